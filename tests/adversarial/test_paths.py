"""Path tricks: nothing but the exact, checked path reaches routing, pricing or the backend.

The attacks come from a real report: ``/v1/./chat/completions`` and ``/v1/x/../chat/completions`` were
priced as a cheap pass-through but served as chat completions by the backend (6,000 tokens in flight
against a 2,000-token budget), and ``/v1/%2e%2e/stats`` reached backend routes outside ``/v1`` carrying
the backend's API key. Every request here goes over a raw socket: client libraries would normalise the
very thing under attack.
"""

from __future__ import annotations

import asyncio
from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from yarl import URL

from gateway.request.paths import path_problem
from loadtest.raw_http import request, send_raw
from tests.conftest import GatewayFactory, StubBackend, stub_pools

TRICKS = [
    "/v1/./chat/completions",
    "/v1/x/../chat/completions",
    "/v1/chat/completions/.",
    "/v1/chat/./completions",
    "/v1/%2e%2e/stats",
    "/v1/%2E%2E/stats",
    "/v1/../x",
    "/v1/..%2fx",
    "/v1/..%2Fstats",
    "/v1/%2e/chat/completions",
    "/v1/chat%2fcompletions",
    "/v1/chat%5ccompletions",
    "/v1//chat/completions",
    "/v1/chat/completions/",
    "/v1/chat/completions%00",
    "/v1/%252e%252e/stats",
    "/v1/%zz/chat",
    "/v1/%2",
    "/v1/x/..",
    "/v1/..",
    "/v1/.%2e/stats",
    "/v1/%c0%ae%c0%ae/stats",
]


@pytest.mark.parametrize("path", TRICKS)
def test_every_trick_path_is_refused_by_the_checker(path: str) -> None:
    assert path_problem(path.encode()) is not None


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/models/org-model_1.5", "/v1/files/file-abc:1", "/", "/v1/a%20b"]
)
def test_ordinary_paths_pass_the_checker(path: str) -> None:
    assert path_problem(path.encode()) is None


_PATH_BYTES = st.binary(max_size=40).map(lambda b: b"/" + b)
_PATH_TEXT = st.lists(
    st.sampled_from(["v1", ".", "..", "", "%2e", "%2E", "%2f", "%5c", "%25", "a", "%41", "x.y", "%"]),
    max_size=8,
).map(lambda parts: ("/" + "/".join(parts)).encode())


@given(st.one_of(_PATH_BYTES, _PATH_TEXT))
def test_an_accepted_path_means_the_same_to_every_resolver(raw: bytes) -> None:
    """Whatever passes has no segment a resolver could collapse, decoded or not, and yarl keeps it."""
    if path_problem(raw) is not None:
        return
    text = raw.decode("ascii")
    decoded = unquote(text)
    assert decoded.count("/") == text.count("/")  # no encoded slash became a separator
    for segment in decoded.split("/")[1:]:
        assert segment not in ("", ".", "..") or decoded == "/"
        assert "\\" not in segment and "\x00" not in segment
    assert URL("http://backend:1" + text, encoded=True).raw_path == text


def budget_config(url: str) -> dict[str, object]:
    return {
        "pools": stub_pools(url),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": 2000}},
        "drain_timeout_s": 1,
    }


@pytest.mark.parametrize("path", TRICKS)
async def test_trick_paths_get_400_and_never_reach_the_backend(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, path: str
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(budget_config(url))
    body = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"max_tokens":900}'
    for method in ("GET", "POST"):
        r = await send_raw(
            gw.url,
            request(
                method, path, body=body if method == "POST" else b"", headers={"authorization": "Bearer k"}
            ),
        )
        assert r is not None and r.status == 400, (method, path, r)
        err = r.json()
        assert isinstance(err, dict) and err["error"]["code"] == "invalid_path"
    assert stub.requests == []
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_dot_segment_chat_cannot_exceed_the_tenants_budget(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    """The reported bypass: 6 concurrent 1,000-token chats through dotted paths on a 2,000 budget."""
    stub, url = stub_backend
    gw = await gateway_factory(budget_config(url))
    body = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"max_tokens":990}'
    paths = ["/v1/./chat/completions", "/v1/x/../chat/completions"] * 3
    answers = await asyncio.gather(
        *(
            send_raw(
                gw.url,
                request("POST", p, body=body, headers={"authorization": "Bearer k", "x-stub-delay": "0.3"}),
            )
            for p in paths
        )
    )
    assert [a.status if a else None for a in answers] == [400] * 6
    assert stub.requests == []


async def test_the_backend_receives_exactly_the_checked_path_and_query(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(budget_config(url))
    body = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'
    target = "/v1/chat/completions?next=%2e%2e/stats&x=%2F"
    r = await send_raw(gw.url, request("POST", target, body=body, headers={"authorization": "Bearer k"}))
    assert r is not None and r.status == 200
    [seen] = stub.requests
    assert seen.path == "/v1/chat/completions"
    assert seen.raw_target == target

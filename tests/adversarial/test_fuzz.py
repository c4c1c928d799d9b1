"""A seeded slice of the fuzzer (``python -m loadtest.fuzz`` runs the long version): every route, every
family of malformed input, over raw sockets, against a gateway in front of the stub backend. No
answer >= 500, no hang, every pool back at 0 and the gateway healthy afterwards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest

from loadtest import fuzz
from tests.conftest import GatewayFactory, StubBackend, stub_pools

pytestmark = pytest.mark.slow


def test_generation_is_deterministic_and_covers_every_family() -> None:
    first = list(fuzz.generate(7, 600))
    assert first == list(fuzz.generate(7, 600))
    families = Counter(c.family.split(" ")[0] for c in first)
    for family in ("mutate", "json", "deep", "method", "path", "content-length", "headers", "body", "header"):
        assert families[family] > 0, family
    assert any(c.family.startswith("chunked") for c in first)


def test_deep_cases_are_deep_json_not_a_string_of_it() -> None:
    # orjson writes a dataclass as an object by itself: the deep family once sent its nesting as a
    # quoted string, and a body the parser takes but cannot write back (a 500) went unnoticed.
    body = orjson.loads(fuzz._dumps({"metadata": fuzz._deep(300)}))
    depth, node = 0, body["metadata"]
    while isinstance(node, list | dict):
        node = node[0] if isinstance(node, list) else node["a"]
        depth += 1
    assert depth == 300


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_seeded_fuzz_slice_finds_no_server_error_and_no_hang(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, seed: int
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url),
            "tenants": {"t": {"keys": ["k"], "budget_tokens": 50_000}},
            "limits": {"body_timeout_s": 2, "body_idle_timeout_s": 1, "header_timeout_s": 2},
            "drain_timeout_s": 1,
        }
    )
    report = await fuzz.run_cases(gw.url, fuzz.generate(seed, 250, api_key="k"), concurrency=8, hang_s=10)
    assert report.cases == 250
    assert report.server_errors == [], fuzz.render(report)
    assert report.hangs == [], fuzz.render(report)
    assert await gw.wait_idle(10) == {name: 0 for name in await gw.in_flight()}
    zero, healthy = await fuzz.check_after(gw.url, "k", gw.ops_url)
    assert zero and healthy


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 4])
async def test_fuzzing_the_admin_api_finds_no_server_error_and_no_hang(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, tmp_path: Path, seed: int
) -> None:
    _, url = stub_backend
    tokens = tmp_path / "tokens"
    tokens.write_text("admin admin-secret\nread read-secret\n")
    gw = await gateway_factory(
        {
            "pools": stub_pools(url),
            "tenants": {"acme": {"keys": ["k"], "budget_tokens": 50_000}},
            "admin": {"tokens_file": str(tokens)},
            "limits": {"body_timeout_s": 2, "body_idle_timeout_s": 1, "header_timeout_s": 2},
        }
    )
    report = await fuzz.run_cases(gw.ops_url, fuzz.generate_admin(seed, 300, "admin-secret"), concurrency=8)
    assert report.cases == 300
    assert report.server_errors == [], fuzz.render(report)
    assert report.hangs == [], fuzz.render(report)
    zero, healthy = await fuzz.check_after(gw.url, "k", gw.ops_url, serve_check=False)
    assert zero and healthy
    async with httpx.AsyncClient(base_url=gw.ops_url, headers={"authorization": "Bearer admin-secret"}) as c:
        assert (await c.get("/admin/v1/state")).status_code == 200  # still answering


@pytest.mark.soak
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_spawned_stack_is_fuzzed_on_either_store(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `python -m loadtest.fuzz --spawn [--store redis]`: tokengate serve as a child process, its
    # budgets in memory or in a redis-server of its own (the Lua gets the hostile requests too).
    report = tmp_path / "report.json"
    code = fuzz.main(["--spawn", "--store", store, "--cases", "80", "--seed", "3", "--json", str(report)])
    assert code == 0, capsys.readouterr().out
    data = orjson.loads(report.read_bytes())
    assert data["passed"] and data["pools_at_zero"] and data["healthy_after"] and data["cases"] == 80

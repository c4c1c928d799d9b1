"""The split advice of /insights, applied as it is printed: long and short requests then reach
different pools (a new user's first split, with no class rules configured)."""

from __future__ import annotations

import httpx
import yaml

from tests.conftest import GatewayFactory, StubBackend, serve_asgi, stub_pools
from tests.gateway.gw_support import chat
from tests.support import eventually


async def test_the_proposed_split_sends_long_and_short_requests_to_different_pools(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    first, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=200_000),
            # Readings are recomputed once per window: short windows, so the test need not wait long.
            "observability": {"window_s": 0.1, "shape": {"min_requests": 20}},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url) as c:
        for i in range(30):
            assert (await c.post("/v1/chat/completions", json=chat(max_tokens=10))).status_code == 200
            if i % 10 == 0:  # a few requests hundreds of times larger
                r = await c.post("/v1/chat/completions", json=chat(max_tokens=20_000))
                assert r.status_code == 200
        proposed = ""

        async def advised() -> bool:
            nonlocal proposed
            proposed = (await c.get(gw.ops_url + "/insights", params={"format": "yaml"})).text
            return "no pool needs a split" not in proposed

        await eventually(advised, timeout_s=5, interval_s=0.05, message="no split advice")
    edit = yaml.safe_load(proposed)
    assert isinstance(edit, dict) and edit["classes"], proposed  # a rule routes to the new pool

    second = StubBackend()
    served = await serve_asgi(second)
    try:
        for spec in edit["pools"].values():
            for b in spec["backends"]:
                if "CHANGE-ME" in b["url"]:  # the one line the advice asks the operator to fill in
                    b["url"] = served.url
        split = await gateway_factory({"pools": edit["pools"], "classes": edit["classes"]})
        first.requests.clear()
        async with httpx.AsyncClient(base_url=split.url) as c:
            short = await c.post("/v1/chat/completions", json=chat(max_tokens=10))
            long = await c.post("/v1/chat/completions", json=chat(max_tokens=20_000))
        assert short.status_code == 200 and long.status_code == 200
        assert [r.body["max_tokens"] for r in first.requests] == [10]
        assert [r.body["max_tokens"] for r in second.requests] == [20_000]
        assert short.headers["x-tokengate-class"] != long.headers["x-tokengate-class"]
    finally:
        await served.stop()

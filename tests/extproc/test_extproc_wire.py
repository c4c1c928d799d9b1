"""The processor's side of Envoy's stream, driven message by message by a gRPC client playing
Envoy: orders of events a real Envoy produces only now and then, made to happen every time.

Envoy closes the processor's stream as soon as it has the answer to the response's last message,
while the request may still be finishing (its last answer being written, usage settled, tokens
released): that close is the exchange done, never the client gone. A stream closed before the
response's end is the client gone: the request is a 499 and releases its tokens."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import orjson
import pytest

from gateway.extproc.server import METHOD, SERVICE
from gateway.extproc.wire_pb2 import (
    HeaderMap,
    HeaderValue,
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from gateway.observe.accesslog import Record
from tests.budgets.support import assert_idle
from tests.extproc.support import Processor, in_process
from tests.support import eventually

TENANTS = {"a": {"keys": ["sk-a"], "budget_tokens": 5000}}
# Never called: this test answers for the backend, as Envoy relays it.
POOLS = {"chat": {"backends": [{"url": "http://127.0.0.1:9", "capacity_tokens": 10_000, "probe": "off"}]}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def headers(pairs: dict[str, str], end: bool = False) -> HttpHeaders:
    return HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=end,
    )


REQUEST = ProcessingRequest(
    request_headers=headers(
        {
            ":method": "POST",
            ":path": "/v1/chat/completions",
            ":scheme": "http",
            ":authority": "gw",
            "authorization": "Bearer sk-a",
            "content-type": "application/json",
        }
    )
)
BODY = ProcessingRequest(request_body=HttpBody(body=orjson.dumps(CHAT), end_of_stream=True))
RESPONSE = ProcessingRequest(response_headers=headers({":status": "200", "content-type": "application/json"}))
ANSWER = {"id": "x", "object": "chat.completion", "choices": [], "usage": USAGE}


class FakeEnvoy:
    """One ext_proc stream, sent and read message by message."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def ask(self, msg: ProcessingRequest) -> ProcessingResponse:
        await self.call.write(msg)
        answer: ProcessingResponse = await self.call.read()
        return answer


@contextlib.asynccontextmanager
async def processor_and_envoy() -> AsyncIterator[tuple[Processor, list[Record], Any]]:
    async with in_process({"tenants": TENANTS, "pools": POOLS}) as p:
        records: list[Record] = []
        p.gateway.request_hooks.append(lambda rec, _end: records.append(rec))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{p.grpc_port}") as channel:
            process = channel.stream_stream(
                f"/{SERVICE}/{METHOD}",
                request_serializer=ProcessingRequest.SerializeToString,
                response_deserializer=ProcessingResponse.FromString,
            )
            yield p, records, process


async def admitted(process: Any) -> FakeEnvoy:
    envoy = FakeEnvoy(process())
    assert (await envoy.ask(REQUEST)).WhichOneof("response") == "request_headers"
    let_go = await envoy.ask(BODY)
    assert let_go.WhichOneof("response") == "request_body"  # admitted: sent on to its pool
    assert (await envoy.ask(RESPONSE)).WhichOneof("response") == "response_headers"
    return envoy


async def ended(p: Processor, records: list[Record]) -> Record:
    await eventually(lambda: len(records) == 1, timeout_s=5, message="the request did not end")
    await assert_idle(p.gateway.store)
    return records[0]


async def test_envoy_closing_the_stream_right_after_the_responses_end_is_a_completed_request() -> None:
    async with processor_and_envoy() as (p, records, process):
        envoy = await admitted(process)
        last = ProcessingRequest(response_body=HttpBody(body=orjson.dumps(ANSWER), end_of_stream=True))
        await envoy.call.write(last)
        await envoy.call.done_writing()  # closed before the answer is even read
        assert (await envoy.call.read()).WhichOneof("response") == "response_body"
        rec = await ended(p, records)
    assert (rec.status, rec.outcome) == (200, "ok")
    assert (rec.prompt_tokens, rec.completion_tokens, rec.usage_estimated) == (7, 3, False)
    [backend] = list(p.gateway.router.backends)
    assert (backend.usage_reported, backend.usage_missing) == (1, 0)


async def test_the_stream_closed_before_the_responses_end_is_the_client_gone() -> None:
    async with processor_and_envoy() as (p, records, process):
        envoy = await admitted(process)
        part = ProcessingRequest(response_body=HttpBody(body=b'{"id": "x", ', end_of_stream=False))
        assert (await envoy.ask(part)).WhichOneof("response") == "response_body"
        await envoy.call.done_writing()
        rec = await ended(p, records)
    assert (rec.status, rec.outcome) == (499, "client_disconnect")


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def delta(text: str, finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return {"id": "x", "object": "chat.completion.chunk", "choices": [choice]}


STREAM = ProcessingRequest(response_headers=headers({":status": "200", "content-type": "text/event-stream"}))
USAGE_EVENT = {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": USAGE}


async def test_a_stream_reset_after_its_done_line_is_a_completed_request_with_its_usage() -> None:
    """What the SDK does: it closes the stream when it reads [DONE], before the response's end
    reaches Envoy, which then resets the processor's stream. Usage is counted once: the engine's,
    or where it sent none, the estimate."""
    for events, usage, estimated in (
        ((delta("a"), delta("b"), delta("c", "stop"), USAGE_EVENT), (7, 3), False),
        ((delta("a"), delta("b", "stop")), None, True),
    ):
        async with processor_and_envoy() as (p, records, process):
            envoy = FakeEnvoy(process())
            await envoy.ask(REQUEST)
            await envoy.ask(BODY)
            assert (await envoy.ask(STREAM)).WhichOneof("response") == "response_headers"
            body = ProcessingRequest(response_body=HttpBody(body=sse(*events), end_of_stream=False))
            assert (await envoy.ask(body)).WhichOneof("response") == "response_body"
            envoy.call.cancel()
            rec = await ended(p, records)
            [backend] = list(p.gateway.router.backends)
        assert (rec.status, rec.outcome, rec.usage_estimated) == (200, "ok", estimated)
        if usage is not None:
            assert (rec.prompt_tokens, rec.completion_tokens) == usage
            assert (backend.usage_reported, backend.usage_missing) == (1, 0)
        else:
            assert rec.prompt_tokens == rec.prefill and rec.completion_tokens == 2  # one per output event
            assert (backend.usage_reported, backend.usage_missing) == (0, 1)


async def test_a_reset_after_the_responses_last_message_before_its_answer_ends_the_request_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client goes while the processor reads the response's last message: Envoy resets the
    stream before the answer can be written. The backend's work is done and counted; the failed
    write is no error of the gateway's."""
    async with processor_and_envoy() as (p, records, process):
        envoy = await admitted(process)
        last = ProcessingRequest(response_body=HttpBody(body=orjson.dumps(ANSWER), end_of_stream=True))
        await envoy.call.write(last)
        envoy.call.cancel()
        rec = await ended(p, records)
    assert rec.status in (200, 499) and rec.outcome in ("ok", "client_disconnect")
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text

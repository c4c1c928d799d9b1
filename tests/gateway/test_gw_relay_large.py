"""A large non-streamed answer (a long generation with logprobs runs to hundreds of MB) is relayed as
it arrives, byte for byte, and its usage still read, without the gateway ever holding it whole."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import orjson
import pytest

from gateway.request.errors import AnswerCut
from gateway.upstream.relay import usage_in_tail
from tests.conftest import GatewayFactory, serve_asgi, stub_pools

USAGE = {"prompt_tokens": 9, "completion_tokens": 1234, "total_tokens": 1243, "details": {"cached": 0}}


def answer(size: int) -> bytes:
    """A chat completion of about ``size`` bytes, usage after the choices as engines write it."""
    text = "tok " * (size // 4)
    body = {"id": "big", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": text}}]}
    return orjson.dumps(body | {"usage": USAGE, "kv_transfer_params": None})


class HalfThenRest:
    """A backend that sends the first half of a large answer, then waits to be let go."""

    def __init__(self, data: bytes, chunked: bool) -> None:
        self.data = data
        self.chunked = chunked
        self.go = asyncio.Event()
        self.upstream_gone = asyncio.Event()  # the gateway closed the connection mid-answer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] != "/v1/chat/completions":  # health probes, /v1/models
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"data": []}'})
            return
        headers = [(b"content-type", b"application/json")]
        if not self.chunked:
            headers.append((b"content-length", str(len(self.data)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        half = len(self.data) // 2
        await send({"type": "http.response.body", "body": self.data[:half], "more_body": True})
        waiting = asyncio.ensure_future(self.go.wait())
        gone = asyncio.ensure_future(receive())  # http.disconnect, when the gateway hangs up
        await asyncio.wait([waiting, gone], return_when=asyncio.FIRST_COMPLETED)
        if gone.done() and gone.result()["type"] == "http.disconnect":
            self.upstream_gone.set()
            waiting.cancel()
            return
        gone.cancel()
        await send({"type": "http.response.body", "body": self.data[half:], "more_body": False})


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_large_answer_is_relayed_as_it_arrives_with_its_usage_read(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture, chunked: bool
) -> None:
    data = answer(6 << 20)
    backend = HalfThenRest(data, chunked)
    served = await serve_asgi(backend)
    caplog.set_level(logging.INFO, logger="tokengate.access")
    try:
        gw = await gateway_factory({"pools": stub_pools(served.url, capacity=10**6)})
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                parts = r.aiter_raw()
                got = b""
                while len(got) <= (2 << 20):  # more than the gateway would hold back to read whole
                    got += await anext(parts)
                assert not backend.go.is_set()  # all of that came before the backend sent the rest
                backend.go.set()
                async for part in parts:
                    got += part
        assert got == data
        line = orjson.loads(
            [rec.getMessage() for rec in caplog.records if rec.name == "tokengate.access"][-1]
        )
        assert (line["prompt_tokens"], line["completion_tokens"]) == (9, 1234)
        assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
    finally:
        backend.go.set()
        await served.stop()


@pytest.mark.parametrize(
    ("tail", "usage"),
    [
        (
            b'..."}],"usage":{"prompt_tokens":1,"completion_tokens":2}}',
            {"prompt_tokens": 1, "completion_tokens": 2},
        ),
        (b'"usage": {"a": {"b": 1}, "s": "}{"}, "x": 1}', {"a": {"b": 1}, "s": "}{"}),
        (b'"content": "say \\"usage\\":{\\"completion_tokens\\":0}"}', None),  # inside a string: not a key
        (b'"usage":{"prompt_tokens":1', None),  # cut short
        (b'"usage":{"a":tru}', None),  # not JSON
        (b"no usage here", None),
    ],
)
def test_usage_is_found_in_the_tail_only_as_a_key(tail: bytes, usage: Any) -> None:
    assert usage_in_tail(tail) == usage


async def test_a_client_gone_half_way_through_a_large_answer_releases_and_closes_upstream(
    gateway_factory: GatewayFactory,
) -> None:
    backend = HalfThenRest(answer(6 << 20), chunked=False)
    served = await serve_asgi(backend)
    try:
        gw = await gateway_factory({"pools": stub_pools(served.url, capacity=10**6)})
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                parts = r.aiter_raw()
                got = 0
                while got <= (2 << 20):
                    got += len(await anext(parts))
            # the client is gone, with the backend still holding the second half
        assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
        await asyncio.wait_for(backend.upstream_gone.wait(), timeout=10)  # the gateway hung up on it
    finally:
        backend.go.set()
        await served.stop()


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class HalfThenDrop(HalfThenRest):
    """Sends half of a large answer, then drops the connection (a backend that crashed mid-answer)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            while (await receive()).get("more_body"):
                pass
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.data)).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send(
                {"type": "http.response.body", "body": self.data[: len(self.data) // 2], "more_body": True}
            )
            await asyncio.sleep(0.05)
            raise RuntimeError("backend crashed at 10.9.8.7:8000")  # uvicorn aborts the connection
        await super().__call__(scope, receive, send)


async def test_a_backend_gone_half_way_through_a_large_answer_cuts_the_answer_and_leaks_nothing(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    backend = HalfThenDrop(answer(6 << 20), chunked=False)
    served = await serve_asgi(backend)
    caplog.set_level(logging.INFO, logger="tokengate.access")
    server_errors = Kept()  # uvicorn's own loggers do not propagate to caplog
    try:
        gw = await gateway_factory({"pools": stub_pools(served.url, capacity=10**6)})
        logging.getLogger("uvicorn.error").addHandler(server_errors)  # (after the servers set up logging)
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
        got = b""
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            with pytest.raises(httpx.HTTPError):  # the answer ends short: the client cannot take it as whole
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for part in r.aiter_raw():
                        got += part
        assert 0 < len(got) < len(backend.data)
        assert b"10.9.8.7" not in got and b"crashed" not in got
        assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
        line = orjson.loads(
            [rec.getMessage() for rec in caplog.records if rec.name == "tokengate.access"][-1]
        )
        assert line["outcome"] == "upstream_error"
        # the cut is the access line's to report, not a traceback in the server's error log
        # (the backend's own crash is logged by its server: that one is the test's, not the gateway's)
        assert not [r for r in server_errors.records if r.exc_info and isinstance(r.exc_info[1], AnswerCut)]
    finally:
        logging.getLogger("uvicorn.error").removeHandler(server_errors)
        await served.stop()

"""The reference backend: an OpenAI-compatible server around the continuous-batching engine.

``build_app(BackendSettings(...))`` returns a Starlette app whose lifespan starts and stops the
engine loop; it can be served by its own uvicorn (``tokengate backend``) or embedded in another
app's event loop (the gateway's default backend). Routes: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/embeddings`` (deterministic test vectors, see ``embeddings.py``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``; any other route is a 404 in OpenAI's error shape.

Benchmarks only: ``tokengate_stop_after: N`` in a body ends the answer after N tokens as at an EOS
(``protocol.py``), so a load test can send realistic ``max_tokens`` and still replay real lengths.

Requests are priced exactly as the gateway prices them: the gateway's default tokenizer (cl100k
offline) and the chat template in ``chat_template.py``. A client that disconnects (streaming or
not) has its request aborted at once and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from backends.engine.async_engine import AsyncEngine, EngineDeadError
from backends.engine.clock import RealClock
from backends.engine.engine import Engine, RequestOutput
from backends.engine.factory import build_executor
from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler
from backends.engine.types import SamplingParams, TextTokenizer
from backends.reference.chat_template import render_chat
from backends.reference.embeddings import embeddings_body, parse_embeddings
from backends.reference.errors import ApiError, bad_request, error_response
from backends.reference.metrics import EngineMetrics
from backends.reference.protocol import GenerationParams, parse_chat, parse_completion
from backends.reference.settings import BackendSettings
from backends.reference.streaming import DONE, Kind, SseFrames, error_frame, full_response
from backends.reference.tokenizer import default_tokenizer

log = logging.getLogger("tokengate.backend")


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _AbortingStreamingResponse(StreamingResponse):
    """Streams SSE and, whatever ends the stream (done, client gone, error), runs ``on_close``.

    It watches for the client's disconnect itself instead of relying on the server noticing on
    the next write: a request still queued in the engine writes nothing for a long time.
    """

    body_iterator: AsyncGenerator[bytes, None]

    def __init__(self, content: AsyncGenerator[bytes, None], on_close: Callable[[], object]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((stream, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            stream.cancel()
            self._on_close()
            for task in (stream, watch):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task

    async def _stream(self, send: Send) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.body_iterator.aclose()


class ReferenceBackend:
    """Holds one app's engine, tokenizer and metrics; its methods are the HTTP handlers."""

    def __init__(self, settings: BackendSettings) -> None:
        self.settings = settings
        self.model = settings.model
        self.created = int(time.time())
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, settings.model)
        executor = build_executor(settings.executor_settings())
        tokenizer = executor.tokenizer
        self.tokenizer: TextTokenizer = tokenizer if tokenizer is not None else default_tokenizer()
        config = settings.scheduler_config()
        self.scheduler = Scheduler(
            config, BlockManager(executor.num_blocks, executor.block_size), executor.eos_token_id
        )
        self.engine = Engine(
            self.scheduler, executor, RealClock(), decoder=self.tokenizer, observer=self.metrics
        )
        self.metrics.bind_scheduler(self.scheduler)
        self.metrics.publish_config(self.scheduler.config, self.scheduler.blocks)
        sim = settings.executor == "sim"
        self.async_engine = AsyncEngine(
            self.engine, simulate_time=sim, time_scale=settings.time_scale, offload=not sim
        )

    async def start(self) -> None:
        await self.async_engine.start()

    async def stop(self) -> None:
        await self.async_engine.stop()

    # ---- routes ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.async_engine.running else 503)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "tokengate",
            "root": self.model,
            "parent": None,
            "max_model_len": self.settings.max_model_len,
        }
        return Response(orjson.dumps({"object": "list", "data": [card]}), media_type="application/json")

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def chat_completions(self, request: Request) -> Response:
        try:
            chat = parse_chat(await _json_body(request))
            self._check_model(chat.params.model)
            prompt_ids = self.tokenizer.encode(render_chat(chat.messages))
            return await self._generate("chat", request, chat.params, prompt_ids, "messages")
        except ApiError as exc:
            return exc.response()

    async def completions(self, request: Request) -> Response:
        try:
            comp = parse_completion(await _json_body(request))
            self._check_model(comp.params.model)
            prompt = comp.prompt
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            return await self._generate("completion", request, comp.params, prompt_ids, "prompt")
        except ApiError as exc:
            return exc.response()

    async def embeddings(self, request: Request) -> Response:
        try:
            req = parse_embeddings(await _json_body(request))
            self._check_model(req.model)
            body = embeddings_body(req, self.tokenizer.encode, self.settings.max_model_len)
            return Response(orjson.dumps(body), media_type="application/json")
        except ApiError as exc:
            return exc.response()

    # ---- internals ---------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise ApiError(
                404, f"The model `{model}` does not exist; this server serves `{self.model}`.", param="model",
                code="model_not_found",
            )  # fmt: skip

    def _engine_request(
        self, request_id: str, params: GenerationParams, prompt_ids: list[int], prompt_param: str
    ) -> EngineRequest:
        max_len = self.settings.max_model_len
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise bad_request("the prompt is empty", prompt_param)
        if n_prompt >= max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                f"{n_prompt} tokens. Please reduce the length of the {prompt_param}.",
                prompt_param,
                "context_length_exceeded",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n_prompt
        if n_prompt + max_tokens > max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or of max_tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        if params.priority != 0 and self.settings.scheduling_policy != "priority":
            raise bad_request(
                "priority is not supported: this server runs the fcfs scheduling policy "
                "(start it with --scheduling-policy priority)",
                "priority",
            )
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed),
            stop=params.stop,
            ignore_eos=params.ignore_eos,
            stop_after=params.stop_after,
            priority=params.priority,
        )

    async def _generate(
        self, kind: Kind, request: Request, params: GenerationParams, prompt_ids: list[int], prompt_param: str
    ) -> Response:
        response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        ereq = self._engine_request(response_id, params, prompt_ids, prompt_param)
        try:
            outputs = self.async_engine.generate(ereq)
        except EngineDeadError as exc:
            return error_response(503, str(exc))
        except ValueError as exc:
            raise bad_request(str(exc), prompt_param) from exc
        created = int(time.time())
        if params.stream:
            frames = SseFrames(kind, response_id, created, self.model, params.include_usage)
            body = _sse_body(kind, frames, outputs, len(prompt_ids), params.include_usage)
            return _AbortingStreamingResponse(body, on_close=lambda: self.async_engine.abort(response_id))
        return await self._respond_whole(kind, request, response_id, created, outputs, len(prompt_ids))

    async def _respond_whole(
        self,
        kind: Kind,
        request: Request,
        response_id: str,
        created: int,
        outputs: AsyncIterator[RequestOutput],
        n_prompt: int,
    ) -> Response:
        collect = asyncio.ensure_future(_collect(outputs))
        watch = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait((collect, watch), return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return Response(status_code=499)  # the client is gone; nobody reads this
            try:
                text, reason, n_out = collect.result()
            except EngineDeadError as exc:
                return error_response(500, str(exc))
        finally:
            watch.cancel()
            collect.cancel()
            self.async_engine.abort(response_id)
        body = full_response(kind, response_id, created, self.model, text, reason, n_prompt, n_out)
        return Response(body, media_type="application/json")


async def _collect(outputs: AsyncIterator[RequestOutput]) -> tuple[str, str | None, int]:
    parts: list[str] = []
    reason: str | None = None
    n_out = 0
    async for out in outputs:
        parts.append(out.text)
        reason = out.finish_reason
        n_out = out.num_output_tokens
    return "".join(parts), reason, n_out


async def _sse_body(
    kind: Kind, frames: SseFrames, outputs: AsyncIterator[RequestOutput], n_prompt: int, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    # The chat role chunk goes out with the first token, after prefill, as vLLM does: sending it
    # at once would make time-to-first-byte hide exactly the prefill stalls a gateway must see.
    role_pending = kind == "chat"
    n_out = 0
    try:
        async for out in outputs:
            if role_pending:
                role_pending = False
                yield frames.role()
            n_out = out.num_output_tokens
            if out.finished:
                yield frames.finish(out.text, out.finish_reason or "stop")
            elif out.text:
                yield frames.text(out.text)
    except EngineDeadError as exc:
        yield error_frame(str(exc))
        yield DONE
        return
    if role_pending:
        yield frames.role()
    if include_usage:
        yield frames.usage(n_prompt, n_out)
    yield DONE


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(
            404,
            f"Unknown route {request.method} {request.url.path}: this reference backend serves "
            "/v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models",
            code="unknown_route",
        )
    return error_response(exc.status_code, str(exc.detail))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(500, "internal server error")


def build_app(settings: BackendSettings | None = None) -> Starlette:
    """The reference backend as an ASGI app; the engine runs while the app's lifespan does.

    ``app.state.backend`` is the ``ReferenceBackend`` (engine, scheduler, metrics) for embedding
    and tests.
    """
    backend = ReferenceBackend(settings or BackendSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", backend.chat_completions, methods=["POST"]),
            Route("/v1/completions", backend.completions, methods=["POST"]),
            Route("/v1/embeddings", backend.embeddings, methods=["POST"]),
            Route("/v1/models", backend.models, methods=["GET"]),
            Route("/health", backend.health, methods=["GET"]),
            Route("/metrics", backend.metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.backend = backend
    return app

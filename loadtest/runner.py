"""Open-loop runner: sends each planned request at its scheduled time, whatever the others are doing.

One shared aiohttp session; streaming requests measure time to first token, the gaps between
content chunks and end-to-end time. Requests ask for ``max_tokens`` = the planned output length with
``ignore_eos: true`` so the backend generates exactly that many tokens (the reference backend and vLLM
honour ``ignore_eos``; other servers may stop early at EOS, which shows as fewer completion tokens).
With ``send_max_tokens`` a number or ``none`` they send that instead (what real clients send) and the
planned length as ``tokengate_stop_after`` (the reference backend's benchmark-only field: the answer
ends there as at an EOS). Every request carries ``x-tokengate-oracle-output: <planned output>``, for a
gateway's oracle arm (``reservation.oracle_header``); other servers ignore the header.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from loadtest.progress import Progress
from loadtest.prompts import PromptFactory
from loadtest.records import RequestRecord, RunResult
from loadtest.schedule import PlannedRequest
from loadtest.spec import SendMaxTokens


@dataclass(frozen=True)
class Target:
    """One column of a comparison: where to send (one base URL, or several used round-robin) and,
    optionally, which part of the plan (``without`` some classes, only the requests planned inside
    ``window``; a window run starts at the window's start, and times stay in plan time)."""

    name: str
    base_urls: tuple[str, ...]
    api_key: str | None = None  # overrides the tenants' keys (e.g. one key for a hosted endpoint)
    without: frozenset[str] = frozenset()
    window: tuple[float, float] | None = None

    def url_for(self, index: int, path: str) -> str:
        return self.base_urls[index % len(self.base_urls)].rstrip("/") + path


@dataclass(frozen=True)
class RunOptions:
    model: str = "tokengate-sim"
    endpoint: str = "chat"  # or "completions"
    stream: bool = True
    ignore_eos: bool = True
    duration_s: float | None = None  # no request is sent after this; None → the plan's own horizon
    max_requests: int | None = None
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    drain_timeout_s: float = 120.0  # after the last send, wait this long for in-flight requests
    chat_overhead_tokens: int = 7
    send_max_tokens: SendMaxTokens = "planned"
    progress: bool = False


_GATEWAY_HEADERS = ("x-tokengate-class", "x-tokengate-cost", "x-tokengate-queue-ms")


def sent_max_tokens(req: PlannedRequest, options: RunOptions) -> int | None:
    """What the request asks for as max_tokens (None: the field is left out)."""
    limit = options.send_max_tokens
    if limit == "planned":
        return req.output_tokens
    return None if limit == "none" else limit


def _body(req: PlannedRequest, prompts: PromptFactory, options: RunOptions) -> tuple[str, bytes]:
    body: dict[str, object] = {"model": options.model}
    limit = sent_max_tokens(req, options)
    if limit is not None:
        body["max_tokens"] = limit
    if options.send_max_tokens != "planned":
        body["tokengate_stop_after"] = req.output_tokens
    body["stream"] = options.stream
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    if options.endpoint == "chat":
        text = prompts.text(req.prompt_tokens - options.chat_overhead_tokens, req.seed)
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompts.text(req.prompt_tokens, req.seed)
        path = "/v1/completions"
    return path, orjson.dumps(body)


def _content_of(chunk: dict[str, object]) -> str | None:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    first = choices[0]
    if not isinstance(first, dict):
        return None
    delta = first.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
        return content if isinstance(content, str) else None
    text = first.get("text")
    return text if isinstance(text, str) else None


def _record_gateway_headers(rec: RequestRecord, headers: Mapping[str, str]) -> None:
    cls, cost, queue_ms = (headers.get(h) for h in _GATEWAY_HEADERS)
    rec.gateway_class = cls
    try:
        rec.gateway_cost = int(cost) if cost is not None else None
        rec.gateway_queue_ms = float(queue_ms) if queue_ms is not None else None
    except ValueError:
        pass


def _record_usage(rec: RequestRecord, usage: object) -> None:
    if isinstance(usage, dict):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            rec.prompt_tokens = prompt
        if isinstance(completion, int):
            rec.completion_tokens = completion


async def _consume_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, clock: _Clock) -> None:
    done = False
    usage_seen = False
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            # The answer is complete; keep reading to the end of the body (the chunked-encoding
            # terminator) so the connection goes back to the pool instead of being torn down,
            # which a gateway would log as a client disconnect.
            done = True
            rec.e2e_s = clock.now() - rec.sent_s
            continue
        if done:
            continue
        chunk = orjson.loads(payload)
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            rec.error = "stream_error"
            rec.detail = str(chunk["error"])[:200]
            return
        if _content_of(chunk):
            now = clock.now()
            if rec.ttft_s is None:
                rec.ttft_s = now - rec.sent_s
            rec.token_times.append(now)
        if chunk.get("usage"):
            usage_seen = True
            _record_usage(rec, chunk["usage"])
    if not done:
        rec.error = "incomplete"
    if not usage_seen:
        rec.completion_tokens = len(rec.token_times)


async def _consume_json(resp: aiohttp.ClientResponse, rec: RequestRecord, clock: _Clock) -> None:
    body = orjson.loads(await resp.read())
    now = clock.now()
    rec.ttft_s = now - rec.sent_s  # without streaming the first token arrives with the last
    rec.token_times.append(now)
    _record_usage(rec, body.get("usage") if isinstance(body, dict) else None)


class _Clock:
    """Seconds of plan time; a run over a window starts at the window's start, not at 0."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._loop = asyncio.get_running_loop()
        self.t0 = self._loop.time() - start_s

    def now(self) -> float:
        return self._loop.time() - self.t0


async def _send(
    session: aiohttp.ClientSession,
    req: PlannedRequest,
    rec: RequestRecord,
    path: str,
    body: bytes,
    api_key: str,
    options: RunOptions,
    clock: _Clock,
) -> None:
    headers = {
        "Authorization": f"Bearer {api_key}",
        "Content-Type": "application/json",
        "x-tokengate-oracle-output": str(req.output_tokens),
    }
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s, sock_connect=options.connect_timeout_s)
    rec.sent_s = clock.now()
    try:
        async with session.post(rec.url, data=body, headers=headers, timeout=timeout) as resp:
            rec.status = resp.status
            _record_gateway_headers(rec, resp.headers)
            if resp.status != 200:
                rec.error = f"http_{resp.status}"
                rec.detail = (await resp.read())[:300].decode("utf-8", "replace")
            elif options.stream:
                await _consume_stream(resp, rec, clock)
            else:
                await _consume_json(resp, rec, clock)
    except aiohttp.ClientConnectorError as exc:
        rec.error, rec.detail = "connect", str(exc)[:200]
    except TimeoutError:
        rec.error = "timeout"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        rec.error, rec.detail = "disconnected", str(exc)[:200]
    except aiohttp.ClientError as exc:
        rec.error, rec.detail = "client_error", str(exc)[:200]
    except orjson.JSONDecodeError as exc:
        rec.error, rec.detail = "bad_json", str(exc)[:200]
    except asyncio.CancelledError:
        rec.error = "cancelled"
        raise
    finally:
        if rec.e2e_s is None or rec.error is not None:
            rec.e2e_s = clock.now() - rec.sent_s


def bounded_plan(
    plan: Sequence[PlannedRequest], options: RunOptions, target: Target | None = None
) -> list[PlannedRequest]:
    """The requests a run will send: those before ``duration_s``, at most ``max_requests``, and the
    target's part of the plan."""
    out = [r for r in plan if options.duration_s is None or r.at_s < options.duration_s]
    out = out[: options.max_requests] if options.max_requests is not None else out
    if target is not None and target.without:
        out = [r for r in out if r.cls not in target.without]
    if target is not None and target.window is not None:
        start, end = target.window
        out = [r for r in out if start <= r.at_s < end]
    return out


def make_session(limit: int = 0) -> aiohttp.ClientSession:
    """The one client session of a run: no connection cap (open loop), no cookie jar, no auto headers."""
    connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300, keepalive_timeout=30)
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
        json_serialize=lambda o: orjson.dumps(o).decode(),
    )


async def run_plan(
    plan: Sequence[PlannedRequest],
    target: Target,
    prompts: PromptFactory,
    options: RunOptions,
    session: aiohttp.ClientSession | None = None,
) -> RunResult:
    """Runs the plan open-loop against ``target``; never raises for request failures (they are recorded)."""
    todo = bounded_plan(plan, options, target)
    start_s = target.window[0] if target.window is not None else 0.0
    prompts.prebuild(
        [r.prompt_tokens - options.chat_overhead_tokens for r in todo] + [r.prompt_tokens for r in todo]
    )
    own_session = session is None
    active = session if session is not None else make_session()
    horizon = options.duration_s if options.duration_s is not None else (todo[-1].at_s if todo else 0.0)
    if target.window is not None:
        horizon = min(horizon, target.window[1])
    progress = Progress(target.name, len(todo), horizon, options.progress)
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task[None]] = set()
    started_unix = time.time()
    clock = _Clock(start_s)

    async def ticker() -> None:
        while True:
            done = sum(1 for r in records if r.e2e_s is not None)
            errors = sum(1 for r in records if r.e2e_s is not None and r.error is not None)
            progress.update(clock.now(), len(records), done, errors, len(tasks))
            await asyncio.sleep(0.5)

    ticker_task = asyncio.create_task(ticker())
    try:
        for req in todo:
            delay = req.at_s - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            path, body = _body(req, prompts, options)
            rec = RequestRecord(
                index=req.index,
                cls=req.cls,
                group=req.group,
                tenant=req.tenant,
                url=target.url_for(req.index, path),
                planned_prompt_tokens=req.prompt_tokens,
                max_tokens=sent_max_tokens(req, options),
                planned_output_tokens=req.output_tokens,
                scheduled_s=req.at_s,
            )
            records.append(rec)
            key = target.api_key or req.api_key
            task = asyncio.create_task(_send(active, req, rec, path, body, key, options, clock))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=options.drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        # Reached on Ctrl-C too: cancel everything in flight so sockets close and backends abort.
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        ticker_task.cancel()
        await asyncio.gather(ticker_task, return_exceptions=True)
        progress.update(clock.now(), len(records), len(records), sum(1 for r in records if r.error), 0)
        progress.close()
        if own_session:
            await active.close()
    ends = [r.end_s for r in records if r.end_s is not None]
    return RunResult(
        target=target.name,
        base_urls=target.base_urls,
        records=records,
        elapsed_s=max(ends) - start_s if ends else 0.0,
        planned=len(todo),
        started_unix=started_unix,
    )

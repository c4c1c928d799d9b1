"""Logs: every line one JSON object (uvicorn's too), or text for humans; one access line per request
with its request id (made here, or a trusted client's), forwarded upstream and returned to the client."""

from __future__ import annotations

import io
import logging
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.observe import accesslog
from gateway.observe.accesslog import Record
from gateway.process.logs import JsonFormatter, TextFormatter
from gateway.request.requestid import new_id
from tests.conftest import GatewayFactory, StubBackend, stub_pools
from tests.gateway.gw_support import access_lines, chat

# UUID-shaped (version 4): engines that validate the header as a UUID take it.
OUR_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


async def test_every_answer_carries_the_request_id_the_backend_and_the_access_line_see(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url), "tenants": {"acme": {"keys": ["sk-acme"]}}})
    caplog.set_level(logging.INFO, logger="tokengate.access")
    auth = {"authorization": "Bearer sk-acme"}
    async with httpx.AsyncClient(base_url=gw.url) as c:
        ok = await c.post("/v1/chat/completions", json=chat(max_tokens=3), headers=auth)
        stream = await c.post("/v1/chat/completions", json=chat(stream=True, max_tokens=3), headers=auth)
        refused = await c.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer nope"})
        unrouted = await c.post("/v1/nothing", json={}, headers=auth)
        models = await c.get("/v1/models", headers=auth)
    answers = [ok, stream, refused, unrouted, models]
    assert [r.status_code for r in answers] == [200, 200, 401, 404, 200]
    ids = [r.headers["x-request-id"] for r in answers]
    assert all(OUR_ID.fullmatch(i) for i in ids) and len(set(ids)) == 5
    assert [r.headers["x-request-id"] for r in stub.requests] == ids[:2]  # forwarded upstream
    lines = access_lines(caplog)
    assert [line["request_id"] for line in lines] == ids  # one line per request, the same id
    first = lines[0]
    assert {"timestamp", "level", "logger", "message"} <= set(first)
    assert first["logger"] == "tokengate.access" and first["level"] == "info"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["timestamp"])
    assert (first["tenant"], first["class"], first["pool"], first["status"]) == (
        "acme",
        "default",
        "default",
        200,
    )
    assert first["backend"] == url and first["cost"] == first["prefill"] + first["decode"] == int(
        ok.headers["x-tokengate-cost"]
    )
    assert first["queue_ms"] is not None and first["reason"] is None and first["client_request_id"] is None
    assert lines[1]["ttft_ms"] is not None
    assert (lines[2]["status"], lines[2]["reason"]) == (401, "invalid_api_key")
    assert (lines[3]["status"], lines[3]["reason"]) == (404, "unknown_route")
    assert "sk-acme" not in caplog.text and "nope" not in caplog.text


async def test_a_clients_request_id_is_only_logged_unless_clients_are_trusted(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stub, url = stub_backend
    caplog.set_level(logging.INFO, logger="tokengate.access")
    untrusted = await gateway_factory({"pools": stub_pools(url)})
    trusted = await gateway_factory({"pools": stub_pools(url), "logging": {"trust_request_id": True}})
    mine = {"x-request-id": "job-42/step:7"}
    async with httpx.AsyncClient() as c:
        a = await c.post(untrusted.url + "/v1/chat/completions", json=chat(max_tokens=1), headers=mine)
        b = await c.post(trusted.url + "/v1/chat/completions", json=chat(max_tokens=1), headers=mine)
        bad = await c.post(
            trusted.url + "/v1/chat/completions",
            json=chat(max_tokens=1),
            headers={"x-request-id": "<script>" + "x" * 300},
        )
    assert OUR_ID.fullmatch(a.headers["x-request-id"])
    assert b.headers["x-request-id"] == "job-42/step:7"
    assert OUR_ID.fullmatch(bad.headers["x-request-id"])  # not safe to echo: never adopted
    assert [r.headers["x-request-id"] for r in stub.requests] == [
        a.headers["x-request-id"],
        "job-42/step:7",
        bad.headers["x-request-id"],
    ]
    la, lb, lbad = access_lines(caplog)
    assert (la["request_id"], la["client_request_id"]) == (a.headers["x-request-id"], "job-42/step:7")
    assert (lb["request_id"], lb["client_request_id"]) == ("job-42/step:7", None)
    assert lbad["client_request_id"] == "_script_" + "x" * 120  # clipped to 128, characters replaced


async def test_the_backends_own_request_id_is_not_relayed(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.conftest import serve_asgi

    async def backend(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        headers = [(b"content-type", b"application/json"), (b"x-request-id", b"backend-made")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    served = await serve_asgi(backend)
    try:
        gw = await gateway_factory({"pools": stub_pools(served.url, models=["stub-model"])})
        async with httpx.AsyncClient(base_url=gw.url) as c:
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=1))
        assert r.status_code == 200 and r.headers.get_list("x-request-id") == [r.headers["x-request-id"]]
        assert OUR_ID.fullmatch(r.headers["x-request-id"])
    finally:
        await served.stop()


def test_request_ids_are_unique_and_cheap() -> None:
    ids = {new_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(OUR_ID.fullmatch(i) for i in ids)


def _record(fields: dict[str, Any] | None = None, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord(
        "tokengate.audit", logging.INFO, __file__, 1, "tenant.update %s", ("x",), exc_info
    )
    if fields is not None:
        rec.fields = fields
    return rec


def test_json_lines_have_the_four_fields_and_the_records_own() -> None:
    line = orjson.loads(JsonFormatter().format(_record({"actor": "admin:1", "before": {"a": 1}}, exc=True)))
    assert line["level"] == "info" and line["logger"] == "tokengate.audit"
    assert line["message"] == "tenant.update x" and line["actor"] == "admin:1" and line["before"] == {"a": 1}
    assert "ValueError: boom" in line["exception"] and line["timestamp"].endswith("Z")


def test_text_lines_read_as_words_with_the_fields_appended() -> None:
    text = TextFormatter().format(_record({"actor": "admin:1", "target": "tenants/a b"}))
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO ", text)  # the access line's clock
    assert ' INFO tokengate.audit: tenant.update x actor=admin:1 target="tenants/a b"' in text


def test_the_access_line_in_text_format(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokengate.access")
    rec = Record("POST", "/v1/chat/completions", start=0.0, request_id="tg-1-1", tenant="acme", status=200)
    rec.error = "upstream said:\nfake line"
    accesslog.set_format("text")
    try:
        rec.emit(0.5)
    finally:
        accesslog.set_format("json")
    [line] = [r.getMessage() for r in caplog.records if r.name == "tokengate.access"]
    assert "Z INFO tokengate.access: POST /v1/chat/completions 200 " in line
    assert " request_id=tg-1-1 " in line and " tenant=acme " in line and "total_ms=500.0" in line
    assert "{" not in line and "\n" not in line and 'error="upstream said:\\nfake line"' in line


@pytest.fixture
def fresh_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """setup_logging changes process-wide logging: put everything back afterwards."""
    from gateway.process.serve import ACCESS_LOG_ENV, LOG_FORMAT_ENV, LOG_LEVEL_ENV

    for name in (ACCESS_LOG_ENV, LOG_FORMAT_ENV, LOG_LEVEL_ENV):
        monkeypatch.setenv(name, "")
    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "tokengate.access", "httpx")
    saved = {
        n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
        for n in names
    }
    try:
        yield
    finally:
        for n, (handlers, level, propagate) in saved.items():
            lg = logging.getLogger(n)
            for h in lg.handlers[:]:
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
            lg.setLevel(level)
            lg.propagate = propagate
        accesslog.set_format("json")


def test_setup_logging_sends_uvicorns_lines_and_ours_through_one_json_formatter(
    fresh_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    from gateway.process.serve import setup_logging

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    setup_logging("info", False, "json")
    uvicorn.Config(app=lambda *a: None, log_config=None, log_level="info")  # uvicorn keeps our handlers
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    logging.getLogger("tokengate").warning("backend %s marked unhealthy", "b1")
    logging.getLogger("uvicorn.access").info("never: the access line replaces it")
    lines = [orjson.loads(line) for line in err.getvalue().splitlines()]
    assert [(x["logger"], x["level"], x["message"]) for x in lines] == [
        ("uvicorn.error", "info", "Application startup complete."),
        ("tokengate", "warning", "backend b1 marked unhealthy"),
    ]


@pytest.fixture
def served_logging(fresh_logging: None, monkeypatch: pytest.MonkeyPatch) -> Callable[[], io.StringIO]:
    """Sets logging up as `tokengate serve --access-log` does, stdout (the access lines) captured.
    Called inside the test: pytest's own capture handlers differ between setup and call."""
    from gateway.process.serve import setup_logging

    def setup() -> io.StringIO:
        out = io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        setup_logging("info", True, "json")
        return out

    return setup


def test_the_access_line_goes_straight_to_its_own_handler_when_nothing_else_could_see_it(
    served_logging: Callable[[], io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = served_logging()
    made: list[logging.LogRecord] = []
    real_make = logging.Logger.makeRecord

    def counting(self: logging.Logger, *a: Any, **k: Any) -> logging.LogRecord:
        record = real_make(self, *a, **k)
        made.append(record)
        return record

    monkeypatch.setattr(logging.Logger, "makeRecord", counting)
    Record("POST", "/v1/chat/completions", start=0.0, request_id="tg-1-2", status=200).emit(0.25)
    logging.getLogger("tokengate.access").handlers[0].flush()
    [line] = out.getvalue().splitlines()
    assert orjson.loads(line)["request_id"] == "tg-1-2"
    assert made == []  # written by the handler itself: no LogRecord per request


def test_a_filter_on_the_access_logger_still_sees_every_line(
    served_logging: Callable[[], io.StringIO],
) -> None:
    out = served_logging()
    access = logging.getLogger("tokengate.access")
    seen: list[str] = []

    def keep_errors_only(record: logging.LogRecord) -> bool:
        seen.append(record.getMessage())
        return '"status":200' not in record.getMessage()

    access.addFilter(keep_errors_only)
    try:
        Record("POST", "/v1/chat/completions", start=0.0, request_id="ok", status=200).emit(0.1)
        Record("POST", "/v1/chat/completions", start=0.0, request_id="bad", status=429).emit(0.1)
    finally:
        access.removeFilter(keep_errors_only)
    access.handlers[0].flush()
    assert len(seen) == 2
    assert [orjson.loads(x)["request_id"] for x in out.getvalue().splitlines()] == ["bad"]


def test_our_ids_are_uuids_that_differ_by_their_counter() -> None:
    a, b = new_id(), new_id()
    assert OUR_ID.fullmatch(a) and OUR_ID.fullmatch(b) and a != b
    assert uuid.UUID(a).version == 4 and str(uuid.UUID(a)) == a
    assert a[:24] == b[:24] and int(b[24:], 16) == int(a[24:], 16) + 1


@pytest.mark.parametrize(
    ("setting", "expected"),
    [("x-correlation-id", "x-correlation-id"), ("none", None), (False, None)],
)
async def test_the_request_id_goes_upstream_under_the_backends_header_or_not_at_all(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, setting: Any, expected: str | None
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory({"pools": stub_pools(url, request_id_header=setting)})
    async with httpx.AsyncClient(base_url=gw.url) as c:
        # A client's own header of the id's name never reaches the backend in its place.
        r = await c.post(
            "/v1/chat/completions", json=chat(max_tokens=3), headers={"x-correlation-id": "forged"}
        )
    assert r.status_code == 200
    sent = stub.requests[-1].headers
    assert "x-request-id" not in sent
    if expected is None:  # no id upstream: the client's header is just one of its headers
        assert sent["x-correlation-id"] == "forged"
    else:
        assert sent[expected] == r.headers["x-request-id"]


def test_a_request_id_header_the_gateway_sets_itself_is_refused_naming_the_field() -> None:
    from gateway.config.loader import ConfigError, parse_config

    for bad, says in (("authorization", "sets itself"), ("x bad", "header name"), (3, "header name")):
        with pytest.raises(ConfigError, match=rf"pools\.default\.backends\[0\]\.request_id_header: .*{says}"):
            parse_config({"pools": stub_pools("http://127.0.0.1:9", request_id_header=bad)})

"""Every failure leaves the gateway in OpenAI's error shape.

``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status; 429 and 503
carry ``Retry-After`` in whole seconds, rounded up. A client value quoted in a message goes
through ``show_value`` (short, never a container's repr): the helper pricing's own 400s use, so
every message echoes client values alike.
"""

from __future__ import annotations

import logging
import math

import orjson

from budgets.types import AdmissionError, NeverFits, QueueFull, QueueTimeout, StoreUnavailable
from classifiers.pricing.values import show_value as show_value

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class AnswerCut(Exception):
    """Raised out of the app when an answer whose headers are out fails half way and is not an SSE
    stream (a JSON body, a pass-through file): the server then closes the connection without
    ending the body, so the client sees an incomplete answer instead of a complete-looking one.
    The access line records why; the server's own error log leaves it out (``quiet_answer_cuts``)."""


class ApiError(Exception):
    """An error answer; raise it anywhere on the request path."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after_s: float | None = None,
        close: bool = False,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.retry_after_s = retry_after_s
        self.close = close  # answer with "connection: close": the server closes it after the answer
        self.extra_headers = headers  # more headers of the answer (a quota's rate-limit headers)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        h = [(b"content-type", b"application/json")]
        if self.retry_after_s is not None:
            h.append((b"retry-after", str(retry_after_seconds(self.retry_after_s)).encode()))
        if self.close:
            h.append((b"connection", b"close"))
        if self.extra_headers:
            h.extend(self.extra_headers)
        return h


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def retry_after_seconds(seconds: float) -> int:
    """HTTP Retry-After is whole seconds; round up so a client never retries too early."""
    return max(1, math.ceil(seconds))


def from_admission(exc: AdmissionError) -> ApiError:
    """Map a budget-store refusal onto its HTTP answer."""
    if isinstance(exc, NeverFits):
        return ApiError(413, exc.message, code="cost_exceeds_capacity")
    if isinstance(exc, QueueFull):
        return ApiError(429, exc.message, code="queue_full", retry_after_s=exc.retry_after_s or 1.0)
    if isinstance(exc, QueueTimeout):
        return ApiError(429, exc.message, code="queue_timeout", retry_after_s=exc.retry_after_s or 1.0)
    if isinstance(exc, StoreUnavailable):
        return ApiError(503, exc.message, code="store_unavailable", retry_after_s=exc.retry_after_s or 1.0)
    retry = exc.retry_after_s if exc.status in (429, 503) else None
    if exc.status == 429 and retry is None:
        retry = 1.0
    return ApiError(exc.status, exc.message, code="admission_refused", retry_after_s=retry)


def _not_a_cut(record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], AnswerCut))


def quiet_answer_cuts() -> None:
    """Keep uvicorn's "Exception in ASGI application" traceback for an ``AnswerCut`` out of its
    error log (idempotent)."""
    logger = logging.getLogger("uvicorn.error")
    if _not_a_cut not in logger.filters:
        logger.addFilter(_not_a_cut)

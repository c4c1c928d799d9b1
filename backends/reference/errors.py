"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import orjson
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> Response:
        return error_response(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": param, "code": code}})


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> Response:
    return Response(
        error_body(status, message, param=param, code=code), status_code=status, media_type="application/json"
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)

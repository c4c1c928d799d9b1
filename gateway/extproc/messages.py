"""Building and reading Envoy's external-processing messages (``wire.proto``): headers in and out,
the answers the processor gives to each message, and the refusal Envoy sends in its place."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.duration_pb2 import Duration

from gateway.extproc.wire_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMap,
    HeaderMutation,
    HeadersResponse,
    HeaderValue,
    HeaderValueOption,
    HttpStatus,
    ImmediateResponse,
    ProcessingResponse,
    TrailersResponse,
)

OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# The answers that change nothing, built once (a message is serialized, never mutated, when sent).
CONTINUE_REQUEST_HEADERS = ProcessingResponse(request_headers=HeadersResponse(response=CommonResponse()))
CONTINUE_RESPONSE_HEADERS = ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse()))
CONTINUE_REQUEST_BODY = ProcessingResponse(request_body=BodyResponse(response=CommonResponse()))
CONTINUE_RESPONSE_BODY = ProcessingResponse(response_body=BodyResponse(response=CommonResponse()))
CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse())


_CONTINUE = {
    "request_headers": CONTINUE_REQUEST_HEADERS,
    "request_body": CONTINUE_REQUEST_BODY,
    "request_trailers": CONTINUE_REQUEST_TRAILERS,
    "response_headers": CONTINUE_RESPONSE_HEADERS,
    "response_body": CONTINUE_RESPONSE_BODY,
    "response_trailers": CONTINUE_RESPONSE_TRAILERS,
}


def continue_for(which: str | None) -> ProcessingResponse:
    """The answer that changes nothing to a message of kind ``which`` (its oneof field)."""
    return _CONTINUE.get(which or "", CONTINUE_REQUEST_HEADERS)


def header_list(headers: HeaderMap) -> list[tuple[bytes, bytes]]:
    """Envoy's headers as ASGI's (lower-case names; values as bytes). Envoy sends a value in
    ``raw_value`` (older versions in ``value``)."""
    return [(h.key.encode("latin-1"), h.raw_value or h.value.encode("latin-1")) for h in headers.headers]


def mutation(set_headers: Iterable[tuple[str, bytes]], remove: Iterable[str] = ()) -> HeaderMutation:
    """Set (replacing any value the message has) and remove headers."""
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=name, raw_value=value), append_action=OVERWRITE)
            for name, value in set_headers
        ],
        remove_headers=list(remove),
    )


def body_answer(
    headers: HeaderMutation | None = None, body: bytes | None = None, *, route_again: bool = False
) -> ProcessingResponse:
    """The answer to the request's body: its headers changed, its body replaced (None: as sent)."""
    common = CommonResponse(header_mutation=headers, clear_route_cache=route_again)
    if body is not None:
        common.body_mutation.CopyFrom(_body(body))
    return ProcessingResponse(request_body=BodyResponse(response=common))


def headers_answer(
    headers: HeaderMutation, *, response: bool, route_again: bool = False
) -> ProcessingResponse:
    """The answer to the request's (``response`` False) or the response's headers."""
    common = HeadersResponse(response=CommonResponse(header_mutation=headers, clear_route_cache=route_again))
    return (
        ProcessingResponse(response_headers=common)
        if response
        else ProcessingResponse(request_headers=common)
    )


def response_body_answer(body: bytes | None) -> ProcessingResponse:
    """The answer to a chunk of the response: relayed as it came (None), or replaced."""
    if body is None:
        return CONTINUE_RESPONSE_BODY
    return ProcessingResponse(response_body=BodyResponse(response=CommonResponse(body_mutation=_body(body))))


def _body(body: bytes) -> BodyMutation:
    return BodyMutation(body=body) if body else BodyMutation(clear_body=True)


def immediate(
    status: int, headers: Iterable[tuple[str, bytes]], body: bytes, details: str
) -> ProcessingResponse:
    """Envoy answers the client itself (a refusal, or an answer the gateway makes): ``details`` goes
    to Envoy's access log (%RESPONSE_CODE_DETAILS%)."""
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status), headers=mutation(headers), body=body, details=details
        )
    )


def extend(seconds: float) -> ProcessingResponse:
    """Ask Envoy to wait longer for the answer to the message it sent last (once per message)."""
    whole = int(seconds)
    return ProcessingResponse(
        override_message_timeout=Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )

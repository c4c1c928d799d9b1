"""Client JSON values as pricing handles them: named by type, echoed short, serialized safely.

Client values echoed in messages are cut to 64 characters plus their length, and containers are
named by type, never printed. Client JSON serialized for counting (tools, schemas, unknown items)
may nest at most ``MAX_JSON_DEPTH`` (254, orjson's limit) containers; deeper is a 400 saying so,
never a RecursionError.
"""

from __future__ import annotations

from typing import Any

import orjson

from classifiers.pricing.cost import InvalidRequest

# orjson serializes at most 254 nested containers; deeper JSON is refused with a 400 instead of
# falling back to a recursive serializer (which raised RecursionError, a 500).
MAX_JSON_DEPTH = 254
# Token ids are signed 64-bit integers in every engine; anything larger is not a token id.
MAX_TOKEN_ID = 2**63 - 1
# Client values echoed in error messages are cut to this many characters.
_ECHO_CHARS = 64

_JSON_TYPE = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def kind(value: object) -> str:
    """The JSON type of a client value ("object", "array", ...), for an error message."""
    return _JSON_TYPE.get(type(value), type(value).__name__)


def show_value(value: object) -> str:
    """A client value for an error message: short, and never the repr of a container.

    A 1 MB string stays 64 characters, and a list nested 5000 deep is not walked (its repr would
    raise RecursionError), so echoing a value can neither bloat a 400 nor turn it into a 500.
    """
    if isinstance(value, str):
        if len(value) <= _ECHO_CHARS:
            return repr(value)
        return f"{value[:_ECHO_CHARS]!r}…({len(value)} chars)"
    if value is None or isinstance(value, bool):
        return orjson.dumps(value).decode()  # null / true / false, as the client wrote them
    if type(value) is int:
        bits = value.bit_length()
        return str(value) if bits <= 64 else f"an integer of {bits} bits"
    if type(value) is float:
        return repr(value)
    return kind(value)


def is_int(value: object) -> bool:
    # bool is a subclass of int, but `"max_tokens": true` is a client bug, not a number.
    return type(value) is int


def token_ids(value: list[Any]) -> bool:
    """True when `value` is a list of token ids: ints in [0, 2**63)."""
    return all(type(t) is int for t in value) and (
        not value or (min(value) >= 0 and max(value) <= MAX_TOKEN_ID)
    )


def _deeper_than(value: object, limit: int) -> bool:
    """True when `value` nests more than `limit` containers; iterative, so any depth is safe."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[dict[Any, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def compact_json(value: object, param: str) -> str:
    """Compact JSON of a client value; raises only InvalidRequest."""
    try:
        return orjson.dumps(value).decode()
    except TypeError as exc:  # orjson.JSONEncodeError: too deep, or a number beyond 64 bits
        if _deeper_than(value, MAX_JSON_DEPTH):
            raise InvalidRequest(
                f"'{param}' is nested more than {MAX_JSON_DEPTH} levels deep; flatten it",
                param=param,
            ) from None
        raise InvalidRequest(
            f"'{param}' cannot be serialized as JSON ({exc}); numbers must fit in 64 bits", param=param
        ) from None

"""Fuzz every route of a running gateway over raw sockets and check it never fails or hangs.

    python -m loadtest.fuzz --spawn --cases 20000 --seed 1          # its own stub backend + gateway
    python -m loadtest.fuzz --url http://127.0.0.1:8080 --api-key sk-1 --cases 5000

Cases are generated from a seed (so a failure can be replayed with ``--seed`` and ``--only N``) and
come in families: valid bodies with one field replaced by a value of the wrong type or an extreme
one, deleted fields, deep nesting, malformed JSON (truncated, flipped bytes, invalid UTF-8, lone
surrogates, NUL bytes), huge bodies and headers, lying ``Content-Length``, chunked bodies (valid and
broken), every method on every route, path tricks, and odd gateway headers. Each is sent on its own
connection exactly as generated (``loadtest.raw_http``).

A run passes when: no answer has a status >= 500, no case waits longer than ``--hang-s`` (10 s) for
an answer or a close, every pool is back at 0 tokens in flight afterwards, and the gateway still
answers a plain request. The exit status is 0 on a pass, 1 otherwise; ``--json`` writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from loadtest.raw_http import RawResponse, host_port, read_response

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
OTHER_PATHS = (
    "/v1/models",
    "/v1/models/stub-model",
    "/v1/files",
    "/v1/rerank",
    "/v1/audio/transcriptions",
    "/v1/unknown",
    "/metrics",
    "/healthz",
    "/readyz",
    "/stats",
    "/insights",
    "/dashboard",
    "/admin/v1/tenants",
    "/",
    "/favicon.ico",
)
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE")
PATH_TRICKS = (
    "/v1/./chat/completions",
    "/v1/x/../chat/completions",
    "/v1/%2e%2e/stats",
    "/v1/..%2fstats",
    "/v1//chat/completions",
    "/v1/chat/completions/",
    "/v1/chat%2fcompletions",
    "/v1/%00",
    "/v1/%zz",
    "/v1/\u00e9",
    "*",
    "http://evil.example/v1/chat/completions",
)


@dataclass(frozen=True, slots=True)
class Case:
    index: int
    family: str
    data: bytes  # the exact bytes sent


@dataclass(slots=True)
class Outcome:
    index: int
    family: str
    status: int | None  # None: closed without an answer
    seconds: float
    hung: bool = False
    error: str | None = None


@dataclass(slots=True)
class Report:
    cases: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_family: Counter[str] = field(default_factory=Counter)
    server_errors: list[Outcome] = field(default_factory=list)
    hangs: list[Outcome] = field(default_factory=list)
    slowest_s: float = 0.0
    pools_at_zero: bool | None = None
    healthy_after: bool | None = None

    @property
    def passed(self) -> bool:
        return (
            not self.server_errors
            and not self.hangs
            and self.pools_at_zero is not False
            and self.healthy_after is not False
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "cases": self.cases,
            "by_status": dict(self.by_status),  # asdict would turn a Counter into one of pairs
            "by_family": dict(self.by_family),
            "server_errors": [asdict(o) for o in self.server_errors],
            "hangs": [asdict(o) for o in self.hangs],
            "slowest_s": self.slowest_s,
            "pools_at_zero": self.pools_at_zero,
            "healthy_after": self.healthy_after,
        }


# ---- generation ----


def _chat(rng: random.Random) -> dict[str, Any]:
    return {
        "model": "stub-model",
        "messages": [{"role": "user", "content": "hello " * rng.randint(1, 20)}],
        "max_tokens": rng.randint(1, 64),
        "stream": rng.random() < 0.5,
    }


def _valid_body(route: str, rng: random.Random) -> dict[str, Any]:
    if route == "/v1/chat/completions":
        body = _chat(rng)
        if rng.random() < 0.3:
            body["tools"] = [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ]
        if rng.random() < 0.3:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}
        if rng.random() < 0.2:  # an image part: well-formed, broken, or remote (classifiers/images.py)
            body["messages"][0]["content"] = [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": _image_url(rng)}},
            ]
        if rng.random() < 0.2:  # engine extensions a chat template renders (priced since 2026-12-04)
            body["documents"] = [{"title": "t", "text": "hello " * rng.randint(1, 20)}]
            body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
        return body
    if route == "/v1/completions":
        return {
            "model": "stub-model",
            "prompt": "hello " * rng.randint(1, 20),
            "max_tokens": rng.randint(1, 64),
        }
    if route == "/v1/embeddings":
        return {"model": "stub-model", "input": rng.choice(["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])}
    return {
        "model": "stub-model",
        "input": rng.choice(["hi", [{"role": "user", "content": "hi"}]]),
        "instructions": "be brief",
        "max_output_tokens": rng.randint(1, 64),
        "stream": rng.random() < 0.5,
    }


# The starts of image files, whole and cut short, with sizes from nothing to absurd.
_IMAGE_HEADS: tuple[bytes, ...] = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x04\x00\x00\x00\x03\x00\x08\x02\x00\x00\x00",
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\x89PNG\r\n\x1a\n\x00\x00",
    b"GIF89a\x00\x00\x00\x00",
    b"GIF89a\xff\xff\xff\xff",
    b"RIFF\x00\x00\x00\x00WEBPVP8X\x0a\x00\x00\x00\x00\x00\x00\x00\xff\xff\xff\xff\xff\xff",
    b"RIFF\x00\x00\x00\x00WEBPVP8L",
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xc0\x00\x11\x08\x10\x00\x10\x00",
    b"\xff\xd8\xff\xe1\xff\xff",
    b"\xff\xd8\x00\x00",
    b"",
)


_HOSTILE_URLS: tuple[str, ...] = (
    "http://127.0.0.1",
    "http://2130706433",
    "http://0x7f.1",
    "http://0177.0.0.1",
    "http://" + "9" * 5000,
    "http://" + "a." * 3000 + "com",
    "http://[::ffff:127.0.0.1]",
    "http://[fe80::1%25eth0]",
    "http://[",
    "http://]",
    "http://a@b@c",
    "http:/localhost",
    "http:\\\\localhost",
    "file:///etc/passwd",
    "/etc/passwd",
    "https://127。0。0。1",
    "http://xn--",
    "http://..",
    "HTTP://LOCALHOST.",
    "javascript:alert(1)",
)


def _image_url(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.1:
        return rng.choice(["https://img.example/a.png", "file-abc", "data:", "data:image/png;base64", ""])
    if kind < 0.2:  # URLs the engine would fetch from inside its network (classifiers/media_urls.py)
        return rng.choice(_HOSTILE_URLS) + rng.choice(["", "/x", ":1", ":99999", "\t", "%00", "\u00e9"])
    head = rng.choice(_IMAGE_HEADS) + rng.randbytes(rng.choice([0, 3, 64]))
    if kind < 0.4:  # percent-encoded, or not base64 at all
        return "data:image/png," + "".join(f"%{b:02x}" for b in head)
    encoded = base64.b64encode(head).decode()
    if kind < 0.5:
        encoded = encoded[: rng.randint(0, len(encoded))] + rng.choice(["", "!", "=", "\u00e9", " "])
    return "data:image/png;base64," + encoded


@dataclass(frozen=True, slots=True)
class RawJson:
    """JSON text placed verbatim (nesting deeper than any serializer will write)."""

    text: str


def _deep(depth: int) -> RawJson:
    opens = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    closes = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return RawJson(opens + "1" + closes)


_EXTREMES: tuple[Callable[[random.Random], Any], ...] = (
    lambda r: None,
    lambda r: True,
    lambda r: 0,
    lambda r: -1,
    lambda r: 2**63 - 1,
    lambda r: 2**64 + 1,
    lambda r: -(2**63),
    lambda r: 10**30,
    lambda r: 1e308,
    lambda r: -0.0,
    lambda r: 3.5,
    lambda r: "",
    lambda r: "x" * r.choice([1, 1000, 200_000]),
    lambda r: "\x00\x01\x1f",
    lambda r: "\ud800",  # a lone surrogate (orjson refuses to dump it; we write it by hand)
    lambda r: [],
    lambda r: [[]],
    lambda r: [None],
    lambda r: {},
    lambda r: {"": None},
    lambda r: _deep(r.choice([10, 100, 300, 600, 1200])),
    lambda r: [1] * r.choice([10, 10_000]),
    lambda r: list(range(-5, 5)),
    lambda r: [r.choice([0, 31_999, 32_000, 151_645, 2**63])] * r.choice([1, 129, 1025]),
    lambda r: {r.choice(["0", "-1", "+5", "１", "99999", "5" * 25]): r.choice([1, "x", None])},
)


def _dumps(obj: Any) -> bytes:
    raws: list[str] = []

    def placeholder(value: object) -> str:
        if isinstance(value, RawJson):
            raws.append(value.text)
            return f"@@raw{len(raws) - 1}@@"
        raise TypeError(type(value).__name__)

    try:
        # (orjson writes a dataclass as an object by itself: RawJson must reach ``placeholder``)
        text = orjson.dumps(obj, default=placeholder, option=orjson.OPT_PASSTHROUGH_DATACLASS).decode()
    except TypeError:
        # Lone surrogates and 65+ bit integers: json writes them (escaped / exact).
        text = json.dumps(obj, ensure_ascii=True, default=placeholder)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw, 1)
    return text.encode("utf-8", "surrogatepass")


def _mutate(body: dict[str, Any], rng: random.Random) -> tuple[str, dict[str, Any]]:
    keys = [
        *body.keys(),
        "n",
        "best_of",
        "stream_options",
        "tools",
        "response_format",
        "prompt",
        "input",
        "documents",
        "chat_template_kwargs",
        "chat_template",
        "prompt_embeds",
        "priority",
        "stop",
        "logit_bias",
        "stop_token_ids",
        "allowed_token_ids",
        "background",
        "kv_transfer_params",
        "prompt_logprobs",
        "echo",
        "logprobs",
        "mm_processor_kwargs",
        "media_io_kwargs",
    ]
    key = rng.choice(keys)
    action = rng.random()
    out = dict(body)
    if action < 0.15 and key in out:
        del out[key]
        return f"delete:{key}", out
    if action < 0.3 and isinstance(out.get("messages"), list):
        msg = dict(out["messages"][0])
        field_name = rng.choice(
            ["role", "content", "name", "tool_calls", "function_call", "reasoning_content", "tool_call_id"]
        )
        msg[field_name] = rng.choice(_EXTREMES)(rng)
        out["messages"] = [msg]
        return f"message.{field_name}", out
    out[key] = rng.choice(_EXTREMES)(rng)
    return f"field:{key}", out


def _request(
    method: str,
    target: str,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    *,
    content_length: int | None = None,
    close: bool = True,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "host: gateway"]
    if close:
        lines.append("connection: close")
    lines += [f"{k}: {v}" for k, v in headers]
    if content_length is not None:
        lines.append(f"content-length: {content_length}")
    elif body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body


def _auth(api_key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def _broken_json(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.randrange(9)
    if kind == 7:  # JSON Python's json reads and orjson does not (gateway/request/proxy.py, pass-through)
        return "lax-json", raw.replace(
            b'"hello', rng.choice([b"NaN", b"Infinity", b"1e400"]) + b', "x": "', 1
        )
    if kind == 8:
        encoding = rng.choice(["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
        return f"encoded-{encoding}", raw.decode("utf-8", "surrogatepass").encode(encoding, "surrogatepass")
    if kind == 0:
        return "truncated", raw[: rng.randrange(max(1, len(raw)))]
    if kind == 1:
        b = bytearray(raw)
        for _ in range(rng.randint(1, 5)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return "flipped", bytes(b)
    if kind == 2:
        return "invalid-utf8", raw.replace(b"hello", b"hel\xff\xfelo", 1) or raw + b"\xc3"
    if kind == 3:
        return "nul", raw.replace(b"hello", b"hel\x00lo", 1)
    if kind == 4:
        return "surrogate-escape", raw.replace(b"hello", b"\\ud800\\udc00\\ud800", 1)
    if kind == 5:
        return "not-an-object", rng.choice([b"[]", b"1", b'"s"', b"null", b"true", b"", b"{", b"}{"])
    return "deep-raw", b"[" * rng.choice([500, 1100, 5000]) + b"]" * rng.choice([0, 500, 1100])


def _chunked(body: bytes, rng: random.Random) -> tuple[str, bytes]:
    parts = []
    i = 0
    while i < len(body):
        n = rng.randint(1, 64)
        parts.append(b"%x\r\n" % n + body[i : i + n] + b"\r\n")
        i += n
    trailer = b"0\r\n\r\n"
    kind = rng.randrange(4)
    if kind == 1:
        return "chunked-bad-size", b"zz\r\n" + body + b"\r\n" + trailer
    if kind == 2:
        return "chunked-unterminated", b"".join(parts)  # never sends the last chunk
    if kind == 3:
        return "chunked-overlong", b"%x\r\n" % (len(body) + 100) + body + b"\r\n" + trailer
    return "chunked", b"".join(parts) + trailer


def generate(seed: int, count: int, api_key: str | None = None) -> Iterator[Case]:
    """``count`` cases from ``seed``; the same seed gives the same cases."""
    rng = random.Random(seed)
    auth = _auth(api_key)
    json_ct = ("content-type", "application/json")
    for index in range(count):
        family_roll = rng.random()
        route = rng.choice(ROUTES)
        body = _valid_body(route, rng)
        if family_roll < 0.35:
            what, mutated = _mutate(body, rng)
            yield Case(index, f"mutate {what}", _request("POST", route, _dumps(mutated), [json_ct, *auth]))
        elif family_roll < 0.45:
            what, raw = _broken_json(_dumps(body), rng)
            target = "/v1/rerank" if rng.random() < 0.3 else route  # (an allowed pass-through route)
            yield Case(index, f"json {what} {target}", _request("POST", target, raw, [json_ct, *auth]))
        elif family_roll < 0.5:
            nested = dict(body)
            depth = rng.choice([64, 255, 256, 600, 990, 1023])
            where = rng.choice(["tools", "response_format", "messages", "metadata"])
            if where == "tools":
                nested["tools"] = [
                    {"type": "function", "function": {"name": "f", "parameters": _deep(depth)}}
                ]
            elif where == "response_format":
                nested["response_format"] = {"type": "json_schema", "json_schema": _deep(depth)}
            elif where == "messages":
                nested["messages"] = [{"role": "user", "content": [_deep(depth)]}]
            else:
                nested["metadata"] = _deep(depth)
            yield Case(index, f"deep {where}", _request("POST", route, _dumps(nested), [json_ct, *auth]))
        elif family_roll < 0.57:
            method = rng.choice(METHODS)
            target = rng.choice([*ROUTES, *OTHER_PATHS])
            raw = _dumps(body) if method in ("POST", "PUT", "PATCH") and rng.random() < 0.7 else b""
            yield Case(index, f"method {method}", _request(method, target, raw, [json_ct, *auth]))
        elif family_roll < 0.63:
            target = rng.choice(PATH_TRICKS) + rng.choice(["", "?a=%2e%2e/x", "?" + "q" * 3000])
            method = rng.choice(["GET", "POST"])
            raw = _dumps(body) if method == "POST" else b""
            yield Case(index, "path", _request(method, target, raw, [json_ct, *auth]))
        elif family_roll < 0.7:
            raw = _dumps(body)
            lie = rng.choice(["short", "long", "negative", "garbage", "two"])
            if lie == "short":
                data = _request("POST", route, raw, [json_ct, *auth], content_length=max(0, len(raw) - 5))
            elif lie == "long":
                data = _request("POST", route, raw, [json_ct, *auth], content_length=len(raw) + 50)
            elif lie == "negative":
                data = _request("POST", route, raw, [json_ct, *auth], content_length=-1)
            elif lie == "garbage":
                data = _request(
                    "POST", route, raw, [json_ct, *auth, ("content-length", "12abc")], content_length=None
                )
            else:
                data = _request("POST", route, raw, [json_ct, *auth, ("content-length", "3")])
            yield Case(index, f"content-length {lie}", data)
        elif family_roll < 0.76:
            what, chunks = _chunked(_dumps(body), rng)
            head = _request(
                "POST", route, b"", [json_ct, *auth, ("transfer-encoding", "chunked")], content_length=None
            )
            # _request adds a content-length for POST bodies; a chunked request must not have one.
            head = head.replace(b"content-length: 0\r\n", b"")
            yield Case(index, what, head + chunks)
        elif family_roll < 0.82:
            size = rng.choice([8 * 1024, 40 * 1024, 200 * 1024, 1024 * 1024])
            kind = rng.choice(["one", "many"])
            headers = (
                [("x-big", "a" * size)]
                if kind == "one"
                else [(f"x-h{i}", "v" * 64) for i in range(size // 70)]
            )
            yield Case(
                index,
                f"headers {kind} {size}",
                _request("POST", route, _dumps(body), [json_ct, *auth, *headers]),
            )
        elif family_roll < 0.86:
            size = rng.choice([1024 * 1024, 5 * 1024 * 1024])
            big = dict(body)
            big["messages" if route == "/v1/chat/completions" else "prompt"] = (
                [{"role": "user", "content": "w " * (size // 2)}]
                if route == "/v1/chat/completions"
                else "w " * (size // 2)
            )
            yield Case(index, f"body {size}", _request("POST", route, _dumps(big), [json_ct, *auth]))
        else:
            name = rng.choice(
                [
                    "x-tokengate-tier",
                    "x-tokengate-max-queue-wait",
                    "authorization",
                    "api-key",
                    "content-type",
                    "x-request-id",
                ]
            )
            value = rng.choice(
                ["", "critical", "batch", "nope", "-1", "nan", "inf", "1e309", "Bearer", "Bearer " + "k" * 5000,
                 "text/plain", "application/json; charset=latin-1", "\x7f\x01", "ÿ" * 10]
            )  # fmt: skip
            headers = [*auth, (name, value)] if name != "authorization" else [(name, value)]
            yield Case(index, f"header {name}", _request("POST", route, _dumps(body), [json_ct, *headers]))


ADMIN_PATHS = (
    "/admin/v1/tenants",
    "/admin/v1/tenants/{name}",
    "/admin/v1/tenants/{name}/keys",
    "/admin/v1/keys/{name}",
    "/admin/v1/keys/{name}/rotate",
    "/admin/v1/pools",
    "/admin/v1/pools/{name}",
    "/admin/v1/pools/{name}/backends",
    "/admin/v1/tiers",
    "/admin/v1/tiers/{name}",
    "/admin/v1/overrides",
    "/admin/v1/overrides/{name}/{name}",
    "/admin/v1/state",
    "/admin/v1/reload",
    "/admin/v1/openapi.json",
    "/admin/v1/nope",
    "/admin/v2/tenants",
)
_NAMES = (
    "acme",
    "default",
    "t",
    "newco",
    "x" * 300,
    "%2e%2e",
    "%C3%A9",
    "a%20b",
    "tenants",
    "standard",
    "-",
    "0",
)


def _admin_body(rng: random.Random) -> dict[str, Any]:
    candidates: list[dict[str, Any]] = [
        {"name": rng.choice(["newco", "acme", "x" * 100, "", "a b"]), "budget_tokens": rng.randint(1, 10**6)},
        {
            "budget_tokens": rng.randint(1, 10**6),
            "weight": 2,
            "tier": rng.choice(["batch", "critical", "gold"]),
        },
        {
            "server_tools": rng.choice(
                [[], ["mcp:*"], ["mcp:"], "code_interpreter", [1], {"a": 1}, ["x" * 5000]]
            )
        },
        {
            "url": rng.choice(["http://127.0.0.1:1", "ftp://x", "", "http://" + "a" * 500]),
            "capacity_tokens": 1000,
        },
        {"url": "http://127.0.0.1:1", "draining": True},
        {"url": "http://127.0.0.1:1", "cache_salt": rng.choice(["tenant", "client", "yes", True, None])},
        {"rank": rng.randint(0, 9), "ceiling": rng.choice([0.5, 1.0, 2.0])},
        {"overlap_s": rng.choice([0, 1, 10**9])},
        {"name": "ci"},
        {},
    ]
    return dict(rng.choice(candidates))


def generate_admin(seed: int, count: int, token: str | None) -> Iterator[Case]:
    """Cases against the admin API on the ops listener: every route and method, odd names, wrong and
    extreme field values, broken JSON, missing or wrong tokens."""
    rng = random.Random(seed)
    json_ct = ("content-type", "application/json")
    for index in range(count):
        path = rng.choice(ADMIN_PATHS)
        while "{name}" in path:
            path = path.replace("{name}", rng.choice(_NAMES), 1)
        if rng.random() < 0.2:
            path += rng.choice(["?url=http://127.0.0.1:1", "?url=", "?url=" + "%" * 3, "?x=1"])
        method = rng.choice(["GET", "GET", "POST", "PATCH", "PUT", "DELETE", "OPTIONS"])
        roll = rng.random()
        who = token if roll < 0.8 else rng.choice([None, "wrong", "x" * 5000])
        headers = [json_ct] + ([("authorization", f"Bearer {who}")] if who else [])
        body: bytes = b""
        family = "admin"
        if method in ("POST", "PATCH", "PUT"):
            data = _admin_body(rng)
            kind = rng.random()
            if kind < 0.5:
                what, data = _mutate(data, rng)
                family = f"admin-mutate {what}"
                body = _dumps(data)
            elif kind < 0.7:
                what, body = _broken_json(_dumps(data), rng)
                family = f"admin-json {what}"
            elif kind < 0.8:
                body = _dumps({"budget_tokens": _deep(rng.choice([100, 600, 1100]))})
                family = "admin-deep"
            else:
                body = _dumps(data)
        yield Case(index, family, _request(method, path, body, headers))


# ---- running ----


async def send_case(url: str, case: Case, hang_s: float) -> Outcome:
    host, port = host_port(url)
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), hang_s)
    except (OSError, TimeoutError) as exc:
        return Outcome(case.index, case.family, None, time.perf_counter() - t0, error=f"connect: {exc!r}")
    try:
        writer.write(case.data)
        try:
            await asyncio.wait_for(writer.drain(), hang_s)
        except (ConnectionError, TimeoutError):
            pass  # the server may refuse and close before reading everything
        try:
            response: RawResponse | None = await asyncio.wait_for(read_response(reader), hang_s)
        except TimeoutError:
            return Outcome(case.index, case.family, None, time.perf_counter() - t0, hung=True)
        except (ConnectionError, ValueError, IndexError) as exc:
            return Outcome(case.index, case.family, None, time.perf_counter() - t0, error=repr(exc))
        return Outcome(
            case.index, case.family, None if response is None else response.status, time.perf_counter() - t0
        )
    finally:
        writer.close()


async def run_cases(
    url: str, cases: Iterator[Case], *, concurrency: int = 16, hang_s: float = 10.0
) -> Report:
    report = Report()
    queue: asyncio.Queue[Case | None] = asyncio.Queue(maxsize=concurrency * 2)

    async def worker() -> None:
        while True:
            case = await queue.get()
            if case is None:
                return
            out = await send_case(url, case, hang_s)
            report.cases += 1
            report.by_status[str(out.status)] += 1
            report.by_family[case.family.split(" ")[0]] += 1
            report.slowest_s = max(report.slowest_s, out.seconds)
            if out.hung:
                report.hangs.append(out)
            elif out.status is not None and out.status >= 500:
                report.server_errors.append(out)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    for case in cases:
        await queue.put(case)
    for _ in workers:
        await queue.put(None)
    await asyncio.gather(*workers)
    return report


def render(report: Report) -> str:
    lines = [
        f"fuzz: {report.cases} cases, {'PASS' if report.passed else 'FAIL'}; slowest {report.slowest_s:.2f} s",
        "statuses: " + ", ".join(f"{k}={v}" for k, v in sorted(report.by_status.items())),
        "families: " + ", ".join(f"{k}={v}" for k, v in sorted(report.by_family.items())),
        f"pools at zero afterwards: {report.pools_at_zero}; healthy afterwards: {report.healthy_after}",
    ]
    for o in report.server_errors[:20]:
        lines.append(f"  >=500: case {o.index} ({o.family}): {o.status}")
    for o in report.hangs[:20]:
        lines.append(f"  hang: case {o.index} ({o.family}) after {o.seconds:.1f} s")
    return "\n".join(lines)


async def check_after(
    url: str,
    api_key: str | None,
    ops_url: str | None = None,
    settle_s: float = 10.0,
    *,
    serve_check: bool = True,
) -> tuple[bool, bool]:
    """(every pool at 0 in flight, the gateway answers /healthz and a plain chat request).

    ``ops_url``: where /metrics is (the ops listener); default: ``url``. ``serve_check`` False: only
    /healthz (after fuzzing the admin API, tenants and backends may rightly have changed)."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=10.0, headers=headers) as c:
        deadline = time.monotonic() + settle_s
        while True:
            text = (await c.get((ops_url or url) + "/metrics")).text
            held = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("tokengate_pool_in_flight_tokens{")
            ]
            zero = all(v == 0 for v in held)
            if zero or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        ok = (await c.get("/healthz")).status_code == 200
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        if serve_check:
            ok = ok and (await c.post("/v1/chat/completions", json=body)).status_code == 200
    return zero, ok


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.fuzz", description=__doc__.split("\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running gateway (its pools must serve the model 'stub-model')")
    p.add_argument(
        "--ops-url", default=None, help="its ops listener, for /metrics (default: http://127.0.0.1:9091)"
    )
    target.add_argument("--spawn", action="store_true", help="start a stub backend and a gateway in-process")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--admin",
        action="store_true",
        help="fuzz the admin API on the ops listener instead (with --url: give --ops-url and --admin-token)",
    )
    p.add_argument("--admin-token", default=None, help="an admin token (with --url --admin)")
    p.add_argument(
        "--store",
        choices=("memory", "redis"),
        default="memory",
        help="--spawn: the gateway's budget store (redis: a redis-server of the stack's own)",
    )
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", type=int, default=None, help="run only this case index (replay)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--hang-s", type=float, default=10.0)
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> Report:
    if args.admin:
        return await _amain_admin(args)
    cases = generate(args.seed, args.cases, args.api_key)
    if args.only is not None:
        cases = (c for c in cases if c.index == args.only)
    if args.url:
        report = await run_cases(args.url, cases, concurrency=args.concurrency, hang_s=args.hang_s)
        ops_url = args.ops_url or "http://127.0.0.1:9091"
        report.pools_at_zero, report.healthy_after = await check_after(args.url, args.api_key, ops_url)
        return report
    from loadtest.fuzz_stack import fuzz_stack

    async with fuzz_stack(store=args.store) as (url, ops_url):
        report = await run_cases(url, cases, concurrency=args.concurrency, hang_s=args.hang_s)
        report.pools_at_zero, report.healthy_after = await check_after(url, None, ops_url)
    return report


async def _amain_admin(args: argparse.Namespace) -> Report:
    if args.url:
        ops_url = args.ops_url or "http://127.0.0.1:9091"
        cases = generate_admin(args.seed, args.cases, args.admin_token)
        report = await run_cases(ops_url, cases, concurrency=args.concurrency, hang_s=args.hang_s)
        report.pools_at_zero, report.healthy_after = await check_after(
            args.url, None, ops_url, serve_check=False
        )
        return report
    from loadtest.fuzz_stack import ADMIN_TOKEN, fuzz_stack

    async with fuzz_stack(store=args.store) as (url, ops_url):
        cases = generate_admin(args.seed, args.cases, ADMIN_TOKEN)
        report = await run_cases(ops_url, cases, concurrency=args.concurrency, hang_s=args.hang_s)
        report.pools_at_zero, report.healthy_after = await check_after(url, None, ops_url, serve_check=False)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(amain(args))
    print(render(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2, default=str)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

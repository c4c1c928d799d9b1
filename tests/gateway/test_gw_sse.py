"""SSE relay: byte-exact when the client asked for usage, usage chunk cut out when it did not,
whatever the chunk boundaries."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.upstream import sse
from gateway.upstream.sse import UsageRelay, usage_counts
from tests.support import examples

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def frame(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


CONTENT = [
    frame({"id": "x", "choices": [{"index": 0, "delta": {"content": f"t{i} "}}], "usage": None})
    for i in range(3)
]
USAGE_FRAME = frame({"id": "x", "choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"
STREAM = b"".join(CONTENT) + USAGE_FRAME + DONE


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return [c for c in out if c]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_passthrough_is_byte_exact_and_reads_usage(cuts: list[int]) -> None:
    relay = UsageRelay(drop_usage=False)
    chunks = split(STREAM, cuts)
    out = [relay.feed(c) for c in chunks]
    assert out == chunks  # chunk for chunk, nothing held back
    assert relay.flush() == b""
    assert relay.usage == USAGE


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_drop_mode_removes_only_the_usage_event(cuts: list[int]) -> None:
    relay = UsageRelay(drop_usage=True)
    out = b"".join(relay.feed(c) for c in split(STREAM, cuts)) + relay.flush()
    assert out == b"".join(CONTENT).replace(b',"usage":null', b"") + DONE
    assert relay.usage == USAGE


def test_crlf_separators_and_unterminated_tail() -> None:
    crlf = STREAM.replace(b"\n\n", b"\r\n\r\n")
    relay = UsageRelay(drop_usage=True)
    out = relay.feed(crlf[:-4]) + relay.flush()  # the last separator never arrives
    content = b"".join(CONTENT).replace(b',"usage":null', b"")
    assert out == content.replace(b"\n\n", b"\r\n\r\n") + b"data: [DONE]"
    assert relay.usage == USAGE


def test_continuous_usage_chunks_are_kept() -> None:
    # With continuous usage stats every content chunk carries usage: only choices == [] is dropped.
    content = frame({"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": USAGE})
    relay = UsageRelay(drop_usage=True)
    assert relay.feed(content + USAGE_FRAME + DONE) == content + DONE


def test_complete_frames_pass_immediately_in_drop_mode() -> None:
    relay = UsageRelay(drop_usage=True)
    plain = [c.replace(b',"usage":null', b"") for c in CONTENT]
    assert relay.feed(CONTENT[0]) == plain[0]  # no added latency for whole events
    assert relay.feed(CONTENT[1][:5]) == b""
    assert relay.feed(CONTENT[1][5:]) == plain[1]


def test_spaced_json_and_null_usage() -> None:
    spaced = b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\n'
    null = b'data: {"choices": [{"index": 0, "delta": {}}], "usage": null}\n\n'
    relay = UsageRelay(drop_usage=True)
    # The null field include_usage added is removed too: the client sees what it asked for.
    assert relay.feed(null + spaced + DONE) == b'data: {"choices": [{"index": 0, "delta": {}}]}\n\n' + DONE
    assert relay.usage == {"prompt_tokens": 1, "completion_tokens": 2}


def test_drop_mode_restores_the_stream_without_include_usage() -> None:
    # What the backend sends without include_usage has no usage field at all.
    with_usage = frame({"id": "x", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None})
    without = frame({"id": "x", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
    leading = b'data: {"usage":null,"id":"x","choices":[]}\n\n'
    relay = UsageRelay(drop_usage=True)
    assert relay.feed(with_usage + leading) == without + b'data: {"id":"x","choices":[]}\n\n'
    # Escaped quotes inside content are never touched.
    text = frame({"choices": [{"index": 0, "delta": {"content": '{"usage":null,'}}]})
    assert UsageRelay(drop_usage=True).feed(text) == text


# ---- the Responses API: named events, usage inside response.completed, no stream_options ----

R_USAGE = {"input_tokens": 11, "output_tokens": 5, "total_tokens": 16, "output_tokens_details": {}}


def named(event: str, obj: dict[str, object]) -> bytes:
    return f"event: {event}\n".encode() + frame({"type": event, **obj})


R_STREAM = (
    named("response.created", {"response": {"id": "r", "status": "in_progress", "usage": None}})
    + named("response.output_text.delta", {"delta": 'say "usage":{ here'})
    + named("response.output_text.delta", {"delta": "done"})
    + named("response.completed", {"response": {"id": "r", "status": "completed", "usage": R_USAGE}})
)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_responses_stream_is_relayed_byte_exact_and_its_usage_learned(cuts: list[int]) -> None:
    relay = UsageRelay(drop_usage=False)
    chunks = split(R_STREAM, cuts)
    assert [relay.feed(c) for c in chunks] == chunks
    assert relay.flush() == b""
    assert relay.usage == R_USAGE
    assert usage_counts(relay.usage) == (11, 5)


def test_every_byte_boundary_of_a_responses_stream_is_handled() -> None:
    for cut in range(len(R_STREAM) + 1):
        relay = UsageRelay(drop_usage=False)
        head, tail = R_STREAM[:cut], R_STREAM[cut:]
        assert relay.feed(head) + relay.feed(tail) + relay.flush() == R_STREAM
        assert usage_counts(relay.usage) == (11, 5), cut


def test_an_incomplete_or_failed_response_still_reports_usage() -> None:
    for event in ("response.incomplete", "response.failed"):
        relay = UsageRelay(drop_usage=False)
        data = named(event, {"response": {"status": event.split(".")[1], "usage": R_USAGE}})
        assert relay.feed(data[:-2]) == data[:-2]  # the separator never arrives
        assert relay.flush() == b""
        assert usage_counts(relay.usage) == (11, 5)


def test_only_events_carrying_a_usage_object_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    real = sse._usage_of

    def spy(event: bytes) -> tuple[dict[str, object] | None, bool]:
        parsed.append(event)
        return real(event)

    monkeypatch.setattr(sse, "_usage_of", spy)
    relay = UsageRelay(drop_usage=False)
    for i in range(0, len(STREAM), 7):
        relay.feed(STREAM[i : i + 7])
    assert parsed == [USAGE_FRAME]
    parsed.clear()
    relay = UsageRelay(drop_usage=False)
    relay.feed(R_STREAM)
    assert parsed == [
        named("response.completed", {"response": {"id": "r", "status": "completed", "usage": R_USAGE}})
    ]


@pytest.mark.parametrize(
    ("usage", "counts"),
    [
        ({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}, (7, 3)),
        ({"input_tokens": 11, "output_tokens": 5, "total_tokens": 16}, (11, 5)),
        ({"prompt_tokens": 7}, (7, None)),
        ({"output_tokens": 0}, (None, 0)),
        ({"prompt_tokens": True, "completion_tokens": False}, (None, None)),
        ({"input_tokens": -1, "output_tokens": -5}, (None, None)),
        ({"prompt_tokens": -1, "completion_tokens": 2}, (None, 2)),
        ({"prompt_tokens": 1.0, "completion_tokens": "3"}, (None, None)),
        ({"prompt_tokens": None, "input_tokens": 4, "completion_tokens": None, "output_tokens": 2}, (4, 2)),
        (None, (None, None)),
        ([7, 3], (None, None)),
        ("usage", (None, None)),
    ],
)
def test_usage_counts_reads_both_apis_and_trusts_only_non_negative_ints(
    usage: object, counts: tuple[int | None, int | None]
) -> None:
    assert usage_counts(usage) == counts


def test_a_non_streaming_responses_body_reports_usage_at_top_level() -> None:
    body = orjson.loads(orjson.dumps({"id": "r", "object": "response", "output": [], "usage": R_USAGE}))
    assert usage_counts(body["usage"]) == (11, 5)


def test_drop_mode_never_holds_more_than_a_bound_of_an_event_that_does_not_end() -> None:
    # No engine writes such an event; a broken backend might, forever: pass it on, do not hold it.
    relay = UsageRelay(drop_usage=True)
    piece = b"data: " + b"x" * 65_536
    out = b""
    held = 0
    for _ in range(100):
        out += relay.feed(piece)
        held = max(held, len(relay._buf))
    assert held <= sse.MAX_HELD_BYTES + len(piece)
    assert out + relay.flush() == piece * 100  # every byte arrives, in order, untouched
    # and a well-formed stream after it is handled as ever
    relay = UsageRelay(drop_usage=True)
    assert relay.feed(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n') == b""
    assert relay.usage == {"completion_tokens": 3}


@settings(max_examples=examples(200), deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12), drop=st.booleans())
def test_the_stream_is_finished_once_its_done_line_is_complete_wherever_it_is_cut(
    cuts: list[int], drop: bool
) -> None:
    stream = b"".join(CONTENT) + DONE
    relay = UsageRelay(drop_usage=drop)
    fed = b""
    for part in split(stream, cuts):
        relay.feed(part)
        fed += part
        # Finished exactly when the whole [DONE] event has come (its blank line may lag).
        assert relay.finished == fed.endswith(DONE)


def test_a_usage_event_finishes_the_stream_and_done_in_a_models_text_does_not() -> None:
    relay = UsageRelay(drop_usage=True)
    text = frame({"id": "x", "choices": [{"index": 0, "delta": {"content": "data: [DONE]\n[DONE]"}}]})
    relay.feed(text)
    assert not relay.finished
    relay.feed(USAGE_FRAME)
    assert relay.finished and relay.usage == USAGE
    tail = UsageRelay(drop_usage=False)
    tail.feed(b"".join(CONTENT) + b"data:[DONE]")  # no space, no blank line: the end of the bytes
    assert not tail.finished
    tail.flush()
    assert tail.finished

from backends.engine.detokenizer import OutputText
from backends.reference.tokenizer import default_tokenizer

TOK = default_tokenizer()


def feed(text: OutputText, ids: list[int]) -> list[str]:
    deltas = []
    for i, t in enumerate(ids):
        text.add(t)
        deltas.append(text.take(final=i == len(ids) - 1))
    return deltas


def test_incremental_text_equals_full_decode_including_split_characters() -> None:
    s = "naïve café — 你好世界 🎉🎉 done"
    ids = TOK.encode(s)
    assert len(ids) > len(s.split())  # some characters span several tokens
    deltas = feed(OutputText(TOK), ids)
    assert "".join(deltas) == s
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_text_and_is_not_emitted() -> None:
    ids = TOK.encode("alpha beta gamma delta epsilon")
    out = OutputText(TOK, stop=("gamma",))
    deltas = []
    for t in ids:
        out.add(t)
        deltas.append(out.take(final=out.stopped))
        if out.stopped:
            break
    assert out.stopped
    assert "".join(deltas) == "alpha beta "
    assert out.text == "alpha beta "


def test_earliest_of_several_stop_strings_wins() -> None:
    ids = TOK.encode("one two three four")
    out = OutputText(TOK, stop=("four", "two"))
    for t in ids:
        out.add(t)
    assert out.stopped and out.text == "one "


def test_skipped_ids_produce_no_text() -> None:
    eos = 100257
    out = OutputText(TOK, skip_ids=frozenset({eos}))
    for t in [*TOK.encode("hello"), eos]:
        out.add(t)
    assert out.take(final=True) == "hello"


def test_unknown_ids_are_skipped_by_the_default_tokenizer() -> None:
    assert TOK.decode([*TOK.encode("ok"), 100_300]) == "ok"

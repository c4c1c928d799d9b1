"""budgets.sorted_keys against a plain sorted list, over random operation sequences (hypothesis)."""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgets.sorted_keys import SortedKeys
from tests.support import examples

Key = tuple[float, int, str]

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 30), st.integers(0, 400)),  # counters tie often
    st.tuples(st.just("remove"), st.integers(0, 10_000), st.just(0)),  # the i-th held key, mod size
    st.tuples(st.just("after"), st.integers(-1, 31), st.integers(0, 400)),
)


def check_shape(keys: SortedKeys[Key]) -> None:
    """Buckets sorted and non-empty, ``maxes`` their last keys, sizes within the load's bounds."""
    assert len(keys.buckets) == len(keys.maxes)
    for bucket, top in zip(keys.buckets, keys.maxes, strict=True):
        assert bucket and bucket == sorted(bucket) and bucket[-1] == top
        assert len(bucket) <= 2 * keys.load
        if len(keys.buckets) > 1:
            assert len(bucket) >= keys.load // 2
    flat = list(keys)
    assert flat == sorted(flat) and len(flat) == len(keys)


@given(st.lists(op, max_size=400), st.sampled_from([1, 2, 4, 64]))
@settings(max_examples=examples(300), deadline=None)
def test_keys_stay_in_order_and_after_finds_the_next_one(ops: list[tuple[str, int, int]], load: int) -> None:
    keys: SortedKeys[Key] = SortedKeys(load)
    model: list[Key] = []
    for kind, a, b in ops:
        if kind == "add":
            key = (float(a), b, f"t{b}")
            if key not in model:
                keys.add(key)
                bisect.insort(model, key)
        elif kind == "remove" and model:
            key = model.pop(a % len(model))
            keys.remove(key)
        elif kind == "after":
            cursor = (float(a), b - 0.5, f"t{b}")  # the pass's cursor: just below a granted rank
            i = bisect.bisect_right(model, cursor)
            assert keys.after(cursor) == (model[i] if i < len(model) else None)
        assert keys.first() == (model[0] if model else None)
        assert len(keys) == len(model)
    assert list(keys) == model
    check_shape(keys)


def test_removing_a_key_that_is_not_held_raises_and_changes_nothing() -> None:
    keys: SortedKeys[Key] = SortedKeys(2)
    for i in range(10):
        keys.add((float(i), i, f"t{i}"))
    with pytest.raises(KeyError):
        keys.remove((4.0, 5, "t5"))
    with pytest.raises(KeyError):
        keys.remove((99.0, 0, ""))
    assert [k[1] for k in keys] == list(range(10))
    check_shape(keys)


def test_a_long_run_of_rising_keys_then_removing_the_lowest_keeps_buckets_short() -> None:
    # The saturated pool's pattern: new heads join above every key, the lowest leaves.
    keys: SortedKeys[Key] = SortedKeys(8)
    for i in range(1000):
        keys.add((float(i), i, f"t{i}"))
        if i % 3:
            first = keys.first()
            assert first is not None
            keys.remove(first)
        check_shape(keys)
    assert len(keys) == 334

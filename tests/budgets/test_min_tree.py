"""budgets.min_tree against a plain dict, over random operation sequences (hypothesis)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from budgets.min_tree import MinMap, MinTree, MostlyInOrder
from tests.support import examples

NAMES = [f"t{i}" for i in range(40)]  # enough to grow the tree past a few powers of two

op = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(NAMES), st.integers(0, 12)),  # ties are common
    st.tuples(st.just("rise"), st.sampled_from(NAMES), st.integers(1, 5)),
    st.tuples(st.just("drop"), st.sampled_from(NAMES), st.integers(0, 0)),
)


@given(st.lists(op, max_size=300))
@settings(max_examples=examples(300), deadline=None)
def test_the_lowest_key_and_the_lowest_of_the_others_are_always_exact(
    ops: list[tuple[str, str, int]],
) -> None:
    tree: MinMap[str, float] = MinMap(math.inf)
    model: dict[str, float] = {}
    for kind, name, x in ops:
        if kind == "set":
            tree.set(name, float(x))
            model[name] = float(x)
        elif kind == "rise" and name in model:
            model[name] += x
            tree.set(name, model[name])
        elif kind == "drop":
            tree.discard(name)
            model.pop(name, None)
        assert len(tree) == len(model)
        assert tree.lowest() == min(model.values(), default=math.inf)
        for other in NAMES[:6]:
            rest = [v for n, v in model.items() if n != other]
            assert tree.lowest_other(other) == min(rest, default=math.inf)
    assert sorted(tree.keys()) == sorted(model.values())
    cells = tree.cells  # every inner cell the lower of its two children, after growth too
    assert all(cells[i] == min(cells[2 * i], cells[2 * i + 1]) for i in range(1, tree.cap))


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=200), st.data())
@settings(max_examples=examples(100), deadline=None)
def test_slots_are_reused_and_tuple_keys_order_like_tuples(values: list[int], data: st.DataObject) -> None:
    tree: MinTree[tuple[float, int, str]] = MinTree((math.inf, 0, ""))
    live: dict[int, tuple[float, int, str]] = {}
    for seq, v in enumerate(values):
        key = (float(v), seq, f"t{seq}")
        live[tree.add(key)] = key
        if data.draw(st.booleans()):
            slot = data.draw(st.sampled_from(sorted(live)))
            tree.remove(slot)
            del live[slot]
        assert tree.lowest() == min(live.values(), default=(math.inf, 0, ""))
    assert len(tree) == len(live)
    assert tree.cap < 2 * max(len(values), 1) + 2  # freed slots are handed out again


def test_keys_that_rise_in_turn_keep_the_lowest_exact_at_every_step() -> None:
    # The round a lazy heap stalls on (every member served once, in turn): here each step is one
    # path of the tree, and the lowest is right after each.
    tree: MinMap[int, float] = MinMap(math.inf)
    for t in range(1000):
        tree.set(t, 0.0)
    for t in range(1000):
        tree.set(t, 1.0)
        assert tree.lowest() == (0.0 if t < 999 else 1.0)
    tree.discard(0)
    assert tree.lowest() == 1.0 and len(tree) == 999
    assert tree.cap == 1024


@given(st.lists(st.tuples(st.booleans(), st.integers(-3, 10), st.integers(0, 30)), max_size=300))
@settings(max_examples=examples(200), deadline=None)
def test_mostly_in_order_keys_come_out_lowest_first_wherever_they_were_kept(
    ops: list[tuple[bool, int, int]],
) -> None:
    # Keys mostly rise (a clock that moves on), some come in late; names leave at random.
    keys: MostlyInOrder[int, tuple[float, int]] = MostlyInOrder((math.inf, 0))
    model: dict[int, tuple[float, int]] = {}
    clock = 0
    for seq, (leave, step, victim) in enumerate(ops):
        if leave:
            keys.discard(victim)
            model.pop(victim, None)
        else:
            clock += max(step, 0)
            name = seq if step % 4 else victim  # now and then a name that may be there: it moves
            key = (float(clock + min(step, 0)), name)  # a negative step: enqueued before the last
            keys.add(name, key)
            model[name] = key
        assert len(keys) == len(model) and bool(keys) == bool(model)
        assert keys.lowest() == min(model.values(), default=(math.inf, 0))
    while model:  # taken out lowest first, as promote and the deadline timer do
        low = keys.lowest()
        assert low == min(model.values())
        keys.discard(low[1])
        del model[low[1]]
    assert keys.lowest() == (math.inf, 0) and not keys

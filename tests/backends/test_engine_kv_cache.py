import pytest

from backends.engine.kv_cache import BlockManager


def test_allocate_grows_table_by_whole_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5)
    assert bm.num_blocks_of("a") == 2
    assert bm.allocate("a", 8)  # still two blocks
    assert bm.num_blocks_of("a") == 2
    assert bm.allocate("a", 9)
    assert bm.num_blocks_of("a") == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 12)
    table_before = list(bm.block_table("a"))
    assert not bm.allocate("a", 24)  # needs 3 more, only 1 free
    assert list(bm.block_table("a")) == table_before
    assert bm.num_free_blocks == 1
    assert not bm.allocate("b", 8)
    assert bm.num_blocks_of("b") == 0


def test_free_returns_blocks_and_is_idempotent() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 6)
    bm.allocate("b", 5)
    assert bm.num_free_blocks == 0
    assert bm.free("a") == 3
    assert bm.free("a") == 0
    assert bm.num_free_blocks == 3
    assert bm.allocate("c", 6)
    assert set(bm.block_table("b")).isdisjoint(bm.block_table("c"))
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 6
    assert bm.owners() == []


def test_freed_table_held_by_a_plan_is_not_mutated() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)
    table = bm.block_table("a")
    snapshot = list(table)
    bm.free("a")
    bm.allocate("b", 8)
    assert list(table) == snapshot


@pytest.mark.parametrize(("blocks", "size"), [(0, 16), (4, 0)])
def test_rejects_bad_geometry(blocks: int, size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=blocks, block_size=size)

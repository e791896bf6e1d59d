"""Tests for vllmini.block_table: BlockTable (one sequence's page table) and block_fill. BlockManager
(many tables over one pool) is tested in tests/test_block_manager.py."""

import pytest

from vllmini import BlockAllocator, BlockTable, OutOfBlocksError
from vllmini.block_table import block_fill
from vllmini.errors import InvalidIndexError


def table_state(t: BlockTable):
    a = t.allocator
    return (
        t.block_ids,
        t.num_tokens,
        list(t.pending_copies),
        a.free_block_ids,
        [a.ref_count(b) for b in range(a.num_blocks)],
    )


# ==== BlockTable


def test_new_table_is_empty():
    t = BlockTable(BlockAllocator(4), 4)
    assert t.block_size == 4
    assert (t.block_ids, t.num_tokens, t.num_blocks, t.pending_copies) == ([], 0, 0, [])
    assert t.slot_mapping() == []
    assert "num_tokens=0" in repr(t)


@pytest.mark.parametrize("bs, err", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("4", TypeError)])
def test_table_rejects_bad_block_size(bs, err):
    with pytest.raises(err, match="block_size"):
        BlockTable(BlockAllocator(2), bs)


def test_table_needs_an_allocator():
    with pytest.raises(TypeError, match="BlockAllocator"):
        BlockTable(8, 4)


def test_append_allocates_only_when_last_block_is_full():
    a = BlockAllocator(8)
    t = BlockTable(a, 4)
    assert t.num_new_blocks(0) == 0
    assert t.num_new_blocks(1) == 1
    assert t.num_new_blocks(5) == 2
    assert t.append_tokens(3) == [0, 1, 2]
    assert t.block_ids == [0] and a.num_free_blocks == 7
    assert t.num_new_blocks(1) == 0
    assert t.append_tokens() == [3]  # fills block 0: no new block
    assert a.num_free_blocks == 7
    assert t.num_new_blocks(1) == 1
    assert t.append_tokens(1) == [4]  # block 0 full: take block 1
    assert t.block_ids == [0, 1] and t.num_tokens == 5 and t.num_blocks == 2
    assert t.append_tokens(0) == []


def test_slots_follow_non_contiguous_blocks():
    a = BlockAllocator(6)
    other = BlockTable(a, 4)
    t = BlockTable(a, 4)
    other.append_tokens(4)  # block 0
    t.append_tokens(2)  # block 1
    other.append_tokens(4)  # block 2
    t.append_tokens(5)  # fills block 1, then block 3
    assert t.block_ids == [1, 3]
    assert t.slot_mapping() == [4, 5, 6, 7, 12, 13, 14]
    assert [t.slot(i) for i in range(7)] == t.slot_mapping()
    assert t.slot(5) == 3 * 4 + 1
    assert t.slot_mapping(2, 5) == [6, 7, 12]
    assert t.slot_mapping(3, 3) == []
    assert t.slot_mapping(6) == [14]


def test_block_ids_is_a_copy():
    t = BlockTable(BlockAllocator(4), 2)
    t.append_tokens(3)
    ids = t.block_ids
    ids.append(99)
    assert t.block_ids == [0, 1]


def test_adopt_takes_blocks_whose_count_fits_the_tokens():
    alloc = BlockAllocator(8)
    t = BlockTable(alloc, block_size=4)
    ids = [alloc.allocate() for _ in range(2)]
    t.adopt(ids, 7)
    assert t.block_ids == ids and t.num_tokens == 7 and t.slot(6) == ids[1] * 4 + 2
    with pytest.raises(InvalidIndexError, match="9 tokens need 3 blocks of 4, got 2"):
        t.adopt(ids, 9)
    assert t.block_ids == ids and t.num_tokens == 7  # unchanged


@pytest.mark.parametrize("i", [-1, 5, 100])
def test_slot_out_of_range_raises_index_error(i):
    t = BlockTable(BlockAllocator(4), 4)
    t.append_tokens(5)
    with pytest.raises(InvalidIndexError, match=f"token_index {i}"):
        t.slot(i)


@pytest.mark.parametrize("start, end", [(-1, 2), (3, 2), (0, 6), (6, None)])
def test_slot_mapping_bad_range_raises(start, end):
    t = BlockTable(BlockAllocator(4), 4)
    t.append_tokens(5)
    with pytest.raises(InvalidIndexError, match="start"):
        t.slot_mapping(start, end)


@pytest.mark.parametrize("n, err", [(-1, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_token_counts_raise_and_change_nothing(n, err):
    t = BlockTable(BlockAllocator(4), 4)
    t.append_tokens(2)
    before = table_state(t)
    with pytest.raises(err, match="num_tokens"):
        t.append_tokens(n)
    with pytest.raises(err, match="num_tokens"):
        t.num_new_blocks(n)
    assert table_state(t) == before


def test_append_out_of_blocks_is_all_or_nothing():
    a = BlockAllocator(3)
    t = BlockTable(a, 4)
    t.append_tokens(6)  # blocks 0, 1; 2 slots left in block 1
    before = table_state(t)
    with pytest.raises(OutOfBlocksError, match="needs 2 new blocks, but only 1 are free"):
        t.append_tokens(7)  # would need blocks for tokens 8..12: two more
    assert table_state(t) == before
    assert t.append_tokens(6) == [6, 7, 8, 9, 10, 11]  # exactly fits
    assert a.num_free_blocks == 0


def test_fork_shares_every_block():
    a = BlockAllocator(6)
    t = BlockTable(a, 4)
    t.append_tokens(6)
    child = t.fork()
    assert child is not t and child.allocator is a and child.block_size == 4
    assert child.block_ids == t.block_ids == [0, 1]
    assert child.num_tokens == 6 and child.pending_copies == []
    assert a.ref_count(0) == a.ref_count(1) == 2
    assert child.slot_mapping() == t.slot_mapping()


def test_append_to_shared_partial_block_copies_on_write():
    a = BlockAllocator(6)
    parent = BlockTable(a, 4)
    parent.append_tokens(6)  # [0, 1], block 1 half full
    child = parent.fork()
    assert child.num_new_blocks(1) == 1  # the copy
    assert child.num_new_blocks(3) == 2  # the copy and one more block
    slots = child.append_tokens(1)
    assert child.block_ids == [0, 2]  # block 0 still shared (full), block 1 copied into 2
    assert child.pending_copies == [(1, 2)]
    assert slots == [2 * 4 + 2]
    assert (a.ref_count(0), a.ref_count(1), a.ref_count(2)) == (2, 1, 1)
    # the parent now owns block 1 alone: it writes in place, no copy
    assert parent.num_new_blocks(1) == 0
    assert parent.append_tokens(1) == [6]
    assert parent.pending_copies == []


def test_append_after_full_shared_block_needs_no_copy():
    a = BlockAllocator(4)
    parent = BlockTable(a, 2)
    parent.append_tokens(4)  # two full blocks
    child = parent.fork()
    assert child.append_tokens(1) == [4]  # fresh block 2, shared blocks untouched
    assert child.pending_copies == [] and child.block_ids == [0, 1, 2]


def test_copy_on_write_out_of_blocks_changes_nothing():
    a = BlockAllocator(2)
    parent = BlockTable(a, 4)
    parent.append_tokens(5)
    child = parent.fork()
    before = table_state(child), table_state(parent)
    with pytest.raises(OutOfBlocksError):
        child.append_tokens(1)
    assert (table_state(child), table_state(parent)) == before


def test_free_returns_every_block_and_empties_table():
    a = BlockAllocator(4)
    t = BlockTable(a, 2)
    t.append_tokens(5)
    t.free()
    assert (t.block_ids, t.num_tokens, t.num_blocks) == ([], 0, 0)
    assert a.num_free_blocks == 4
    assert a.free_block_ids[:3] == (0, 1, 2)  # freed last block first: the table's first block is next
    t.free()  # freeing an empty table is fine
    assert a.num_free_blocks == 4


def test_free_of_a_fork_keeps_shared_blocks_alive():
    a = BlockAllocator(4)
    parent = BlockTable(a, 2)
    parent.append_tokens(3)
    child = parent.fork()
    child.append_tokens(1)  # copy-on-write of block 1 into block 2
    child.free()
    assert child.pending_copies == []  # never copy into a block that went back to the pool
    assert parent.block_ids == [0, 1]
    assert [a.ref_count(b) for b in range(4)] == [1, 1, 0, 0]


def test_block_fill_counts_each_physical_block_once():
    # seq A: 5 tokens in blocks 3, 0; seq B (a fork of A grown to 6) shares block 3, owns block 1
    assert block_fill([([3, 0], 5), ([3, 1], 6)], 4) == {3: 4, 0: 1, 1: 2}
    assert block_fill([], 4) == {} and block_fill([([], 0)], 4) == {}

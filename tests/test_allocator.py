"""Tests for vllmini.allocator.BlockAllocator: the free list, reference counts and every error path."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllmini import BlockAllocator, BlockIdError, OutOfBlocksError, VllminiError


def state(a: BlockAllocator):
    """Everything observable about an allocator, to check that failed calls change nothing."""
    return a.free_block_ids, tuple(a.ref_count(b) for b in range(a.num_blocks)), a.num_free_blocks


# ---- construction


def test_fresh_pool_is_all_free_in_order():
    a = BlockAllocator(5)
    assert a.num_blocks == 5
    assert a.num_free_blocks == 5
    assert a.num_used_blocks == 0
    assert a.free_block_ids == (0, 1, 2, 3, 4)
    assert all(a.ref_count(b) == 0 for b in range(5))


@pytest.mark.parametrize("n", [0, -1, -100])
def test_non_positive_pool_is_rejected(n):
    with pytest.raises(ValueError, match=str(n)):
        BlockAllocator(n)


@pytest.mark.parametrize("n", [2.0, "4", None, True])
def test_non_int_pool_is_rejected(n):
    with pytest.raises(TypeError, match="num_blocks"):
        BlockAllocator(n)


def test_numpy_int_pool_size_is_fine():
    assert BlockAllocator(np.int64(3)).num_blocks == 3
    with pytest.raises(TypeError, match="num_blocks must be an int, got bool"):
        BlockAllocator(np.True_)


def test_huge_pool_is_lazy():
    """10**12 blocks: ids never handed out are implicit, so construction and O(1) calls cost nothing."""
    a = BlockAllocator(10**12)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    a.free(1)
    assert a.allocate() == 1 and a.allocate() == 3  # last freed first, then the never-used ids in order
    assert a.num_free_blocks == 10**12 - 4 and a.num_used_blocks == 4
    assert a.ref_count(10**12 - 1) == 0
    with pytest.raises(BlockIdError, match="unknown block id 1000000000000"):
        a.ref_count(10**12)


def test_repr_names_the_pool():
    assert repr(BlockAllocator(3)) == "BlockAllocator(num_blocks=3, num_free_blocks=3)"


# ---- allocate / free


def test_allocate_hands_out_lowest_first_with_ref_count_one():
    a = BlockAllocator(4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert a.ref_count(1) == 1
    assert a.num_free_blocks == 1
    assert a.free_block_ids == (3,)


def test_allocate_from_empty_pool_raises_and_changes_nothing():
    a = BlockAllocator(2)
    a.allocate()
    a.allocate()
    before = state(a)
    with pytest.raises(OutOfBlocksError, match="all 2 blocks"):
        a.allocate()
    assert state(a) == before
    assert (
        issubclass(OutOfBlocksError, VllminiError)
        and issubclass(BlockIdError, VllminiError)
        and issubclass(BlockIdError, IndexError)
    )


def test_free_returns_block_and_it_is_reused_first():
    a = BlockAllocator(4)
    ids = [a.allocate() for _ in range(3)]
    a.free(ids[1])
    assert a.ref_count(1) == 0
    assert a.num_free_blocks == 2
    assert a.free_block_ids == (1, 3)  # the block freed last is handed out next
    assert a.allocate() == 1


def test_free_accepts_numpy_ints():
    a = BlockAllocator(2)
    a.allocate()
    a.free(np.int32(0))
    assert a.num_free_blocks == 2


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_free_unknown_block_raises_and_changes_nothing(bad):
    a = BlockAllocator(4)
    a.allocate()
    before = state(a)
    with pytest.raises(BlockIdError, match=f"unknown block id {bad}"):
        a.free(bad)
    assert state(a) == before


def test_double_free_raises_and_changes_nothing():
    a = BlockAllocator(3)
    b = a.allocate()
    a.free(b)
    before = state(a)
    with pytest.raises(BlockIdError, match="free"):
        a.free(b)
    with pytest.raises(BlockIdError, match="block 2"):
        a.free(2)  # never allocated
    assert state(a) == before


@pytest.mark.parametrize("bad", ["0", 0.0, None, False])
def test_block_id_must_be_int(bad):
    a = BlockAllocator(2)
    a.allocate()
    for method in (a.free, a.incref, a.ref_count):
        with pytest.raises(TypeError, match="block_id"):
            method(bad)
    with pytest.raises(TypeError, match="block_id"):
        a.fork([bad])


# ---- reference counts


def test_incref_needs_one_free_per_owner():
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    a.incref(b)
    assert a.ref_count(b) == 3
    a.free(b)
    a.free(b)
    assert a.ref_count(b) == 1 and a.num_free_blocks == 1
    a.free(b)
    assert a.ref_count(b) == 0 and a.num_free_blocks == 2


def test_incref_of_free_or_unknown_block_raises():
    a = BlockAllocator(2)
    before = state(a)
    with pytest.raises(BlockIdError, match="cannot incref block 0"):
        a.incref(0)
    with pytest.raises(BlockIdError, match="unknown block id 7"):
        a.incref(7)
    assert state(a) == before


def test_ref_count_of_unknown_block_raises():
    with pytest.raises(BlockIdError, match="unknown block id 3"):
        BlockAllocator(3).ref_count(3)


def test_fork_increfs_every_block_and_returns_them():
    a = BlockAllocator(4)
    ids = [a.allocate() for _ in range(3)]
    shared = a.fork(ids)
    assert shared == ids and shared is not ids
    assert [a.ref_count(b) for b in range(4)] == [2, 2, 2, 0]
    assert a.fork([]) == []
    assert a.fork((0, 0)) == [0, 0]  # a repeated id is shared twice
    assert a.ref_count(0) == 4


def test_fork_is_all_or_nothing():
    a = BlockAllocator(4)
    a.allocate()
    a.allocate()
    before = state(a)
    with pytest.raises(BlockIdError, match="cannot fork block 3"):
        a.fork([0, 1, 3])
    with pytest.raises(BlockIdError, match="unknown block id 9"):
        a.fork([0, 9])
    assert state(a) == before


# ---- property test: random operations against a plain-Python model


@given(
    num_blocks=st.integers(1, 8),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "incref"]), st.integers(-1, 9)), max_size=60),
)
def test_random_operations_match_a_model(num_blocks, ops):
    a = BlockAllocator(num_blocks)
    refs = {}  # block -> ref count, only allocated blocks
    stack = list(range(num_blocks - 1, -1, -1))  # an eager free list: the next block sits at the end
    for op, b in ops:
        before = state(a)
        if op == "alloc":
            if len(refs) == num_blocks:
                with pytest.raises(OutOfBlocksError):
                    a.allocate()
                assert state(a) == before
            else:
                new = a.allocate()
                assert new not in refs and new == stack.pop()  # same order as an eager free list
                refs[new] = 1
        elif b in refs:
            if op == "free":
                a.free(b)
                refs[b] -= 1
                if refs[b] == 0:
                    del refs[b]
                    stack.append(b)
            else:
                a.incref(b)
                refs[b] += 1
        else:
            with pytest.raises(BlockIdError):
                getattr(a, op)(b)
            assert state(a) == before
        free = a.free_block_ids
        assert free == tuple(reversed(stack)) and a.num_free_blocks == len(stack)
        assert len(set(free)) == len(free) == num_blocks - len(refs)
        assert set(free).isdisjoint(refs)
        assert [a.ref_count(x) for x in range(num_blocks)] == [refs.get(x, 0) for x in range(num_blocks)]

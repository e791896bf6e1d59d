"""Tests for vllmini.block_manager (BlockManager: many page tables over one pool), plus a hypothesis state
machine that drives many sequences and checks the whole pool after every step."""

import numpy as np
import pytest
import torch
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllmini import BlockAllocator, BlockManager, BlockTable, OutOfBlocksError, VllminiError
from vllmini.errors import InvalidIndexError


def manager_state(m: BlockManager):
    a = m.allocator
    tables = {
        s: (m.block_table(s).block_ids, m.seq_len(s), list(m.block_table(s).pending_copies))
        for s in m.seq_ids
    }
    return tables, a.free_block_ids, [a.ref_count(b) for b in range(a.num_blocks)]


# ==== BlockManager


def test_manager_basics():
    m = BlockManager(8, 4)
    assert (m.num_blocks, m.block_size, m.num_free_blocks, m.seq_ids) == (8, 4, 8, [])
    assert isinstance(m.allocator, BlockAllocator)
    assert m.allocate("a", 5) == [0, 1, 2, 3, 4]
    assert m.allocate("b", 2) == [8, 9]
    assert m.seq_ids == ["a", "b"] and len(m) == 2 and "a" in m and "c" not in m
    assert m.seq_len("a") == 5 and m.num_free_blocks == 5
    assert m.block_table("a").block_ids == [0, 1]
    assert m.append("a", 4) == [5, 6, 7, 12]
    assert m.slot_mapping("a", 3, 6) == [3, 4, 5]
    assert m.slot_mapping("b") == [8, 9]
    assert "num_seqs=2" in repr(m)


@pytest.mark.parametrize(
    "args, err",
    [((0, 4), ValueError), ((4, 0), ValueError), ((4, 4, -1), ValueError), ((4, 4, 4), ValueError),
     ((4.0, 4), TypeError), ((4, 4, 1.0), TypeError)],
)  # fmt: skip
def test_manager_rejects_bad_arguments(args, err):
    with pytest.raises(err):
        BlockManager(*args)


def test_can_allocate_respects_the_watermark():
    m = BlockManager(8, 4, watermark_blocks=2)
    assert m.watermark_blocks == 2
    assert m.can_allocate(24)  # 6 blocks, 2 left
    assert not m.can_allocate(25)  # 7 blocks, 1 left < watermark
    before = manager_state(m)
    with pytest.raises(OutOfBlocksError, match="watermark"):
        m.allocate(0, 25)
    assert manager_state(m) == before
    m.allocate(0, 24)
    assert m.can_append(0, 8)  # running sequences may dip below the watermark
    m.append(0, 8)
    assert m.num_free_blocks == 0
    assert not m.can_append(0, 1)
    assert not m.can_allocate(0)  # below the watermark: no new sequence, not even an empty one
    with pytest.raises(ValueError, match="num_tokens"):
        m.can_allocate(-1)


def test_allocate_twice_and_unknown_ids_raise():
    m = BlockManager(4, 2)
    m.allocate(1, 3)
    before = manager_state(m)
    with pytest.raises(VllminiError, match="seq_id 1 already exists"):
        m.allocate(1, 1)
    for call in (
        lambda: m.append(7),
        lambda: m.can_append(7),
        lambda: m.free(7),
        lambda: m.fork(7, 8),
        lambda: m.block_table(7),
        lambda: m.seq_len(7),
        lambda: m.slot_mapping(7),
        lambda: m.build_block_tables([1, 7]),
    ):
        with pytest.raises(VllminiError, match="unknown seq_id 7"):
            call()
    with pytest.raises(VllminiError, match="seq_id 1 already exists"):
        m.fork(1, 1)
    assert manager_state(m) == before


def test_manager_append_out_of_blocks_changes_nothing():
    m = BlockManager(2, 2)
    m.allocate(0, 3)
    before = manager_state(m)
    assert not m.can_append(0, 2)
    with pytest.raises(OutOfBlocksError):
        m.append(0, 2)
    assert manager_state(m) == before


def test_manager_fork_free_and_pending_copies():
    m = BlockManager(6, 4)
    m.allocate("p", 6)
    m.fork("p", "c")
    assert m.block_table("c").block_ids == m.block_table("p").block_ids == [0, 1]
    assert m.can_append("c", 1)
    assert m.append("c", 1) == [10]
    assert m.take_pending_copies() == [(1, 2)]
    assert m.take_pending_copies() == []
    m.free("p")
    assert m.seq_ids == ["c"]
    assert [m.allocator.ref_count(b) for b in range(3)] == [1, 0, 1]
    m.free("c")
    assert m.num_free_blocks == 6 and m.seq_ids == []


def test_pending_copy_keeps_its_source_alive_until_taken():
    """Copy-on-write, then the parent freed before take_pending_copies(): the source block must not go
    back to the pool (another sequence would get it, and the copy would read that sequence's KV)."""
    m = BlockManager(3, 4)
    m.allocate("p", 2)  # block 0, half full
    m.fork("p", "c")
    m.append("c", 1)  # copy-on-write of block 0 into block 1
    m.free("p")
    assert m.allocator.ref_count(0) == 1 and m.num_free_blocks == 1  # pinned for the copy
    assert m.allocate("q", 4) == [8, 9, 10, 11]  # block 2, not block 0
    assert m.take_pending_copies() == [(0, 1)]
    assert m.allocator.ref_count(0) == 0 and m.num_free_blocks == 1  # the pin went with the copy
    assert m.take_pending_copies() == []


def test_pending_copy_goes_with_its_destination():
    m = BlockManager(3, 4)
    m.allocate("p", 2)
    m.fork("p", "c")
    m.append("c", 1)
    m.free("p")  # block 0 pinned for c's copy
    m.free("c")  # the copy lost its destination: no copy, no pin
    assert m.take_pending_copies() == [] and m.num_free_blocks == 3
    m.allocate("p", 2)
    m.fork("p", "c")
    m.append("c", 1)
    m.free("c")  # the parent never let go: nothing was pinned
    assert m.take_pending_copies() == [] and m.num_free_blocks == 2
    assert [m.allocator.ref_count(b) for b in range(3)] == [1, 0, 0]


def test_snapshot_and_restore_undo_every_change():
    m = BlockManager(6, 2)
    m.allocate("a", 3)
    m.fork("a", "b")
    before = manager_state(m)
    snapshot = m.snapshot()
    for _ in range(2):  # a snapshot can be restored more than once
        m.append("b", 1)  # copy-on-write
        m.free("a")  # pins a's last block for b's copy
        m.allocate("c", 4)
        m.restore(snapshot)
        assert manager_state(m) == before and m.seq_ids == ["a", "b"]
        assert m.take_pending_copies() == [] and m.num_free_blocks == 4


def test_build_block_tables_pads_with_minus_one():
    m = BlockManager(8, 2)
    m.allocate(0, 5)  # blocks 0, 1, 2
    m.allocate(1, 1)  # block 3
    m.allocate(2, 0)  # no block
    bt, lens = m.build_block_tables([1, 0, 2])
    assert bt.dtype == torch.int32 and lens.dtype == torch.int32
    assert bt.tolist() == [[3, -1, -1], [0, 1, 2], [-1, -1, -1]]
    assert lens.tolist() == [1, 5, 0]
    bt, lens = m.build_block_tables([1], device="cpu")
    assert bt.tolist() == [[3]] and bt.device.type == "cpu"
    bt, lens = m.build_block_tables([])
    assert bt.shape == (0, 0) and lens.shape == (0,)
    bt, lens = m.build_block_tables(iter([2]))
    assert bt.shape == (1, 0) and lens.tolist() == [0]


def test_utilization():
    m = BlockManager(8, 4)
    u = m.utilization()
    assert u == {
        "num_tokens": 0,
        "allocated_slots": 0,
        "pool_slots": 32,
        "used_blocks": 0,
        "free_blocks": 8,
        "token_utilization": 1.0,
        "pool_utilization": 0.0,
    }
    m.allocate(0, 5)
    m.allocate(1, 4)
    u = m.utilization()
    assert (u["num_tokens"], u["allocated_slots"], u["used_blocks"], u["free_blocks"]) == (9, 12, 3, 5)
    assert u["token_utilization"] == 9 / 12 and u["pool_utilization"] == 9 / 32
    m.fork(0, 2)  # shared blocks hold their tokens once
    assert m.utilization()["num_tokens"] == 9
    m.append(2, 1)  # copy-on-write: the copy holds 2 tokens (1 copied + 1 new), the original keeps 1
    u = m.utilization()
    assert (u["num_tokens"], u["used_blocks"]) == (11, 4)


def test_usage_is_utilization_and_sharing_in_one():
    m = BlockManager(8, 4)
    m.allocate(0, 5)
    m.allocate(1, 4)
    assert m.usage(num_tokens=11) == {  # nothing shared: the caller's token count is kept
        "num_tokens": 11,
        "allocated_slots": 12,
        "pool_slots": 32,
        "used_blocks": 3,
        "free_blocks": 5,
        "logical_blocks": 3,
        "shared_blocks": 0,
        "cached_blocks": 0,
    }
    m.fork(0, 2)  # shared: tokens are counted block by block, each shared block once
    u = m.usage(num_tokens=99)
    assert (u["num_tokens"], u["used_blocks"], u["logical_blocks"], u["shared_blocks"]) == (9, 3, 5, 2)


def test_numpy_ints_are_fine_and_bools_are_not():
    m = BlockManager(np.int64(8), np.int32(4), watermark_blocks=np.int64(1))
    assert (m.num_blocks, m.block_size, m.watermark_blocks) == (8, 4, 1)
    assert m.allocate("a", np.int64(5)) == [0, 1, 2, 3, 4]
    assert m.append("a", np.int16(1)) == [5] and m.block_table("a").slot(np.int64(5)) == 5
    with pytest.raises(TypeError, match="block_size must be an int, got bool"):
        BlockTable(BlockAllocator(2), True)
    with pytest.raises(TypeError, match="num_tokens must be an int, got bool"):
        m.append("a", np.True_)
    assert issubclass(InvalidIndexError, IndexError) and issubclass(InvalidIndexError, VllminiError)


# ==== the state machine: many sequences, random allocate / append / fork / free


class ManySequences(RuleBasedStateMachine):
    """Drives a BlockManager and a fake KV cache (slot -> token). After every step the pool must be
    consistent, and reading every sequence's slots must give back exactly its own tokens."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5), data=st.data())
    def setup(self, num_blocks, block_size, data):
        watermark = data.draw(st.integers(0, min(2, num_blocks - 1)))
        self.m = BlockManager(num_blocks, block_size, watermark_blocks=watermark)
        self.cache = {}  # slot -> token value (what a real cache would hold)
        self.tokens = {}  # seq_id -> the token values it should read back
        self.next_id = 0
        self.next_token = 0

    def _write(self, seq_id, slots):
        for src, dst in self.m.take_pending_copies():  # the cache owner's job: copy before writing
            bs = self.m.block_size
            for off in range(bs):
                if src * bs + off in self.cache:
                    self.cache[dst * bs + off] = self.cache[src * bs + off]
        for slot in slots:
            self.cache[slot] = self.next_token
            self.tokens[seq_id].append(self.next_token)
            self.next_token += 1

    @rule(num_tokens=st.integers(0, 14))
    def allocate(self, num_tokens):
        seq_id, before = self.next_id, manager_state(self.m)
        if self.m.can_allocate(num_tokens):
            slots = self.m.allocate(seq_id, num_tokens)
            assert len(slots) == num_tokens
            self.tokens[seq_id] = []
            self._write(seq_id, slots)
            self.next_id += 1
        else:
            with pytest.raises(OutOfBlocksError):
                self.m.allocate(seq_id, num_tokens)
            assert manager_state(self.m) == before

    @precondition(lambda self: len(self.m) > 0)
    @rule(data=st.data(), num_tokens=st.integers(1, 9))
    def append(self, data, num_tokens):
        seq_id = data.draw(st.sampled_from(self.m.seq_ids))
        before = manager_state(self.m)
        if self.m.can_append(seq_id, num_tokens):
            n = self.m.seq_len(seq_id)
            slots = self.m.append(seq_id, num_tokens)
            assert slots == self.m.slot_mapping(seq_id, n)
            self._write(seq_id, slots)
        else:
            with pytest.raises(OutOfBlocksError):
                self.m.append(seq_id, num_tokens)
            assert manager_state(self.m) == before

    @precondition(lambda self: len(self.m) > 0)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.m.seq_ids))
        self.m.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: len(self.m) > 0)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(self.m.seq_ids))
        self.m.free(seq_id)
        del self.tokens[seq_id]

    @rule()
    def free_all(self):
        assume(len(self.m) > 0)
        for seq_id in self.m.seq_ids:
            self.m.free(seq_id)
        self.tokens.clear()
        assert self.m.num_free_blocks == self.m.num_blocks
        assert all(self.m.allocator.ref_count(b) == 0 for b in range(self.m.num_blocks))

    @invariant()
    def pool_is_consistent(self):
        m, a, bs = self.m, self.m.allocator, self.m.block_size
        owners = {}
        for s in m.seq_ids:
            t = m.block_table(s)
            ids = t.block_ids
            assert len(set(ids)) == len(ids)  # a sequence never holds a block twice
            assert len(ids) == -(-t.num_tokens // bs)  # no more blocks than needed
            for b in ids:
                owners[b] = owners.get(b, 0) + 1
        free = a.free_block_ids
        assert len(set(free)) == len(free)
        assert set(free).isdisjoint(owners)  # an owned block is never on the free list
        assert len(free) + len(owners) == m.num_blocks  # free + used = pool
        for b in range(m.num_blocks):
            assert a.ref_count(b) == owners.get(b, 0)  # ref counts match owners

    @invariant()
    def slots_agree_with_tables(self):
        m, bs = self.m, self.m.block_size
        for s in m.seq_ids:
            t = m.block_table(s)
            expect = [t.block_ids[i // bs] * bs + i % bs for i in range(t.num_tokens)]
            assert t.slot_mapping() == expect == [t.slot(i) for i in range(t.num_tokens)]
        if m.seq_ids:
            bt, lens = m.build_block_tables(m.seq_ids)
            assert bt.dtype == lens.dtype == torch.int32
            for row, s in enumerate(m.seq_ids):
                ids = m.block_table(s).block_ids
                assert bt[row, : len(ids)].tolist() == ids
                assert (bt[row, len(ids) :] == -1).all()
                assert lens[row].item() == m.seq_len(s)

    @invariant()
    def usage_agrees_with_utilization_and_sharing(self):
        m = self.m
        u = m.usage(sum(m.seq_len(s) for s in m.seq_ids))
        full, shared = m.utilization(), m.sharing()
        assert [u[k] for k in ("num_tokens", "used_blocks", "free_blocks")] == [
            full[k] for k in ("num_tokens", "used_blocks", "free_blocks")
        ]
        assert [u[k] for k in shared] == list(shared.values())

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        # forked sequences share blocks; copy-on-write must keep each one's tokens intact
        for s in self.m.seq_ids:
            assert [self.cache[slot] for slot in self.m.slot_mapping(s)] == self.tokens[s]

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for s in self.m.seq_ids:
            self.m.free(s)
        assert self.m.num_free_blocks == self.m.num_blocks  # everything returns to the pool
        assert self.m.utilization()["used_blocks"] == 0


TestManySequences = ManySequences.TestCase

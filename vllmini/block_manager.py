"""Every sequence's page table over one shared block pool (notebook 03; sharing: notebook 08): one
`BlockTable` per sequence over a shared `BlockAllocator`, with admission under a watermark, growth, forks
that share blocks (copy-on-write copies handed out by `take_pending_copies`), a `PrefixCache` when enabled,
undo (`snapshot`/`restore`), and the padded `block_tables` / `seq_lens` (vLLM's names) attention reads."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from itertools import zip_longest
from typing import TYPE_CHECKING

from vllmini.allocator import BlockAllocator
from vllmini.block_table import BlockTable, pool_utilization
from vllmini.checks import as_block_size, as_bool, as_hashable, as_int, as_token_ids, cdiv
from vllmini.errors import InvalidArgumentError, InvalidTypeError, OutOfBlocksError, VllminiError
from vllmini.prefix_cache import PrefixCache, extend_hashes

if TYPE_CHECKING:
    import torch


class BlockManager:
    """Page tables for many sequences over one shared block pool."""

    def __init__(
        self, num_blocks: int, block_size: int, watermark_blocks: int = 0, enable_prefix_caching: bool = False
    ):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = as_block_size(block_size)
        # new sequences must leave this many blocks free, so running sequences can still grow
        self.watermark_blocks = as_int(watermark_blocks, "watermark_blocks", min=0, max=self.num_blocks - 1)
        self._tables: dict[Hashable, BlockTable] = {}
        self._pinned: set[int] = set()  # freed blocks kept alive as the source of a pending copy
        enable_prefix_caching = as_bool(enable_prefix_caching, "enable_prefix_caching")
        self.prefix_cache = PrefixCache(self.block_size) if enable_prefix_caching else None

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Plainly free blocks plus cached ones nobody holds (evicted on demand)."""
        return self.allocator.num_free_blocks + self.num_cached_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (a subset of num_free_blocks)."""
        return len(self.prefix_cache.evictable) if self.prefix_cache is not None else 0

    @property
    def seq_ids(self) -> list:
        return list(self._tables)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def block_table(self, seq_id) -> BlockTable:
        """The live page table of `seq_id`."""
        try:
            return self._tables[seq_id]
        except (KeyError, TypeError):
            raise VllminiError(f"unknown seq_id {seq_id!r}; known: {self.seq_ids}") from None

    def seq_len(self, seq_id) -> int:
        return self.block_table(seq_id).num_tokens

    def slot_mapping(self, seq_id, start: int = 0, end: int | None = None) -> list[int]:
        return self.block_table(seq_id).slot_mapping(start, end)

    def _check_shared(self, num_tokens: int, shared) -> list[int]:
        shared = self.allocator.check_all_allocated(shared, "share")
        if len(set(shared)) != len(shared):
            raise InvalidArgumentError(f"shared blocks must be distinct, got {shared}")
        if len(shared) * self.block_size > num_tokens:
            raise InvalidArgumentError(
                f"{len(shared)} shared blocks hold {len(shared) * self.block_size} tokens, more than the "
                f"sequence's num_tokens={num_tokens}: only whole blocks of its prefix can be shared"
            )
        return shared

    def blocks_needed(self, num_tokens: int, shared=()) -> int:
        """Free blocks a new sequence of `num_tokens` starting on the full blocks `shared` takes."""
        shared = self._check_shared(as_int(num_tokens, "num_tokens", min=0), shared)
        cache = self.prefix_cache
        taken = sum(b in cache.evictable for b in shared) if cache is not None else 0
        return cdiv(num_tokens, self.block_size) - len(shared) + taken

    def can_allocate(self, num_tokens: int, shared=()) -> bool:
        """Does a new sequence of `num_tokens` tokens fit, leaving `watermark_blocks` free?"""
        return self.num_free_blocks - self.blocks_needed(num_tokens, shared) >= self.watermark_blocks

    def _make_room(self, num_blocks: int) -> None:
        """Evict cached blocks nobody holds (least recently used first) until `num_blocks` are free."""
        while self.allocator.num_free_blocks < num_blocks and self.num_cached_free_blocks:
            self.allocator.free(self.prefix_cache.evict())

    def allocate(self, seq_id: Hashable, num_tokens: int, shared=()) -> list[int]:
        """Start `seq_id` on full blocks `shared` (a cached prefix, a sibling's) + its own; returns slots."""
        if as_hashable(seq_id, "seq_id") in self._tables:
            raise VllminiError(f"seq_id {seq_id!r} already exists")
        if not self.can_allocate(num_tokens, shared):  # the watermark rule has one home
            needed = self.blocks_needed(num_tokens, shared)
            raise OutOfBlocksError(
                f"seq {seq_id!r} with {num_tokens} tokens needs {needed} blocks; {self.num_free_blocks} "
                f"are free and {self.watermark_blocks} must stay free (watermark)"
            )
        shared = self._check_shared(num_tokens, shared)
        for block_id in shared:
            if self.prefix_cache is not None and block_id in self.prefix_cache.evictable:
                self.prefix_cache.reuse(block_id)  # the cache's reference becomes the sequence's
            else:
                self.allocator.incref(block_id)
        table = BlockTable(self.allocator, self.block_size)
        table.adopt(shared, len(shared) * self.block_size)
        self._make_room(table.num_new_blocks(num_tokens - table.num_tokens))
        table.append_tokens(num_tokens - table.num_tokens)
        self._tables[seq_id] = table
        return table.slot_mapping()

    def can_append(self, seq_id, num_tokens: int = 1) -> bool:
        """Can `seq_id` grow by `num_tokens`? (The watermark does not apply to running sequences.)"""
        return self.block_table(seq_id).num_new_blocks(num_tokens) <= self.num_free_blocks

    def append(self, seq_id, num_tokens: int = 1) -> list[int]:
        """Grow `seq_id` by `num_tokens` tokens; returns the new tokens' slots."""
        table = self.block_table(seq_id)
        try:  # from the plainly free blocks: one call on the decode hot path (most decodes take none)
            return table.append_tokens(num_tokens)
        except OutOfBlocksError:  # nothing changed: evicting cached blocks nobody holds may make room
            needed = table.num_new_blocks(num_tokens)
        if needed > self.num_free_blocks:  # checked before evicting: a failed append keeps the cache
            raise OutOfBlocksError(
                f"seq {seq_id!r} needs {needed} new blocks to grow by {num_tokens} tokens, but only "
                f"{self.num_free_blocks} are free ({self.num_cached_free_blocks} of them cached)"
            )
        self._make_room(needed)
        return table.append_tokens(num_tokens)

    def cached_prefix(self, token_ids: list[int], hashes: list[bytes]) -> list[int]:
        """The cached blocks a new sequence can start on (never its last token); extends its `hashes`."""
        token_ids = as_token_ids(token_ids, "token_ids")
        if not isinstance(hashes, list):
            raise InvalidTypeError(f"hashes must be the sequence's hash chain (a list), got {hashes!r}")
        if self.prefix_cache is None:
            return []
        num_blocks = (len(token_ids) - 1) // self.block_size
        return self.prefix_cache.lookup(
            extend_hashes(hashes, token_ids, num_blocks, self.block_size)[:num_blocks], token_ids
        )

    def cache_full_blocks(
        self, seq_id, token_ids: list[int], hashes: list[bytes], start: int, end: int
    ) -> int:
        """Name by hash the blocks of `seq_id` that tokens [start, end) filled; returns how many are new."""
        if self.prefix_cache is None:
            return 0
        table, bs = self.block_table(seq_id), self.block_size
        start, end = as_int(start, "start", min=0), as_int(end, "end", min=0)
        first, last = start // bs, min(end, table.num_tokens) // bs  # blocks that became full
        extend_hashes(hashes, token_ids, last, bs)
        register, block_ids = self.prefix_cache.register, table.block_ids
        return sum(
            register(block_ids[i], hashes[i], hashes[i - 1] if i else None, token_ids[i * bs : (i + 1) * bs])
            for i in range(first, last)
        )

    def _release(self, block_id: int) -> bool:
        """Keep a cached block whose last owner leaves (as evictable) instead of freeing it."""
        cache = self.prefix_cache
        if cache is None or not cache.is_cached(block_id) or self.allocator.ref_count(block_id) != 1:
            return False
        cache.release(block_id)
        return True

    def fork(self, parent_id, child_id: Hashable) -> None:
        """Start `child_id` as a copy of `parent_id` that shares all its blocks (e.g. parallel sampling)."""
        parent = self.block_table(parent_id)
        if as_hashable(child_id, "seq_id") in self._tables:
            raise VllminiError(f"seq_id {child_id!r} already exists")
        self._tables[child_id] = parent.fork()

    def free(self, seq_id) -> None:
        """Finish `seq_id`: its blocks go back to the pool (a pending copy's source once copies are taken)."""
        table = self.block_table(seq_id)
        del self._tables[seq_id]
        needed = {src for t in self._tables.values() for src, _ in t.pending_copies}
        for block_id in needed.intersection(table.block_ids) - self._pinned:
            self.allocator.incref(block_id)
            self._pinned.add(block_id)
        table.free(self._release)  # drops its own pending copies too: their destination blocks are gone
        for block_id in self._pinned - needed:  # sources nobody has to copy from any more
            self._pinned.discard(block_id)
            self.allocator.free(block_id)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Collect and clear every copy-on-write job (src_block, dst_block); copy them before allocating."""
        pairs = []
        for table in self._tables.values():
            pairs.extend(table.pending_copies)
            table.pending_copies = []
        for block_id in sorted(self._pinned):
            self.allocator.free(block_id)
        self._pinned.clear()
        return pairs

    def snapshot(self) -> tuple:
        """The whole state, for `restore` (e.g. a step whose forward raised). O(num_blocks)."""
        tables = {s: (t, t.block_ids, t.num_tokens, tuple(t.pending_copies)) for s, t in self._tables.items()}
        cache = self.prefix_cache.snapshot() if self.prefix_cache is not None else None
        return self.allocator.snapshot(), tables, set(self._pinned), cache

    def restore(self, snapshot: tuple) -> None:
        """Put back the state `snapshot()` saved (the same table objects); the snapshot stays reusable."""
        allocator, tables, pinned, cache = snapshot
        self.allocator.restore(allocator)
        self._tables = {}
        for seq_id, (table, block_ids, num_tokens, pending) in tables.items():
            table.adopt(block_ids, num_tokens)
            table.pending_copies = list(pending)
            self._tables[seq_id] = table
        self._pinned = set(pinned)
        if cache is not None:  # blocks evicted since the snapshot lose their names; free ones go back
            for block_id in self.prefix_cache.restore(cache):
                self.allocator.free(block_id)

    def build_block_tables(
        self, seq_ids: Iterable, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables int32 [num_seqs, max_num_blocks_per_seq] (-1: none), seq_lens int32 [num_seqs]"""
        import numpy as np
        import torch

        tables = [self.block_table(s) for s in seq_ids]
        # the columns, padded with -1 by zip_longest, then transposed; numpy reads ints faster than torch
        columns = list(zip_longest(*(t.block_ids for t in tables), fillvalue=-1))
        block_tables = np.array(columns, dtype=np.int32).reshape(len(columns), len(tables)).T
        seq_lens = np.array([t.num_tokens for t in tables], dtype=np.int32)  # (S,)
        return torch.from_numpy(block_tables.copy()).to(device), torch.from_numpy(seq_lens).to(device)

    def utilization(self) -> dict:
        """How well the pool is used (`pool_utilization`); free_blocks include cached ones nobody holds."""
        tables = ((t.block_ids, t.num_tokens) for t in self._tables.values())
        used = self.allocator.num_used_blocks - self.num_cached_free_blocks
        return pool_utilization(tables, self.block_size, self.num_blocks, used)

    @property
    def num_pinned_blocks(self) -> int:
        """Freed blocks kept alive only as the source of a copy not yet taken (`take_pending_copies`)."""
        return len(self._pinned)

    def sharing(self) -> dict:
        """What sharing saves now: logical_blocks (held without sharing), shared_blocks, cached_blocks."""
        owners = Counter(b for t in self._tables.values() for b in t.block_ids)  # block -> its sequences
        return {
            "logical_blocks": sum(owners.values()),
            "shared_blocks": sum(k > 1 for k in owners.values()),
            "cached_blocks": self.num_cached_free_blocks,
        }

    def usage(self, num_tokens: int) -> dict:
        """`utilization()` and `sharing()` in O(sequences), for every step, from the caller's `num_tokens`."""
        used = self.num_blocks - self.num_free_blocks
        logical, shared = sum(t.num_blocks for t in self._tables.values()), 0
        if logical > used - self.num_pinned_blocks:  # some physical block has several owners
            num_tokens, shared = self.utilization()["num_tokens"], self.sharing()["shared_blocks"]
        return {
            "num_tokens": num_tokens,
            "allocated_slots": used * self.block_size,
            "pool_slots": self.num_blocks * self.block_size,
            "used_blocks": used,
            "free_blocks": self.num_free_blocks,
            "logical_blocks": logical,
            "shared_blocks": shared,
            "cached_blocks": self.num_cached_free_blocks,
        }

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_seqs={len(self._tables)}, num_free_blocks={self.num_free_blocks})"
        )

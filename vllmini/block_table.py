"""One sequence's page table (notebook 03): logical block i lives in physical block `block_ids[i]`, so

    slot(t) = block_ids[t // block_size] * block_size + t % block_size

Forked tables share blocks (reference counts); writing into a shared, partly filled last block first
copies it (copy-on-write), recorded as (src_block, dst_block) in `pending_copies`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllmini.allocator import BlockAllocator
from vllmini.checks import as_block_size, as_int, cdiv
from vllmini.errors import InvalidIndexError, InvalidTypeError, OutOfBlocksError


def block_fill(tables: Iterable[tuple[Sequence[int], int]], block_size: int) -> dict[int, int]:
    """Tokens held in each physical block of sequences given as (block_ids, num_tokens); shared: once."""
    filled: dict[int, int] = {}  # physical block -> tokens in it
    for block_ids, n in tables:
        for i, block_id in enumerate(block_ids):
            filled[block_id] = max(filled.get(block_id, 0), min(block_size, n - i * block_size))
    return filled


def pool_utilization(tables: Iterable[tuple[Sequence[int], int]], block_size: int, num_blocks: int,
                     used_blocks: int) -> dict:  # fmt: skip
    """How well sequences given as (block_ids, num_tokens) use a pool of `num_blocks`, `used_blocks` held."""
    num_tokens = sum(block_fill(tables, block_size).values())
    allocated_slots, pool_slots = used_blocks * block_size, num_blocks * block_size
    return {
        "num_tokens": num_tokens,
        "allocated_slots": allocated_slots,
        "pool_slots": pool_slots,
        "used_blocks": used_blocks,
        "free_blocks": num_blocks - used_blocks,
        "token_utilization": num_tokens / allocated_slots if allocated_slots else 1.0,
        "pool_utilization": num_tokens / pool_slots,
    }


class BlockTable:
    """One sequence's page table: logical block i -> physical block id."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        if not isinstance(allocator, BlockAllocator):
            raise InvalidTypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        self.allocator, self.block_size = allocator, as_block_size(block_size)
        self._block_ids: list[int] = []
        self._num_tokens = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src_block, dst_block) copy-on-write jobs

    @property
    def block_ids(self) -> list[int]:
        """A copy of the table: element i is the physical block of logical block i."""
        return list(self._block_ids)

    def adopt(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """Hold `block_ids` (references the caller took) with `num_tokens` tokens (a cache hit, an undo)."""
        block_ids = self.allocator.check_all_allocated(block_ids, "adopt")
        num_tokens = as_int(num_tokens, "num_tokens", min=0)
        needed = cdiv(num_tokens, self.block_size)
        if needed != len(block_ids):
            raise InvalidIndexError(
                f"{num_tokens} tokens need {needed} blocks of {self.block_size}, "
                f"got {len(block_ids)} block ids"
            )
        self._block_ids, self._num_tokens = block_ids, num_tokens

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_blocks(self) -> int:
        return len(self._block_ids)

    def _needs_copy(self, num_tokens: int) -> bool:
        """Would writing `num_tokens` more tokens land in a shared, partly filled last block?"""
        if num_tokens == 0 or self._num_tokens % self.block_size == 0:
            return False  # nothing to write, or the last block is full (new tokens go to a new block)
        return not self._owns_last_block()

    def _owns_last_block(self) -> bool:
        return self.allocator.ref_count(self._block_ids[-1]) == 1

    def num_new_blocks(self, num_tokens: int) -> int:
        """How many blocks `append_tokens(num_tokens)` would allocate (copy-on-write included)."""
        num_tokens = as_int(num_tokens, "num_tokens", min=0)
        grow = cdiv(self._num_tokens + num_tokens, self.block_size) - len(self._block_ids)
        return grow + int(self._needs_copy(num_tokens))

    def append_tokens(self, num_tokens: int = 1) -> list[int]:
        """Make room for `num_tokens` more tokens and return their slots. All-or-nothing."""
        start, bs = self._num_tokens, self.block_size
        if type(num_tokens) is int and num_tokens == 1 and start % bs and self._owns_last_block():
            self._num_tokens += 1  # a decode's usual case: the next slot of its own, partly filled last block
            return [self._block_ids[-1] * bs + start % bs]
        needed = self.num_new_blocks(num_tokens)
        if needed and needed > (free := self.allocator.num_free_blocks):  # (most decodes need none)
            raise OutOfBlocksError(
                f"appending {num_tokens} tokens needs {needed} new blocks, but only {free} are free"
            )
        if needed and self._needs_copy(num_tokens):
            src, dst = self._block_ids[-1], self.allocator.allocate()
            self.allocator.free(src)  # drop our reference; the other owners keep theirs
            self._block_ids[-1] = dst
            self.pending_copies.append((src, dst))
        while len(self._block_ids) < cdiv(start + num_tokens, bs):
            self._block_ids.append(self.allocator.allocate())
        self._num_tokens += num_tokens
        return [self._block_ids[t // bs] * bs + t % bs for t in range(start, self._num_tokens)]  # their slots

    def slot(self, token_index: int) -> int:
        """The physical slot (block_id * block_size + offset) that holds token `token_index`."""
        token_index = as_int(token_index, "token_index")
        if not 0 <= token_index < self._num_tokens:
            raise InvalidIndexError(
                f"token_index {token_index} out of range: the sequence has {self._num_tokens}"
            )
        block, offset = divmod(token_index, self.block_size)
        return self._block_ids[block] * self.block_size + offset

    def slot_mapping(self, start: int = 0, end: int | None = None) -> list[int]:
        """Slots of tokens start..end-1 (default: the whole sequence)."""
        start = as_int(start, "start")
        end = self._num_tokens if end is None else as_int(end, "end")
        if not 0 <= start <= end <= self._num_tokens:
            raise InvalidIndexError(
                f"need 0 <= start <= end <= {self._num_tokens}, got start={start}, end={end}"
            )
        bs = self.block_size
        return [self._block_ids[t // bs] * bs + t % bs for t in range(start, end)]

    def fork(self) -> BlockTable:
        """A child table sharing every block of this one (same allocator; ref counts go up)."""
        child = BlockTable(self.allocator, self.block_size)
        child.adopt(self.allocator.fork(self._block_ids), self._num_tokens)
        return child

    def free(self, release=None) -> None:
        """Give every block back, last first, unless `release(block_id)` keeps it (returns True)."""
        for block_id in reversed(self._block_ids):
            if release is None or not release(block_id):
                self.allocator.free(block_id)
        self._block_ids, self._num_tokens = [], 0
        self.pending_copies = []  # their destination blocks are gone: never copy into them

    def __repr__(self) -> str:
        return (
            f"BlockTable(num_tokens={self._num_tokens}, block_size={self.block_size}, "
            f"block_ids={self._block_ids})"
        )

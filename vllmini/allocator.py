"""The block allocator (notebook 02): physical KV-cache block ids with reference counts, in O(1). The free
list is lazy: ids never handed out are implicit (>= a high-water mark), returned ids sit on a stack used
first. A failed call leaves the allocator exactly as it was."""

from collections.abc import Sequence

from vllmini.checks import as_int
from vllmini.errors import BlockIdError, InvalidTypeError, OutOfBlocksError


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1 and takes them back, in O(1)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = as_int(num_blocks, "num_blocks", min=1)
        self._next_unused = 0  # high-water mark: ids >= this were never handed out
        self._free: list[int] = []  # returned ids, a stack: the last freed is reused first (any order works)
        self._ref_counts: dict[int, int] = {}  # allocated block -> owners (>= 1); absent = free

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._next_unused

    @property
    def num_used_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free blocks in the order `allocate()` will hand them out (first = next); O(free blocks)."""
        return tuple(reversed(self._free)) + tuple(range(self._next_unused, self.num_blocks))

    def ref_count(self, block_id: int) -> int:
        """How many owners hold `block_id` (0 when it is free)."""
        return self._ref_counts.get(self._check_id(block_id), 0)

    def allocate(self) -> int:
        """Take the next free block; it starts with ref_count 1."""
        if self._free:
            block_id = self._free.pop()
        elif self._next_unused < self.num_blocks:
            block_id, self._next_unused = self._next_unused, self._next_unused + 1
        else:
            raise OutOfBlocksError(f"no free block left: all {self.num_blocks} blocks are in use")
        self._ref_counts[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one reference to `block_id`; the block returns to the pool when none are left."""
        block_id = self.check_allocated(block_id, "free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            del self._ref_counts[block_id]
            self._free.append(block_id)

    def incref(self, block_id: int) -> None:
        """Add one owner to an allocated block (sharing it, e.g. between a parent and a forked child)."""
        self._ref_counts[self.check_allocated(block_id, "incref")] += 1

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """Share every block in `block_ids` with one more owner; all-or-nothing. Returns the ids."""
        ids = self.check_all_allocated(block_ids, "fork")  # check them all before changing any
        for block_id in ids:
            self._ref_counts[block_id] += 1
        return ids

    def snapshot(self) -> tuple:
        """The free list and reference counts, for `restore` (e.g. undoing a failed engine step)."""
        return self._next_unused, list(self._free), dict(self._ref_counts)

    def restore(self, snapshot: tuple) -> None:
        """Put back what `snapshot()` saved; the snapshot stays reusable."""
        self._next_unused, free, ref_counts = snapshot
        self._free, self._ref_counts = list(free), dict(ref_counts)

    def _check_id(self, block_id) -> int:
        block_id = as_int(block_id, "block_id")
        if not 0 <= block_id < self.num_blocks:
            raise BlockIdError(f"unknown block id {block_id}: expected 0 <= block_id < {self.num_blocks}")
        return block_id

    def check_allocated(self, block_id, action: str) -> int:
        """`block_id` as an int if it is allocated; BlockIdError naming `action` otherwise."""
        block_id = self._check_id(block_id)
        if block_id not in self._ref_counts:
            raise BlockIdError(f"cannot {action} block {block_id}: it is free (not allocated)")
        return block_id

    def check_all_allocated(self, block_ids, action: str) -> list[int]:
        """`block_ids` (a list, tuple or range) as ints if every one is allocated."""
        if not isinstance(block_ids, (list, tuple, range)):
            raise InvalidTypeError(f"cannot {action} block_ids {block_ids!r}: expected a list of block ids")
        return [self.check_allocated(b, action) for b in block_ids]

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free_blocks={self.num_free_blocks})"

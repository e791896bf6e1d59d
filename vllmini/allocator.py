"""The block allocator: a pool of physical KV-cache block ids with reference counts.

The KV cache is cut into `num_blocks` fixed-size blocks. The allocator knows nothing about tokens or
tensors; it only hands out block ids and takes them back. A free list (a Python list used as a stack)
makes `allocate()` and `free()` O(1), and a reference count per block lets several sequences share a
block (after a fork) until the last owner lets go.

Every method checks its arguments first and changes state only after all checks passed, so a failed
call leaves the allocator exactly as it was.
"""

import operator
from collections.abc import Sequence

from vllmini.errors import OutOfBlocksError, VllminiError


def _as_int(value, name: str) -> int:
    """`value` as a Python int (numpy/torch integers are fine); TypeError for anything else."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1 and takes them back, in O(1)."""

    def __init__(self, num_blocks: int):
        num_blocks = _as_int(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # the free list is a stack: the next block to hand out sits at the END of the list, so block 0
        # comes first on a fresh pool and the block freed last is reused first (any order is correct)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks  # 0 = free, k = k owners

    # ----------------------------------------------------------------------------------------------
    # read-only views

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free blocks in the order `allocate()` will hand them out (first = next)."""
        return tuple(reversed(self._free))

    def ref_count(self, block_id: int) -> int:
        """How many owners hold `block_id` (0 when it is free)."""
        return self._ref_counts[self._check_id(block_id)]

    # ----------------------------------------------------------------------------------------------
    # state changes

    def allocate(self) -> int:
        """Take a free block off the free list; it starts with ref_count 1."""
        if not self._free:
            raise OutOfBlocksError(f"no free block left: all {self.num_blocks} blocks are in use")
        block_id = self._free.pop()
        self._ref_counts[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one reference to `block_id`; the block returns to the pool when none are left."""
        block_id = self._check_allocated(block_id, "free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)

    def incref(self, block_id: int) -> None:
        """Add one owner to an allocated block (sharing it, e.g. between a parent and a forked child)."""
        block_id = self._check_allocated(block_id, "incref")
        self._ref_counts[block_id] += 1

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """Share every block in `block_ids` with one more owner; all-or-nothing. Returns the ids."""
        ids = [self._check_allocated(b, "fork") for b in block_ids]  # check them all before changing any
        for block_id in ids:
            self._ref_counts[block_id] += 1
        return ids

    # ----------------------------------------------------------------------------------------------
    # checks

    def _check_id(self, block_id) -> int:
        block_id = _as_int(block_id, "block_id")
        if not 0 <= block_id < self.num_blocks:
            raise VllminiError(f"unknown block id {block_id}: expected 0 <= block_id < {self.num_blocks}")
        return block_id

    def _check_allocated(self, block_id, action: str) -> int:
        block_id = self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise VllminiError(f"cannot {action} block {block_id}: it is free (not allocated)")
        return block_id

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free_blocks={self.num_free_blocks})"

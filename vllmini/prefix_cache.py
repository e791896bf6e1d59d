"""Prefix caching (notebook 08): full KV blocks found again by what they hold, so alike requests share them.
A block's K/V depends on every token before it, so a block is named by a hash chain: hash(block i) =
SHA-256(hash(block i-1), its token ids), truncated to 16 bytes. A hit is checked against the stored parent
hash and token ids. A cached block whose last owner leaves waits, still findable, in an LRU list
(`evictable`) until its memory is needed (vLLM v1: `vllm/v1/core/block_pool.py`)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

HASH_BYTES = 16  # 128 bits: a collision is the only way a wrong block could be served


def block_hash(parent: bytes | None, token_ids) -> bytes:
    """The chain hash of one full block: H(parent's hash, its token ids). parent None = first block."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())  # token ids as int64s
    return h.digest()[:HASH_BYTES]


def extend_hashes(hashes: list[bytes], token_ids: list[int], num_blocks: int, block_size: int) -> list[bytes]:
    """Grow `hashes` (the chain of a sequence's first blocks, kept between calls) to `num_blocks` entries."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else None
        hashes.append(block_hash(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


class PrefixCache:
    """hash -> block for full computed blocks, and the LRU list of cached blocks no sequence holds."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}  # hash -> physical block
        self._entry: dict[int, tuple] = {}  # block -> (hash, parent's hash or None, tuple of token ids)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, oldest first
        self.evicted: list[int] = []  # blocks evicted since the last snapshot (their pages may be rewritten)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entry)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entry

    def hash_of(self, block_id: int) -> bytes | None:
        return self._entry[block_id][0] if block_id in self._entry else None

    def lookup(self, hashes: list[bytes], token_ids: list[int]) -> list[int]:
        """The blocks of the longest cached prefix of a sequence whose chain is `hashes`."""
        blocks, bs = [], self.block_size
        for i, h in enumerate(hashes):
            block = self._block_of.get(h)
            if block is None:
                break
            _, parent, ids = self._entry[block]
            # a hash collision must not hand out another prefix's K/V: compare what the block holds
            if parent != (hashes[i - 1] if i else None) or ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            blocks.append(block)
        return blocks

    def register(self, block_id: int, h: bytes, parent: bytes | None, token_ids) -> bool:
        """Name a full, computed block by its hash; False if it has a name or another block has this one."""
        if block_id in self._entry or h in self._block_of:
            return False
        self._block_of[h] = block_id
        self._entry[block_id] = (h, parent, tuple(token_ids))
        return True

    def release(self, block_id: int) -> None:
        """Its last owner left: keep it findable, as the most recently used evictable block."""
        assert block_id in self._entry and block_id not in self.evictable
        self.evictable[block_id] = None

    def reuse(self, block_id: int) -> None:
        """An evictable block was hit: a sequence holds it again, so it cannot be evicted."""
        del self.evictable[block_id]

    def evict(self) -> int:
        """Forget the least recently used evictable block; returns it (the caller frees its page)."""
        block_id, _ = self.evictable.popitem(last=False)
        self.uncache(block_id)
        self.evicted.append(block_id)
        return block_id

    def uncache(self, block_id: int) -> None:
        """Drop a block's hash entry (it stays allocated if someone holds it)."""
        del self._block_of[self._entry.pop(block_id)[0]]
        self.evictable.pop(block_id, None)

    def snapshot(self) -> tuple:
        """The whole cache, for `restore`; starts a new log of evictions."""
        self.evicted = []
        return dict(self._block_of), dict(self._entry), list(self.evictable)

    def restore(self, snapshot: tuple) -> list[int]:
        """Put back `snapshot()`'s cache; blocks evicted since come back unnamed (their pages may have been
        written). Returns those that were evictable (now plainly free)."""
        block_of, entry, evictable = snapshot
        self._block_of, self._entry = dict(block_of), dict(entry)
        self.evictable = OrderedDict.fromkeys(evictable)
        freed = []
        for block_id in self.evicted:
            if block_id in self._entry:
                if block_id in self.evictable:
                    freed.append(block_id)
                self.uncache(block_id)
        self.evicted = []
        return freed

    def __repr__(self) -> str:
        return f"PrefixCache(cached_blocks={len(self._entry)}, evictable={len(self.evictable)})"

"""What a page-table picture needs, copied out of the live objects (so drawing can never change them).

`snapshot` accepts a `BlockManager`, one `BlockTable`, or a dict seq_id -> table (a `BlockTable` or any
table with the same four attributes, e.g. one a learner wrote) and returns a `Snapshot` of plain lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllmini.allocator import BlockAllocator
from vllmini.block_manager import BlockManager
from vllmini.block_table import BlockTable, block_fill, pool_utilization
from vllmini.checks import as_index, as_pair
from vllmini.errors import InvalidArgumentError, InvalidTypeError

TABLE_ATTRS = ("block_ids", "num_tokens", "block_size", "allocator")


@dataclass
class Snapshot:
    """Plain copies of everything the picture needs."""

    block_size: int
    num_blocks: int
    seqs: list[tuple[object, list[int], int]]  # (seq_id, block_ids, num_tokens) of the sequences to draw
    ref_counts: list[int]  # the allocator's, per physical block
    free_ids: tuple[int, ...]  # the free list, next first
    copies: list[tuple[int, int]]  # copy-on-write (src_block, dst_block) pairs: pending or just made
    util: dict  # BlockManager.utilization() of the whole pool
    owners: dict[int, list] = field(default_factory=dict)  # block -> seq_ids holding it (every sequence)
    fill: dict[int, int] = field(default_factory=dict)  # block -> slots holding tokens
    cached: set[int] = field(default_factory=set)  # blocks named in the prefix cache (in use or not)
    cached_free: tuple[int, ...] = ()  # cached blocks nobody holds, least recently used (evicted) first

    def pinned(self, block_id: int) -> bool:
        """Held by no sequence and not by the cache: kept alive as the source of a pending copy."""
        cache_hold = block_id in self.cached_free
        return self.ref_counts[block_id] > len(self.owners.get(block_id, ())) + cache_hold


def is_table(obj) -> bool:
    """A BlockTable, or any page table with the same four attributes."""
    return isinstance(obj, BlockTable) or all(hasattr(obj, a) for a in TABLE_ATTRS)


def _tables_of(obj, allocator: BlockAllocator | None) -> tuple[dict, BlockAllocator]:
    """The tables to draw and their allocator, checked."""
    if isinstance(obj, BlockManager):
        tables, allocator = {s: obj.block_table(s) for s in obj.seq_ids}, allocator or obj.allocator
    elif is_table(obj):
        tables = {0: obj}
    elif isinstance(obj, dict):
        tables = dict(obj)
    else:
        raise InvalidTypeError(
            f"manager_or_tables must be a BlockManager, a BlockTable or a dict seq_id -> BlockTable, "
            f"got {type(obj).__name__}"
        )
    for seq_id, table in tables.items():
        if not is_table(table):
            raise InvalidTypeError(
                f"tables[{seq_id!r}] is a {type(table).__name__}, expected a BlockTable "
                f"(or a table of your own with {', '.join(TABLE_ATTRS)})"
            )
    if allocator is None:
        if not tables:
            raise InvalidArgumentError("an empty dict of tables needs allocator= to know the pool")
        allocator = next(iter(tables.values())).allocator
    if not isinstance(allocator, BlockAllocator):
        raise InvalidTypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
    if any(t.allocator is not allocator for t in tables.values()):
        raise InvalidArgumentError("every table must use the allocator being drawn")
    return tables, allocator


def snapshot(manager_or_tables, allocator: BlockAllocator | None = None, seq_ids=None, copies=()) -> Snapshot:
    """Copy what the picture needs; `copies` adds copy-on-write pairs already taken from the tables."""
    obj = manager_or_tables
    if isinstance(obj, Snapshot):  # taken earlier (the explorer takes it under its lock)
        return obj
    tables, allocator = _tables_of(obj, allocator)
    sizes = {t.block_size for t in tables.values()}
    if len(sizes) > 1:
        raise InvalidArgumentError(f"all tables must share one block_size, got {sorted(sizes)}")
    block_size = sizes.pop() if sizes else getattr(obj, "block_size", 1)
    fills = [(t.block_ids, t.num_tokens) for t in tables.values()]
    num_blocks = allocator.num_blocks
    if isinstance(obj, BlockManager):
        util, cache = obj.utilization(), obj.prefix_cache
    else:  # bare tables: every block in use is theirs
        util = pool_utilization(fills, block_size, num_blocks, allocator.num_used_blocks)
        cache = None
    owners: dict[int, list] = {}
    for seq_id, table in tables.items():
        for block_id in table.block_ids:
            owners.setdefault(block_id, []).append(seq_id)
    if seq_ids is not None:
        missing = [s for s in seq_ids if s not in tables]
        if missing:
            raise InvalidArgumentError(f"seq_ids {missing} not found; known: {list(tables)}")
    drawn = tables if seq_ids is None else {s: tables[s] for s in seq_ids}
    pending = [tuple(pair) for t in tables.values() for pair in getattr(t, "pending_copies", [])]
    copies = [
        tuple(as_index(b, f"copies[{i}] block", num_blocks) for b in as_pair(pair, f"copies[{i}]"))
        for i, pair in enumerate(copies)
    ]
    return Snapshot(
        block_size=block_size,
        num_blocks=num_blocks,
        seqs=[(s, list(t.block_ids), t.num_tokens) for s, t in drawn.items()],
        ref_counts=[allocator.ref_count(b) for b in range(num_blocks)],
        free_ids=allocator.free_block_ids,
        copies=list(dict.fromkeys([*pending, *copies])),
        util=util,
        owners=owners,
        fill=block_fill(fills, block_size),
        cached={b for b in range(num_blocks) if cache.is_cached(b)} if cache else set(),
        cached_free=tuple(cache.evictable) if cache else (),
    )

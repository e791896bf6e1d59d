"""Where the blocks of the page-table picture go: logical blocks stacked per sequence on the left, the
physical pool in columns on the right, in data units (a token slot is `cell` wide, rows 1 apart).
Long sequences show their first and last blocks, big pools the blocks in use, the copies and the next
free and cached ones; the rest is summarized as gaps."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllmini.checks import cdiv
from vllmini.course.snapshot import Snapshot

LABEL_ROOM = 4.4  # at least this much room right of a pool block for its label
LABEL_CHAR = 0.17  # about the width of one character of a pool label, in data units


@dataclass
class Places:
    """Row positions: logical blocks stacked per sequence (left), the pool in columns (right)."""

    cell: float
    logical: list = field(default_factory=list)  # (seq_index, logical_index, row) of drawn blocks
    logical_gaps: list = field(default_factory=list)  # (seq_index, row, hidden_blocks)
    seq_rows: list = field(default_factory=list)  # (first_row, last_row) per drawn sequence
    hidden_seqs: int = 0  # sequences not drawn at all
    pool: dict = field(default_factory=dict)  # block_id -> (x, y) of drawn physical blocks
    pool_gaps: list = field(default_factory=list)  # (x, y, first_id, last_id) of runs not drawn
    pool_cols: int = 1
    num_rows: float = 0.0
    pool_x: float = 0.0  # left edge of the first pool column
    col_step: float = 0.0
    x_min: float = -5.0
    x_max: float = 0.0


def _place_logical(snap: Snapshot, places: Places, max_seq_blocks: int, max_seqs: int) -> float:
    """Stack each drawn sequence's logical blocks; a long one shows its first and last blocks."""
    row = 0.0
    for k, (_, block_ids, _) in enumerate(snap.seqs[:max_seqs]):
        first, count = row, len(block_ids)
        shown = (
            list(range(count)) if count <= max_seq_blocks else [*range(max_seq_blocks - 2), None, count - 1]
        )
        for i in shown:
            if i is None:
                places.logical_gaps.append((k, row, count - (max_seq_blocks - 1)))
            else:
                places.logical.append((k, i, row))
            row += 1
        if not block_ids:
            row += 1  # an empty sequence still gets a row for its label
        places.seq_rows.append((first, row - 1))
        row += 0.5  # gap between sequences
    places.hidden_seqs = max(0, len(snap.seqs) - max_seqs)
    return row - 0.5 if snap.seqs else 0


def _pool_items(snap: Snapshot, places: Places, max_blocks: int) -> list:
    """Which physical blocks to draw: all of a small pool; else those the arrows need, the copies, the
    next free and cached ones, then the lowest ids, up to max_blocks. A run of skipped ids is one item."""
    if snap.num_blocks <= max_blocks:
        shown_ids = list(range(snap.num_blocks))
    else:
        wanted = [snap.seqs[k][1][i] for k, i, _ in places.logical]
        wanted += [b for pair in snap.copies for b in pair]
        wanted += [*snap.free_ids[:2], *snap.cached_free[:2]]
        keep = set(list(dict.fromkeys(wanted))[:max_blocks])
        keep |= set([b for b in range(snap.num_blocks) if b not in keep][: max_blocks - len(keep)])
        shown_ids = sorted(keep)
    items: list = []  # block ids and ("gap", first, last)
    prev = -1
    for b in [*shown_ids, snap.num_blocks]:
        if b > prev + 1:
            items.append(("gap", prev + 1, b - 1))
        if b < snap.num_blocks:
            items.append(b)
        prev = b
    return items


def place(snap: Snapshot, label_lengths: dict, limits: tuple[int, int, int, int]) -> Places:
    """All positions. The pool wraps into columns of at most max_pool_rows (unless the logical side is
    taller anyway); each column leaves room right of its blocks for the longest label."""
    max_pool_rows, max_blocks, max_seq_blocks, max_seqs = limits
    places = Places(cell=min(1.0, 8.0 / snap.block_size))  # a block is at most 8 units wide
    logical_rows = _place_logical(snap, places, max_seq_blocks, max_seqs)
    items = _pool_items(snap, places, max_blocks)
    pool_rows = min(len(items), max(max_pool_rows, int(logical_rows)))
    places.pool_cols = cdiv(len(items), pool_rows)
    places.num_rows = max(logical_rows, pool_rows)
    block_w = snap.block_size * places.cell
    longest = max((label_lengths[b] for b in items if not isinstance(b, tuple)), default=0)
    label_room = max(LABEL_ROOM, 0.6 + LABEL_CHAR * longest) + (1.0 if snap.copies else 0.0)
    places.pool_x = block_w + max(5.0, 1.2 * block_w)  # the gap between the two sides holds the arrows
    places.col_step = block_w + label_room
    places.x_max = places.pool_x + places.pool_cols * places.col_step + (1.0 if snap.copies else 0.0)
    for j, item in enumerate(items):
        col, r = divmod(j, pool_rows)
        x, y = places.pool_x + col * places.col_step, float(r)
        if isinstance(item, tuple):
            places.pool_gaps.append((x, y, item[1], item[2]))
        else:
            places.pool[item] = (x, y)
    return places

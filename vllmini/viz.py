"""Pictures of the page table: a static figure and an interactive explorer.

`draw_page_table(manager)` draws each sequence's logical blocks on the left, the physical block pool
on the right (free blocks dashed, the next one to be handed out marked), and an arrow from every
logical block to the physical block that holds it. Each sequence has one colour in both views; filled
token slots are coloured, empty ones white; a block shared by several sequences (ref_count > 1) is
striped in its owners' colours and labelled; a pending copy-on-write is a dashed arrow between two
pool blocks. Big pools and long sequences are cut to what fits on a screen, and the rest summarized.
`PageTableExplorer` wraps a `BlockManager` in ipywidgets so a learner can add, grow, fork and free
sequences and watch the picture change.

The drawing is two steps: `_layout` decides where everything goes (pure geometry, no matplotlib), the
`_draw_*` functions paint one part each. What a physical block looks like is decided in one place,
`_pool_block_style`, so new kinds of block (e.g. cached but free) only add a case there.

Viz only reads: it never changes the manager, tables or allocator it draws. matplotlib and
ipywidgets are imported inside the functions that need them, so `import vllmini` stays light.
"""

from __future__ import annotations

import functools
import html
import io
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllmini.allocator import BlockAllocator
from vllmini.block_table import BlockManager, BlockTable
from vllmini.checks import as_int, one_of
from vllmini.errors import InvalidArgumentError, InvalidTypeError, VllminiError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# tab10 without its grey (grey means "free" here)
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#bcbd22", "#17becf",
)  # fmt: skip
FREE_FACE, FREE_EDGE = "#f3f3f3", "#b0b0b0"
HIGHLIGHT = "#ffd54f"  # the glow behind a block that was just copied (copy-on-write)
H = 0.8  # drawn height of a block row (rows are 1 apart)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# ---------------------------------------------------------------------------------------------- state


@dataclass
class _Snapshot:
    """Plain copies of everything the picture needs (so drawing cannot touch the live objects)."""

    block_size: int
    num_blocks: int
    seqs: list[tuple[object, list[int], int]]  # (seq_id, block_ids, num_tokens), the ones to draw
    ref_counts: list[int]
    free_ids: tuple[int, ...]
    copies: list[tuple[int, int]]  # pending copy-on-write (src_block, dst_block) pairs
    util: dict  # BlockManager.utilization() of the whole pool


def _manager_over(tables: dict, allocator: BlockAllocator, block_size: int) -> BlockManager:
    """A BlockManager view of existing tables, so their utilization has one home (BlockManager's)."""
    from types import SimpleNamespace

    view = BlockManager.__new__(BlockManager)
    view.allocator, view.block_size, view.watermark_blocks = allocator, block_size, 0
    view._tables = {
        s: SimpleNamespace(_block_ids=list(t.block_ids), num_tokens=t.num_tokens) for s, t in tables.items()
    }
    return view


_TABLE_ATTRS = ("block_ids", "num_tokens", "block_size", "allocator")


def _is_table(obj) -> bool:
    """A BlockTable, or any page table with the same four attributes (e.g. one a learner wrote)."""
    return isinstance(obj, BlockTable) or all(hasattr(obj, a) for a in _TABLE_ATTRS)


def _snapshot(manager_or_tables, allocator: BlockAllocator | None, seq_ids) -> _Snapshot:
    obj = manager_or_tables
    if isinstance(obj, _Snapshot):  # taken earlier (the explorer takes it under its lock)
        return obj
    if isinstance(obj, BlockManager):
        tables = {s: obj.block_table(s) for s in obj.seq_ids}
        allocator = allocator or obj.allocator
    elif _is_table(obj):
        tables = {0: obj}
    elif isinstance(obj, dict):
        tables = dict(obj)
    else:
        raise InvalidTypeError(
            f"manager_or_tables must be a BlockManager, a BlockTable or a dict seq_id -> BlockTable, "
            f"got {type(obj).__name__}"
        )
    for seq_id, table in tables.items():
        if not _is_table(table):
            raise InvalidTypeError(
                f"tables[{seq_id!r}] is a {type(table).__name__}, expected a BlockTable "
                f"(or a table of your own with {', '.join(_TABLE_ATTRS)})"
            )
    if allocator is None:
        if not tables:
            raise InvalidArgumentError("an empty dict of tables needs allocator= to know the pool")
        allocator = next(iter(tables.values())).allocator
    if not isinstance(allocator, BlockAllocator):
        raise InvalidTypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
    sizes = {t.block_size for t in tables.values()}
    if len(sizes) > 1:
        raise InvalidArgumentError(f"all tables must share one block_size, got {sorted(sizes)}")
    if any(t.allocator is not allocator for t in tables.values()):
        raise InvalidArgumentError("every table must use the allocator being drawn")
    block_size = sizes.pop() if sizes else getattr(obj, "block_size", 1)
    util = (
        obj if isinstance(obj, BlockManager) else _manager_over(tables, allocator, block_size)
    ).utilization()
    if seq_ids is not None:
        missing = [s for s in seq_ids if s not in tables]
        if missing:
            raise InvalidArgumentError(f"seq_ids {missing} not found; known: {list(tables)}")
        tables = {s: tables[s] for s in seq_ids}
    return _Snapshot(
        block_size=block_size,
        num_blocks=allocator.num_blocks,
        seqs=[(s, list(t.block_ids), t.num_tokens) for s, t in tables.items()],
        ref_counts=[allocator.ref_count(b) for b in range(allocator.num_blocks)],
        free_ids=allocator.free_block_ids,
        copies=[tuple(pair) for t in tables.values() for pair in getattr(t, "pending_copies", [])],
        util=util,
    )


def seq_color(seq_id, order: int = 0) -> str:
    """The colour of a sequence: fixed by an int seq_id (stable across redraws), else by its order."""
    key = seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else order
    return PALETTE[key % len(PALETTE)]


# ---------------------------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    """Where everything goes, in data units: a token slot is `cell` wide, a block row 1 high."""

    cell: float  # width of one token slot
    logical: list = field(default_factory=list)  # (seq_index, logical_index, row) of drawn blocks
    logical_gaps: list = field(default_factory=list)  # (seq_index, row, hidden_blocks)
    seq_rows: list = field(default_factory=list)  # (first_row, last_row) per drawn sequence
    hidden_seqs: int = 0  # sequences not drawn at all
    pool: dict = field(default_factory=dict)  # block_id -> (x, y) of drawn physical blocks
    pool_gaps: list = field(default_factory=list)  # (x, y, first_id, last_id) of runs not drawn
    pool_cols: int = 1
    n_rows: float = 0.0
    px0: float = 0.0  # left edge of the first pool column
    col_step: float = 0.0
    x_min: float = -5.0
    x_max: float = 0.0

    @property
    def block_w(self) -> float:
        return self.col_step - 4.4


def _layout(snap: _Snapshot, max_pool_rows: int, max_blocks: int, max_seq_blocks: int, max_seqs: int):
    """Row positions: logical blocks stacked per sequence (left), the pool in columns (right). Long
    sequences show their first and last blocks, big pools the blocks in use and the next free ones."""
    bs = snap.block_size
    lay = _Layout(cell=min(1.0, 8.0 / bs))  # a block is at most 8 units wide
    row = 0.0
    for k, (_, block_ids, _) in enumerate(snap.seqs[:max_seqs]):
        first, n = row, len(block_ids)
        shown = list(range(n)) if n <= max_seq_blocks else [*range(max_seq_blocks - 2), None, n - 1]
        for i in shown:
            if i is None:
                lay.logical_gaps.append((k, row, n - (max_seq_blocks - 1)))
            else:
                lay.logical.append((k, i, row))
            row += 1
        if not block_ids:
            row += 1  # an empty sequence still gets a row for its label
        lay.seq_rows.append((first, row - 1))
        row += 0.5  # gap between sequences
    lay.hidden_seqs = max(0, len(snap.seqs) - max_seqs)
    logical_rows = row - 0.5 if snap.seqs else 0

    # which physical blocks to draw: all of a small pool; else those the arrows need, the copies, the
    # next free ones, then the lowest ids, up to max_blocks; each run of skipped ids becomes one row
    if snap.num_blocks <= max_blocks:
        shown_ids = list(range(snap.num_blocks))
    else:
        wanted = [snap.seqs[k][1][i] for k, i, _ in lay.logical]
        wanted += [b for pair in snap.copies for b in pair] + list(snap.free_ids[:2])
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
    # the pool wraps into columns of at most max_pool_rows, unless the logical side is taller anyway
    pool_rows = min(len(items), max(max_pool_rows, int(logical_rows)))
    lay.pool_cols = -(-len(items) // pool_rows)
    lay.n_rows = max(logical_rows, pool_rows)

    block_w = bs * lay.cell
    lay.px0 = block_w + max(5.0, 1.2 * block_w)  # the gap between the two sides holds the arrows
    lay.col_step = block_w + 4.4  # room right of each pool block for its label, "12 shared ×2"
    lay.x_max = lay.px0 + lay.pool_cols * lay.col_step + (2.5 if snap.copies else 0.0)  # room for "copy"
    for j, item in enumerate(items):
        col, r = divmod(j, pool_rows)
        x, y = lay.px0 + col * lay.col_step, float(r)
        if isinstance(item, tuple):
            lay.pool_gaps.append((x, y, item[1], item[2]))
        else:
            lay.pool[item] = (x, y)
    return lay


def _pool_block_style(b: int, snap: _Snapshot, owners: dict, fill: dict) -> dict:
    """How physical block `b` looks: stripes (owner colours), filled slots, frame, label."""
    refs = snap.ref_counts[b]
    if refs == 0:
        nxt = " (next)" if snap.free_ids and b == snap.free_ids[0] else ""
        return {"stripes": [FREE_FACE], "filled": snap.block_size, "frame": FREE_EDGE, "lw": 1.2, "ls": "--",
                "label": f"{b} free{nxt}", "label_color": "#999999", "bold": False, "free": True}  # fmt: skip
    stripes = list(dict.fromkeys(owners.get(b, []))) or ["#777777"]  # one colour per distinct owner
    shared = refs > 1
    return {"stripes": stripes, "filled": fill.get(b, 0), "frame": "black" if shared else stripes[0],
            "lw": 2.4 if shared else 1.6, "ls": "-", "label": f"{b} shared ×{refs}" if shared else f"{b}",
            "label_color": "black", "bold": shared, "free": False}  # fmt: skip


# ---------------------------------------------------------------------------------------------- drawing


def _draw_block(ax, x, y, lay, style, numbers, gid, dividers):
    """One block: its filled slots (one stripe per owner), empty slots white, cell dividers, a frame."""
    from matplotlib.patches import Rectangle

    w = lay.cell
    filled, stripes = style["filled"], style["stripes"]
    for m, c in enumerate(stripes):  # one horizontal stripe per owner of a shared block
        if filled:
            ax.add_artist(Rectangle((x, y + m * H / len(stripes)), filled * w, H / len(stripes), fc=c, lw=0))
    if filled * w < lay.block_w:  # the empty slots: white, also over a highlight
        ax.add_artist(Rectangle((x + filled * w, y), lay.block_w - filled * w, H, fc="white", lw=0))
    dividers.append((x, y, filled, style["free"]))
    if numbers is not None:
        for j, num in enumerate(numbers):
            color = "white" if j < filled and not style["free"] else "#999999"
            ax.text(x + (j + 0.5) * w, y + H / 2, str(num), ha="center", va="center", fontsize=7, color=color)
    ax.add_artist(
        Rectangle(
            (x, y), lay.block_w, H, fill=False, ec=style["frame"], lw=style["lw"], ls=style["ls"], gid=gid
        )
    )


def _draw_dividers(ax, dividers, lay, bs):
    """All the thin lines between token slots, as two collections (white on colour, grey on white)."""
    from matplotlib.collections import LineCollection

    if bs > 32:
        return  # too thin to see
    on_colour, on_white = [], []
    for x, y, filled, free in dividers:
        for j in range(1, bs):
            seg = [(x + j * lay.cell, y), (x + j * lay.cell, y + H)]
            (on_white if free or j > filled else on_colour).append(seg)
    ax.add_collection(LineCollection(on_colour, colors="white", linewidths=0.6))
    ax.add_collection(LineCollection(on_white, colors="#c8c8c8", linewidths=0.6))


def _draw_sequences(ax, snap, lay, colors, show_numbers, dividers):
    """Left side: each sequence's name and length, its logical blocks, and '⋮' for hidden ones."""
    bs = snap.block_size
    for (s, block_ids, n), (first, last) in zip(snap.seqs, lay.seq_rows, strict=False):
        c = colors[s]
        ax.plot([-2.0, -2.0], [first + 0.05, last + H - 0.05], color=c, lw=3, solid_capstyle="butt")
        name = {"ha": "right", "va": "center", "fontsize": 9, "color": c, "fontweight": "bold"}
        ax.text(-2.3, (first + last + H) / 2, f"seq {s}\n{n} tok", **name)
        if not block_ids:
            ax.text(0, first + H / 2, "(no blocks)", va="center", fontsize=8, color="grey")
    for k, i, row in lay.logical:
        s, _, n = snap.seqs[k]
        filled = min(bs, n - i * bs)
        style = {
            "stripes": [colors[s]],
            "filled": filled,
            "frame": colors[s],
            "lw": 1.6,
            "ls": "-",
            "free": False,
        }
        numbers = [i * bs + j if j < filled else "" for j in range(bs)] if show_numbers else None
        _draw_block(ax, 0, row, lay, style, numbers, f"logical:{s}:{i}", dividers)
        ax.text(-0.25, row + H / 2, f"L{i}", ha="right", va="center", fontsize=8, color="#444444")
    for k, row, hidden in lay.logical_gaps:
        label = f"⋮ {_plural(hidden, 'more block')}"
        ax.text(0.2, row + H / 2, label, va="center", fontsize=8, color=colors[snap.seqs[k][0]])
    if lay.hidden_seqs:
        y = lay.seq_rows[-1][1] + H + 0.3
        text = f"+ {_plural(lay.hidden_seqs, 'more sequence')} not drawn"
        ax.text(lay.x_min + 0.2, y, text, va="top", fontsize=8, color="grey")


def _draw_pool(ax, snap, lay, colors, show_numbers, highlight, dividers):
    """Right side: the physical pool (free blocks dashed grey, shared ones framed black and striped)."""
    from matplotlib.patches import Rectangle

    bs = snap.block_size
    owners: dict[int, list] = {}  # who holds each physical block, and how many of its slots hold tokens
    fill: dict[int, int] = {}
    for s, block_ids, n in snap.seqs:
        for i, b in enumerate(block_ids):
            owners.setdefault(b, []).append(colors[s])
            fill[b] = max(fill.get(b, 0), min(bs, n - i * bs))
    for b, (x, y) in lay.pool.items():
        style = _pool_block_style(b, snap, owners, fill)
        if b in highlight:
            glow = Rectangle((x - 0.35, y - 0.15), lay.block_w + 0.7, H + 0.3, fc=HIGHLIGHT, lw=0, zorder=0.4)
            glow.set_gid(f"highlight:{b}")
            ax.add_artist(glow)
        numbers = [b * bs + j for j in range(bs)] if show_numbers else None
        _draw_block(ax, x, y, lay, style, numbers, f"physical:{b}", dividers)
        weight = "bold" if style["bold"] else None
        ax.text(x + lay.block_w + 0.25, y + H / 2, style["label"], va="center", fontsize=8,
                color=style["label_color"], fontweight=weight)  # fmt: skip
    for x, y, first, last in lay.pool_gaps:
        n = last - first + 1
        free = sum(1 for b in range(first, last + 1) if snap.ref_counts[b] == 0)
        text = f"⋮ block {first} not drawn" if n == 1 else f"⋮ blocks {first}–{last} not drawn ({n}"
        text += f", {free} free)" if n > 1 else f" ({'free' if free else 'in use'})"
        ax.text(x, y + H / 2, text, va="center", fontsize=8, color="#777777")


def _draw_arrows(ax, snap, lay, colors):
    """Logical block -> physical block (under the blocks, so they never hide a cell); copy-on-write
    pairs as dashed black arrows from the source block to its copy."""
    from matplotlib.patches import FancyArrowPatch

    x0 = snap.block_size * lay.cell + 0.1
    style = {"arrowstyle": "-|>", "mutation_scale": 11, "lw": 1.3, "alpha": 0.85, "zorder": 0.5}
    for k, i, row in lay.logical:
        s, block_ids, _ = snap.seqs[k]
        if block_ids[i] not in lay.pool:
            continue
        x, y = lay.pool[block_ids[i]]
        arrow = FancyArrowPatch((x0, row + H / 2), (x - 0.1, y + H / 2), **style, color=colors[s])
        arrow.set_gid(f"arrow:{s}:{i}->{block_ids[i]}")
        ax.add_artist(arrow)
    for src, dst in snap.copies:
        if src in lay.pool and dst in lay.pool:
            (xs, ys), (xd, yd) = lay.pool[src], lay.pool[dst]
            arrow = FancyArrowPatch(
                (xs + lay.block_w + 3.6, ys + H / 2), (xd + lay.block_w + 3.6, yd + H / 2),
                connectionstyle="arc3,rad=-0.5", arrowstyle="-|>", mutation_scale=10, lw=1.2, ls="--",
                color="black", zorder=3,
            )  # fmt: skip
            arrow.set_gid(f"copy:{src}->{dst}")
            ax.add_artist(arrow)
            ax.text(xs + lay.block_w + 4.0, (ys + yd) / 2 + H / 2, "copy", fontsize=7, va="center")


def _draw_headers(ax, snap, lay, title):
    """Column headers, the free list under the picture, and the title with the pool's utilization."""
    header = {"ha": "center", "va": "bottom", "fontsize": 9, "fontweight": "bold"}
    ax.text(snap.block_size * lay.cell / 2, -0.55, "logical blocks", **header)
    pool_title = f"physical blocks (pool of {snap.num_blocks})"
    ax.text(lay.px0 + (lay.pool_cols * lay.col_step - 4.4) / 2, -0.55, pool_title, **header)
    shown = ", ".join(map(str, snap.free_ids[:16])) + (", ..." if len(snap.free_ids) > 16 else "")
    free_list = f"free list (next first): [{shown}]"
    ax.text(lay.x_min + 0.2, lay.n_rows + 0.5, free_list, va="top", fontsize=8, color="#555555")
    if title is None:
        u = snap.util
        used, slots, tokens = u["used_blocks"], u["allocated_slots"], u["num_tokens"]
        util = (
            f", {tokens}/{slots} allocated slots hold tokens ({u['token_utilization']:.0%})" if used else ""
        )
        title = (
            f"{_plural(len(snap.seqs), 'sequence')}, block_size {snap.block_size}: "
            f"{used}/{snap.num_blocks} blocks used{util}"
        )
    if title:
        ax.set_title(title, fontsize=10)


def draw_page_table(
    manager_or_tables,
    allocator: BlockAllocator | None = None,
    *,
    seq_ids=None,
    colors: dict | None = None,
    title: str | None = None,
    show_numbers: bool | None = None,
    max_pool_rows: int = 16,
    max_blocks: int = 64,
    max_seq_blocks: int = 8,
    max_seqs: int = 16,
    highlight=(),
    figsize: tuple[float, float] | None = None,
    fig: Figure | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Draw the page table of a `BlockManager` (or a dict seq_id -> BlockTable plus its allocator).

    Left: each sequence's logical blocks, one row per block (cells = token slots; the number in a
    filled cell is the token index). Right: the physical pool (the number in a cell is its slot id,
    block_id * block_size + offset). Arrows: logical -> physical; dashed black arrows: pending
    copy-on-write copies. At most `max_blocks` pool blocks, `max_seq_blocks` blocks per sequence and
    `max_seqs` sequences are drawn (the rest is summarized); `highlight` lists pool blocks to mark.
    Returns the matplotlib Figure; pass `fig=` to redraw into an existing figure or `ax=` to draw into
    an existing Axes.
    """
    import matplotlib.pyplot as plt

    max_pool_rows = as_int(max_pool_rows, "max_pool_rows", min=1)
    max_blocks = as_int(max_blocks, "max_blocks", min=1)
    max_seq_blocks = as_int(max_seq_blocks, "max_seq_blocks", min=3)
    max_seqs = as_int(max_seqs, "max_seqs", min=1)
    snap = _snapshot(manager_or_tables, allocator, seq_ids)
    lay = _layout(snap, max_pool_rows, max_blocks, max_seq_blocks, max_seqs)
    if show_numbers is None:
        show_numbers = snap.block_size <= 8 and lay.n_rows <= 24 and len(lay.pool) + len(lay.logical) <= 48
    colors = dict(colors or {})
    for k, (s, _, _) in enumerate(snap.seqs):
        colors.setdefault(s, seq_color(s, k))

    if ax is None:
        width, height = 0.42 * (lay.x_max - lay.x_min), 0.42 * (lay.n_rows + 2.6)
        size = figsize or (min(16.0, width), min(14.0, height))
        if fig is None:
            fig = plt.figure(figsize=size)
        else:
            fig.clear()
            fig.set_size_inches(*size)
        ax = fig.add_axes((0.01, 0.01, 0.98, 0.98 if title == "" else 0.9))
    fig = ax.figure

    dividers: list = []
    _draw_sequences(ax, snap, lay, colors, show_numbers, dividers)
    _draw_pool(ax, snap, lay, colors, show_numbers, set(highlight), dividers)
    _draw_dividers(ax, dividers, lay, snap.block_size)
    _draw_arrows(ax, snap, lay, colors)
    _draw_headers(ax, snap, lay, title)
    ax.set_xlim(lay.x_min, lay.x_max)
    ax.set_ylim(lay.n_rows + 1.4, -1.2)  # row 0 at the top
    ax.set_axis_off()
    return fig


# ---------------------------------------------------------------------------------------------- explorer


def _in_kernel() -> bool:
    """Are we running inside a Jupyter kernel (where widgets talk to a browser)?"""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _locked(method):
    """Run an explorer method under the explorer's lock (the picture is drawn on another thread)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _tokens_box(**kwargs):
    """A BoundedIntText with one extra synced flag per action button (see PageTableExplorer)."""
    import ipywidgets as w
    from traitlets import Bool

    class TokensBox(w.BoundedIntText):
        add_click = Bool(False).tag(sync=True)
        append_click = Bool(False).tag(sync=True)
        fork_click = Bool(False).tag(sync=True)
        free_click = Bool(False).tag(sync=True)

    return TokensBox(**kwargs)


class PageTableExplorer:
    """Add, grow, fork and free sequences with buttons and watch the page table change.

    The picture is a PNG in an `ipywidgets.Image`, redrawn into one reused Figure after every action
    and shown at its natural size (rendered at 2x for sharp text), so it updates in place (no flicker,
    no ipympl needed). The status line and the picture are updated together, after the drawing. Errors
    such as running out of blocks are shown in the status line (and kept in `last_error`), never
    raised, and leave state and picture unchanged. A click right after typing always uses the typed
    number (see the note in __init__); `click(name)` clicks a button from code. In a Jupyter kernel the
    drawing runs on a worker thread (`background`), so clicks are answered at once; `wait()` blocks
    until the picture shows the current state.
    """

    CSS_PX_PER_INCH = 96  # the picture's natural size on the page
    RENDER_SCALE = 2  # pixels rendered per CSS pixel: sharp on high-density screens, and when zoomed

    def __init__(
        self,
        num_blocks: int = 16,
        block_size: int = 4,
        *,
        figsize=None,
        max_width: int = 1000,
        background: bool | None = None,
    ):
        import ipywidgets as w
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.num_blocks = as_int(num_blocks, "num_blocks", min=1)
        self.block_size = as_int(block_size, "block_size", min=1)
        self.max_width = as_int(max_width, "max_width", min=100)
        self.figsize = figsize
        self.manager = BlockManager(self.num_blocks, self.block_size)
        self.next_seq_id = 0
        self.last_error: str | None = None
        self.last_action = "empty pool: add a sequence"
        self.last_copies: list[tuple[int, int]] = []  # copy-on-write pairs of the last action
        self.history: list[str] = []  # what every successful action did, oldest first (reset empties it)
        # In a kernel the picture is drawn on a worker thread, so a click is answered in well under a
        # millisecond and the browser seldom has to hold an update back (see the note on clicks below).
        self.background = _in_kernel() if background is None else bool(background)
        self._lock = threading.RLock()  # guards the manager and the explorer's state
        self._draw_lock = threading.Lock()  # guards the figure
        self._wake = threading.Condition()
        self._want: bool | None = None  # None: nothing to do; False: status only; True: picture too
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None
        self.figure = Figure()  # not registered with pyplot: it never pops up on its own
        FigureCanvasAgg(self.figure)  # renders PNGs headless

        self.num_tokens = _tokens_box(
            value=self.block_size + 1,
            min=1,
            max=self.num_blocks * self.block_size,
            description="tokens",
            continuous_update=True,  # the buttons' labels follow the typing
            layout=w.Layout(width="240px"),
        )
        self.seq_select = w.Dropdown(options=[], description="sequence", layout=w.Layout(width="240px"))
        wide = w.Layout(width="240px")
        tips = {
            "add": "start a new sequence holding `tokens` tokens",
            "append": "grow the selected sequence by `tokens` tokens",
            "fork": "a new sequence sharing every block of the selected one",
            "free": "finish the selected sequence: its blocks go back",
        }
        # A click must not overtake the number typed just before it. The browser holds back a widget's
        # update while its previous one is unanswered, but sends a Button's click at once, so a click
        # could reach the kernel before the number. Instead each action button toggles, and the browser
        # itself copies the toggle into the tokens box (jsdlink): the click then travels in the tokens
        # box's own message stream, after (or in one message with) the number.
        self._buttons, self._links = {}, []
        for name, tip in tips.items():
            button = w.ToggleButton(tooltip=tip, layout=wide)
            self._links.append(w.jsdlink((button, "value"), (self.num_tokens, f"{name}_click")))
            self.num_tokens.observe(self._on_click, f"{name}_click")
            button.add_class("vllmini-action")
            self._buttons[name] = button
        self.add_button, self.append_button = self._buttons["add"], self._buttons["append"]
        self.fork_button, self.free_button = self._buttons["fork"], self._buttons["free"]
        self.reset_button = w.Button(description="reset: empty pool", icon="refresh", layout=wide)
        self.reset_button.on_click(lambda _button: self.reset())
        self.num_tokens.observe(self._label_buttons, "value")
        self.seq_select.observe(self._label_buttons, "value")
        self.status = w.HTML()
        picture = w.Layout(
            max_width="100%", min_width="0", height="auto", flex="0 1 auto", object_fit="contain"
        )
        self.image = w.Image(format="png", layout=picture)  # shrinks (keeping its shape) in narrow cells
        self.controls = w.VBox(
            [self.num_tokens, self.seq_select, self.add_button, self.append_button, self.fork_button,
             self.free_button, self.reset_button],
            layout=w.Layout(min_width="250px"),
        )  # fmt: skip
        # a toggled button looks like any other button: the toggle is only the click's messenger
        style = w.HTML(
            "<style>.vllmini-explorer .vllmini-action.mod-active {box-shadow: none; "
            "background-color: var(--jp-layout-color2); color: var(--jp-ui-font-color1);}</style>",
            layout=w.Layout(display="none"),
        )
        self.widget = w.VBox([style, self.status, w.HBox([self.controls, self.image])])
        for widget, name in (
            (self.widget, "explorer"), (self.num_tokens, "tokens"), (self.seq_select, "seq"),
            (self.add_button, "add"), (self.append_button, "append"), (self.fork_button, "fork"),
            (self.free_button, "free"), (self.reset_button, "reset"), (self.status, "status"),
            (self.image, "image"),
        ):  # fmt: skip
            widget.add_class(f"vllmini-{name}")  # stable handles for the browser test
        self._label_buttons()
        self.refresh()

    # ---- actions (the buttons call these; tests and notebooks may call them directly)

    @_locked
    def add_sequence(self, num_tokens: int | None = None):
        """Start a new sequence of `num_tokens` tokens (default: the tokens box). Returns its id or None."""
        n = self.num_tokens.value if num_tokens is None else num_tokens
        seq_id = self.next_seq_id
        if not self._try(lambda: self.manager.allocate(seq_id, n), f"added seq {seq_id} with {self._tok(n)}"):
            return None
        self.next_seq_id += 1
        self._refresh_select(seq_id)
        self.refresh()
        return seq_id

    @_locked
    def append(self, seq_id=None, num_tokens: int | None = None) -> None:
        """Grow `seq_id` (default: the selected one) by `num_tokens` (default: the tokens box)."""
        seq_id = self.seq_select.value if seq_id is None else seq_id
        n = self.num_tokens.value if num_tokens is None else num_tokens
        if self._no_seq(seq_id):
            return
        if self._try(lambda: self.manager.append(seq_id, n), f"appended {self._tok(n)} to seq {seq_id}"):
            self.refresh()

    @_locked
    def fork(self, seq_id=None):
        """Fork `seq_id` (default: the selected one) into a new sequence. Returns the child's id or None."""
        seq_id = self.seq_select.value if seq_id is None else seq_id
        if self._no_seq(seq_id):
            return None
        child = self.next_seq_id
        message = f"forked seq {seq_id} into seq {child} (now selected); they share every block"
        if not self._try(lambda: self.manager.fork(seq_id, child), message):
            return None
        self.next_seq_id += 1
        self._refresh_select(child)
        self.refresh()
        return child

    @_locked
    def free(self, seq_id=None) -> None:
        """Finish `seq_id` (default: the selected one): its blocks go back to the pool."""
        seq_id = self.seq_select.value if seq_id is None else seq_id
        if self._no_seq(seq_id):
            return
        if self._try(lambda: self.manager.free(seq_id), f"freed seq {seq_id}"):
            self._refresh_select(None)
            self.refresh()

    @_locked
    def reset(self) -> None:
        """Start over with an empty pool (sequence ids start at 0 again)."""
        self.manager = BlockManager(self.num_blocks, self.block_size)
        self.next_seq_id = 0
        self.last_error = None
        self.last_action = "reset: empty pool"
        self.last_copies = []
        self.history = []
        self._refresh_select(None)
        self.refresh()

    def click(self, name: str) -> None:
        """Click the button `name` ("add", "append", "fork" or "free") as the browser does: flip its
        flag on the tokens box."""
        one_of(name, "name", tuple(self._buttons))
        flag = f"{name}_click"
        setattr(self.num_tokens, flag, not getattr(self.num_tokens, flag))

    def _on_click(self, change) -> None:
        action = change["name"].removesuffix("_click")
        {"add": self.add_sequence, "append": self.append, "fork": self.fork, "free": self.free}[action]()

    # ---- helpers

    @staticmethod
    def _tok(n) -> str:
        return _plural(n, "token") if isinstance(n, int) else f"{n!r} tokens"

    def _try(self, action, message: str) -> bool:
        """Run one manager call. On success take its copy-on-write jobs (the cache owner's job) and
        remember what happened; on a VllminiError (the manager left its state unchanged) show it."""
        try:
            slots = action()
        except VllminiError as e:
            self.last_error = f"{type(e).__name__}: {e}"
            self._show_status()  # state unchanged: the picture stays as it is
            return False
        self.last_error = None
        self.last_copies = self.manager.take_pending_copies()
        if slots:
            shown = slots if len(slots) <= 8 else f"[{slots[0]}, ..., {slots[-1]}]"
            message += f" → slots {shown}"
        for src, dst in self.last_copies:
            message += f"; copy-on-write: block {src} → {dst}"
        self.last_action = message
        self.history.append(message)
        return True

    def _no_seq(self, seq_id) -> bool:
        if seq_id is not None:
            return False
        self.last_error = "no sequence selected: add one first"
        self._show_status()
        return True

    def _refresh_select(self, value) -> None:
        ids = self.manager.seq_ids
        self.seq_select.options = [(f"seq {s}", s) for s in ids]
        if value in ids:
            self.seq_select.value = value
        elif ids and self.seq_select.value not in ids:
            self.seq_select.value = ids[0]
        self._label_buttons()

    def _label_buttons(self, _change=None) -> None:
        """The buttons say what they will do, with the current tokens box and selection."""
        tokens, seq = self._tok(self.num_tokens.value), self.seq_select.value
        self.add_button.description = f"add a sequence of {tokens}"
        none = seq is None
        self.append_button.description = "append (no sequence)" if none else f"append {tokens} to seq {seq}"
        self.fork_button.description = "fork (no sequence)" if none else f"fork seq {seq}"
        self.free_button.description = "free (no sequence)" if none else f"free seq {seq}"
        for button in (self.append_button, self.fork_button, self.free_button):
            button.disabled = none

    def status_text(self) -> str:
        """The status line as plain text: last action or error, then the free list and utilization."""
        u = self.manager.utilization()
        free = list(self.manager.allocator.free_block_ids)
        shown = ", ".join(map(str, free[:16])) + (", ..." if len(free) > 16 else "")
        head = f"error: {self.last_error}" if self.last_error else self.last_action
        share = f"{u['token_utilization']:.0%}" if u["allocated_slots"] else "-"  # nothing allocated yet
        return (
            f"{head}\n{u['free_blocks']} of {self.num_blocks} blocks free, next first: [{shown}] | "
            f"{u['num_tokens']} tokens in {u['allocated_slots']} allocated slots ({share}) | "
            f"pool {u['pool_utilization']:.0%}"
        )

    def _status_html(self) -> str:
        head, tail = self.status_text().split("\n", 1)
        color = "#c62828" if self.last_error else "#333333"
        return (
            f"<div style='font-family:monospace;font-size:12px;line-height:1.5'>"
            f"<b style='color:{color}'>{html.escape(head)}</b><br>{html.escape(tail)}</div>"
        )

    def _show_status(self) -> None:
        self.refresh(picture=False)

    def render_png(self, snap: _Snapshot | None = None, highlight=None) -> tuple[bytes, int]:
        """The picture as PNG bytes (the last action's copied blocks highlighted) and the width in CSS
        pixels to show it at: its natural size, at most max_width, rendered at RENDER_SCALE x."""
        if snap is None:
            with self._lock:
                snap, highlight = _snapshot(self.manager, None, None), [d for _, d in self.last_copies]
        with self._draw_lock:
            draw_page_table(snap, fig=self.figure, figsize=self.figsize, highlight=highlight or ())
            width = min(self.max_width, round(self.figure.get_figwidth() * self.CSS_PX_PER_INCH))
            buf = io.BytesIO()
            dpi = self.RENDER_SCALE * width / self.figure.get_figwidth()
            self.figure.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 3})
        return buf.getvalue(), width

    def refresh(self, picture: bool = True) -> None:
        """Show the current state: redraw (unless picture=False), then swap the picture and the status
        line together, so the status never runs ahead. In the background, this only asks the worker."""
        if not self.background:
            self._update(picture)
            return
        with self._wake:
            self._want = picture or bool(self._want)
            self._idle.clear()
            self._wake.notify()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="page-table-explorer", daemon=True)
                self._worker.start()

    def wait(self, timeout: float = 60.0) -> bool:
        """Block until the picture and status show the current state (True), or `timeout` passed."""
        return self._idle.wait(timeout)

    def _update(self, picture: bool) -> None:
        with self._lock:  # one consistent state for both: the status and the snapshot to draw
            status = self._status_html()
            snap = _snapshot(self.manager, None, None) if picture else None
            highlight = [dst for _, dst in self.last_copies]
        if picture:
            png, width = self.render_png(snap, highlight)
            self.image.layout.width = f"{width}px"
            self.image.value = png
        self.status.value = status

    def _work(self) -> None:
        try:  # drawing yields the CPU to the kernel's main thread, which answers the browser
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass  # not Linux: no per-thread priority
        while True:
            with self._wake:
                while self._want is None:
                    self._wake.wait()
                while self._wake.wait(timeout=0.03):  # let a quick run of clicks finish first
                    pass
                picture, self._want = self._want, None
            try:
                self._update(picture)
            except Exception as e:  # keep the worker alive; say what happened where the learner looks
                self.status.value = f"<pre>explorer could not draw: {html.escape(repr(e))}</pre>"
            with self._wake:
                if self._want is None:
                    self._idle.set()

    def display(self) -> None:
        """Show the widget; where widgets cannot render (a saved notebook not yet run), a short hint
        stands in for the raw VBox(...) repr."""
        from IPython.display import display

        view = {"model_id": self.widget.model_id, "version_major": 2, "version_minor": 0}
        hint = f"PageTableExplorer({self.num_blocks} blocks of {self.block_size}): run this cell to use it"
        display({"application/vnd.jupyter.widget-view+json": view, "text/plain": hint}, raw=True)

    def _ipython_display_(self) -> None:
        self.display()

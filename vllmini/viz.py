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
from vllmini.checks import as_int, cdiv, one_of
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
    view.allocator, view.block_size, view.watermark_blocks, view.prefix_cache = allocator, block_size, 0, None
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
    lay.pool_cols = cdiv(len(items), pool_rows)
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


# ---- course pictures (notebooks 01, 04, 06)
# Each function draws one picture a notebook would otherwise spend many lines of matplotlib on. They only
# read their arguments (lengths, tables, per-step records) and return the Figure.

PROMPT_FACE, OUTPUT_FACE, EMPTY_FACE, EMPTY_EDGE = "#4C72B0", "#DD8452", "#F4CCCC", "#C0392B"
SCHEME_COLORS = {"static": "#C0392B", "pow2": "#8E44AD", "oracle": "#7F8C8D", "paged": "#27AE60"}


def _bare(ax, keep=("bottom",)) -> None:
    """Hide the spines a schematic picture does not need."""
    for side in ("top", "right", "left", "bottom"):
        if side not in keep:
            ax.spines[side].set_visible(False)


def draw_reservations(
    requests, max_len: int, block_size: int, *, figsize: tuple[float, float] = (8, 4.2)
) -> Figure:
    """Two rows of slot squares per request (prompt, output, reserved-but-empty): static vs paged."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    requests = [(int(i), int(o)) for i, o in requests]
    tokens = sum(i + o for i, o in requests)
    static = [max_len] * len(requests)
    paged = [cdiv(i + o, block_size) * block_size for i, o in requests]
    fig, axes = plt.subplots(2, 1, figsize=figsize)
    panels = [
        (axes[0], static, None, f"static: {max_len} slots each, {tokens} of {sum(static)} hold tokens"),
        (
            axes[1],
            paged,
            block_size,
            f"paged (block_size {block_size}): {tokens} of {sum(paged)} slots hold tokens",
        ),
    ]
    width = max(max_len, max(paged))
    for ax, reserve, bs, title in panels:
        for row, ((n_in, n_out), n_res) in enumerate(zip(requests, reserve, strict=True)):
            for slot in range(width):
                if slot < n_in:
                    style = dict(facecolor=PROMPT_FACE, edgecolor="white")
                elif slot < n_in + n_out:
                    style = dict(facecolor=OUTPUT_FACE, edgecolor="white")
                elif slot < n_res:
                    style = dict(facecolor=EMPTY_FACE, hatch="///", edgecolor=EMPTY_EDGE)
                else:
                    style = dict(facecolor=FREE_FACE, edgecolor="#CCCCCC")
                ax.add_patch(Rectangle((slot, -row - 0.4), 0.92, 0.8, linewidth=0.8, **style))
            for edge in range(0, n_res + 1, bs) if bs else ():  # block boundaries
                ax.plot([edge - 0.04] * 2, [-row - 0.5, -row + 0.5], color="black", lw=1.5)
        ax.set_xlim(-0.3, width + 0.2)
        ax.set_ylim(-len(requests) + 0.4, 0.6)
        labels = [f"request {r}: {i}+{o}" for r, (i, o) in enumerate(requests)]
        ax.set_yticks([-r for r in range(len(requests))], labels)
        ax.set_xticks(range(0, width + 1, 4))
        ax.set_xlabel("KV slot")
        ax.set_title(title, loc="left")
        _bare(ax)
    handles = [
        Rectangle((0, 0), 1, 1, color=PROMPT_FACE),
        Rectangle((0, 0), 1, 1, color=OUTPUT_FACE),
        Rectangle((0, 0), 1, 1, facecolor=EMPTY_FACE, hatch="///", edgecolor=EMPTY_EDGE),
        Rectangle((0, 0), 1, 1, facecolor=FREE_FACE, edgecolor="#CCCCCC"),
    ]
    fig.legend(handles, ["prompt", "output", "reserved, empty", "free for other requests"],
               loc="lower center", ncol=4, frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def draw_prefill_and_decode(
    prompt_len: int = 6, num_decode_steps: int = 4, *, figsize: tuple[float, float] = (11, 3.8)
) -> Figure:
    """Prefill (every prompt token's query against the prompt's keys, one forward) beside decode (one
    query per step, reading every cached key and value): why decode is bound by memory bandwidth."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n, steps = int(prompt_len), int(num_decode_steps)
    total = n + steps
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=figsize, gridspec_kw={"width_ratios": [n + 2, total + 2]})
    for q in range(n):  # prefill: a causal triangle of query x key scores, computed together
        for k in range(n):
            face = PROMPT_FACE if k <= q else FREE_FACE
            ax1.add_patch(Rectangle((k, -q), 0.92, 0.92, facecolor=face, edgecolor="white"))
    ax1.set_title(f"prefill: {n} prompt tokens in ONE forward\n{n * (n + 1) // 2} query-key products, "
                  "weights read once", fontsize=10, loc="left")  # fmt: skip
    for t in range(steps):  # decode: step t has one query that reads all n + t cached keys
        for k in range(n + t + 1):
            if k < n + t:
                face, edge = (PROMPT_FACE if k < n else OUTPUT_FACE), "white"
            else:
                face, edge = "white", "black"  # the new token: written to the cache this step
            ax2.add_patch(Rectangle((k, -t), 0.92, 0.92, facecolor=face, edgecolor=edge, alpha=0.9))
    ax2.set_title(f"decode: ONE new token per forward, {steps} forwards\neach reads every cached K/V "
                  "(and all weights) for one query", fontsize=10, loc="left")  # fmt: skip
    for ax, rows, cols, ylab in ((ax1, n, n, "query (prompt token)"), (ax2, steps, total, "decode step")):
        ax.set_xlim(-0.2, cols + 0.2)
        ax.set_ylim(-rows + 0.8, 1.1)
        ax.set_yticks([-r + 0.46 for r in range(rows)], [str(r) for r in range(rows)])
        ax.set_xticks([c + 0.46 for c in range(cols)], [str(c) for c in range(cols)], fontsize=8)
        ax.set_xlabel("key / value position in the KV cache")
        ax.set_ylabel(ylab)
        _bare(ax, keep=())
    handles = [
        Rectangle((0, 0), 1, 1, color=PROMPT_FACE),
        Rectangle((0, 0), 1, 1, color=OUTPUT_FACE),
        Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black"),
    ]
    fig.legend(handles, ["prompt K/V read", "generated K/V read", "new token (K/V written this step)"],
               loc="lower center", ncol=3, frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_token_shares(
    share: dict, paper_share: dict, *, block_size: int = 16, figsize: tuple[float, float] = (10, 4.5)
) -> Figure:
    """Bars: the share of reserved KV slots holding tokens, per scheme, workload and snapshot, beside
    the paper's measurement. share: {(workload, "done" | "half", scheme): float}."""
    import matplotlib.pyplot as plt
    import numpy as np

    schemes = list(paper_share)
    workloads = list(dict.fromkeys(w for w, _, _ in share))
    fig, ax = plt.subplots(figsize=figsize)
    x = np.arange(len(schemes))
    width = 0.8 / (2 * len(workloads) + 1)
    k = 0
    for w, color in zip(workloads, ("#4C72B0", "#DD8452"), strict=False):
        for snap in ("done", "half"):
            label = f"{w}, {'at completion' if snap == 'done' else 'halfway through output'}"
            ax.bar(x + (k - len(workloads)) * width, [share[w, snap, s] for s in schemes], width,
                   color=color if snap == "done" else "white", edgecolor=color,
                   hatch=None if snap == "done" else "//", label=label)  # fmt: skip
            k += 1
    paper = [paper_share[s] for s in schemes]
    ax.bar(
        x + len(workloads) * width,
        paper,
        width,
        color="#555555",
        label="paper, measured while serving (Fig. 2)",
    )
    for xi, p in zip(x, paper, strict=True):
        ax.text(xi + len(workloads) * width, p + 0.015, f"{p:.1%}", ha="center", fontsize=8)
    names = {"static": "static\nOrca (Max)", "pow2": "pow2\nOrca (Pow2)", "oracle": "oracle\nOrca (Oracle)",
             "paged": f"paged (block {block_size})\nvLLM"}  # fmt: skip
    ax.set_xticks(x, [names.get(s, s) for s in schemes])
    ax.set_ylim(0, 1.12)
    ax.set_yticks(np.linspace(0, 1, 6), [f"{v:.0%}" for v in np.linspace(0, 1, 6)])
    ax.set_ylabel("reserved KV slots holding real tokens")
    ax.set_title("Share of reserved KV memory that holds real tokens")
    ax.legend(frameon=False, fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    return fig


def plot_length_sweeps(
    sweep: dict,
    max_lens,
    block_sizes,
    *,
    budget_label: str,
    block_size: int = 16,
    default_max_len: int = 2048,
    figsize: tuple[float, float] = (11, 7.5),
) -> Figure:
    """2 x 2 plots: share of slots holding tokens (top) and requests that fit (bottom), against
    max_len (left) and block_size (right).

    sweep: {(workload, scheme, "max_len" | "block", x): (share, fits)}."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    workloads = list(dict.fromkeys(k[0] for k in sweep))
    fig, axes = plt.subplots(2, 2, figsize=figsize, sharex="col")
    for row, metric in enumerate(
        ["share of reserved slots holding tokens", f"requests that fit in {budget_label}"]
    ):
        for w, ls in zip(workloads, ("-", "--"), strict=False):
            for s in ("static", "paged"):
                color = SCHEME_COLORS[s]
                axes[row, 0].plot(max_lens, [sweep[w, s, "max_len", m][row] for m in max_lens], color=color,
                                  ls=ls, marker="o", label=f"{s}, {w}")  # fmt: skip
            paged = [sweep[w, "paged", "block", b][row] for b in block_sizes]
            axes[row, 1].plot(block_sizes, paged, color=SCHEME_COLORS["paged"], ls=ls, marker="o",
                              label=f"paged, {w}")  # fmt: skip
            static = sweep[w, "static", "max_len", default_max_len][row]
            axes[row, 1].axhline(static, color=SCHEME_COLORS["static"], ls=ls, lw=1.5,
                                 label=f"static ({default_max_len}), {w}")  # fmt: skip
        axes[row, 0].set_ylabel(metric)
        for ax in axes[row]:
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_ylim(0, 1.05)
                ax.yaxis.set_major_formatter(PercentFormatter(1.0))
            else:
                ax.set_yscale("log")
                ax.set_yticks([2, 5, 10, 20, 50, 100, 200], ["2", "5", "10", "20", "50", "100", "200"])
                ax.minorticks_off()
    axes[0, 0].set_title(f"vary max_len (paged: block {block_size})")
    axes[0, 1].set_title(f"vary block_size (paged; static at max_len {default_max_len})")
    axes[1, 0].set_xticks(list(max_lens), [str(m) for m in max_lens])
    axes[1, 1].set_xticks(list(block_sizes), [str(b) for b in block_sizes])
    axes[1, 0].set_xlabel("max_len (tokens)")
    axes[1, 1].set_xlabel("block_size (tokens)")
    axes[0, 0].legend(frameon=False, fontsize=8)
    axes[0, 1].legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def draw_causal_mask(mask, *, start: int = 0, ax: Axes | None = None, title: str | None = None) -> Figure:
    """A prefill mask as a heatmap: rows are new tokens (at positions start, start+1, ...), columns the
    cached positions they may read (True = read)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    m = np.asarray(mask, dtype=bool)  # (num_new, seq_len)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.45 * m.shape[1] + 1.6, 0.45 * m.shape[0] + 1.2))
    ax.imshow(m, cmap=ListedColormap([FREE_FACE, PROMPT_FACE]), vmin=0, vmax=1, aspect="equal")
    ax.set_xticks(np.arange(m.shape[1]), [str(c) for c in range(m.shape[1])], fontsize=8)
    ax.set_yticks(np.arange(m.shape[0]), [str(start + r) for r in range(m.shape[0])], fontsize=8)
    ax.set_xticks(np.arange(m.shape[1] + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(m.shape[0] + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position (read from the cache)")
    ax.set_ylabel("new token at position")
    if title:
        ax.set_title(title, fontsize=10)
    return ax.figure


def draw_flat_batch(
    query_lens, seq_lens, *, names=None, figsize: tuple[float, float] | None = None
) -> Figure:
    """The flat prefill batch: every sequence's new tokens back to back (top, with `query_start_loc`
    marked), and where they sit in each sequence: its last query_len positions (below)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    qlens, slens = [int(q) for q in query_lens], [int(s) for s in seq_lens]
    names = list(names) if names is not None else [str(i) for i in range(len(qlens))]
    starts = [sum(qlens[:i]) for i in range(len(qlens) + 1)]
    width = max(starts[-1], max(slens))
    if figsize is None:
        figsize = (max(6.0, 0.42 * width + 2.5), 1.4 + 0.7 * (len(qlens) + 1))
    fig, ax = plt.subplots(figsize=figsize)
    for i, (q, L) in enumerate(zip(qlens, slens, strict=True)):
        color = PALETTE[i % len(PALETTE)]
        for j in range(q):  # top row: the flat query
            ax.add_patch(Rectangle((starts[i] + j, 0), 0.92, 0.8, facecolor=color, edgecolor="white"))
            ax.text(
                starts[i] + j + 0.46, 0.4, str(L - q + j), ha="center", va="center", fontsize=7, color="white"
            )
        y = -1.4 - i
        for t in range(L):  # the sequence: cached (light) then new (solid)
            new = t >= L - q
            ax.add_patch(Rectangle((t, y), 0.92, 0.8, facecolor=color, alpha=1.0 if new else 0.25,
                                   edgecolor="white"))  # fmt: skip
        ax.text(-0.3, y + 0.4, f"seq {names[i]}: seq_len {L}", ha="right", va="center", fontsize=9)
    for i, s in enumerate(starts):  # query_start_loc
        ax.plot([s - 0.04] * 2, [-0.15, 1.05], color="black", lw=1.5)
        ax.text(
            s - 0.04, 1.15, f"query_start_loc[{i}] = {s}", rotation=30, fontsize=7, ha="left", va="bottom"
        )
    ax.text(-0.3, 0.4, "flat query", ha="right", va="center", fontsize=9, weight="bold")
    ax.set_title("light: already in the cache; solid: this forward's new tokens (numbers: positions)",
                 fontsize=9, loc="left")  # fmt: skip
    ax.set_xlim(-6.5, width + 0.5)
    ax.set_ylim(-1.6 - len(qlens), 3.2)
    ax.set_xticks(range(0, width + 1, 2 if width <= 30 else 5))
    ax.set_yticks([])
    ax.set_xlabel("token index (flat batch on top; position in the sequence below; numbers = position)")
    _bare(ax)
    fig.tight_layout()
    return fig


TIMELINE_STATES = {  # state -> (face, label)
    "waiting": ("#E8E8E8", "waiting"),
    "prefill": ("#4C72B0", "admitted: prefill"),
    "decode": ("#9DB8DB", "running: decode"),
    "preempted": ("#C0392B", "preempted (blocks freed)"),
    "finished": ("#27AE60", "finished (blocks freed)"),
}


def plot_request_timeline(
    timeline: dict,
    *,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (10, 3.2),
    title: str | None = None,
) -> Figure:
    """One row per request, one cell per engine step, coloured by what the request did in that step.
    timeline: {request_id: [state per step]}, states from TIMELINE_STATES or None (not there)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    ids = sorted(timeline)
    steps = max(len(v) for v in timeline.values())
    for row, rid in enumerate(ids):
        for step, state in enumerate(timeline[rid]):
            if state is not None:
                ax.add_patch(Rectangle((step, -row - 0.4), 0.94, 0.8, facecolor=TIMELINE_STATES[state][0],
                                       edgecolor="white"))  # fmt: skip
    ax.set_xlim(-0.2, steps + 0.2)
    ax.set_ylim(-len(ids) + 0.4, 0.6)
    ax.set_yticks([-r for r in range(len(ids))], [f"request {r}" for r in ids])
    ax.set_xticks([s + 0.47 for s in range(steps)], [str(s) for s in range(steps)], fontsize=8)
    ax.set_xlabel("engine step")
    ax.set_title(title or "what each request did in each step", loc="left", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=face) for face, _ in TIMELINE_STATES.values()]
    ax.legend(handles, [label for _, label in TIMELINE_STATES.values()], loc="upper center",
              bbox_to_anchor=(0.5, -0.28), ncol=5, frameon=False, fontsize=8)  # fmt: skip
    _bare(ax)
    ax.figure.tight_layout()
    return ax.figure


def plot_pool_and_batch(stats, *, figsize: tuple[float, float] = (11, 3.4)) -> Figure:
    """An engine run's `StepStats` as two plots: KV slots allocated / holding tokens during each step's
    forward (preemptions marked), and the sequences in each forward (decodes + prefills)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [s.step for s in stats]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=figsize)
    ax1.plot(steps, [s.allocated_slots for s in stats], drawstyle="steps-mid", label="slots allocated")
    ax1.plot(steps, [s.num_tokens for s in stats], drawstyle="steps-mid", label="slots holding a token")
    ax1.axhline(stats[0].pool_slots, color="grey", ls=":", label="pool")
    for s in stats:
        if s.num_preemptions:
            ax1.axvline(s.step, color="C3", alpha=0.4)
    ax1.set(
        xlabel="engine step",
        ylabel="token slots (during the forward)",
        title="KV pool (red line: a preemption)",
    )
    ax1.set_ylim(0, stats[0].pool_slots * 1.1)
    ax1.legend(fontsize=8, loc="lower left")
    decodes = [s.num_decodes for s in stats]
    ax2.bar(steps, decodes, label="decodes")
    ax2.bar(steps, [s.num_prefills for s in stats], bottom=decodes, label="prefills")
    ax2.set(xlabel="engine step", ylabel="sequences in the forward", title="running batch")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def plot_engine_experiment(
    results: dict,
    finished_per_step: dict,
    paper_batch: dict,
    paper_share: dict,
    *,
    figsize: tuple[float, float] = (15, 3.8),
) -> Figure:
    """Static vs oracle vs paged: mean running batch (both workloads, log scale), KV budget holding
    tokens (first workload) and requests finished over the steps (first workload). results:
    {(workload, policy): {"batch", "kv_tokens"}}; finished_per_step: {policy: cumulative counts}."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    workloads = list(dict.fromkeys(w for w, _ in results))
    policies = list(dict.fromkeys(p for _, p in results))
    colors = [SCHEME_COLORS.get(p, "C0") for p in policies]
    fig, axes = plt.subplots(1, 3, figsize=figsize)
    ticks = []
    for k, w in enumerate(workloads):
        xs = [(len(policies) + 1) * k + j for j in range(len(policies))]
        ticks += xs
        axes[0].bar(xs, [results[w, p]["batch"] for p in policies], color=colors)
        axes[0].scatter(xs, [paper_batch[w][p] for p in policies], marker="_", s=400, color="k", zorder=3,
                        label="paper (OPT-13B)" if k == 0 else None)  # fmt: skip
    axes[0].set_xticks(ticks, policies * len(workloads), fontsize=8)
    axes[0].set(yscale="log", ylabel="sequences", title=f"mean running batch ({' | '.join(workloads)})")
    axes[0].legend(fontsize=8)
    w0 = workloads[0]
    axes[1].bar(policies, [results[w0, p]["kv_tokens"] for p in policies], color=colors)
    axes[1].scatter(policies, [paper_share[p] for p in policies], marker="_", s=400, color="k", zorder=3,
                    label="paper Fig. 2")  # fmt: skip
    axes[1].set(ylim=(0, 1), ylabel="share of the KV budget", title=f"KV budget holding real tokens ({w0})")
    axes[1].legend(fontsize=8)
    for p, color in zip(policies, colors, strict=True):
        axes[2].plot(finished_per_step[p], color=color, label=p)
    axes[2].set(xlabel="engine step", ylabel="requests finished", title=f"requests finished ({w0})")
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    return fig


PIPELINE = (  # (package piece, what it does, notebook)
    ("BlockAllocator", "free list + ref counts\nof physical block ids", "02"),
    ("BlockManager", "page tables: logical ->\nphysical, slot mapping", "03"),
    ("PagedKVCache", "K/V pools; writes through\nthe slot mapping", "04"),
    ("paged_attention", "reads K/V through the\nblock table (torch, CUDA)", "04, 05, 07"),
    ("LlamaModel", "a flat batch of prefills\nand decodes per forward", "06"),
    ("Scheduler", "admit, grow, preempt,\nfree: each step", "06"),
    ("LLMEngine", "requests in, tokens out;\nstats per step", "06"),
)


def draw_pipeline(*, figsize: tuple[float, float] = (13, 3.2)) -> Figure:
    """The whole of vllmini as one row of boxes, lowest layer on the left, with the notebook that
    builds each piece; data flows left to right, nothing imports a box to its right."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=figsize)
    n = len(PIPELINE)
    for i, (name, what, nb) in enumerate(PIPELINE):
        x = i * 1.9
        ax.add_patch(FancyBboxPatch((x, 0), 1.6, 1.3, boxstyle="round,pad=0.05", facecolor=PALETTE[i % 9],
                                    alpha=0.18, edgecolor=PALETTE[i % 9], lw=2))  # fmt: skip
        ax.text(x + 0.8, 1.05, name, ha="center", va="center", fontsize=10, weight="bold", family="monospace")
        ax.text(x + 0.8, 0.55, what, ha="center", va="center", fontsize=8)
        ax.text(
            x + 0.8,
            -0.25,
            f"notebook{'s' if ',' in nb else ''} {nb}",
            ha="center",
            va="center",
            fontsize=8,
            color="#555555",
        )
        if i < n - 1:
            ax.annotate("", (x + 1.88, 0.65), (x + 1.66, 0.65), arrowprops=dict(arrowstyle="->", lw=1.5))
    flow = "block ids  ->  page tables  ->  KV cache  ->  attention  ->  model  ->  scheduler  ->  engine"
    ax.text(0, 1.7, flow, fontsize=9, color="#555555")
    ax.set_xlim(-0.2, n * 1.9)
    ax.set_ylim(-0.5, 1.95)
    ax.set_axis_off()
    fig.tight_layout()
    return fig


def plot_requests_that_fit(
    budgets, curves: dict, paper: dict, *, paper_budget: float, subtitle: str = "",
    figsize: tuple[float, float] = (11, 4),
) -> Figure:  # fmt: skip
    """One plot per workload: requests that fit against the KV budget, one line per scheme, with the
    paper's measurement as a diamond. curves, paper: {(workload, scheme): list of counts | count}."""
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(w for w, _ in curves))
    schemes = list(dict.fromkeys(s for _, s in curves))
    fig, axes = plt.subplots(1, len(workloads), figsize=figsize, squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        for s in schemes:
            color = SCHEME_COLORS.get(s, "C0")
            ax.plot(budgets, curves[w, s], color=color, lw=2, label=s)
            ax.plot(paper_budget, paper[w, s], "D", color=color, markeredgecolor="black", ms=7)
        ax.plot([], [], "D", color="white", markeredgecolor="black", label="paper, mean batch (Fig. 13)")
        ax.axvline(paper_budget, color="black", lw=0.8, ls=":")
        ax.set(title=f"{w}{', ' + subtitle if subtitle else ''}", xlabel="KV cache budget (GB)",
               ylabel="requests that fit")  # fmt: skip
        ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


# ---- CUDA pictures (notebook 05)
# How a kernel's threads are organised and who reads what; pure functions of their arguments.

WARP_SIZE = 32


def draw_cuda_hierarchy(grid: tuple[int, int] = (4, 2), threads: int = 128, figsize=(14, 4.4)) -> Figure:
    """Grid -> thread block -> warp -> lane, and which memory each level sees (notebook 05a)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import ConnectionPatch, Rectangle

    gx, gy = grid
    warps = threads // WARP_SIZE
    fig, (ga, ba, wa) = plt.subplots(1, 3, figsize=figsize, gridspec_kw={"width_ratios": [1.1, 1, 1.5]})
    for y in range(gy):  # the grid: gx x gy thread blocks
        for x in range(gx):
            hot = (x, y) == (1, 0)
            ga.add_patch(Rectangle((x, y), 0.9, 0.9, fc=PALETTE[0] if hot else "#c6dbef", ec="black"))
            ga.text(x + 0.45, y + 0.45, f"block\n({x},{y})", ha="center", va="center", fontsize=8,
                    color="white" if hot else "black")  # fmt: skip
    ga.set(xlim=(-0.1, gx), ylim=(gy + 0.1, -0.1), xticks=[], yticks=[])
    grid_title = f"the grid: gridDim = ({gx}, {gy}) thread blocks"
    ga.set_title(f"{grid_title}\nblockIdx = (x, y); all blocks see global memory")
    for w in range(warps):  # one block: its warps
        ba.add_patch(Rectangle((0, w), 1, 0.85, fc=PALETTE[1 + w % 8], alpha=0.8, ec="black"))
        ba.text(0.5, w + 0.42, f"warp {w}: threads {w * WARP_SIZE}..{w * WARP_SIZE + WARP_SIZE - 1}",
                ha="center", va="center", fontsize=8)  # fmt: skip
    ba.add_patch(Rectangle((0, warps + 0.1), 1, 0.7, fc="#fff2cc", ec="black", hatch="//"))
    ba.text(0.5, warps + 0.45, "shared memory of this block", ha="center", va="center", fontsize=8,
            bbox=dict(fc="white", ec="none", pad=1))  # fmt: skip
    ba.set(xlim=(-0.05, 1.05), ylim=(warps + 0.9, -0.1), xticks=[], yticks=[])
    ba.set_title(f"block (1,0): blockDim = {threads} threads\nthreadIdx.x = 0..{threads - 1}, on one SM")
    for lane in range(WARP_SIZE):  # one warp: its lanes
        r, c = divmod(lane, 8)
        wa.add_patch(Rectangle((c, r), 0.92, 0.9, fc=PALETTE[2], alpha=0.8, ec="black"))
        wa.text(
            c + 0.46, r + 0.45, f"lane {lane}\nt={WARP_SIZE + lane}", ha="center", va="center", fontsize=7
        )
    wa.set(xlim=(-0.05, 8), ylim=(4.1, -0.1), xticks=[], yticks=[])
    wa.set_title(
        "warp 1: 32 lanes (t = threadIdx.x), one instruction at a time\n"
        "lane = t % 32; each lane has its own registers"
    )
    for (src, dst, xy_a, xy_b) in ((ga, ba, (1.9, 0.0), (0, 0)), (ga, ba, (1.9, 0.9), (0, warps + 0.8)),
                                   (ba, wa, (1, 1), (0, 0)), (ba, wa, (1, 1.85), (0, 4))):  # fmt: skip
        fig.add_artist(
            ConnectionPatch(xy_a, xy_b, "data", "data", axesA=src, axesB=dst, color="grey", lw=0.8)
        )
    fig.tight_layout()
    return fig


def butterfly_steps(values) -> list[list[float]]:
    """The 32 lane values before and after each step of the xor butterfly (masks 16, 8, 4, 2, 1)."""
    rows = [[float(v) for v in values]]
    assert len(rows[0]) == WARP_SIZE, "one value per lane"
    for mask in (16, 8, 4, 2, 1):
        prev = rows[-1]
        rows.append([prev[lane] + prev[lane ^ mask] for lane in range(WARP_SIZE)])
    return rows


def draw_butterfly(values, lane: int = 0, figsize=(14, 5.2)) -> Figure:
    """Which lane adds which in each step of `v += __shfl_xor_sync(0xffffffff, v, k)`; `lane` in red."""
    import matplotlib.pyplot as plt

    rows = butterfly_steps(values)
    fig, ax = plt.subplots(figsize=figsize)
    for step, mask in enumerate((16, 8, 4, 2, 1)):
        ax.plot([lane, lane], [step + 0.18, step + 0.82], color="red", lw=1.8, zorder=2)  # its own value
        for a in range(WARP_SIZE):  # a line into lane a from its partner a ^ mask
            b = a ^ mask
            mine = a == lane
            ax.plot([b, a], [step + 0.18, step + 0.82], color="red" if mine else "#bbbbbb",
                    lw=1.8 if mine else 0.5, zorder=2 if mine else 1)  # fmt: skip
        ax.text(WARP_SIZE - 0.2, step + 0.5, f"k = {mask:>2}: lane l adds lane l ^ {mask}", fontsize=8,
                va="center")  # fmt: skip
    for step, row in enumerate(rows):
        for a, v in enumerate(row):
            ax.text(a, step, f"{v:g}", ha="center", va="center", fontsize=6.5,
                    bbox=dict(boxstyle="round,pad=0.2", fc="#ffe0e0" if a == lane else "white",
                              ec="red" if a == lane else "#999999", lw=0.6))  # fmt: skip
    ax.set_xlim(-0.7, WARP_SIZE + 6.5)
    ax.set_ylim(len(rows) - 0.5, -0.7)
    ax.set_xticks(range(0, WARP_SIZE, 2))
    ax.set_xlabel("lane")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["start"] + [f"after step {s}" for s in range(1, len(rows))])
    ax.set_title(f"the butterfly: 5 shuffles, and every lane holds the sum {rows[-1][0]:g} "
                 f"(red: the values lane {lane} adds)")  # fmt: skip
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def online_softmax_trace(scores) -> list[tuple[float, float, float]]:
    """(running max m, running sum l = sum exp(s - m), rescale factor exp(m_old - m)) after each score."""
    import math

    m, l, out = -math.inf, 0.0, []
    for s in scores:
        m_new = max(m, float(s))
        factor = math.exp(m - m_new)  # 0 for the first score (m = -inf)
        l = l * factor + math.exp(float(s) - m_new)
        m = m_new
        out.append((m, l, factor))
    return out


def draw_online_softmax(scores, chunks: int = 3, figsize=(14, 4.2)) -> Figure:
    """Left: running max and sum as the scores arrive, rescaled when the max grows. Right: `chunks`
    warps each keep (m, l) of their own tokens; the merge rescales each to the common max."""
    import math

    import matplotlib.pyplot as plt

    scores = [float(s) for s in scores]
    trace = online_softmax_trace(scores)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=figsize, gridspec_kw={"width_ratios": [1.5, 1]})
    t = range(len(scores))
    ax.plot(t, scores, "o", color="grey", label="score of token t")
    ax.step(t, [m for m, _, _ in trace], where="post", color=PALETTE[3], label="running max m")
    for i, (_, _, factor) in enumerate(trace):
        if 0 < factor < 1:
            ax.annotate(f"x{factor:.2f}", (i, trace[i][0]), textcoords="offset points", xytext=(0, 8),
                        ha="center", fontsize=7, color=PALETTE[3])  # fmt: skip
    ax.margins(y=0.2)
    ax.set_xlabel("token t (arriving one at a time)")
    ax.set_ylabel("score / max")
    lx = ax.twinx()
    lx.plot(t, [l for _, l, _ in trace], "s-", color=PALETTE[0], ms=3, label="running sum l")
    lx.set_ylabel("l = sum of exp(score - m)", color=PALETTE[0])
    ax.legend(handles=ax.get_legend_handles_labels()[0] + lx.get_legend_handles_labels()[0], fontsize=8,
              loc="upper left")  # fmt: skip
    ax.set_title("online softmax: when the max grows, the sum so far is multiplied by exp(m_old - m_new)")
    size = math.ceil(len(scores) / chunks)
    parts = [online_softmax_trace(scores[i * size : (i + 1) * size])[-1] for i in range(chunks)]
    big = max(m for m, _, _ in parts)
    names = [f"warp {w}" for w in range(chunks)]
    bx.bar(names, [l for _, l, _ in parts], color="#cccccc", label="l_w (own max m_w)")
    bx.bar(names, [l * math.exp(m - big) for m, l, _ in parts], color=PALETTE[0], width=0.5,
           label="l_w * exp(m_w - M)")  # fmt: skip
    merged = sum(l * math.exp(m - big) for m, l, _ in parts)
    bx.bar(["merged"], [merged], color=PALETTE[2], label="sum: the whole context's l")
    for i, (m, l, _) in enumerate(parts):
        bx.text(i, l, f"m_w = {m:.1f}", ha="center", va="bottom", fontsize=8)
    bx.set_title(f"the merge: {chunks} warps, tokens {size} each; M = max m_w = {big:.1f}")
    bx.legend(fontsize=8)
    fig.tight_layout()
    return fig


def page_read_owner(kernel: str, block_size: int = 16, head_size: int = 128):
    """[block_size, head_size] int array: which thread (kernel "1") or lane ("2", "3") reads each element
    of one K page in one step: "1" thread t reads token t's whole row; "2" lane l reads dims l, l+32, ...;
    "3" lane l reads the consecutive dims l*D .. l*D+D-1, D = head_size / 32."""
    import numpy as np

    if kernel not in ("1", "2", "3"):
        raise InvalidArgumentError(f"kernel must be '1', '2' or '3', got {kernel!r}")
    d = np.arange(head_size)
    if kernel == "1":
        return np.repeat(np.arange(block_size)[:, None], head_size, axis=1)
    dims = head_size // WARP_SIZE
    lane = d % WARP_SIZE if kernel == "2" else d // dims
    return np.repeat(lane[None, :], block_size, axis=0)


def draw_page_reads(block_size: int = 16, head_size: int = 128, figsize=(14, 7.5)) -> Figure:
    """One K page (block_size tokens x head_size float32) coloured by the thread that reads each element,
    for kernels 1, 2 and 3, with what ONE load instruction of a warp touches outlined in red."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    dims = head_size // WARP_SIZE
    panels = [
        ("1", f"kernel 1: thread t reads token t's whole row, one float per instruction.\n"
              f"One warp instruction: float 0 of 32 rows ({min(block_size, WARP_SIZE)} in this page), "
              f"{head_size * 4} bytes apart (not coalesced)"),
        ("2", f"kernel 2: a warp per token; lane l reads dims l, l+32, ... ({dims} loads of 4 bytes).\n"
              f"One warp instruction: 32 adjacent floats = 128 bytes (coalesced)"),
        ("3", f"kernels 3 and 4: lane l reads dims {dims}l .. {dims}l+{dims - 1}, one {dims * 4}-byte load.\n"
              f"One warp instruction: the whole row, {head_size * 4} adjacent bytes"),
    ]  # fmt: skip
    fig, axes = plt.subplots(3, 1, figsize=figsize)
    for ax, (kernel, title) in zip(axes, panels, strict=True):
        owner = page_read_owner(kernel, block_size, head_size)
        ax.imshow(owner, cmap="viridis", aspect="auto", interpolation="nearest")
        if kernel == "1":
            ax.add_patch(Rectangle((-0.5, -0.5), 1, block_size, fill=False, ec="red", lw=2))
        elif kernel == "2":
            ax.add_patch(Rectangle((-0.5, -0.5), WARP_SIZE, 1, fill=False, ec="red", lw=2))
        else:
            ax.add_patch(Rectangle((-0.5, -0.5), head_size, 1, fill=False, ec="red", lw=2))
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylabel("slot (token)")
        ax.set_yticks(range(0, block_size, 4))
    axes[-1].set_xlabel(
        "head dimension (4 bytes each); colour: the thread (kernel 1) or lane that reads it, "
        "dark = 0, yellow = the last; red: what one load instruction of a warp reads"
    )
    fig.tight_layout()
    return fig


def draw_token_mapping(
    seq_len: int = 150,
    block_size: int = 16,
    tokens_per_step: int = 8,
    num_warps: int = 8,
    seed: int = 3,
    figsize=(11, 4.6),
) -> Figure:
    """One sequence's tokens in their pages (one row per logical block, labelled with its physical page),
    coloured by the warp that scores them: warp w takes tokens_per_step consecutive tokens, then the
    next warp, round robin."""
    import math
    import random

    import matplotlib.pyplot as plt

    rng = random.Random(seed)
    pages = rng.sample(range(4 * math.ceil(seq_len / block_size)), math.ceil(seq_len / block_size))
    fig, ax = plt.subplots(figsize=figsize)
    for t in range(seq_len):
        row, col = divmod(t, block_size)
        warp = (t // tokens_per_step) % num_warps
        ax.add_patch(
            plt.Rectangle((col, row), 1, 1, color=PALETTE[warp % len(PALETTE)], alpha=0.75, ec="white")
        )
        ax.text(col + 0.5, row + 0.5, t, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, block_size)
    ax.set_ylim(len(pages), 0)
    ax.set_yticks([r + 0.5 for r in range(len(pages))])
    ax.set_yticklabels([f"block {r} -> page {p}" for r, p in enumerate(pages)])
    ax.set_xticks([c + 0.5 for c in range(block_size)])
    ax.set_xticklabels(range(block_size))
    ax.set_xlabel("slot in page")
    ax.set_title(f"which warp scores which token ({tokens_per_step} consecutive tokens per warp step)")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=PALETTE[w % len(PALETTE)], alpha=0.75) for w in range(num_warps)
    ]
    ax.legend(handles, [f"warp {w}" for w in range(num_warps)], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8)  # fmt: skip
    fig.tight_layout()
    return fig


# ---- serving pictures (latency vs rate)

POLICY_COLORS = {"static": "C3", "oracle": "C1", "paged": "C2"}


def plot_latency_vs_rate(points, *, factor: float = 5.0, ax: Axes | None = None, title: str | None = None):
    """Mean normalized latency (ms/token) against request rate, one line per policy, from
    `vllmini.serving.rate_sweep` points; a dotted line marks the highest rate each policy sustains (below
    `factor` x its lowest-rate latency, the dashed line). Hollow markers: runs cut off (lower bounds)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from vllmini.serving import sustained_rate

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.2))
    thresholds = []
    for k, policy in enumerate(dict.fromkeys(p.policy for p in points)):
        pts = sorted((p for p in points if p.policy == policy), key=lambda p: p.rate)
        color = POLICY_COLORS.get(policy, f"C{k + 4}")
        s = sustained_rate(pts, policy, factor)
        rates, lat = [p.rate for p in pts], [1e3 * p.mean_normalized_latency for p in pts]
        bound = "" if s.crossed else ">= "
        ax.plot(rates, lat, "-", color=color, label=f"{policy}: sustains {bound}{s.rate:.3g} requests/s")
        done = [p.metrics.complete for p in pts]
        ax.scatter(
            rates, lat, s=28, zorder=3, color=[color if d else "white" for d in done], edgecolors=color
        )
        if s.crossed:
            ax.axvline(s.rate, color=color, ls=":", lw=1.2)
        thresholds.append((1e3 * s.threshold, color))
    spread = max(t for t, _ in thresholds) / min(t for t, _ in thresholds)
    for t, color in thresholds[:1] if spread < 1.05 else thresholds:  # one line when they coincide
        ax.axhline(t, color="grey" if spread < 1.05 else color, ls="--", lw=0.9)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set(
        xlabel="request rate (requests/s)",
        ylabel="mean normalized latency (ms/token)",
        title=title or f"latency vs request rate (dashed: {factor:g}x the lowest-rate latency)",
    )
    ax.legend(fontsize=8, loc="lower right")  # the curves rise to the upper left
    return ax


# ---- kernel performance (notebook 07)


def plot_decode_roofline(
    read_bw: float, peak_flops: float, points: dict[str, float], *, ax: Axes | None = None, figsize=(6.4, 3.6)
) -> Figure:
    """A roofline: attainable FLOP/s = min(peak_flops, intensity * read_bw) on log axes, with each named
    arithmetic intensity (FLOP per byte read) marked on the memory slope."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=figsize)
    x = np.logspace(-1, 3, 200)  # FLOP per byte
    ax.loglog(x, np.minimum(peak_flops, x * read_bw) / 1e12, color="black", linewidth=1.5)
    ax.axvline(peak_flops / read_bw, color="grey", linestyle=":", linewidth=1)
    ax.text(peak_flops / read_bw * 1.1, peak_flops / 1e12 / 3, "ridge", fontsize=8, color="grey")
    slope = f"slope: memory, {read_bw / 1e12:.1f} TB/s x intensity"
    ax.text(0.03, 0.92, slope, fontsize=8, transform=ax.transAxes)
    flat = f"flat: compute,\n{peak_flops / 1e12:.0f} TFLOP/s"
    ax.text(peak_flops / read_bw * 3, peak_flops / 1e12 / 2, flat, fontsize=8)
    for i, (name, intensity) in enumerate(points.items()):
        y = min(peak_flops, intensity * read_bw) / 1e12
        ax.plot(
            [intensity], [y], "o", color=PALETTE[i % len(PALETTE)], label=f"{name}: {intensity:.1f} FLOP/B"
        )
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("decode attention sits on the memory slope", fontsize=10)
    fig.tight_layout()
    return fig


def plot_kernel_work_split(
    layouts: dict[str, list[list[int]]], *, figsize=(10, 3.2), num_tokens: int | None = None
) -> Figure:
    """One panel per kernel version: rows = query heads, columns = tokens of one sequence, each cell
    coloured by the thread block that reads that token's K/V row for that head. A column with several
    colours is a K/V row read several times (once per block)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    fig, axes = plt.subplots(1, len(layouts), figsize=figsize, squeeze=False)
    cmap = ListedColormap(list(PALETTE))
    for ax, (name, grid) in zip(axes[0], layouts.items(), strict=True):
        ax.imshow([[b % len(PALETTE) for b in row] for row in grid], cmap=cmap, vmin=0, vmax=len(PALETTE) - 1,
                  aspect="auto", interpolation="nearest")  # fmt: skip
        blocks = len({b for row in grid for b in row})
        ax.set_title(f"{name}\n{blocks} blocks", fontsize=9)
        ax.set_xlabel("token")
        ax.set_yticks(range(len(grid)), [f"q{h}" for h in range(len(grid))], fontsize=7)
    axes[0][0].set_ylabel("query head")
    fig.tight_layout()
    return fig


def plot_recorded_bandwidth(rows: list[dict], dtype: str, *, figsize=(10, 3.6)) -> Figure:
    """Bars of GB/s per shape for the read ceiling, contiguous SDPA, the torch gather and every kernel
    version, from rows recorded by benchmarks/bench_attention.py (--json)."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["dtype"] == dtype and r["block_size"] == 16]
    keep = ["read ceiling", "sdpa (contiguous)", "torch gather"]
    keep += sorted({r["backend"] for r in rows if r["backend"].endswith(" kernel")})
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(keep)
    for i, name in enumerate(keep):
        vals = {r["shape"]: r["gb_per_s"] for r in rows if r["backend"] == name}
        xs = [j + i * width for j, s in enumerate(shapes) if s in vals]
        color = "black" if name == "read ceiling" else PALETTE[i % len(PALETTE)]
        ax.bar(xs, [vals[s] / 1e3 for s in shapes if s in vals], width, label=name, color=color)
    labels = [s.split(" D=")[0].replace(" ", "\n", 2) for s in shapes]
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], labels, fontsize=7)
    ax.set_ylabel("TB/s of K+V read")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig

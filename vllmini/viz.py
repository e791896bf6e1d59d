"""Pictures of the page table: a static figure and an interactive explorer.

`draw_page_table(manager)` draws each sequence's logical blocks on the left, the physical block pool
on the right (free blocks dashed, the next one to be handed out marked), and an arrow from every
logical block to the physical block that holds it. Each sequence has one colour in both views; filled
token slots are coloured, empty ones white; a block shared by several sequences (ref_count > 1) is
striped in its owners' colours and labelled. `PageTableExplorer` wraps a `BlockManager` in
ipywidgets buttons so a learner can add, grow, fork and free sequences and watch the picture change.

Viz only reads: it never changes the manager, tables or allocator it draws. matplotlib and
ipywidgets are imported inside the functions that need them, so `import vllmini` stays light.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllmini.allocator import BlockAllocator
from vllmini.block_table import BlockManager, BlockTable
from vllmini.errors import VllminiError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# tab10 without its grey (grey means "free" here)
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#bcbd22", "#17becf",
)  # fmt: skip
FREE_FACE, FREE_EDGE = "#f3f3f3", "#b0b0b0"


@dataclass
class _Snapshot:
    """Plain copies of everything the picture needs (so drawing cannot touch the live objects)."""

    block_size: int
    num_blocks: int
    seqs: list[tuple[object, list[int], int]]  # (seq_id, block_ids, num_tokens)
    ref_counts: list[int]
    free_ids: tuple[int, ...]


def _snapshot(manager_or_tables, allocator: BlockAllocator | None, seq_ids) -> _Snapshot:
    obj = manager_or_tables
    if isinstance(obj, BlockManager):
        tables = {s: obj.block_table(s) for s in obj.seq_ids}
        allocator = allocator or obj.allocator
    elif isinstance(obj, BlockTable):
        tables = {0: obj}
    elif isinstance(obj, dict):
        tables = dict(obj)
    else:
        raise TypeError(f"expected a BlockManager or a dict seq_id -> BlockTable, got {type(obj).__name__}")
    for seq_id, table in tables.items():
        if not isinstance(table, BlockTable):
            raise TypeError(f"tables[{seq_id!r}] is a {type(table).__name__}, expected a BlockTable")
    if allocator is None:
        if not tables:
            raise ValueError("an empty dict of tables needs allocator= to know the pool")
        allocator = next(iter(tables.values())).allocator
    sizes = {t.block_size for t in tables.values()}
    if len(sizes) > 1:
        raise ValueError(f"all tables must share one block_size, got {sorted(sizes)}")
    if any(t.allocator is not allocator for t in tables.values()):
        raise ValueError("every table must use the allocator being drawn")
    block_size = sizes.pop() if sizes else getattr(obj, "block_size", 1)
    if seq_ids is not None:
        missing = [s for s in seq_ids if s not in tables]
        if missing:
            raise ValueError(f"seq_ids {missing} not found; known: {list(tables)}")
        tables = {s: tables[s] for s in seq_ids}
    return _Snapshot(
        block_size=block_size,
        num_blocks=allocator.num_blocks,
        seqs=[(s, t.block_ids, t.num_tokens) for s, t in tables.items()],
        ref_counts=[allocator.ref_count(b) for b in range(allocator.num_blocks)],
        free_ids=allocator.free_block_ids,
    )


def seq_color(seq_id, order: int = 0) -> str:
    """The colour of a sequence: fixed by an int seq_id (stable across redraws), else by its order."""
    key = seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else order
    return PALETTE[key % len(PALETTE)]


def _layout(snap: _Snapshot, max_pool_rows: int):
    """Row positions: logical blocks stacked per sequence (left), the pool in columns (right)."""
    logical = []  # (seq_index, logical_index, row)
    seq_rows = []  # (first_row, last_row) per sequence
    row = 0.0
    for k, (_, block_ids, _) in enumerate(snap.seqs):
        first = row
        for i in range(len(block_ids)):
            logical.append((k, i, row))
            row += 1
        if not block_ids:
            row += 1  # an empty sequence still gets a row for its label
        seq_rows.append((first, row - 1))
        row += 0.5  # gap between sequences
    logical_rows = row - 0.5 if snap.seqs else 0
    # the pool wraps into columns of at most max_pool_rows, unless the logical side is taller anyway
    pool_rows = min(snap.num_blocks, max(max_pool_rows, int(logical_rows)))
    pool_cols = -(-snap.num_blocks // pool_rows)
    n_rows = max(logical_rows, pool_rows)
    return logical, seq_rows, pool_rows, pool_cols, n_rows


H = 0.8  # drawn height of a block row (rows are 1 apart)


def _draw_block(ax, x, y, cells, numbers, frame, *, width=1.6, style="-", gid=None, number_color="white"):
    """One block: a row of token cells (each a colour, a list of colours drawn as stripes, or None for
    empty), the numbers to write in them (or None), and a frame carrying the block's gid."""
    from matplotlib.patches import Rectangle

    for j, face in enumerate(cells):
        stripes = face if isinstance(face, list) else [face or "white"]
        for m, c in enumerate(stripes):  # one horizontal stripe per owner of a shared block
            ax.add_patch(Rectangle((x + j, y + m * H / len(stripes)), 1, H / len(stripes), facecolor=c, lw=0))
        ax.add_patch(Rectangle((x + j, y), 1, H, fill=False, edgecolor="white" if face else frame, lw=0.6))
        if numbers is not None:
            color = number_color if face and face != FREE_FACE else "#999999"
            ax.text(
                x + j + 0.5, y + H / 2, str(numbers[j]), ha="center", va="center", fontsize=7, color=color
            )
    ax.add_patch(Rectangle((x, y), len(cells), H, fill=False, edgecolor=frame, lw=width, ls=style, gid=gid))


def draw_page_table(
    manager_or_tables,
    allocator: BlockAllocator | None = None,
    *,
    seq_ids=None,
    colors: dict | None = None,
    title: str | None = None,
    show_numbers: bool | None = None,
    max_pool_rows: int = 16,
    figsize: tuple[float, float] | None = None,
    fig: Figure | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Draw the page table of a `BlockManager` (or a dict seq_id -> BlockTable plus its allocator).

    Left: each sequence's logical blocks, one row per block (cells = token slots; the number in a
    filled cell is the token index). Right: the physical pool (the number in a cell is its slot id,
    block_id * block_size + offset). Arrows: logical -> physical. Returns the matplotlib Figure; pass
    `fig=` to redraw into an existing figure or `ax=` to draw into an existing Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    snap = _snapshot(manager_or_tables, allocator, seq_ids)
    bs, seqs = snap.block_size, snap.seqs
    logical, seq_rows, pool_rows, pool_cols, n_rows = _layout(snap, max_pool_rows)
    if show_numbers is None:
        show_numbers = bs <= 8 and n_rows <= 40
    colors = dict(colors or {})
    for k, (s, _, _) in enumerate(seqs):
        colors.setdefault(s, seq_color(s, k))

    # geometry in data units: a token slot is 1 wide, a block row 1 high; the pool sits right of a gap
    px0 = bs + max(5.0, 1.2 * bs)  # left edge of the first pool column (the gap holds the arrows)
    label_room = 4.4  # right of each pool block, for "12 shared ×2"
    col_step = bs + label_room
    x_min, x_max = -5.0, px0 + pool_cols * col_step
    if ax is None:
        size = figsize or (min(16.0, 0.42 * (x_max - x_min)), min(14.0, 0.42 * (n_rows + 2.6)))
        if fig is None:
            fig = plt.figure(figsize=size)
        else:
            fig.clear()
            fig.set_size_inches(*size)
        ax = fig.add_axes((0.01, 0.01, 0.98, 0.98 if title == "" else 0.9))
    fig = ax.figure

    def pool_xy(block_id: int) -> tuple[float, float]:
        col, r = divmod(block_id, pool_rows)
        return px0 + col * col_step, float(r)

    # who holds each physical block, and how many of its slots hold tokens
    owners: dict[int, list] = {}
    fill: dict[int, int] = {}
    for s, block_ids, n in seqs:
        for i, b in enumerate(block_ids):
            owners.setdefault(b, []).append(colors[s])
            fill[b] = max(fill.get(b, 0), min(bs, n - i * bs))

    # ---- left: each sequence's logical blocks, with its name and length
    for (s, block_ids, n), (first, last) in zip(seqs, seq_rows, strict=True):
        c = colors[s]
        ax.plot([-2.0, -2.0], [first + 0.05, last + H - 0.05], color=c, lw=3, solid_capstyle="butt")
        name = {"ha": "right", "va": "center", "fontsize": 9, "color": c, "fontweight": "bold"}
        ax.text(-2.3, (first + last + H) / 2, f"seq {s}\n{n} tok", **name)
        if not block_ids:
            ax.text(0, first + H / 2, "(no blocks)", va="center", fontsize=8, color="grey")
    for k, i, row in logical:
        s, _, n = seqs[k]
        filled = min(bs, n - i * bs)
        cells = [colors[s] if j < filled else None for j in range(bs)]
        numbers = [i * bs + j if j < filled else "" for j in range(bs)] if show_numbers else None
        _draw_block(ax, 0, row, cells, numbers, colors[s], gid=f"logical:{s}:{i}")
        ax.text(-0.25, row + H / 2, f"L{i}", ha="right", va="center", fontsize=8, color="#444444")

    # ---- right: the physical pool; free blocks dashed grey, shared ones framed black and striped
    for b in range(snap.num_blocks):
        x, y = pool_xy(b)
        refs = snap.ref_counts[b]
        numbers = [b * bs + j for j in range(bs)] if show_numbers else None
        if refs == 0:
            label = f"{b} free" + (" (next)" if snap.free_ids and b == snap.free_ids[0] else "")
            _draw_block(
                ax, x, y, [FREE_FACE] * bs, numbers, FREE_EDGE, width=1.2, style="--", gid=f"physical:{b}"
            )
            ax.text(x + bs + 0.25, y + H / 2, label, va="center", fontsize=8, color="#999999")
            continue
        stripes = list(dict.fromkeys(owners.get(b, []))) or ["#777777"]  # one colour per distinct owner
        cells = [stripes if j < fill.get(b, 0) else None for j in range(bs)]
        frame, width = ("black", 2.4) if refs > 1 else (stripes[0], 1.6)
        _draw_block(ax, x, y, cells, numbers, frame, width=width, gid=f"physical:{b}")
        label = f"{b} shared ×{refs}" if refs > 1 else f"{b}"
        ax.text(
            x + bs + 0.25, y + H / 2, label, va="center", fontsize=8, fontweight="bold" if refs > 1 else None
        )

    # ---- arrows: logical block -> physical block (under the blocks, so they never hide a cell)
    arrow_style = {"arrowstyle": "-|>", "mutation_scale": 11, "lw": 1.3, "alpha": 0.85, "zorder": 0.5}
    for k, i, row in logical:
        s, block_ids, _ = seqs[k]
        x, y = pool_xy(block_ids[i])
        arrow = FancyArrowPatch((bs + 0.1, row + H / 2), (x - 0.1, y + H / 2), **arrow_style, color=colors[s])
        arrow.set_gid(f"arrow:{s}:{i}->{block_ids[i]}")
        ax.add_patch(arrow)

    # ---- headers, title, free list
    header = {"ha": "center", "va": "bottom", "fontsize": 9, "fontweight": "bold"}
    ax.text(bs / 2, -0.55, "logical blocks", **header)
    pool_title = f"physical blocks (pool of {snap.num_blocks})"
    ax.text(px0 + (pool_cols * col_step - label_room) / 2, -0.55, pool_title, **header)
    shown = ", ".join(map(str, snap.free_ids[:16])) + (", ..." if len(snap.free_ids) > 16 else "")
    ax.text(
        x_min + 0.2, n_rows + 0.5, f"free list (next first): [{shown}]", va="top", fontsize=8, color="#555555"
    )
    if title is None:
        used, tokens = snap.num_blocks - len(snap.free_ids), sum(fill.values())
        util = (
            f", {tokens}/{used * bs} allocated slots hold tokens ({tokens / (used * bs):.0%})" if used else ""
        )
        plural = "" if len(seqs) == 1 else "s"
        title = f"{len(seqs)} sequence{plural}, block_size {bs}: {used}/{snap.num_blocks} blocks used{util}"
    if title:
        ax.set_title(title, fontsize=10)
    ax.set_xlim(x_min, x_max)
    ax.set_ylim(n_rows + 1.4, -1.2)  # row 0 at the top
    ax.set_axis_off()
    return fig


class PageTableExplorer:
    """Add, grow, fork and free sequences with buttons and watch the page table change.

    The picture is a PNG in an `ipywidgets.Image`, redrawn into one reused Figure after every action,
    so it updates in place (no flicker, no ipympl needed) in JupyterLab and headless alike. Errors such
    as running out of blocks are shown in the status line (and kept in `last_error`), never raised.
    """

    def __init__(self, num_blocks: int = 16, block_size: int = 4, *, figsize=None):
        import ipywidgets as w
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.num_blocks, self.block_size, self.figsize = num_blocks, block_size, figsize
        self.manager = BlockManager(num_blocks, block_size)
        self.next_seq_id = 0
        self.last_error: str | None = None
        self.last_action = "empty pool: add a sequence"
        self.figure = Figure()  # not registered with pyplot: it never pops up on its own
        FigureCanvasAgg(self.figure)  # renders PNGs headless

        self.num_tokens = w.BoundedIntText(
            value=block_size + 1,
            min=1,
            max=num_blocks * block_size,
            description="tokens",
            layout=w.Layout(width="150px"),
        )
        self.seq_select = w.Dropdown(options=[], description="sequence", layout=w.Layout(width="180px"))
        self.add_button = w.Button(description="add sequence", tooltip="new sequence with `tokens` tokens")
        self.append_button = w.Button(description="append", tooltip="append `tokens` tokens to `sequence`")
        self.fork_button = w.Button(description="fork", tooltip="new sequence sharing every block")
        self.free_button = w.Button(description="free", tooltip="finish `sequence`: its blocks go back")
        self.reset_button = w.Button(description="reset", button_style="warning")
        self.add_button.on_click(self._on_add)
        self.append_button.on_click(self._on_append)
        self.fork_button.on_click(self._on_fork)
        self.free_button.on_click(self._on_free)
        self.reset_button.on_click(self._on_reset)
        self.status = w.HTML()
        self.image = w.Image(format="png")
        buttons = [self.add_button, self.append_button, self.fork_button, self.free_button, self.reset_button]
        self.widget = w.VBox(
            [
                w.HBox([self.num_tokens, self.seq_select]),
                w.HBox(buttons),
                self.status,
                self.image,
            ]
        )
        self.refresh()

    # ---- actions (the buttons call these; tests and notebooks may call them directly)

    def add_sequence(self, num_tokens: int | None = None):
        """Start a new sequence of `num_tokens` tokens (default: the tokens box). Returns its id or None."""
        n = self.num_tokens.value if num_tokens is None else num_tokens
        seq_id = self.next_seq_id
        if self._try(lambda: self.manager.allocate(seq_id, n), f"added seq {seq_id} with {n} tokens"):
            self.next_seq_id += 1
            self._refresh_select(seq_id)
            self.refresh()
            return seq_id
        self.refresh()
        return None

    def append(self, seq_id=None, num_tokens: int | None = None) -> None:
        seq_id = self.seq_select.value if seq_id is None else seq_id
        n = self.num_tokens.value if num_tokens is None else num_tokens
        if self._no_seq(seq_id):
            return
        self._try(lambda: self.manager.append(seq_id, n), f"appended {n} tokens to seq {seq_id}")
        self.refresh()

    def fork(self, seq_id=None):
        """Fork `seq_id` (default: the selected one) into a new sequence. Returns the child's id or None."""
        seq_id = self.seq_select.value if seq_id is None else seq_id
        if self._no_seq(seq_id):
            return None
        child = self.next_seq_id
        if self._try(lambda: self.manager.fork(seq_id, child), f"forked seq {seq_id} into seq {child}"):
            self.next_seq_id += 1
            self._refresh_select(child)
            self.refresh()
            return child
        self.refresh()
        return None

    def free(self, seq_id=None) -> None:
        seq_id = self.seq_select.value if seq_id is None else seq_id
        if self._no_seq(seq_id):
            return
        if self._try(lambda: self.manager.free(seq_id), f"freed seq {seq_id}"):
            self._refresh_select(None)
        self.refresh()

    def reset(self) -> None:
        self.manager = BlockManager(self.num_blocks, self.block_size)
        self.next_seq_id = 0
        self.last_error = None
        self.last_action = "reset: empty pool"
        self._refresh_select(None)
        self.refresh()

    def _on_add(self, _button=None):
        self.add_sequence()

    def _on_append(self, _button=None):
        self.append()

    def _on_fork(self, _button=None):
        self.fork()

    def _on_free(self, _button=None):
        self.free()

    def _on_reset(self, _button=None):
        self.reset()

    # ---- helpers

    def _try(self, action, message: str) -> bool:
        try:
            slots = action()
        except (VllminiError, ValueError, TypeError) as e:  # the manager left its state unchanged
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        self.last_error = None
        self.last_action = message + (f" -> slots {slots}" if slots else "")
        return True

    def _no_seq(self, seq_id) -> bool:
        if seq_id is not None:
            return False
        self.last_error = "no sequence selected: add one first"
        self.refresh()
        return True

    def _refresh_select(self, value) -> None:
        ids = self.manager.seq_ids
        self.seq_select.options = ids
        if value in ids:
            self.seq_select.value = value
        elif ids and self.seq_select.value not in ids:
            self.seq_select.value = ids[0]

    def status_text(self) -> str:
        """The status line as plain text: last action or error, free list, utilization."""
        u = self.manager.utilization()
        free = list(self.manager.allocator.free_block_ids)
        head = f"error: {self.last_error}" if self.last_error else self.last_action
        share = f"{u['token_utilization']:.0%}" if u["allocated_slots"] else "-"  # nothing allocated yet
        return (
            f"{head}\nfree list: {free} | used {u['used_blocks']}/{self.num_blocks} blocks | "
            f"{u['num_tokens']} tokens in {u['allocated_slots']} allocated slots "
            f"({share}) | pool {u['pool_utilization']:.0%}"
        )

    def refresh(self) -> None:
        """Redraw the figure into the same Figure and swap the PNG bytes shown by the Image widget."""
        import html

        head, tail = self.status_text().split("\n", 1)
        color = "#c62828" if self.last_error else "#333333"
        self.status.value = (
            f"<div style='font-family:monospace;font-size:12px'><b style='color:{color}'>{html.escape(head)}"
            f"</b><br>{html.escape(tail)}</div>"
        )
        draw_page_table(self.manager, fig=self.figure, figsize=self.figsize)
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=90)
        self.image.value = buf.getvalue()

    def display(self) -> None:
        """Show the widget; where widgets cannot render (a saved notebook not yet run), a short hint
        stands in for the raw VBox(...) repr."""
        from IPython.display import display

        view = {"model_id": self.widget.model_id, "version_major": 2, "version_minor": 0}
        hint = f"PageTableExplorer({self.num_blocks} blocks of {self.block_size}): run this cell to use it"
        display({"application/vnd.jupyter.widget-view+json": view, "text/plain": hint}, raw=True)

    def _ipython_display_(self) -> None:
        self.display()


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

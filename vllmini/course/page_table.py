"""The page-table picture: `draw_page_table(manager)` paints what `page_table_layout` decided.

Left: each sequence's logical blocks; right: the physical pool; an arrow from every logical block to the
physical block that holds it, one colour per sequence in both views. Read `page_table_layout` for what
each block looks like (shared, copy-on-write, free, cached); this file only paints. It never changes
the manager, tables or allocator it draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllmini.allocator import BlockAllocator
from vllmini.course.page_table_layout import Box, PageTableLayout, page_table_layout
from vllmini.course.style import HIGHLIGHT, ROW_HEIGHT

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAP_ARROW = {"mutation_scale": 11, "lw": 1.3, "alpha": 0.85, "zorder": 0.5}  # under the blocks: hides no cell
COPY_ARROW = {"connectionstyle": "arc3,rad=-0.5", "mutation_scale": 10, "lw": 1.2, "ls": "--", "zorder": 3}
LEGEND = {"fontsize": 8, "frameon": False, "handlelength": 2.2, "borderaxespad": 0, "columnspacing": 1.5}


def _paint_box(ax, box: Box, dividers: list) -> None:
    """One block: its filled slots (one stripe per owner), empty slots, slot numbers, a frame."""
    from matplotlib.patches import Rectangle

    stripe = ROW_HEIGHT / len(box.stripes)
    filled_w = box.filled * box.cell
    for k, color in enumerate(box.stripes):  # one horizontal stripe per owner of a shared block
        if box.filled:
            ax.add_artist(Rectangle((box.x, box.y + k * stripe), filled_w, stripe, fc=color, lw=0))
    if filled_w < box.width:  # the empty slots: white, also over a highlight
        ax.add_artist(
            Rectangle((box.x + filled_w, box.y), box.width - filled_w, ROW_HEIGHT, fc="white", lw=0)
        )
    plain = box.kind in ("free", "cached")  # slots of a free block hold nobody's tokens: grey text
    dividers.append((box, plain))
    for j, num in enumerate(box.numbers or ()):
        color = "white" if j < box.filled and not plain else "#999999"
        x, y = box.x + (j + 0.5) * box.cell, box.y + ROW_HEIGHT / 2
        ax.text(x, y, str(num), ha="center", va="center", fontsize=7, color=color)
    style = {"ec": box.frame, "lw": box.linewidth, "ls": box.linestyle, "hatch": box.hatch}
    ax.add_artist(Rectangle((box.x, box.y), box.width, ROW_HEIGHT, fill=False, gid=box.gid, **style))


def _paint_dividers(ax, dividers: list) -> None:
    """All the thin lines between token slots, as two collections (white on colour, grey on white)."""
    from matplotlib.collections import LineCollection

    on_colour, on_white = [], []
    for box, plain in dividers:
        if box.slots > 32:
            continue  # too thin to see
        for j in range(1, box.slots):
            seg = [(box.x + j * box.cell, box.y), (box.x + j * box.cell, box.y + ROW_HEIGHT)]
            (on_white if plain or j > box.filled else on_colour).append(seg)
    ax.add_collection(LineCollection(on_colour, colors="white", linewidths=0.6))
    ax.add_collection(LineCollection(on_white, colors="#c8c8c8", linewidths=0.6))


def _paint_arrows(ax, layout: PageTableLayout) -> None:
    """Mappings under the blocks (they never hide a cell); copy arcs on top, dashed."""
    from matplotlib.patches import FancyArrowPatch

    for arrow in layout.arrows:
        style = MAP_ARROW if arrow.kind == "map" else COPY_ARROW
        patch = FancyArrowPatch(arrow.start, arrow.end, arrowstyle="-|>", color=arrow.color, **style)
        patch.set_gid(arrow.gid)
        ax.add_artist(patch)


def _paint_legend(ax, layout: PageTableLayout) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    if not layout.legend:
        return
    handles = []
    for _, style in layout.legend:
        if style.get("line"):
            handles.append(Line2D([0, 1], [0, 0], color=style["color"], ls=style["ls"], lw=1.2))
        else:
            handles.append(Rectangle((0, 0), 1, 1, **style))
    at = {"bbox_to_anchor": layout.legend_at, "bbox_transform": ax.transData, "ncol": layout.legend_cols}
    ax.legend(handles, [text for text, _ in layout.legend], loc="upper left", **at, **LEGEND)


def paint_page_table(ax, layout: PageTableLayout) -> None:
    """Paint a `PageTableLayout` into `ax`."""
    from matplotlib.patches import Rectangle

    for block_id, x, y, width in layout.glows:
        glow = Rectangle((x - 0.35, y - 0.15), width + 0.7, ROW_HEIGHT + 0.3, fc=HIGHLIGHT, lw=0, zorder=0.4)
        glow.set_gid(f"highlight:{block_id}")
        ax.add_artist(glow)
    for x, y0, y1, color in layout.bars:
        ax.plot([x, x], [y0, y1], color=color, lw=3, solid_capstyle="butt")
    dividers: list = []
    for box in layout.boxes:
        _paint_box(ax, box, dividers)
    _paint_dividers(ax, dividers)
    _paint_arrows(ax, layout)
    for label in layout.labels:
        style = {"fontsize": label.size, "color": label.color, "fontweight": "bold" if label.bold else None}
        ax.text(label.x, label.y, label.text, ha=label.ha, va=label.va, **style)
    _paint_legend(ax, layout)
    if layout.title:
        ax.set_title(layout.title, fontsize=10)
    ax.set_xlim(*layout.xlim)
    ax.set_ylim(*layout.ylim)
    ax.set_axis_off()


def draw_page_table(
    manager_or_tables,
    allocator: BlockAllocator | None = None,
    *,
    figsize: tuple[float, float] | None = None,
    fig: Figure | None = None,
    ax: Axes | None = None,
    **options,
) -> Figure:
    """Draw the page table of a `BlockManager` (or a dict seq_id -> BlockTable plus its allocator).

    Left: each sequence's logical blocks, one row per block (cells = token slots; the number in a
    filled cell is the token index). Right: the physical pool (the number in a cell is its slot id,
    block_id * block_size + offset). Arrows: logical -> physical; dashed black arcs: copy-on-write.
    Returns the matplotlib Figure; pass `fig=` to redraw into an existing figure or `ax=` to draw into
    an existing Axes. `options` (seq_ids, colors, title, show_numbers, the max_* limits, highlight,
    copies, token_text) go to `page_table_layout`, which says what each does.
    """
    import matplotlib.pyplot as plt

    layout = page_table_layout(manager_or_tables, allocator, **options)
    if ax is None:
        size = figsize or layout.size
        if fig is None:
            fig = plt.figure(figsize=size)
        else:
            fig.clear()
            fig.set_size_inches(*size)
        ax = fig.add_axes((0.01, 0.01, 0.98, 0.98 if options.get("title") == "" else 0.9))
    paint_page_table(ax, layout)
    return ax.figure

"""The block pool over time (notebook 02) and the slots one query reads through its page table (04).

    draw_pool_history(history, num_blocks)            # notebook 02: the pool after each operation
    draw_slots_read(ax, key_cache, block_tables, seq_lens, seq)   # notebook 04: what one query reads

It only reads what it draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vllmini.checks import as_int, check_tensor
from vllmini.course.style import bare
from vllmini.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FREE, ONE_OWNER, SHARED = "#eeeeee", "#1f77b4", "#ff7f0e"
SEQ_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def draw_pool_history(
    history: Sequence[tuple[str, Sequence[int], Sequence[int]]],
    num_blocks: int,
    *,
    figsize: tuple[float, float] = (8.5, 5.2),
    title: str | None = None,
) -> Figure:
    """One row per (label, ref_counts, free_block_ids) state of a block pool: free blocks grey, blocks with
    one owner blue, shared ones orange (ref count under the id), the free list on the right."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    num_blocks = as_int(num_blocks, "num_blocks", min=1)
    rows = list(history)
    for i, row in enumerate(rows):
        if not (isinstance(row, tuple | list) and len(row) == 3):
            raise InvalidTypeError(f"history[{i}] must be (label, ref_counts, free_block_ids), got {row!r}")
        if len(row[1]) != num_blocks:
            raise InvalidArgumentError(
                f"history[{i}] has {len(row[1])} ref counts, expected num_blocks = {num_blocks}"
            )
    fig, ax = plt.subplots(figsize=figsize)
    for row, (label, refs, free) in enumerate(rows):
        for b, r in enumerate(refs):
            face = FREE if r == 0 else (ONE_OWNER if r == 1 else SHARED)
            edge, ink = ("#999999", "#888888") if r == 0 else (face, "white")
            ax.add_patch(Rectangle((b, row), 0.9, 0.8, facecolor=face, edgecolor=edge))
            ax.text(
                b + 0.45, row + 0.32, str(b), ha="center", va="center", fontsize=10, color=ink, weight="bold"
            )
            ax.text(b + 0.45, row + 0.64, f"rc {r}", ha="center", va="center", fontsize=7, color=ink)
        ax.text(-0.2, row + 0.4, label, ha="right", va="center", fontsize=9, family="monospace")
        free_list = f"free list: {list(free)}"
        ax.text(num_blocks + 0.2, row + 0.4, free_list, va="center", fontsize=9, color="#555555")
    ax.set_xlim(-4.6, num_blocks + 5.4)
    ax.set_ylim(len(rows), -0.3)
    ax.set_axis_off()
    if title is not None:
        ax.set_title(title, fontsize=11)
    return fig


def draw_slots_read(
    ax: Axes,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], NaN where never written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int, -1 padded
    seq_lens: torch.Tensor,  # [num_seqs] int
    seq: int,
    *,
    names: str | Sequence[str] | None = None,
) -> Axes:
    """The key pool, one row per page: each sequence's tokens in its colour (found through its block
    table), slots never written marked NaN, and the slots sequence `seq`'s decode query reads outlined."""
    from matplotlib.patches import Rectangle

    check_tensor(key_cache, "key_cache", ndim=4)
    check_tensor(block_tables, "block_tables", ndim=2)
    check_tensor(seq_lens, "seq_lens", ndim=1)
    num_blocks, block_size = key_cache.shape[:2]
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise InvalidArgumentError(f"seq_lens has {seq_lens.shape[0]} entries, block_tables {num_seqs} rows")
    seq = as_int(seq, "seq", min=0, max=num_seqs - 1)
    names = list(names) if names is not None else [str(s) for s in range(num_seqs)]
    written = ~key_cache.isnan().any(-1).any(-1)  # [num_blocks, block_size]
    owner = {}  # (page, offset) -> (sequence, token)
    for s in range(num_seqs):
        for t in range(int(seq_lens[s])):
            page = int(block_tables[s, t // block_size])
            if not 0 <= page < num_blocks:
                raise InvalidArgumentError(
                    f"block_tables[{s}, {t // block_size}] = {page} is not a block id in [0, {num_blocks})"
                )
            owner[page, t % block_size] = (s, t)
    for b in range(num_blocks):
        for o in range(block_size):
            s, t = owner.get((b, o), (None, None))
            face = "lightgrey" if written[b, o] else "white"  # nobody's token: written earlier, or never
            if s is not None:
                face = SEQ_COLORS[s % len(SEQ_COLORS)]
            ax.add_patch(Rectangle((o, -b), 1, 1, facecolor=face, edgecolor="grey", alpha=0.55))
            ax.text(o + 0.5, -b + 0.5, "NaN" if s is None else f"{names[s]}{t}", ha="center", va="center",
                    fontsize=8, color="grey" if s is None else "black")  # fmt: skip
            if s == seq:
                ax.add_patch(Rectangle((o, -b), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
        ax.text(-0.2, -b + 0.5, f"page {b}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.6, block_size)
    ax.set_ylim(-num_blocks + 1, 1)
    offsets = range(block_size)
    ax.set_xticks([o + 0.5 for o in offsets], [f"offset {o}" for o in offsets], fontsize=8)
    ax.set_yticks([])
    bare(ax)
    return ax

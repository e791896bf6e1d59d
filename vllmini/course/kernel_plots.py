"""Kernel performance pictures (notebook 07): the decode roofline, how versions split the work, and
recorded bandwidth per shape."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllmini.course.style import PALETTE

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
        label = f"{name}: {intensity:.1f} FLOP/B"
        ax.plot([intensity], [y], "o", color=PALETTE[i % len(PALETTE)], label=label)
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("decode attention sits on the memory slope", fontsize=10)
    fig.tight_layout()
    return fig


def group_identical(layouts: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """Consecutive versions with the same work split become one entry, named "v1 a · v2 b · ..."."""
    groups: list[tuple[list[str], list[list[int]]]] = []
    for name, grid in layouts.items():
        if groups and groups[-1][1] == grid:
            groups[-1][0].append(name)
        else:
            groups.append(([name], grid))
    return {" · ".join(names): grid for names, grid in groups}


def plot_kernel_work_split(
    layouts: dict[str, list[list[int]]], *, figsize=(10, 3.2), num_tokens: int | None = None
) -> Figure:
    """One panel per distinct work split (versions that split the work alike share one panel, titled with
    all their names): rows = query heads, columns = tokens of one sequence, each cell coloured by the
    thread block that reads that token's K/V row for that head. A column with several colours is a K/V row
    read several times (once per block)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    groups = group_identical(layouts)
    fig, axes = plt.subplots(1, len(groups), figsize=figsize, squeeze=False)
    cmap = ListedColormap(list(PALETTE))
    for ax, (name, grid) in zip(axes[0], groups.items(), strict=True):
        ax.imshow([[b % len(PALETTE) for b in row] for row in grid], cmap=cmap, vmin=0, vmax=len(PALETTE) - 1,
                  aspect="auto", interpolation="nearest")  # fmt: skip
        blocks = len({b for row in grid for b in row})
        reads = len({row[0] for row in grid})  # blocks that read token 0's K/V row
        names = name.split(" · ")
        half = (len(names) + 1) // 2
        title = (
            ", ".join(names) if len(names) < 3 else ", ".join(names[:half]) + ",\n" + ", ".join(names[half:])
        )
        ax.set_title(f"{title}\n{blocks} blocks; each K/V row read {reads}x", fontsize=9)
        ax.set_xlabel("token")
        ax.set_yticks(range(len(grid)), [f"q{h}" for h in range(len(grid))], fontsize=8)
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

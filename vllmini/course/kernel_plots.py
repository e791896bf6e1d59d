"""Kernel performance pictures (notebook 07): the decode roofline, how versions split the work, recorded
bandwidth per shape, and the tensor core's mma fragments."""

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


def mma_fragment_layout() -> dict[str, list[list[tuple[int, int]]]]:
    """Which lane and which of its registers hold each element of `mma.sync.aligned.m16n8k16`'s matrices,
    as vllmini/emulator/emu_mma.h models them (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
    point type"): {"A": 16x16, "B": 16x8, "C/D": 16x8} of (lane, register). Lane l = 4g + t holds
    A[g][2t..2t+1] in a0, A[g+8][..] in a1, A[g][2t+8..2t+9] in a2, A[g+8][2t+8..] in a3 (a 32-bit register,
    two 16-bit elements, the lower column in its low half); B[2t..2t+1][g] in b0, B[2t+8..2t+9][g] in b1;
    C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1] in c0..c3 (one float32 each)."""
    a = [[(-1, -1)] * 16 for _ in range(16)]
    b = [[(-1, -1)] * 8 for _ in range(16)]
    c = [[(-1, -1)] * 8 for _ in range(16)]
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg in range(4):
            for half in range(2):
                a[g + 8 * (reg % 2)][2 * t + 8 * (reg // 2) + half] = (lane, reg)
            c[g + 8 * (reg // 2)][2 * t + reg % 2] = (lane, reg)
        for reg in range(2):
            for half in range(2):
                b[2 * t + 8 * reg + half][g] = (lane, reg)
    return {"A": a, "B": b, "C/D": c}


def plot_mma_fragments(layout: dict[str, list[list[tuple[int, int]]]], *, figsize=(10, 4.4)) -> Figure:
    """The three matrices of one m16n8k16 mma, each element coloured by the register that holds it and
    labelled with the lane (0-31) that holds it, from `mma_fragment_layout()`."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    # light colours, so the lane numbers stay legible
    cmap = ListedColormap(["#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb"])
    names = {"A": "A (16x16, 16-bit): a0..a3", "B": "B (16x8, 16-bit): b0, b1"}
    names["C/D"] = "C, D (16x8, float32): c0..c3"
    axis_names = {"A": ("m", "k"), "B": ("k", "n"), "C/D": ("m", "n")}  # D[m][n] = sum_k A[m][k] B[k][n]
    fig, axes = plt.subplots(1, 3, figsize=figsize, gridspec_kw={"width_ratios": [16, 8, 8]})
    for ax, (name, grid) in zip(axes, layout.items(), strict=True):
        regs = [[reg for _, reg in row] for row in grid]
        ax.imshow(regs, cmap=cmap, vmin=0, vmax=3, interpolation="nearest")
        for r, row in enumerate(grid):
            for col, (lane, _) in enumerate(row):
                ax.text(col, r, str(lane), ha="center", va="center", fontsize=5.5)
        ax.set_title(names[name], fontsize=9)
        ax.set_xticks(range(len(grid[0])), range(len(grid[0])), fontsize=6)
        ax.set_yticks(range(16), range(16), fontsize=6)
        ax.set_ylabel(f"row ({axis_names[name][0]})", fontsize=8)
        ax.set_xlabel(f"column ({axis_names[name][1]})", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i)) for i in range(4)]
    fig.legend(handles, ["register 0", "register 1", "register 2", "register 3"], loc="lower center", ncol=4,
               fontsize=8, frameon=False)  # fmt: skip
    title = "mma.sync m16n8k16: which lane (number) and register (colour) holds each element"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def plot_tensor_core_gain(
    tb_s: dict[tuple[str, str], float], read_ceiling_tb_s: float, *, figsize=(8, 3.2)
) -> Figure:
    """Bars of TB/s of K+V read ({(shape, row): TB/s}, as bench_tensor_cores.py records them), one group
    per shape, with the read ceiling as a dashed line."""
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(s for s, _ in tb_s))
    rows = list(dict.fromkeys(r for _, r in tb_s))
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [j + i * width for j in range(len(shapes))]
        ax.bar(xs, [tb_s[s, row] for s in shapes], width, label=row, color=PALETTE[i % len(PALETTE)])
    ax.axhline(read_ceiling_tb_s, color="black", linestyle="--", linewidth=1)
    ax.text(-0.1, read_ceiling_tb_s * 1.02, "read ceiling", fontsize=8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
    ax.set_ylabel("TB/s of K+V read")
    ax.set_ylim(0, read_ceiling_tb_s * 1.3)
    ax.legend(fontsize=8, loc="upper right", ncol=len(rows))
    fig.tight_layout()
    return fig

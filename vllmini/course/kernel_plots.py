"""Kernel pictures (notebooks 05b and 07): each version's step as a diff, the decode roofline, how versions
split the work, version 8's transposed butterfly and version 7's split-context merge, recorded bandwidth
per shape, and the tensor core's mma fragments."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllmini.course.style import PALETTE
from vllmini.errors import InvalidArgumentError

# The H200's read ceiling, bytes/s: kernels/read_ceiling.cu (16-byte loads) reading 4 GB, measured with
# benchmarks/bench_read_ceiling.py on 2026-12-02 (benchmarks/RESULTS.md). Every kernel is measured against it.
H200_READ_BW = 4.49e12

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def code_lines(number: int) -> list[str]:
    """Kernel version `number`'s source without comment-only and blank lines, its own name (the file stem,
    which starts every entry point's name) written paged_attention_n, so a diff shows code, not renames."""
    from vllmini import cuda_kernels

    stem = cuda_kernels.kernel_versions()[number].file
    text = cuda_kernels.read_kernel_source(stem).replace(stem, "paged_attention_n")
    return [line for line in text.splitlines() if line.strip() and not line.strip().startswith("//")]


def step_diff(number: int, context: int = 0) -> str:
    """The unified diff of version `number`'s code against version `number - 1`'s: the step's one idea."""
    import difflib

    from vllmini import cuda_kernels

    old, new = (cuda_kernels.kernel_versions()[n].file for n in (number - 1, number))
    lines = difflib.unified_diff(code_lines(number - 1), code_lines(number), old, new, n=context, lineterm="")
    return "\n".join(lines)


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
    versions = {r["backend"] for r in rows if r["backend"].endswith(" kernel")}  # "v5 kernel" .. "v10 kernel"
    keep += sorted(versions, key=lambda name: int(name.split()[0][1:]))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(keep)
    # the baselines in greys, the kernel versions along one colour map: the chain reads left to right
    kernels = plt.get_cmap("viridis")([k / max(1, len(keep) - 4) for k in range(len(keep) - 3)])
    colors = ["black", "#7f7f7f", "#c7c7c7", *kernels]
    for i, name in enumerate(keep):
        vals = {r["shape"]: r["gb_per_s"] for r in rows if r["backend"] == name}
        xs = [j + i * width for j, s in enumerate(shapes) if s in vals]
        ax.bar(xs, [vals[s] / 1e3 for s in shapes if s in vals], width, label=name, color=colors[i])
    labels = [s.split(" D=")[0].replace(" ", "\n", 2) for s in shapes]
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], labels, fontsize=7)
    ax.set_ylabel("TB/s of K+V read")
    ax.set_ylim(0, 1.4 * max(r["gb_per_s"] for r in rows if r["backend"] in keep) / 1e3)  # legend room
    ax.legend(fontsize=7, ncol=6, loc="upper center")
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


def transposed_butterfly_steps(parts) -> list[list[list[tuple[int, float]]]]:
    """Version 8's step 4, in Python: `parts[lane][u]` is a lane's partial dot product for token u (a group
    of GROUP = len(parts) lanes, TOKENS = len(parts[0]) tokens). Each step with offset k = GROUP/2, GROUP/4,
    ... keeps half of a lane's values (the upper half where lane & k), adds the partner's (lane ^ k) same
    half, and sends it the other; once one value is left, plain butterflies. Returns every row of
    [lane][(token, value)], the start first; at the end lane l holds one token's full sum."""
    group, tokens = len(parts), len(parts[0])
    if group & (group - 1) or tokens & (tokens - 1) or not 1 <= tokens <= group:
        raise InvalidArgumentError(f"need a power-of-two group and tokens <= group, got {group} x {tokens}")
    rows = [[[(u, float(x)) for u, x in enumerate(lane)] for lane in parts]]
    offset = group // 2
    while offset:
        prev, half = rows[-1], max(len(rows[-1][0]) // 2, 1)
        row = []
        for lane in range(group):
            side = slice(half, None) if lane & offset and len(prev[lane]) > 1 else slice(0, half)
            mine, theirs = prev[lane][side], prev[lane ^ offset][side]
            row.append([(u, a + b) for (u, a), (_, b) in zip(mine, theirs, strict=True)])
        rows.append(row)
        offset //= 2
    return rows


def plot_transposed_butterfly(parts, *, lane: int = 0, figsize=(11, 4.2)) -> Figure:
    """Lanes as columns, steps as rows: each lane's values as boxes coloured by token, a line into every
    lane from the partner it adds (red for `lane`)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = transposed_butterfly_steps(parts)
    group = len(parts)
    fig, ax = plt.subplots(figsize=figsize)
    for step, row in enumerate(rows):
        for col, values in enumerate(row):
            width = 0.9 / len(values)
            for i, (token, value) in enumerate(values):
                x = col - 0.45 + i * width
                look = {"ec": "red", "lw": 1.2} if col == lane else {"ec": "grey", "lw": 0.5}
                look["fc"] = PALETTE[token % len(PALETTE)]
                ax.add_patch(Rectangle((x, step - 0.2), width, 0.4, alpha=0.35, **look))
                ax.text(x + width / 2, step, f"{value:g}", ha="center", va="center", fontsize=8)
        if step:
            offset = group >> step
            for col in range(group):
                red = col == lane
                ax.plot([col ^ offset, col], [step - 0.78, step - 0.22], color="red" if red else "#bbbbbb",
                        lw=1.6 if red else 0.5, zorder=2 if red else 1)  # fmt: skip
    labels = ["start"] + [
        f"k = {group >> s}: " + ("keep half, send half" if len(rows[s - 1][0]) > 1 else "plain butterfly")
        for s in range(1, len(rows))
    ]
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.set_xticks(range(group), range(group), fontsize=9)
    ax.set_xlim(-0.6, group - 0.4)
    ax.set_ylim(len(rows) - 0.6, -0.6)
    ax.set_xlabel("lane in the group")
    ax.set_title(f"the transposed butterfly: {len(parts[0])} tokens' partial sums per lane (colour: token); "
                 f"after {len(rows) - 1} steps each lane holds one token's score\n(a line runs into each "
                 f"lane from the partner it adds; red: lane {lane})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return fig


def split_merge(scores, values, pieces: int) -> dict:
    """One query over one context of len(scores) tokens cut into `pieces` consecutive pieces (the last may
    be shorter), as version 7's split blocks see it: each piece's m_i = max score, l_i = sum exp(s - m_i)
    and o_i = its normalized output; then M = max m_i, w_i = l_i e^(m_i - M) / sum_j l_j e^(m_j - M) and
    out = sum w_i o_i. float64 throughout."""
    import numpy as np

    scores, values = np.asarray(scores, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if not 1 <= pieces <= len(scores) or values.shape[0] != len(scores):
        raise InvalidArgumentError(
            f"need 1 <= pieces <= tokens and one value row per score, got {pieces} pieces, "
            f"{len(scores)} scores, {values.shape[0]} value rows"
        )
    size = -(-len(scores) // pieces)
    starts = list(range(0, len(scores), size))
    m = np.array([scores[a : a + size].max() for a in starts])
    l = np.array([np.exp(scores[a : a + size] - mi).sum() for a, mi in zip(starts, m, strict=True)])
    o = np.stack([np.exp(scores[a : a + size] - mi) @ values[a : a + size] / li
                  for a, mi, li in zip(starts, m, l, strict=True)])  # fmt: skip
    w = l * np.exp(m - m.max())
    w = w / w.sum()
    return {"starts": starts, "size": size, "m": m, "l": l, "o": o, "M": m.max(), "w": w, "out": w @ o}


def plot_split_merge(scores, merge: dict, *, figsize=(11, 3.8)) -> Figure:
    """Left: the scores along the context, each piece shaded, with its max m_i (line) and (m_i, l_i)
    written above it. Right: the merge weights w_i of the pieces, from `split_merge`."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=figsize, gridspec_kw={"width_ratios": [2.4, 1]})
    top = max(scores) + 0.25 * (max(scores) - min(scores))
    for i, start in enumerate(merge["starts"]):
        end = min(start + merge["size"], len(scores))
        color = PALETTE[i % len(PALETTE)]
        ax.axvspan(start - 0.5, end - 0.5, color=color, alpha=0.12)
        ax.plot(range(start, end), scores[start:end], "o", color=color, ms=4)
        ax.hlines(merge["m"][i], start - 0.4, end - 0.6, color=color, lw=1.5)
        label = f"piece {i}: block {i}\nm = {merge['m'][i]:.2f}, l = {merge['l'][i]:.2f}"
        ax.text((start + end - 1) / 2, top, label, ha="center", va="top", fontsize=8)
    ax.set_ylim(min(scores) - 0.3, top + 0.1 * (top - min(scores)))
    ax.set_xlabel("token of the context")
    ax.set_ylabel("score q·k / sqrt(D)")
    pieces = len(merge["starts"])
    ax.set_title(f"{pieces} pieces, each read by its own thread block (line: its max m_i)", fontsize=10)
    names = [f"piece {i}" for i in range(pieces)]
    bars = bx.bar(names, merge["w"], color=[PALETTE[i % len(PALETTE)] for i in range(len(names))])
    bx.bar_label(bars, [f"{w:.3f}" for w in merge["w"]], fontsize=8)
    bx.set_ylim(0, 1.15 * max(merge["w"]))
    bx.set_ylabel("merge weight w_i")
    weight = "w_i = l_i e^(m_i - M) / sum_j l_j e^(m_j - M)"
    bx.set_title(f"M = max m_i = {merge['M']:.2f}\n{weight}", fontsize=10)
    bx.tick_params(labelsize=8)
    fig.tight_layout()
    return fig

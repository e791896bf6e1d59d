"""CUDA pictures (notebooks 05a, 05b): how a kernel's threads are organised and who reads what.

Pure functions of their arguments; the `*_steps` / `*_trace` / `*_owner` helpers return the numbers a
picture shows, so a notebook can check them against a kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllmini.course.style import PALETTE, bare
from vllmini.cuda_kernels import WARP_SIZE
from vllmini.errors import InvalidArgumentError

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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
        text = f"lane {lane}\nt={WARP_SIZE + lane}"
        wa.text(c + 0.46, r + 0.45, text, ha="center", va="center", fontsize=7)
    wa.set(xlim=(-0.05, 8), ylim=(4.1, -0.1), xticks=[], yticks=[])
    wa.set_title(
        "warp 1: 32 lanes (t = threadIdx.x), one instruction at a time\n"
        "lane = t % 32; each lane has its own registers"
    )
    for (src, dst, xy_a, xy_b) in ((ga, ba, (1.9, 0.0), (0, 0)), (ga, ba, (1.9, 0.9), (0, warps + 0.8)),
                                   (ba, wa, (1, 1), (0, 0)), (ba, wa, (1, 1.85), (0, 4))):  # fmt: skip
        line = ConnectionPatch(xy_a, xy_b, "data", "data", axesA=src, axesB=dst, color="grey", lw=0.8)
        fig.add_artist(line)
    fig.tight_layout()
    return fig


def butterfly_masks(group: int = WARP_SIZE) -> list[int]:
    """The xor masks of a butterfly over groups of `group` lanes: 16, 8, 4, 2, 1 for the whole warp."""
    if group not in (2, 4, 8, 16, 32):
        raise InvalidArgumentError(f"group must be a power of two from 2 to {WARP_SIZE} lanes, got {group!r}")
    return [group >> s for s in range(1, group.bit_length())]


def butterfly_steps(values, group: int = WARP_SIZE) -> list[list[float]]:
    """The 32 lane values before and after each step of the xor butterfly (masks 16, 8, 4, 2, 1; from
    group / 2 down for groups of `group` lanes, each summing its own lanes)."""
    rows = [[float(v) for v in values]]
    assert len(rows[0]) == WARP_SIZE, "one value per lane"
    for mask in butterfly_masks(group):
        prev = rows[-1]
        rows.append([prev[lane] + prev[lane ^ mask] for lane in range(WARP_SIZE)])
    return rows


def draw_butterfly(values, lane: int = 0, group: int = WARP_SIZE, figsize=(10, 5.6)) -> Figure:
    """Which lane adds which in each step of `v += __shfl_xor_sync(0xffffffff, v, k)`; `lane` in red.
    With `group` < 32 the butterfly stops at k = group / 2: each group of lanes sums its own values."""
    import matplotlib.pyplot as plt

    rows = butterfly_steps(values, group)
    fig, ax = plt.subplots(figsize=figsize)
    for step, mask in enumerate(butterfly_masks(group)):
        ax.plot([lane, lane], [step + 0.18, step + 0.82], color="red", lw=1.8, zorder=2)  # its own value
        for target in range(WARP_SIZE):  # a line into lane `target` from its partner target ^ mask
            partner = target ^ mask
            mine = target == lane
            ax.plot([partner, target], [step + 0.18, step + 0.82], color="red" if mine else "#bbbbbb",
                    lw=1.8 if mine else 0.5, zorder=2 if mine else 1)  # fmt: skip
        ax.text(WARP_SIZE - 0.3, step + 0.5, f"k = {mask}", fontsize=10, va="center")
    for step, row in enumerate(rows):
        for other, value in enumerate(row):
            ax.text(other, step, f"{value:g}", ha="center", va="center", fontsize=9,
                    bbox=dict(boxstyle="round,pad=0.15", fc="#ffe0e0" if other == lane else "white",
                              ec="red" if other == lane else "#999999", lw=0.6))  # fmt: skip
    ax.set_xlim(-0.7, WARP_SIZE + 1.6)
    ax.set_ylim(len(rows) - 0.5, -0.7)
    ax.set_xticks(range(0, WARP_SIZE, 2))
    ax.set_xlabel("lane")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["start"] + [f"after step {s}" for s in range(1, len(rows))])
    ends = ", ".join(f"lanes {g}-{g + group - 1} hold {rows[-1][g]:g}" for g in range(0, WARP_SIZE, group))
    whole = f"in groups of {group}:\n{ends}"
    if group == WARP_SIZE:
        whole = f"every lane holds\nthe sum {rows[-1][0]:g}"
    ax.set_title(f"the butterfly: in step k, lane l adds lane l ^ k; after {len(rows) - 1} shuffles {whole} "
                 f"(red: the values lane {lane} adds)", fontsize=11)  # fmt: skip
    bare(ax, keep=("bottom", "left"))
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


def _running_max_panel(ax, scores: list, trace: list) -> None:
    """Scores as they arrive and the running max, with the rescale factor written where the max grows."""
    t = range(len(scores))
    ax.plot(t, scores, "o", color="grey", label="score of token t")
    ax.step(t, [m for m, _, _ in trace], where="post", color=PALETTE[3], label="running max m")
    for i, (_, _, factor) in enumerate(trace):
        if 0 < factor < 1:
            ax.annotate(f"x{factor:.2f}", (i, trace[i][0]), textcoords="offset points", xytext=(0, 8),
                        ha="center", fontsize=9, color=PALETTE[3])  # fmt: skip
    ax.margins(y=0.25)
    ax.set_ylabel("score, max m")
    ax.legend(fontsize=9, loc="lower left", ncol=2)
    ax.set_title("online softmax: when the max grows, the sum so far is multiplied by exp(m_old - m_new)")


def _running_sum_panel(ax, scores: list, trace: list) -> None:
    """The running sum l, drawn in its two moves per token: the rescale of the sum so far (red, down
    when the max grew) and the new term exp(score - m) (blue, up)."""
    import math

    prev = 0.0
    for i, (m, l, factor) in enumerate(trace):
        rescaled = prev * factor
        if i and factor < 1:
            ax.plot([i - 1, i], [prev, rescaled], color=PALETTE[3], lw=2)
            ax.annotate(f"x{factor:.2f}", (i, rescaled), textcoords="offset points", xytext=(4, -12),
                        fontsize=9, color=PALETTE[3])  # fmt: skip
        elif i:
            ax.plot([i - 1, i], [prev, rescaled], color=PALETTE[0], lw=1, alpha=0.5)
        ax.plot([i, i], [rescaled, l], color=PALETTE[0], lw=2)  # + exp(score - m), never negative
        ax.plot([i], [l], "s", color=PALETTE[0], ms=4)
        assert math.isclose(l, rescaled + math.exp(scores[i] - m))
        prev = l
    ax.plot([], [], color=PALETTE[3], lw=2, label="max grew: l *= exp(m_old - m_new)")
    ax.plot([], [], "s-", color=PALETTE[0], lw=2, ms=4, label="then l += exp(score - m)")
    ax.set_ylim(0, None)
    ax.set_xlabel("token t (arriving one at a time)")
    ax.set_ylabel("running sum l")
    ax.legend(fontsize=9, loc="lower right")


def draw_online_softmax(scores, chunks: int = 3, figsize=(14, 6)) -> Figure:
    """Left, top: scores and the running max; left, bottom: the running sum, rescaled when the max grows
    and then raised by each new term. Right: `chunks` warps each keep (m, l) of their own tokens; the
    merge rescales each to the common max."""
    import math

    import matplotlib.pyplot as plt

    scores = [float(s) for s in scores]
    trace = online_softmax_trace(scores)
    fig = plt.figure(figsize=figsize)
    grid = fig.add_gridspec(2, 2, width_ratios=[1.5, 1])
    ax = fig.add_subplot(grid[0, 0])
    _running_max_panel(ax, scores, trace)
    _running_sum_panel(fig.add_subplot(grid[1, 0], sharex=ax), scores, trace)
    bx = fig.add_subplot(grid[:, 1])
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
        bx.text(i, l, f"m_w = {m:.1f}", ha="center", va="bottom", fontsize=9)
    bx.set_title(f"the merge: {chunks} warps, tokens {size} each;\nM = max m_w = {big:.1f}")
    bx.margins(y=0.12)
    bx.legend(fontsize=9)
    fig.tight_layout()
    return fig


def page_read_owner(kernel: str, block_size: int = 16, head_size: int = 128):
    """[block_size, head_size] int array: which thread (kernel "1") or lane ("2", "3") reads each element
    of one K page in one step: "1" thread t reads token t's whole row; "2" lane l reads dims l, l+32, ...;
    "3" lane l reads the consecutive dims l*D .. l*D+D-1, D = head_size / 32."""
    import numpy as np

    if kernel not in ("1", "2", "3"):
        raise InvalidArgumentError(f"kernel must be '1', '2' or '3', got {kernel!r}")
    dim = np.arange(head_size)
    if kernel == "1":
        return np.repeat(np.arange(block_size)[:, None], head_size, axis=1)
    dims = head_size // WARP_SIZE
    lane = dim % WARP_SIZE if kernel == "2" else dim // dims
    return np.repeat(lane[None, :], block_size, axis=0)


def draw_page_reads(block_size: int = 16, head_size: int = 128, figsize=(14, 7.5)) -> Figure:
    """One K page (block_size tokens x head_size float32) coloured by the thread that reads each element,
    for kernel 1, kernels 2-3 and kernels 4-5, with what ONE load instruction of a warp touches outlined in
    red."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    dims = head_size // WARP_SIZE
    panels = [
        ("1", f"kernel 1: thread t reads token t's whole row, one float per instruction.\n"
              f"One warp instruction: float 0 of 32 rows ({min(block_size, WARP_SIZE)} in this page), "
              f"{head_size * 4} bytes apart (not coalesced)"),
        ("2", f"kernels 2 and 3: a warp per token; lane l reads dims l, l+32, ... ({dims} loads of 4 bytes)."
              "\n"
              f"One warp instruction: 32 adjacent floats = 128 bytes (coalesced)"),
        ("3", f"kernels 4 and 5: lane l reads dims {dims}l .. {dims}l+{dims - 1}, one {dims * 4}-byte load.\n"
              f"One warp instruction: the whole row, {head_size * 4} adjacent bytes"),
    ]  # fmt: skip
    fig, axes = plt.subplots(3, 1, figsize=figsize)
    for ax, (kernel, title) in zip(axes, panels, strict=True):
        owner = page_read_owner(kernel, block_size, head_size)
        ax.imshow(owner, cmap="viridis", aspect="auto", interpolation="nearest")
        # what one warp instruction reads: a column (kernel 1), 32 floats of a row (2), a whole row (3)
        width, height = {"1": (1, block_size), "2": (WARP_SIZE, 1), "3": (head_size, 1)}[kernel]
        ax.add_patch(Rectangle((-0.5, -0.5), width, height, fill=False, ec="red", lw=2))
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

    num_pages = math.ceil(seq_len / block_size)
    pages = random.Random(seed).sample(range(4 * num_pages), num_pages)
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

"""Course pictures: why paging (notebook 01), the prefill batch and its mask (04), the pipeline (09).

Each function draws one picture a notebook would otherwise spend many lines of matplotlib on. They only
read their arguments (lengths, tables, measured shares) and return the Figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllmini.checks import cdiv
from vllmini.course.style import (
    EMPTY_EDGE,
    EMPTY_FACE,
    FREE_FACE,
    OUTPUT_FACE,
    PALETTE,
    PROMPT_FACE,
    SCHEME_COLORS,
    bare,
    swatches,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
    paged_title = f"paged (block_size {block_size}): {tokens} of {sum(paged)} slots hold tokens"
    panels = [
        (axes[0], static, None, f"static: {max_len} slots each, {tokens} of {sum(static)} hold tokens"),
        (axes[1], paged, block_size, paged_title),
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
        bare(ax)
    handles = swatches(
        {"color": PROMPT_FACE},
        {"color": OUTPUT_FACE},
        {"facecolor": EMPTY_FACE, "hatch": "///", "edgecolor": EMPTY_EDGE},
        {"facecolor": FREE_FACE, "edgecolor": "#CCCCCC"},
    )
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

    prompt, steps = int(prompt_len), int(num_decode_steps)
    total = prompt + steps
    ratios = {"width_ratios": [prompt + 2, total + 2]}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=figsize, gridspec_kw=ratios)
    for query in range(prompt):  # prefill: a causal triangle of query x key scores, computed together
        for k in range(prompt):
            face = PROMPT_FACE if k <= query else FREE_FACE
            ax1.add_patch(Rectangle((k, -query), 0.92, 0.92, facecolor=face, edgecolor="white"))
    products = prompt * (prompt + 1) // 2
    ax1.set_title(f"prefill: {prompt} prompt tokens in ONE forward\n{products} query-key products, "
                  "weights read once", fontsize=10, loc="left")  # fmt: skip
    for step in range(steps):  # decode: this step has one query that reads all prompt + step cached keys
        for k in range(prompt + step + 1):
            if k < prompt + step:
                face, edge = (PROMPT_FACE if k < prompt else OUTPUT_FACE), "white"
            else:
                face, edge = "white", "black"  # the new token: written to the cache this step
            ax2.add_patch(Rectangle((k, -step), 0.92, 0.92, facecolor=face, edgecolor=edge, alpha=0.9))
    ax2.set_title(f"decode: ONE new token per forward, {steps} forwards\neach reads every cached K/V "
                  "(and all weights) for one query", fontsize=10, loc="left")  # fmt: skip
    panels = ((ax1, prompt, prompt, "query (prompt token)"), (ax2, steps, total, "decode step"))
    for ax, rows, cols, ylab in panels:
        ax.set_xlim(-0.2, cols + 0.2)
        ax.set_ylim(-rows + 0.8, 1.1)
        ax.set_yticks([-r + 0.46 for r in range(rows)], [str(r) for r in range(rows)])
        ax.set_xticks([c + 0.46 for c in range(cols)], [str(c) for c in range(cols)], fontsize=8)
        ax.set_xlabel("key / value position in the KV cache")
        ax.set_ylabel(ylab)
        bare(ax, keep=())
    new_token = {"facecolor": "white", "edgecolor": "black"}
    handles = swatches({"color": PROMPT_FACE}, {"color": OUTPUT_FACE}, new_token)
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
    workloads = list(dict.fromkeys(name for name, _, _ in share))
    fig, ax = plt.subplots(figsize=figsize)
    x = np.arange(len(schemes))
    width = 0.8 / (2 * len(workloads) + 1)
    bar = 0
    for workload, color in zip(workloads, ("#4C72B0", "#DD8452"), strict=False):
        for snap in ("done", "half"):
            label = f"{workload}, {'at completion' if snap == 'done' else 'halfway through output'}"
            ax.bar(x + (bar - len(workloads)) * width, [share[workload, snap, s] for s in schemes], width,
                   color=color if snap == "done" else "white", edgecolor=color,
                   hatch=None if snap == "done" else "//", label=label)  # fmt: skip
            bar += 1
    paper = [paper_share[s] for s in schemes]
    paper_x = x + len(workloads) * width
    ax.bar(paper_x, paper, width, color="#555555", label="paper, measured while serving (Fig. 2)")
    for xi, p in zip(paper_x, paper, strict=True):
        ax.text(xi, p + 0.015, f"{p:.1%}", ha="center", fontsize=8)
    names = {"static": "static\nOrca (Max)", "pow2": "pow2\nOrca (Pow2)", "oracle": "oracle\nOrca (Oracle)",
             "paged": f"paged (block {block_size})\nvLLM"}  # fmt: skip
    ax.set_xticks(x, [names.get(s, s) for s in schemes])
    ax.set_ylim(0, 1.08)
    ax.set_yticks(np.linspace(0, 1, 6), [f"{v:.0%}" for v in np.linspace(0, 1, 6)])
    ax.set_ylabel("reserved KV slots holding real tokens")
    ax.set_title("Share of reserved KV memory that holds real tokens")
    # below the axes, clear of every bar (the oracle's reach 100%)
    ax.legend(frameon=False, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
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

    workloads = list(dict.fromkeys(key[0] for key in sweep))
    fig, axes = plt.subplots(2, 2, figsize=figsize, sharex="col")
    metrics = ["share of reserved slots holding tokens", f"requests that fit in {budget_label}"]
    for row, metric in enumerate(metrics):
        for workload, ls in zip(workloads, ("-", "--"), strict=False):
            for s in ("static", "paged"):
                color = SCHEME_COLORS[s]
                values = [sweep[workload, s, "max_len", m][row] for m in max_lens]
                axes[row, 0].plot(max_lens, values, color=color, ls=ls, marker="o", label=f"{s}, {workload}")
            paged = [sweep[workload, "paged", "block", b][row] for b in block_sizes]
            axes[row, 1].plot(block_sizes, paged, color=SCHEME_COLORS["paged"], ls=ls, marker="o",
                              label=f"paged, {workload}")  # fmt: skip
            static = sweep[workload, "static", "max_len", default_max_len][row]
            axes[row, 1].axhline(static, color=SCHEME_COLORS["static"], ls=ls, lw=1.5,
                                 label=f"static ({default_max_len}), {workload}")  # fmt: skip
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
    for col, (xs, name) in enumerate([(max_lens, "max_len"), (block_sizes, "block_size")]):
        axes[1, col].set_xticks(list(xs), [str(v) for v in xs])
        axes[1, col].set_xlabel(f"{name} (tokens)")
    _sweep_legend(fig, workloads)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _sweep_legend(fig: Figure, workloads: list) -> None:
    """One legend for the four sweep plots: colour = scheme, line style = workload (long handles, so a
    dashed line looks dashed)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=SCHEME_COLORS[s], lw=3, label=s) for s in ("static", "paged")]
    handles += [Line2D([], [], color="#333333", ls=ls, lw=1.5, label=w)
                for w, ls in zip(workloads, ("-", "--"), strict=False)]  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False, fontsize=10, handlelength=4)


def draw_causal_mask(mask, *, start: int = 0, ax: Axes | None = None, title: str | None = None) -> Figure:
    """A prefill mask as a heatmap: rows are new tokens (at positions start, start+1, ...), columns the
    cached positions they may read (True = read)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    grid = np.asarray(mask, dtype=bool)  # (num_new, seq_len)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.45 * grid.shape[1] + 1.6, 0.45 * grid.shape[0] + 1.2))
    ax.imshow(grid, cmap=ListedColormap([FREE_FACE, PROMPT_FACE]), vmin=0, vmax=1, aspect="equal")
    ax.set_xticks(np.arange(grid.shape[1]), [str(c) for c in range(grid.shape[1])], fontsize=8)
    ax.set_yticks(np.arange(grid.shape[0]), [str(start + r) for r in range(grid.shape[0])], fontsize=8)
    ax.set_xticks(np.arange(grid.shape[1] + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(grid.shape[0] + 1) - 0.5, minor=True)
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
    for i, (query_len, seq_len) in enumerate(zip(qlens, slens, strict=True)):
        color = PALETTE[i % len(PALETTE)]
        for j in range(query_len):  # top row: the flat query
            ax.add_patch(Rectangle((starts[i] + j, 0), 0.92, 0.8, facecolor=color, edgecolor="white"))
            position = str(seq_len - query_len + j)
            ax.text(starts[i] + j + 0.46, 0.4, position, ha="center", va="center", fontsize=7, color="white")
        y = -1.4 - i
        for t in range(seq_len):  # the sequence: cached (light) then new (solid)
            new = t >= seq_len - query_len
            ax.add_patch(Rectangle((t, y), 0.92, 0.8, facecolor=color, alpha=1.0 if new else 0.25,
                                   edgecolor="white"))  # fmt: skip
        ax.text(-0.3, y + 0.4, f"seq {names[i]}: seq_len {seq_len}", ha="right", va="center", fontsize=9)
    for i, start in enumerate(starts):  # query_start_loc
        ax.plot([start - 0.04] * 2, [-0.15, 1.05], color="black", lw=1.5)
        label = f"query_start_loc[{i}] = {start}"
        ax.text(start - 0.04, 1.15, label, rotation=30, fontsize=7, ha="left", va="bottom")
    ax.text(-0.3, 0.4, "flat query", ha="right", va="center", fontsize=9, weight="bold")
    ax.set_title("light: already in the cache; solid: this forward's new tokens (numbers: positions)",
                 fontsize=9, loc="left")  # fmt: skip
    ax.set_xlim(-6.5, width + 0.5)
    ax.set_ylim(-1.6 - len(qlens), 3.2)
    ax.set_xticks(range(0, width + 1, 2 if width <= 30 else 5))
    ax.set_yticks([])
    ax.set_xlabel("token index (flat batch on top; position in the sequence below; numbers = position)")
    bare(ax)
    fig.tight_layout()
    return fig


PIPELINE = (  # (package piece, what it does, notebook)
    ("BlockAllocator", "free list + ref counts\nof physical block ids", "02"),
    ("BlockManager", "page tables, slots;\nsharing, prefix cache", "03, 08"),
    ("PagedKVCache", "K/V pools; writes through\nthe slot mapping", "04"),
    ("paged_attention", "reads K/V through the\nblock table (torch, CUDA)", "04, 05b, 07"),
    ("LlamaModel", "a flat batch of prefills\nand decodes per forward", "06"),
    ("Scheduler", "admit, grow, preempt,\nfree: each step", "06"),
    ("LLMEngine", "requests in, tokens out;\nstats per step", "06"),
    ("serving", "requests arriving over\ntime; latency vs rate", "06"),
)


def draw_pipeline(*, figsize: tuple[float, float] = (15, 3.2)) -> Figure:
    """The whole of vllmini as one row of boxes, lowest layer on the left, with the notebook that
    builds each piece; data flows left to right, nothing imports a box to its right."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=figsize)
    num_boxes = len(PIPELINE)
    for i, (name, what, nb) in enumerate(PIPELINE):
        x = i * 1.9
        ax.add_patch(FancyBboxPatch((x, 0), 1.6, 1.3, boxstyle="round,pad=0.05", facecolor=PALETTE[i % 9],
                                    alpha=0.18, edgecolor=PALETTE[i % 9], lw=2))  # fmt: skip
        ax.text(x + 0.8, 1.05, name, ha="center", va="center", fontsize=10, weight="bold", family="monospace")
        ax.text(x + 0.8, 0.55, what, ha="center", va="center", fontsize=8)
        notebooks = f"notebook{'s' if ',' in nb else ''} {nb}"
        ax.text(x + 0.8, -0.25, notebooks, ha="center", va="center", fontsize=8, color="#555555")
        if i < num_boxes - 1:
            ax.annotate("", (x + 1.88, 0.65), (x + 1.66, 0.65), arrowprops=dict(arrowstyle="->", lw=1.5))
    layers = ["block ids", "page tables", "KV cache", "attention", "model", "scheduler", "engine", "serving"]
    ax.text(0, 1.7, "  ->  ".join(layers), fontsize=9, color="#555555")
    ax.set_xlim(-0.2, num_boxes * 1.9)
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


# One engine step, stage by stage: (stage, vLLM 0.11.0 names, vllmini names). The vLLM names are
# classes/methods of its V1 engine (vllm/v1/...); the vllmini names resolve under the package.
ENGINE_STEP = (
    ("scheduler", ("Scheduler.schedule",), ("scheduler.Scheduler.schedule",)),
    ("KV cache manager\n+ block pool", ("KVCacheManager.allocate_slots", "BlockPool.get_new_blocks"),
     ("block_manager.BlockManager.append", "allocator.BlockAllocator")),
    ("inputs and\nattention metadata", ("GPUModelRunner._prepare_inputs", "BlockTable.compute_slot_mapping",
                                        "CommonAttentionMetadata"),
     ("model_runner.prepare_inputs", "attention.AttentionMetadata")),
    ("model runner:\nthe forward", ("GPUModelRunner.execute_model", "LlamaForCausalLM", "FlashAttentionImpl"),
     ("model_runner.ModelRunner.execute", "model.LlamaModel", "attention.paged_attention")),
    ("sampler", ("Sampler",), ("sampling.sample_batch",)),
    ("update", ("Scheduler.update_from_output",), ("engine.LLMEngine.step",)),
)  # fmt: skip


def draw_engine_step(*, figsize: tuple[float, float] = (16, 4.4)) -> Figure:
    """One engine step as boxes in the order they run (ENGINE_STEP): each box names the stage, the vLLM
    0.11.0 functions that do it and, below a line, vllmini's; the frame is the step itself."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=figsize)
    width, gap = 2.45, 0.45
    for i, (stage, vllm, ours) in enumerate(ENGINE_STEP):
        x, color = i * (width + gap), PALETTE[i % len(PALETTE)]
        ax.add_patch(FancyBboxPatch((x, 0), width, 2.6, boxstyle="round,pad=0.05", fc=color, alpha=0.14,
                                    edgecolor=color, lw=2))  # fmt: skip
        ax.text(x + width / 2, 2.45, stage, ha="center", va="top", fontsize=10.5, weight="bold")
        ax.text(x + width / 2, 1.72, "\n".join(vllm), ha="center", va="top", fontsize=8, family="monospace")
        ax.text(x + width / 2, 0.62, "vllmini:\n" + "\n".join(n.split(".", 1)[1] for n in ours), ha="center",
                va="top", fontsize=7.5, family="monospace", color="#555555")  # fmt: skip
        ax.plot([x + 0.1, x + width - 0.1], [0.78, 0.78], color=color, lw=0.8)
        if i:
            ax.add_patch(FancyArrowPatch((x - gap + 0.02, 1.3), (x - 0.02, 1.3), arrowstyle="-|>",
                                         mutation_scale=14, color="black"))  # fmt: skip
    total = len(ENGINE_STEP) * (width + gap) - gap
    ax.add_patch(FancyBboxPatch((-0.25, -0.3), total + 0.5, 3.35, boxstyle="round,pad=0.02", fill=False,
                                edgecolor="grey", ls="--"))  # fmt: skip
    ax.text(-0.15, 2.9, "EngineCore.step (vLLM)  |  LLMEngine.step (vllmini)", fontsize=9, color="grey",
            va="center", family="monospace")  # fmt: skip
    note = "from the KV cache manager to the model runner travels a SchedulerOutput: which requests run, "
    ax.text(total / 2, -0.5, note + "how many new tokens each, their new blocks",
            ha="center", va="top", fontsize=8.5, style="italic")  # fmt: skip
    ax.set(xlim=(-0.4, total + 0.4), ylim=(-0.9, 3.2))
    ax.axis("off")
    fig.tight_layout()
    return fig

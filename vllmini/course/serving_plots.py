"""Pictures of an engine at work (notebook 06): what each request did per step, the tokens of each step under
chunked prefill, the pool and the batch over a run, static vs paged reservation, and latency against
request rate.

They only read what they are given (per-step records, results, rate-sweep points) and return the Figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllmini.course.style import POLICY_COLORS, SCHEME_COLORS, bare, seq_color, swatches

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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
    handles = swatches(*({"color": face} for face, _ in TIMELINE_STATES.values()))
    ax.legend(handles, [label for _, label in TIMELINE_STATES.values()], loc="upper center",
              bbox_to_anchor=(0.5, -0.28), ncol=5, frameon=False, fontsize=8)  # fmt: skip
    bare(ax)
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
    ax1.set(xlabel="engine step", ylabel="token slots (during the forward)")
    ax1.set(title="KV pool (red line: a preemption)", ylim=(0, stats[0].pool_slots * 1.1))
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


def plot_latency_vs_rate(points, *, factor: float = 5.0, ax: Axes | None = None, title: str | None = None):
    """Mean normalized latency (ms/token) against request rate, one line per policy, from
    `vllmini.course.latency.rate_sweep` points; a dotted line marks the highest rate each policy sustains
    (below `factor` x its lowest-rate latency, the dashed line). Hollow markers: runs cut off (lower
    bounds)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from vllmini.course.latency import sustained_rate

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
        faces = [color if p.metrics.complete else "white" for p in pts]  # hollow: cut off
        ax.scatter(rates, lat, s=28, zorder=3, color=faces, edgecolors=color)
        if s.crossed:
            ax.axvline(s.rate, color=color, ls=":", lw=1.2)
        thresholds.append((1e3 * s.threshold, color))
    spread = max(t for t, _ in thresholds) / min(t for t, _ in thresholds)
    for t, color in thresholds[:1] if spread < 1.05 else thresholds:  # one line when they coincide
        ax.axhline(t, color="black" if spread < 1.05 else color, ls="--", lw=0.9)
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


def plot_step_tokens(
    steps: list[dict], budget: int | None, *, ax: Axes | None = None, title: str | None = None
) -> Axes:
    """The tokens of each step's forward, stacked by request: `steps[k]` maps a request id to the span
    (start, end, is_prefill) of its tokens computed in step k (start = its num_computed_tokens before the
    step). Prefill chunks are hatched and labelled start-end, decodes are one plain token; the dashed
    line is the token budget (max_num_batched_tokens; None draws none)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.6))
    for k, spans in enumerate(steps):
        bottom = 0
        for rid, (start, end, prefill) in sorted(spans.items()):
            n, color = end - start, seq_color(rid)
            hatch = "//" if prefill else None
            ax.bar(k, n, bottom=bottom, width=0.8, color=color, edgecolor="white", hatch=hatch)
            if prefill and n >= 2:
                box = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}
                ax.text(k, bottom + n / 2, f"{start}-{end}", ha="center", va="center", fontsize=8, bbox=box)
            bottom += n
    if budget is not None:
        ax.axhline(budget, color="black", ls="--", lw=1)
        ax.text(
            len(steps) - 0.5,
            budget,
            f"max_num_batched_tokens = {budget}",
            ha="right",
            va="bottom",
            fontsize=8,
        )
    rids = sorted({rid for spans in steps for rid in spans})
    handles = swatches(*({"color": seq_color(r)} for r in rids), {"facecolor": "white", "edgecolor": "grey",
                                                                  "hatch": "//"})  # fmt: skip
    ax.legend(handles, [f"request {r}" for r in rids] + ["prefill chunk (start-end)"], fontsize=8,
              loc="upper right")  # fmt: skip
    ax.set(xlabel="step", ylabel="tokens in the forward", xticks=range(len(steps)), title=title or "")
    bare(ax, keep=("bottom", "left"))
    return ax

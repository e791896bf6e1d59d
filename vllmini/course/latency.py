"""What a served trace measured, and latency against request rate: per-request metrics with percentiles
(normalized latency, TTFT, TPOT, throughput), the same trace time-scaled to several rates for the
static / oracle / paged policies on one KV budget, and the highest rate each policy sustains (mean
normalized latency below `factor` x its value at the lowest rate; Kwon et al., SOSP 2023, Fig. 12)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vllmini.checks import as_float, as_int, one_of
from vllmini.course.arrivals import at_rate, make_trace
from vllmini.course.serving import H200_STEP_COST, RequestRecord, ServingRun, StepCost, serve
from vllmini.engine import LLMEngine
from vllmini.errors import InvalidArgumentError
from vllmini.scheduler import POLICIES, check_policy

__all__ = [
    "FULL_BLOCK_SIZE", "FULL_KV_SLOTS", "FULL_MAX_MODEL_LEN", "PAPER_RATE_GAIN", "RATE_GRID",
    "ServingMetrics", "Stat", "Sustained", "SweepPoint", "engine_at_scale", "format_metrics", "format_sweep",
    "rate_sweep", "summarize", "sustained_rate",
]  # fmt: skip

# The engine benchmark's KV budget (benchmarks/bench_engine.py, notebook 06), at full size: the paper's
# max_model_len 2048 and 15,360 token slots = 7.5 x 2048, so static reservation admits 7 requests at once
# (Orca (Max)'s batch in Kwon et al., Fig. 13); block size 16. `engine_at_scale` divides all by `scale`.
FULL_MAX_MODEL_LEN, FULL_KV_SLOTS, FULL_BLOCK_SIZE = 2048, 15360, 16

# Request rates (requests/s) a sweep runs at full size; at 1/scale the requests are `scale` times shorter,
# so `rate_sweep` multiplies these by scale. Each brackets where the three policies cross 5x their
# lowest-rate latency under H200_STEP_COST (ShareGPT: near 4, 10 and 12 requests/s; Alpaca: near 11, 85
# and 110), with room above for a GPU faster than the model.
RATE_GRID = {
    "sharegpt": (0.5, 2.0, 3.0, 4.0, 5.5, 7.0, 8.5, 10.0, 12.0, 14.0, 17.0, 20.0),
    "alpaca": (2.0, 6.0, 10.0, 15.0, 25.0, 40.0, 55.0, 70.0, 85.0, 100.0, 120.0, 150.0),
}


# -----------------------------------------------------------------------------
# metrics


@dataclass(frozen=True)
class Stat:
    """Mean and percentiles of one per-request metric."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values) -> Stat:
        v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
        if v.size == 0:
            return cls(math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = np.percentile(v, [50, 90, 99])  # linear interpolation between order statistics
        return cls(float(v.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class ServingMetrics:
    """What a served trace measured. Latencies in seconds; normalized latency in s/token.

    A run cut off with requests unfinished counts each of them as finishing at the cut-off with its
    full output (a lower bound on its latency), so its means are lower bounds (complete False)."""

    num_requests: int
    num_finished: int
    duration: float  # first arrival to last finish (or the cut-off)
    request_throughput: float  # finished requests / duration
    output_throughput: float  # output tokens generated / duration
    normalized_latency: Stat
    ttft: Stat
    tpot: Stat
    latency: Stat
    complete: bool = True


def summarize(run: ServingRun | Sequence[RequestRecord], end: float | None = None) -> ServingMetrics:
    """Normalized latency, TTFT, TPOT, end-to-end latency (mean and p50/p90/p99), throughput."""
    if isinstance(run, ServingRun):
        records, end = run.records, run.end if run.cut_off else None
    else:
        records = list(run)
    if not records:
        raise InvalidArgumentError("summarize needs at least one request record, got none")
    done = [r for r in records if r.finished]
    left = [r for r in records if not r.finished]
    if left and end is None:
        raise InvalidArgumentError(
            f"{len(left)} requests are unfinished (e.g. request {left[0].request_id}): pass end=, the cut-off"
        )
    # unfinished: lower bounds, as if each finished with its full output at the cut-off
    norm = [r.normalized_latency for r in done] + [(end - r.arrival) / r.max_tokens for r in left]
    lat = [r.latency for r in done] + [end - r.arrival for r in left]
    ttft = [r.ttft for r in done] + [
        (r.first_token if r.first_token is not None else end) - r.arrival for r in left
    ]
    last = max([r.finish for r in done] + ([end] if left else []))
    duration = last - min(r.arrival for r in records)
    tokens = sum(r.output_len for r in records)
    return ServingMetrics(
        num_requests=len(records),
        num_finished=len(done),
        duration=duration,
        request_throughput=len(done) / duration if duration > 0 else math.nan,
        output_throughput=tokens / duration if duration > 0 else math.nan,
        normalized_latency=Stat.of(norm),
        ttft=Stat.of(ttft),
        tpot=Stat.of(r.tpot for r in done),
        latency=Stat.of(lat),
        complete=not left,
    )


def format_metrics(m: ServingMetrics) -> str:
    """A short table: mean and percentiles of each latency metric, then throughput."""
    rows = [
        ("normalized latency (ms/token)", m.normalized_latency),
        ("time to first token (ms)", m.ttft),
        ("time per output token (ms)", m.tpot),
        ("end-to-end latency (s)", m.latency),
    ]
    lines = [f"{'':30} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8}"]
    for k, (name, s) in enumerate(rows):
        unit = 1.0 if k == 3 else 1e3
        lines.append(f"{name:30}" + "".join(f" {unit * v:8.3g}" for v in (s.mean, s.p50, s.p90, s.p99)))
    bound = "" if m.complete else " (cut off: means are lower bounds)"
    lines.append(
        f"{m.num_finished}/{m.num_requests} requests finished in {m.duration:.3g} s: "
        f"{m.request_throughput:.3g} requests/s, {m.output_throughput:.4g} output tokens/s{bound}"
    )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# latency against request rate


def engine_at_scale(model, policy: str, scale: int = 1, **engine_kwargs) -> LLMEngine:
    """An engine on the engine benchmark's KV budget at 1/scale: max_model_len 2048 / scale, 15,360 / scale
    token slots (static reservation fits 7 requests), block size 16 / scale (at least 1)."""
    check_policy(policy)
    scale = as_int(scale, "scale", min=1, max=FULL_MAX_MODEL_LEN // 2)
    block = max(1, FULL_BLOCK_SIZE // scale)
    kw = dict(max_num_seqs=1024, watermark=0.01) | engine_kwargs
    return LLMEngine(
        model,
        block_size=block,
        num_blocks=FULL_KV_SLOTS // scale // block,
        max_model_len=FULL_MAX_MODEL_LEN // scale,
        policy=policy,
        **kw,
    )


@dataclass(frozen=True)
class SweepPoint:
    """One (policy, rate) run of a sweep."""

    workload: str
    policy: str
    rate: float  # requests/s
    metrics: ServingMetrics
    mean_batch: float
    num_preemptions: int
    num_steps: int
    seconds: float  # the run's length on its clock (simulated: what the GPU would take)

    @classmethod
    def of(cls, workload: str, policy: str, rate: float, run: ServingRun) -> SweepPoint:
        """The point a served run makes: its metrics (`summarize`), mean batch, preemptions and steps."""
        m = summarize(run)
        return cls(workload, policy, rate, m, run.mean_batch, run.num_preemptions, len(run.steps), run.end)

    @property
    def mean_normalized_latency(self) -> float:
        return self.metrics.normalized_latency.mean


def _check_sweep_args(workload, rates, policies, scale, duration, factor, max_time_factor) -> tuple:
    """rate_sweep()'s arguments checked; returns (rates ascending, scale, duration, factor,
    max_time_factor) cleaned. rates None: RATE_GRID[workload] x scale."""
    one_of(workload, "workload", tuple(RATE_GRID))
    scale = as_int(scale, "scale", min=1, max=FULL_MAX_MODEL_LEN // 2)
    if rates is None:
        rates = [r * scale for r in RATE_GRID[workload]]
    rates = sorted(as_float(r, "rate", min=1e-9) for r in rates)
    if not rates:
        raise InvalidArgumentError("rates must hold at least one request rate, got none")
    for p in policies:
        check_policy(p)
    duration = as_float(duration, "duration", min=1e-9)
    factor = as_float(factor, "factor", min=1.0)
    max_time_factor = as_float(max_time_factor, "max_time_factor", min=1.0)
    return rates, scale, duration, factor, max_time_factor


def rate_sweep(
    model,
    rates: Sequence[float] | None = None,
    *,
    workload: str = "sharegpt",
    policies: Sequence[str] | None = None,
    scale: int = 1,
    duration: float = 60.0,
    seed: int = 0,
    clock: str = "simulated",
    step_cost: StepCost | Callable[[int, int], float] = H200_STEP_COST,
    factor: float = 5.0,
    max_time_factor: float = 3.0,
    stop_past_threshold: bool = True,
    on_point: Callable[[SweepPoint], None] | None = None,
    on_run: Callable[[ServingRun, SweepPoint], None] | None = None,
    keep_going: Callable[[], bool] | None = None,
) -> list[SweepPoint]:
    """Serve one seeded trace of `duration` seconds at each rate (ascending) under each policy, on the
    engine benchmark's KV budget at 1/scale (`engine_at_scale`). rates None: RATE_GRID[workload] x scale.
    policies None: the scheduler's POLICIES, paging last (after the baselines it is measured against).

    The trace is drawn once at the highest rate and stretched for the lower ones (same requests, only
    the arrival rate changes). A run stops at max_time_factor * duration (its means are then lower
    bounds). With stop_past_threshold a policy stops at the first rate whose mean normalized latency
    exceeds `factor` times its value at the lowest rate. Rates run in turn, each under every policy still
    going: a sweep that keep_going() (asked before each run) stops leaves no policy behind. on_point(point)
    and on_run(run, point) are called after each run."""
    if policies is None:
        policies = sorted(POLICIES, key=lambda p: p == "paged")  # stable: the baselines keep their order
    rates, scale, duration, factor, max_time_factor = _check_sweep_args(
        workload, rates, policies, scale, duration, factor, max_time_factor
    )
    max_len = FULL_MAX_MODEL_LEN // scale
    vocab = model.config.vocab_size
    base = make_trace(
        rates[-1], duration, workload, max_model_len=max_len, scale=scale, vocab_size=vocab, seed=seed
    )
    points, first, active = [], {}, list(policies)  # first: each policy's latency at its lowest rate
    for rate in rates:  # rate by rate, every policy still running: a sweep cut short leaves none behind
        trace = at_rate(base, rate, rates[-1], duration)
        if not trace:
            continue
        for policy in list(active):
            if keep_going is not None and not keep_going():
                return points
            engine = engine_at_scale(model, policy, scale)
            run = serve(engine, trace, clock=clock, step_cost=step_cost, max_time=max_time_factor * duration)
            pt = SweepPoint.of(workload, policy, rate, run)
            points.append(pt)
            if on_point is not None:
                on_point(pt)
            if on_run is not None:
                on_run(run, pt)
            first.setdefault(policy, pt.mean_normalized_latency)
            if stop_past_threshold and pt.mean_normalized_latency > factor * first[policy]:
                active.remove(policy)
        if not active:
            break
    return points


@dataclass(frozen=True)
class Sustained:
    """The highest rate a policy sustains: mean normalized latency below factor x its lowest-rate value."""

    policy: str
    rate: float  # interpolated where the curve crosses the threshold; the highest rate run if it never does
    threshold: float  # s/token
    crossed: bool  # False: never crossed in the rates run, so `rate` is a lower bound


def sustained_rate(points: Sequence[SweepPoint], policy: str, factor: float = 5.0) -> Sustained:
    """Where `policy`'s mean normalized latency first exceeds factor x its value at the lowest rate run,
    interpolated linearly between the two rates around the crossing."""
    factor = as_float(factor, "factor", min=1.0)
    pts = sorted((p for p in points if p.policy == policy), key=lambda p: p.rate)
    if not pts:
        raise InvalidArgumentError(f"no sweep points for policy {policy!r}")
    threshold = factor * pts[0].mean_normalized_latency
    for lo, hi in zip(pts, pts[1:], strict=False):
        y0, y1 = lo.mean_normalized_latency, hi.mean_normalized_latency
        if y1 > threshold:
            rate = lo.rate + (threshold - y0) / (y1 - y0) * (hi.rate - lo.rate)
            return Sustained(policy, rate, threshold, True)
    return Sustained(policy, pts[-1].rate, threshold, False)


def format_sweep(points: Sequence[SweepPoint], factor: float = 5.0) -> str:
    """One line per run (normalized latency in ms/token, TTFT in s), then each policy's sustained rate."""
    head = (
        f"{'':21}{'normalized latency, ms/token':>30}\n{'policy':7} {'rate/s':>7} {'reqs':>5} {'mean':>10} "
        f"{'p50':>9} {'p99':>9} {'TTFT p50 (s)':>13} {'batch':>6} {'preempt':>7}"
    )
    lines = [head, "-" * len(head.split("\n")[1])]
    order = {policy: i for i, policy in enumerate(dict.fromkeys(p.policy for p in points))}
    for p in sorted(points, key=lambda p: (order[p.policy], p.rate)):  # a policy's runs together
        m, nl = p.metrics, p.metrics.normalized_latency
        mark = ">" if not m.complete else " "
        lines.append(
            f"{p.policy:7} {p.rate:7.3g} {m.num_requests:5d} {mark}{1e3 * nl.mean:9.4g} {1e3 * nl.p50:9.4g} "
            f"{1e3 * nl.p99:9.4g} {m.ttft.p50:13.3g} {p.mean_batch:6.1f} {p.num_preemptions:7d}"
        )
    if any(not p.metrics.complete for p in points):
        lines.append("> run cut off with requests unfinished: the mean is a lower bound")
    lines.append(
        f"highest rate sustained (mean normalized latency < {factor:g}x its value at the lowest rate):"
    )
    found = {}
    for policy in dict.fromkeys(p.policy for p in points):
        s = found[policy] = sustained_rate(points, policy, factor)
        lines.append(f"  {policy:7} {'' if s.crossed else '>= '}{s.rate:.3g} requests/s")
    if "paged" in found:
        for other in ("static", "oracle"):
            if other in found:
                a, b = found["paged"], found[other]
                approx = "" if a.crossed and b.crossed else " (a bound: one never crossed)"
                lines.append(f"  paged / {other}: {a.rate / b.rate:.2f}x{approx}")
    return "\n".join(lines)


# the paper's curve, for the record (Kwon et al., SOSP 2023): vLLM sustains 2-4x the request rate of
# FasterTransformer and Orca at the same latency (abstract, Fig. 12); on ShareGPT 1.7-2.7x Orca (Oracle)
# and 2.7-8x Orca (Max) (Sec. 6.2).
PAPER_RATE_GAIN = {"abstract": (2.0, 4.0), "oracle_sharegpt": (1.7, 2.7), "static_sharegpt": (2.7, 8.0)}

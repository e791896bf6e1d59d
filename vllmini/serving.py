"""The engine under load: requests that arrive over time, the latency each one sees, and the highest
request rate a policy sustains.

    trace = make_trace(rate=4.0, duration=30.0, workload="sharegpt")     # seeded Poisson arrivals
    run = serve(engine, trace)                                           # simulated clock (default)
    print(format_metrics(summarize(run)))

Arrivals are a Poisson process (exponential gaps with mean 1 / rate); lengths come from
`vllmini.memory.sample_requests` (ShareGPT-like or Alpaca-like, the paper's means). `serve` admits each
request when the clock reaches its arrival and steps the REAL engine (its scheduler, preemption and KV
pool), recording per request: arrival, first token, finish, tokens. Two clocks:

  "wall"       seconds measured around each step (on a GPU: the real thing).
  "simulated"  each step costs step_seconds = a + b * (tokens in the batch) + c * (KV tokens read),
               `StepCost`, fitted to step times recorded on a GPU (`H200_STEP_COST`): a model of the GPU's
               time, deterministic, that a CPU runs in a fraction of it. Only time is modelled: batching,
               preemption and memory are the engine's own. (A tiny model on a CPU runs ~10x faster with
               torch.set_num_threads(1).)

Metrics follow the PagedAttention paper (Kwon et al., SOSP 2023, Sec. 6): normalized latency = a
request's end-to-end latency divided by its output length, averaged over requests; plus time to first
token (TTFT), time per output token after the first (TPOT, as vLLM's benchmark_serving.py) and
throughput. `rate_sweep` runs the same trace, time-scaled, at several rates for the static / oracle /
paged policies on one KV budget, and `sustained_rate` finds the highest rate at which a policy's mean
normalized latency stays below `factor` (5) times its value at the lowest rate (Fig. 12 of the paper).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vllmini.checks import as_float, as_int, one_of
from vllmini.engine import LLMEngine, RequestOutput, SamplingParams
from vllmini.errors import EngineStateError, InvalidArgumentError, InvalidTypeError
from vllmini.memory import WORKLOADS, sample_requests

CLOCKS = ("simulated", "wall")
POLICIES = ("static", "oracle", "paged")

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
# arrivals and traces


def poisson_arrivals(
    rate: float, *, num_requests: int | None = None, duration: float | None = None, seed: int = 0
) -> np.ndarray:
    """Arrival times (seconds, float64, increasing) of a Poisson process of `rate` requests/s, seeded.

    Give num_requests (exactly that many) or duration (every arrival in [0, duration)). The gaps are
    standard exponentials / rate drawn in one stream, so the same seed at another rate gives the same
    trace stretched in time: arrivals(2r) == arrivals(r) / 2.
    """
    rate = as_float(rate, "rate", min=0.0)
    if rate == 0.0:
        raise InvalidArgumentError("rate must be > 0 requests/s, got 0.0")
    seed = as_int(seed, "seed", min=0)
    if (num_requests is None) == (duration is None):
        raise InvalidArgumentError("give exactly one of num_requests and duration")
    rng = np.random.default_rng(seed)
    if num_requests is not None:
        n = as_int(num_requests, "num_requests", min=0)
        return np.cumsum(rng.standard_exponential(n)) / rate  # (n,)
    horizon = as_float(duration, "duration", min=0.0) * rate  # in units of mean gaps
    chunks, total = [], 0.0
    while total < horizon:  # draw the same stream in chunks until it passes the horizon
        gaps = rng.standard_exponential(1024)
        chunks.append(gaps)
        total += float(gaps.sum())
    times = np.cumsum(np.concatenate(chunks)) if chunks else np.zeros(0)
    return times[times < horizon] / rate  # (n,)


@dataclass(frozen=True)
class TimedRequest:
    """One request of a trace: when it arrives, its prompt, and how many tokens it generates."""

    arrival: float  # seconds since the trace started
    prompt_token_ids: tuple[int, ...]
    output_len: int  # generated exactly (max_tokens with ignore_eos), so the schedule is the weights'-free


def scaled_lengths(
    n: int, workload: str = "sharegpt", *, max_model_len: int = 2048, scale: int = 1, seed: int = 0
) -> list[tuple[int, int]]:
    """n (input, output) lengths of `workload` at 1/scale: drawn at max_model_len * scale by
    `sample_requests`, divided by scale (rounded, >= 1), clipped to input + output <= max_model_len
    (as benchmarks/bench_engine.py and notebook 06 do)."""
    n = as_int(n, "n", min=0)
    one_of(workload, "workload", tuple(WORKLOADS))
    max_model_len = as_int(max_model_len, "max_model_len", min=2)
    scale = as_int(scale, "scale", min=1)
    out = []
    for i, o in sample_requests(n, workload, max_model_len * scale, as_int(seed, "seed", min=0)):
        i = min(max(1, round(i / scale)), max_model_len - 1)
        o = min(max(1, round(o / scale)), max_model_len - i)
        out.append((i, o))
    return out


def make_trace(
    rate: float,
    duration: float,
    workload: str = "sharegpt",
    *,
    max_model_len: int = 2048,
    scale: int = 1,
    vocab_size: int = 256,
    seed: int = 0,
) -> list[TimedRequest]:
    """Requests arriving at `rate`/s (Poisson) during [0, duration), lengths of `workload` at 1/scale,
    random prompt ids in [0, vocab_size); all seeded by `seed`."""
    arrivals = poisson_arrivals(rate, duration=duration, seed=seed)  # (n,)
    lengths = scaled_lengths(len(arrivals), workload, max_model_len=max_model_len, scale=scale, seed=seed)
    vocab_size = as_int(vocab_size, "vocab_size", min=1)
    rng = np.random.default_rng([seed, 1])  # prompt ids: a stream of their own
    return [
        TimedRequest(float(t), tuple(int(x) for x in rng.integers(0, vocab_size, i)), o)
        for t, (i, o) in zip(arrivals, lengths, strict=True)
    ]


def at_rate(
    trace: Sequence[TimedRequest], rate: float, base_rate: float, duration: float
) -> list[TimedRequest]:
    """The trace drawn at base_rate, stretched in time to `rate` and cut at `duration`: the same
    requests in the same order, so a sweep over rates changes only how fast they come."""
    factor = as_float(base_rate, "base_rate", min=0.0) / as_float(rate, "rate", min=1e-12)
    duration = as_float(duration, "duration", min=0.0)
    return [replace(q, arrival=q.arrival * factor) for q in trace if q.arrival * factor < duration]


# -----------------------------------------------------------------------------
# the cost of one step, for the simulated clock


@dataclass(frozen=True)
class StepCost:
    """Seconds one engine step takes: fixed + per_token * (tokens in the batch) + per_kv_token * (KV tokens
    its attention reads). Tokens in the batch = prefill tokens + one per decode."""

    fixed: float  # s per step: Python, scheduling, kernel launches, the weights read once
    per_token: float  # s per token in the forward (prefill or decode)
    per_kv_token: float  # s per token of KV cache attention reads

    def __post_init__(self):
        for name in ("fixed", "per_token", "per_kv_token"):
            as_float(getattr(self, name), name, min=0.0)

    def __call__(self, num_batched_tokens: int, num_kv_tokens: int) -> float:
        return self.fixed + self.per_token * num_batched_tokens + self.per_kv_token * num_kv_tokens

    @classmethod
    def fit(cls, num_batched_tokens, num_kv_tokens, seconds) -> StepCost:
        """Least-squares fit with all three coefficients >= 0 (each subset of free coefficients is
        solved; the best feasible one wins). Inputs: one entry per step, or per run's mean step."""
        cols = [np.asarray(v, dtype=np.float64).ravel() for v in (num_batched_tokens, num_kv_tokens, seconds)]
        if len({c.size for c in cols}) != 1 or cols[0].size < 3:
            raise InvalidArgumentError(
                f"fit needs three equal-length inputs of >= 3 steps, got lengths {[c.size for c in cols]}"
            )
        x = np.stack([np.ones(cols[0].size), cols[0], cols[1]], 1)  # (n, 3)
        y = cols[2]  # (n,)
        best, best_err = np.zeros(3), float(y @ y)
        for mask in range(1, 8):
            cols = [j for j in range(3) if mask >> j & 1]
            coef = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[cols] = coef
            err = float(((x @ full - y) ** 2).sum())
            if err < best_err:
                best, best_err = full, err
        return cls(*(float(c) for c in best))


# Fitted by StepCost.fit to the nine mean step times in benchmarks/recorded/engine_step_times.json (one
# NVIDIA H200, a 0.85B-parameter random Llama in bfloat16, the engine benchmark's KV budget, 2026-11-30);
# tests/test_serving.py refits them from that file. A step is mostly fixed cost (Python and launches).
H200_STEP_COST = StepCost(fixed=1.259e-2, per_token=7.737e-5, per_kv_token=0.0)


# -----------------------------------------------------------------------------
# watching the engine step


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did, counted from the sequences, and when it ran on the serving clock."""

    start: float  # clock time the step started
    seconds: float  # its duration (measured, or modelled by StepCost)
    num_prefills: int
    num_decodes: int
    num_batched_tokens: int  # prefill tokens (prompt + tokens generated before a preemption) + decodes
    num_kv_tokens: int  # tokens in the KV cache the batch's attention reads
    num_generated: int  # new tokens sampled

    @property
    def batch_size(self) -> int:
        return self.num_prefills + self.num_decodes


class StepMeter:
    """Runs `engine.step()` and counts what it did from the engine's public state: which sequences were
    prefilled or decoded, tokens in the batch, KV tokens read, new tokens, first tokens."""

    def __init__(self, engine: LLMEngine):
        if not isinstance(engine, LLMEngine):
            raise InvalidTypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
        self.engine = engine
        self.seen_len: dict[int, int] = {}  # request id -> output tokens it had after the last step

    def step(self) -> tuple[list[RequestOutput], StepRecord, list[int]]:
        """One engine step: (finished outputs, its StepRecord with start=seconds=0, ids that got their
        first token in it)."""
        sched = self.engine.scheduler
        before = {s.seq_id: s for s in sched.running}
        finished = self.engine.step()
        seen, ran = self.seen_len, {}
        for s in sched.running:
            ran[s.seq_id] = (len(s.prompt_token_ids), len(s.output_token_ids))
        for o in finished:
            ran[o.request_id] = (len(o.prompt_token_ids), len(o.output_token_ids))
        prefills = decodes = batched = kv = generated = 0
        first = []
        for rid, (prompt, now) in ran.items():
            had = seen.get(rid, 0)
            if now == had:  # in the running list but not in this forward (cannot happen today)
                continue
            generated += now - had
            kv += prompt + had  # tokens its attention reads: all but the one sampled in this step
            if rid in before:
                decodes, batched = decodes + 1, batched + 1
            else:  # admitted now: its prompt and any tokens from before a preemption are prefilled
                prefills, batched = prefills + 1, batched + prompt + had
            if had == 0:
                first.append(rid)
        for rid, (_, now) in ran.items():
            seen[rid] = now
        for o in finished:
            seen.pop(o.request_id, None)
        return finished, StepRecord(0.0, 0.0, prefills, decodes, batched, kv, generated), first


# -----------------------------------------------------------------------------
# the serving loop


@dataclass
class RequestRecord:
    """One request's life on the serving clock (seconds). Unfinished ones keep finish None."""

    request_id: int
    arrival: float
    prompt_len: int
    max_tokens: int
    admitted: float | None = None  # when it was handed to the engine (>= arrival)
    first_token: float | None = None
    finish: float | None = None
    output_len: int = 0
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def latency(self) -> float:
        """End-to-end: arrival to the last token."""
        return self.finish - self.arrival

    @property
    def normalized_latency(self) -> float:
        """End-to-end latency / output tokens (s/token), the paper's per-request metric."""
        return self.latency / self.output_len

    @property
    def ttft(self) -> float:
        """Time to first token: arrival to the end of the step that sampled it (queueing included)."""
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first; NaN for a one-token output."""
        if self.output_len < 2:
            return math.nan
        return (self.finish - self.first_token) / (self.output_len - 1)


@dataclass
class ServingRun:
    """A trace served: each request's record, each step's record, and where the run was cut off."""

    records: list[RequestRecord]
    steps: list[StepRecord]
    clock: str
    end: float  # clock time when the loop stopped
    cut_off: bool = False  # stopped at max_time with requests unfinished
    num_preemptions: int = 0

    @property
    def mean_batch(self) -> float:
        return sum(s.batch_size for s in self.steps) / max(1, len(self.steps))


def _describe(rec: RequestRecord, engine: LLMEngine) -> str:
    """One line naming a request and where it is: for errors."""
    sched, where, got = engine.scheduler, "not in the engine", rec.output_len
    for name, seqs in (("running", sched.running), ("waiting", sched.waiting)):
        for s in seqs:
            if s.seq_id == rec.request_id:
                where, got = name, len(s.output_token_ids)
    return (
        f"request {rec.request_id} (arrived at {rec.arrival:.3f} s, prompt {rec.prompt_len} tokens, "
        f"{got} of {rec.max_tokens} output tokens, {where})"
    )


def serve(
    engine: LLMEngine,
    trace: Sequence[TimedRequest],
    *,
    clock: str = "simulated",
    step_cost: StepCost | Callable[[int, int], float] = H200_STEP_COST,
    max_time: float | None = None,
    stall_steps: int = 100,
) -> ServingRun:
    """Serve `trace` on an idle `engine`: each request is added when the clock reaches its arrival, and
    the engine steps while it has work. Returns every request's arrival, first token, finish and tokens.

    clock "simulated" advances by step_cost(tokens in the batch, KV tokens read) per step (and jumps to
    the next arrival when idle); "wall" measures each step with time.perf_counter (the step returns only
    after its tokens reached the host) and sleeps while idle. max_time stops the loop on that clock with
    requests unfinished (cut_off). EngineStateError, naming the oldest unfinished request, when
    `stall_steps` steps in a row produce no token and finish nothing.
    """
    if not isinstance(engine, LLMEngine):
        raise InvalidTypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
    one_of(clock, "clock", CLOCKS)
    if not callable(step_cost):
        raise InvalidTypeError(f"step_cost must be a StepCost or a callable, got {type(step_cost).__name__}")
    if max_time is not None:
        max_time = as_float(max_time, "max_time", min=0.0)
    stall_steps = as_int(stall_steps, "stall_steps", min=1)
    for k, q in enumerate(trace):
        if not isinstance(q, TimedRequest):
            raise InvalidTypeError(f"trace[{k}] must be a TimedRequest, got {type(q).__name__}")
        as_float(q.arrival, f"trace[{k}].arrival", min=0.0)
    if engine.has_unfinished_requests():
        raise EngineStateError("serve() needs an idle engine: it has unfinished requests")

    order = sorted(range(len(trace)), key=lambda k: trace[k].arrival)  # stable: ties keep trace order
    meter, records, steps = StepMeter(engine), {}, []
    preempted_before = engine.num_preemptions
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    t, nxt, stalled, cut = 0.0, 0, 0, False
    while nxt < len(order) or engine.has_unfinished_requests():
        if clock == "wall":
            t = now()
        while nxt < len(order) and trace[order[nxt]].arrival <= t:  # admit everything that has arrived
            q = trace[order[nxt]]
            rid = engine.add_request(
                list(q.prompt_token_ids), SamplingParams(max_tokens=q.output_len, ignore_eos=True)
            )
            records[rid] = RequestRecord(rid, q.arrival, len(q.prompt_token_ids), q.output_len, admitted=t)
            nxt += 1
        if max_time is not None and t >= max_time:
            cut = True
            break
        if not engine.has_unfinished_requests():  # idle until the next arrival
            if clock == "wall":
                time.sleep(max(0.0, trace[order[nxt]].arrival - t))
            else:
                t = trace[order[nxt]].arrival  # jump exactly to it (t + gap could round below it)
            continue
        start = t
        finished, rec, first = meter.step()
        if clock == "wall":
            t = now()
            seconds = t - start
        else:
            seconds = as_float(
                step_cost(rec.num_batched_tokens, rec.num_kv_tokens), "step_cost(...)", min=0.0
            )
            t = start + seconds
        steps.append(replace(rec, start=start, seconds=seconds))
        for rid in first:
            records[rid].first_token = t
        for o in finished:
            r = records[o.request_id]
            r.finish, r.output_len, r.finish_reason = t, len(o.output_token_ids), o.finish_reason
            if r.first_token is None:
                r.first_token = t
        stalled = 0 if (rec.num_generated or finished) else stalled + 1
        if stalled >= stall_steps:
            left = [r for r in records.values() if not r.finished]
            oldest = min(left, key=lambda r: (r.arrival, r.request_id)) if left else None
            who = (
                f"{_describe(oldest, engine)} is the oldest unfinished"
                if oldest
                else "no request is unfinished"
            )
            raise EngineStateError(
                f"serving made no progress in {stalled} engine steps (no token sampled, nothing finished) at "
                f"t={t:.3f} s: {who}; "
                f"{len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting"
            )
    for r in records.values():  # cut off: keep how far each unfinished one got
        if not r.finished:
            r.output_len = meter.seen_len.get(r.request_id, r.output_len)
    ordered = [records[k] for k in sorted(records)]
    return ServingRun(ordered, steps, clock, t, cut, engine.num_preemptions - preempted_before)


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
    one_of(policy, "policy", POLICIES)
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

    @property
    def mean_normalized_latency(self) -> float:
        return self.metrics.normalized_latency.mean


def rate_sweep(
    model,
    rates: Sequence[float] | None = None,
    *,
    workload: str = "sharegpt",
    policies: Sequence[str] = POLICIES,
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

    The trace is drawn once at the highest rate and stretched for the lower ones (same requests, only
    the arrival rate changes). A run stops at max_time_factor * duration (its means are then lower
    bounds). With stop_past_threshold a policy stops at the first rate whose mean normalized latency
    exceeds `factor` times its value at the lowest rate: higher rates would only be slower.
    on_point(point) and on_run(run, point) are called after each run; keep_going() (e.g. a time budget)
    is asked before each run and False stops the sweep.
    """
    one_of(workload, "workload", tuple(RATE_GRID))
    scale = as_int(scale, "scale", min=1, max=FULL_MAX_MODEL_LEN // 2)
    if rates is None:
        rates = [r * scale for r in RATE_GRID[workload]]
    rates = sorted(as_float(r, "rate", min=1e-9) for r in rates)
    if not rates:
        raise InvalidArgumentError("rates must hold at least one request rate, got none")
    for p in policies:
        one_of(p, "policy", POLICIES)
    duration = as_float(duration, "duration", min=1e-9)
    factor = as_float(factor, "factor", min=1.0)
    max_time_factor = as_float(max_time_factor, "max_time_factor", min=1.0)
    max_len = FULL_MAX_MODEL_LEN // scale
    vocab = model.config.vocab_size
    base = make_trace(
        rates[-1], duration, workload, max_model_len=max_len, scale=scale, vocab_size=vocab, seed=seed
    )
    points = []
    for policy in policies:
        first = None
        for rate in rates:
            trace = at_rate(base, rate, rates[-1], duration)
            if not trace:
                continue
            if keep_going is not None and not keep_going():
                return points
            engine = engine_at_scale(model, policy, scale)
            run = serve(engine, trace, clock=clock, step_cost=step_cost, max_time=max_time_factor * duration)
            m = summarize(run)
            pt = SweepPoint(
                workload, policy, rate, m, run.mean_batch, run.num_preemptions, len(run.steps), run.end
            )
            points.append(pt)
            if on_point is not None:
                on_point(pt)
            if on_run is not None:
                on_run(run, pt)
            first = pt.mean_normalized_latency if first is None else first
            if stop_past_threshold and pt.mean_normalized_latency > factor * first:
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
    for p in points:
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

"""The engine under load: requests that arrive over time, the latency each one sees, and the highest
request rate a policy sustains.

    trace = make_trace(rate=4.0, duration=30.0, workload="sharegpt")     # seeded Poisson arrivals
    run = serve(engine, trace)                                           # simulated clock (default)
    print(format_metrics(summarize(run)))

Arrivals (`vllmini.course.arrivals`) are a Poisson process (exponential gaps with mean 1 / rate); lengths
come from `vllmini.course.memory.sample_requests` (ShareGPT-like or Alpaca-like, the paper's means).
`serve` admits each request when the clock reaches its arrival and steps the REAL engine (its scheduler,
preemption and KV pool), recording per request: arrival, first token, finish, tokens. Two clocks:

  "wall"       seconds measured around each step (on a GPU: the real thing).
  "simulated"  each step costs step_seconds = a + b * (tokens in the batch) + c * (KV tokens read),
               `StepCost`, fitted to step times recorded on a GPU (`H200_STEP_COST`): a model of the GPU's
               time, deterministic, that a CPU runs in a fraction of it. Only time is modelled: batching,
               preemption and memory are the engine's own. (A tiny model on a CPU runs ~10x faster with
               torch.set_num_threads(1).)

Metrics follow the PagedAttention paper (Kwon et al., SOSP 2023, Sec. 6): normalized latency = a
request's end-to-end latency divided by its output length, averaged over requests; plus time to first
token (TTFT), time per output token after the first (TPOT, as vLLM's benchmark_serving.py) and
throughput: `summarize` in `vllmini.course.latency`. There `rate_sweep` runs the same trace, time-scaled,
at several rates for the static / oracle / paged policies on one KV budget, and `sustained_rate` finds the
highest rate at which a policy's mean normalized latency stays below `factor` (5) times its value at the
lowest rate (Fig. 12 of the paper).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vllmini.checks import as_float, as_int, one_of
from vllmini.course.arrivals import TimedRequest
from vllmini.engine import LLMEngine
from vllmini.errors import EngineStateError, InvalidArgumentError, InvalidTypeError
from vllmini.outputs import RequestOutput
from vllmini.sampling import SamplingParams

__all__ = [
    "CLOCKS", "H200_STEP_COST", "RequestRecord", "ServingRun", "StepCost", "StepMeter", "StepRecord", "serve",
]  # fmt: skip

CLOCKS = ("simulated", "wall")


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
# Those steps ran eagerly; with the CUDA graphs the engine now uses on a GPU, the same fit gives about
# 2.2 ms + 0.145 ms per token (benchmarks/RESULTS.md): this clock models the eager engine.
H200_STEP_COST = StepCost(fixed=1.259e-2, per_token=7.737e-5, per_kv_token=0.0)


# -----------------------------------------------------------------------------
# watching the engine step


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did (from its StepStats), and when it ran on the serving clock."""

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
    """Runs `engine.step()` and reads what it did from the `StepStats` the engine records for it
    (vllmini.outputs); which requests got their first token, which StepStats does not keep, comes from
    their output lengths."""

    def __init__(self, engine: LLMEngine):
        if not isinstance(engine, LLMEngine):
            raise InvalidTypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
        self.engine = engine
        self.seen_len: dict[int, int] = {}  # request id -> output tokens it had after the last step

    def step(self) -> tuple[list[RequestOutput], StepRecord, list[int]]:
        """One engine step: (finished outputs, its StepRecord with start=seconds=0, ids that got their
        first token in it)."""
        num_forwards = self.engine.num_forwards
        finished = self.engine.step()
        now = {s.request_id: len(s.output_token_ids) for s in self.engine.scheduler.running}
        now |= {o.request_id: len(o.output_token_ids) for o in finished}
        first = [rid for rid, n in now.items() if n and not self.seen_len.get(rid)]
        self.seen_len |= now
        for o in finished:
            self.seen_len.pop(o.request_id, None)
        if self.engine.num_forwards == num_forwards:  # nothing ran (only aborted requests came back)
            return finished, StepRecord(0.0, 0.0, 0, 0, 0, 0, 0), first
        st = self.engine.stats[-1]
        batched = st.num_prefill_tokens + st.num_decodes  # a decode computes its one new token
        record = StepRecord(
            0.0, 0.0, st.num_prefills, st.num_decodes, batched, st.num_tokens, st.num_generated
        )
        return finished, record, first


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


def _check_serve_args(engine, trace, clock, step_cost, max_time, stall_steps) -> tuple[float | None, int]:
    """serve()'s arguments checked; returns (max_time, stall_steps) cleaned."""
    if not isinstance(engine, LLMEngine):
        raise InvalidTypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
    one_of(clock, "clock", CLOCKS)
    if not callable(step_cost):
        raise InvalidTypeError(f"step_cost must be a StepCost or a callable, got {type(step_cost).__name__}")
    if max_time is not None:
        max_time = as_float(max_time, "max_time", min=0.0)
    for k, q in enumerate(trace):
        if not isinstance(q, TimedRequest):
            raise InvalidTypeError(f"trace[{k}] must be a TimedRequest, got {type(q).__name__}")
        as_float(q.arrival, f"trace[{k}].arrival", min=0.0)
    if engine.has_unfinished_requests():
        raise EngineStateError("serve() needs an idle engine: it has unfinished requests")
    return max_time, as_int(stall_steps, "stall_steps", min=1)


def _admit(engine: LLMEngine, q: TimedRequest, t: float, records: dict) -> None:
    """Hand an arrived request to the engine and start its record."""
    params = SamplingParams(max_tokens=q.output_len, ignore_eos=True)
    rid = engine.add_request(list(q.prompt_token_ids), params)
    records[rid] = RequestRecord(rid, q.arrival, len(q.prompt_token_ids), q.output_len, admitted=t)


def _timed_step(meter: StepMeter, clock: str, step_cost, start: float, now: Callable[[], float]) -> tuple:
    """One engine step that starts at `start` on the serving clock: (finished outputs, its StepRecord
    with start and seconds, ids that got their first token, the clock when it ended). Its seconds are
    measured ("wall": now() after the step) or modelled (step_cost of its tokens)."""
    finished, rec, first = meter.step()
    if clock == "wall":
        t = now()
        seconds = t - start
    else:
        seconds = as_float(step_cost(rec.num_batched_tokens, rec.num_kv_tokens), "step_cost(...)", min=0.0)
        t = start + seconds
    return finished, replace(rec, start=start, seconds=seconds), first, t


def _record_tokens(records: dict, first: list[int], finished: list[RequestOutput], t: float) -> None:
    """A step that ended at t: first tokens and finished requests noted in their records."""
    for rid in first:
        records[rid].first_token = t
    for o in finished:
        r = records[o.request_id]
        r.finish, r.output_len, r.finish_reason = t, len(o.output_token_ids), o.finish_reason
        if r.first_token is None:
            r.first_token = t


def _stall_error(engine: LLMEngine, records: dict, stalled: int, t: float) -> EngineStateError:
    """The no-progress error, naming the oldest unfinished request and where it is."""
    left = [r for r in records.values() if not r.finished]
    oldest = min(left, key=lambda r: (r.arrival, r.request_id)) if left else None
    who = f"{_describe(oldest, engine)} is the oldest unfinished" if oldest else "no request is unfinished"
    return EngineStateError(
        f"serving made no progress in {stalled} engine steps (no token sampled, nothing finished) at "
        f"t={t:.3f} s: {who}; "
        f"{len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting"
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
    max_time, stall_steps = _check_serve_args(engine, trace, clock, step_cost, max_time, stall_steps)

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
            _admit(engine, trace[order[nxt]], t, records)
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
        finished, rec, first, t = _timed_step(meter, clock, step_cost, t, now)
        steps.append(rec)
        _record_tokens(records, first, finished, t)
        stalled = 0 if (rec.num_generated or finished) else stalled + 1
        if stalled >= stall_steps:
            raise _stall_error(engine, records, stalled, t)
    for r in records.values():  # cut off: keep how far each unfinished one got
        if not r.finished:
            r.output_len = meter.seen_len.get(r.request_id, r.output_len)
    ordered = [records[k] for k in sorted(records)]
    return ServingRun(ordered, steps, clock, t, cut, engine.num_preemptions - preempted_before)

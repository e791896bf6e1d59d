"""Requests that arrive over time: a seeded Poisson arrival process over the ShareGPT-like and Alpaca-like
length samplers of `vllmini.course.memory`, as a trace of TimedRequests that `vllmini.course.serving.serve`
replays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from vllmini.checks import as_float, as_int, one_of
from vllmini.course.memory import WORKLOADS, sample_requests
from vllmini.errors import InvalidArgumentError


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
    for prompt, output in sample_requests(n, workload, max_model_len * scale, as_int(seed, "seed", min=0)):
        prompt = min(max(1, round(prompt / scale)), max_model_len - 1)
        output = min(max(1, round(output / scale)), max_model_len - prompt)
        out.append((prompt, output))
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

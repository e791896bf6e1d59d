"""Tests for vllmini.course's arrivals, serving and latency: Poisson arrivals, the serving loop on the real
engine, the metrics, the step-cost model, and the latency-vs-rate sweep (static must sustain a lower rate
than paging)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vllmini import LlamaConfig, LlamaModel
from vllmini.course.arrivals import TimedRequest, at_rate, make_trace, poisson_arrivals
from vllmini.course.latency import (
    SweepPoint,
    engine_at_scale,
    format_metrics,
    format_sweep,
    rate_sweep,
    summarize,
    sustained_rate,
)
from vllmini.course.serving import H200_STEP_COST, RequestRecord, ServingRun, StepCost, serve
from vllmini.errors import EngineStateError, InvalidArgumentError, InvalidTypeError

RECORDED = Path(__file__).resolve().parents[1] / "benchmarks" / "recorded" / "engine_step_times.json"
SCALE = 8  # notebook 06's scale: max_model_len 256, 1,920 KV slots, block size 2


TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other (10x slower on 2 cores)
    torch.manual_seed(0)
    yield LlamaModel(LlamaConfig(**TINY)).eval()
    torch.set_num_threads(threads)


# -----------------------------------------------------------------------------
# arrivals


def test_poisson_arrivals_are_seeded_and_have_the_mean_rate():
    a = poisson_arrivals(3.5, num_requests=20000, seed=7)
    assert np.array_equal(a, poisson_arrivals(3.5, num_requests=20000, seed=7))
    assert not np.array_equal(a, poisson_arrivals(3.5, num_requests=20000, seed=8))
    assert a.dtype == np.float64 and (np.diff(a) > 0).all() and a[0] > 0
    gaps = np.diff(np.concatenate([[0.0], a]))
    # 20,000 exponential gaps: the mean is off by 1/sqrt(20000) = 0.7% (one sd); 3% is > 4 sd
    assert abs(len(a) / a[-1] / 3.5 - 1) < 0.03
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: sd == mean
    # counts in windows of one second are Poisson(3.5): variance == mean
    counts = np.bincount(a.astype(int))[:-1]
    assert abs(counts.mean() / 3.5 - 1) < 0.03 and abs(counts.var() / counts.mean() - 1) < 0.1


def test_poisson_arrivals_by_duration_and_at_another_rate():
    by_n = poisson_arrivals(2.0, num_requests=5000, seed=3)
    by_t = poisson_arrivals(2.0, duration=1000.0, seed=3)
    assert (by_t < 1000.0).all() and by_n[len(by_t)] >= 1000.0  # every arrival before the end, no more
    assert np.array_equal(by_t, by_n[: len(by_t)])  # the same stream, cut at the duration
    assert abs(len(by_t) - 2000) < 5 * math.sqrt(2000)
    assert np.allclose(poisson_arrivals(4.0, num_requests=5000, seed=3), by_n / 2, rtol=1e-12)
    assert len(poisson_arrivals(1.0, duration=0.0)) == 0


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(rate=0.0, num_requests=3), InvalidArgumentError),
        (dict(rate=-1.0, num_requests=3), InvalidArgumentError),
        (dict(rate=True, num_requests=3), InvalidTypeError),
        (dict(rate=1.0), InvalidArgumentError),
        (dict(rate=1.0, num_requests=3, duration=1.0), InvalidArgumentError),
        (dict(rate=1.0, num_requests=2.5), InvalidTypeError),
        (dict(rate=1.0, duration=float("inf")), InvalidArgumentError),
    ],
)
def test_poisson_arrivals_rejects_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        poisson_arrivals(**kwargs)


def test_make_trace_is_seeded_and_fits_the_model():
    t = make_trace(5.0, 20.0, "sharegpt", max_model_len=256, scale=SCALE, vocab_size=64, seed=1)
    assert t == make_trace(5.0, 20.0, "sharegpt", max_model_len=256, scale=SCALE, vocab_size=64, seed=1)
    assert 60 < len(t) < 140  # Poisson(100)
    assert all(0 <= q.arrival < 20.0 for q in t) and [q.arrival for q in t] == sorted(q.arrival for q in t)
    assert all(len(q.prompt_token_ids) + q.output_len <= 256 and q.output_len >= 1 for q in t)
    assert all(0 <= x < 64 for q in t for x in q.prompt_token_ids)
    slower = at_rate(t, 2.5, 5.0, 20.0)  # half the rate: the first half of the requests, twice as spread
    assert [q.prompt_token_ids for q in slower] == [q.prompt_token_ids for q in t[: len(slower)]]
    assert all(s.arrival == pytest.approx(2 * q.arrival) for s, q in zip(slower, t, strict=False))
    assert len(slower) == sum(q.arrival < 10.0 for q in t)


# -----------------------------------------------------------------------------
# metrics on a hand-made trace


def percentile(values, q):
    """Linear interpolation between order statistics, written out (numpy's default method)."""
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = math.floor(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def hand_records():
    # (arrival, first token, finish, output tokens)
    rows = [(0.0, 0.5, 2.5, 5), (1.0, 1.25, 1.25, 1), (1.5, 3.5, 9.5, 13), (2.0, 2.2, 4.2, 11)]
    return [
        RequestRecord(i, a, prompt_len=3, max_tokens=n, admitted=a, first_token=f, finish=e, output_len=n)
        for i, (a, f, e, n) in enumerate(rows)
    ]


def test_metrics_on_a_hand_made_trace():
    recs = hand_records()
    m = summarize(recs)
    norm = [2.5 / 5, 0.25 / 1, 8.0 / 13, 2.2 / 11]  # (finish - arrival) / output tokens
    ttft = [0.5, 0.25, 2.0, 0.2]
    tpot = [2.0 / 4, 6.0 / 12, 2.0 / 10]  # (finish - first) / (n - 1); the one-token request has none
    assert m.normalized_latency.mean == pytest.approx(sum(norm) / 4, rel=1e-12)
    assert m.ttft.mean == pytest.approx(sum(ttft) / 4, rel=1e-12)
    assert m.tpot.mean == pytest.approx(sum(tpot) / 3, rel=1e-12)
    assert m.latency.mean == pytest.approx((2.5 + 0.25 + 8.0 + 2.2) / 4, rel=1e-12)
    for q, attr in ((50, "p50"), (90, "p90"), (99, "p99")):
        assert getattr(m.normalized_latency, attr) == pytest.approx(percentile(norm, q), rel=1e-12)
        assert getattr(m.ttft, attr) == pytest.approx(percentile(ttft, q), rel=1e-12)
        assert getattr(m.tpot, attr) == pytest.approx(percentile(tpot, q), rel=1e-12)
    assert m.duration == 9.5 and m.num_finished == m.num_requests == 4 and m.complete
    assert m.request_throughput == pytest.approx(4 / 9.5) and m.output_throughput == pytest.approx(30 / 9.5)
    text = format_metrics(m)
    assert "normalized latency" in text and "4/4 requests finished" in text


def test_a_cut_off_run_gives_lower_bounds():
    recs = hand_records()
    recs[2].finish, recs[2].output_len = None, 4  # request 2 had 4 of 13 tokens at the cut-off (t = 6)
    with pytest.raises(InvalidArgumentError, match="request 2"):
        summarize(recs)
    run = ServingRun(recs, [], "simulated", end=6.0, cut_off=True)
    m = summarize(run)
    assert not m.complete and m.num_finished == 3
    assert m.normalized_latency.mean == pytest.approx((0.5 + 0.25 + 4.5 / 13 + 0.2) / 4, rel=1e-12)
    assert m.duration == 6.0 and m.output_throughput == pytest.approx((5 + 1 + 4 + 11) / 6.0)


# -----------------------------------------------------------------------------
# the serving loop on the real engine


def test_serve_admits_on_arrival_and_finishes_every_request(model):
    trace = make_trace(40.0, 1.0, "sharegpt", max_model_len=256, scale=SCALE, vocab_size=64, seed=2)
    engine = engine_at_scale(model, "paged", SCALE)
    added_before_step = []  # engine steps already run when each request was handed over
    add = engine.add_request

    def spy(prompt, params):
        added_before_step.append(len(engine.stats))
        return add(prompt, params)

    engine.add_request = spy
    run = serve(engine, trace)
    assert len(run.records) == len(trace) and not run.cut_off
    assert len(run.steps) == len(engine.stats) and not engine.has_unfinished_requests()
    for q, rec, k in zip(trace, run.records, added_before_step, strict=True):
        assert rec.arrival == q.arrival and rec.finished and rec.output_len == q.output_len
        assert run.steps[k].start >= q.arrival  # the first step it could be in starts after it arrived
        assert k == 0 or run.steps[k - 1].start < q.arrival  # ... and it was not held back
        assert q.arrival < rec.first_token <= rec.finish
    # the meter counts what the engine's own statistics say the step did
    for s, st in zip(run.steps, engine.stats, strict=True):
        assert (s.num_prefills, s.num_decodes, s.num_kv_tokens) == (
            st.num_prefills,
            st.num_decodes,
            st.num_tokens,
        )
        assert s.seconds == pytest.approx(H200_STEP_COST(s.num_batched_tokens, s.num_kv_tokens), rel=1e-12)
    busy = sum(s.seconds for s in run.steps)
    assert busy <= run.end and run.end == pytest.approx(run.steps[-1].start + run.steps[-1].seconds)
    again = serve(engine_at_scale(model, "paged", SCALE), trace)  # deterministic: the same records again
    assert again.records == run.records and again.steps == run.steps
    # a prompt of n tokens admitted alone and never preempted: n tokens in its prefill
    assert run.steps[0].num_batched_tokens == sum(
        len(q.prompt_token_ids) for q in trace if q.arrival <= run.steps[0].start
    )


def test_serve_on_the_wall_clock(model):
    trace = [TimedRequest(0.02 * i, (1, 2, 3), 4) for i in range(6)]
    run = serve(engine_at_scale(model, "static", SCALE), trace, clock="wall")
    assert all(r.finished and r.output_len == 4 for r in run.records)
    assert all(r.admitted >= r.arrival for r in run.records)
    assert all(s.seconds > 0 for s in run.steps) and run.end >= 0.1


@pytest.mark.gpu
def test_serve_on_a_gpu_by_the_wall_clock():
    torch.manual_seed(0)
    with torch.device("cuda"):
        gpu_model = LlamaModel(LlamaConfig(**TINY)).eval()
    trace = make_trace(40.0, 0.5, "sharegpt", max_model_len=256, scale=SCALE, vocab_size=64, seed=5)
    engine = engine_at_scale(gpu_model, "paged", SCALE)
    run = serve(engine, trace, clock="wall")
    assert engine.model.device.type == "cuda" and len(run.records) == len(trace) > 5
    assert all(r.finished and r.output_len == r.max_tokens and r.admitted >= r.arrival for r in run.records)
    assert all(r.arrival < r.first_token <= r.finish <= run.end for r in run.records)
    assert all(s.seconds > 0 for s in run.steps) and summarize(run).complete


def test_serve_cut_off_keeps_partial_progress(model):
    trace = make_trace(100.0, 0.5, "sharegpt", max_model_len=256, scale=SCALE, vocab_size=64, seed=4)
    run = serve(engine_at_scale(model, "static", SCALE), trace, max_time=0.5)
    assert run.cut_off and run.end >= 0.5
    left = [r for r in run.records if not r.finished]
    assert left and any(r.output_len > 0 for r in left) and all(r.output_len < r.max_tokens for r in left)
    assert not summarize(run).complete


def test_no_progress_raises_naming_the_request(model):
    engine = engine_at_scale(model, "paged", SCALE)
    engine.step = lambda: []  # an engine that never gets anywhere
    trace = [TimedRequest(0.0, (5, 6, 7), 3), TimedRequest(0.1, (8,), 2)]
    with pytest.raises(
        EngineStateError, match=r"no progress in 5 engine steps.*request 0 \(arrived at 0.000 s"
    ):
        serve(engine, trace, stall_steps=5)


def test_serve_rejects_bad_arguments(model):
    engine = engine_at_scale(model, "paged", SCALE)
    with pytest.raises(InvalidArgumentError, match="clock"):
        serve(engine, [], clock="cpu")
    with pytest.raises(InvalidTypeError, match=r"trace\[0\]"):
        serve(engine, [(0.0, [1], 2)])
    with pytest.raises(InvalidArgumentError, match="arrival"):
        serve(engine, [TimedRequest(-1.0, (1,), 2)])
    with pytest.raises(InvalidTypeError, match="engine"):
        serve(object(), [])
    engine.add_request([1, 2], None)
    with pytest.raises(EngineStateError, match="idle"):
        serve(engine, [])


# -----------------------------------------------------------------------------
# the step-cost model


def test_step_cost_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    tokens, kv = rng.integers(1, 300, 50), rng.integers(0, 20000, 50)
    true = StepCost(0.01, 5e-5, 2e-7)
    fit = StepCost.fit(tokens, kv, [true(t, k) for t, k in zip(tokens, kv, strict=True)])
    assert fit.fixed == pytest.approx(0.01, rel=1e-9) and fit.per_token == pytest.approx(5e-5, rel=1e-9)
    assert fit.per_kv_token == pytest.approx(2e-7, rel=1e-9)
    # a least-squares slope that would be negative is clamped to 0 and the others refit
    fit = StepCost.fit([1, 2, 3, 4], [0, 0, 0, 0], [0.4, 0.3, 0.2, 0.1])
    assert fit.per_token == 0.0 and fit.fixed == pytest.approx(0.25)
    with pytest.raises(InvalidArgumentError):
        StepCost(-1.0, 0.0, 0.0)
    with pytest.raises(InvalidArgumentError, match="equal-length"):
        StepCost.fit([1, 2, 3], [1, 2], [1, 2, 3])


def test_h200_step_cost_is_the_fit_to_the_recorded_step_times():
    doc = json.loads(RECORDED.read_text())
    runs = doc["runs"]
    assert doc["gpu"] and doc["date"] and doc["source"] and len(runs) >= 6
    for r in runs:  # each mean step time is the recorded tokens/s at the replayed batch
        if r["steps"] == 480:  # the 600-step runs, 120 not timed: tokens per step == batch
            assert r["mean_step_seconds"] == pytest.approx(r["mean_batch"] / r["tokens_per_s"], rel=1e-3)
    fit = StepCost.fit(
        *([r[k] for r in runs] for k in ("mean_batched_tokens", "mean_kv_tokens", "mean_step_seconds"))
    )
    for name in ("fixed", "per_token", "per_kv_token"):
        assert getattr(H200_STEP_COST, name) == pytest.approx(getattr(fit, name), rel=1e-3, abs=1e-12)


# -----------------------------------------------------------------------------
# latency against rate


def point(policy, rate, latency):
    m = summarize([RequestRecord(0, 0.0, 1, 1, 0.0, latency, latency, 1)])
    return SweepPoint("sharegpt", policy, rate, m, 1.0, 0, 1, latency)


def test_sustained_rate_interpolates_the_crossing():
    pts = [point("paged", 1.0, 0.01), point("paged", 2.0, 0.02), point("paged", 4.0, 0.09)]
    s = sustained_rate(pts, "paged", factor=5.0)  # threshold 0.05: crossed between 2 (0.02) and 4 (0.09)
    assert s.crossed and s.threshold == pytest.approx(0.05) and s.rate == pytest.approx(2.0 + 2.0 * 3 / 7)
    s = sustained_rate(pts[:2], "paged")
    assert not s.crossed and s.rate == 2.0
    with pytest.raises(InvalidArgumentError, match="static"):
        sustained_rate(pts, "static")


def test_static_sustains_a_lower_rate_than_paging(model):
    """A small deterministic sweep (notebook 06's scale): paging keeps up at a rate that swamps static."""
    rates = (6.0, 40.0, 100.0)
    pts = rate_sweep(model, rates, policies=("static", "paged"), scale=SCALE, duration=3.0, seed=0)
    by = {(p.policy, p.rate): p for p in pts}
    assert sorted(by) == [
        ("paged", 6.0),
        ("paged", 40.0),
        ("paged", 100.0),
        ("static", 6.0),
        ("static", 40.0),
    ]
    static, paged = sustained_rate(pts, "static"), sustained_rate(pts, "paged")
    assert static.crossed and 6.0 < static.rate < 40.0 and static.rate < paged.rate
    # unloaded, the policies agree; at 40/s static queues (TTFT) while paging runs a larger batch
    low = by["static", 6.0].metrics.normalized_latency.mean
    assert low == pytest.approx(by["paged", 6.0].metrics.normalized_latency.mean, rel=0.05)
    assert by["static", 40.0].metrics.ttft.p50 > 10 * by["paged", 40.0].metrics.ttft.p50
    assert by["paged", 40.0].mean_batch > 1.5 * by["static", 40.0].mean_batch
    text = format_sweep(pts)
    assert "paged / static" in text and "highest rate sustained" in text
    assert [p.policy for p in pts[:4]] == ["static", "paged"] * 2  # rate by rate, every policy in turn
    runs = []  # a budget that allows three runs: the third is static's second rate, paged is not behind
    cut = rate_sweep(model, rates, policies=("static", "paged"), scale=SCALE, duration=3.0, seed=0,
                     keep_going=lambda: len(runs) < 3, on_point=runs.append)  # fmt: skip
    assert [(p.policy, p.rate) for p in cut] == [("static", 6.0), ("paged", 6.0), ("static", 40.0)]


def test_plot_latency_vs_rate():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllmini.course.serving_plots import plot_latency_vs_rate

    pts = [point("static", 1.0, 0.01), point("static", 2.0, 0.08), point("paged", 1.0, 0.01)]
    pts.append(point("paged", 4.0, 0.02))
    ax = plot_latency_vs_rate(pts)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["static: sustains 1.57 requests/s", "paged: sustains >= 4 requests/s"]
    assert ax.get_yscale() == "log" and "normalized latency" in ax.get_ylabel()
    plt.close("all")

"""Reliability, third round: a step whose commit fails is undone (and redone by the next step), non-finite
logits end any request with "error", the loader reads only inside the checkpoint, bad inputs are refused
with a VllminiError and change nothing, and memory stays bounded.

Faults are injected into the calls a step's commit makes (marking tokens computed, finishing, retiring,
freeing, naming blocks in the prefix cache, building outputs), one and several per run, on a workload
with preemption, n > 1, prefix caching, chunked prefill and streaming; every run must give the clean
run's tokens, return each request once, never exceed max_tokens, and end with every block in the pool.

The tests reach the package through its top-level names and their methods; the few internals a fault
is injected into are looked up in one place, `commit_sites` (and the explorer in `explorer_import`).
"""

import gc
import json
import math
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from vllmini import (
    BlockAllocator,
    BlockIdError,
    BlockManager,
    BlockTable,
    CheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    LlamaModel,
    LLMEngine,
    PagedKVCache,
    SamplingParams,
    Sequence,
    VllminiError,
)

transformers = pytest.importorskip("transformers")
from llama_cases import random_hf_model  # noqa: E402 (needs transformers)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model runs fastest on one thread (and a busy 2-core machine does not slow it down)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -----------------------------------------------------------------------------
# the internals faults are injected into: the one place to update when the package renames them


def commit_sites(engine) -> dict[str, tuple[object, str]]:
    """The calls a step's commit makes, as (object, method name): patched on the instance, so the
    scheduler's and the engine's own calls go through the fault."""
    sched = engine.scheduler
    bm = sched.block_manager
    return {
        "mark_computed": (sched, "mark_computed"),  # the prompt chunk / sampled token is in the cache
        "finish": (sched, "finish"),
        "retire": (sched, "_retire"),  # takes a sequence out of the queues (finish and abort)
        "free": (bm, "free"),
        "prefix_cache_insert": (bm, "cache_full_blocks"),  # names filled blocks by their hash
        "finish_reason": (engine.outputs, "finish_reason"),  # output building: why a sequence stops
        "output": (engine.outputs, "output"),  # output building: the RequestOutput
    }


def explorer_import() -> str:
    """The import line of the page-table explorer (it moves to vllmini.course)."""
    return "from vllmini.course.explorer import PageTableExplorer"


# -----------------------------------------------------------------------------
# the fault injector and the workload


class InjectedFault(RuntimeError):
    pass


class Call:
    """What a fault plan sees of one call: its site, its number over the run and within this step
    attempt (from 1), the steps committed so far, and whether the previous attempt failed."""

    def __init__(self, site, total, in_attempt, step, retry):
        self.site, self.total, self.in_attempt, self.step, self.retry = site, total, in_attempt, step, retry


class Faults:
    """Raises in the calls `plan(call)` picks (before or after the real call runs), at most once per
    step attempt. Counts every call of every site."""

    def __init__(self, engine, plan=None, error=InjectedFault, when="before", sites=None):
        self.engine, self.plan, self.error, self.when = engine, plan, error, when
        self.sites = commit_sites(engine) if sites is None else sites
        self.total = dict.fromkeys(self.sites, 0)
        self.in_attempt = dict.fromkeys(self.sites, 0)
        self.step, self.retry, self.raised, self.fired = 0, False, 0, False
        self.enabled = True  # False: count calls, raise nothing

    def new_attempt(self, step: int, retry: bool) -> None:
        self.step, self.retry, self.fired = step, retry, False
        self.in_attempt = dict.fromkeys(self.sites, 0)

    def _wrap(self, site, original):
        def call(*args, **kwargs):
            self.total[site] += 1
            self.in_attempt[site] += 1
            c = Call(site, self.total[site], self.in_attempt[site], self.step, self.retry)
            fire = self.enabled and self.plan is not None and not self.fired and self.plan(c)
            if fire and self.when == "before":
                self._fire(site)
            result = original(*args, **kwargs)
            if fire:
                self._fire(site)
            return result

        return call

    def _fire(self, site):
        self.fired = True
        self.raised += 1
        raise self.error(f"injected into {site}")

    def __enter__(self):
        self._own = []  # what each patched instance held before: its own attribute, or nothing
        for site, (obj, name) in self.sites.items():
            self._own.append((obj, name, obj.__dict__.get(name)))
            setattr(obj, name, self._wrap(site, getattr(obj, name)))
        return self

    def __exit__(self, *exc):
        for obj, name, own in self._own:  # (the model is shared by the module's tests)
            if own is None:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = own


def engine_state(engine) -> dict:
    """Everything a step changes that a caller can see: queues, each sequence's progress and generator,
    page tables, free blocks, counters."""
    sched = engine.scheduler
    bm = sched.block_manager
    return {
        "waiting": [s.seq_id for s in sched.waiting],
        "running": [s.seq_id for s in sched.running],
        "sequences": {
            s.seq_id: (
                s.status.name,
                s.num_computed_tokens,
                list(s.output_token_ids),
                len(s.output_logprobs),
                s.num_preemptions,
                s.finish_reason,
                s.stop_reason,
                s.num_streamed,
                hash(s.generator.get_state().numpy().tobytes()),
            )
            for s in [*sched.waiting, *sched.running]
        },  # fmt: skip
        "page tables": {sid: (bm.block_table(sid).block_ids, bm.seq_len(sid)) for sid in bm.seq_ids},
        "free blocks": bm.num_free_blocks,
        "preemptions": sched.num_preemptions,
        "forwards": engine.num_forwards,
        "unfinished": engine.has_unfinished_requests(),
    }


def assert_unchanged(before: dict, after: dict) -> None:
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not changed, f"a failed step changed the engine (before, after): {changed}"


def assert_pool_empty(engine) -> None:
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests()
    assert len(bm) == 0, f"sequences left in the block manager: {bm.seq_ids}"
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"


def drive(engine, waves, faults=None, errors=(InjectedFault,), max_attempts=2000) -> tuple[dict, int]:
    """Add `waves` [(after this many committed steps, [(prompt, params), ...]), ...] and step until
    done. A step that raises one of `errors` must leave the engine as it was, and is retried (the fault
    plan is told so). Returns {request_id: [its outputs, in order]} and the number of failed steps."""
    waves, outputs, failures, step, attempts = list(waves), {}, 0, 0, 0
    retry = False
    while waves or engine.has_unfinished_requests():
        while waves and waves[0][0] <= step:
            for prompt, params in waves.pop(0)[1]:
                engine.add_request(prompt, params)
        attempts += 1
        assert attempts <= max_attempts, "the engine makes no progress"
        if faults is not None:
            faults.new_attempt(step, retry)
        before = engine_state(engine)
        try:
            done = engine.step()
        except errors:
            failures += 1
            retry = True
            assert_unchanged(before, engine_state(engine))
            continue
        retry = False
        step += 1
        for o in done:
            got = outputs.setdefault(o.request_id, [])
            assert not (got and got[-1].finished), f"request {o.request_id} came back after it finished"
            got.append(o)
    return outputs, failures


def final_tokens(outputs: dict, waves) -> dict:
    """{request_id: [(tokens, finish_reason, error) per sample]}: streamed deltas put together; checks
    each request finished once and no sample got more than its max_tokens."""
    params = [p for _, wave in waves for _, p in wave]
    assert sorted(outputs) == list(range(len(params))), "a request was lost"
    result = {}
    for rid, outs in outputs.items():
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        p = params[rid]
        samples = {}
        for o in outs:
            for c in o.outputs:
                tokens = samples.setdefault(c.index, [])
                if p.output_kind == "delta":
                    tokens += c.token_ids
                else:
                    tokens[:] = c.token_ids
                assert len(tokens) <= p.max_tokens, f"request {rid} got {len(tokens)} > {p.max_tokens} tokens"
        assert sorted(samples) == list(range(p.n))
        ends = {c.index: (c.finish_reason, c.error) for c in outs[-1].outputs}
        result[rid] = [(samples[i], *ends[i]) for i in range(p.n)]
    return result


def _prompts():
    g = torch.Generator().manual_seed(28)
    base = torch.randint(3, 128, (17,), generator=g).tolist()
    other = torch.randint(3, 128, (9,), generator=g).tolist()
    return base, other


def workload() -> list:
    """Two waves of requests: greedy, sampled (seeded, and seeded by the engine), n = 2 and 3, shared
    prefixes (prefix-cache hits), a prompt longer than the token budget (chunked), streaming."""
    base, other = _prompts()
    sp = SamplingParams
    first = [
        (base[:11], sp(max_tokens=6, ignore_eos=True)),
        (base[:8] + other[:3], sp(n=3, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)),
        (other[:5], sp(max_tokens=7, temperature=0.7, ignore_eos=True, stop_token_ids=[other[0]])),
    ]
    second = [
        (base[:11], sp(n=2, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True, output_kind="delta")),
        (base, sp(max_tokens=5, ignore_eos=True, output_kind="cumulative")),
        (other[:3], sp(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)),
    ]
    return [(0, first), (3, second)]


def small_engine(model) -> LLMEngine:
    return LLMEngine(
        model, block_size=4, num_blocks=12, watermark=0.0, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_num_batched_tokens=16, seed=5,
    )  # fmt: skip


@pytest.fixture(scope="module")
def clean(model):
    """The clean run's tokens, and how often each commit site is called in it."""
    engine = small_engine(model)
    with Faults(engine) as counter:
        outputs, failures = drive(engine, workload(), counter)
    assert failures == 0
    stats = engine.stats
    assert engine.num_preemptions > 0, "the workload must preempt"
    assert sum(s.num_hit_tokens for s in stats) > 0, "the workload must hit the prefix cache"
    assert max(s.num_prefill_tokens for s in stats) == 16, "the 17-token prompt must be chunked"
    assert_pool_empty(engine)
    assert all(n > 0 for n in counter.total.values()), counter.total
    return final_tokens(outputs, workload()), dict(counter.total)


def run_with_faults(model, plan, error=InjectedFault, when="before") -> tuple[dict, Faults]:
    engine = small_engine(model)
    with Faults(engine, plan, error, when) as faults:
        outputs, failures = drive(engine, workload(), faults, errors=(error,))
    assert failures == faults.raised > 0
    assert_pool_empty(engine)
    return final_tokens(outputs, workload()), faults


SITES = ["mark_computed", "finish", "retire", "free", "prefix_cache_insert", "finish_reason", "output"]


# -----------------------------------------------------------------------------
# 1. a fault inside the commit: the step raises, changes nothing, and the next step redoes it


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("site", SITES)
def test_one_fault_at_a_commit_site(model, clean, site, when):
    """One fault at the first, a middle and the last call of each site, before or after the real call
    ran: identical tokens, every block back."""
    expected, calls = clean
    n = calls[site]
    for k in sorted({1, (n + 1) // 2, n}):
        got, _ = run_with_faults(model, lambda c, k=k: c.site == site and c.total == k, when=when)
        assert got == expected, f"fault at call {k} of {n} of {site} ({when})"


@pytest.mark.parametrize("site", SITES)
def test_a_fault_in_every_step_at_a_commit_site(model, clean, site):
    """Several faults per run: every step's first attempt fails at its r-th call of the site (r = 1, 2,
    3 over three runs, so every call of a step is hit), the retry runs clean."""
    expected, _ = clean
    for r in (1, 2, 3):
        got, faults = run_with_faults(
            model, lambda c, r=r: c.site == site and not c.retry and c.in_attempt == r
        )
        assert got == expected, f"faults at call {r} of every step of {site}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_faults_at_every_commit_site(model, clean, seed):
    """Faults at random calls of every site, several per run (MemoryError, as a real one would be)."""
    expected, _ = clean
    rng = random.Random(seed)
    got, faults = run_with_faults(model, lambda c: rng.random() < 0.1, error=MemoryError)
    assert faults.raised >= 3
    assert got == expected


def test_a_failed_step_with_a_long_queue_restores_every_sequence(model):
    """The snapshot of a step covers only the head of a long queue (what admission can reach): a step
    that fails at the very end of its commit leaves every queued and running sequence as it was."""
    engine = LLMEngine(model, block_size=4, num_blocks=24, watermark=0.0, max_num_seqs=3, seed=5)
    g = torch.Generator().manual_seed(5)
    for i in range(9):
        prompt = torch.randint(3, 128, (3 + i,), generator=g).tolist()
        params = SamplingParams(n=1 + i % 2, temperature=0.9, max_tokens=4, ignore_eos=True)
        engine.add_request(prompt, params)
    sched, commit = engine.scheduler, engine._commit

    def state():
        seqs = [*sched.waiting, *sched.running]
        return [s.seq_id for s in seqs], [(s.seq_id, s.snapshot()) for s in seqs]

    def failing_commit(*args):
        commit(*args)
        raise InjectedFault("after the whole commit")

    failed = 0
    while engine.has_unfinished_requests():
        before = state()
        if len(sched.waiting) > sched.max_num_seqs:
            engine._commit = failing_commit
            with pytest.raises(InjectedFault):
                engine.step()
            del engine._commit
            assert state() == before, "a failed step left a sequence changed"
            failed += 1
        engine.step()
    assert failed >= 3
    assert_pool_empty(engine)


def _n3_request():
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 128, (11,), generator=g).tolist()
    return prompt, SamplingParams(n=3, temperature=0.8, seed=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_memory_error_on_the_second_mark_computed_of_a_step(model, step):
    """Issue: one MemoryError on the second mark_computed of a step (n=3, max_tokens=4, an 11-token
    prompt) wedged the engine: every later step raised "slot_mapping writes slot 0 more than once"."""
    prompt, params = _n3_request()
    waves = [(0, [(prompt, params)])]
    expected = final_tokens(drive(LLMEngine(model, block_size=4, num_blocks=32), waves)[0], waves)
    engine = LLMEngine(model, block_size=4, num_blocks=32)

    def plan(c):
        return c.site == "mark_computed" and c.step == step and c.in_attempt == 2 and not c.retry

    with Faults(engine, plan, MemoryError) as faults:
        outputs, failures = drive(engine, waves, faults, errors=(MemoryError,))
    assert failures == faults.raised == 1
    assert final_tokens(outputs, waves) == expected
    assert_pool_empty(engine)


def test_a_failure_in_finish_never_gives_more_than_max_tokens(model):
    """Issue: one failure in Scheduler.finish returned 5 tokens for max_tokens=4."""
    prompt, _ = _n3_request()
    waves = [(0, [(prompt, SamplingParams(max_tokens=4, ignore_eos=True))])]
    expected = final_tokens(drive(LLMEngine(model, block_size=4, num_blocks=32), waves)[0], waves)
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    with Faults(engine, lambda c: c.site == "finish" and c.total == 1) as faults:
        outputs, failures = drive(engine, waves, faults)
    assert failures == 1
    got = final_tokens(outputs, waves)
    assert got == expected and len(got[0][0][0]) == 4
    assert_pool_empty(engine)


def _retire_fault_engine(model):
    """Two requests; freeing the blocks of the first one as it finishes (its 2nd token) fails once."""
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    prompt, _ = _n3_request()
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request(prompt[:5], SamplingParams(max_tokens=6, ignore_eos=True))
    faults = Faults(engine, lambda c: c.site == "free" and c.total == 1)
    return engine, faults


def test_a_failure_in_free_while_a_request_retires(model):
    """Issue: a failure in BlockManager.free while a request retired lost the request (never returned,
    has_unfinished_requests() False) and leaked its blocks."""
    clean_outputs, _ = drive(_retire_fault_engine(model)[0], [])
    expected = {rid: outs[-1].output_token_ids for rid, outs in clean_outputs.items()}
    engine, faults = _retire_fault_engine(model)
    with faults:
        outputs, failures = drive(engine, [], faults)
    assert failures == 1
    assert {rid: outs[-1].output_token_ids for rid, outs in outputs.items()} == expected
    assert len(outputs[0][-1].output_token_ids) == 2 and outputs[0][-1].finish_reason == "length"
    assert_pool_empty(engine)


def test_abort_after_a_failed_retire(model):
    """Issue: after a failed free in a retire, abort_request raised a raw ValueError (list.remove)."""
    engine, faults = _retire_fault_engine(model)
    with faults:
        first = engine.step()  # the prefill: each request has 1 token
        assert first == []
        with pytest.raises(InjectedFault):
            engine.step()  # request 0 gets its 2nd token and retires: freeing fails
    assert engine.has_unfinished_requests()
    assert engine.abort_request(0)  # still unfinished: the failed step changed nothing
    aborted = [o for o in engine.step() if o.request_id == 0]
    assert [(o.finish_reason, len(o.output_token_ids)) for o in aborted] == [("abort", 1)]
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(engine)


# -----------------------------------------------------------------------------
# 2. non-finite logits are an error for every request, greedy included


def _poisoning(engine, seq_len: int, poison):
    """The forward's logits row of the sequence holding `seq_len` tokens after the step gets
    poison(row)."""
    original = engine.model.forward

    def forward(input_ids, positions, kv_cache, meta, **kwargs):
        logits = original(input_ids, positions, kv_cache, meta, **kwargs)
        for i, n in enumerate(meta.seq_lens.tolist()):
            if n == seq_len:
                poison(logits[i])
        return logits

    return forward


POISONS = {
    "nan": lambda row: row.fill_(math.nan),
    "one nan": lambda row: row.__setitem__(7, math.nan),
    "+inf": lambda row: row.__setitem__(7, math.inf),
}


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("poison", list(POISONS))
def test_non_finite_logits_end_a_greedy_request_with_error(model, poison, logprobs):
    """Issue: greedy requests took NaN logits as token 0 (and +inf as a token), finish_reason "length",
    logprob nan. Now the request finishes with "error" and a message, keeping the tokens it had; the
    rest of the batch goes on unchanged."""
    _, other = _prompts()
    sp = SamplingParams
    requests = [
        (other[:3], sp(max_tokens=4, ignore_eos=True)),
        (other[:9], sp(max_tokens=4, ignore_eos=True, logprobs=logprobs)),  # poisoned at 11 tokens
        (other[:9] + other[:6], sp(max_tokens=4, temperature=0.8, seed=2, ignore_eos=True)),
    ]
    waves = [(0, requests)]
    expected = final_tokens(drive(LLMEngine(model, block_size=4, num_blocks=32), waves)[0], waves)
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    engine.model.forward = _poisoning(engine, 11, POISONS[poison])  # the 3rd token of request 1
    try:
        outputs, failures = drive(engine, waves)
    finally:
        del engine.model.forward
    assert failures == 0
    got = final_tokens(outputs, waves)
    [(tokens, reason, error)] = got[1]
    assert (tokens, reason) == (expected[1][0][0][:2], "error")
    assert error and any(w in error.lower() for w in ("nan", "inf", "finite")), error
    if logprobs is not None:
        assert all(math.isfinite(e[t].logprob) for e, t in zip(outputs[1][-1].logprobs, tokens, strict=True))
    assert got[0] == expected[0] and got[2] == expected[2]
    assert_pool_empty(engine)


@pytest.mark.parametrize("poison", list(POISONS))
def test_non_finite_logits_in_a_multi_step_end_only_that_request(model, poison, steps_run):
    """The same inside a multi-step (greedy requests, num_scheduler_steps=4): the row's argmax is
    flagged on the device, the request ends with "error" at that forward, the other gets every token."""
    _, other = _prompts()
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    waves = [(0, [(other[:3], greedy), (other[:9], greedy)])]  # request 1 poisoned at its 3rd token
    expected = final_tokens(drive(LLMEngine(model, block_size=4, num_blocks=32), waves)[0], waves)
    engine = LLMEngine(model, block_size=4, num_blocks=32, num_scheduler_steps=4)
    engine.model.forward = _poisoning(engine, 11, POISONS[poison])
    try:
        outputs, failures = drive(engine, waves)
    finally:
        del engine.model.forward
    got = final_tokens(outputs, waves)
    [(tokens, reason, error)] = got[1]
    assert (tokens, reason, failures, steps_run) == (expected[1][0][0][:2], "error", 0, [3])
    assert "not finite" in error and got[0] == expected[0]
    assert_pool_empty(engine)


def test_a_minus_inf_logit_is_not_an_error(model):
    """-inf is a masked token, not a fault: the request runs as usual."""
    _, other = _prompts()
    waves = [(0, [(other[:9], SamplingParams(max_tokens=4, ignore_eos=True))])]
    expected = final_tokens(drive(LLMEngine(model, block_size=4, num_blocks=32), waves)[0], waves)
    masked = {t for t in range(128) if t not in expected[0][0][0]}.pop()
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    engine.model.forward = _poisoning(engine, 11, lambda row: row.__setitem__(masked, -math.inf))
    try:
        outputs, _ = drive(engine, waves)
    finally:
        del engine.model.forward
    assert final_tokens(outputs, waves) == expected


# -----------------------------------------------------------------------------
# 4. the loader reads only inside the checkpoint folder, and checks types


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny sharded float32 checkpoint (three or more shards)."""
    path = tmp_path_factory.mktemp("sharded")
    random_hf_model(1, num_hidden_layers=1).save_pretrained(path, max_shard_size="40KB")
    assert len(list(path.glob("model-*.safetensors"))) > 2
    return path


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _rewrite_index(root: Path, change) -> None:
    index = root / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = sorted(set(data["weight_map"].values()))[0]
    data["weight_map"] = {k: change(v) if v == shard else v for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("where", ["absolute", "dotdot", "dotdot inside"])
def test_shard_names_outside_the_checkpoint_are_refused(sharded, tmp_path, where):
    """Issue: absolute or `../` shard names in model.safetensors.index.json were read."""
    root = _copy_checkpoint(sharded, tmp_path / "ckpt")
    (root / "sub").mkdir()
    shard = sorted(root.glob("model-*.safetensors"))[0]
    stray = tmp_path / "stray.safetensors"
    shard.rename(stray)  # the shard now lives next to the checkpoint, not in it: loading it would work
    name = {
        "absolute": str(stray),
        "dotdot": "../stray.safetensors",
        "dotdot inside": "sub/../../stray.safetensors",
    }
    _rewrite_index(root, lambda _: name[where])
    with pytest.raises(CheckpointError) as info:
        LlamaModel.from_pretrained(root)
    assert not isinstance(info.value, FileNotFoundError)  # refused, not looked for
    assert name[where] in str(info.value) and "model.safetensors.index.json" in str(info.value)


@pytest.mark.parametrize(
    "bad", [5, None, ["model-00001.safetensors"], {"a": 1}], ids=["int", "None", "list", "dict"]
)
def test_non_string_shard_names_are_a_checkpoint_error(sharded, tmp_path, bad):
    """Issue: a shard name that is not a string raised a raw TypeError."""
    root = _copy_checkpoint(sharded, tmp_path / "ckpt")
    _rewrite_index(root, lambda _: bad)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        LlamaModel.from_pretrained(root)


@pytest.mark.parametrize(
    "eos", ["2", [2, "7"], 2.5, True, [None]], ids=["str", "str-in-list", "float", "bool", "None-in-list"]
)
def test_generation_config_eos_must_be_an_int_or_a_list_of_ints(sharded, tmp_path, eos):
    """Issue: `eos_token_id: "2"` was kept as a string, so generation never stopped at EOS."""
    root = _copy_checkpoint(sharded, tmp_path / "ckpt")
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(CheckpointError, match="eos_token_id") as info:
        LlamaModel.from_pretrained(root)
    assert "generation_config.json" in str(info.value)


def test_generation_config_eos_ints_still_load(sharded, tmp_path):
    root = _copy_checkpoint(sharded, tmp_path / "ckpt")
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert LlamaModel.from_pretrained(root).eos_token_ids == (2, 7)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert LlamaModel.from_pretrained(root).eos_token_ids == (5,)


# -----------------------------------------------------------------------------
# 5. bad inputs: a VllminiError of the builtin kind a caller expects, and nothing changed


@pytest.mark.parametrize(
    "seed, error",
    [(2**70, InvalidArgumentError), (-(2**64), InvalidArgumentError), (1.5, InvalidTypeError),
     ("3", InvalidTypeError)],
    ids=["2**70", "-2**64", "1.5", "str"],
)  # fmt: skip
def test_sequence_seed_is_checked(seed, error):
    """Issue: Sequence(seed=2**70) raised "Overflow when unpacking long long", seed=1.5 a RuntimeError."""
    with pytest.raises(error, match="seed"):
        Sequence(0, [5, 6], 4, seed=seed)


def _bm_state(bm):
    return {s: (bm.block_table(s).block_ids, bm.seq_len(s)) for s in bm.seq_ids}, bm.num_free_blocks


def test_unhashable_seq_ids_are_refused():
    """Issue: unhashable sequence ids raised a raw TypeError in BlockManager.allocate and fork."""
    bm = BlockManager(8, 4)
    bm.allocate("a", 5)
    before = _bm_state(bm)
    with pytest.raises(InvalidTypeError, match="seq_id"):
        bm.allocate(["x"], 3)
    with pytest.raises(InvalidTypeError, match="seq_id"):
        bm.fork("a", ["x"])
    with pytest.raises(InvalidTypeError, match="seq_id"):
        bm.fork("a", {"x": 1})
    assert _bm_state(bm) == before


@pytest.mark.parametrize("bad", [None, 5, 2.5])
def test_allocator_fork_needs_a_sequence_of_block_ids(bad):
    """Issue: BlockAllocator.fork(None) raised a raw TypeError."""
    a = BlockAllocator(4)
    ids = [a.allocate(), a.allocate()]
    with pytest.raises(InvalidTypeError, match="block"):
        a.fork(bad)
    assert [a.ref_count(b) for b in range(4)] == [1, 1, 0, 0] and ids == [0, 1]


@pytest.mark.parametrize(
    "block_ids, error",
    [(["x"], InvalidTypeError), ([1.5], InvalidTypeError), (None, InvalidTypeError),
     ([99], BlockIdError), ([-1], BlockIdError), ([3], BlockIdError)],
    ids=["str", "float", "None", "outside-pool", "negative", "free-block"],
)  # fmt: skip
def test_block_table_adopt_checks_its_blocks(block_ids, error):
    """Issue: adopt(['x'], 2) raised a raw ValueError, and adopt([99], 2) took a block outside the pool
    (the table was corrupt). Also refused: -1, a float, and a block that is free (block 3: adopt takes
    references the caller already holds)."""
    a = BlockAllocator(4)
    table = BlockTable(a, 2)
    table.append_tokens(3)  # blocks 0 and 1
    a.allocate()  # block 2, held elsewhere; block 3 stays free
    with pytest.raises(error):
        table.adopt(block_ids, 2)
    assert (table.block_ids, table.num_tokens) == ([0, 1], 3)
    assert a.num_free_blocks == 1


@pytest.mark.parametrize(
    "token_ids, hashes, error",
    [(["x"] * 9, [], InvalidTypeError), ([5] * 9, None, InvalidTypeError), (5, [], InvalidTypeError),
     ([5.0] * 9, [], InvalidTypeError)],
    ids=["str-tokens", "None-hashes", "int-tokens", "float-tokens"],
)  # fmt: skip
def test_cached_prefix_checks_its_tokens(token_ids, hashes, error):
    """Issue: cached_prefix(['x'] * 9, []) raised a raw TypeError from the hash."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.allocate("a", 9)
    bm.cache_full_blocks("a", [5] * 9, [], 0, 9)
    before = _bm_state(bm), bm.num_cached_free_blocks
    with pytest.raises(error):
        bm.cached_prefix(token_ids, hashes)
    assert (_bm_state(bm), bm.num_cached_free_blocks) == before
    assert hashes in ([], None)  # nothing appended to the caller's hash chain


def _names_a_size(message: str) -> bool:
    return any(
        unit in message for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "GB", "TB", "PB")
    )


@pytest.mark.parametrize("kwargs", [dict(num_blocks=2**40), dict(num_blocks=2**62)], ids=["2**40", "2**62"])
def test_a_kv_cache_larger_than_memory_is_refused(kwargs):
    """Issue: PagedKVCache(num_blocks=2**40) raised torch's allocation error."""
    with pytest.raises(VllminiError) as info:
        PagedKVCache(num_layers=1, num_kv_heads=2, head_size=64, block_size=16, **kwargs)
    assert isinstance(info.value, (MemoryError, ValueError)), type(info.value).__mro__
    assert _names_a_size(str(info.value)), str(info.value)


@pytest.mark.parametrize(
    "kwargs", [dict(num_blocks=2**40), dict(kv_cache_memory=2**50)], ids=["num_blocks", "kv_cache_memory"]
)
def test_an_engine_pool_larger_than_memory_is_refused(model, kwargs):
    """Issue: LLMEngine(num_blocks=2**40) raised torch's allocation error."""
    with pytest.raises(VllminiError) as info:
        LLMEngine(model, block_size=4, **kwargs)
    assert isinstance(info.value, (MemoryError, ValueError)), type(info.value).__mro__
    assert _names_a_size(str(info.value)), str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [dict(block_size=10**6), dict(block_size=10**6, num_blocks=2), dict(block_size=256),
     dict(block_size=64, max_model_len=32)],
    ids=["10**6", "10**6-2-blocks", "256", "64-past-32"],
)  # fmt: skip
def test_block_size_past_max_model_len_is_refused_before_allocating(model, monkeypatch, kwargs):
    """Issue: LLMEngine(block_size=10**6) on a 128-position model allocated two 512 MB blocks."""

    def allocate(*args, **kwargs):
        raise AssertionError("the KV cache was allocated before the options were checked")

    monkeypatch.setattr(PagedKVCache, "__init__", allocate)
    with pytest.raises(InvalidArgumentError, match="block_size") as info:
        LLMEngine(model, **kwargs)
    assert "max_model_len" in str(info.value)


def _tokenizer_engine(hf):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(3, 128)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model = LlamaModel.from_pretrained(hf, dtype=torch.float32)
    model.tokenizer = tok
    return LLMEngine(model, block_size=4, num_blocks=16)


def test_a_prompt_with_a_lone_surrogate_is_refused(hf):
    """Issue: the prompt "w5 \\ud800" raised the tokenizer's raw TypeError."""
    engine = _tokenizer_engine(hf)
    for call in (
        lambda: engine.add_request("w5 \ud800", SamplingParams(max_tokens=2)),
        lambda: engine.generate(["w5 w6", "w5 \ud800"], SamplingParams(max_tokens=2), use_tqdm=False),
    ):
        with pytest.raises(InvalidArgumentError, match="surrogate|encod|UTF|utf") as info:
            call()
        assert isinstance(info.value, ValueError)
        assert not engine.has_unfinished_requests()
    assert engine.add_request("w5 w6", SamplingParams(max_tokens=2)) == 0  # no request id was used up


@pytest.mark.parametrize(
    "ids, error",
    [(5, InvalidTypeError), (None, InvalidTypeError), (["a"], InvalidTypeError), ("2", InvalidTypeError),
     ([2.5], InvalidTypeError), ([True], InvalidTypeError), ([-1], InvalidArgumentError),
     ([128], InvalidArgumentError)],
    ids=["int", "None", "str-list", "str", "float", "bool", "negative", "past-vocab"],
)  # fmt: skip
def test_eos_token_ids_setter_checks_its_ids(model, ids, error):
    """Issue: `engine.eos_token_ids = 5` raised a raw TypeError and `= ['a']` was accepted (a string, a
    float, a bool and ids outside the vocabulary too)."""
    engine = LLMEngine(model, block_size=4, num_blocks=8)
    with pytest.raises(error, match="eos_token_ids"):
        engine.eos_token_ids = ids
    assert engine.eos_token_ids == {2}
    engine.eos_token_ids = [2, 7]
    assert engine.eos_token_ids == {2, 7}


def test_stop_token_ids_outside_the_vocabulary_are_refused(model):
    """A stop token the model can never produce is a mistake (logprobs past the vocabulary already is)."""
    engine = LLMEngine(model, block_size=4, num_blocks=8)
    with pytest.raises(InvalidArgumentError, match="stop_token_ids"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2, stop_token_ids=[10**6]))
    assert not engine.has_unfinished_requests()


# -----------------------------------------------------------------------------
# 6. bounded memory


def _fast_forward(engine):
    """A forward that skips the model (one logits row per sequence): thousands of steps in seconds."""
    vocab = engine.model.config.vocab_size

    def forward(input_ids, positions, kv_cache, meta, **kwargs):
        logits = torch.zeros(len(meta.seq_lens), vocab)
        logits[:, 3 + positions[-1] % 100] = 1.0
        return logits

    return forward


def test_stats_keep_a_bounded_window(model):
    """Issue: engine.stats kept ~375 B per step forever. After 3,000 steps it holds fewer entries, the
    latest last, numbered by its step."""
    engine = LLMEngine(model, block_size=16, num_blocks=16, watermark=0.0)
    engine.model.forward = _fast_forward(engine)
    try:
        steps = 0
        while steps < 3000:
            if not engine.has_unfinished_requests():
                engine.add_request([5, 6, 7], SamplingParams(max_tokens=120, ignore_eos=True))
            engine.step()
            steps += 1
    finally:
        del engine.model.forward
    assert len(engine.stats) < steps
    assert engine.stats[-1].step == steps - 1


def test_explorer_fork_with_a_huge_n_is_refused_or_capped():
    """Issue: PageTableExplorer.fork(0, 10**5) took 84 s, holding the explorer's lock. In a subprocess
    (a slow fork cannot be stopped in this one)."""
    code = f"""
import time
{explorer_import()}
e = PageTableExplorer(num_blocks=16, block_size=4, background=False)
e.add_sequence(6)
t = time.perf_counter()
first = e.fork(0, 10**5)
print(time.perf_counter() - t, len(e.manager.seq_ids), first is None, e.last_error)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("fork(0, 10**5) ran for more than 30 s")
    assert run.returncode == 0, run.stderr
    seconds, num_seqs, refused, error = run.stdout.split(" ", 3)
    assert float(seconds) < 10.0  # (drawing a few sequences takes a second or two on a busy 2-core machine)
    assert int(num_seqs) < 10**5
    if refused == "True":
        assert "100000" in error and int(num_seqs) == 1


@pytest.mark.slow
def test_a_soak_with_faults_keeps_memory_flat(model):
    """10,000 committed steps of requests arriving and leaving (n up to 3, prefix caching, chunked
    prefill, preemption, streaming, aborts), with faults in the forward and at every commit site: every
    request comes back once, within max_tokens, the pool ends empty, and the Python heap does not grow
    (tracemalloc: < 1 MB between steps 1,000 and 10,000)."""
    engine = LLMEngine(
        model, block_size=4, num_blocks=24, watermark=0.0, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_num_batched_tokens=24, seed=9,
    )  # fmt: skip
    engine.model.forward = _fast_forward(engine)  # the engine's bookkeeping is what may grow
    sites = {**commit_sites(engine), "forward": (engine.model, "forward")}
    rng = random.Random(10)
    base, other = _prompts()
    pending: dict[int, SamplingParams] = {}  # request_id -> params, until it comes back finished
    counts = {"added": 0, "returned": 0, "aborted": 0, "failed": 0}
    marks = {}

    def new_request():
        n = rng.choice([1, 1, 2, 3])
        prompt = (base if rng.random() < 0.5 else other)[: rng.randint(1, 17)] + [rng.randint(3, 127)]
        params = SamplingParams(
            n=n, max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 99),
            ignore_eos=rng.random() < 0.5, output_kind=rng.choice(["final_only", "final_only", "delta"]),
        )  # fmt: skip
        pending[engine.add_request(prompt, params)] = params
        counts["added"] += 1

    tracemalloc.start()
    try:
        with Faults(engine, lambda c: rng.random() < 0.01, error=InjectedFault, sites=sites) as faults:
            step = 0
            while step < 10_000:
                while len(pending) < 4:
                    new_request()
                if rng.random() < 0.01:  # (aborts run between steps: no faults there)
                    faults.enabled = False
                    engine.abort_request(rng.choice(list(pending)))
                    faults.enabled = True
                    counts["aborted"] += 1
                faults.new_attempt(step, faults.fired)
                try:
                    done = engine.step()
                except InjectedFault:
                    counts["failed"] += 1
                    continue
                step += 1
                for o in done:
                    params = pending[o.request_id] if o.finished else None
                    if params is not None:
                        assert all(len(c.token_ids) <= params.max_tokens for c in o.outputs)
                        del pending[o.request_id]
                        counts["returned"] += 1
                if step in (1_000, 10_000):
                    gc.collect()
                    marks[step] = tracemalloc.get_traced_memory()[0]
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    del pending[o.request_id]
                    counts["returned"] += 1
    finally:
        tracemalloc.stop()
        del engine.model.forward
    assert not pending and counts["returned"] == counts["added"]
    assert counts["failed"] > 1000 and engine.num_preemptions > 20, (counts, engine.num_preemptions)
    assert_pool_empty(engine)
    growth = marks[10_000] - marks[1_000]
    assert growth < 2**20, f"the heap grew by {growth / 2**20:.2f} MB over 9,000 steps ({counts})"

"""Chunked prefill: prompts split over steps so that a step never holds more than max_num_batched_tokens.

On the tiny transformers Llama of test_engine.py: greedy tokens as transformers' float64 decode (top-2 gap
rule) for any chunk size, with preemption, parallel sampling and prefix caching; running decodes keep
going while a long prompt is prefilled; a failed step undoes its chunk progress; the no-progress error
names the request that cannot fit.
"""

import random

import pytest
import torch

from vllmini.engine import EngineConfig, LLMEngine
from vllmini.errors import EngineStateError, InvalidArgumentError
from vllmini.model_runner import prepare_inputs
from vllmini.sampling import SamplingParams
from vllmini.scheduler import Scheduler
from vllmini.sequence import Sequence

transformers = pytest.importorskip("transformers")
from engine_faults import fails_once_per_step  # noqa: E402
from llama_cases import TIE, assert_same_greedy, greedy_reference  # noqa: E402 (needs transformers)

MAX_TOKENS = 10
PROMPT_LENS = (1, 3, 4, 5, 8, 9, 16, 17, 30)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(hf64, prompts):
    return [greedy_reference(hf64, p, MAX_TOKENS) for p in prompts]


def chunked(model, budget, **kwargs):
    kwargs = {"block_size": 4, "num_blocks": 64, **kwargs}
    return LLMEngine(model, enable_chunked_prefill=True, max_num_batched_tokens=budget, **kwargs)


def step_tokens(s) -> int:
    """Tokens in one step's forward: prompt tokens computed + one per decode."""
    return s.num_prefill_tokens + s.num_decodes


# -----------------------------------------------------------------------------
# the same greedy tokens, never more than the budget per step


@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_greedy_matches_transformers_for_any_chunk_size(model, prompts, reference, budget):
    engine = chunked(model, budget)
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outputs)
    assert_same_greedy([o.output_token_ids for o in outputs], reference)
    assert max(step_tokens(s) for s in engine.stats) <= budget
    assert sum(s.num_generated for s in engine.stats) == MAX_TOKENS * len(prompts)
    assert sum(s.num_prefill_tokens for s in engine.stats) == sum(PROMPT_LENS)  # each prompt token once
    if budget == 1:  # one token a step: a prompt's last token is the step that samples its first one
        assert len(engine.stats) == sum(PROMPT_LENS) + (MAX_TOKENS - 1) * len(prompts)
    elif budget < max(PROMPT_LENS):  # the longest prompt took several steps, some beside decodes
        assert len(engine.stats) > MAX_TOKENS and any(s.num_prefills and s.num_decodes for s in engine.stats)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chunking_off_and_on_give_the_same_tokens(model, prompts, reference):
    off = LLMEngine(model, block_size=4, num_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    on = chunked(model, 5).generate(prompts, GREEDY, use_tqdm=False)
    assert_same_greedy([o.output_token_ids for o in off], reference)
    assert_same_greedy([o.output_token_ids for o in on], reference)
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(off, on, strict=True))
    assert same >= len(prompts) - 1  # only a genuine tie may tell them apart


def test_running_decodes_are_not_stalled_by_a_long_prompt(model, prompts, hf64):
    long_prompt = [(7 * i) % 120 + 3 for i in range(60)]
    expected, gaps = greedy_reference(hf64, long_prompt, 4)
    stalls = {}
    for on in (False, True):
        engine = chunked(model, 8) if on else LLMEngine(model, block_size=4, num_blocks=64)
        for p in prompts[:2]:
            engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
        engine.step()  # both prefilled: from now on they decode
        rid = engine.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        first = len(engine.stats)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
        prefill_steps = [s for s in engine.stats[first:] if s.num_prefills]
        stalls[on] = max(step_tokens(s) for s in prefill_steps)
        assert all(s.num_decodes == 2 for s in prefill_steps)  # the two running ones went on every step
        if on:  # 60 prompt tokens, 6 per step beside the 2 decodes
            assert len(prefill_steps) == 10 and all(s.num_prefill_tokens == 6 for s in prefill_steps)
            # the KV cache holds what the chunks computed so far, not the slots reserved for the rest
            held = [s.num_tokens for s in prefill_steps]
            assert [b - a for a, b in zip(held, held[1:], strict=False)] == [8] * 9
            assert all(s.num_tokens < s.allocated_slots - 8 for s in prefill_steps[:-2])
        got = outputs[rid].output_token_ids
        diff = next((t for t in range(4) if got[t] != expected[t]), None)
        assert diff is None or gaps[diff] < TIE
    assert stalls == {False: 62, True: 8}  # one 62-token step without chunking, at most 8 with it


def test_chunks_with_preemption_and_recompute(model, prompts, reference):
    engine = chunked(model, 12, num_blocks=12, watermark=0.0)
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert engine.num_preemptions > 0
    assert_same_greedy([o.output_token_ids for o in outputs], reference)
    assert max(step_tokens(s) for s in engine.stats) <= 12
    assert engine.scheduler.block_manager.num_free_blocks == 12


def test_chunks_with_parallel_sampling_and_prefix_caching(model, hf64):
    """A system prompt shared by every request: computed in chunks once, then found in the cache; n=3
    samples fork the first one's pages when its last chunk is done. Greedy samples equal transformers',
    seeded sampled ones equal those of the same run without chunking."""
    system = [(11 * i) % 120 + 3 for i in range(24)]
    prompts = [system + [5 + i, 9 + 2 * i] for i in range(4)]
    greedy = SamplingParams(max_tokens=6, n=3, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=4, ignore_eos=True)
    engine = chunked(model, 10, enable_prefix_caching=True, num_blocks=48)
    outputs = engine.generate(prompts, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, gaps = greedy_reference(hf64, prompt, 6)
        assert len(out.outputs) == 3 and all(c.token_ids == out.outputs[0].token_ids for c in out.outputs)
        assert_same_greedy([out.output_token_ids], [(tokens, gaps)])
    assert sum(s.num_hit_tokens for s in engine.stats) >= 24  # later requests found the system prompt
    assert max(step_tokens(s) for s in engine.stats) <= 10 + 3 * len(prompts)  # forks decode for free
    plain = LLMEngine(model, block_size=4, num_blocks=48, enable_prefix_caching=True)
    want = plain.generate(prompts, sampled, use_tqdm=False)
    got = chunked(model, 7, enable_prefix_caching=True, num_blocks=48).generate(
        prompts, sampled, use_tqdm=False
    )
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert len({tuple(c.token_ids) for c in got[0].outputs}) == 3  # three different samples


def test_a_failure_in_every_forward_undoes_the_chunk_progress(model, prompts):
    requests = [
        (p, SamplingParams(max_tokens=4 + i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]

    def run(fail):
        engine = chunked(model, 5, num_blocks=14, watermark=0.0)
        for p, sp in requests:
            engine.add_request(p, sp)
        outputs = {}
        with fails_once_per_step(engine, KeyboardInterrupt, enabled=fail):
            while engine.has_unfinished_requests():
                try:
                    outputs.update((o.request_id, o.output_token_ids) for o in engine.step())
                except KeyboardInterrupt:
                    continue
        computed = [(s.num_prefills, s.num_prefill_tokens, s.num_decodes) for s in engine.stats]
        return outputs, computed, engine.num_preemptions

    clean = run(False)
    assert clean[2] > 0  # preemptions too
    assert run(True) == clean


# -----------------------------------------------------------------------------
# no silent hang; options


def test_no_progress_names_the_request_under_chunking_and_n(model):
    engine = chunked(model, 4, num_blocks=8, watermark=0.0)
    bm = engine.scheduler.block_manager
    bm.allocate("leak", 24)  # 6 of 8 blocks held outside the scheduler
    rid = engine.add_request([5] * 9, SamplingParams(max_tokens=2, n=2, temperature=1.0))
    with pytest.raises(EngineStateError, match=rf"request {rid} \(9 tokens, 2 samples, 4 blocks\)"):
        engine.step()
    assert len(engine.scheduler.waiting) == 2  # nothing changed
    bm.free("leak")
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert [o.request_id for o in done] == [rid] and len(done[0].outputs) == 2


def test_arrivals_that_must_wait_are_no_error(model, prompts):
    """A request that does not fit now waits for running ones to finish: no false no-progress error."""
    engine = chunked(model, 6, num_blocks=10, watermark=0.0)
    first = engine.add_request(prompts[8], SamplingParams(max_tokens=8, ignore_eos=True))  # 10 blocks
    done, rng = [], random.Random(0)
    for step in range(200):
        if step in (1, 3, 4):  # arrivals while the first holds (nearly) every block
            engine.add_request(prompts[rng.randrange(8)], SamplingParams(max_tokens=5, n=2, temperature=1.0))
        if not engine.has_unfinished_requests():
            break
        done += engine.step()
    assert sorted(o.request_id for o in done) == [first, 1, 2, 3]


def test_budget_below_max_model_len_needs_chunking(model, hf):
    with pytest.raises(InvalidArgumentError, match="enable_chunked_prefill=True"):
        LLMEngine(model, num_blocks=8, max_num_batched_tokens=16, enable_chunked_prefill=False)
    engine = LLMEngine.from_pretrained(
        hf, dtype=torch.float32, num_blocks=8, max_num_batched_tokens=16, enable_chunked_prefill=True
    )
    assert engine.scheduler.max_num_batched_tokens == 16 and engine.scheduler.enable_chunked_prefill
    assert engine.config.enable_chunked_prefill and engine.max_model_len == 128


@pytest.mark.parametrize("seed", range(6))
def test_scheduler_chunks_never_lose_a_token_or_exceed_the_budget(seed):
    """The scheduler alone, with random prompts, budgets and finishes: every prompt token is computed
    exactly once per admission, and a step never schedules more than the budget."""
    rng = random.Random(seed)
    budget, bs = rng.randint(1, 9), rng.choice([1, 2, 4])
    config = EngineConfig(
        block_size=bs, max_model_len=40, watermark=0.0, max_num_seqs=4, max_num_batched_tokens=budget
    )
    sched = Scheduler(config, 40)
    seqs = [Sequence(i, [1] * rng.randint(1, 25), rng.randint(1, 8), seed=0) for i in range(10)]
    for seq in seqs:
        sched.add(seq)
    computed = {s.seq_id: 0 for s in seqs}
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty
        assert out.num_prefill_tokens + len(out.decodes) <= max(budget, len(out.decodes))
        assert (
            len(out.slot_mapping) == len(set(out.slot_mapping)) == out.num_prefill_tokens + len(out.decodes)
        )
        prepare_inputs(out, sched.block_manager)
        for seq in out.preempted:
            computed[seq.seq_id] = 0
        for seq in out.prefills:
            assert seq.num_computed_tokens == computed[seq.seq_id]  # chunks follow each other
            computed[seq.seq_id] = out.prefill_end(seq)
        for seq in out.partial_prefills:
            sched.mark_computed(seq, out.prefill_end(seq))
        for seq, _ in out.samplers:
            sched.mark_computed(seq)
            seq.output_token_ids.append(7)
            computed[seq.seq_id] = seq.num_tokens - 1
            if len(seq.output_token_ids) == seq.max_tokens:
                sched.finish(seq, "length")
    assert not sched.has_unfinished()
    assert all(len(s.output_token_ids) == s.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == 40


@pytest.mark.parametrize("policy", ["static", "oracle"])
def test_chunks_under_static_reservations(model, prompts, reference, policy):
    engine = chunked(model, 6, policy=policy, max_model_len=48, num_blocks=48)
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_greedy([o.output_token_ids for o in outputs], reference)
    assert max(step_tokens(s) for s in engine.stats) <= 6 and engine.num_preemptions == 0


@pytest.mark.parametrize("seed", range(6))  # seeds 0, 2, 3 preempt; 0, 2, 4 hit the prefix cache
def test_random_mixes_of_arrivals_samples_and_cached_prefixes(model, hf64, seed):
    """Requests arriving at random steps, n = 1..3 greedy samples, shared prefixes (prefix caching on or
    off), a tight pool and a random budget: every sample equals transformers', the pool comes back."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 128) for _ in range(rng.randint(4, 12))]
    budget, caching = rng.randint(2, 12), seed % 2 == 0
    engine = chunked(model, budget, num_blocks=12, watermark=0.0, enable_prefix_caching=caching)
    arrivals = sorted(rng.randrange(16) for _ in range(8))
    requests, outputs, step = {}, {}, 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            prompt = system + [rng.randrange(3, 128) for _ in range(rng.randint(1, 8))]
            params = SamplingParams(max_tokens=rng.randint(2, 10), n=rng.randint(1, 3), ignore_eos=True)
            requests[engine.add_request(prompt, params)] = (prompt, params.max_tokens)
        outputs.update((o.request_id, o) for o in engine.step())
        step += 1
    assert sorted(outputs) == sorted(requests)
    for rid, (prompt, max_tokens) in requests.items():
        tokens, gaps = greedy_reference(hf64, prompt, max_tokens)
        for c in outputs[rid].outputs:
            diff = next((t for t in range(max_tokens) if c.token_ids[t] != tokens[t]), None)
            assert len(c.token_ids) == max_tokens and (diff is None or gaps[diff] < TIE)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm) == 0
    assert max(step_tokens(s) for s in engine.stats if not s.num_decodes) <= budget


@pytest.mark.parametrize("budget, num_blocks", [(3, 14), (5, 14), (5, 16)])
def test_sampled_groups_preempted_mid_run_wait_for_the_pages_they_share(model, prompts, budget, num_blocks):
    """n=3 sampled requests in a pool that preempts them after their samples diverged: readmitted, the
    first sample recomputes in chunks and the others, sharing its leading blocks, only run once those
    are computed. Every sample equals the same request run alone in a big pool without chunking."""
    params = [SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    picked = prompts[4:8]
    engine = chunked(model, budget, num_blocks=num_blocks, watermark=0.0)
    got = engine.generate(picked, params, use_tqdm=False)
    assert engine.num_preemptions > 0
    for prompt, p, o in zip(picked, params, got, strict=True):
        [alone] = LLMEngine(model, block_size=4, num_blocks=64).generate(prompt, p, use_tqdm=False)
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in alone.outputs]
        assert len({tuple(c.token_ids) for c in o.outputs}) == 3

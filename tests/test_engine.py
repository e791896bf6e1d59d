"""vllmini.engine: greedy tokens as transformers, preemption, sampling, rejection, the config, and steps
that fail or are interrupted (rolled back, retried, aborted). The scheduler alone: tests/test_scheduler.py.

The model is a tiny random-weight transformers LlamaForCausalLM (GQA, tied embeddings, Llama-3 rope
scaling); the reference decodes it greedily in float64, one prompt at a time, and records the gap
between its top-2 logits at every step so that genuine ties (gap < 1e-4) are not counted as errors.
"""

import contextlib

import numpy as np
import pytest
import torch

from vllmini.engine import LLMEngine
from vllmini.errors import EngineStateError, InvalidArgumentError, InvalidTypeError, VllminiError
from vllmini.model import LlamaModel
from vllmini.outputs import RequestOutput
from vllmini.sampling import SamplingParams, sample

transformers = pytest.importorskip("transformers")
from engine_faults import corrupt_first_page, fails_once_per_step  # noqa: E402
from llama_cases import assert_same_greedy, greedy_reference, random_hf_model  # noqa: E402 (needs transformers)

MAX_TOKENS = 16
PROMPT_LENS = (1, 3, 4, 5, 8, 9, 16, 17)  # around block boundaries of block_size 4


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(hf64, prompts):
    """transformers' greedy tokens (float64) and top-2 gaps, per prompt."""
    return [greedy_reference(hf64, p, MAX_TOKENS) for p in prompts]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


# -----------------------------------------------------------------------------
# greedy tokens as transformers


def test_greedy_matches_transformers(model, prompts, reference):
    engine = LLMEngine(model, block_size=4, num_blocks=64)
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.request_id for o in outputs] == list(range(len(prompts)))
    assert all(o.finish_reason == "length" and o.text is None for o in outputs)
    assert_same_greedy(outputs, reference)
    # one forward per step, never one per sequence: all 8 prompts prefill together, then decode together
    assert engine.num_forwards == len(engine.stats) == MAX_TOKENS
    assert engine.stats[0].num_prefills == len(prompts) and engine.stats[1].num_decodes == len(prompts)
    assert engine.num_preemptions == 0
    assert engine.scheduler.block_manager.num_free_blocks == 64  # everything came back


def test_greedy_with_preemption_and_recompute(model, prompts, reference):
    """A pool too small for all requests at once: sequences get preempted and recomputed."""
    engine = LLMEngine(model, block_size=4, num_blocks=16, watermark=0.0)
    calls = []
    original = engine.model.forward
    engine.model.forward = lambda *a, **k: calls.append(a[3].num_seqs) or original(*a, **k)
    try:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        del engine.model.forward
    assert engine.num_preemptions > 0
    assert_same_greedy(outputs, reference)
    assert len(calls) == engine.num_forwards == len(engine.stats)
    assert calls == [s.batch_size for s in engine.stats]
    # some step mixed a (re-)prefill with decodes in its one forward
    assert any(s.num_prefills and s.num_decodes for s in engine.stats)
    assert sum(s.num_generated for s in engine.stats) == MAX_TOKENS * len(prompts)  # none lost or doubled
    for s in engine.stats:
        assert s.used_blocks + s.free_blocks == 16 and s.num_tokens <= s.allocated_slots <= s.pool_slots


@pytest.mark.parametrize("policy", ["static", "oracle"])
def test_static_baselines_give_the_same_tokens(model, prompts, reference, policy):
    engine = LLMEngine(model, block_size=4, num_blocks=40, max_model_len=40, policy=policy)
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_greedy(outputs, reference)
    assert engine.num_preemptions == 0
    first = engine.stats[0]
    if policy == "static":  # 10 blocks reserved per request: 4 fit in the pool
        assert first.batch_size == 4 and first.used_blocks == 40
    else:  # exactly prompt + max_tokens each
        assert first.used_blocks == sum(-(-(n + MAX_TOKENS) // 4) for n in PROMPT_LENS[: first.batch_size])
    assert max(s.batch_size for s in engine.stats) < len(prompts)  # the reservation limits the batch


def test_paged_runs_a_bigger_batch_than_static_in_the_same_pool(model, prompts):
    paged = LLMEngine(model, block_size=4, num_blocks=40, max_model_len=40)
    static = LLMEngine(model, block_size=4, num_blocks=40, max_model_len=40, policy="static")
    for engine in (paged, static):
        engine.generate(prompts, GREEDY, use_tqdm=False)
    mean = [sum(s.batch_size for s in e.stats) / len(e.stats) for e in (paged, static)]
    assert mean[0] > 1.5 * mean[1] and len(paged.stats) < len(static.stats)
    assert min(s.token_utilization for s in paged.stats) > 0.7
    assert max(s.token_utilization for s in static.stats) < 0.7


# -----------------------------------------------------------------------------
# sampling


def test_sample_top_k_and_top_p_keep_only_the_head():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    g = torch.Generator().manual_seed(0)
    draw = lambda p: {sample(logits, p, g) for _ in range(300)}  # noqa: E731
    assert draw(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert draw(SamplingParams(temperature=1.0, top_k=2)) == {1, 3}
    assert draw(SamplingParams(temperature=1.0, top_k=1)) == {1}
    assert draw(SamplingParams(temperature=1.0, top_p=0.5)) == {1, 3}  # 0.4 < 0.5: the next one joins
    assert draw(SamplingParams(temperature=1.0, top_p=0.4)) == {1}  # 0.4 alone reaches 0.4
    assert draw(SamplingParams(temperature=1.0, top_p=0.75)) == {1, 3, 4}
    # top_p applies to the top_k renormalized: 0.4, 0.3, 0.15 -> 0.47, 0.35, 0.18
    assert draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.8)) == {1, 3}
    assert draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.85)) == {1, 3, 4}
    assert draw(SamplingParams(temperature=0.0)) == {1}  # greedy ignores the generator


def test_sample_temperature_sharpens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    counts = {}
    for temp in (0.2, 1.0, 5.0):
        g = torch.Generator().manual_seed(0)
        counts[temp] = sum(sample(logits, SamplingParams(temperature=temp), g) == 0 for _ in range(400))
    assert counts[0.2] > counts[1.0] > counts[5.0]
    assert abs(counts[1.0] / 400 - 0.5) < 0.1


def test_seeded_sampling_repeats_and_ignores_the_rest_of_the_batch(model, prompts):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=7, ignore_eos=True)
    alone = LLMEngine(model, block_size=4, num_blocks=64).generate([prompts[5]], params, use_tqdm=False)[0]
    again = LLMEngine(model, block_size=4, num_blocks=64).generate([prompts[5]], params, use_tqdm=False)[0]
    assert alone.output_token_ids == again.output_token_ids
    # in a crowd of other sampled requests, with a pool small enough to preempt
    crowd = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in range(len(prompts))
    ]
    crowd[5] = params
    engine = LLMEngine(model, block_size=4, num_blocks=14, watermark=0.0)
    outputs = engine.generate(prompts, crowd, use_tqdm=False)
    assert engine.num_preemptions > 0
    assert outputs[5].output_token_ids == alone.output_token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=8, ignore_eos=True)
    changed = LLMEngine(model, block_size=4, num_blocks=64).generate([prompts[5]], other, use_tqdm=False)[0]
    assert changed.output_token_ids != alone.output_token_ids  # the seed matters


def test_unseeded_requests_are_reproducible_per_engine_seed(model, prompts):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = [
        LLMEngine(model, block_size=4, num_blocks=64, seed=s).generate(prompts[:3], params, use_tqdm=False)
        for s in (0, 0, 1)
    ]
    tokens = [[o.output_token_ids for o in run] for run in runs]
    assert tokens[0] == tokens[1] != tokens[2]
    assert len({tuple(t) for t in tokens[0]}) == 3  # each request has its own stream


def test_stop_token_ids_and_eos(model, prompts, reference):
    tokens = reference[6][0]
    stop = tokens[4]
    cut = tokens.index(stop)  # the first time it appears
    engine = LLMEngine(model, block_size=4, num_blocks=64)
    out = engine.generate(
        [prompts[6]], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.output_token_ids == tokens[: cut + 1]  # stop token kept
    engine.eos_token_ids = {stop}  # as if the model's EOS were this id
    out = engine.generate([prompts[6]], SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.output_token_ids == tokens[: cut + 1]
    out = engine.generate(
        [prompts[6]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.finish_reason == "length" and out.output_token_ids == tokens


@pytest.mark.parametrize("policy", ["paged", "static", "oracle"])
def test_multi_step_gives_the_single_steps_tokens(model, prompts, reference, policy, steps_run):
    """num_scheduler_steps=4: decode-only batches run 4 forwards per schedule (each step's argmax is the
    next one's input), with max_tokens staggered (a row past its own writes nothing), stop tokens ending
    samples mid-way and requests of 2 samples; the tokens, the stats per forward and the pool as with one
    step per schedule."""
    stop = reference[6][0][4]
    params = [
        SamplingParams(
            max_tokens=4 + i, ignore_eos=True, stop_token_ids=[] if i % 2 else [stop], n=1 + i % 3 // 2
        )
        for i in range(len(prompts))
    ]
    runs = {}
    for steps in (1, 4):
        steps_run.clear()
        engine = LLMEngine(model, block_size=4, num_blocks=160, policy=policy, num_scheduler_steps=steps)
        outs = engine.generate(prompts, params, use_tqdm=False)
        runs[steps] = [(o.output_token_ids, [x.token_ids for x in o.outputs], o.finish_reason) for o in outs]
        assert engine.num_forwards == len(engine.stats) and sum(s.num_generated for s in engine.stats) == sum(
            len(x.token_ids) for o in outs for x in o.outputs
        )
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and len(bm) == 0
        assert (4 in steps_run) == (steps == 4), steps_run
    assert runs[4] == runs[1]
    assert any(reason == "stop" for *_, reason in runs[1]) and any(r == "length" for *_, r in runs[1])
    assert_same_greedy(
        [
            o
            for o, p in zip(
                LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=4).generate(
                    prompts, GREEDY, use_tqdm=False
                ),
                prompts,
                strict=True,
            )
        ],
        reference,
    )


def test_multi_step_with_prefix_caching_and_chunked_prefill(model, prompts, steps_run):
    """Blocks filled during a multi-step are cached by their hashes (a second wave on the same prompts hits
    them), chunked prompts keep single steps until their prefill is done: the tokens of one step per
    schedule, the same cache hits."""
    runs = {}
    for steps in (1, 4):
        engine = LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=steps,
                           enable_prefix_caching=True, max_num_batched_tokens=8)  # fmt: skip
        first = [o.output_token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
        again = [p + t[:6] for p, t in zip(prompts, first, strict=True)]  # prompt + part of its output
        second = [o.output_token_ids for o in engine.generate(again, GREEDY, use_tqdm=False)]
        runs[steps] = first, second, sum(s.num_hit_tokens for s in engine.stats)
    assert runs[4] == runs[1] and runs[1][2] > 0 and 4 in steps_run


def test_multi_step_only_runs_greedy_batches_with_nothing_waiting(model, prompts, steps_run):
    engine = LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=4)
    engine.generate(
        prompts[:2], [GREEDY, SamplingParams(max_tokens=8, temperature=0.8, seed=1)], use_tqdm=False
    )
    engine.generate(prompts[:2], [GREEDY, SamplingParams(max_tokens=8, logprobs=2)], use_tqdm=False)
    small = LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=4, max_num_seqs=2)
    small.generate(prompts[:3], GREEDY, use_tqdm=False)  # the third waits while the first two decode
    # a sampled or logprobs request (8 tokens) keeps the greedy one (16) to single steps until it finishes:
    # then 8 tokens left, 4 + 4; the third request runs alone at the end: 15 tokens after its prefill
    assert steps_run == [4, 4] + [4, 4] + [4, 4, 4, 3], steps_run


def test_a_failed_multi_step_is_rolled_back_and_retried(model, prompts):
    """Each step's first forward fails after writing the KV cache: the whole multi-step (its slots, its
    tokens) is undone and the retry gives the uninterrupted run's tokens."""
    clean = LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=4)
    want = [o.output_token_ids for o in clean.generate(prompts, GREEDY, use_tqdm=False)]
    engine = LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=4)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done, failures = {}, 0
    with fails_once_per_step(engine):
        while engine.has_unfinished_requests():
            try:
                done.update((o.request_id, o.output_token_ids) for o in engine.step())
            except RuntimeError:
                failures += 1
    assert [done[i] for i in ids] == want
    assert failures == 1 + 4 and engine.num_forwards == len(engine.stats) == MAX_TOKENS  # prefill, 4+4+4+3
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm) == 0


def test_a_failure_late_in_a_multi_step_commit_undoes_the_whole_step(model, prompts, monkeypatch):
    """A fault while committing the 4th forward's tokens: no token, stat or forward of the step is kept
    (the first three forwards' commits included), and the retry gives the clean run's tokens."""
    clean = LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=4)
    want = [o.output_token_ids for o in clean.generate(prompts, GREEDY, use_tqdm=False)]
    engine = LLMEngine(model, block_size=4, num_blocks=160, num_scheduler_steps=4)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # the prefill
    finish_reason, calls = engine.outputs.finish_reason, []

    def failing(seq, token):
        calls.append(token)
        if len(calls) == 3 * len(prompts) + 1:
            raise RuntimeError("injected")
        return finish_reason(seq, token)

    monkeypatch.setattr(engine.outputs, "finish_reason", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.num_forwards == len(engine.stats) == 1
    assert all(len(s.output_token_ids) == 1 for s in engine.scheduler.running)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.output_token_ids) for o in engine.step())
    assert [done[i] for i in ids] == want and engine.num_forwards == len(engine.stats) == MAX_TOKENS


def test_eos_ids_come_from_the_model(model):
    assert LLMEngine(model, num_blocks=8).eos_token_ids == {2}


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (dict(max_tokens=0), InvalidArgumentError, "max_tokens must be >= 1, got 0"),
        (dict(max_tokens=2.0), InvalidTypeError, "max_tokens must be an int, got float"),
        (dict(temperature=-1.0), InvalidArgumentError, "temperature"),
        (dict(temperature=float("nan")), InvalidArgumentError, "temperature"),
        (dict(temperature="1"), InvalidTypeError, "temperature"),
        (dict(top_k=0), InvalidArgumentError, "top_k"),
        (dict(top_k=True), InvalidTypeError, "top_k.*bool"),
        (dict(top_k=2.5), InvalidTypeError, "top_k"),
        (dict(top_p=0.0), InvalidArgumentError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), InvalidArgumentError, "top_p"),
        (dict(seed=1.5), InvalidTypeError, "seed must be an int"),
        (dict(seed=2**70), InvalidArgumentError, "seed must be <="),
        (dict(stop_token_ids="12"), InvalidTypeError, "stop_token_ids must be a list.*str '12'"),
        (dict(stop_token_ids=[1.0]), InvalidTypeError, r"stop_token_ids\[0\] must be an int"),
        (dict(stop_token_ids=[True]), InvalidTypeError, "bool"),
        (dict(stop_token_ids=[-1]), InvalidArgumentError, "stop_token_ids must be >= 0"),
        (dict(stop_token_ids=5), InvalidTypeError, "stop_token_ids"),
        (dict(ignore_eos=1), InvalidTypeError, "ignore_eos must be a bool"),
    ],
)
def test_sampling_params_validation(bad, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**bad)


def test_sampling_params_accept_numpy_and_torch_scalars():
    p = SamplingParams(
        max_tokens=np.int64(3),
        temperature=np.float32(0.5),
        top_k=torch.tensor(4),
        seed=np.uint64(2**64 - 1),
        stop_token_ids=np.array([7, 9]),
        ignore_eos=np.bool_(True),
    )
    assert (p.max_tokens, p.top_k, p.seed, p.stop_token_ids, p.ignore_eos) == (3, 4, 2**64 - 1, [7, 9], True)
    assert type(p.max_tokens) is int and type(p.stop_token_ids[0]) is int and p.temperature == 0.5
    assert SamplingParams(stop_token_ids=torch.tensor([3])).stop_token_ids == [3]
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)  # torch's whole seed range works


def test_tiny_temperature_is_greedy(model, prompts):
    """1e-45 passes validation; dividing the logits by it would overflow: it counts as greedy."""
    greedy = LLMEngine(model, block_size=4, num_blocks=64).generate(prompts[:3], GREEDY, use_tqdm=False)
    tiny = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1e-45)
    assert tiny.is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    outs = LLMEngine(model, block_size=4, num_blocks=64).generate(prompts[:3], tiny, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in greedy]
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert sample(logits, SamplingParams(temperature=1e-6), torch.Generator().manual_seed(0)) == 1


# -----------------------------------------------------------------------------
# requests in and out


def test_add_request_rejects_what_can_never_run(model):
    engine = LLMEngine(model, block_size=4, num_blocks=8, max_model_len=64, watermark=0.0)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        engine.add_request([5] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="could never fit"):  # 40 tokens need 10 blocks of 4; the pool has 8
        engine.add_request([5] * 30, SamplingParams(max_tokens=11))
    engine.add_request([5] * 30, SamplingParams(max_tokens=3))  # 32 - 1 tokens ever cached: 8 blocks
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.add_request([5, 128], SamplingParams())
    with pytest.raises(TypeError, match="tokenizer"):
        engine.add_request("hello", SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([5], {"max_tokens": 3})
    with pytest.raises(VllminiError, match="idle"):
        engine.generate([[5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(engine.scheduler.waiting) == 1  # only the valid request was queued


def test_generate_validates_every_request_before_queueing_any(model):
    engine = LLMEngine(model, block_size=4, num_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[5], [5] * 70], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[5]], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_engine_constructor_errors(model):
    with pytest.raises(ValueError, match="static.*max_model_len=128"):
        LLMEngine(model, block_size=4, num_blocks=8, policy="static")
    with pytest.raises(ValueError, match="policy"):
        LLMEngine(model, num_blocks=8, policy="lazy")
    with pytest.raises(ValueError, match="backend"):
        LLMEngine(model, num_blocks=8, backend="triton")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(model, num_blocks=8, max_model_len=4096)
    with pytest.raises(ValueError, match="exactly one"):
        LLMEngine(model, num_blocks=8, kv_cache_memory=1 << 20)


def test_backend_that_cannot_run_the_model_says_so(model):
    """Checked when the engine is built, not at the first decode."""
    f64 = LlamaModel(model.config).double()  # the CUDA kernel has float32/16 and bfloat16 versions only
    with pytest.raises(ValueError, match="backend 'emulator' cannot run.*float64"):
        LLMEngine(f64, num_blocks=8, backend="emulator")
    with pytest.raises(ValueError, match="backend 'cupy' cannot run.*CUDA"):
        LLMEngine(model, num_blocks=8, backend="cupy")
    assert LLMEngine(f64, num_blocks=8).backend == "torch"  # "auto" on the CPU
    assert LLMEngine(model, num_blocks=8, backend="emulator").backend == "emulator"


def test_kv_cache_sized_by_memory(model):
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # K+V, layers, block_size, kv heads, head_dim, fp32
    engine = LLMEngine(model, block_size=4, kv_cache_memory=10 * per_block + 5)
    assert engine.kv_cache.num_blocks == engine.scheduler.block_manager.num_blocks == 10
    assert LLMEngine(model, block_size=16).kv_cache.num_blocks == 8 * 128 // 16  # CPU default


def test_from_pretrained_with_tokenizer_strings_in_text_out(tmp_path, hf):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf.save_pretrained(tmp_path)
    vocab = {f"w{i}": i for i in range(3, 128)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    engine = LLMEngine.from_pretrained(tmp_path, dtype=torch.float32, block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    [by_text] = engine.generate("w5 w17 w99", params, use_tqdm=False)
    [by_ids] = engine.generate([[5, 17, 99]], params, use_tqdm=False)
    assert by_text.prompt_token_ids == [5, 17, 99]
    assert by_text.output_token_ids == by_ids.output_token_ids
    assert by_text.text == " ".join(f"w{t}" for t in by_ids.output_token_ids if t > 2)


def test_step_by_step_returns_each_request_once(model, prompts):
    engine = LLMEngine(model, block_size=4, num_blocks=16, watermark=0.0)
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=3 + i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    seen: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert sorted(o.request_id for o in seen) == ids
    assert all(len(o.output_token_ids) == 3 + o.request_id for o in seen)
    assert engine.step() == []


def test_emulator_backend_gives_the_same_tokens(model, prompts, steps_run):
    """The decode path through the CUDA source run on the CPU (prefill stays on torch)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    torch_out = LLMEngine(model, block_size=4, num_blocks=32).generate(prompts[:4], params, use_tqdm=False)
    for steps in (1, 3):  # 3: multi-step, the padded forward a CUDA graph records (fused layer kernels too)
        engine = LLMEngine(model, block_size=4, num_blocks=32, backend="emulator", num_scheduler_steps=steps)
        emu_out = engine.generate(prompts[:4], params, use_tqdm=False)
        assert [o.output_token_ids for o in emu_out] == [o.output_token_ids for o in torch_out], steps
    assert steps_run == [3]


# -----------------------------------------------------------------------------
# the config


def test_engine_config_from_keywords_config_or_both(model):
    from vllmini import EngineConfig

    cfg = EngineConfig(block_size=4, num_blocks=20, watermark=0.0, seed=3)
    a = LLMEngine(model, cfg)
    b = LLMEngine(model, block_size=4, num_blocks=20, watermark=0.0, seed=3)
    c = LLMEngine(model, EngineConfig(block_size=8, num_blocks=20, seed=3), block_size=4, watermark=0.0)
    for e in (a, b, c):  # keywords fill the config; given both, the keywords win
        assert (e.kv_cache.block_size, e.kv_cache.num_blocks, e.scheduler.block_manager.watermark_blocks) == (
            4,
            20,
            0,
        )
        assert e.config.max_model_len == 128 and e.config.max_num_batched_tokens == 2048  # resolved
        assert e.seed == 3
    assert cfg.max_model_len is None  # the caller's config is not changed
    assert (
        LLMEngine(
            model, num_blocks=8, max_model_len=64, max_num_batched_tokens=100
        ).scheduler.max_num_batched_tokens
        == 100
    )
    assert EngineConfig(block_size=np.int64(8)).block_size == 8


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(block_size=0), InvalidArgumentError, "block_size must be >= 1, got 0"),
        (dict(block_size=2.0), InvalidTypeError, "block_size must be an int"),
        (dict(max_model_len=0), InvalidArgumentError, "max_model_len must be >= 1, got 0"),
        (dict(max_model_len=64.5), InvalidTypeError, "max_model_len must be an int, got float 64.5"),
        (dict(num_blocks=True), InvalidTypeError, "num_blocks must be an int, got bool"),
        (dict(num_blocks=8, gpu_memory_utilization=0.5), InvalidArgumentError, "exactly one"),
        (dict(gpu_memory_utilization=0.0), InvalidArgumentError, "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), InvalidArgumentError, "gpu_memory_utilization"),
        (dict(backend="triton"), InvalidArgumentError, "backend must be one of"),
        (dict(policy="lazy"), InvalidArgumentError, "policy must be one of"),
        (dict(watermark=1.0), InvalidArgumentError, "watermark"),
        (dict(max_num_seqs=0), InvalidArgumentError, "max_num_seqs"),
        (dict(seed="0"), InvalidTypeError, "seed"),
        (
            dict(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False),
            InvalidArgumentError,
            "max_num_batched_tokens=32",
        ),
        (
            dict(enable_prefix_caching=True, policy="static"),
            InvalidArgumentError,
            "enable_prefix_caching needs policy 'paged'",
        ),
        (dict(enable_chunked_prefill=1), InvalidTypeError, "enable_chunked_prefill must be a bool"),
        (dict(max_cuda_graph_batch_size=513), InvalidArgumentError, "max_cuda_graph_batch_size"),
        (dict(use_cuda_graphs=1), InvalidTypeError, "use_cuda_graphs must be a bool"),
        (dict(num_scheduler_steps=0), InvalidArgumentError, "num_scheduler_steps"),
        (dict(num_scheduler_steps=65), InvalidArgumentError, "num_scheduler_steps"),
        (dict(blocksize=4), InvalidTypeError, "unknown engine option.*blocksize"),
    ],
)
def test_engine_config_rejects_bad_options(model, kwargs, error, message):
    from vllmini import EngineConfig

    with pytest.raises(error, match=message):
        LLMEngine(model, **kwargs)
    if "blocksize" not in kwargs:
        with pytest.raises(error, match=message):
            EngineConfig(**kwargs)


def test_cuda_graphs_are_off_on_the_cpu_and_refused_there(model):
    assert LLMEngine(model, num_blocks=8).graphs is None  # the default (None): on for CUDA only
    with pytest.raises(InvalidArgumentError, match="use_cuda_graphs=True needs a CUDA model"):
        LLMEngine(model, num_blocks=8, use_cuda_graphs=True)


def test_engine_config_checks_against_the_model(model):
    from vllmini import EngineConfig

    with pytest.raises(
        InvalidArgumentError, match="max_num_batched_tokens=100 is smaller than max_model_len=128"
    ):
        LLMEngine(
            model, num_blocks=8, max_num_batched_tokens=100, enable_chunked_prefill=False
        )  # max_model_len 128
    with pytest.raises(InvalidTypeError, match="config must be an EngineConfig"):
        LLMEngine(model, {"block_size": 4})
    with pytest.raises(InvalidTypeError, match="unknown engine option"):  # before loading any weights
        LLMEngine.from_pretrained("/nonexistent", config=EngineConfig(), blocksize=4)


# -----------------------------------------------------------------------------
# failures, Ctrl-C and abort: a step is all-or-nothing


def _requests(prompts):
    """Greedy and sampled requests (seeded and unseeded), of different lengths."""
    out = []
    for i, p in enumerate(prompts):
        temp = 0.0 if i % 2 == 0 else 0.8
        seed = i if i % 4 == 1 else None
        out.append((p, SamplingParams(max_tokens=6 + i, temperature=temp, seed=seed, ignore_eos=True)))
    return out


def _run(engine, requests, errors=()):
    """add every request, then step until done; steps that raise one of `errors` are retried."""
    for p, sp in requests:
        engine.add_request(p, sp)
    outputs, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            done = engine.step()
        except errors:
            failures += 1
            continue
        for o in done:
            assert o.request_id not in outputs  # each request comes back once
            outputs[o.request_id] = o
    return outputs, failures


def _small_engine(model):
    return LLMEngine(model, block_size=4, num_blocks=12, watermark=0.0)  # small enough to preempt


def _summary(engine, outputs):
    return (
        {i: (o.output_token_ids, o.finish_reason) for i, o in outputs.items()},
        [(s.num_prefills, s.num_decodes, s.num_preemptions, s.used_blocks) for s in engine.stats],
    )


@pytest.fixture(scope="module")
def clean_run(model, prompts):
    engine = _small_engine(model)
    outputs, _ = _run(engine, _requests(prompts))
    assert engine.num_preemptions > 0
    return _summary(engine, outputs)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_failure_in_every_forward_is_rolled_back(model, prompts, clean_run, error, when):
    """Each step's first forward raises (before it ran, or after it wrote the KV cache); step() again
    continues. Nothing lost or doubled, and every token equals the uninterrupted run's."""
    engine = _small_engine(model)
    original, failed = engine.model.forward, set()

    def forward(input_ids, positions, kv_cache, meta, **kwargs):
        step = len(engine.stats)
        if step not in failed and when == "before":
            failed.add(step)
            raise error("injected")
        logits = original(input_ids, positions, kv_cache, meta, **kwargs)
        if step not in failed:  # after its KV writes, and leaving garbage in them
            failed.add(step)
            for cache in kv_cache.key_caches + kv_cache.value_caches:
                cache.view(-1, *cache.shape[2:])[meta.slot_mapping] = 100.0
            raise error("injected")
        return logits

    engine.model.forward = forward
    try:
        outputs, failures = _run(engine, _requests(prompts), errors=(error,))
    finally:
        del engine.model.forward
    assert failures == len(engine.stats) == engine.num_forwards
    assert _summary(engine, outputs) == clean_run
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm) == 0


def test_ctrl_c_while_sampling_restores_the_generators(model, prompts, clean_run, monkeypatch):
    """A KeyboardInterrupt after some sequences already drew from their generators: rolled back too."""
    import vllmini.sampling as sampling_module

    engine, calls = _small_engine(model), {}

    draw = sampling_module._draw  # the per-request part of sampling: one draw from the request's generator

    def interrupted_sample(probs, params, generator):
        step = len(engine.stats)
        calls[step] = calls.get(step, 0) + 1
        token = draw(probs, params, generator)
        if calls[step] == 2:  # the second sampled sequence of each step, once
            raise KeyboardInterrupt
        return token

    monkeypatch.setattr(sampling_module, "_draw", interrupted_sample)
    outputs, failures = _run(engine, _requests(prompts), errors=(KeyboardInterrupt,))
    assert failures > 3
    assert _summary(engine, outputs) == clean_run


def test_exception_in_the_first_prefill_then_step(model, prompts):
    """Issue: the interrupted request was left running over prompt KV that was never written."""
    requests = [(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts[:3]]
    expected, _ = _run(LLMEngine(model, block_size=4, num_blocks=32), requests)
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    for p, sp in requests:
        engine.add_request(p, sp)
    original = engine.model.forward
    engine.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    del engine.model.forward
    assert len(engine.scheduler.waiting) == 3 and not engine.scheduler.running  # nothing half-done
    assert engine.scheduler.block_manager.num_free_blocks == 32 and engine.stats == []
    assert engine.model.forward == original
    outputs, _ = _run(engine, [])
    assert {i: o.output_token_ids for i, o in outputs.items()} == {
        i: o.output_token_ids for i, o in expected.items()
    }


def test_real_ctrl_c_in_forward_and_in_commit(model, prompts):
    """SIGINT itself: in the forward it rolls the step back; during the commit it waits for the commit to
    finish, then raises, and the requests that finished in that step come back from the next step()."""
    import signal

    requests = [(p, SamplingParams(max_tokens=2 + i, ignore_eos=True)) for i, p in enumerate(prompts[:3])]
    expected, _ = _run(LLMEngine(model, block_size=4, num_blocks=32), requests)
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    for p, sp in requests:
        engine.add_request(p, sp)
    original_forward, original_finish = engine.model.forward, engine.scheduler.finish
    engine.model.forward = lambda *a, **k: signal.raise_signal(signal.SIGINT) or original_forward(*a, **k)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    del engine.model.forward
    assert engine.stats == [] and len(engine.scheduler.waiting) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the engine's handler is gone

    def finish(seq, reason):  # Ctrl-C in the middle of retiring the first finished request
        signal.raise_signal(signal.SIGINT)
        original_finish(seq, reason)

    outputs = {}
    outputs.update((o.request_id, o) for o in engine.step())  # the prefill: nothing finishes
    engine.scheduler.finish = finish
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # request 0 finishes (2 tokens): the commit completes, then Ctrl-C is raised
    del engine.scheduler.finish
    assert len(engine.stats) == 2 and [s.seq_id for s in engine.scheduler.running] == [1, 2]
    outputs.update((o.request_id, o) for o in engine.step())  # request 0 comes back now
    assert 0 in outputs
    outputs.update(_run(engine, [])[0])
    assert {i: o.output_token_ids for i, o in outputs.items()} == {
        i: o.output_token_ids for i, o in expected.items()
    }


def test_a_sampling_failure_finishes_only_that_request(model, prompts, clean_run, monkeypatch):
    import vllmini.sampling as sampling_module

    requests = _requests(prompts)
    bad = requests[3][1]  # a sampled request

    draw = sampling_module._draw

    def failing_sample(probs, params, generator):
        if params is bad:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return draw(probs, params, generator)

    monkeypatch.setattr(sampling_module, "_draw", failing_sample)
    engine = _small_engine(model)
    outputs, failures = _run(engine, requests)
    assert failures == 0
    assert outputs[3].finish_reason == "error" and outputs[3].output_token_ids == []
    assert "RuntimeError: probability tensor" in outputs[3].error
    expected = clean_run[0]
    for i, o in outputs.items():
        if i != 3:  # the others go on (with a different batch, so greedy and seeded ones compare)
            if requests[i][1].is_greedy or requests[i][1].seed is not None:
                assert (o.output_token_ids, o.finish_reason, o.error) == (*expected[i], None)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_request(model, prompts):
    engine = LLMEngine(model, block_size=4, num_blocks=16, watermark=0.0)
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    engine.step()
    engine.step()
    running = [s.seq_id for s in engine.scheduler.running]
    waiting = [s.seq_id for s in engine.scheduler.waiting]
    assert running and waiting
    partial = {
        s.seq_id: list(s.output_token_ids) for s in [*engine.scheduler.running, *engine.scheduler.waiting]
    }
    free = engine.scheduler.block_manager.num_free_blocks
    assert engine.abort_request(running[0]) and engine.abort_request(waiting[0])
    assert not engine.abort_request(running[0])  # already aborted
    assert not engine.abort_request(99)
    with pytest.raises(InvalidTypeError, match="request_id"):
        engine.abort_request("0")
    assert engine.scheduler.block_manager.num_free_blocks > free  # its blocks came back
    done = engine.step()
    aborted = {o.request_id: o for o in done if o.finish_reason == "abort"}
    assert set(aborted) == {running[0], waiting[0]}
    for i in (running[0], waiting[0]):  # what it had generated when it was aborted
        assert aborted[i].output_token_ids == partial[i] and aborted[i].prompt_token_ids == prompts[i]
    assert len(partial[running[0]]) == 2
    rest, _ = _run(engine, [])
    assert sorted([o.request_id for o in done] + list(rest)) == ids
    assert not engine.abort_request(ids[-1])  # finished
    # aborting the last request: its output still comes back from step(), with nothing left to run
    rid = engine.add_request([5, 6], SamplingParams(max_tokens=3))
    assert engine.abort_request(rid) and engine.has_unfinished_requests()
    with pytest.raises(EngineStateError, match="idle"):
        engine.generate([[5]], use_tqdm=False)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(rid, "abort")]
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_generate_interrupted_aborts_its_requests_and_stays_usable(model, prompts):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = LLMEngine(model, block_size=4, num_blocks=16).generate(prompts, params, use_tqdm=False)
    engine = LLMEngine(model, block_size=4, num_blocks=16)
    original = engine.model.forward

    def forward(*args, **kwargs):
        if len(engine.stats) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    engine.model.forward = forward
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, params, use_tqdm=False)
    del engine.model.forward
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert engine.scheduler.block_manager.num_free_blocks == 16
    again = engine.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in expected]


def test_no_progress_names_the_request_that_cannot_fit(model):
    engine = LLMEngine(model, block_size=4, num_blocks=8, watermark=0.0)
    bm = engine.scheduler.block_manager
    bm.allocate("leak", 28)  # 7 of 8 blocks held outside the scheduler
    rid = engine.add_request([5] * 9, SamplingParams(max_tokens=2))
    with pytest.raises(EngineStateError, match=rf"request {rid} \(9 tokens, 3 blocks\).*1 of 8 blocks free"):
        engine.step()
    assert len(engine.scheduler.waiting) == 1  # nothing changed: not stuck once the blocks are back
    bm.free("leak")
    assert [o.request_id for o in _run(engine, [])[0].values()] == [rid]


def test_a_victim_of_a_failed_step_is_recomputed_if_the_retry_differs(model, prompts, reference):
    """A failed forward may write into the blocks of a sequence it preempted (here: garbage). Restored,
    that sequence must not decode over them: when the retried step does not preempt it again (here an
    abort made room), it is recomputed. Greedy tokens still match transformers'."""
    engine = LLMEngine(model, block_size=4, num_blocks=16, watermark=0.0)
    original, sched = engine.model.forward, engine.scheduler
    for p in prompts:
        engine.add_request(p, GREEDY)
    outputs = {}
    bm = sched.block_manager
    while True:  # step up to a step whose forward writes into the blocks of a sequence it preempts
        before = {s.seq_id: bm.block_table(s.seq_id).block_ids for s in sched.running}
        snapshot = sched.snapshot()  # the scheduler's own undo lets us look ahead
        out = sched.schedule()
        sched.restore(snapshot)
        written = {slot // bm.block_size for slot in out.slot_mapping}
        if any(written.intersection(before[s.seq_id]) for s in out.preempted):
            break
        outputs.update((o.request_id, o) for o in engine.step())

    def forward(input_ids, positions, kv_cache, meta, **kwargs):  # writes the KV cache, then fails
        original(input_ids, positions, kv_cache, meta, **kwargs)
        for cache in kv_cache.key_caches + kv_cache.value_caches:  # a failed forward may leave anything
            cache.view(-1, *cache.shape[2:])[meta.slot_mapping] = 100.0
        raise RuntimeError("after the KV writes")

    engine.model.forward = forward
    with pytest.raises(RuntimeError):
        engine.step()
    del engine.model.forward
    oldest = engine.scheduler.running[0].seq_id
    assert engine.abort_request(oldest)
    outputs.update(_run(engine, [])[0])
    del outputs[oldest]
    assert_same_greedy(
        [outputs[i] for i in sorted(outputs)], [r for i, r in enumerate(reference) if i != oldest]
    )


# -----------------------------------------------------------------------------
# what counts as a prompt


def test_prompts_as_tensors_arrays_and_numpy_ints(model):
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    run = lambda prompts: [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)]  # noqa: E731
    want = run([[5, 6, 7]])
    assert run(torch.tensor([5, 6, 7])) == want  # a 1-D int tensor is one prompt
    assert run(np.array([5, 6, 7])) == want
    assert run([np.int64(5), np.int64(6), np.int64(7)]) == want
    assert run((5, 6, 7)) == want
    assert run([torch.tensor([5, 6, 7]), np.array([5, 6, 7], dtype=np.int32)]) == want * 2
    assert run(torch.tensor([[5, 6, 7], [5, 6, 7]])) == want * 2  # 2-D: one prompt per row
    engine.add_request(np.array([5, 6, 7]), params)
    assert [o.output_token_ids for o in _run(engine, [])[0].values()] == want
    assert engine.generate([], use_tqdm=False) == []


@pytest.mark.parametrize(
    "prompts, params, error, message",
    [
        (b"w5 w6", None, InvalidTypeError, "got bytes b'w5 w6': decode it first"),
        ([5.7, 3.2], None, InvalidTypeError, r"prompt\[0\] must be an int, got float 5.7"),
        ([[5, 6.0]], None, InvalidTypeError, r"prompt\[1\] must be an int, got float"),
        ([True, 5], None, InvalidTypeError, "bool"),
        (torch.tensor([5.0, 6.0]), None, InvalidTypeError, "1-D integer tensor or array, got torch.float32"),
        (torch.tensor([True]), None, InvalidTypeError, "torch.bool"),
        (np.zeros((1, 1, 2), dtype=np.int64), None, InvalidTypeError, r"shape \(1, 1, 2\)"),
        (5, None, InvalidTypeError, "prompts must be a str, a list of token ids"),
        ({5, 6}, None, InvalidTypeError, "prompts must be"),
        (
            [[5]],
            {"max_tokens": 2},
            InvalidTypeError,
            r"params must be a SamplingParams, got dict.*SamplingParams\(\*\*params\)",
        ),
        ([[5]], [SamplingParams(), SamplingParams()], InvalidArgumentError, "2 SamplingParams for 1 prompts"),
        ([[5, 128]], None, InvalidArgumentError, r"\[0, 128\)"),
        ([[]], None, InvalidArgumentError, "empty"),
    ],
)
def test_bad_prompts_are_refused_clearly(model, prompts, params, error, message):
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    with pytest.raises(error, match=message):
        engine.generate(prompts, params, use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine._next_id == 0


def test_generate_tokenizes_each_prompt_once(model, monkeypatch):
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    calls = []
    original = engine.inputs.encode
    monkeypatch.setattr(engine.inputs, "encode", lambda p: calls.append(p) or original(p))
    engine.generate([[5, 6], [7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert calls == [[5, 6], [7]]


@pytest.mark.gpu
def test_a_bad_block_id_seen_by_the_kernel_guard_fails_the_step_and_rolls_it_back(monkeypatch):
    """On CUDA the decode kernels check page ids on the GPU (no host sync); the engine reads that record
    once per step, before committing: the step raises InvalidBlockTableError and is undone."""
    from vllmini.cuda_kernels import check_kernel_errors
    from vllmini.errors import InvalidBlockTableError

    with contextlib.suppress(InvalidBlockTableError):  # a record left by an earlier test's guarded call
        check_kernel_errors("cuda")
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=torch.float32, device="cuda")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = LLMEngine(model, block_size=4, num_blocks=32).generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    rid = engine.add_request([5, 6, 7, 8, 9], params)
    engine.step()  # the prefill
    corrupt_first_page(engine, monkeypatch)
    with pytest.raises(InvalidBlockTableError, match=r"block_tables\[0, 0\] = 1000000"):
        engine.step()
    monkeypatch.undo()
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [rid]
    assert done[0].output_token_ids == clean[0].output_token_ids  # the failed step left no trace

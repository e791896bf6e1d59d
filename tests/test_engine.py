"""vllmini.engine and vllmini.scheduler: greedy tokens as transformers, preemption, sampling, rejection.

The model is a tiny random-weight transformers LlamaForCausalLM (GQA, tied embeddings, Llama-3 rope
scaling); the reference decodes it greedily in float64, one prompt at a time, and records the gap
between its top-2 logits at every step so that genuine ties (gap < 1e-4) are not counted as errors.
"""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllmini.engine import LLMEngine, RequestOutput, SamplingParams, sample
from vllmini.errors import VllminiError
from vllmini.model import LlamaModel
from vllmini.scheduler import Scheduler, Sequence, SequenceStatus

transformers = pytest.importorskip("transformers")
from llama_cases import LLAMA3_ROPE, random_hf_model  # noqa: E402 (needs transformers)

TIE = 1e-4
MAX_TOKENS = 16
PROMPT_LENS = (1, 3, 4, 5, 8, 9, 16, 17)  # around block boundaries of block_size 4


@pytest.fixture(scope="module")
def hf():
    # longer contexts than test_model's: rope scaling starts at 32 positions, by a factor of 4
    rope = {**LLAMA3_ROPE, "factor": 4.0, "original_max_position_embeddings": 32}
    return random_hf_model(0, max_position_embeddings=128, rope_scaling=rope)


@pytest.fixture(scope="module")
def model(hf):
    return LlamaModel.from_pretrained(hf, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    """transformers' greedy tokens (float64, whole sequence recomputed each step) and top-2 gaps."""
    hf64 = transformers.LlamaForCausalLM(hf.config).eval()
    hf64.load_state_dict(hf.state_dict())
    hf64 = hf64.double()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, tokens, gaps = list(p), [], []
            for _ in range(MAX_TOKENS):
                logits = hf64(torch.tensor([ids])).logits[0, -1]
                top2 = logits.topk(2).values
                tokens.append(int(logits.argmax()))
                gaps.append(float(top2[0] - top2[1]))
                ids.append(tokens[-1])
            out.append((tokens, gaps))
    return out


def assert_same_greedy(outputs, reference):
    """Same tokens, except that after a genuine tie in transformers' logits anything may follow."""
    full = 0
    for o, (tokens, gaps) in zip(outputs, reference, strict=True):
        got = o.output_token_ids
        assert len(got) == len(tokens), (got, tokens)
        diff = next((t for t in range(len(tokens)) if got[t] != tokens[t]), None)
        if diff is None:
            full += 1
        else:
            assert gaps[diff] < TIE, f"token {diff} differs: {got} vs {tokens} (top-2 gap {gaps[diff]:.2e})"
    assert full >= len(reference) - 1  # ties are rare: this cannot pass by accident


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


def test_eos_ids_come_from_the_model(model):
    assert LLMEngine(model, num_blocks=8).eos_token_ids == {2}


def test_sampling_params_validation():
    for bad in (
        dict(max_tokens=0),
        dict(temperature=-1.0),
        dict(top_k=0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(seed=1.5),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


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


# -----------------------------------------------------------------------------
# the scheduler alone: no request lost or duplicated, whatever the pool


@given(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["paged", "static", "oracle"]),
    requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=12),
    seed=st.integers(0, 1000),
)
def test_scheduler_never_loses_or_duplicates(num_blocks, block_size, policy, requests, seed):
    max_model_len = 24
    if policy == "static" and -(-max_model_len // block_size) > num_blocks:
        with pytest.raises(ValueError, match="static"):
            Scheduler(num_blocks, block_size, max_model_len, policy=policy, watermark=0.0)
        return
    sched = Scheduler(num_blocks, block_size, max_model_len, policy=policy, watermark=0.0, max_num_seqs=5)
    rng = random.Random(seed)
    seqs = []
    for i, (n_prompt, n_out) in enumerate(requests):
        seq = Sequence(i, [1] * n_prompt, n_out, seed=0)
        try:
            sched.add(seq)
            seqs.append(seq)
        except ValueError:
            assert -(-(n_prompt + n_out - 1) // block_size) > num_blocks or policy != "paged"
    finished = []
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty
        batch = [s.seq_id for s in out.seqs]
        assert len(batch) == len(set(batch)) <= 5
        assert len(out.slot_mapping) == len(set(out.slot_mapping))  # no two tokens share a slot
        assert all(s.status is SequenceStatus.RUNNING for s in out.seqs)
        assert {s.seq_id for s in sched.running} == set(batch)
        assert not {s.seq_id for s in sched.waiting} & set(batch)
        input_ids, positions, meta = sched.build_inputs(out)
        assert input_ids.shape == positions.shape == (len(out.slot_mapping),)
        for seq in out.seqs:
            seq.output_token_ids.append(rng.randrange(100))
            if len(seq.output_token_ids) == seq.max_tokens or rng.random() < 0.05:
                sched.finish(seq, "length")
                finished.append(seq.seq_id)
    assert not sched.has_unfinished()
    assert sorted(finished) == [s.seq_id for s in seqs]
    assert sched.block_manager.num_free_blocks == num_blocks
    if policy != "paged":
        assert sched.num_preemptions == 0


def test_emulator_backend_gives_the_same_tokens(model, prompts):
    """The decode path through the CUDA source run on the CPU (prefill stays on torch)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    torch_out = LLMEngine(model, block_size=4, num_blocks=32).generate(prompts[:4], params, use_tqdm=False)
    engine = LLMEngine(model, block_size=4, num_blocks=32, backend="emulator")
    emu_out = engine.generate(prompts[:4], params, use_tqdm=False)
    assert [o.output_token_ids for o in emu_out] == [o.output_token_ids for o in torch_out]

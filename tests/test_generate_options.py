"""What users of generate expect beyond tokens: stop strings, logprobs, streaming, batched sampling.

On the tiny transformers Llama of test_engine.py, with a word-level tokenizer ("w5" is token 5): stop strings
cut the text where a straightforward decode finds them; logprobs equal transformers' float64 log_softmax;
streamed pieces add up to the final output (also when steps fail and are retried); sampling the whole batch
at once draws exactly the tokens a per-request sampler draws.
"""

import pytest
import torch
from engine_faults import fails_once_per_step

import vllmini.sampling as sampling_module
from vllmini.engine import LLMEngine
from vllmini.errors import InvalidArgumentError, InvalidTypeError
from vllmini.model import LlamaModel
from vllmini.outputs import Logprob
from vllmini.sampling import SamplingParams, sample_batch

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # float32 engine vs float64 reference


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(3, 128)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


@pytest.fixture(scope="module")
def tok_model(hf, tokenizer):
    m = LlamaModel.from_pretrained(hf, dtype=torch.float32)
    m.tokenizer = tokenizer
    return m


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (2, 5, 8, 13, 3)]


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


# -----------------------------------------------------------------------------
# stop strings


def test_stop_strings_cut_the_text_where_they_first_appear(tok_model, tokenizer, prompts):
    engine = LLMEngine(tok_model, block_size=4, num_blocks=64)
    free = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    params, expected = [], []
    for i, o in enumerate(free):
        ids = o.output_token_ids
        words = decode(tokenizer, ids).split()
        stop = " ".join(words[2 + i % 3 : 4 + i % 3])  # spans two tokens
        # the first token after which the text holds it (it may appear earlier, e.g. "w7 w12" in "w7 w123")
        cut = next(n for n in range(1, len(ids) + 1) if stop in decode(tokenizer, ids[:n]))
        text = decode(tokenizer, ids[:cut])
        expected.append((ids[:cut], text[: text.index(stop)], stop))
        params.append(SamplingParams(max_tokens=12, ignore_eos=True, stop=["never there", stop]))
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for o, (ids, text, stop) in zip(outputs, expected, strict=True):
        assert (o.output_token_ids, o.text, o.finish_reason) == (ids, text, "stop")
        assert o.outputs[0].stop_reason == stop and stop not in o.text
    # a stop string that never appears: the request runs to max_tokens
    [o] = engine.generate(
        prompts[0], SamplingParams(max_tokens=12, ignore_eos=True, stop="w999"), use_tqdm=False
    )
    assert o.finish_reason == "length" and o.output_token_ids == free[0].output_token_ids
    assert o.outputs[0].stop_reason is None


def test_stop_strings_per_sample_and_stop_token_reason(tok_model, tokenizer, prompts):
    engine = LLMEngine(tok_model, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=10, n=4, temperature=1.0, seed=3, ignore_eos=True, stop="w1")
    [o] = engine.generate(prompts[2], params, use_tqdm=False)
    for c in o.outputs:  # "w1" starts any of w1x, w1xx: each sample stops at its own first one
        full = decode(tokenizer, c.token_ids)
        assert "w1" not in c.text and full.startswith(c.text)
        if c.finish_reason == "stop":
            assert full[len(c.text) :].startswith("w1") and c.stop_reason == "w1"
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 10
    assert sum(c.finish_reason == "stop" for c in o.outputs) >= 2  # a third of the vocabulary starts with w1
    stop_id = o.outputs[0].token_ids[0]
    [o] = engine.generate(
        prompts[2],
        SamplingParams(max_tokens=10, seed=3, temperature=1.0, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    assert (
        o.finish_reason == "stop" and o.outputs[0].stop_reason == stop_id and o.output_token_ids == [stop_id]
    )


def test_stop_strings_need_a_tokenizer(model, prompts):
    engine = LLMEngine(model, block_size=4, num_blocks=16)
    with pytest.raises(InvalidArgumentError, match=r"stop=\['x'\]\) needs a tokenizer.*stop_token_ids"):
        engine.add_request(prompts[0], SamplingParams(stop="x"))
    with pytest.raises(InvalidArgumentError, match="needs a tokenizer"):
        engine.generate(prompts, SamplingParams(stop=["x"]), use_tqdm=False)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (dict(stop=5), InvalidTypeError, "stop must be a non-empty string or a list of them, got 5"),
        (dict(stop=[""]), InvalidTypeError, "stop must be"),
        (dict(stop=["a", 1]), InvalidTypeError, "stop must be"),
        (dict(logprobs=-1), InvalidArgumentError, "logprobs.*must be >= 0, got -1"),
        (dict(logprobs=1.5), InvalidTypeError, "logprobs"),
        (dict(logprobs=True), InvalidTypeError, "logprobs.*bool"),
        (dict(output_kind="stream"), InvalidArgumentError, "output_kind must be one of"),
    ],
)
def test_option_validation(bad, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**bad)


def test_options_accepted(model):
    assert SamplingParams(stop="ab").stop == ["ab"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logprobs=torch.tensor(3)).logprobs == 3
    with pytest.raises(InvalidArgumentError, match="logprobs must be <= the vocabulary size 128, got 129"):
        LLMEngine(model, block_size=4, num_blocks=8).add_request([5], SamplingParams(logprobs=129))


# -----------------------------------------------------------------------------
# logprobs


def test_logprobs_equal_transformers_log_softmax(tok_model, hf64, prompts):
    """Greedy and sampled requests in a pool small enough to preempt: one entry per token, the drawn
    token's logprob and rank and the top-k alternatives, as transformers' float64 log_softmax."""
    engine = LLMEngine(tok_model, block_size=4, num_blocks=10, watermark=0.0)
    ks = [3, 0, 5, 1, 2]
    params = [
        SamplingParams(max_tokens=9, ignore_eos=True, logprobs=k, temperature=0.0 if i % 2 else 1.0, seed=i)
        for i, k in enumerate(ks)
    ]
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.num_preemptions > 0  # recomputed tokens get no second entry
    for prompt, o, p in zip(prompts, outputs, params, strict=True):
        assert len(o.logprobs) == len(o.output_token_ids) == 9 and o.logprobs == o.outputs[0].logprobs
        with torch.no_grad():
            full = torch.tensor([prompt + o.output_token_ids])
            ref = hf64(full).logits[0, len(prompt) - 1 : -1].log_softmax(-1)  # (9, V): row t predicts token t
        for t, (token, entry) in enumerate(zip(o.output_token_ids, o.logprobs, strict=True)):
            row, values = ref[t], ref[t].sort(descending=True).values
            assert next(iter(entry)) == token and all(isinstance(v, Logprob) for v in entry.values())
            assert abs(entry[token].logprob - float(row[token])) < TOL
            assert abs(float(values[entry[token].rank - 1]) - float(row[token])) < TOL  # its rank's value
            if p.is_greedy:
                assert entry[token].rank == 1
            top = {i: v for i, v in entry.items() if v.rank <= p.logprobs}
            assert sorted(v.rank for v in top.values()) == list(range(1, p.logprobs + 1))
            assert len(entry) in (p.logprobs, p.logprobs + 1)  # the drawn token, if not among them
            for i, v in top.items():
                assert (
                    abs(v.logprob - float(row[i])) < TOL and abs(v.logprob - float(values[v.rank - 1])) < TOL
                )
            names = ["<unk>", "<s>", "</s>"]  # special tokens show too
            assert all(v.decoded_token == (names[i] if i < 3 else f"w{i}") for i, v in entry.items())


def test_no_logprobs_unless_asked(model, prompts):
    [o] = LLMEngine(model, block_size=4, num_blocks=16).generate(
        prompts[0], SamplingParams(max_tokens=3), use_tqdm=False
    )
    assert o.logprobs is None and o.outputs[0].logprobs is None


# -----------------------------------------------------------------------------
# streaming


def _stream(engine, requests, fail=False):
    """add the requests, step to the end; every output per request, in order. fail: the forward of every
    step fails once, after writing the KV cache (the step is rolled back and retried)."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    outputs = {i: [] for i in ids}
    with fails_once_per_step(engine, enabled=fail):
        while engine.has_unfinished_requests():
            try:
                for o in engine.step():
                    outputs[o.request_id].append(o)
            except RuntimeError:
                continue
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("fail", [False, True])
def test_streamed_pieces_add_up_to_the_final_output(tok_model, prompts, fail):
    free = LLMEngine(tok_model, block_size=4, num_blocks=32).generate(
        prompts[4], SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False
    )[0]
    words = free.text.split()
    stop = f"{words[4]} {words[5][:2]}"  # e.g. "w88 w5": once "w88" is out it may be the stop's start
    kinds = ["delta", "cumulative", "final_only", "delta", "delta"]
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, output_kind=kinds[0], logprobs=2),
        SamplingParams(max_tokens=6, ignore_eos=True, output_kind=kinds[1], temperature=1.0, seed=1),
        SamplingParams(max_tokens=7, ignore_eos=True, output_kind=kinds[2]),
        SamplingParams(max_tokens=9, ignore_eos=True, output_kind=kinds[3], n=2, temperature=1.0, seed=5),
        SamplingParams(max_tokens=9, ignore_eos=True, output_kind=kinds[4], stop=[stop]),  # held back text
    ]
    final = LLMEngine(tok_model, block_size=4, num_blocks=12, watermark=0.0).generate(
        prompts, params, use_tqdm=False
    )
    engine = LLMEngine(tok_model, block_size=4, num_blocks=12, watermark=0.0)
    streams = _stream(engine, list(zip(prompts, params, strict=True)), fail=fail)
    assert engine.num_preemptions > 0
    for kind, stream, want in zip(kinds, streams, final, strict=True):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert (
            all(o.finish_reason is None for o in stream[:-1])
            and stream[-1].finish_reason == want.finish_reason
        )
        if kind == "final_only":
            assert len(stream) == 1
        assert len(stream) > 1 or kind == "final_only"
        for i, c in enumerate(want.outputs):
            pieces = [o.outputs[i] for o in stream]
            if kind == "delta":
                assert sum((p.token_ids for p in pieces), []) == c.token_ids
                assert "".join(p.text for p in pieces) == c.text
                if c.logprobs is not None:
                    assert sum((p.logprobs for p in pieces), []) == c.logprobs
            else:  # everything so far, each time
                for p in pieces:
                    assert p.token_ids == c.token_ids[: len(p.token_ids)] and c.text.startswith(p.text)
                assert pieces[-1] == c
    # the stop string never shows in the streamed text, even in part
    assert all(stop not in o.text for o in streams[4]) and streams[4][-1].finish_reason == "stop"


def test_generate_returns_whole_outputs_of_streaming_params(model, prompts):
    delta = SamplingParams(max_tokens=5, ignore_eos=True, output_kind="delta")
    got = LLMEngine(model, block_size=4, num_blocks=32).generate(prompts, delta, use_tqdm=False)
    want = LLMEngine(model, block_size=4, num_blocks=32).generate(
        prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert all(o.finished and len(o.output_token_ids) == 5 for o in got)


def test_generate_bar_shows_tokens_per_second(model, prompts, capsys):
    LLMEngine(model, block_size=4, num_blocks=32).generate(
        prompts, SamplingParams(max_tokens=4), use_tqdm=True
    )
    err = capsys.readouterr().err
    assert "5/5" in err and "output" in err and "tok/s" in err


# -----------------------------------------------------------------------------
# sampling the batch at once


def per_request_sample(logits, params, generator):
    """The per-request sampler, one request at a time (what the batched one must equal)."""
    if params.is_greedy:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.numel():
        top = logits.topk(params.top_k)
        logits = torch.full_like(logits, float("-inf")).scatter(0, top.indices, top.values)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def test_batched_sampling_draws_what_each_request_would_alone(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 128, generator=g) * 3  # (S, V)
    mix = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.6),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.05),
    ]
    draws = []
    real_draw = sampling_module._draw
    monkeypatch.setattr(sampling_module, "_draw", lambda *a: draws.append(1) or real_draw(*a))
    for trial in range(30):
        rng = torch.Generator().manual_seed(trial)
        n = int(torch.randint(1, 12, (1,), generator=rng))
        rows = torch.randint(0, 10, (n,), generator=rng).tolist()  # repeats: forked samples share a row
        params = [mix[int(i)] for i in torch.randint(0, len(mix), (n,), generator=rng)]
        seeds = [1000 * trial + j for j in range(n)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        draws.clear()
        batch = [sample_batch(logits, rows, params, gens) for _ in range(3)]  # three draws in a row
        assert len(draws) == 3 * sum(not p.is_greedy for p in params)  # only the draw is per request
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        alone = [
            [per_request_sample(logits[r], p, g) for r, p, g in zip(rows, params, gens, strict=True)]
            for _ in range(3)
        ]
        assert batch == alone
    assert (
        len(
            {
                sample_batch(
                    logits, [3], [SamplingParams(temperature=5.0)], [torch.Generator().manual_seed(s)]
                )[0]
                for s in range(40)
            }
        )
        > 3
    )


def test_batched_sampling_of_logits_that_need_grad():
    """Logits straight from a model outside no_grad still sample (the top-k/top-p sort reads them)."""
    logits = torch.randn(2, 32, requires_grad=True)
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=4)]
    tokens = sample_batch(logits, [0, 1], params, [torch.Generator().manual_seed(i) for i in range(2)])
    assert all(isinstance(t, int) and 0 <= t < 32 for t in tokens)


def test_a_bad_row_fails_alone():
    logits = torch.randn(3, 16)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=1.0)] * 3
    out = sample_batch(logits, [0, 1, 2], params, [torch.Generator().manual_seed(i) for i in range(3)])
    assert isinstance(out[1], InvalidArgumentError) and "NaN" in str(out[1])  # not drawn from (issue 28)
    assert isinstance(out[0], int) and isinstance(out[2], int)


def test_aborting_a_streaming_request_ends_its_stream(model, prompts):
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=2, ignore_eos=True, output_kind="delta")
    rid = engine.add_request(prompts[1], params)
    pieces = engine.step() + engine.step()
    assert [(o.request_id, o.finished) for o in pieces] == [(rid, False)] * 2
    assert all(len(c.token_ids) == 1 and c.finish_reason is None for o in pieces for c in o.outputs)
    assert engine.abort_request(rid)
    [last] = engine.step()
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    assert all(c.token_ids == [] for c in last.outputs)  # nothing new since the last piece
    assert not engine.has_unfinished_requests()

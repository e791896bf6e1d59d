"""The tiny random-weight transformers Llama that the model and engine tests check vllmini against, and
the float64 greedy reference with its top-2-gap rule.

GQA (4 query heads, 2 KV heads), tied embeddings and Llama-3 rope scaling, small enough for a 2-core CI.
"""

import torch
import transformers

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def hf_config(**overrides) -> transformers.LlamaConfig:
    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=500.0,
        rope_scaling=dict(LLAMA3_ROPE),
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def random_hf_model(seed=0, **overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hf_config(**overrides)).eval()


def engine_hf_model() -> transformers.LlamaForCausalLM:
    """The engine tests' model: longer contexts than test_model's (rope scaling starts at 32 positions,
    by a factor of 4), 128 positions."""
    rope = {**LLAMA3_ROPE, "factor": 4.0, "original_max_position_embeddings": 32}
    return random_hf_model(0, max_position_embeddings=128, rope_scaling=rope)


def float64_copy(hf: transformers.LlamaForCausalLM) -> transformers.LlamaForCausalLM:
    """The same weights in float64: the reference the engine's float32 tokens are checked against."""
    m = transformers.LlamaForCausalLM(hf.config).eval()
    m.load_state_dict(hf.state_dict())
    return m.double()


TIE = 1e-4  # a top-2 logit gap below this is a genuine tie: float32 may pick either token


def greedy_reference(hf64: transformers.LlamaForCausalLM, prompt, max_tokens: int) -> tuple[list, list]:
    """transformers' greedy tokens (float64, the whole sequence recomputed each step) and the gap between
    the two largest logits at each step."""
    ids, tokens, gaps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf64(torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top2[0] - top2[1]))
            ids.append(tokens[-1])
    return tokens, gaps


def assert_greedy(got: list, ref: tuple) -> bool:
    """Same tokens as the reference (its first len(got)), except after a genuine near-tie (top-2 gap
    below TIE), where anything may follow. True if all of them agree."""
    tokens, gaps = ref
    tokens, gaps = tokens[: len(got)], gaps[: len(got)]
    assert len(got) == len(tokens), (got, tokens)
    diff = next((t for t in range(len(tokens)) if got[t] != tokens[t]), None)
    if diff is not None:
        assert gaps[diff] < TIE, f"token {diff} differs: {got} vs {tokens} (top-2 gap {gaps[diff]:.2e})"
    return diff is None


def assert_same_greedy(outputs, reference) -> None:
    """Each output (a RequestOutput or a token list) has its reference's greedy tokens, except that after a
    genuine tie anything may follow; ties are rare, so at most one output may differ (this cannot pass by
    accident)."""
    tokens = [getattr(o, "output_token_ids", o) for o in outputs]
    full = sum(assert_greedy(got, ref) for got, ref in zip(tokens, reference, strict=True))
    assert full >= len(reference) - 1

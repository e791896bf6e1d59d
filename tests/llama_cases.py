"""The tiny random-weight transformers Llama that test_model.py and test_engine.py check vllmini against.

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

"""A Llama-family decoder whose attention reads and writes the paged KV cache.

The model is the usual Llama stack (token embedding, N x [RMSNorm -> grouped-query attention with
rotary embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual], RMSNorm, lm_head), written out in
one file. What is different from a textbook decoder is the batch it eats: one flat list of tokens
from many sequences at once, `input_ids [num_tokens]` and `positions [num_tokens]`, plus an
`AttentionMetadata` (from vllmini.attention) that says where each token's K/V goes (`slot_mapping`) and
which pages each sequence reads (`block_tables`, `seq_lens`). Prefill sequences come first (each several
new tokens, `paged_prefill_attention`), decode sequences after (one new token each, `paged_attention`),
so a step that mixes both is still one forward. The forward returns the logits of each sequence's last
token. Weights load from a Hugging Face checkpoint or a `transformers` model (vllmini.loader).
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllmini.attention import (
    AttentionMetadata,
    check_block_tables,
    guarded_by_default,
    paged_attention,
    paged_prefill_attention,
    to_device,  # noqa: F401 (re-exported, as AttentionMetadata is)
)
from vllmini.checks import as_float, as_int, one_of
from vllmini.errors import CheckpointError, InvalidArgumentError, InvalidTypeError
from vllmini.kv_cache import check_slot_mapping, reshape_and_cache
from vllmini.loader import (
    as_dict,
    load_hf_state_dict,
    read_chat_template,
    read_checkpoint,
    read_checkpoint_file,
    read_json,
)

ROPE_KEYS = {  # rope type -> what it reads from its scaling dict
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# -----------------------------------------------------------------------------
# config


@dataclass
class LlamaConfig:
    """The numbers that define a Llama-family model (the keys of its config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None = num_attention_heads (MHA)
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...}; None = plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        for name in "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads".split():
            setattr(self, name, as_int(getattr(self, name), name, min=1))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            setattr(self, name, as_int(getattr(self, name), name, min=1))
        self.rms_norm_eps = as_float(self.rms_norm_eps, "rms_norm_eps", min=0.0)
        self.rope_theta = as_float(self.rope_theta, "rope_theta")
        if self.rope_theta <= 0:
            raise InvalidArgumentError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgumentError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise InvalidTypeError(f"rope_scaling must be a dict or None, got {self.rope_scaling!r}")
            scaling = dict(self.rope_scaling)
            old_name = scaling.pop("type", None)  # older configs' key for rope_type
            kind = one_of(scaling.setdefault("rope_type", old_name), "rope type", ROPE_KEYS)
            missing = [key for key in ROPE_KEYS[kind] if key not in scaling]
            if missing:
                raise InvalidArgumentError(f"rope_scaling of type {kind!r} lacks {missing}")
            for key in ROPE_KEYS[kind]:
                as_float(scaling[key], f"rope_scaling[{key!r}]")
            self.rope_scaling = None if kind == "default" else scaling

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """From a Hugging Face config dict, with either rope key style: older `rope_theta` +
        `rope_scaling`, or newer `rope_parameters` (which holds rope_theta and rope_type together)."""
        one_of(d.get("model_type", "llama"), "model_type", ("llama",))
        one_of(d.get("hidden_act", "silu"), "hidden_act (SwiGLU)", ("silu",))
        rope = dict(as_dict(d.get("rope_parameters"), "rope_parameters"))
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if not rope:  # the older style: the scaling dict sits on its own
            rope = dict(as_dict(d.get("rope_scaling"), "rope_scaling"))
        one_of(rope.pop("partial_rotary_factor", 1.0), "partial_rotary_factor", (1.0,))
        missing = [f.name for f in fields(cls) if f.default is MISSING and d.get(f.name) is None]
        if missing:
            raise InvalidArgumentError(f"the config lacks {missing}")
        kwargs = {f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None}
        kwargs.update(rope_theta=theta, rope_scaling=rope or None)  # as read above, in either style
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> LlamaConfig:
        """From the config.json in checkpoint directory `path`; a bad file is a CheckpointError naming it."""
        return read_checkpoint_file(Path(path) / "config.json", lambda f: cls.from_dict(read_json(f)))


# -----------------------------------------------------------------------------
# the layers


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as Llama does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm upcasts to float32 inside and rounds once: Llama's x.float() * rsqrt(...) .to(dtype),
        # in one kernel instead of seven (a decode step launches two per layer)
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Rotation frequency of each pair of head dims (head_dim // 2,), with Llama-3 / linear scaling.

    Llama 3 stretches long wavelengths (low frequencies) by `factor`, keeps short ones, and blends
    linearly in between, so a model trained on `original_max_position_embeddings` reads longer text.
    """
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    scaling = config.rope_scaling or {}  # {}: plain RoPE
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # 0 for wavelengths longer than old_len / lo (fully scaled), 1 below old_len / hi (unscaled)
        smooth = ((old_len / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq.float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair by the position's angle. x (T, nh, hd); cos/sin (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # (T, nh, hd)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Grouped-query attention over the paged cache: write the new K/V, then read every page."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias, h = config.attention_bias, config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)

    def forward(self, x, cos, sin, key_cache, value_cache, meta: AttentionMetadata, backend: str):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # (T, nh, hd)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, nkv, hd)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, nkv, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # new tokens into their slots; the model checked slot_mapping and block_tables once this forward
        reshape_and_cache(
            k, v, key_cache, value_cache, meta.slot_mapping, validate=False, padding=meta.has_padding
        )
        # the batch is prefills first: their new tokens are rows [0, split), one row per decode follows
        split, num_prefills = meta.num_prefill_tokens, meta.num_prefills
        # a decode-only batch takes the attention's output as is (no buffer, no copy: fewer launches)
        out = torch.empty_like(q) if num_prefills else None  # (T, nh, hd)
        if num_prefills:  # only the torch backend has a prefill path
            out[:split] = paged_prefill_attention(
                q[:split],
                key_cache,
                value_cache,
                meta.block_tables[:num_prefills],
                meta.seq_lens[:num_prefills],
                meta.query_start_loc[: num_prefills + 1],
                backend="torch" if backend in ("cupy", "emulator") else backend,
            )
        if meta.num_decodes:
            decoded = paged_attention(
                q[split:],
                key_cache,
                value_cache,
                meta.block_tables[num_prefills:],
                meta.seq_lens[num_prefills:],
                backend=backend,
                # the model checked the tables on the host this forward, or the kernel's guard checks them
                validate="guard" if guarded_by_default(backend, q.device, q.dtype) else False,
            )  # (T - split, nh, hd)
            if out is None:
                out = decoded
            else:
                out[split:] = decoded
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, key_cache, value_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_cache, value_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------
# the model


class LlamaModel(nn.Module):
    """Llama decoder + lm_head. Parameter names match Hugging Face's without the `model.` prefix."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # rotary frequencies (hd/2,), float32: a plain attribute, not a buffer, so that model.to(bfloat16)
        # cannot round them; forward moves them to the input's device
        self.inv_freq = rope_inv_freq(config)
        self.tokenizer = None  # a tokenizers.Tokenizer when the checkpoint has tokenizer.json
        self.chat_template: str | None = None  # Jinja text, when the checkpoint has one
        eos = config.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(
            eos if isinstance(eos, list) else [] if eos is None else [eos]
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,) int
        positions: torch.Tensor,  # (num_tokens,) int: each token's index in its sequence
        kv_cache,  # a PagedKVCache (anything with per-layer .key_caches / .value_caches)
        meta: AttentionMetadata,
        *,
        backend: str = "auto",
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Logits (num_seqs, vocab) of each sequence's last new token; all_logits: (num_tokens, vocab)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise InvalidArgumentError(
                f"input_ids and positions must both be [num_tokens], got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        self._check_cache(kv_cache)
        # Check where this step writes and reads ONCE, on the host, for all layers: each layer's
        # reshape_and_cache and paged_attention then skip their own checks (a host sync each).
        num_blocks, block_size = kv_cache.key_caches[0].shape[:2]
        if meta.slot_mapping.shape != input_ids.shape:
            raise InvalidArgumentError(
                f"meta.slot_mapping must be [num_tokens] = [{input_ids.shape[0]}], "
                f"got {tuple(meta.slot_mapping.shape)}"
            )
        guarded = guarded_by_default(backend, input_ids.device, kv_cache.key_caches[0].dtype)
        if not meta.host_checked:
            check_slot_mapping(meta.slot_mapping, num_blocks * block_size, allow_padding=False)
        if meta.num_decodes and not guarded and not meta.host_checked:
            decodes = slice(meta.num_prefills, None)  # (with the guard: no sync here; the engine checks)
            check_block_tables(meta.block_tables[decodes], meta.seq_lens[decodes], num_blocks, block_size)
        x = self.embed_tokens(input_ids)  # (T, hidden)
        self.inv_freq = self.inv_freq.to(positions.device)  # the same tensor when already there
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hd/2), float32 as in Llama
        angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache.key_caches[i], kv_cache.value_caches[i], meta, backend)
        if not all_logits:
            x = x[meta.last_token_indices]  # (num_seqs, hidden)
        return self.lm_head(self.norm(x))

    def _check_cache(self, kv_cache) -> None:
        config, shape = self.config, kv_cache.key_caches[0].shape
        want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, self.dtype)
        got = (len(kv_cache.key_caches), shape[2], shape[3], kv_cache.key_caches[0].dtype)
        if got != want:
            raise InvalidArgumentError(
                f"kv_cache has (num_layers, num_kv_heads, head_size, dtype) = {got}; this model needs {want}"
            )
        # every layer's cache must have layer 0's shape: one check of the slots and tables holds for all
        for i, (kc, vc) in enumerate(zip(kv_cache.key_caches, kv_cache.value_caches, strict=True)):
            if kc.shape != shape or vc.shape != shape:
                raise InvalidArgumentError(
                    f"layer {i}'s cache is {tuple(kc.shape)}, layer 0's is {tuple(shape)}"
                )

    @classmethod
    def from_pretrained(
        cls, path_or_hf_model, dtype: torch.dtype | None = None, device: str | torch.device | None = None
    ) -> LlamaModel:
        """From a checkpoint directory (config.json + model.safetensors or a sharded
        model.safetensors.index.json; tokenizer.json and generation_config.json when present) or
        from an in-memory transformers LlamaForCausalLM (whose tensors are shared, not copied, when
        dtype and device already match). dtype defaults to the stored weights'. (vllmini.loader)"""
        if dtype is not None and dtype not in DTYPES:
            raise InvalidTypeError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        ckpt = read_checkpoint(path_or_hf_model, LlamaConfig.from_dict)
        state, where = ckpt.state, ckpt.where
        embed = state.get("model.embed_tokens.weight", state.get("embed_tokens.weight"))  # prefix optional
        if embed is None:
            raise CheckpointError(f"{where} has no model.embed_tokens.weight: not a Llama checkpoint")
        dtype = dtype if dtype is not None else embed.dtype
        if dtype not in DTYPES:
            raise CheckpointError(f"{where} stores {dtype} weights; pass dtype= one of {DTYPES} to convert")
        with torch.device("meta"):  # no memory, no random init: the weights come next
            model = cls(ckpt.config)
        device = device if device is not None else ckpt.device
        load_hf_state_dict(model, state, dtype, torch.device(device or "cpu"), where)
        model.tokenizer = ckpt.tokenizer
        model.chat_template = read_chat_template(path_or_hf_model)
        eos = ckpt.generation.get("eos_token_id")
        if eos is not None:
            model.eos_token_ids = tuple(eos if isinstance(eos, list) else [eos])
        return model.eval()

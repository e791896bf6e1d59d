"""A Llama-family decoder on the paged KV cache (notebook 06): one flat batch of tokens from many sequences,
`AttentionMetadata` saying where each token's K/V goes; weights read by vllmini.models."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import vllmini.models as hf  # reading a Hugging Face checkpoint
from vllmini.attention import (
    AttentionMetadata,
    guarded_by_default,
    paged_attention,
    paged_prefill_attention,
    resolve_backend,
)
from vllmini.checks import as_float, as_int, cdiv, one_of
from vllmini.cuda_kernels import LAYER_OP_HIDDEN, LAYER_OP_THREADS, launch_layer_op
from vllmini.errors import CheckpointError, InvalidArgumentError, InvalidTypeError
from vllmini.kv_cache import FLOAT_DTYPES, reshape_and_cache

ROPE_KEYS = {  # rope type -> what it reads from its scaling dict
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


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
            if missing := [key for key in ROPE_KEYS[kind] if key not in scaling]:
                raise InvalidArgumentError(f"rope_scaling of type {kind!r} lacks {missing}")
            for key in ROPE_KEYS[kind]:
                as_float(scaling[key], f"rope_scaling[{key!r}]")
            self.rope_scaling = None if kind == "default" else scaling

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """From a Hugging Face config dict (`rope_theta` + `rope_scaling`, or newer `rope_parameters`)."""
        one_of(d.get("model_type", "llama"), "model_type", ("llama",))
        one_of(d.get("hidden_act", "silu"), "hidden_act (SwiGLU)", ("silu",))
        rope = dict(hf.as_dict(d.get("rope_parameters"), "rope_parameters"))
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if not rope:  # the older style: the scaling dict sits on its own
            rope = dict(hf.as_dict(d.get("rope_scaling"), "rope_scaling"))
        one_of(rope.pop("partial_rotary_factor", 1.0), "partial_rotary_factor", (1.0,))
        if missing := [f.name for f in fields(cls) if f.default is MISSING and d.get(f.name) is None]:
            raise InvalidArgumentError(f"the config lacks {missing}")
        kwargs = {f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None}
        kwargs.update(rope_theta=theta, rope_scaling=rope or None)  # as read above, in either style
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> LlamaConfig:
        """From the config.json in checkpoint directory `path`."""
        return hf.read_checkpoint_file(Path(path) / "config.json", lambda f: cls.from_dict(hf.read_json(f)))


class Rope(NamedTuple):
    """The rotary tables of a forward: per token (PyTorch), or per position (kernels/layer_ops.cu)."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    positions: torch.Tensor | None = None  # None: tables (T, 1, hd); else (max_position_embeddings, hd)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as Llama does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fused: bool = False):
        """(norm(x + residual), x + residual) as vLLM's fused_add_rms_norm; (norm(x), x) without `residual`.
        fused: one kernel, the sum written over `residual`."""
        if fused and all(t.data_ptr() % 16 == 0 for t in (x, self.weight, residual) if t is not None):
            out, (T, H) = torch.empty_like(x), x.shape  # the kernel reads rows 16 bytes at a time
            launch_layer_op("add_rms_norm", x, (T,), (out, residual, x, self.weight), (H,), (self.eps,))
            return out, x if residual is None else residual
        x = x if residual is None else x + residual
        # upcasts to float32 inside and rounds once, as Llama does, in one kernel instead of seven
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps), x


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Rotation frequency of each pair of head dims (head_dim // 2,), with linear or Llama-3 scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    scaling = config.rope_scaling or {}  # {}: plain RoPE
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # 0 for wavelengths over old_len / lo (stretched), 1 below old_len / hi (kept), blended in between
        smooth = ((old_len / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin (T, 1, hd) of each position (the sin's first half negated for `apply_rotary`)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2), float32 as in Llama
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair by the position's angle: x * cos + (-x2, x1) * sin, with the
    halves swapped by one flip and the sign in `signed_sin`. x (T, nh, hd); cos/signed_sin (T, 1, hd)."""
    T, nh, hd = x.shape
    swapped = x.reshape(T, nh, 2, hd // 2).flip(2).view(T, nh, hd)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin)  # (T, nh, hd)


class MergedLinear(nn.Linear):
    """Projections of one input as one GEMM (vLLM's MergedColumnParallelLinear); `parts`: HF name -> rows."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts


class Attention(nn.Module):
    """Grouped-query attention over the paged cache: write the new K/V, then read every page."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, bias, h = config.head_dim, config.attention_bias, config.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(h, parts, bias)  # q, k and v in one GEMM
        self.o_proj = nn.Linear(q_size, h, bias=bias)

    def forward(self, x, rope: Rope, key_cache, value_cache, meta: AttentionMetadata, backend: str, validate):
        T, nh, hd = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (nh + 2 nkv) hd)
        if rope.positions is not None:  # one kernel: q rotated into its own tensor, k and v into the cache
            q, slots = x.new_empty(T, nh, hd), meta.slot_mapping.long()
            tensors = (q, key_cache, value_cache, qkv, rope.cos, rope.sin_signed, rope.positions, slots)
            ints = (nh, self.num_kv_heads, hd, rope.cos.shape[0], key_cache.shape[0] * key_cache.shape[1])
            launch_layer_op("rope_and_cache", qkv, (T, nh + 2 * self.num_kv_heads), tensors, ints)
        else:
            qk = apply_rotary(qkv[:, : -self.num_kv_heads * hd].view(T, -1, hd), rope.cos, rope.sin_signed)
            q, k = qk[:, :nh].contiguous(), qk[:, nh:]  # (T, nh, hd) as attention takes it, (T, nkv, hd)
            v = qkv[:, -self.num_kv_heads * hd :].view(T, self.num_kv_heads, hd)  # (T, nkv, hd)
            # the model checked slot_mapping and block_tables once for all layers
            reshape_and_cache(
                k, v, key_cache, value_cache, meta.slot_mapping, validate=False, padding=meta.has_padding
            )
        n, split = meta.num_prefills, meta.num_prefill_tokens  # prefills: sequences [0, n), rows [0, split)
        tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
        out = torch.empty_like(q) if n else None  # (T, nh, hd); decode-only: no buffer
        if n:
            prefill = "torch" if backend in ("cupy", "emulator") else backend  # only torch has a prefill path
            out[:split] = paged_prefill_attention(
                q[:split], key_cache, value_cache, tables[:n], lens[:n], starts[: n + 1], backend=prefill
            )
        if meta.num_decodes:
            decoded = paged_attention(
                q[split:],
                key_cache,
                value_cache,
                tables[n:],
                lens[n:],
                backend=backend,
                validate=validate,  # "guard", or False: the model checked the tables (check_metadata)
                max_seq_len=meta.max_decode_seq_len,  # known on the host: the kernels' splits
            )  # (T - split, nh, hd)
            if out is None:
                out = decoded
            else:
                out[split:] = decoded
        return self.o_proj(out.reshape(T, nh * hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inner, "up_proj": inner}, bias)  # one GEMM
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 inner)
        if fused:  # one kernel
            T, inner = x.shape[0], gate_up.shape[1] // 2
            h = gate_up.new_empty(T, inner)
            launch_layer_op("silu_and_mul", h, (T, cdiv(inner, LAYER_OP_THREADS)), (h, gate_up), (inner,))
            return self.down_proj(h)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, inner) views each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, rope: Rope, key_cache, value_cache, meta, backend, validate):
        """(output, residual before it is added: the next norm adds it); residual None: the first layer."""
        fused = rope.positions is not None  # kernels/layer_ops.cu
        h, residual = self.input_layernorm(x, residual, fused)
        h = self.self_attn(h, rope, key_cache, value_cache, meta, backend, validate)
        h, residual = self.post_attention_layernorm(h, residual, fused)
        return self.mlp(h, fused), residual


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
        # (hd/2,) float32: not a buffer, so model.to(bfloat16) cannot round it
        self.inv_freq = rope_inv_freq(config)
        self._rope_tables: dict = {}  # (device, dtype) -> [cos, signed sin] (positions, hd): `rope_tables`
        h = config.hidden_size  # add_rms_norm reads 16-byte chunks of a row: 8 16-bit elements
        self.fits_layer_ops = h <= LAYER_OP_HIDDEN and h % 8 == 0 and config.head_dim <= LAYER_OP_THREADS
        self.tokenizer = None  # a tokenizers.Tokenizer when the checkpoint has tokenizer.json
        self.chat_template: str | None = None  # Jinja text, when the checkpoint has one
        eos = config.eos_token_id  # an int, a list of ints, or None
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])

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
        if meta.slot_mapping.shape != input_ids.shape:
            raise InvalidArgumentError(
                f"meta.slot_mapping must be [num_tokens] = [{input_ids.shape[0]}], "
                f"got {tuple(meta.slot_mapping.shape)}"
            )
        meta, validate = self.check_metadata(meta, kv_cache, backend)
        x = self.embed_tokens(input_ids)  # (T, hidden)
        self.inv_freq = self.inv_freq.to(positions.device)  # the same tensor when already there
        # kernels/layer_ops.cu wherever attention runs a kernel ("cupy", "emulator"), within its sizes
        fused = self.fits_layer_ops and kv_cache.key_caches[0].is_contiguous()
        if fused and resolve_backend(backend, x.device, x.dtype) != "torch":
            rope = self.rope_tables(positions)
        else:
            fused, rope = False, Rope(*rope_cos_sin(positions, self.inv_freq, x.dtype))
        residual = None
        for layer, kc, vc in zip(self.layers, kv_cache.key_caches, kv_cache.value_caches, strict=True):
            x, residual = layer(x, residual, rope, kc, vc, meta, backend, validate)
        if not all_logits and x.shape[0] != meta.num_seqs:  # else one token a sequence: each is its last
            x, residual = x[meta.last_token_indices], residual[meta.last_token_indices]  # (num_seqs, hidden)
        return self.lm_head(self.norm(x, residual, fused)[0])

    def rope_tables(self, positions: torch.Tensor) -> Rope:
        """Tables of every position by `rope_cos_sin`, once per device and dtype; `positions` as int64."""
        key = (positions.device, self.dtype)
        if key not in self._rope_tables:
            every = torch.arange(self.config.max_position_embeddings, device=positions.device)
            self._rope_tables[key] = [t[:, 0] for t in rope_cos_sin(every, self.inv_freq, self.dtype)]
        return Rope(*self._rope_tables[key], positions.long())

    def check_metadata(
        self, meta: AttentionMetadata, kv_cache, backend: str
    ) -> tuple[AttentionMetadata, str | bool]:
        """Check slots (and tables unless the kernel guards) ONCE for all layers: (meta, "guard" or False)."""
        guarded = guarded_by_default(backend, self.device, self.dtype)
        if not meta.host_checked:
            meta = dataclasses.replace(meta)
            meta.check_on_host(*kv_cache.key_caches[0].shape[:2], tables=not guarded)
        return meta, "guard" if guarded else False

    def _check_cache(self, kv_cache) -> None:
        config, shape = self.config, kv_cache.key_caches[0].shape
        want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, self.dtype)
        got = (len(kv_cache.key_caches), shape[2], shape[3], kv_cache.key_caches[0].dtype)
        if got != want:
            raise InvalidArgumentError(
                f"kv_cache has (num_layers, num_kv_heads, head_size, dtype) = {got}; this model needs {want}"
            )
        for i, (kc, vc) in enumerate(zip(kv_cache.key_caches, kv_cache.value_caches, strict=True)):
            if kc.shape != shape or vc.shape != shape:
                raise InvalidArgumentError(
                    f"layer {i}'s cache is {tuple(kc.shape)}, layer 0's is {tuple(shape)}"
                )

    @classmethod
    def from_pretrained(
        cls, path_or_hf_model, dtype: torch.dtype | None = None, device: str | torch.device | None = None
    ) -> LlamaModel:
        """From a checkpoint directory or an in-memory transformers LlamaForCausalLM (dtype None: stored)."""
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise InvalidTypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        ckpt = hf.read_checkpoint(path_or_hf_model, LlamaConfig.from_dict)
        state, where = ckpt.state, ckpt.where
        embed = state.get("model.embed_tokens.weight", state.get("embed_tokens.weight"))  # prefix optional
        if embed is None:
            raise CheckpointError(f"{where} has no model.embed_tokens.weight: not a Llama checkpoint")
        dtype = dtype if dtype is not None else embed.dtype
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{where} stores {dtype} weights; pass dtype= one of {FLOAT_DTYPES} to convert"
            )
        with torch.device("meta"):  # no memory, no random init: the weights come next
            model = cls(ckpt.config)
        device = device if device is not None else ckpt.device
        hf.load_hf_state_dict(model, state, dtype, torch.device(device or "cpu"), where)
        model.tokenizer = ckpt.tokenizer
        model.chat_template = hf.read_chat_template(path_or_hf_model)
        eos = ckpt.generation.get("eos_token_id")
        if eos is not None:
            eos = eos if isinstance(eos, list) else [eos]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
                raise CheckpointError(
                    f"{ckpt.where}: generation_config.json's eos_token_id must be an int or a list of ints, "
                    f"got {ckpt.generation['eos_token_id']!r}"
                )
            model.eos_token_ids = tuple(eos)
        return model.eval()

"""Paged attention: attention whose keys and values are read from a paged KV cache via block tables.

Decode (`paged_attention`): one new query token per sequence attends to the sequence's whole context.
Prefill (`paged_prefill_attention`): each sequence's new tokens (its last ones, already written to the
cache) attend causally to everything before them. Token t of sequence s lives at
    key_cache[block_tables[s, t // block_size], t % block_size]    # (num_kv_heads, head_size)

Everything is validated on the host before any backend runs (`validate_decode_args`). The "torch"
backend here is the naive one: gather the pages into a contiguous tensor, then ordinary attention with
a float32 softmax. "cupy" (a CUDA kernel on a GPU) and "emulator" (the same CUDA source on the CPU)
live in `vllmini.cuda_kernels` and are imported only when asked for. "auto" picks "cupy" for CUDA
tensors of a dtype the kernels take (KERNEL_DTYPES) when CuPy works, else "torch"; never the emulator.

Index dtypes: block_tables, seq_lens and query_start_loc may be int32 (vLLM's choice) or int64; they
are normalized to contiguous int32. Padding entries of block_tables (past a sequence's length) are
never read, whatever they hold (-1, garbage).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import NamedTuple

import torch

from vllmini.kv_cache import _check_cache_pair

BACKENDS = ("auto", "torch", "cupy", "emulator")
INDEX_DTYPES = (torch.int32, torch.int64)


class DecodeArgs(NamedTuple):
    """Validated decode inputs: contiguous tensors, int32 indices, a float scale."""

    query: torch.Tensor  # (num_seqs, num_heads, head_size)
    key_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_size)
    block_tables: torch.Tensor  # (num_seqs, max_num_blocks_per_seq) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32
    scale: float
    max_seq_len: int  # max(seq_lens), 0 for an empty batch


class PrefillArgs(NamedTuple):
    """Validated prefill inputs; query holds every sequence's new tokens back to back."""

    query: torch.Tensor  # (num_tokens, num_heads, head_size)
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_num_blocks_per_seq) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    scale: float
    max_seq_len: int
    max_query_len: int


# ----------------------------------------------------------------------------- validation


def _check_index_tensor(name: str, t, shape_desc: str, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_desc}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the caches are on {device}")


def _check_query(query, key_cache: torch.Tensor, what: str) -> None:
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [{what}, num_heads, head_size], got shape {tuple(query.shape)}")
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query is {query.dtype} but the caches are {key_cache.dtype}; they must match")
    if query.device != key_cache.device:
        raise ValueError(f"query is on {query.device} but the caches are on {key_cache.device}")
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} != cache head_size {head_size}")
    num_heads = query.shape[1]
    if num_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )


def _check_scale(scale, head_size: int) -> float:
    if scale is None:
        return head_size**-0.5
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    return float(scale)


def _check_tables(
    key_cache: torch.Tensor, block_tables, seq_lens, num_seqs: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check block_tables/seq_lens against the cache; return them as contiguous int32 and max(seq_lens)."""
    device = key_cache.device
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    _check_index_tensor("block_tables", block_tables, "[num_seqs, max_num_blocks_per_seq]", 2, device)
    _check_index_tensor("seq_lens", seq_lens, "[num_seqs]", 1, device)
    if block_tables.shape[0] != num_seqs or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_num_blocks_per_seq>=1], "
            f"got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got shape {tuple(seq_lens.shape)}")
    if num_seqs == 0:
        return block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(), 0

    max_blocks = block_tables.shape[1]
    max_len = max_blocks * block_size
    lens = seq_lens.to(torch.int64)  # (num_seqs,)
    bad_len = (lens < 1) | (lens > max_len)
    num_used = (lens.clamp(1, max_len) + block_size - 1) // block_size  # blocks each sequence reads
    used = torch.arange(max_blocks, device=device)[None, :] < num_used[:, None]  # (num_seqs, max_blocks)
    bt = block_tables.to(torch.int64)
    bad_page = used & ((bt < 0) | (bt >= num_blocks))
    # one host sync for all checks
    any_bad_len, any_bad_page, longest = torch.stack([bad_len.any(), bad_page.any(), lens.max()]).tolist()
    if any_bad_len:
        i = int(bad_len.nonzero()[0, 0])
        raise ValueError(
            f"seq_lens[{i}] = {int(lens[i])} is out of range: expected 1 .. max_num_blocks_per_seq "
            f"* block_size = {max_blocks} * {block_size} = {max_len}"
        )
    if any_bad_page:
        s, j = (int(x) for x in bad_page.nonzero()[0])
        raise ValueError(
            f"block_tables[{s}, {j}] = {int(bt[s, j])} is not a block id in [0, {num_blocks}) "
            f"(sequence {s} has seq_len {int(lens[s])}, so it reads blocks 0..{int(num_used[s]) - 1})"
        )
    return block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(), int(longest)


def validate_decode_args(
    query: torch.Tensor,  # (num_seqs, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int32/int64
    seq_lens: torch.Tensor,  # (num_seqs,) int32/int64
    scale: float | None = None,
) -> DecodeArgs:
    """Check every decode input (raising ValueError/TypeError that names it) and normalize it.

    Returns contiguous copies where needed (a strided cache is copied whole: correct, not fast),
    int32 block_tables/seq_lens, the resolved scale and max(seq_lens). Needs one host sync.
    """
    _check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "num_seqs")
    scale = _check_scale(scale, key_cache.shape[3])
    block_tables, seq_lens, max_seq_len = _check_tables(key_cache, block_tables, seq_lens, query.shape[0])
    return DecodeArgs(
        query.contiguous(),
        key_cache.contiguous(),
        value_cache.contiguous(),
        block_tables,
        seq_lens,
        scale,
        max_seq_len,
    )


def validate_prefill_args(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq)
    seq_lens: torch.Tensor,  # (num_seqs,)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,)
    scale: float | None = None,
) -> PrefillArgs:
    """Like `validate_decode_args`, plus query_start_loc: starts at 0, ends at num_tokens, and each
    sequence has 1 .. seq_len new tokens (its last ones)."""
    _check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "num_tokens")
    scale = _check_scale(scale, key_cache.shape[3])
    _check_index_tensor(
        "block_tables", block_tables, "[num_seqs, max_num_blocks_per_seq]", 2, key_cache.device
    )
    num_seqs = block_tables.shape[0]
    _check_index_tensor("query_start_loc", query_start_loc, "[num_seqs + 1]", 1, key_cache.device)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}] (num_seqs from block_tables), "
            f"got shape {tuple(query_start_loc.shape)}"
        )
    block_tables, seq_lens, max_seq_len = _check_tables(key_cache, block_tables, seq_lens, num_seqs)
    starts = query_start_loc.tolist()
    num_tokens = query.shape[0]
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens={num_tokens}, "
            f"got {starts[0]} .. {starts[-1]}"
        )
    max_query_len = 0
    for i, n in enumerate(seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        if not 1 <= q_len <= n:
            raise ValueError(
                f"sequence {i} has {q_len} query tokens (query_start_loc[{i}:{i + 2}] = "
                f"{starts[i : i + 2]}); expected 1 .. seq_lens[{i}] = {n}"
            )
        max_query_len = max(max_query_len, q_len)
    return PrefillArgs(
        query.contiguous(),
        key_cache.contiguous(),
        value_cache.contiguous(),
        block_tables,
        seq_lens,
        query_start_loc.to(torch.int32).contiguous(),
        scale,
        max_seq_len,
        max_query_len,
    )


# ----------------------------------------------------------------------------- the torch backend


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 math for half types (and float32); float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _decode_torch(a: DecodeArgs) -> torch.Tensor:
    """Naive paged decode: gather every sequence's tokens (padded to the longest), then attention."""
    q, kc, vc = a.query, a.key_cache, a.value_cache
    num_seqs, num_heads, head_size = q.shape
    num_blocks, block_size, num_kv_heads = kc.shape[:3]
    group = num_heads // num_kv_heads  # query heads per kv head
    acc = _acc_dtype(q.dtype)
    L = a.max_seq_len
    lens = a.seq_lens.long()[:, None]  # (S, 1)
    nb = -(-L // block_size)  # blocks of the longest sequence
    used = torch.arange(nb, device=q.device)[None, :] * block_size < lens  # (S, nb)
    pages = torch.where(used, a.block_tables[:, :nb].long(), 0)  # padding entries -> page 0, masked below
    valid = torch.arange(L, device=q.device)[None, :] < lens  # (S, L)
    # the gather: copy each sequence's pages out of the pool, one contiguous (S, L, kvh, hs) tensor each
    # for K and V (indexing dim 0 of the pool copies whole pages: the fastest gather torch has)
    k = kc[pages].flatten(1, 2)[:, :L]  # (S, nb * block_size, kvh, hs) -> (S, L, kvh, hs)
    v = vc[pages].flatten(1, 2)[:, :L]
    # slots past a seq_len hold stale data or NaN: their scores become -inf below, and their values
    # must be zeroed too, because a zero weight times a NaN value is still NaN
    v = v.masked_fill(~valid[:, :, None, None], 0)
    k, v = k.to(acc).permute(0, 2, 3, 1), v.to(acc).transpose(1, 2)  # (S, kvh, hs, L), (S, kvh, L, hs)
    qg = q.view(num_seqs, num_kv_heads, group, head_size).to(acc)  # (S, kvh, G, hs)
    scores = (qg @ k) * a.scale  # (S, kvh, G, L)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # (S, kvh, G, hs)
    return out.reshape(num_seqs, num_heads, head_size).to(q.dtype)


def _prefill_torch(a: PrefillArgs) -> torch.Tensor:
    """Naive paged prefill, one sequence at a time: gather its pages, then causal attention."""
    q, kc, vc = a.query, a.key_cache, a.value_cache
    num_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads
    acc = _acc_dtype(q.dtype)
    out = torch.empty_like(q)
    starts, lens = a.query_start_loc.tolist(), a.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        n = end - start  # new tokens: positions seq_len - n .. seq_len - 1
        pages = a.block_tables[i, : -(-seq_len // block_size)].long()
        k = kc[pages].flatten(0, 1)[:seq_len].to(acc)  # (L, kvh, hs)
        v = vc[pages].flatten(0, 1)[:seq_len].to(acc)
        qi = q[start:end].view(n, num_kv_heads, group, head_size).to(acc)  # (n, kvh, G, hs)
        scores = torch.einsum("qkgd,lkd->kgql", qi, k) * a.scale  # (kvh, G, n, L)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]  # (n, L)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("kgql,lkd->qkgd", probs, v).reshape(n, num_heads, head_size)
    return out


# ----------------------------------------------------------------------------- dispatch


@functools.cache
def cupy_usable() -> bool:
    """True when CuPy imports and sees a CUDA device (checked once)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _check_backend_name(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# dtypes the CUDA kernels take today; "auto" sends anything else to torch instead of failing
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Turn "auto" into a concrete backend for tensors on `device`; reject impossible pairs.

    "auto" is "cupy" for CUDA tensors of a kernel dtype (KERNEL_DTYPES) when CuPy works, else "torch".
    """
    _check_backend_name(backend)
    device = torch.device(device)
    if backend == "auto":
        kernel_ok = dtype is None or dtype in KERNEL_DTYPES
        return "cupy" if device.type == "cuda" and kernel_ok and cupy_usable() else "torch"
    if backend == "cupy" and device.type != "cuda":
        raise ValueError(f"backend 'cupy' needs CUDA tensors, got tensors on {device}")
    if backend == "emulator" and device.type != "cpu":
        raise ValueError(f"backend 'emulator' runs on the CPU and needs CPU tensors, got {device}")
    return backend


def paged_attention(
    query: torch.Tensor,  # (num_seqs, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:  # (num_seqs, num_heads, head_size), query's dtype
    """Decode attention through block tables: each sequence's one query token attends to its
    seq_lens[s] cached tokens. backend: "torch", "cupy", "emulator" or "auto" (see module doc)."""
    _check_backend_name(backend)
    a = validate_decode_args(query, key_cache, value_cache, block_tables, seq_lens, scale)
    backend = resolve_backend(backend, a.query.device, a.query.dtype)
    if a.query.shape[0] == 0:
        return torch.empty_like(a.query)
    if backend == "torch":
        return _decode_torch(a)
    cuda_kernels = importlib.import_module("vllmini.cuda_kernels")  # lazy: only kernel users pay for it
    out = torch.empty_like(a.query)
    cuda_kernels.paged_attention_v1(
        a.query, a.key_cache, a.value_cache, a.block_tables, a.seq_lens, a.scale, out, runtime=backend
    )
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
    """Causal attention for each sequence's new tokens (its last ones, already in the cache) over its
    whole cached context. Serves whole prompts and chunks that start mid-sequence. Only "torch"."""
    _check_backend_name(backend)
    if backend not in ("auto", "torch"):
        raise ValueError(
            f"paged_prefill_attention supports backend 'torch' (or 'auto'), got {backend!r}; "
            "the CUDA kernels implement decode only"
        )
    a = validate_prefill_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    if a.query.shape[0] == 0:
        return torch.empty_like(a.query)
    return _prefill_torch(a)

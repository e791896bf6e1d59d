"""Paged attention: attention whose keys and values are read from a paged KV cache via block tables.

Decode (`paged_attention`): one new query token per sequence attends to the sequence's whole context.
Prefill (`paged_prefill_attention`): each sequence's new tokens (its last ones, already written to the
cache) attend causally to everything before them. Token t of sequence s lives at
    key_cache[block_tables[s, t // block_size], t % block_size]    # (num_kv_heads, head_size)

Shapes, dtypes and devices are always checked on the host (no device access). The block tables and
seq_lens -- values that live on the device -- are checked in one of three ways (`validate=`):
    "host"   (True)  copy them to the host and check with numpy before any backend runs: free for CPU
                     tensors, one device->host copy and sync for CUDA tensors. The default on the CPU,
                     and on CUDA for backends without a guard (torch, kernel versions 1-4).
    "guard"          the in-kernel guard (kernel version 5, CUDA by default, or the emulator when asked):
                     every page id is checked as the kernel loads it, a bad one is never read, its
                     sequence's output rows are NaN and the first violation (sequence, table entry, value)
                     is recorded in a device-side buffer. No sync: `check_kernel_errors()` reads the buffer
                     (one sync) and raises InvalidBlockTableError; the engine calls it once per step.
    "trust"  (False) no check at all, for a caller that checked these tables already (check_block_tables).
The "torch" backend is the naive one: gather the pages into a contiguous tensor, then
`scaled_dot_product_attention` (float32 softmax for half types) with the padding masked. "cupy" (a
CUDA kernel on a GPU) and "emulator" (the same CUDA source on the CPU) live in `vllmini.cuda_kernels`
and are imported only when asked for; `kernel_version=` picks one of its kernels (None: the best one).
"auto" picks "cupy" for CUDA tensors of a dtype the kernels take (KERNEL_DTYPES) when CuPy works, else
"torch"; never the emulator.

Index dtypes: block_tables, seq_lens and query_start_loc may be int32 (vLLM's choice) or int64; they
are normalized to contiguous int32. Padding entries of block_tables (past a sequence's length) are
never read, whatever they hold (-1, garbage).
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from vllmini.checks import as_float, cdiv
from vllmini.errors import InvalidArgumentError, InvalidBlockTableError, InvalidTypeError
from vllmini.kv_cache import check_cache_pair

BACKENDS = ("auto", "torch", "cupy", "emulator")
VALIDATE_MODES = (
    "host",
    "guard",
    "trust",
)  # validate= also takes None (auto), True ("host"), False ("trust")
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
        raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise InvalidTypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    if t.dim() != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D {shape_desc}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device} but the caches are on {device}")


def _check_query(query, key_cache: torch.Tensor, what: str) -> None:
    if not isinstance(query, torch.Tensor):
        raise InvalidTypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    if query.dim() != 3:
        raise InvalidArgumentError(
            f"query must be 3-D [{what}, num_heads, head_size], got shape {tuple(query.shape)}"
        )
    if query.dtype != key_cache.dtype:
        raise InvalidTypeError(
            f"query is {query.dtype} but the caches are {key_cache.dtype}; they must match"
        )
    if query.device != key_cache.device:
        raise InvalidArgumentError(f"query is on {query.device} but the caches are on {key_cache.device}")
    if query.shape[2] != head_size:
        raise InvalidArgumentError(f"query head_size {query.shape[2]} != cache head_size {head_size}")
    num_heads = query.shape[1]
    if num_heads < 1 or num_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )


def _check_scale(scale, head_size: int) -> float:
    if scale is None:
        return head_size**-0.5
    return as_float(scale, "scale")  # None above means 1/sqrt(head_size)


def _host_view(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The index tensors as numpy arrays on the host: CPU tensors viewed without a copy (strides and
    all), anything else through `_host_copy`."""
    if all(t.device.type == "cpu" for t in tensors):
        return [t.numpy() for t in tensors]
    return _host_copy(*tensors)


def _host_copy(*tensors: torch.Tensor) -> list[np.ndarray]:
    """ONE device->host copy of all the tensors: flattened into one (int64 if any of them is), then
    `.cpu()` -- one sync, instead of a dozen tiny kernels and a sync per question asked of them."""
    dtype = torch.int64 if any(t.dtype == torch.int64 for t in tensors) else torch.int32
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]).cpu().numpy()
    views, at = [], 0
    for t in tensors:
        views.append(flat[at : at + t.numel()].reshape(t.shape))
        at += t.numel()
    return views


def _check_tables_host(bt: np.ndarray, lens: np.ndarray, num_blocks: int, block_size: int) -> np.ndarray:
    """Check block tables (S, M) and seq_lens (S,) on the host; return seq_lens as int64 (S,).

    A sequence of length n reads the first ceil(n / block_size) entries of its row; the rest (padding)
    may hold anything."""
    max_blocks = bt.shape[1]
    max_len = max_blocks * block_size
    lens = lens.astype(np.int64)  # (S,) small copy: no int32 overflow below
    if lens.min() < 1 or lens.max() > max_len:
        i = int(((lens < 1) | (lens > max_len)).argmax())
        raise InvalidArgumentError(
            f"seq_lens[{i}] = {int(lens[i])} is out of range: expected 1 .. max_num_blocks_per_seq "
            f"* block_size = {max_blocks} * {block_size} = {max_len}"
        )
    num_used = cdiv(lens, block_size)  # (S,) blocks each sequence reads, >= 1
    used_cols = bt[:, : int(num_used.max())]  # a view: columns past every sequence's end are padding
    # viewed as unsigned, a negative id becomes huge, so one compare finds ids outside [0, num_blocks)
    unsigned = used_cols.view(np.uint32 if used_cols.dtype == np.int32 else np.uint64)
    out_of_range = unsigned >= num_blocks  # (S, max_used)
    first = out_of_range.argmax(axis=1)  # (S,) first out-of-range column of each row (0 if none)
    bad_rows = out_of_range[np.arange(len(first)), first] & (first < num_used)
    if bad_rows.any():
        s = int(bad_rows.argmax())
        j = int(first[s])
        raise InvalidBlockTableError(
            f"block_tables[{s}, {j}] = {int(bt[s, j])} is not a block id in [0, {num_blocks}) "
            f"(sequence {s} has seq_len {int(lens[s])}, so it reads blocks 0..{int(num_used[s]) - 1})"
        )
    return lens


def check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> int:
    """The host-side block-table checks of `paged_attention`, on their own (one host copy); returns
    max(seq_lens). For a caller that runs many layers over the same tables (the model, once per
    forward) and then calls `paged_attention(..., validate=False)` for each layer."""
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise InvalidArgumentError(
            f"block_tables must be [num_seqs, max_num_blocks_per_seq] and seq_lens [num_seqs], got shapes "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    if block_tables.shape[0] == 0:
        return 0
    bt, lens = _host_view(block_tables, seq_lens)
    return int(_check_tables_host(bt, lens, num_blocks, block_size).max())


def _check_table_shapes(key_cache: torch.Tensor, block_tables, seq_lens, num_seqs: int) -> None:
    device = key_cache.device
    _check_index_tensor("block_tables", block_tables, "[num_seqs, max_num_blocks_per_seq]", 2, device)
    _check_index_tensor("seq_lens", seq_lens, "[num_seqs]", 1, device)
    if block_tables.shape[0] != num_seqs or (num_seqs > 0 and block_tables.shape[1] < 1):
        raise InvalidArgumentError(
            f"block_tables must be [num_seqs={num_seqs}, max_num_blocks_per_seq>=1], "
            f"got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_seqs,):
        raise InvalidArgumentError(
            f"seq_lens must be [num_seqs={num_seqs}], got shape {tuple(seq_lens.shape)}"
        )


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Contiguous int32 (free when it already is). int64 values outside int32 are clamped, not wrapped,
    so an id like 2**40 stays out of range for the in-kernel guard instead of becoming a valid id."""
    if t.dtype == torch.int64:
        t = t.clamp(-(2**31), 2**31 - 1)
    return t.to(torch.int32).contiguous()


def _validate_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, check_tables=True):
    """validate_decode_args, also returning seq_lens on the host (int64 numpy) for the torch backend.

    check_tables=False skips the one host copy and the table checks (the caller ran check_block_tables
    on these tables already); seq_lens on the host is then None."""
    check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "num_seqs")
    scale = _check_scale(scale, key_cache.shape[3])
    num_seqs = query.shape[0]
    _check_table_shapes(key_cache, block_tables, seq_lens, num_seqs)
    if not check_tables:
        longest = block_tables.shape[1] * key_cache.shape[1]  # an upper bound: the torch path masks
        args = DecodeArgs(
            query.contiguous(),
            key_cache.contiguous(),
            value_cache.contiguous(),
            _int32(block_tables),
            _int32(seq_lens),
            scale,
            longest,
        )
        return args, None
    if num_seqs == 0:
        lens = np.zeros(0, dtype=np.int64)
    else:
        bt, lens = _host_view(block_tables, seq_lens)
        lens = _check_tables_host(bt, lens, key_cache.shape[0], key_cache.shape[1])
    args = DecodeArgs(
        query.contiguous(),
        key_cache.contiguous(),
        value_cache.contiguous(),
        _int32(block_tables),
        _int32(seq_lens),
        scale,
        int(lens.max()) if num_seqs else 0,
    )
    return args, lens


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
    int32 block_tables/seq_lens, the resolved scale and max(seq_lens). The table checks run on the
    host: CUDA tables cost one device->host copy (one sync), CPU tables none."""
    return _validate_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)[0]


def _validate_prefill(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """validate_prefill_args, also returning seq_lens and query_start_loc on the host (int64 numpy)."""
    check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "num_tokens")
    scale = _check_scale(scale, key_cache.shape[3])
    _check_index_tensor(
        "block_tables", block_tables, "[num_seqs, max_num_blocks_per_seq]", 2, key_cache.device
    )
    num_seqs = block_tables.shape[0]
    _check_index_tensor("query_start_loc", query_start_loc, "[num_seqs + 1]", 1, key_cache.device)
    if query_start_loc.shape != (num_seqs + 1,):
        raise InvalidArgumentError(
            f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}] (num_seqs from block_tables), "
            f"got shape {tuple(query_start_loc.shape)}"
        )
    _check_table_shapes(key_cache, block_tables, seq_lens, num_seqs)
    bt, lens, starts = _host_view(block_tables, seq_lens, query_start_loc)
    if num_seqs > 0:
        lens = _check_tables_host(bt, lens, key_cache.shape[0], key_cache.shape[1])
    lens, starts = lens.astype(np.int64), starts.astype(np.int64)
    num_tokens = query.shape[0]
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise InvalidArgumentError(
            f"query_start_loc must start at 0 and end at num_tokens={num_tokens}, "
            f"got {int(starts[0])} .. {int(starts[-1])}"
        )
    q_lens = np.diff(starts)  # (S,) new tokens of each sequence
    bad = (q_lens < 1) | (q_lens > lens)
    if bad.any():
        i = int(bad.argmax())
        raise InvalidArgumentError(
            f"sequence {i} has {int(q_lens[i])} query tokens (query_start_loc[{i}:{i + 2}] = "
            f"{starts[i : i + 2].tolist()}); expected 1 .. seq_lens[{i}] = {int(lens[i])}"
        )
    args = PrefillArgs(
        query.contiguous(),
        key_cache.contiguous(),
        value_cache.contiguous(),
        _int32(block_tables),
        _int32(seq_lens),
        _int32(query_start_loc),
        scale,
        int(lens.max()) if num_seqs else 0,
        int(q_lens.max()) if num_seqs else 0,
    )
    return args, lens, starts


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
    sequence has 1 .. seq_len new tokens (its last ones). One device->host copy for all three."""
    return _validate_prefill(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)[0]


# ----------------------------------------------------------------------------- the torch backend


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 math for half types (and float32); float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _decode_torch(a: DecodeArgs, min_seq_len: int) -> torch.Tensor:
    """Naive paged decode: gather every sequence's pages (padded to the longest), then SDPA.

    min_seq_len (known on the host from validation) says which positions may need masking: none when
    every sequence is equally long, else only positions min_seq_len .. max_seq_len - 1."""
    q, kc, vc = a.query, a.key_cache, a.value_cache
    num_seqs, num_heads, head_size = q.shape
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads  # query heads per kv head
    L = a.max_seq_len
    nb = cdiv(L, block_size)  # blocks of the longest sequence
    ragged = min_seq_len < L  # some sequences are shorter than the longest: mask their tails
    lens = a.seq_lens[:, None]  # (S, 1)
    pages = a.block_tables[:, :nb].long()  # (S, nb)
    if ragged:  # a shorter sequence's padding entries may hold anything: read page 0 instead (zeroed below)
        used = torch.arange(nb, device=q.device)[None, :] * block_size < lens  # (S, nb)
        pages = torch.where(used, pages, 0)
    # the gather: indexing dim 0 of the pool copies whole pages (the fastest gather torch has)
    k = kc[pages].flatten(1, 2)[:, :L]  # (S, nb, bs, kvh, hs) -> (S, L, kvh, hs), a view
    v = vc[pages].flatten(1, 2)[:, :L]
    mask = None
    if ragged:
        # slots past a seq_len hold stale data, NaN or inf. Masking their scores is not enough
        # (NaN + -inf and 0 * NaN are NaN), so zero them in K and V: only positions >= min_seq_len
        valid = torch.arange(L, device=q.device)[None, :] < lens  # (S, L)
        tail = ~valid[:, min_seq_len:, None, None]  # (S, L - min_seq_len, 1, 1)
        k[:, min_seq_len:].masked_fill_(tail, 0)
        v[:, min_seq_len:].masked_fill_(tail, 0)
        mask = valid[:, None, None, :]  # (S, 1, 1, L): True = attend; broadcast over heads and queries
    # GQA/MQA: the G query heads that share a kv head become G query rows of that one head, so every
    # kv head is read once (no repeated K/V, any SDPA kernel); MHA is G = 1
    qg = q.view(num_seqs, num_kv_heads, group, head_size)  # (S, kvh, G, hs)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (S, kvh, L, hs) strided views; SDPA takes them as is
    # SDPA accumulates in float32 for half types (and keeps float64 in float64)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=a.scale)  # (S, kvh, G, hs)
    return out.reshape(num_seqs, num_heads, head_size)


def _prefill_torch(a: PrefillArgs, lens: np.ndarray, starts: np.ndarray) -> torch.Tensor:
    """Paged prefill for the whole batch in one attention call, no loop over sequences: gather every
    sequence's pages into a padded (S, L, kvh, hs) tensor with one index, lay the new tokens out on a
    padded (S, N) grid, and run one SDPA with a mask that is causal (query row j of sequence s sits at
    position lens[s] - n_s + j, so a chunk that starts at k > 0 works) and cuts each sequence at its length.
    lens/starts: seq_lens and query_start_loc on the host (from validation: the indices need no sync)."""
    q, kc, vc = a.query, a.key_cache, a.value_cache
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads  # query heads per kv head
    S, L, N, device = len(lens), a.max_seq_len, a.max_query_len, q.device
    q_lens = np.diff(starts)  # (S,) new tokens of each sequence
    # where each new token sits on the (S, N) grid, and where each grid row sits in the sequence
    rows = np.repeat(np.arange(S) * N - starts[:-1], q_lens) + np.arange(num_tokens)  # (T,)
    q_pos = (lens - q_lens)[:, None] + np.arange(N)[None, :]  # (S, N); rows past n_s: padding
    rows, q_pos, lens_d = (torch.from_numpy(x).to(device) for x in (rows, q_pos, lens))
    nb = cdiv(L, block_size)
    pages = a.block_tables[:, :nb].long()  # (S, nb)
    used = torch.arange(nb, device=device)[None, :] * block_size < lens_d[:, None]  # (S, nb)
    pages = torch.where(used, pages, 0)  # padding entries may hold anything: read page 0 (zeroed below)
    acc = q.dtype if device.type == "cuda" else _acc_dtype(q.dtype)  # CUDA SDPA accumulates in float32
    k = kc[pages].flatten(1, 2)[:, :L].to(acc)  # (S, nb, bs, kvh, hs) -> (S, L, kvh, hs), a fresh copy
    v = vc[pages].flatten(1, 2)[:, :L].to(acc)
    positions = torch.arange(L, device=device)
    valid = positions[None, :] < lens_d[:, None]  # (S, L)
    if int(lens.min()) < L:  # stale slots past a length may hold NaN: a mask is not enough (0 * NaN)
        k.masked_fill_(~valid[:, :, None, None], 0)
        v.masked_fill_(~valid[:, :, None, None], 0)
    allowed = positions[None, None, :] <= q_pos[:, :, None]  # (S, N, L); position 0 always: no empty row
    grid = q.new_zeros(S * N, num_heads, head_size, dtype=acc)
    grid[rows] = q.to(acc)  # (S*N, nh, hs): the new tokens, padded per sequence to N rows
    # GQA: the G query heads of a kv head become G x N query rows of that head (each kv head read once)
    qg = grid.view(S, N, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)  # (S, kvh, G, N, hs)
    qg = qg.reshape(S, num_kv_heads, group * N, head_size)
    mask = allowed[:, None, None].expand(S, 1, group, N, L).reshape(S, 1, group * N, L)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=a.scale
    )  # (S, kvh, G*N, hs)
    out = out.view(S, num_kv_heads, group, N, head_size).permute(0, 3, 1, 2, 4)  # (S, N, kvh, G, hs)
    return out.reshape(S * N, num_heads, head_size)[rows].to(q.dtype)  # (T, nh, hs)


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
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")


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
        raise InvalidArgumentError(f"backend 'cupy' needs CUDA tensors, got tensors on {device}")
    if backend == "emulator" and device.type != "cpu":
        raise InvalidArgumentError(f"backend 'emulator' runs on the CPU and needs CPU tensors, got {device}")
    return backend


# ----------------------------------------------------------------------------- the in-kernel guard's record

ERROR_FIELDS = 5  # flag, sequence, table entry (-1: seq_lens), value, limit
_error_buffers: dict[torch.device, torch.Tensor] = {}  # device -> int32 [ERROR_FIELDS], zero when clean


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def kernel_error_buffer(device: torch.device | str) -> torch.Tensor:
    """The int32 [5] buffer the guarded kernels on `device` record their first violation in (made on
    first use: make one guarded call before capturing a CUDA graph)."""
    device = _normalize_device(device)
    if device not in _error_buffers:
        _error_buffers[device] = torch.zeros(ERROR_FIELDS, dtype=torch.int32, device=device)
    return _error_buffers[device]


def check_kernel_errors(device: torch.device | str | None = None) -> None:
    """Raise InvalidBlockTableError if a guarded kernel call (validate="guard", the default for CUDA
    tensors) saw a bad block id or seq_len since the last check; clears the record. One device->host
    copy (a sync) per device checked: call it once per step (the engine does, before committing a
    step), not per layer. `device` None checks every device that has a record."""
    devices = list(_error_buffers) if device is None else [_normalize_device(device)]
    for d in devices:
        buf = _error_buffers.get(d)
        if buf is None:
            continue
        flag, seq, entry, value, limit = buf.tolist()
        if not flag:
            continue
        buf.zero_()
        if entry < 0:
            raise InvalidBlockTableError(
                f"seq_lens[{seq}] = {value} is out of range: expected 1 .. max_num_blocks_per_seq * "
                f"block_size = {limit} (seen on {d} by the in-kernel guard; that sequence's output is NaN)"
            )
        raise InvalidBlockTableError(
            f"block_tables[{seq}, {entry}] = {value} is not a block id in [0, {limit}) (seen on {d} by the "
            f"in-kernel guard of a paged_attention call since the last check; that sequence's output is NaN)"
        )


def _table_check_mode(validate, device: torch.device, backend: str, guard_available: bool) -> str:
    """validate= (None, True, False or a VALIDATE_MODES name) -> "host", "guard" or "trust"."""
    if validate is None:
        return "guard" if device.type == "cuda" and guard_available else "host"
    if validate is True or validate is False:
        return "host" if validate else "trust"
    if validate not in VALIDATE_MODES:
        raise InvalidArgumentError(
            f"validate must be None, True, False or one of {VALIDATE_MODES}, got {validate!r}"
        )
    if validate == "guard" and not guard_available:
        raise InvalidArgumentError(
            f"validate='guard' needs a kernel with the in-kernel guard (backend 'cupy' or 'emulator', "
            f"kernel version 5); backend is {backend!r}"
        )
    return validate


def guarded_by_default(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """True when paged_attention(..., backend=backend) on such tensors checks its tables with the
    in-kernel guard by default (CUDA, a kernel with a guard): a caller then skips its own host check
    and calls check_kernel_errors() once per step instead."""
    if resolve_backend(backend, device, dtype) != "cupy":
        return False
    cuda_kernels = importlib.import_module("vllmini.cuda_kernels")
    return cuda_kernels.resolve_kernel_version(None, dtype).guard


def paged_attention(
    query: torch.Tensor,  # (num_seqs, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    scale: float | None = None,
    *,
    backend: str = "auto",
    validate: bool | str | None = None,
    kernel_version: int | str | None = None,
) -> torch.Tensor:  # (num_seqs, num_heads, head_size), query's dtype
    """Decode attention through block tables: each sequence's one query token attends to its
    seq_lens[s] cached tokens. backend: "torch", "cupy", "emulator" or "auto" (see module doc).

    validate: how block_tables and seq_lens are checked (module doc): None (default) = "host" on the CPU,
    "guard" on CUDA when the kernel has one (no host sync: errors surface at check_kernel_errors());
    True = "host" (one sync on CUDA), False = "trust", or "guard". kernel_version (backends "cupy" and
    "emulator"): a number or name from vllmini.cuda_kernels.kernel_versions(); None = the best one."""
    _check_backend_name(backend)
    a, _ = _validate_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, check_tables=False)
    backend = resolve_backend(backend, a.query.device, a.query.dtype)
    version = None
    if backend in ("cupy", "emulator"):
        cuda_kernels = importlib.import_module("vllmini.cuda_kernels")  # lazy: only kernel users pay for it
        version = cuda_kernels.resolve_kernel_version(kernel_version, a.query.dtype)
    elif kernel_version is not None:
        raise InvalidArgumentError(
            f"kernel_version applies to backends 'cupy' and 'emulator', not {backend!r}; "
            f"got {kernel_version!r}"
        )
    mode = _table_check_mode(validate, a.query.device, backend, version is not None and version.guard)
    num_seqs = a.query.shape[0]
    lens = None
    if mode == "host" and num_seqs:
        bt, lens = _host_view(block_tables, seq_lens)  # the caller's values (int64 ones unclamped)
        lens = _check_tables_host(bt, lens, a.key_cache.shape[0], a.key_cache.shape[1])
        a = a._replace(max_seq_len=int(lens.max()))
    if num_seqs == 0:
        return torch.empty_like(a.query)
    if backend == "torch":
        return _decode_torch(a, int(lens.min()) if lens is not None else 0)  # 0: mask, lengths unknown
    out = torch.empty_like(a.query)
    error = kernel_error_buffer(a.query.device) if mode == "guard" else None
    cuda_kernels.paged_attention_kernel(
        a.query, a.key_cache, a.value_cache, a.block_tables, a.seq_lens, a.scale, out, runtime=backend,
        version=version, error=error, _validated=True,
    )  # fmt: skip
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
        raise InvalidArgumentError(
            f"paged_prefill_attention supports backend 'torch' (or 'auto'), got {backend!r}; "
            "the CUDA kernels implement decode only"
        )
    a, lens, starts = _validate_prefill(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
    )
    if a.query.shape[0] == 0:
        return torch.empty_like(a.query)
    return _prefill_torch(a, lens, starts.astype(np.int64))

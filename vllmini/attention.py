"""Paged attention: token t of sequence s lives at key_cache[block_tables[s, t // block_size], t % block_size]
(num_kv_heads, head_size). Decode (`paged_attention`): each sequence's one new token attends to its context;
prefill (`paged_prefill_attention`): each sequence's new tokens (its last, already cached) attend causally.
Shapes, dtypes and devices are checked on the host; the values of block_tables and seq_lens one of three
ways (`validate=`; None: `guarded_by_default` picks "guard" or "host"):
    "host"  (True)   checked with numpy on the host: free for CPU tensors, one sync for CUDA ones.
    "guard"          the in-kernel guard (kernels 9-10, the default for "cupy"): a bad page id is never read,
                     its sequence's rows come out NaN, and `check_kernel_errors()` raises it later.
    "trust" (False)  no check, for a caller that checked these tables already (check_block_tables).
Backends: "torch" (gather, then SDPA); "cupy" (a GPU) and "emulator" (the CPU) launch a cuda_kernels version
(`kernel_version=`); "auto": "cupy" for CUDA tensors when CuPy works, else "torch"."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from vllmini import cuda_kernels
from vllmini.checks import as_float, as_int, cdiv, check_tensor, one_of
from vllmini.cuda_kernels import KernelVersion, resolve_kernel_version
from vllmini.errors import InvalidArgumentError, InvalidBlockTableError, InvalidTypeError
from vllmini.kv_cache import FLOAT_DTYPES, INDEX_DTYPES, check_cache_pair, check_slot_mapping

BACKENDS = ("auto", "torch", "cupy", "emulator")
VALIDATE_MODES = ("host", "guard", "trust")  # and None (auto), True ("host"), False ("trust")


class DecodeArgs(NamedTuple):
    """Validated inputs: contiguous tensors, int32 indices, a float scale (prefill: new tokens in a row)."""

    query: torch.Tensor  # (num_seqs, num_heads, head_size)
    key_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_size)
    block_tables: torch.Tensor  # (num_seqs, max_num_blocks_per_seq) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32
    scale: float
    max_seq_len: int  # max(seq_lens) (0 for an empty batch); before the host check the tables' width
    min_seq_len: int  # min(seq_lens) after the host check, else 0 (unknown: the torch path masks all)


def _check_index_tensor(name: str, t, shape_desc: str, ndim: int, device: torch.device) -> None:
    check_tensor(t, name, ndim=ndim, shape_desc=shape_desc)
    if t.dtype not in INDEX_DTYPES:
        raise InvalidTypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device} but the caches are on {device}")


def _check_query(query, key_cache, value_cache, scale, what: str) -> float:
    """The caches, the query against them, and the scale (None: 1/sqrt(head_size)), which it returns."""
    check_cache_pair(key_cache, value_cache)
    check_tensor(query, "query", ndim=3, shape_desc=f"[{what}, num_heads, head_size]")
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    if query.dtype != key_cache.dtype:
        raise InvalidTypeError(f"query is {query.dtype} but the caches are {key_cache.dtype}, must match")
    if query.device != key_cache.device:
        raise InvalidArgumentError(f"query is on {query.device} but the caches are on {key_cache.device}")
    if query.shape[2] != head_size:
        raise InvalidArgumentError(f"query head_size {query.shape[2]} != cache head_size {head_size}")
    cuda_kernels.check_head_layout(query.shape[1], num_kv_heads)
    return head_size**-0.5 if scale is None else as_float(scale, "scale")


def _host_view(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The index tensors as numpy arrays on the host: CPU tensors viewed in place, others by `_host_copy`."""
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    return [t.numpy() for t in tensors] if on_cpu else _host_copy(*tensors)


def _host_copy(*tensors: torch.Tensor) -> list[np.ndarray]:
    """ONE device->host copy (one sync) of all the tensors, flattened into one (int64 if any is)."""
    dtype = torch.int64 if any(t.dtype == torch.int64 for t in tensors) else torch.int32
    parts = torch.cat([t.reshape(-1).to(dtype) for t in tensors]).cpu().split([t.numel() for t in tensors])
    return [part.reshape(t.shape).numpy() for part, t in zip(parts, tensors, strict=True)]


def _check_tables_host(bt: np.ndarray, lens: np.ndarray, num_blocks: int, block_size: int) -> np.ndarray:
    """Check tables (S, M) and seq_lens (S,) on the host, only the entries a length reads; lens as int64."""
    max_blocks, max_len = bt.shape[1], bt.shape[1] * block_size
    lens = lens.astype(np.int64)  # (S,) small copy: no int32 overflow below
    if len(lens) == 0:
        return lens
    if lens.min() < 1 or lens.max() > max_len:
        i = int(((lens < 1) | (lens > max_len)).argmax())
        raise InvalidArgumentError(
            f"seq_lens[{i}] = {int(lens[i])} is out of range: expected 1 .. max_num_blocks_per_seq "
            f"* block_size = {max_blocks} * {block_size} = {max_len}"
        )
    num_used = cdiv(lens, block_size)  # (S,) blocks each sequence reads, >= 1
    used_cols = bt[:, : int(num_used.max())]  # a view: columns past every sequence's end are padding
    # viewed as unsigned, a negative id becomes huge, so one compare finds ids outside [0, num_blocks)
    out_of_range = used_cols.view(np.uint32 if used_cols.dtype == np.int32 else np.uint64) >= num_blocks
    first = out_of_range.argmax(axis=1)  # (S,) first out-of-range column of each row (0 if none)
    bad_rows = out_of_range[np.arange(len(first)), first] & (first < num_used)
    if bad_rows.any():
        j = int(first[s := int(bad_rows.argmax())])  # the first bad row, and its first bad column
        raise InvalidBlockTableError(
            f"block_tables[{s}, {j}] = {int(bt[s, j])} is not a block id in [0, {num_blocks}) "
            f"(sequence {s} has seq_len {int(lens[s])}, so it reads blocks 0..{int(num_used[s]) - 1})"
        )
    return lens


def check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> int:
    """`paged_attention`'s host table checks alone (then validate=False); returns max(seq_lens)."""
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise InvalidArgumentError(
            f"block_tables must be [num_seqs, max_num_blocks_per_seq] and seq_lens [num_seqs], got shapes "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    return int(_check_tables_host(*_host_view(block_tables, seq_lens), num_blocks, block_size).max(initial=0))


def _check_table_shapes(key_cache: torch.Tensor, block_tables, seq_lens, num_seqs: int | None) -> int:
    """Index dtypes, devices and shapes; num_seqs None: block_tables' rows. Returns num_seqs."""
    device = key_cache.device
    _check_index_tensor("block_tables", block_tables, "[num_seqs, max_num_blocks_per_seq]", 2, device)
    _check_index_tensor("seq_lens", seq_lens, "[num_seqs]", 1, device)
    num_seqs = block_tables.shape[0] if num_seqs is None else num_seqs
    if block_tables.shape[0] != num_seqs or (num_seqs > 0 and block_tables.shape[1] < 1):
        shape = tuple(block_tables.shape)
        raise InvalidArgumentError(
            f"block_tables must be [num_seqs={num_seqs}, max_num_blocks_per_seq>=1], got {shape}"
        )
    if seq_lens.shape != (num_seqs,):
        raise InvalidArgumentError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    return num_seqs


def _normalize(query, key_cache, value_cache, *indices) -> tuple[torch.Tensor, ...]:
    """Contiguous, indices int32 (int64 clamped: an id like 2**40 stays out of range for the guard)."""
    ints = (t.clamp(-(2**31), 2**31 - 1).int() if t.dtype == torch.int64 else t.int() for t in indices)
    return tuple(t.contiguous() for t in (query, key_cache, value_cache, *ints))


def validate_decode_args(
    query: torch.Tensor,  # (num_seqs, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int32/int64
    seq_lens: torch.Tensor,  # (num_seqs,) int32/int64
    scale: float | None = None,
    *,
    tables: bool = True,
) -> DecodeArgs:
    """Check and normalize every decode input; the tables' values on the host unless tables=False."""
    scale = _check_query(query, key_cache, value_cache, scale, "num_seqs")
    _check_table_shapes(key_cache, block_tables, seq_lens, query.shape[0])
    tensors = _normalize(query, key_cache, value_cache, block_tables, seq_lens)
    args = DecodeArgs(*tensors, scale, block_tables.shape[1] * key_cache.shape[1], 0)
    return _with_host_lens(args, block_tables, seq_lens) if tables else args


def _with_host_lens(args: DecodeArgs, block_tables, seq_lens) -> DecodeArgs:
    """args after the host check of the caller's tables (int64 ones unclamped), with the true lengths."""
    lens = _check_tables_host(*_host_view(block_tables, seq_lens), *args.key_cache.shape[:2])
    return args._replace(max_seq_len=int(lens.max(initial=0)), min_seq_len=int(lens.min(initial=0)))


def _gather_pages(args: DecodeArgs, lens: torch.Tensor, min_len: int, dtype: torch.dtype):
    """Each sequence's first L = max_seq_len keys and values, (S, L, kvh, hs) copies in `dtype`; slots past
    a length (from min_len up) read page 0 and are zeroed: they may hold NaN, and 0 * NaN is NaN."""
    kc, L, block_size = args.key_cache, args.max_seq_len, args.key_cache.shape[1]
    nb = cdiv(L, block_size)
    pages = args.block_tables[:, :nb]  # (S, nb)
    if min_len < L:
        used = torch.arange(nb, device=kc.device) * block_size < lens[:, None]  # (S, nb)
        pages = torch.where(used, pages, 0)
    shape = (len(pages), nb * block_size, *kc.shape[2:])  # index_select: the pages in table order
    k, v = (c.index_select(0, pages.reshape(-1)).view(shape)[:, :L].to(dtype) for c in (kc, args.value_cache))
    if min_len < L:
        tail = (torch.arange(min_len, L, device=kc.device) >= lens[:, None])[:, :, None, None]
        k[:, min_len:].masked_fill_(tail, 0)
        v[:, min_len:].masked_fill_(tail, 0)
    return k, v


def _sdpa_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """SDPA of q (S, N, nh, hs) over k, v (S, L, kvh, hs), mask (S, N, L) or None. A KV head's G query heads
    go through enable_gqa on the CPU (faster there), as G x N rows on CUDA (no fused kernel masks with it)."""
    (S, N, num_heads, head_size), kvh = q.shape, k.shape[2]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (S, kvh, L, hs) strided views; SDPA takes them as is
    if q.device.type == "cpu":
        mask = None if mask is None else mask[:, None]  # (S, 1, N, L)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)
    G = num_heads // kvh
    qg = q.view(S, N, kvh, G, head_size).permute(0, 2, 3, 1, 4).reshape(S, kvh, G * N, head_size)
    if mask is not None:
        mask = mask[:, None, None].expand(S, 1, G, N, -1).reshape(S, 1, G * N, -1)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # (S, kvh, G*N, hs)
    return out.view(S, kvh, G, N, head_size).permute(0, 3, 1, 2, 4).reshape(S, N, num_heads, head_size)


def _decode_torch(args: DecodeArgs) -> torch.Tensor:
    """Naive paged decode: each sequence's query sits at its context's last position."""
    lens = args.seq_lens
    if lens.device.type == "cpu" and len(lens):  # lengths on the host: read and mask only what is used
        L = min(int(lens.max()), args.max_seq_len)  # within the tables even if unchecked
        args = args._replace(max_seq_len=L, min_seq_len=max(int(lens.min()), args.min_seq_len))
    L = args.max_seq_len
    k, v = _gather_pages(args, lens, args.min_seq_len, args.query.dtype)
    ragged = args.min_seq_len < L  # else every position is valid: no mask
    mask = (torch.arange(L, device=lens.device) < lens[:, None])[:, None] if ragged else None  # (S, 1, L)
    return _sdpa_paged(args.query[:, None], k, v, mask, args.scale)[:, 0]


def _prefill_torch(args: DecodeArgs, lens: np.ndarray, starts: np.ndarray) -> torch.Tensor:
    """The whole prefill in one causal SDPA, new tokens on a padded (S, N) grid; lens, starts: host copies."""
    q, S, device, heads = args.query, len(lens), args.query.device, args.query.shape[1:]
    q_lens = np.diff(starts)  # (S,) new tokens of each sequence
    N = int(q_lens.max())
    rows = np.repeat(np.arange(S) * N - starts[:-1], q_lens) + np.arange(q.shape[0])  # (T,) grid row of each
    q_pos = (lens - q_lens)[:, None] + np.arange(N)  # (S, N) position of a grid row; past n_s: padding
    rows, q_pos, lens_d = (torch.from_numpy(x).to(device) for x in (rows, q_pos, lens))
    # float32 math for half types on the CPU (float64 stays); CUDA SDPA accumulates in float32 itself
    acc = q.dtype if device.type == "cuda" or q.dtype == torch.float64 else torch.float32
    k, v = _gather_pages(args, lens_d, args.min_seq_len, acc)
    mask = torch.arange(args.max_seq_len, device=device) <= q_pos[:, :, None]  # (S, N, L); never an empty row
    grid = q.new_zeros(S * N, *heads, dtype=acc)
    grid[rows] = q.to(acc)  # (S*N, nh, hs): the new tokens, padded per sequence to N rows
    out = _sdpa_paged(grid.view(S, N, *heads), k, v, mask, args.scale)
    return out.reshape(S * N, *heads)[rows].to(q.dtype)  # (T, nh, hs)


@functools.cache
def cupy_usable() -> bool:
    """True when CuPy imports and sees a CUDA device (checked once)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Turn "auto" into a concrete backend for tensors on `device` (module doc); reject impossible pairs."""
    one_of(backend, "backend", BACKENDS)
    device = torch.device(device)
    if backend == "auto":
        kernel_ok = dtype is None or dtype in FLOAT_DTYPES
        return "cupy" if device.type == "cuda" and kernel_ok and cupy_usable() else "torch"
    if backend == "cupy" and device.type != "cuda":
        raise InvalidArgumentError(f"backend 'cupy' needs CUDA tensors, got tensors on {device}")
    if backend == "emulator" and device.type != "cpu":
        raise InvalidArgumentError(f"backend 'emulator' runs on the CPU and needs CPU tensors, got {device}")
    return backend


def guarded_by_default(
    backend: str, device: torch.device, dtype: torch.dtype, kernel_version: int | str | None = None
) -> bool:
    """Who checks the tables when validate is None (decided here only): True, the in-kernel guard."""
    backend = resolve_backend(backend, device, dtype)
    return backend == "cupy" and resolve_kernel_version(kernel_version, dtype).guard


def _table_check_mode(validate, backend: str, version: KernelVersion | None) -> str:
    """validate= -> "host", "guard" or "trust" (None: as `guarded_by_default`)."""
    if validate is None:
        return "guard" if backend == "cupy" and version.guard else "host"
    if validate is True or validate is False:
        return "host" if validate else "trust"
    if validate not in VALIDATE_MODES:
        raise InvalidArgumentError(
            f"validate must be None, True, False or one of {VALIDATE_MODES}, got {validate!r}"
        )
    if validate == "guard" and not (version is not None and version.guard):
        raise InvalidArgumentError(
            f"validate='guard' needs a kernel with the in-kernel guard (backend 'cupy' or 'emulator', "
            f"kernel version 9 or 10); backend is {backend!r}"
        )
    return validate


# the fast path: call signature -> (backend, version, scale, guard record or None, {max_seq_len: plan})
_CALLS: dict[tuple, tuple] = {}
MAX_CACHED_CALLS = 256


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
    max_seq_len: int | None = None,  # max(seq_lens) on the host (None: the tables' width), for the splits
) -> torch.Tensor:  # (num_seqs, num_heads, head_size), query's dtype
    """Decode attention, each sequence's one query over its seq_lens[s] cached tokens (module doc)."""
    tensors = (query, key_cache, value_cache, block_tables, seq_lens)
    try:
        key = (*[x for t in tensors for x in (t.shape, t.dtype, t.device)], scale, backend, validate,
               kernel_version)  # fmt: skip
        known = _CALLS.get(key) if scale is None or type(scale) is float else None
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the checks will say
        key = known = None
    fast = known is not None and (max_seq_len is None or type(max_seq_len) is int)
    if fast and all(map(torch.Tensor.is_contiguous, tensors)):
        (backend, version, scale, error, calls), width = known, block_tables.shape[1]
        if backend == "torch":
            return _decode_torch(DecodeArgs(*tensors, scale, width * key_cache.shape[1], 0))
        if (call := calls.get(max_seq_len)) is None:
            where = (version, backend, query.device, query.dtype, query.shape, key_cache.shape, width)
            call = calls[max_seq_len] = cuda_kernels.plan_call(*where, None, max_seq_len)
        return call.run(tensors, torch.empty_like(query), error, scale)
    return _checked_paged_attention(tensors, scale, backend, validate, kernel_version, max_seq_len, key)


def _checked_paged_attention(tensors, scale, backend, validate, kernel_version, max_seq_len, key):
    """paged_attention with every check; remembers a signature whose calls need none of them again."""
    args = validate_decode_args(*tensors, scale, tables=False)
    backend = resolve_backend(backend, args.query.device, args.query.dtype)
    version = None
    if backend in ("cupy", "emulator"):
        version = cuda_kernels.resolve_call_version(
            kernel_version, args.query, args.key_cache.shape[2], backend
        )
    elif kernel_version is not None:
        raise InvalidArgumentError(
            f"kernel_version applies to backends 'cupy', 'emulator', not {backend!r}; got {kernel_version!r}"
        )
    mode = _table_check_mode(validate, backend, version)
    if args.query.shape[0] == 0:
        return torch.empty_like(args.query)
    if mode == "host":
        args = _with_host_lens(args, *tensors[3:])
        if max_seq_len is not None and as_int(max_seq_len, "max_seq_len") < args.max_seq_len:
            raise InvalidArgumentError(
                f"max_seq_len = {max_seq_len} is below max(seq_lens) = {args.max_seq_len}"
            )
    error = cuda_kernels.kernel_error_buffer(args.query.device) if mode == "guard" else None
    if backend == "torch":
        out = _decode_torch(args)
    else:
        out, longest = torch.empty_like(args.query), args.max_seq_len if max_seq_len is None else max_seq_len
        cuda_kernels.launch_paged_attention(
            args[:5], args.scale, out, backend, version, error, None, None, longest
        )
    if key is not None and mode != "host" and all(a is t for a, t in zip(args[:5], tensors, strict=True)):
        if len(_CALLS) >= MAX_CACHED_CALLS:
            _CALLS.clear()
        _CALLS[key] = (backend, version, args.scale, error, {})
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int32/int64
    seq_lens: torch.Tensor,  # (num_seqs,): context lengths, the new tokens included
    query_start_loc: torch.Tensor,  # (num_seqs + 1,): cumulative new tokens
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:  # (num_tokens, num_heads, head_size)
    """Causal attention of each sequence's new tokens (its last, already cached) over its context."""
    one_of(backend, "backend", BACKENDS)
    if backend not in ("auto", "torch"):
        raise InvalidArgumentError(
            f"paged_prefill_attention supports backend 'torch' (or 'auto'), got {backend!r}; "
            "the CUDA kernels implement decode only"
        )
    scale = _check_query(query, key_cache, value_cache, scale, "num_tokens")
    num_seqs = _check_table_shapes(key_cache, block_tables, seq_lens, None)
    _check_index_tensor("query_start_loc", query_start_loc, "[num_seqs + 1]", 1, key_cache.device)
    if query_start_loc.shape != (num_seqs + 1,):
        raise InvalidArgumentError(
            f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}] (num_seqs from block_tables), "
            f"got shape {tuple(query_start_loc.shape)}"
        )
    bt, lens, starts = _host_view(block_tables, seq_lens, query_start_loc)
    lens, starts = _check_tables_host(bt, lens, *key_cache.shape[:2]), starts.astype(np.int64)
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise InvalidArgumentError(
            f"query_start_loc must start at 0 and end at num_tokens={query.shape[0]}, "
            f"got {int(starts[0])} .. {int(starts[-1])}"
        )
    q_lens = np.diff(starts)  # (S,) new tokens of each sequence
    if (bad := (q_lens < 1) | (q_lens > lens)).any():
        i = int(bad.argmax())
        raise InvalidArgumentError(
            f"sequence {i} has {int(q_lens[i])} query tokens (query_start_loc[{i}:{i + 2}] = "
            f"{starts[i : i + 2].tolist()}); expected 1 .. seq_lens[{i}] = {int(lens[i])}"
        )
    if query.shape[0] == 0:
        return torch.empty_like(query)
    tensors = _normalize(query, key_cache, value_cache, block_tables, seq_lens)
    return _prefill_torch(DecodeArgs(*tensors, scale, int(lens.max()), int(lens.min())), lens, starts)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; CPU -> CUDA through pinned memory, non-blocking (no host sync, unlike `.to()`)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclasses.dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence reads: prefills first, then decodes."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot of each new token
    block_tables: torch.Tensor  # (num_seqs, max_num_blocks_per_seq) int32, padded with -1
    seq_lens: torch.Tensor  # (num_seqs,) int32: tokens in the cache after this step
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative new tokens (each sequence's last)
    num_prefills: int  # the first num_prefills sequences use the prefill path; the rest decode one token each
    num_prefill_tokens: int  # = query_start_loc[num_prefills]
    host_checked: bool = False  # `check_on_host` passed: the forward skips its own checks (GPU syncs)
    has_padding: bool = False  # slot_mapping may hold unchecked -1 rows (a CUDA graph's padding)
    max_decode_seq_len: int | None = None  # the longest decode, known on the host: the kernels' splits
    last_token_indices: torch.Tensor = dataclasses.field(init=False)  # (num_seqs,) int64

    def __post_init__(self):
        self.last_token_indices = self.query_start_loc[1:].to(torch.int64) - 1

    def check_on_host(self, num_blocks: int, block_size: int, *, tables: bool = True) -> None:
        """Check slot_mapping (and the decode tables) on the host, so the GPU forward needs no sync for it."""
        check_slot_mapping(self.slot_mapping, num_blocks * block_size, allow_padding=False)
        if tables and self.num_decodes:
            n = self.num_prefills
            check_block_tables(self.block_tables[n:], self.seq_lens[n:], num_blocks, block_size)
        self.host_checked = True

    def to(self, device) -> AttentionMetadata:
        """A copy on `device` (see `to_device`: from the CPU to CUDA without a host sync)."""
        tensors = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
        return dataclasses.replace(self, **{name: to_device(getattr(self, name), device) for name in tensors})

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        block_tables: torch.Tensor,
        seq_lens: list[int],
        slot_mapping: list[int],
        num_prefills: int,
        device=None,
    ) -> AttentionMetadata:
        """From host-side lists (one entry per sequence, prefills first); checks they agree."""
        if not 0 <= num_prefills <= len(query_lens) or len(query_lens) != len(seq_lens):
            raise InvalidArgumentError(
                f"need 0 <= num_prefills ({num_prefills}) <= num_seqs and one query_len per "
                f"seq_len, got {len(query_lens)} query_lens and {len(seq_lens)} seq_lens"
            )
        if any(q != 1 for q in query_lens[num_prefills:]):
            raise InvalidArgumentError(
                f"decode sequences take one new token each, got query_lens {query_lens[num_prefills:]}"
            )
        if any(not 1 <= q <= s for q, s in zip(query_lens, seq_lens, strict=True)):
            raise InvalidArgumentError(f"query_lens must be in [1, seq_len], got {query_lens} for {seq_lens}")
        if sum(query_lens) != len(slot_mapping):
            raise InvalidArgumentError(
                f"slot_mapping has {len(slot_mapping)} slots for {sum(query_lens)} new tokens"
            )
        starts = [0, *itertools.accumulate(query_lens)]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_tables=block_tables.to(device=device, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            num_prefills=num_prefills,
            num_prefill_tokens=starts[num_prefills],
            max_decode_seq_len=max(seq_lens[num_prefills:], default=None),
        )

"""How paged attention's inputs are checked: shapes, dtypes and devices always on the host; the block
tables and seq_lens (values on the device) on the host (one copy) or by the kernels' in-kernel guard,
whose record of the first bad page id lives here too (`kernel_error_buffer`, `check_kernel_errors`).
`vllmini.attention` explains the three modes ("host", "guard", "trust") and re-exports every public name.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from vllmini.checks import as_float, cdiv
from vllmini.errors import InvalidArgumentError, InvalidBlockTableError, InvalidTypeError
from vllmini.kv_cache import check_cache_pair

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
    return head_size**-0.5 if scale is None else as_float(scale, "scale")


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
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]).cpu()
    parts = flat.split([t.numel() for t in tensors])
    return [part.reshape(t.shape).numpy() for part, t in zip(parts, tensors, strict=True)]


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


def _check_table_shapes(key_cache: torch.Tensor, block_tables, seq_lens, num_seqs: int | None) -> int:
    """Index dtypes, devices and shapes; num_seqs None: block_tables' rows. Returns num_seqs."""
    device = key_cache.device
    _check_index_tensor("block_tables", block_tables, "[num_seqs, max_num_blocks_per_seq]", 2, device)
    _check_index_tensor("seq_lens", seq_lens, "[num_seqs]", 1, device)
    if num_seqs is None:
        num_seqs = block_tables.shape[0]
    if block_tables.shape[0] != num_seqs or (num_seqs > 0 and block_tables.shape[1] < 1):
        raise InvalidArgumentError(
            f"block_tables must be [num_seqs={num_seqs}, max_num_blocks_per_seq>=1], "
            f"got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_seqs,):
        raise InvalidArgumentError(
            f"seq_lens must be [num_seqs={num_seqs}], got shape {tuple(seq_lens.shape)}"
        )
    return num_seqs


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Contiguous int32 (free when it already is). int64 values outside int32 are clamped, not wrapped,
    so an id like 2**40 stays out of range for the in-kernel guard instead of becoming a valid id."""
    if t.dtype == torch.int64:
        t = t.clamp(-(2**31), 2**31 - 1)
    return t.to(torch.int32).contiguous()


def _normalize(query, key_cache, value_cache, *indices) -> tuple[torch.Tensor, ...]:
    """query and the caches contiguous (a strided cache is copied whole), the index tensors `_int32`."""
    return (query.contiguous(), key_cache.contiguous(), value_cache.contiguous(), *map(_int32, indices))


def _validate_decode(query, key_cache, value_cache, block_tables, seq_lens, scale) -> DecodeArgs:
    """Every decode check but the tables' values; max_seq_len is then the tables' width in tokens, an upper
    bound (the torch path masks). `_with_host_lens` adds the host check of the values."""
    check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "num_seqs")
    scale = _check_scale(scale, key_cache.shape[3])
    _check_table_shapes(key_cache, block_tables, seq_lens, query.shape[0])
    tensors = _normalize(query, key_cache, value_cache, block_tables, seq_lens)
    return DecodeArgs(*tensors, scale, block_tables.shape[1] * key_cache.shape[1])


def _with_host_lens(args: DecodeArgs, block_tables, seq_lens) -> tuple[DecodeArgs, np.ndarray]:
    """args with the true max_seq_len after the host check of the caller's tables (int64 ones unclamped);
    seq_lens as int64."""
    if args.query.shape[0] == 0:
        return args._replace(max_seq_len=0), np.zeros(0, dtype=np.int64)
    bt, lens = _host_view(block_tables, seq_lens)
    lens = _check_tables_host(bt, lens, args.key_cache.shape[0], args.key_cache.shape[1])
    return args._replace(max_seq_len=int(lens.max())), lens


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
    args = _validate_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return _with_host_lens(args, block_tables, seq_lens)[0]


def _validate_prefill(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """validate_prefill_args, also returning seq_lens and query_start_loc on the host (int64 numpy)."""
    check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "num_tokens")
    scale = _check_scale(scale, key_cache.shape[3])
    num_seqs = _check_table_shapes(key_cache, block_tables, seq_lens, None)
    _check_index_tensor("query_start_loc", query_start_loc, "[num_seqs + 1]", 1, key_cache.device)
    if query_start_loc.shape != (num_seqs + 1,):
        raise InvalidArgumentError(
            f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}] (num_seqs from block_tables), "
            f"got shape {tuple(query_start_loc.shape)}"
        )
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
    tensors = _normalize(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    longest, longest_query = (int(lens.max()), int(q_lens.max())) if num_seqs else (0, 0)
    return PrefillArgs(*tensors, scale, longest, longest_query), lens, starts


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

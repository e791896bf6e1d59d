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
Backends: "torch" gathers the pages and runs `scaled_dot_product_attention`; "cupy" (a CUDA kernel on
a GPU) and "emulator" (the same CUDA source on the CPU) live in `vllmini.cuda_kernels`, imported only
when asked for, and `kernel_version=` picks one of `vllmini.kernel_registry`'s versions (None: the best).
"auto" is "cupy" for CUDA tensors of a dtype the kernels take (KERNEL_DTYPES) when CuPy works, else
"torch"; never the emulator. Index tensors may be int32 (vLLM's choice) or int64; padding entries of
block_tables (past a sequence's length) are never read, whatever they hold (-1, garbage).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools

import numpy as np
import torch
import torch.nn.functional as F

from vllmini.attention_checks import (  # noqa: F401 (re-exported: every name importable from here)
    ERROR_FIELDS,
    INDEX_DTYPES,
    VALIDATE_MODES,
    DecodeArgs,
    PrefillArgs,
    _table_check_mode,
    _validate_decode,
    _validate_prefill,
    _with_host_lens,
    check_block_tables,
    check_kernel_errors,
    kernel_error_buffer,
    validate_decode_args,
    validate_prefill_args,
)
from vllmini.checks import cdiv, one_of
from vllmini.errors import InvalidArgumentError
from vllmini.kernel_registry import resolve_kernel_version
from vllmini.kv_cache import check_slot_mapping

BACKENDS = ("auto", "torch", "cupy", "emulator")
# dtypes the CUDA kernels take today; "auto" sends anything else to torch instead of failing
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------- the torch backend


def _decode_torch(args: DecodeArgs, min_seq_len: int) -> torch.Tensor:
    """Naive paged decode: gather every sequence's pages (padded to the longest), then SDPA.

    min_seq_len (known on the host from validation) says which positions may need masking: none when
    every sequence is equally long, else only positions min_seq_len .. max_seq_len - 1."""
    q, kc, vc = args.query, args.key_cache, args.value_cache
    num_seqs, num_heads, head_size = q.shape
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads  # query heads per kv head
    L = args.max_seq_len
    nb = cdiv(L, block_size)  # blocks of the longest sequence
    ragged = min_seq_len < L  # some sequences are shorter than the longest: mask their tails
    lens = args.seq_lens[:, None]  # (S, 1)
    pages = args.block_tables[:, :nb].long()  # (S, nb)
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
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=args.scale)  # (S, kvh, G, hs)
    return out.reshape(num_seqs, num_heads, head_size)


def _prefill_torch(args: PrefillArgs, lens: np.ndarray, starts: np.ndarray) -> torch.Tensor:
    """Paged prefill for the whole batch in one attention call, no loop over sequences: gather every
    sequence's pages into a padded (S, L, kvh, hs) tensor with one index, lay the new tokens out on a
    padded (S, N) grid, and run one SDPA with a mask that is causal (query row j of sequence s sits at
    position lens[s] - n_s + j, so a chunk that starts at k > 0 works) and cuts each sequence at its length.
    lens/starts: seq_lens and query_start_loc on the host (from validation: the indices need no sync)."""
    q, kc, vc = args.query, args.key_cache, args.value_cache
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads  # query heads per kv head
    S, L, N, device = len(lens), args.max_seq_len, args.max_query_len, q.device
    q_lens = np.diff(starts)  # (S,) new tokens of each sequence
    # where each new token sits on the (S, N) grid, and where each grid row sits in the sequence
    rows = np.repeat(np.arange(S) * N - starts[:-1], q_lens) + np.arange(num_tokens)  # (T,)
    q_pos = (lens - q_lens)[:, None] + np.arange(N)[None, :]  # (S, N); rows past n_s: padding
    rows, q_pos, lens_d = (torch.from_numpy(x).to(device) for x in (rows, q_pos, lens))
    nb = cdiv(L, block_size)
    pages = args.block_tables[:, :nb].long()  # (S, nb)
    used = torch.arange(nb, device=device)[None, :] * block_size < lens_d[:, None]  # (S, nb)
    pages = torch.where(used, pages, 0)  # padding entries may hold anything: read page 0 (zeroed below)
    # float32 math for half types on the CPU (float64 stays); CUDA SDPA accumulates in float32 itself
    acc = q.dtype if device.type == "cuda" or q.dtype == torch.float64 else torch.float32
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
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=args.scale
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


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Turn "auto" into a concrete backend for tensors on `device` (module doc); reject impossible pairs."""
    one_of(backend, "backend", BACKENDS)
    device = torch.device(device)
    if backend == "auto":
        kernel_ok = dtype is None or dtype in KERNEL_DTYPES
        return "cupy" if device.type == "cuda" and kernel_ok and cupy_usable() else "torch"
    if backend == "cupy" and device.type != "cuda":
        raise InvalidArgumentError(f"backend 'cupy' needs CUDA tensors, got tensors on {device}")
    if backend == "emulator" and device.type != "cpu":
        raise InvalidArgumentError(f"backend 'emulator' runs on the CPU and needs CPU tensors, got {device}")
    return backend


def guarded_by_default(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """True when paged_attention(..., backend=backend) on such tensors checks its tables with the
    in-kernel guard by default (CUDA, a kernel with a guard): a caller then skips its own host check
    and calls check_kernel_errors() once per step instead."""
    return resolve_backend(backend, device, dtype) == "cupy" and resolve_kernel_version(None, dtype).guard


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
    seq_lens[s] cached tokens. backend, validate (None: "guard" on CUDA when the kernel has one, else
    "host") and kernel_version (a number or name of kernel_versions(); None: the best): see module doc."""
    one_of(backend, "backend", BACKENDS)
    args = _validate_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    backend = resolve_backend(backend, args.query.device, args.query.dtype)
    version = None
    if backend in ("cupy", "emulator"):
        version = resolve_kernel_version(kernel_version, args.query.dtype)
    elif kernel_version is not None:
        raise InvalidArgumentError(
            f"kernel_version applies to backends 'cupy' and 'emulator', not {backend!r}; "
            f"got {kernel_version!r}"
        )
    mode = _table_check_mode(validate, args.query.device, backend, version is not None and version.guard)
    if args.query.shape[0] == 0:
        return torch.empty_like(args.query)
    min_seq_len = 0  # lengths unknown: the torch path masks every position
    if mode == "host":
        args, lens = _with_host_lens(args, block_tables, seq_lens)
        min_seq_len = int(lens.min())
    if backend == "torch":
        return _decode_torch(args, min_seq_len)
    out = torch.empty_like(args.query)
    error = kernel_error_buffer(args.query.device) if mode == "guard" else None
    cuda_kernels = importlib.import_module("vllmini.cuda_kernels")  # lazy: only kernel users pay for it
    cuda_kernels.paged_attention_kernel(
        args.query, args.key_cache, args.value_cache, args.block_tables, args.seq_lens, args.scale, out,
        runtime=backend, version=version, error=error, _validated=True,
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
    one_of(backend, "backend", BACKENDS)
    if backend not in ("auto", "torch"):
        raise InvalidArgumentError(
            f"paged_prefill_attention supports backend 'torch' (or 'auto'), got {backend!r}; "
            "the CUDA kernels implement decode only"
        )
    args, lens, starts = _validate_prefill(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
    )
    if args.query.shape[0] == 0:
        return torch.empty_like(args.query)
    return _prefill_torch(args, lens, starts.astype(np.int64))


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`. A CPU tensor goes to CUDA through pinned memory, non-blocking: no host sync (a
    plain .to() from pageable memory waits for the copy)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# -----------------------------------------------------------------------------
# attention metadata: how the flat batch of tokens maps onto sequences and pages


@dataclasses.dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence reads.

    Sequences are ordered prefills first, then decodes (one new token each). Sequence i's new tokens
    are input_ids[query_start_loc[i]:query_start_loc[i+1]], and they are its last ones: after this
    step it holds seq_lens[i] tokens in the cache.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot of each new token
    block_tables: torch.Tensor  # (num_seqs, max_num_blocks_per_seq) int32, padded with -1
    seq_lens: torch.Tensor  # (num_seqs,) int32: tokens in the cache after this step
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative new tokens
    num_prefills: int  # the first num_prefills sequences use the prefill path
    num_prefill_tokens: int  # = query_start_loc[num_prefills]
    # True once `check_on_host` passed (the forward then skips its own checks, each a sync on a GPU)
    host_checked: bool = False
    # slot_mapping may hold -1 rows that were not checked (a CUDA graph's padding): see reshape_and_cache
    has_padding: bool = False
    # (num_seqs,) int64: each sequence's last token
    last_token_indices: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.last_token_indices = self.query_start_loc[1:].to(torch.int64) - 1

    def check_on_host(self, num_blocks: int, block_size: int, *, tables: bool = True) -> None:
        """Check slot_mapping (and, with tables, the decode rows' block tables) while they are still on
        the host (free for CPU tensors), so the GPU forward needs no sync for it. The engine calls this
        on the metadata it builds on the CPU, then `to(device)`."""
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
                f"decode sequences take exactly one new token, got query_lens {query_lens[num_prefills:]}"
            )
        if any(not 1 <= q <= s for q, s in zip(query_lens, seq_lens, strict=True)):
            raise InvalidArgumentError(
                f"each query_len must be in [1, seq_len], got {query_lens} for {seq_lens}"
            )
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
        )

"""The paged KV cache (notebook 04): per layer, K and V pools cut into fixed-size blocks (pages), each
[num_blocks, block_size, num_kv_heads, head_size]. A token's K/V lives at slot = block_id * block_size +
offset; `reshape_and_cache` writes new tokens' K/V to their slots (vLLM's name)."""

from __future__ import annotations

import os

import numpy as np
import torch

from vllmini.checks import as_fraction, as_index, as_int, as_pair, check_tensor
from vllmini.errors import BlockIdError, InvalidArgumentError, InvalidTypeError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the model runs in, the kernels take
CACHE_DTYPES = (*FLOAT_DTYPES, torch.float64)  # what attention can read (float64: references)
INDEX_DTYPES = (torch.int32, torch.int64)  # block ids, slots, lengths
_POOL = "[num_blocks, block_size, num_kv_heads, head_size]"
_NEW = "[num_tokens, num_kv_heads, head_size]"
_SLOTS = "[num_tokens]"


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both pools 4-D, same shape, same supported floating dtype (CACHE_DTYPES), same device."""
    check_tensor(key_cache, "key_cache", ndim=4, shape_desc=_POOL)
    check_tensor(value_cache, "value_cache", ndim=4, shape_desc=_POOL)
    if key_cache.shape != value_cache.shape:
        raise InvalidArgumentError(
            f"key_cache and value_cache must have the same shape, got {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise InvalidTypeError(f"key_cache is {key_cache.dtype} but value_cache is {value_cache.dtype}")
    if key_cache.dtype not in CACHE_DTYPES:
        raise InvalidTypeError(
            f"the caches must have a floating dtype in {list(CACHE_DTYPES)}, got {key_cache.dtype}"
        )
    if key_cache.device != value_cache.device:
        raise InvalidArgumentError(
            f"key_cache is on {key_cache.device} but value_cache is on {value_cache.device}"
        )


def reshape_and_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    slot_mapping: torch.Tensor,  # (num_tokens,) int32/int64, -1 = padding (skipped)
    *,
    validate: bool = True,  # False: skip the slot checks (a host sync), the caller ran `check_slot_mapping`
    padding: bool = False,  # then -1 rows rewrite row 0's K/V into row 0's slot (no sync, no mask)
) -> None:
    """Write each token's key/value into its slot, in place; all is checked before anything is written."""
    check_cache_pair(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    device, kv_shape = key_cache.device, (None, num_kv_heads, head_size)
    for name, t in (("key", key), ("value", value)):
        check_tensor(t, name, dtypes=key_cache.dtype, device=device, shape=kv_shape, shape_desc=_NEW)
    if key.shape != value.shape:
        raise InvalidArgumentError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    check_tensor(
        slot_mapping, "slot_mapping", dtypes=INDEX_DTYPES, device=device, shape=(len(key),), shape_desc=_SLOTS
    )
    slots = slot_mapping.to(torch.int64)
    if validate:
        if check_slot_mapping(slot_mapping, num_blocks * block_size):  # -1 rows present: drop them
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
    elif padding:  # no sync: a padding row becomes a copy of row 0 (same slot, same bytes)
        src = torch.where(slots >= 0, torch.arange(slots.shape[0], device=slots.device), 0)  # (T,)
        slots, key, value = slots[src], key[src], value[src]
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    for cache, new in ((key_cache, key), (value_cache, value)):
        if contiguous:  # one index_put per pool, no div/mod
            cache.view(-1, num_kv_heads, head_size)[slots] = new
        else:  # (block, offset) indexing works in place whatever the cache's strides are
            cache[slots // block_size, slots % block_size] = new


def check_slot_mapping(slot_mapping: torch.Tensor, num_slots: int, *, allow_padding: bool = True) -> bool:
    """Host check: every entry in [0, num_slots) or -1 (allow_padding), no slot twice; True if any -1."""
    slots = slot_mapping.detach().to("cpu", torch.int64).numpy()
    bad = (slots < (-1 if allow_padding else 0)) | (slots >= num_slots)
    if bad.any():
        i = int(bad.argmax())
        expected = "-1 (skip) or a slot" if allow_padding else "a slot"
        raise InvalidArgumentError(
            f"slot_mapping[{i}] = {int(slots[i])} is out of range: expected {expected} in [0, {num_slots})"
        )
    kept = slots[slots >= 0]
    uniq, counts = np.unique(kept, return_counts=True)
    if len(uniq) != len(kept):
        raise InvalidArgumentError(f"slot_mapping writes slot {int(uniq[counts > 1][0])} more than once")
    return len(kept) != len(slots)


def check_memory(nbytes: int, num_blocks: int, device: torch.device) -> None:
    """Refuse, before allocating, a pool over the free GPU memory or the host's physical memory (if known)."""
    if device.type == "cuda":
        room = torch.cuda.mem_get_info(device)[0]
    elif hasattr(os, "sysconf"):
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return
    if nbytes > room:
        raise InvalidArgumentError(
            f"a KV cache of {num_blocks} blocks needs {nbytes / 2**30:,.1f} GiB, more than the "
            f"{room / 2**30:,.1f} GiB the {device.type} has{' free' if device.type == 'cuda' else ''}"
        )


class PagedKVCache:
    """K and V pools for every layer, sized by block count, by a byte budget, or by free GPU memory."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        *,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        num_layers = as_int(num_layers, "num_layers", min=1)
        num_kv_heads = as_int(num_kv_heads, "num_kv_heads", min=1)
        head_size = as_int(head_size, "head_size", min=1)
        block_size = as_int(block_size, "block_size", min=1)
        if dtype not in CACHE_DTYPES:
            raise InvalidTypeError(f"dtype must be one of {list(CACHE_DTYPES)}, got {dtype!r}")
        device = torch.device(device)
        sizes = {
            "num_blocks": num_blocks,
            "memory_bytes": memory_bytes,
            "gpu_memory_utilization": gpu_memory_utilization,
        }
        given = [name for name, v in sizes.items() if v is not None]
        if len(given) != 1:
            raise InvalidArgumentError(
                f"give exactly one of num_blocks, memory_bytes, gpu_memory_utilization; got {given or 'none'}"
            )
        per_block = self.bytes_per_block(num_layers, num_kv_heads, head_size, block_size, dtype)
        if memory_bytes is not None:
            memory_bytes = as_int(memory_bytes, "memory_bytes", min=0)
            num_blocks = memory_bytes // per_block
            if num_blocks < 1:
                raise InvalidArgumentError(
                    f"memory_bytes={memory_bytes} holds no block: one block needs {per_block} bytes"
                )
        elif gpu_memory_utilization is not None:
            share = as_fraction(gpu_memory_utilization, "gpu_memory_utilization", "(0, 1]")
            if device.type != "cuda":
                raise InvalidArgumentError(f"gpu_memory_utilization needs a CUDA device, got device={device}")
            free, _total = torch.cuda.mem_get_info(device)
            num_blocks = int(free * share) // per_block
            if num_blocks < 1:
                raise InvalidArgumentError(
                    f"{share:.0%} of {free} free bytes holds no block of {per_block} bytes"
                )
        else:
            num_blocks = as_int(num_blocks, "num_blocks", min=1)
        check_memory(num_blocks * per_block, num_blocks, device)
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.block_size, self.num_blocks, self.dtype, self.device = block_size, num_blocks, dtype, device
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        # zeros, not empty: a fresh cache prints the same on every run
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block id costs across all layers, K and V together."""
        return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes held by all pools (K and V, every layer)."""
        return sum(t.nbytes for t in self.key_caches + self.value_caches)

    @property
    def num_slots(self) -> int:
        """Token slots per layer: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write one layer's new K/V through the slot mapping (as `reshape_and_cache`: -1 skips a row)."""
        layer = as_index(layer, "layer", self.num_layers)
        reshape_and_cache(key, value, self.key_caches[layer], self.value_caches[layer], slot_mapping)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src -> dst in every layer's pools (copy-on-write); all read before any is written."""
        pairs = [self._check_pair(p) for p in pairs]
        if len({d for _, d in pairs}) != len(pairs):
            raise InvalidArgumentError(f"a destination block appears more than once in {pairs}")
        if not pairs:
            return
        src, dst = torch.tensor(pairs, dtype=torch.int64, device=self.device).T
        for cache in self.key_caches + self.value_caches:
            cache[dst] = cache[src]  # the right side is gathered (a copy) before the write

    def _check_pair(self, pair) -> tuple[int, int]:
        """(src_block, dst_block) as two block ids of this cache."""
        src, dst = as_pair(pair, "each (src_block, dst_block)")
        ids = as_int(src, "src_block"), as_int(dst, "dst_block")
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise BlockIdError(f"block id {b} in pair {ids} is out of range [0, {self.num_blocks})")
        return ids

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})"
        )

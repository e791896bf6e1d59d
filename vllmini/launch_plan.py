"""How one call launches a kernel version: the grid, the block, shared memory and, for version 5, how
a context is split into pieces (FlashDecoding; vLLM's paged_attention_v2) -- decided on the host from
sizes alone (no device values, so no sync). Used by `vllmini.cuda_kernels`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from vllmini.checks import cdiv

if TYPE_CHECKING:
    from vllmini.kernel_registry import KernelVersion

WARP_SIZE = 32
EMULATOR_SMS = 4  # the "multiprocessors" launch_plan assumes for the emulator (a CPU runs blocks one by one)
SPLIT_TARGET_BLOCKS_PER_SM = 8  # version 5 splits contexts until the grid has this many blocks per SM
MIN_SPLIT_TOKENS = 256  # ... but into no piece shorter than this (the merge would cost more than it gains)
MERGE_THREADS = 128


class LaunchPlan(NamedTuple):
    """How one call launches a version: the main kernel's shape and, for version 5, its work split."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int  # dynamic shared memory, bytes
    heads_per_block: int  # query heads one block serves (version 5: a GQA group, at most 4)
    num_splits: int  # context pieces per (sequence, head block); > 1 adds the merge kernel
    pages_per_split: int
    options: tuple[str, ...]  # extra NVRTC options (version 5 compiles one head-size copy per module)


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (asked once)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_plan(
    version: KernelVersion,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_num_blocks_per_seq: int,
    dtype: torch.dtype,
    sms: int,
    num_splits: int | None = None,
) -> LaunchPlan:
    """The launch of `version` for these sizes on a GPU with `sms` multiprocessors.

    Versions 1-4: one block per (sequence, query head). Version 5: one block per (sequence, group of
    heads_per_block query heads sharing a KV head, context piece); heads_per_block is the largest of 4, 2,
    1 that divides the GQA group (2 at most for 16-bit head sizes above 128: registers). The context is
    split when the grid would have fewer than SPLIT_TARGET_BLOCKS_PER_SM blocks per SM, into as many
    pieces as fill it but none shorter than MIN_SPLIT_TOKENS tokens. The lengths are not known on the
    host without a sync, so the pieces are cut from the block table's width (max_num_blocks_per_seq *
    block_size); a piece past a shorter sequence's end exits at once. `num_splits` forces a count."""
    chunks = cdiv(head_size, WARP_SIZE)  # 32-dim chunks of a head
    if version.number < 5:
        if version.number == 1:
            shared_mem = (max_num_blocks_per_seq * block_size + version.threads) * 4  # scores + scratch
        else:
            shared_mem = (version.threads // 16) * (head_size + 2) * 4  # per lane group: max, sum, output
        return LaunchPlan(
            (num_seqs, num_heads, 1), (version.threads, 1, 1), shared_mem, 1, 1, max_num_blocks_per_seq, ()
        )
    group = num_heads // num_kv_heads
    sixteen = dtype != torch.float32
    hb_max = 1 if group == 1 else (2 if sixteen and chunks > 4 else 4)
    heads_per_block = max(h for h in (4, 2, 1) if h <= hb_max and group % h == 0)
    compiled_hb = 1 if heads_per_block == 1 else hb_max  # the copy's HBMAX (registers, shared memory)
    blocks = num_seqs * (num_heads // heads_per_block)
    if num_splits is None:
        target = SPLIT_TARGET_BLOCKS_PER_SM * sms
        longest = max_num_blocks_per_seq * block_size
        num_splits = 1 if blocks >= target else min(cdiv(target, blocks), max(1, longest // MIN_SPLIT_TOKENS))
    num_splits = max(1, min(num_splits, max_num_blocks_per_seq))
    pages_per_split = cdiv(max_num_blocks_per_seq, num_splits)
    num_splits = cdiv(max_num_blocks_per_seq, pages_per_split)  # no empty piece at the end
    lane_group = 16 if sixteen else 32
    shared_mem = (version.threads // lane_group) * compiled_hb * (head_size + 2) * 4
    options = (f"-DVLLMINI_ONLY_CHUNKS={chunks}", f"-DVLLMINI_ONLY_GQA={int(heads_per_block > 1)}")
    grid = (num_seqs, num_heads // heads_per_block, num_splits)
    return LaunchPlan(
        grid, (version.threads, 1, 1), shared_mem, heads_per_block, num_splits, pages_per_split, options
    )

"""Checks for the exercises where you write CUDA (notebooks 05b and 07): your kernel's source runs on the
CPU emulator (bounds checked, races detected) against a float64 PyTorch reference on random inputs with
random, non-identity block tables; a check prints one line when it passes and says what is wrong when not.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from vllmini.checks import cdiv


def _emulated(source: str, name: str, checked: bool):
    """The learner's kernel, built by the emulator (a CompileError names the line)."""
    from vllmini.emulator import RawKernel

    return RawKernel(source, name, checked=checked, time_limit=60)  # messages name the `// x.cu` header


def _first_wrong_row(got: torch.Tensor, want: torch.Tensor, hint: str) -> None:
    """AssertionError naming the first (sequence, head) row of got [S, H, D] not float32-close to want."""
    bad = ~torch.isclose(got.double(), want, rtol=1e-4, atol=1e-4)  # NaN is never close
    if bad.any():
        s, h, d = (int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"wrong values at sequence {s}, head {h}: out[{s}, {h}, {d}] = {got[s, h, d].item():.6g}, "
            f"expected {want[s, h, d].item():.6g} ({int(bad[s, h].sum())} of {got.shape[2]} dims wrong "
            f"in that row, {int(bad.any(dim=2).sum())} of {got.shape[0] * got.shape[1]} rows); {hint}"
        )


def _paged_decode_case(seed: int, seq_lens: list[int], heads: int, kv_heads: int, d: int, bs: int) -> dict:
    """float32 decode inputs with random, non-identity block tables (-1 padding) over a pool twice the
    needed size; pages no table names, and slots past a sequence's end, hold NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, bs) for n in seq_lens]
    pages = torch.randperm(2 * sum(need), generator=g).tolist()
    tables = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    k_cache = torch.full((2 * sum(need), bs, kv_heads, d), float("nan"))
    v_cache = k_cache.clone()
    for s, n in enumerate(seq_lens):
        mine = [pages.pop() for _ in range(need[s])]
        tables[s, : need[s]] = torch.tensor(mine, dtype=torch.int32)
        slots = [p * bs + i for p in mine for i in range(bs)][:n]  # token t's slot, through the table
        k_cache.view(-1, kv_heads, d)[slots], v_cache.view(-1, kv_heads, d)[slots] = torch.randn(
            2, n, kv_heads, d, generator=g
        )
    q = torch.randn(len(seq_lens), heads, d, generator=g)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), scale=d**-0.5)  # fmt: skip


def _paged_decode_reference(c: dict) -> torch.Tensor:
    """softmax(scale q . k_t) @ v_t over each sequence's tokens, gathered through its table, in float64."""
    q, k_cache, v_cache = c["q"].double(), c["k_cache"].double(), c["v_cache"].double()
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)  # [S, H, D]
    for s, n in enumerate(c["seq_lens"].tolist()):
        pages = c["block_tables"][s, : cdiv(n, bs)].long()
        k = k_cache[pages].flatten(0, 1)[:n].repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[pages].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[s], k) * c["scale"], dim=1)
        out[s] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def check_warp_reduction_kernel(source: str, checked: bool = True) -> None:
    """Exercise 05b (kernels/exercises/warp_reduction.cu): the learner's version 2,
    `paged_attention_2_warp_per_token`, run on the CPU emulator -- once with the race detector, then in
    checked mode (AddressSanitizer) -- on random block tables, GQA, head sizes that are and are not
    multiples of 32, against float64."""
    kernel = _emulated(source, "paged_attention_2_warp_per_token", checked)
    cases = [(0, [1, 17, 40], 4, 2, 64, 16), (1, [100, 33], 4, 1, 80, 8), (2, [300], 2, 2, 128, 16)]
    for i, (seed, lens, heads, kv_heads, d, bs) in enumerate(cases):
        c = _paged_decode_case(seed, lens, heads, kv_heads, d, bs)
        out = torch.full_like(c["q"], float("nan"))
        width = c["block_tables"].shape[1]
        sizes = (bs, heads, d, kv_heads, width)
        args = (out, c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"],
                *(np.int32(x) for x in sizes), np.float32(c["scale"]))  # fmt: skip
        # the first case under the race detector (in this process, bounds checked), the rest checked
        kernel((len(lens), heads), (128,), args, shared_mem=(width * bs + 128) * 4, racecheck=i == 0)
        _first_wrong_row(out, _paged_decode_reference(c), (
            f"seq_lens {lens}, head_size {d}, block_size {bs}: does every lane end with the sum of all 32 "
            "lanes' partial dot products? (a butterfly: log2(32) = 5 shuffle steps, every lane taking part)"
        ))  # fmt: skip
    print(
        "correct: your warp reduction gives the float64 answer on random block tables, "
        "no race, no stray access"
    )


def _split_partials(seed: int, rows: int, n: int, num_splits: int, d: int, spread: float):
    """Scores and values of `rows` (sequence, head) rows of n tokens cut into num_splits pieces (the
    last ones empty when num_splits > n): (part_out [rows, splits, D], part_ml [rows, splits, 2]) in
    float32 and the whole rows' softmax output [rows, D] in float64."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=g, dtype=torch.float64) * spread
    v = torch.randn(rows, n, d, generator=g, dtype=torch.float64)
    want = torch.einsum("rn,rnd->rd", torch.softmax(scores, dim=1), v)
    cuts = sorted(random.Random(seed).sample(range(1, n), min(num_splits, n) - 1)) + [n] * (num_splits - n)
    part_out, part_ml = torch.zeros(rows, num_splits, d), torch.zeros(rows, num_splits, 2)
    part_ml[:, :, 0] = -math.inf  # empty pieces: m = -inf, l = 0, o = 0
    for s, (a, b) in enumerate(zip([0, *cuts], [*cuts, n][:num_splits], strict=True)):
        if b > a:
            m = scores[:, a:b].max(dim=1).values
            e = torch.exp(scores[:, a:b] - m[:, None])
            part_ml[:, s, 0], part_ml[:, s, 1] = m.float(), e.sum(dim=1).float()
            part_out[:, s] = (torch.einsum("rn,rnd->rd", e, v[:, a:b]) / e.sum(dim=1)[:, None]).float()
    return part_out, part_ml, want


def check_split_merge_kernel(source: str, checked: bool = True) -> None:
    """Exercise 07 (kernels/exercises/split_merge.cu): the learner's `split_merge` kernel, run on the CPU
    emulator -- once with the race detector, then in checked mode -- on partial results of random
    contexts cut into 1 to 200 pieces (some empty), scores up to the hundreds, against float64."""
    kernel = _emulated(source, "split_merge", checked)
    cases = [(0, 40, 3, 64, 1.0, 128), (1, 9, 1, 32, 1.0, 128), (2, 50, 7, 96, 500.0, 128),
             (3, 20, 33, 64, 3.0, 32), (4, 300, 200, 32, 1.0, 128)]  # fmt: skip
    seqs, heads = 2, 3
    for i, (seed, n, splits, d, spread, threads) in enumerate(cases):
        part_out, part_ml, want = _split_partials(seed, seqs * heads, n, splits, d, spread)
        out = torch.full((seqs, heads, d), float("nan"))
        args = (out, part_out, part_ml, np.int32(splits), np.int32(d))
        kernel((seqs, heads), (threads,), args, racecheck=i == 0)
        _first_wrong_row(out, want.view(seqs, heads, d), (
            f"{n} tokens in {splits} pieces, scores of size ~{spread:g}, {threads} threads: weight piece s "
            "by l_s * exp(m_s - M), M the largest m_s (without M, exp(m_s) overflows for large scores)"
        ))  # fmt: skip
    print(
        "correct: your merge equals one softmax over the whole context: "
        "1 to 200 pieces, scores in the hundreds"
    )

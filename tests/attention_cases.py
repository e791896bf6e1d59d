"""Shared paged-attention test cases and a float64 reference, for every backend's tests.

    from attention_cases import DECODE_GRID, make_decode_case, reference_decode, assert_close

    case = make_decode_case(0, *params, dtype=torch.float32, device="cpu")
    out = paged_attention(case["query"], case["key_cache"], case["value_cache"],
                          case["block_tables"], case["seq_lens"], case["scale"], backend="torch")
    assert_close(out, reference_decode(case))

Cases are hostile on purpose: random non-identity block tables over a pool about twice the size
needed, blocks aliased across sequences, every slot no sequence reads filled with NaN, padding of the
block tables holding -1, huge ids and ids of NaN pages. The reference gathers token by token in float64.
"""

from __future__ import annotations

import math
import random
from itertools import product
from typing import NamedTuple

import torch


class DecodeParams(NamedTuple):
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    seq_lens: tuple[int, ...]


def case_id(p: DecodeParams) -> str:
    """Short pytest id: heads, head size, block size, lengths."""
    lens = ",".join(map(str, p.seq_lens)) if len(p.seq_lens) <= 4 else f"{len(p.seq_lens)}seqs"
    return f"h{p.num_heads}kv{p.num_kv_heads}-d{p.head_size}-bs{p.block_size}-L{lens}"


HEAD_SIZES = (64, 80, 96, 128, 256)
BLOCK_SIZES = (1, 8, 16, 32)
HEAD_LAYOUTS = ((4, 4), (8, 2), (4, 1))  # MHA, GQA, MQA as (num_heads, num_kv_heads)


def _boundary_lens(bs: int) -> tuple[int, ...]:
    """Length 1 and lengths on both sides of the first two block boundaries, in one batch."""
    return tuple(sorted({1, max(bs - 1, 1), bs, bs + 1, 2 * bs - 1, 2 * bs + 1, 3 * bs + 5}))


def _params(nh: int, nkv: int, hs: int, bs: int, lens: tuple[int, ...]) -> DecodeParams:
    return DecodeParams(len(lens), nh, nkv, hs, bs, tuple(lens))


# every head size x block size, head layouts rotating, mixed boundary lengths; plus a few extremes
DECODE_GRID: list[DecodeParams] = [
    _params(*HEAD_LAYOUTS[i % 3], hs, bs, _boundary_lens(bs))
    for i, (hs, bs) in enumerate(product(HEAD_SIZES, BLOCK_SIZES))
] + [
    _params(4, 4, 64, 16, (1,)),  # a single one-token sequence
    _params(8, 1, 128, 16, (1, 1, 1)),  # MQA, all length 1
    _params(4, 2, 128, 16, (300,)),  # one long sequence
    _params(2, 2, 64, 8, (17, 3, 64, 9, 1, 40)),  # more sequences
]

# for slow backends (the CPU emulator): few heads and few tokens, still every head/block size
DECODE_GRID_SMALL: list[DecodeParams] = [
    _params(2, 2, 64, 1, (1, 2, 5)),
    _params(4, 2, 80, 8, (1, 8, 9)),
    _params(2, 1, 96, 16, (15, 17)),
    _params(2, 2, 128, 32, (1, 33)),
    _params(4, 1, 256, 8, (7, 16)),
    _params(4, 2, 128, 16, (16, 1, 31)),
]

# tolerances (rtol, atol) against the float64 reference: inputs are exact in every dtype, so the
# error is the math in float32 plus rounding the output to the dtype
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Elementwise |out - ref| <= atol + rtol * |ref| with the tolerance of out's dtype; no NaN."""
    rtol, atol = TOLERANCES[dtype or out.dtype]
    out = out.detach().to("cpu", torch.float64)
    assert torch.isfinite(out).all(), "output holds NaN/inf: a poisoned slot leaked"
    torch.testing.assert_close(out, ref.to(torch.float64), rtol=rtol, atol=atol)


def _make_pool(
    rng: random.Random, gen: torch.Generator, num_kv_heads, head_size, block_size, seq_lens, dtype, device
):
    """Random paged K/V for the given lengths: block tables, NaN-poisoned pools."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = max(2 * sum(need), 2)
    max_blocks = max(need) + 1  # at least one padding entry per sequence
    order = list(range(num_blocks))
    rng.shuffle(order)  # random, non-identity page assignment
    tables, taken = [], []
    for n in need:
        row = []
        for _ in range(n):
            if taken and rng.random() < 0.2:
                row.append(rng.choice(taken))  # alias a page another sequence already uses
            else:
                row.append(order.pop())
                taken.append(row[-1])
        tables.append(row)
    # every slot some sequence reads gets a value; everything else stays NaN
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for row, n in zip(tables, seq_lens, strict=True):
        for t in range(n):
            read[row[t // block_size], t % block_size] = True
    unused_pages = [b for b in range(num_blocks) if not read[b].any()]
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    key_cache[~read] = float("nan")
    value_cache[~read] = float("nan")
    padded = []
    for row in tables:  # padding: -1, a huge id, or the id of a NaN page
        fill = [
            rng.choice([-1, 10**6 + rng.randrange(1000), rng.choice(unused_pages or [-1])])
            for _ in range(max_blocks - len(row))
        ]
        padded.append(row + fill)
    return {
        "key_cache": key_cache.to(device),
        "value_cache": value_cache.to(device),
        "block_tables": torch.tensor(padded, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "num_blocks": num_blocks,
    }


def make_decode_case(
    seed: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    seq_lens,
    dtype=torch.float32,
    device="cpu",
) -> dict:
    """A decode batch: query [num_seqs, num_heads, head_size] and a hostile paged cache (see module doc)."""
    seq_lens = tuple(int(n) for n in seq_lens)
    assert len(seq_lens) == num_seqs, f"{num_seqs=} but {len(seq_lens)} seq_lens"
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    case = _make_pool(rng, gen, num_kv_heads, head_size, block_size, seq_lens, dtype, device)
    case["query"] = torch.randn(num_seqs, num_heads, head_size, generator=gen).to(dtype).to(device)
    case["scale"] = head_size**-0.5
    return case


def make_prefill_case(
    seed: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    seq_lens,
    query_lens,
    dtype=torch.float32,
    device="cpu",
) -> dict:
    """A prefill batch: sequence i's last query_lens[i] tokens are new; query [sum(query_lens), H, D]."""
    seq_lens, query_lens = tuple(map(int, seq_lens)), tuple(map(int, query_lens))
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    case = _make_pool(rng, gen, num_kv_heads, head_size, block_size, seq_lens, dtype, device)
    case["query"] = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(dtype).to(device)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    case["query_start_loc"] = torch.tensor(starts, dtype=torch.int32, device=device)
    case["scale"] = head_size**-0.5
    return case


def gather_kv(case: dict, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `seq`'s keys and values, token by token through its block table: float64 [L, kvh, hs]."""
    kc, vc = case["key_cache"].cpu().double(), case["value_cache"].cpu().double()
    block_size = kc.shape[1]
    row = case["block_tables"][seq].tolist()
    n = int(case["seq_lens"][seq])
    slots = [(row[t // block_size], t % block_size) for t in range(n)]
    return torch.stack([kc[b, o] for b, o in slots]), torch.stack([vc[b, o] for b, o in slots])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query vector against keys/values [L, hs] in float64. No finite score at all (every one
    -inf): attend to nothing, a zero row (vllmini's documented choice, as SDPA does for masked rows)."""
    scores = (k @ q) * scale
    if bool((scores == float("-inf")).all()):
        return torch.zeros_like(q)
    return torch.softmax(scores, dim=0) @ v


def reference_decode(case: dict) -> torch.Tensor:
    """float64 [num_seqs, num_heads, head_size], one head and one sequence at a time."""
    q = case["query"].cpu().double()
    num_seqs, num_heads, _ = q.shape
    group = num_heads // case["key_cache"].shape[2]
    out = torch.zeros_like(q)
    for s in range(num_seqs):
        k, v = gather_kv(case, s)
        for h in range(num_heads):
            out[s, h] = _attend(q[s, h], k[:, h // group], v[:, h // group], case["scale"])
    return out


def reference_prefill(case: dict) -> torch.Tensor:
    """float64 [num_tokens, num_heads, head_size]: new token j of a sequence of length L with n new
    tokens sits at position L - n + j and attends to positions 0 .. L - n + j."""
    q = case["query"].cpu().double()
    num_heads = q.shape[1]
    group = num_heads // case["key_cache"].shape[2]
    starts = case["query_start_loc"].tolist()
    out = torch.zeros_like(q)
    for s, seq_len in enumerate(case["seq_lens"].tolist()):
        k, v = gather_kv(case, s)
        n = starts[s + 1] - starts[s]
        for j in range(n):
            p = seq_len - n + j
            for h in range(num_heads):
                kh, vh = k[: p + 1, h // group], v[: p + 1, h // group]
                out[starts[s] + j, h] = _attend(q[starts[s] + j, h], kh, vh, case["scale"])
    return out

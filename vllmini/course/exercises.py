"""Checks for the course's exercises: call one with your answer and it says whether it is right.

Each `check_*` computes the expected answer itself from the package's finished pieces (never a stored
number), prints one line when the answer is right, and raises `AssertionError` with a hint when it is
not. Worked solutions are in `notebooks/solutions/`. This module sits on top of the package, like
the rest of `vllmini.course`: nothing in the engine imports it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import torch

from vllmini.allocator import BlockAllocator
from vllmini.checks import cdiv
from vllmini.course import memory
from vllmini.course.kernel_plots import H200_READ_BW
from vllmini.errors import VllminiError

GiB = 2**30


def _ok(msg: str) -> None:
    print(f"correct: {msg}")


# ---- notebook 01


def fp8_answer(gpu_bytes: int = 80 * GiB) -> tuple[int, int]:
    """Llama-3-8B with an fp8 KV cache and fp16 weights: (KV bytes per token, KV tokens on the GPU)."""
    shape = memory.LLAMA_3_8B
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * 1
    return per_token, (gpu_bytes - shape.num_params * 2) // per_token


def check_fp8_kv(kv_bytes_per_token: int, kv_tokens: int) -> None:
    """Exercise 01.1: the KV bytes per token of an fp8 Llama-3-8B cache and the tokens that fit on
    80 GiB next to its fp16 weights."""
    want_bytes, want_tokens = fp8_answer()
    assert kv_bytes_per_token == want_bytes, (
        f"KV bytes per token: got {kv_bytes_per_token}; count 2 (K and V) x layers x kv heads x head_size x "
        "1 byte"
    )
    assert kv_tokens == want_tokens, (
        f"tokens that fit: got {kv_tokens}; subtract the weights at 2 bytes per parameter (not 1), then "
        "divide by the fp8 bytes per token"
    )
    _ok(f"{want_bytes // 1024} KiB per token, {want_tokens:,} tokens: about twice the fp16 cache's tokens")


def time_average_answer(n: int = 200_000, seed: int = 0) -> tuple[float, float]:
    """ShareGPT-like requests, each at its own uniform progress through its output: (static share,
    paged share) of reserved slots holding tokens, max_len 2048, block size 16."""
    reqs = memory.sample_requests(n, "sharegpt", max_len=2048, seed=seed)
    inp = np.array([r[0] for r in reqs])
    out = np.array([r[1] for r in reqs])
    held = inp + np.rint(np.random.default_rng(seed + 1).uniform(0, 1, n) * out).astype(np.int64)
    return held.sum() / (2048 * n), held.sum() / (cdiv(held, 16) * 16).sum()


def check_time_average(static_share: float, paged_share: float) -> None:
    """Exercise 01.2: static and paged shares with every request at a random point of its output."""
    want_static, want_paged = time_average_answer()
    assert abs(static_share - want_static) < 0.01, (
        f"static share {static_share:.3f}: held tokens / (2048 x requests); each request holds its prompt "
        "plus a uniform fraction of its output"
    )
    assert abs(paged_share - want_paged) < 0.01, (
        f"paged share {paged_share:.3f}: held tokens / slots of the whole blocks those tokens fill"
    )
    _ok(f"static about {want_static:.1%}, paged about {want_paged:.1%} (the paper measured 20.4% and 96.3%)")


def check_block_manager_share(token_utilization: float, n: int = 30, seed: int = 0) -> None:
    """Exercise 01.4: a BlockManager holding n ShareGPT-like requests at final length vs the formula."""
    reqs = memory.sample_requests(n, "sharegpt", seed=seed)
    want = memory.paged_reservation(reqs, 16).token_share
    assert math.isclose(token_utilization, want, rel_tol=1e-12), (
        f"got {token_utilization}, expected the same as memory.paged_reservation(requests, 16).token_share; "
        f"did you allocate sample_requests({n}, 'sharegpt', seed={seed}) at prompt + output tokens each?"
    )
    _ok(f"both say {want:.4%}: each holds ceil(tokens / 16) blocks, so the counts are the same integers")


# ---- notebook 02


def _ops_agree(make_mine: Callable, next_ids: Callable, num_blocks: int, num_ops: int, seed: int) -> None:
    rng = random.Random(seed)
    mine, in_use = make_mine(num_blocks), set()
    for _ in range(num_ops):
        if in_use and (len(in_use) == num_blocks or rng.random() < 0.45):
            b = rng.choice(sorted(in_use))
            mine.free(b)
            next_ids("free", b)
            in_use.discard(b)
        else:
            got, want = mine.allocate(), next_ids("allocate", None)
            assert got == want, (
                f"allocate() returned {got}, expected {want} "
                f"(free blocks: {sorted(set(range(num_blocks)) - in_use)})"
            )
            in_use.add(got)


def check_bitmap_allocator(cls: type) -> None:
    """Exercise 02.1: cls(num_blocks) always hands out the lowest free block id."""
    used: set[int] = set()

    def lowest(op, b):
        if op == "free":
            used.discard(b)
            return None
        b = min(set(range(8)) - used)
        used.add(b)
        return b

    _ops_agree(cls, lowest, 8, 500, seed=0)
    _ok("the bitmap allocator always returns the lowest free id")


def check_first_difference(ops: list) -> None:
    """Exercise 02.1: a list of ("allocate",) / ("free", b) calls after which the LIFO free list and the
    lowest-free-id bitmap hand out different ids on the next allocate()."""
    lifo, bitmap_used = BlockAllocator(16), set()
    for op in ops:
        if op[0] == "allocate":
            got = lifo.allocate()
            low = min(set(range(16)) - bitmap_used)
            assert got == low, (
                f"they already differ at {op}: LIFO {got}, bitmap {low}; make that your last call"
            )
            bitmap_used.add(low)
        else:
            lifo.free(op[1])
            bitmap_used.discard(op[1])
    nxt, low = lifo.free_block_ids[0], min(set(range(16)) - bitmap_used)
    assert nxt != low, f"after these calls both hand out block {nxt} next"
    _ok(f"next allocate(): LIFO gives {nxt}, the bitmap {low}")


def check_fifo_allocator(cls: type) -> None:
    """Exercise 02.2: cls(num_blocks) hands out the block freed longest ago first (fresh ones in order)."""
    queue: list[int] = list(range(8))

    def fifo(op, b):
        if op == "free":
            queue.append(b)
            return None
        return queue.pop(0)

    _ops_agree(cls, fifo, 8, 500, seed=1)
    _ok("the FIFO allocator hands out the least recently freed block first")


def check_failed_fork_corrupts(broken_cls: type, ops: list) -> None:
    """Exercise 02.3: ops, e.g. [("allocate",), ("fork", [0, 3])], leave broken_cls's ref counts
    different from the package's all-or-nothing BlockAllocator's (errors raised by a call are caught)."""
    good, bad = BlockAllocator(4), broken_cls(4)
    for op in ops:
        for a in (good, bad):
            try:
                getattr(a, op[0])(*op[1:])
            except VllminiError:
                pass
    counts_good = [good.ref_count(b) for b in range(4)]
    counts_bad = [bad.ref_count(b) for b in range(4)]
    assert counts_good != counts_bad, f"the ref counts agree ({counts_good}): the failed fork changed nothing"
    _ok(f"ref counts after the failed fork: all-or-nothing {counts_good}, broken {counts_bad}")


def check_leak_detector(cls: type) -> None:
    """Exercise 02.4: cls (notebook 02's RefCountedAllocator with a check() method) passes on valid states
    and raises AssertionError on each kind of corruption."""
    a = cls(6)
    ids = [a.allocate() for _ in range(4)]
    a.fork(ids[:2])
    a.free(ids[3])
    a.check()  # a valid state must pass
    corruptions = {
        "a block twice on the free list": lambda x: x.free_list.append(x.free_list[-1]),
        "a used block on the free list": lambda x: x.free_list.append(0),
        "a free block missing from the free list": lambda x: x.free_list.pop(),
        "a block with ref count 0 off the free list": lambda x: x.ref_counts.__setitem__(1, 0),
    }
    for name, corrupt in corruptions.items():
        b = cls(6)
        for _ in range(4):
            b.allocate()
        b.fork([0, 1])
        b.free(3)
        corrupt(b)
        try:
            b.check()
        except AssertionError:
            continue
        raise AssertionError(f"check() did not notice {name}")
    _ok(f"check() passes a valid pool and catches all {len(corruptions)} corruptions")


# ---- notebook 04


def check_gather_bytes(nbytes: int) -> None:
    """Exercise 04.1: bytes the naive gather copies for 64 sequences x 4096 tokens, 32 KV heads of 128,
    fp16 (keys and values)."""
    want = 2 * 64 * 4096 * 32 * 128 * 2
    assert nbytes == want, (
        f"got {nbytes:,}; count keys AND values, 2 bytes each, for every token of every sequence"
    )
    _ok(
        f"{want / GiB:.0f} GiB copied (read and written), then read again by attention: "
        "three passes over memory instead of one"
    )


def check_slots_read(fn: Callable) -> None:
    """Exercise 04.3: fn(block_table, seq_len, block_size) -> the slot ids a decode query reads, in order."""
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 2, 4, 16])
        seq_len = rng.randint(1, 40)
        pages = rng.sample(range(64), cdiv(seq_len, bs)) + [-1] * rng.randint(0, 2)
        want = [pages[t // bs] * bs + t % bs for t in range(seq_len)]
        got = [int(s) for s in fn(list(pages), seq_len, bs)]
        assert got == want, (
            f"block_table {pages}, seq_len {seq_len}, block_size {bs}: got {got}, expected {want}"
        )
    _ok("slot of token t = block_table[t // block_size] * block_size + t % block_size, for t < seq_len")


def check_batched_decode(fn: Callable) -> None:
    """Exercise 04.4: fn(query, key_cache, value_cache, block_tables, seq_lens) equals paged_attention
    on random GQA batches with NaN in every slot nobody owns."""
    from vllmini.attention import paged_attention

    g = torch.Generator().manual_seed(0)
    for seq_lens, heads, kv_heads, bs in [([1, 5, 8, 9], 4, 2, 4), ([17, 3, 32], 8, 8, 16), ([7], 2, 1, 2)]:
        pages = [cdiv(n, bs) for n in seq_lens]
        nb = 2 * sum(pages)
        perm = torch.randperm(nb, generator=g).tolist()
        tables = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)
        kc = torch.full((nb, bs, kv_heads, 8), float("nan"))
        vc = torch.full_like(kc, float("nan"))
        for s, n in enumerate(seq_lens):
            tables[s, : pages[s]] = torch.tensor([perm.pop() for _ in range(pages[s])])
            slots = torch.tensor([int(tables[s, t // bs]) * bs + t % bs for t in range(n)])
            kc.view(-1, kv_heads, 8)[slots] = torch.randn(n, kv_heads, 8, generator=g)
            vc.view(-1, kv_heads, 8)[slots] = torch.randn(n, kv_heads, 8, generator=g)
        q = torch.randn(len(seq_lens), heads, 8, generator=g)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        want = paged_attention(q, kc, vc, tables, sl, backend="torch")
        got = fn(q, kc, vc, tables, sl)
        assert not got.isnan().any(), f"NaN in the output for seq_lens {seq_lens}: a padded slot leaked"
        assert torch.allclose(got, want, atol=1e-5), (
            f"seq_lens {seq_lens}: max |diff| {(got - want).abs().max():.2e}"
        )
    _ok("your batched decode matches vllmini.paged_attention on three GQA batches, no NaN leaked")


# ---- notebook 06


def check_static_batch(fn: Callable) -> None:
    """Exercise 06.3: fn(pool_slots, max_model_len) -> how many requests the static policy runs at once
    (with an endless queue), checked against the engine itself on a tiny model."""
    from vllmini.engine import LLMEngine
    from vllmini.model import LlamaConfig, LlamaModel
    from vllmini.sampling import SamplingParams

    for pool, max_len in [(1920, 256), (1920, 128), (1000, 256), (64, 32), (63, 32)]:
        want = pool // max_len
        got = fn(pool, max_len)
        assert got == want, f"pool {pool} slots, max_model_len {max_len}: got {got}, expected {want}"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    engine = LLMEngine(LlamaModel(cfg).eval(), block_size=4, num_blocks=24, max_model_len=32, policy="static")
    for _ in range(8):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.stats[0].batch_size == fn(96, 32), "the engine disagrees: read Scheduler._reserve"
    _ok("static admits pool_slots // max_model_len requests, however short they are")


def check_timeline(timeline: dict, request_id: int, first_admitted: int, steps_waiting: int) -> None:
    """Exercise 06.2: for request_id in the recorded timeline, the step it was first admitted and the
    number of steps it spent waiting in all (before its first admission and after preemptions)."""
    states = timeline[request_id]
    want_first = states.index("prefill")
    want_wait = sum(s == "waiting" for s in states)
    assert first_admitted == want_first, (
        f"first admitted: got step {first_admitted}; find the first dark-blue cell"
    )
    assert steps_waiting == want_wait, f"steps waiting: got {steps_waiting}; count the grey cells of its row"
    _ok(f"request {request_id}: first admitted at step {want_first}, waited {want_wait} steps in all")


def check_ttft_knee(points: list, answer: dict) -> None:
    """Exercise 06.4: for each policy of a `serving.rate_sweep`, the lowest rate whose median time to
    first token is more than 10x its median TTFT at the lowest rate (None if no rate is)."""
    want = {}
    for policy in dict.fromkeys(p.policy for p in points):
        pts = sorted((p for p in points if p.policy == policy), key=lambda p: p.rate)
        base = pts[0].metrics.ttft.p50
        want[policy] = next((p.rate for p in pts if p.metrics.ttft.p50 > 10 * base), None)
    assert set(answer) == set(want), f"one rate (or None) per policy: {sorted(want)}, got {sorted(answer)}"
    for policy, rate in want.items():
        got = answer[policy]
        same = got is None if rate is None else got is not None and math.isclose(got, rate)
        assert same, f"{policy}: got {got}; compare each rate's TTFT p50 with 10x the lowest rate's"
    _ok(", ".join(f"{p} from {r:g}/s" if r is not None else f"{p} never" for p, r in want.items()))


# ---- notebook 07


def roofline_answer(batch: int, seq_len: int, heads: int, kv_heads: int, head_size: int, elem_bytes: int,
                    read_bw: float) -> tuple[int, float, float]:  # fmt: skip
    """Decode attention of one step: (K and V bytes read, microseconds at read_bw bytes/s, FLOP per byte)."""
    nbytes = 2 * batch * seq_len * kv_heads * head_size * elem_bytes
    flops = 4 * batch * seq_len * heads * head_size
    return nbytes, nbytes / read_bw * 1e6, flops / nbytes


def check_decode_roofline(
    kv_bytes: int, ceiling_us: float, intensity: float, read_bw: float = H200_READ_BW
) -> None:
    """Exercise 07.1: shape (e), 64 sequences x 4096 tokens, 32 query heads sharing 8 KV heads, head size
    128, float16: the bytes one decode step reads, its time at the read ceiling, its FLOP per byte."""
    want_bytes, want_us, want_int = roofline_answer(64, 4096, 32, 8, 128, 2, read_bw)
    assert kv_bytes == want_bytes, (
        f"bytes: got {kv_bytes:,}; keys AND values, for every token of every sequence, per KV head (not per "
        "query head), 2 bytes each"
    )
    assert math.isclose(ceiling_us, want_us, rel_tol=1e-3), (
        f"time: got {ceiling_us:.4g} us; bytes / {read_bw:.3g} bytes/s, in microseconds"
    )
    assert math.isclose(intensity, want_int, rel_tol=1e-6), (
        f"intensity: got {intensity:.4g}; 4 FLOP per (token, query head, dim) over the bytes: 2H / (K e)"
    )
    _ok(f"{want_bytes / 1e9:.2f} GB, {want_us:.0f} us at the ceiling, {want_int:g} FLOP per byte")


def check_lse_merge(merge: Callable) -> None:
    """Exercise 07.2: merge(parts) with parts a list of (m [H], l [H], o [H, D]) from pieces of one
    context (m the max score, l the sum of exp(score - m), o the piece's softmax-weighted value sum over l)
    returns the whole context's attention output [H, D]; checked against one softmax in float64."""
    g = torch.Generator().manual_seed(0)
    for n, pieces, spread in [(10, 2, 1.0), (37, 3, 5.0), (64, 5, 1.0), (9, 9, 1.0), (50, 4, 800.0)]:
        scores = torch.randn(4, n, generator=g, dtype=torch.float64) * spread  # [H, n]
        v = torch.randn(n, 8, generator=g, dtype=torch.float64)  # [n, D]
        want = torch.softmax(scores, dim=1) @ v  # [H, D]
        cuts = sorted(random.Random(n).sample(range(1, n), pieces - 1))
        parts = []
        for a, b in zip([0] + cuts, cuts + [n], strict=True):
            s = scores[:, a:b]
            m = s.max(dim=1).values  # [H]
            e = torch.exp(s - m[:, None])
            parts.append((m, e.sum(dim=1), (e @ v[a:b]) / e.sum(dim=1)[:, None]))
        got = torch.as_tensor(merge(parts), dtype=torch.float64)
        assert got.shape == want.shape, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert not got.isnan().any(), (
            f"NaN with scores of size ~{spread:g}: exp(m_i) overflows; subtract the largest m first"
        )
        err = (got - want).abs().max().item()
        assert err < 1e-9, f"{n} tokens, {pieces} pieces: max |diff| {err:.2e}; weight o_i by l_i e^(m_i - M)"
    _ok("the merged pieces equal one softmax over the whole context, even with scores in the hundreds")


def check_first_bad_entry(fn: Callable) -> None:
    """Exercise 07.3: fn(block_tables, seq_lens, num_blocks, block_size) -> (sequence, index) of the first
    block-table entry (row by row) that a sequence reads and that is not a block id, or None; the -1
    padding after a sequence's last block is never read."""
    from vllmini.attention import check_block_tables
    from vllmini.errors import InvalidBlockTableError

    rng = random.Random(0)
    for _ in range(300):
        num_blocks, bs = rng.choice([4, 16]), rng.choice([1, 4, 16])
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
        width = max(cdiv(n, bs) for n in lens) + rng.randint(0, 2)
        rows = [[rng.randrange(num_blocks) for _ in range(cdiv(n, bs))] for n in lens]
        for r in rows:
            r += [-1] * (width - len(r))
            if rng.random() < 0.3:  # corrupt one entry, read or padding
                r[rng.randrange(width)] = rng.choice([-1, -7, num_blocks, 10**6])
        bt, sl = torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        want = next(((s, j) for s, n in enumerate(lens) for j in range(cdiv(n, bs))
                     if not 0 <= rows[s][j] < num_blocks), None)  # fmt: skip
        try:  # the package's host check agrees on whether the tables are bad
            check_block_tables(bt, sl, num_blocks, bs)
            assert want is None
        except InvalidBlockTableError as e:
            assert want is not None and f"block_tables[{want[0]}, {want[1]}]" in str(e)
        got = fn(bt.clone(), sl.clone(), num_blocks, bs)
        got = None if got is None else tuple(int(x) for x in got)
        assert got == want, (
            f"block_tables {rows}, seq_lens {lens}, num_blocks {num_blocks}, block_size {bs}: got {got}, "
            f"expected {want} (a sequence of n tokens reads entries 0 .. ceil(n / block_size) - 1)"
        )
    _ok("your check finds the same first bad entry as vllmini's, and ignores the padding nobody reads")


# ---- notebook 03


def prefix_sharing_answer(block_size: int, prompt: int = 10) -> int:
    """Blocks saved when two requests fork a `prompt`-token prompt, then write one token each."""
    from vllmini.block_manager import BlockManager

    m = BlockManager(num_blocks=16, block_size=block_size)
    m.allocate("a", prompt)
    m.fork("a", "b")
    m.append("a", 1)
    m.take_pending_copies()
    m.append("b", 1)
    return 2 * cdiv(prompt + 1, block_size) - (m.num_blocks - m.num_free_blocks)


def check_prefix_sharing(saved_block_size_4: int, saved_block_size_16: int) -> None:
    """Exercise 03.1: blocks two forked requests save on a 10-token prompt, at block_size 4 and 16."""
    want = (prefix_sharing_answer(4), prefix_sharing_answer(16))
    got = (saved_block_size_4, saved_block_size_16)
    assert got == want, (
        f"got {got}; only the prompt's FULL blocks stay shared: its last, partly filled block is copied as "
        "soon as one request writes into it"
    )
    _ok(f"saves {want[0]} blocks at block_size 4 and {want[1]} at 16: floor(10 / block_size) full blocks")


def _replay(arrivals: list, watermark: int):
    from vllmini.block_manager import BlockManager

    m = BlockManager(8, 4, watermark_blocks=watermark)
    for seq_id, n in arrivals:
        if m.can_allocate(n):  # one that does not fit waits
            m.allocate(seq_id, n)
    return m


def check_watermark(arrivals: list) -> None:
    """Exercise 03.2: `arrivals` = [(seq_id, num_tokens), ...] admitted in order into BlockManager(8, 4)
    when they fit: without a watermark some running sequence cannot grow by one token afterwards, with
    watermark_blocks=1 every running one can."""
    arrivals = [(s, int(n)) for s, n in arrivals]
    plain, kept = _replay(arrivals, 0), _replay(arrivals, 1)
    stuck = [s for s in plain.seq_ids if not plain.can_append(s, 1)]
    assert stuck, (
        f"after {arrivals} every running sequence can still grow in BlockManager(8, 4): fill the pool so "
        "that the next token of some sequence needs a block nobody has"
    )
    # with one block kept back at admission, one token more always fits (it needs at most one block)
    assert all(kept.can_append(s, 1) for s in kept.seq_ids)
    waiting = [s for s, _ in arrivals if s not in kept.seq_ids]
    _ok(
        f"without a watermark seqs {stuck} are stuck (a scheduler must preempt); with one block kept back "
        f"{waiting or 'nobody'} waits at admission and every running sequence grows"
    )


def block_size_answer() -> int:
    """The first block size of 1, 2, 4, ..., 256 at which the notebook's 64 short sequences (5 to 50
    tokens) keep less than 90% of their allocated slots busy."""
    lengths = [random.Random(s).randint(5, 50) for s in range(64)]
    for bs in [2**k for k in range(9)]:
        if sum(lengths) / sum(cdiv(n, bs) * bs for n in lengths) < 0.9:
            return bs
    raise AssertionError("unreachable: block_size 256 wastes most slots")


def check_block_size(first_below_90: int) -> None:
    """Exercise 03.3: the first block size at which token utilization of the 64 short sequences
    (`random.Random(s).randint(5, 50)` for s in range(64)) drops below 90%."""
    want = block_size_answer()
    assert first_below_90 == want, (
        f"got {first_below_90}; utilization = sum(lengths) / sum(ceil(n / bs) * bs), for bs = 1, 2, 4, ..."
    )
    _ok(f"below 90% from block_size {want}; a kernel still prefers 16 (one lookup per 16 tokens)")


def check_padding(read_zero_padded: list, read_minus_padded: list) -> None:
    """Exercise 03.4: what a gather that reads every block of the row returns, on the cache
    `torch.arange(16.).reshape(4, 4)`, for a one-block sequence in block 2 padded with 0 ([2, 0]) and
    with -1 ([2, -1])."""
    cache = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    for name, row, got in (("0", [2, 0], read_zero_padded), ("-1", [2, -1], read_minus_padded)):
        want = cache[torch.tensor(row)].reshape(-1).tolist()
        assert [float(x) for x in got] == want, (
            f"padding {name}: got {list(got)}, expected {want} (cache[row].reshape(-1): torch reads index "
            "-1 as the last block)"
        )
    _ok("both paddings return someone else's tokens; only -1 can be told from a real block id (row < 0)")


# ---- notebook 08


def check_beam_replace(fn: Callable) -> None:
    """Exercise 08.1: fn(bm, parents) replaces a step's beams: `parents` maps each new beam id to the live
    beam it continues; afterwards the block manager holds exactly the new beams, each with its parent's
    page table (shared, not copied), and every block no new beam uses is free again."""
    from vllmini.block_manager import BlockManager

    cases = [
        ({"a": 9, "b": 9}, {"c": "a", "d": "a", "e": "b"}),  # a kept twice, b once
        ({"a": 12, "b": 12, "c": 12}, {"x": "c", "y": "c", "z": "c"}),  # only c survives
        ({"a": 5}, {"b": "a"}),
    ]
    for lengths, parents in cases:
        bm = BlockManager(num_blocks=32, block_size=4)
        for seq, n in lengths.items():
            bm.allocate(seq, n)
        before = {s: bm.block_table(s).block_ids for s in lengths}
        free_before = bm.num_free_blocks
        fn(bm, dict(parents))
        assert sorted(bm.seq_ids) == sorted(parents), (
            f"live sequences {sorted(bm.seq_ids)}, expected the new beams {sorted(parents)}: free the old"
        )
        for new, parent in parents.items():
            got = bm.block_table(new).block_ids
            assert got == before[parent], (
                f"beam {new!r} has blocks {got}, expected its parent's {before[parent]}"
            )
        kept = {b for p in set(parents.values()) for b in before[p]}
        want_free = free_before + sum(len(before[s]) for s in before if s not in parents.values())
        assert bm.num_free_blocks == want_free, (
            f"{bm.num_free_blocks} free blocks, expected {want_free}: a beam no new beam continues frees its "
            "blocks; a surviving one's must not be freed while a new beam shares them (fork first)"
        )
        for b in kept:
            users = sum(b in bm.block_table(n).block_ids for n in parents)
            assert bm.allocator.ref_count(b) == users, (
                f"block {b}: reference count {bm.allocator.ref_count(b)}, {users} beams use it"
            )
    _ok("fork each survivor into its new beams, then free the old beams: pages shared, nothing copied")


def memory_saved_answer(n: int, prompt_len: int, output_len: int, block_size: int) -> float:
    """The share of KV blocks parallel sampling saves at the end of one request of n samples (whole prompt
    blocks shared, each sample's partial prompt block copied), counted on a real BlockManager."""
    from vllmini.block_manager import BlockManager

    bm = BlockManager(num_blocks=n * (cdiv(prompt_len + output_len, block_size) + 1), block_size=block_size)
    bm.allocate(0, prompt_len)
    for i in range(1, n):
        bm.fork(0, i)
    for _ in range(output_len):
        for i in range(n):
            bm.append(i, 1)
        bm.take_pending_copies()
    logical = sum(bm.block_table(i).num_blocks for i in range(n))
    return 1 - bm.utilization()["used_blocks"] / logical


def check_memory_saved(fn: Callable) -> None:
    """Exercise 08.4: fn(n, prompt_len, output_len, block_size) -> the share of KV blocks parallel sampling
    saves at the end of a request of n samples, when only whole prompt blocks are shared."""
    for n, p, o, bs in [(2, 19, 58, 16), (4, 19, 58, 16), (6, 19, 58, 16), (4, 161, 338, 16), (3, 10, 8, 4),
                        (2, 15, 1, 16), (5, 32, 7, 16), (3, 1, 20, 1)]:  # fmt: skip
        want, got = memory_saved_answer(n, p, o, bs), float(fn(n, p, o, bs))
        assert math.isclose(got, want, abs_tol=1e-9), (
            f"n={n}, prompt {p}, output {o}, blocks of {bs}: got {got:.4f}, expected {want:.4f} (shared: the "
            "prompt's whole blocks, once; every sample holds ceil((p + o) / block_size) logical blocks)"
        )
    _ok("(n - 1) * (p // block_size) / (n * ceil((p + o) / block_size)), as the block manager counts it")

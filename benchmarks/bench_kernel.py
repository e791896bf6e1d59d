"""The CUDA kernel alone, its host-side validation, and the public call, timed apart (GPU only).

bench_attention.py times `vllmini.paged_attention` as a user calls it. This script splits that time:
  raw       cuda_kernels.paged_attention_kernel (--version, default the best) on inputs validated once
  validate  validate_decode_args alone (one device-to-host copy of block_tables + seq_lens)
  full      vllmini.paged_attention(..., backend="cupy")
on the shapes (a), (b), (d), (e), (f) of benchmarks/RESULTS.md: head size 128, block_size 16, random K/V,
random non-identity block tables over a pool twice the needed size. Before timing, the raw kernel's output is
checked against a float64 reference on the first sequences. CUDA events, median of --repeats calls,
L2 flushed (256 MB written) before every call.

    python benchmarks/bench_kernel.py [--dtype float32|float16|bfloat16] [--repeats 30]

--compare OLD.cu also times another text of the same version's file on the same data, in the same run
(the fair way to compare variants: timings move by 10-20% between runs on the same GPU), e.g.
    git show HEAD~3:kernels/paged_attention_9_guard.cu > /tmp/old.cu
    python benchmarks/bench_kernel.py --dtype float16 --version 9 --compare /tmp/old.cu
--splits N ... also times the raw kernel with the context cut into N pieces (its output checked first),
to try the split rule (cuda_kernels._num_splits, SPLIT_BLOCKS_PER_SM), e.g. --version 9 --splits 1 4 8 16 33.
bench_attention.py times every version side by side.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from cuda_timing import median_us

import vllmini
from vllmini import cuda_kernels
from vllmini.attention import validate_decode_args

SHAPES = {  # name: (batch, query heads, kv heads, context)
    "(a) B=64 H=32 L=4096": (64, 32, 32, 4096),
    "(b) B=16 H=32 L=4096": (16, 32, 32, 4096),
    "(d) B=1 H=32 L=32768": (1, 32, 32, 32768),
    "(e) GQA B=64 32q/8kv L=4096": (64, 32, 8, 4096),
    "(f) B=1 H=32 L=4096": (1, 32, 32, 4096),
}


def make_case(batch, heads, kv_heads, context, dtype, head_size=128, block_size=16):
    blocks_per_seq = context // block_size
    num_blocks = 2 * batch * blocks_per_seq  # half the pool is never read
    kc = torch.randn(num_blocks, block_size, kv_heads, head_size, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_blocks, device="cuda")[: batch * blocks_per_seq].view(batch, -1).int()
    sl = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_size, device="cuda", dtype=dtype)
    return q, kc, vc, bt, sl


def check(out, q, kc, vc, bt, sl, num_seqs=2) -> float:
    """Relative L2 error of out[:num_seqs] against a float64 gather-then-softmax reference."""
    B, H, D = q.shape
    group = H // kc.shape[2]
    errs = []
    for s in range(min(num_seqs, B)):
        pages = bt[s].long()
        k = kc[pages].flatten(0, 1)[: int(sl[s])].double()  # (L, kvh, D)
        v = vc[pages].flatten(0, 1)[: int(sl[s])].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (L, H, D)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[s].double(), k) * D**-0.5, -1)
        ref = torch.einsum("hl,lhd->hd", p, v)
        errs.append(float((out[s].double() - ref).norm() / ref.norm()))
    return max(errs)


def time_us(fn, repeats: int, flush: torch.Tensor) -> float:
    """One warm-up call, then the median of `repeats` timed calls, each reading K/V from HBM."""
    fn()
    torch.cuda.synchronize()
    return median_us(fn, repeats, flush)


def bench_shape(
    name: str,
    shape: tuple,
    dtype: torch.dtype,
    repeats: int,
    flush: torch.Tensor,
    other: str | None = None,
    version: int | None = None,
    splits: tuple[int, ...] = (),
) -> str:
    """Check the kernel on one shape, then time raw / validate / full (and raw at each forced piece count
    of `splits`, each output checked first); returns the table row."""
    B, H, KVH, L = shape
    q, kc, vc, bt, sl = make_case(B, H, KVH, L, dtype)
    a = validate_decode_args(q, kc, vc, bt, sl)
    out = torch.empty_like(q)

    def kernel(**kw):  # the kernel on this shape's inputs (kw: num_splits=, source=)
        return lambda: cuda_kernels.paged_attention_kernel(
            a.query, a.key_cache, a.value_cache, a.block_tables, a.seq_lens, a.scale, out,
            version=version, **kw,
        )  # fmt: skip

    def checked(fn, what: str) -> float:  # fn's output against float64, before anything is timed
        out.fill_(float("nan"))  # poisoned: every element must be written
        fn()
        err = check(out, q, kc, vc, bt, sl)
        if not (torch.isfinite(out).all() and err < (1e-5 if dtype == torch.float32 else 1e-2)):
            raise SystemExit(f"{name}: {what} output wrong (relative error {err:.2e}); not timing it")
        return err

    raw = kernel()
    err = checked(raw, "kernel")
    t_raw = time_us(raw, repeats, flush)
    t_val = time_us(lambda: validate_decode_args(q, kc, vc, bt, sl), repeats, flush)
    t_full = time_us(lambda: vllmini.paged_attention(q, kc, vc, bt, sl, backend="cupy"), repeats, flush)
    tbs = 2 * B * L * KVH * 128 * kc.element_size() / t_raw / 1e6
    row = f"{name:30} {t_raw:9.1f} {tbs:6.2f} {t_val:12.1f} {t_full:9.1f} {err:8.1e}"
    for n in splits:  # the same kernel, the context cut into n pieces (1: no split)
        checked(forced := kernel(num_splits=n), f"{n}-piece")
        row += f" {n}:{time_us(forced, repeats, flush):.1f}"
    if other is not None:  # the other text of this version, same data, checked the same way first
        checked(raw_other := kernel(source=other), "--compare kernel")
        t_other = time_us(raw_other, repeats, flush)
        t_again = time_us(raw, repeats, flush)  # this version again: the spread of one run
        row += f" {t_other:10.1f} {t_other / t_raw:6.2f} {t_again:9.1f}"
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--compare", metavar="OLD.cu", help="also time this text of the version's file")
    parser.add_argument("--version", type=int, help="kernel version (default: the best, as backend='cupy')")
    parser.add_argument(
        "--splits", type=int, nargs="*", default=[], help="also time raw at these piece counts"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernel.py needs an NVIDIA GPU with CuPy (see bench_attention.py for CPU)")
    dtype = getattr(torch, args.dtype)
    flush = torch.empty(2**26, device="cuda")  # 256 MB, more than the H200's 60 MB of L2
    print(
        f"# {torch.cuda.get_device_name()} | {args.dtype} | median of {args.repeats} | head_size 128, bs 16"
    )
    other = Path(args.compare).read_text() if args.compare else None
    head = f"{'shape':30} {'raw us':>9} {'TB/s':>6} {'validate us':>12} {'full us':>9} {'rel err':>8}"
    print(head + (f" {'other us':>10} {'ratio':>6} {'raw again':>9}" if other else ""))
    for name, shape in SHAPES.items():
        row = bench_shape(name, shape, dtype, args.repeats, flush, other, args.version, tuple(args.splits))
        print(row, flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

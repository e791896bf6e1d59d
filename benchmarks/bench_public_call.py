"""The public call against cuDNN, side by side: GPU time, host time and back-to-back eager time per call.

    python benchmarks/bench_public_call.py                 # shapes (a)-(f) and GQA 32/4, 64/8; fp16, bf16
    python benchmarks/bench_public_call.py --quick         # two shapes, few repeats (a smoke test)

Both sides with default arguments: `vllmini.paged_attention(q, key_cache, value_cache, block_tables,
seq_lens)` on a paged cache (random tables over a pool twice the need, unused slots NaN) and cuDNN SDPA
(`scaled_dot_product_attention` under sdpa_kernel(CUDNN_ATTENTION), enable_gqa for GQA) on a contiguous
copy of the same K/V. Every output is checked against float64 first. Columns:
    GPU us      CUDA events around one call, L2 flushed before it (256 MB written), median of --repeats
    host us     time.perf_counter around --host-calls calls without a sync between them, per call (the
                GPU runs behind; the queue never fills), median of 5 rounds
    eager us    --eager-calls calls back to back, synchronized before and after, mean per call
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import make_dataset, reference, rel_err  # noqa: E402
from cuda_timing import median_us  # noqa: E402

import vllmini  # noqa: E402
from vllmini import cuda_kernels  # noqa: E402
from vllmini.attention import resolve_kernel_version  # noqa: E402

# (label, batch, context, heads, kv heads); head size 128, block size 16
SHAPES = [("(a)", 64, 4096, 32, 32), ("(b)", 16, 4096, 32, 32), ("(c)", 64, 512, 32, 32),
          ("(d)", 1, 32768, 32, 32), ("(e)", 64, 4096, 32, 8), ("(f)", 1, 4096, 32, 32),
          ("GQA 32/4", 64, 4096, 32, 4), ("GQA 64/8", 64, 4096, 64, 8)]  # fmt: skip
MAX_REL_ERR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def host_us(fn, calls: int) -> float:
    """Host microseconds per call: `calls` calls enqueued without a sync (median of 5 rounds)."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def eager_us(fn, calls: int) -> float:
    """Mean microseconds per call of `calls` back-to-back calls, synchronized at both ends."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--host-calls", type=int, default=200)
    p.add_argument("--eager-calls", type=int, default=1000)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    shapes = [SHAPES[4], SHAPES[5]] if args.quick else SHAPES
    flush = torch.empty(2**26, dtype=torch.float32, device="cuda")  # 256 MB > L2
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, CuPy {__import__('cupy').__version__}")  # fmt: skip
    print(f"{'shape':<22} {'dtype':<9} {'v':>2} {'cuDNN GPU':>9} {'ours GPU':>8} {'ratio':>6} "
          f"{'cuDNN host':>10} {'ours host':>9} {'cuDNN eager':>11} {'ours eager':>10} {'ratio':>6} "
          f"{'rel err':>8}")  # fmt: skip
    for dtype in (torch.float16, torch.bfloat16):
        for label, batch, context, heads, kv_heads in shapes:
            data = make_dataset(batch, context, heads, kv_heads, 128, dtype, 16, "cuda", seed=0)
            q4, kc, vc = data["contiguous"]
            ref = reference(q4, kc, vc, 128**-0.5)
            paged = data["paged"]
            ours = lambda paged=paged: vllmini.paged_attention(*paged)  # noqa: E731
            cudnn = lambda q4=q4, kc=kc, vc=vc: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)  # noqa: E731
            err = rel_err(ours(), ref)
            cuda_kernels.check_kernel_errors()
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn_err = rel_err(cudnn()[:, :, 0], ref)
                assert max(err, cudnn_err) < MAX_REL_ERR[dtype], (label, dtype, err, cudnn_err)
                row = [median_us(f, args.repeats, flush) for f in (cudnn, ours)]
                row += [host_us(f, args.host_calls) for f in (cudnn, ours)]
                eager = [eager_us(f, args.eager_calls) for f in (cudnn, ours)] if batch == 1 else [0, 0]
            v = resolve_kernel_version(
                None, dtype, head_size=128, group=heads // kv_heads, tensor_cores=True
            ).number
            name = f"{label} B{batch} H{heads}/{kv_heads} L{context}"
            eager_ratio = eager[1] / eager[0] if eager[0] else float("nan")
            print(f"{name:<22} {str(dtype)[6:]:<9} {v:>2} {row[0]:9.1f} {row[1]:8.1f} "
                  f"{row[1] / row[0]:6.2f} {row[2]:10.1f} {row[3]:9.1f} {eager[0]:11.1f} {eager[1]:10.1f} "
                  f"{eager_ratio:6.2f} {err:8.1e}", flush=True)  # fmt: skip
            del data, paged, q4, kc, vc
    print("all outputs checked against float64; eager columns for batch 1 only")


if __name__ == "__main__":
    main()

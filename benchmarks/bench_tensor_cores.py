"""Kernel 10 (GQA on tensor cores) against version 9 and cuDNN, side by side in one run.

    python benchmarks/bench_tensor_cores.py                      # the GQA shapes of issue 24, fp16 and bf16
    python benchmarks/bench_tensor_cores.py --small --repeats 3  # a short run (e.g. under compute-sanitizer)
    python benchmarks/bench_tensor_cores.py --shapes 64x255x32x8 1x255x32x8 --splits 1,2,4,8  # short contexts

Every output is checked against float64 first. Times: CUDA events, L2 flushed before each call, median of
--repeats calls. Rows: version 10 at several context splits, version 9 (its own launch plan, guard on), and
cuDNN SDPA on a contiguous cache (the same K/V, no page table). TB/s counts the K and V bytes read once.
Version 10 is launched here directly from its source (block 128, grid (num_seqs, num_heads / group,
splits)), so it runs before the package's launcher knows it.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import make_dataset, reference, rel_err  # noqa: E402
from cuda_timing import median_us, read_ceiling_us  # noqa: E402

from vllmini import cuda_kernels  # noqa: E402
from vllmini.cuda_kernels import kernel_error_buffer  # noqa: E402

TC = cuda_kernels.kernel_versions()[cuda_kernels.TENSOR_CORES].file  # paged_attention_10_tensor_cores
SUFFIX = {torch.float16: "_f16", torch.bfloat16: "_bf16"}
_modules: dict = {}


def tc_kernel(source: str, function: str, options: tuple[str, ...]):
    import cupy

    key = (hash(source), options)
    if key not in _modules:
        _modules[key] = cupy.RawModule(code=source, options=("--std=c++17", *options))
    return _modules[key].get_function(function)


def tensor_core_call(source: str, paged, scale: float, num_splits: int, error: torch.Tensor | None):
    """A zero-argument callable launching version 10 (and its merge) on one dataset; returns the output."""
    query, key_cache, value_cache, block_tables, seq_lens = paged
    num_seqs, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_heads // num_kv_heads
    hpb = max(h for h in range(1, 17) if group % h == 0)
    pages_per_split = -(-max_blocks // num_splits)
    num_splits = -(-max_blocks // pages_per_split)
    rows16 = hpb > 8
    options = (f"-DVLLMINI_ONLY_HEAD={head_size}", f"-DVLLMINI_ONLY_ROWS16={int(rows16)}")
    suffix = SUFFIX[query.dtype]
    kernel = tc_kernel(source, TC + suffix, options)
    merge = tc_kernel(source, f"{TC}_merge{suffix}", options)
    shared = 4 * (16 if rows16 else 8) * (head_size + 2) * 4
    out = torch.empty_like(query)
    part_out = part_ml = None
    if num_splits > 1:
        part_out = query.new_empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32)
        part_ml = query.new_empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    ints = (num_blocks, block_size, num_heads, head_size, num_kv_heads, max_blocks, hpb, pages_per_split)
    pointers = (out, part_out, part_ml, query, key_cache, value_cache, block_tables, seq_lens, error)
    args = (*map(ptr, pointers), *map(np.int32, ints), np.float32(scale))
    grid = (num_seqs, num_heads // hpb, num_splits)
    merge_args = (ptr(out), ptr(part_out), ptr(part_ml), np.int32(num_splits), np.int32(head_size))

    def fn():
        kernel(grid, (128,), args, shared_mem=shared)
        if num_splits > 1:
            merge((num_seqs, num_heads), (128,), merge_args)
        return out

    return fn


def guard_call(paged, scale: float):
    error = kernel_error_buffer(paged[0].device)

    def fn():
        out = torch.empty_like(paged[0])
        return cuda_kernels.paged_attention_kernel(
            *paged, scale, out, "cupy", version=cuda_kernels.IDEAS["guard"], error=error
        )

    return fn


def time_us(fn, repeats: int, flush: torch.Tensor) -> float:
    """Median GPU µs of fn() after two warm-up calls, L2 flushed before each (cuda_timing.median_us)."""
    for _ in range(2):
        fn()
    return median_us(fn, repeats, flush)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=str(Path(__file__).resolve().parent.parent / "kernels" / f"{TC}.cu"))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--splits", default="1,2,4", help="version 10 context splits to time")
    p.add_argument("--small", action="store_true", help="small shapes only (sanitizers)")
    p.add_argument(
        "--shapes",
        nargs="+",
        metavar="BxLxHxKV",
        help="batch x context x heads x kv_heads (default: issue 24's three GQA shapes at B64 L4096)",
    )
    p.add_argument("--variant", action="append", default=[], help="NAME=OLD=>NEW: a text edit of the source")
    p.add_argument(
        "--variant-file", action="append", default=[], help="NAME=PATH: another text of the source"
    )
    args = p.parse_args(argv)
    device = "cuda"
    base = Path(args.source).read_text()
    sources = {f"v{cuda_kernels.TENSOR_CORES}": base}
    for v in args.variant:
        name, edit = v.split("=", 1)
        old, new = edit.split("=>")
        assert old in base, f"variant {name}: {old!r} not in the source"
        sources[name] = base.replace(old, new)
    for v in args.variant_file:
        name, path = v.split("=", 1)
        sources[name] = Path(path).read_text()
    splits = [int(s) for s in args.splits.split(",")]
    shapes = [(64, 4096, 32, 8), (64, 4096, 32, 4), (64, 4096, 64, 8)]  # (batch, context, heads, kv_heads)
    if args.shapes:  # e.g. 64x255x32x8: a decode step's short contexts, to try the split rule
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    if args.small:
        shapes, splits = [(3, 300, 8, 2), (2, 77, 16, 1)], [1, 3]
    dtypes = (torch.float16, torch.bfloat16)
    flush = torch.empty(2**26, dtype=torch.float32, device=device)  # 256 MB > L2
    if not args.small:
        read_us = read_ceiling_us(2**32, args.repeats, flush)
        tbs = 2**32 / read_us / 1e6
        print(f"read ceiling: the plain read kernel over 4 GiB: {read_us:.0f} us = {tbs:.2f} TB/s")
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}")
    print(f"{'shape':<26} {'dtype':<9} {'row':<20} {'us':>8} {'TB/s':>6} {'x cuDNN':>8} {'rel err':>9}")
    for dtype in dtypes:
        for batch, context, heads, kv_heads in shapes:
            data = make_dataset(batch, context, heads, kv_heads, 128, dtype, 16, device, seed=0)
            scale = 128**-0.5
            q4, kc, vc = data["contiguous"]
            ref = reference(q4, kc, vc, scale)
            error = torch.zeros(5, dtype=torch.int32, device=device)
            calls = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                calls["cuDNN sdpa"] = lambda q4=q4, kc=kc, vc=vc, sc=scale: F.scaled_dot_product_attention(
                    q4, kc, vc, scale=sc, enable_gqa=True
                )[:, :, 0]
                try:
                    calls["cuDNN sdpa"]()
                except RuntimeError as e:
                    print(f"cuDNN unavailable: {str(e)[:200]}")
                    del calls["cuDNN sdpa"]
            calls[f"v{cuda_kernels.IDEAS['guard']} kernel"] = guard_call(data["paged"], scale)
            for name, src in sources.items():
                for s in splits:
                    calls[f"{name} splits={s}"] = tensor_core_call(src, data["paged"], scale, s, error)
            results = {}
            for name, fn in calls.items():
                if name == "cuDNN sdpa":
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = fn()
                        err = rel_err(out, ref)
                        us = time_us(fn, args.repeats, flush) if not args.small else float("nan")
                else:
                    out = fn()
                    err = rel_err(out, ref)
                    us = time_us(fn, args.repeats, flush) if not args.small else float("nan")
                results[name] = (us, err)
                tol = 2e-3 if dtype == torch.float16 else 1.6e-2
                assert err < tol, f"{name} {dtype} {(batch, context, heads, kv_heads)}: rel err {err:.2e}"
            assert error.tolist() == [0] * 5, f"guard tripped on valid tables: {error.tolist()}"
            base_us = results.get("cuDNN sdpa", (float("nan"),))[0]
            label = f"B{batch} L{context} {heads}/{kv_heads}"
            for name, (us, err) in results.items():
                tbs = data["kv_bytes"] / us / 1e6
                row = f"{label:<26} {str(dtype)[6:]:<9} {name:<20} {us:8.1f} {tbs:6.2f} {us / base_us:8.3f}"
                print(f"{row} {err:9.2e}")
    print("all outputs checked against float64")


if __name__ == "__main__":
    main()

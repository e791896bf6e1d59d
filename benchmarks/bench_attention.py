"""Decode-attention benchmark: every paged_attention backend and kernel version against contiguous SDPA.

For each shape it builds ONE random dataset: K/V generated contiguously, then scattered into a pool
about twice the size needed through random non-identity block tables (unused pages and slots NaN).
Every row's output is checked against a float64 reference first (the run aborts on a mismatch), then
timed. Rows (GPU): "sdpa (contiguous)" = `scaled_dot_product_attention` on the contiguous copy (torch's
default dispatch, enable_gqa for GQA); "torch gather" = `paged_attention(backend="torch")`; "vN kernel" =
kernel version N alone (`cuda_kernels.paged_attention_kernel` on validated inputs; versions 9-10 with
their in-kernel guard on, as the public call runs them; version 8 is version 9 without it);
"v9 identity table" = version 9 over an identity block table (paging's cost; not re-validated);
"(graph)" rows (--graphs) = the call captured once in a torch.cuda.CUDAGraph and replayed (no host time);
"public call" = `paged_attention(..., backend="cupy")` with default arguments; "public v5 + host check"
= kernel 5 behind the host's table check (validate=True: one host sync). "read ceiling" = the plain
read kernel (kernels/read_ceiling.cu, benchmarks/cuda_timing.py) over as many bytes as the shape's K and V.

    python benchmarks/bench_attention.py                      # small CPU grid, < 1 minute
    python benchmarks/bench_attention.py --device cuda --preset h200 --csv h200.csv --plot h200.png
    python benchmarks/bench_attention.py --batch 1 4 --context 16 40 --emulator   # the CPU emulator

--block-sizes 8 16 32 64 128 adds kernel 9 at other block sizes on the first shape (same data, re-paged).
--json writes the rows for notebook 07 (benchmarks/h200_attention.json is the recorded run).

Bandwidth = bytes of K+V of the valid tokens / time. "vs sdpa" and "vs torch" are time ratios
(t_backend / t_other; < 1 is faster). "% read bw" is the share of the device's read bandwidth,
measured here by the plain read kernel over 4 GB (a large torch.sum on a CPU). GPU: CUDA events,
median of --repeats (>= 30) calls, L2 flushed (256 MB written) before every timed call.
CPU: time.perf_counter, median.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from cuda_timing import read_ceiling_us
from tqdm import tqdm

import vllmini
from vllmini import cuda_kernels
from vllmini.attention import cupy_usable, validate_decode_args
from vllmini.cuda_kernels import IDEAS, kernel_error_buffer

G = IDEAS["guard"]  # the guarded version the public call runs (MHA, float32, no tensor cores)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# relative L2 error allowed against float64 (inputs are exact in every dtype)
MAX_REL_ERR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# the shapes (a)-(f): (batch, context, heads, kv heads); head size 128, block size 16
H200_SHAPES = [(64, 4096, 32, 32), (16, 4096, 32, 32), (64, 512, 32, 32), (1, 32768, 32, 32),
               (64, 4096, 32, 8), (1, 4096, 32, 32)]  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048], help="tokens per sequence")
    p.add_argument("--heads", type=int, nargs="+", default=[8])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    p.add_argument("--head-size", type=int, nargs="+", default=[64])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(DTYPES))
    p.add_argument("--block-size", type=int, nargs="+", default=[16])
    p.add_argument("--preset", choices=["h200"], help="shapes (a)-(f), D=128, bs=16, fp16+fp32")
    p.add_argument("--versions", type=int, nargs="*", help="kernel versions to time (default: all present)")
    p.add_argument("--block-sizes", type=int, nargs="*", default=[], help="extra block sizes, best kernel")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also time the guarded kernel and the public call as CUDA graphs",
    )
    p.add_argument("--variants", nargs="*", default=[], help=".cu files timed as variants of version 9")
    p.add_argument("--json", help="write the rows and the run's facts to this JSON file")
    p.add_argument("--repeats", type=int, help="timed calls per backend (default 30 on GPU, 7 on CPU)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats: a smoke test")
    p.add_argument("--emulator", action="store_true", help="also run the CPU emulator (tiny shapes only)")
    p.add_argument("--emulator-max-work", type=int, default=4096, help="max batch*heads*context for it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is steadier on a busy machine)")
    p.add_argument("--csv", help="write the rows to this CSV file")
    p.add_argument("--plot", help="save a bandwidth plot to this PNG file")
    return p.parse_args(argv)


def shape_grid(args) -> list[tuple]:
    """(batch, context, heads, kv_heads, head_size, dtype, block_size) tuples."""
    if args.preset == "h200":
        dtypes = args.dtype if args.dtype != ["float32"] else ["float16", "float32"]
        grid = [(*s, 128, d, 16) for d in dtypes for s in H200_SHAPES]
    else:
        grid = list(itertools.product(args.batch, args.context, args.heads, args.kv_heads, args.head_size,
                                      args.dtype, args.block_size))  # fmt: skip
    grid = [g for g in grid if g[2] % g[3] == 0]
    return grid[:2] if args.quick else grid


# ----------------------------------------------------------------------------- data and reference


def make_dataset(batch, context, heads, kv_heads, head_size, dtype, block_size, device, seed, identity=False):
    """K/V made contiguous, then scattered through random block tables into a NaN pool ~2x the need."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(batch, context, kv_heads, head_size, generator=gen, device=device).to(dtype)
    v = torch.randn(batch, context, kv_heads, head_size, generator=gen, device=device).to(dtype)
    q = torch.randn(batch, heads, head_size, generator=gen, device=device).to(dtype)
    pages_per_seq = -(-context // block_size)  # the same K, V, q for any block size; only the paging differs
    num_blocks = 2 * batch * pages_per_seq
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    if identity:
        perm = torch.arange(num_blocks, device=device)
    block_tables = perm[: batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    pos = torch.arange(context, device=device)
    slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # (B, L)
    pool_shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.full(pool_shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(pool_shape, float("nan"), dtype=dtype, device=device)
    key_cache.view(-1, kv_heads, head_size)[slots.flatten()] = k.flatten(0, 1)
    value_cache.view(-1, kv_heads, head_size)[slots.flatten()] = v.flatten(0, 1)
    return {
        "paged": (q, key_cache, value_cache, block_tables, seq_lens),
        "contiguous": (q[:, :, None], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()),
        "kv_bytes": 2 * batch * context * kv_heads * head_size * k.element_size(),
    }


def reference(q, k, v, scale) -> torch.Tensor:
    """float64 decode attention on the contiguous layout, a few sequences at a time (bounded memory)."""
    batch, heads, _, head_size = q.shape
    kv_heads, context = k.shape[1], k.shape[2]
    out = torch.empty(batch, heads, head_size, dtype=torch.float64, device=q.device)
    chunk = max(1, 2**27 // (kv_heads * context * head_size))
    for lo in range(0, batch, chunk):
        qq = q[lo : lo + chunk, :, 0].double().unflatten(1, (kv_heads, heads // kv_heads))  # (c, kvh, G, D)
        kk, vv = k[lo : lo + chunk].double(), v[lo : lo + chunk].double()  # (c, kvh, L, D)
        p = torch.softmax(torch.einsum("bkgd,bkld->bkgl", qq, kk) * scale, dim=-1)
        out[lo : lo + chunk] = torch.einsum("bkgl,bkld->bkgd", p, vv).flatten(1, 2)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------- timing


def time_fn(fn, device: str, repeats: int, flush: torch.Tensor | None) -> float:
    """Median microseconds per call."""
    for _ in range(2):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            flush.zero_()  # evict L2: the timed call reads K/V from HBM
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure_read_bandwidth(device: str, repeats: int) -> float:
    """Bytes/s of the plain read kernel over 4 GB on a GPU; of a torch.sum over 256 MB on a CPU."""
    if device.startswith("cuda"):
        flush = torch.empty(2**26, device=device)
        return 2**32 / (read_ceiling_us(2**32, max(repeats, 10), flush) * 1e-6)
    n = 2**26  # float32 elements
    x = torch.ones(n, dtype=torch.float32, device=device)
    return n * 4 / (time_fn(x.sum, device, 5, None) * 1e-6)


# ----------------------------------------------------------------------------- main


def kernel_call(args_, version: int, guard: bool, tables=None, source=None):
    """The kernel alone on validated inputs (what the public call launches after its checks)."""
    a = args_
    bt = a.block_tables if tables is None else tables
    error = kernel_error_buffer(a.query.device) if guard else None

    def fn():
        out = torch.empty_like(a.query)
        return cuda_kernels.paged_attention_kernel(
            a.query, a.key_cache, a.value_cache, bt, a.seq_lens, a.scale, out, "cupy", version=version,
            error=error, source=source,
        )  # fmt: skip

    return fn


def calls_for(args, shape, data, scale, q4, kc, vc) -> dict:
    """Row name -> zero-argument callable returning the output, for one shape's dataset."""
    batch, context, heads, kv_heads = shape[:4]
    gqa = heads != kv_heads
    calls = {
        "sdpa (contiguous)": lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=gqa)
    }
    calls["torch gather"] = lambda: vllmini.paged_attention(*data["paged"], scale, backend="torch")
    on_gpu = args.device.startswith("cuda")
    if on_gpu and cupy_usable():
        a = validate_decode_args(*data["paged"], scale)
        present = cuda_kernels.kernel_versions()
        dtype = data["paged"][0].dtype
        for n in args.versions if args.versions is not None else sorted(present):
            v = present.get(n)
            if v is None or dtype not in v.dtypes:
                continue
            calls[f"v{n} kernel"] = kernel_call(a, n, v.guard)
        for path in args.variants:  # other texts of version 9's file, same launch (tuning experiments)
            calls[f"v{G} variant {Path(path).stem}"] = kernel_call(a, G, True, source=Path(path).read_text())
        calls["public call"] = lambda: vllmini.paged_attention(*data["paged"], scale, backend="cupy")
        if (h := IDEAS["half_warps"]) in present:
            calls[f"public v{h} + host check"] = lambda: vllmini.paged_attention(
                *data["paged"], scale, backend="cupy", kernel_version=h, validate=True
            )
    elif args.emulator and batch * heads * context <= args.emulator_max_work:
        calls["emulator"] = lambda: vllmini.paged_attention(*data["paged"], scale, backend="emulator")
    return calls


def backends_for(args, shape) -> list[str]:
    """Rows per shape, for the progress bar (an estimate)."""
    n = 2 + (2 * len(cuda_kernels.kernel_versions()) + 4 if args.device.startswith("cuda") else 1)
    return [""] * n


def bench_shape(args, shape, repeats, flush, read_bw, bar, notes) -> list[dict]:
    """Check, then time, every row on one shape's dataset."""
    device = args.device
    batch, context, heads, kv_heads, head_size, dtype_name, block_size = shape
    dtype = DTYPES[dtype_name]
    data = make_dataset(batch, context, heads, kv_heads, head_size, dtype, block_size, device, args.seed)
    scale = head_size**-0.5
    q4, kc, vc = data["contiguous"]
    ref = reference(q4, kc, vc, scale)
    calls = calls_for(args, shape, data, scale, q4, kc, vc)
    label = f"B={batch} L={context} H={heads}/{kv_heads} D={head_size} {dtype_name} bs={block_size}"
    results = {}
    for b, fn in calls.items():
        bar.set_postfix_str(f"{label} {b}")
        out = fn()
        err = rel_err(out[:, :, 0] if out.dim() == 4 else out, ref)
        out = None  # free it before timing
        if not err <= MAX_REL_ERR[dtype]:
            raise SystemExit(f"MISMATCH {label} {b}: relative L2 error {err:.2e} > {MAX_REL_ERR[dtype]}")
        results[b] = (time_fn(fn, device, repeats, flush), err)
        bar.update()
    on_gpu = flush is not None
    if on_gpu and args.graphs:  # the same calls captured in a CUDA graph: the GPU's time without the host's
        for b in [b for b in (f"v{G} kernel", "public call") if b in calls]:
            calls[b]()  # warm (compiles, the error buffer) before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = calls[b]()
            graph.replay()
            err = rel_err(captured, ref)
            if not err <= MAX_REL_ERR[dtype]:
                raise SystemExit(f"MISMATCH {label} {b} (graph): relative L2 error {err:.2e}")
            results[f"{b} (graph)"] = (time_fn(graph.replay, device, repeats, flush), err)
            del graph, captured
    if on_gpu:
        if f"v{G} kernel" in results:  # the same kernel over an identity table: what paging costs
            ident = make_dataset(batch, context, heads, kv_heads, head_size, dtype, block_size, device,
                                 args.seed, identity=True)  # fmt: skip
            a = validate_decode_args(*ident["paged"], scale)
            results[f"v{G} identity table"] = (
                time_fn(kernel_call(a, G, True), device, repeats, flush),
                float("nan"),
            )
            del ident, a
        # the read ceiling at this byte count: the plain read kernel over as many bytes as K and V
        ceiling = read_ceiling_us(data["kv_bytes"] // 16 * 16, repeats, flush)
        results["read ceiling"] = (ceiling, float("nan"))
        for bs in args.block_sizes if shape == args.sweep_shape else ():
            if bs == block_size or f"v{G} kernel" not in results:
                continue
            other = make_dataset(batch, context, heads, kv_heads, head_size, dtype, bs, device, args.seed)
            a = validate_decode_args(*other["paged"], scale)
            fn = kernel_call(a, G, True)
            err = rel_err(fn(), ref)
            if not err <= MAX_REL_ERR[dtype]:
                raise SystemExit(f"MISMATCH {label} v{G} bs={bs}: relative L2 error {err:.2e}")
            results[f"v{G} kernel bs={bs}"] = (time_fn(fn, device, repeats, flush), err)
            del other, a
    rows = []
    base_t, torch_t = results["sdpa (contiguous)"][0], results["torch gather"][0]
    ceiling_t = results.get("read ceiling", (None,))[0]
    dev_name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    for b, (t, err) in results.items():
        bw = data["kv_bytes"] / (t * 1e-6)
        rows.append({
            "shape": label, "batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads,
            "head_size": head_size, "dtype": dtype_name, "block_size": block_size, "backend": b,
            "time_us": round(t, 2), "gb_per_s": round(bw / 1e9, 2),
            "pct_read_bw": round(100 * bw / read_bw, 1), "vs_sdpa": round(t / base_t, 3),
            "vs_torch": round(t / torch_t, 3),
            "pct_ceiling": round(100 * ceiling_t / t, 1) if ceiling_t else "",
            "rel_err": f"{err:.1e}", "device": dev_name,
        })  # fmt: skip
    return rows


def run(args) -> list[dict]:
    device = args.device
    on_gpu = device.startswith("cuda")
    repeats = args.repeats or (30 if on_gpu else 7)
    if args.quick and not on_gpu:
        repeats = min(repeats, 5)
    grid = shape_grid(args)
    args.sweep_shape = grid[0] if grid else None  # --block-sizes: on the first shape only (time)
    flush = torch.empty(2**26, dtype=torch.float32, device=device) if on_gpu else None  # 256 MB > L2
    read_bw = measure_read_bandwidth(device, repeats)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | {name} | torch {torch.__version__} "
          f"| {repeats} timed calls per cell | measured read bandwidth {read_bw / 1e9:.1f} GB/s")  # fmt: skip
    rows, notes = [], []
    bar = tqdm(total=sum(len(backends_for(args, s)) + 1 for s in grid), desc="bench_attention", unit="run")
    for shape in grid:
        rows += bench_shape(args, shape, repeats, flush, read_bw, bar, notes)
        if on_gpu:
            torch.cuda.empty_cache()
    bar.close()
    print_table(rows)
    for n in notes:
        print("note:", n)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [("backend", "backend", 24), ("time_us", "time µs", 10), ("gb_per_s", "GB/s", 9),
            ("pct_ceiling", "% ceil", 8), ("vs_sdpa", "vs sdpa", 8), ("vs_torch", "vs torch", 9),
            ("rel_err", "rel err", 8)]  # fmt: skip
    shape = None
    print("".join(f"{h:>{w}}" if k != "backend" else f"{h:<{w}}" for k, h, w in cols))
    for r in rows:
        if r["shape"] != shape:
            shape = r["shape"]
            print(shape)
        print("".join(f"{r[k]!s:>{w}}" if k != "backend" else f"  {r[k]:<{w - 2}}" for k, _, w in cols))


def save_plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    keep = ("sdpa (contiguous)", "torch gather", "read ceiling")
    backends = [b for b in dict.fromkeys(r["backend"] for r in rows) if b in keep or b.endswith(" kernel")]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 4.8))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        vals = {r["shape"]: r["gb_per_s"] for r in rows if r["backend"] == b}
        xs = [j + i * width for j, s in enumerate(shapes) if s in vals]
        ax.bar(xs, [vals[s] for s in shapes if s in vals], width, label=b)
    peak = rows[0]["gb_per_s"] / rows[0]["pct_read_bw"] * 100 if rows[0]["pct_read_bw"] else None
    if peak:
        ax.axhline(peak, color="black", linestyle="--", linewidth=1, label=f"measured read {peak:.0f} GB/s")
    ticks = [j + 0.4 - width / 2 for j in range(len(shapes))]
    ax.set_xticks(ticks, [s.replace(" ", "\n", 3) for s in shapes], fontsize=7)
    ax.set_ylabel("GB/s of K+V of valid tokens")
    ax.set_title(f"decode attention on {rows[0]['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"csv saved to {args.csv}")
    if args.plot:
        save_plot(rows, args.plot)
    if args.json:
        import json

        facts = {
            "date_utc": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}",
            "torch": torch.__version__,
            "command": "python benchmarks/bench_attention.py " + " ".join(argv or __import__("sys").argv[1:]),
        }
        with open(args.json, "w") as f:
            json.dump({"facts": facts, "rows": rows}, f, indent=1)
        print(f"json saved to {args.json}")


if __name__ == "__main__":
    main()

"""Tests for kernel version 10 (kernels/paged_attention_10_tensor_cores.cu): GQA decode on tensor cores.

1. the emulator's model of `mma.sync.aligned.m16n8k16` (vllmini/emulator/emu_mma.h) against a plain matrix
   product, one fragment layout at a time (A, B, C/D) and all together; a lane that skips it is an error;
2. version 10 through the emulator against the float64 reference: random non-identity block tables, GQA
   groups 1, 4 and 8 (and 16 rows), lengths on and around block boundaries, with and without splits, the
   in-kernel guard;
3. the same on a GPU (marked gpu), where the mma test checks the layouts against the hardware.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from attention_cases import assert_close, make_decode_case, reference_decode

from vllmini import cuda_kernels
from vllmini.emulator import KernelError, RawKernel

MMA_SOURCE = (Path(__file__).resolve().parent / "emulator_kernels" / "mma.cu").read_text()
V9 = "paged_attention_10_tensor_cores"
THREADS = 128
SUFFIX = {torch.float16: "_f16", torch.bfloat16: "_bf16"}


# ----------------------------------------------------------------------------- the mma model


def _mma(runtime: str, dtype: torch.dtype, a, b, c, function: str | None = None) -> torch.Tensor:
    """d = a @ b + c for [warps, 16, 16] x [warps, 16, 8] (+ [warps, 16, 8]), one warp per product."""
    warps = a.shape[0]
    name = function or "mma" + SUFFIX[dtype]
    device = "cuda" if runtime == "cupy" else "cpu"
    a, b, c = (x.to(device).contiguous() for x in (a.to(dtype), b.to(dtype), c.float()))
    d = torch.full((warps, 16, 8), float("nan"), device=device)
    args = (d, a.view(torch.uint16), b.view(torch.uint16), c)
    if runtime == "cupy":
        import cupy

        kernel = cupy.RawKernel(MMA_SOURCE, name, options=("--std=c++17",))
        kernel((1,), (32 * warps,), tuple(x.data_ptr() for x in args))
        torch.cuda.synchronize()
    else:
        RawKernel(MMA_SOURCE, name, filename="mma.cu")((1,), (32 * warps,), args)
    return d.cpu()


def _layout_cases(gen: torch.Generator):
    """(name, a, b, c): each fragment layout on its own (the others fixed and structured), then all."""
    eye = torch.eye(16)
    rand_a = torch.randn(2, 16, 16, generator=gen)
    rand_b = torch.randn(2, 16, 8, generator=gen)
    rand_c = torch.randn(2, 16, 8, generator=gen)
    zeros_c = torch.zeros(2, 16, 8)
    # A alone: B picks columns 0-7 of A (warp 0) and 8-15 (warp 1), so D shows every element of A
    pick = torch.stack([eye[:, :8], eye[:, 8:]])
    yield "A", rand_a, pick, zeros_c
    # B alone: A = identity, so D = B
    yield "B", eye.expand(2, 16, 16), rand_b, zeros_c
    # C/D alone: A = 0, so D = C
    yield "C", torch.zeros(2, 16, 16), rand_b, rand_c
    yield "all", rand_a, rand_b, rand_c


def _check_mma(runtime: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, a, b, c in _layout_cases(gen):
        a16, b16 = a.to(dtype), b.to(dtype)  # the inputs as the kernel sees them (rounded)
        ref = a16.double() @ b16.double() + c.double()
        d = _mma(runtime, dtype, a, b, c)
        exact = name != "all"  # one nonzero product per output: no rounding at all
        tol = 0.0 if exact else 1e-5
        msg = lambda m, n=name: f"layout {n}: {m}"  # noqa: E731
        torch.testing.assert_close(d.double(), ref, rtol=tol, atol=tol, msg=msg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_emulator_mma_matches_a_matrix_product(dtype):
    _check_mma("emulator", dtype)


def test_emulator_mma_is_warp_wide():
    a, b, c = torch.zeros(1, 16, 16), torch.zeros(1, 16, 8), torch.zeros(1, 16, 8)
    with pytest.raises(KernelError, match="mma.cu"):
        _mma("emulator", torch.float16, a, b, c, function="mma_divergent")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_gpu_mma_matches_the_same_layouts(dtype):
    _check_mma("cupy", dtype)


# ----------------------------------------------------------------------------- version 10


def heads_per_block(num_heads: int, num_kv_heads: int) -> int:
    """The whole GQA group when it fits the 16 rows, else its largest divisor that does."""
    group = num_heads // num_kv_heads
    return max(h for h in range(1, 17) if group % h == 0)


def launch_v9(case: dict, runtime: str, num_splits: int = 1, error: torch.Tensor | None = None, hpb=None):
    """Version 10 on a decode case, launched as kernels/paged_attention_10_tensor_cores.cu's header says."""
    query, key_cache = case["query"], case["key_cache"]
    num_seqs, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    max_blocks = case["block_tables"].shape[1]
    hpb = hpb or heads_per_block(num_heads, num_kv_heads)
    pages_per_split = -(-max_blocks // num_splits)
    num_splits = -(-max_blocks // pages_per_split)
    rows = 16 if hpb > 8 else 8
    shared = 4 * rows * (head_size + 2) * 4
    out = torch.empty_like(query)
    part_out = part_ml = None
    if num_splits > 1:
        part_out = query.new_empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32)
        part_ml = query.new_empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32)
    raw = [t.view(torch.uint16) for t in (out, query, key_cache, case["value_cache"])]
    ints = (num_blocks, block_size, num_heads, head_size, num_kv_heads, max_blocks, hpb, pages_per_split)
    args = (raw[0], part_out, part_ml, *raw[1:], case["block_tables"], case["seq_lens"], error,
            *map(np.int32, ints), np.float32(case["scale"]))  # fmt: skip
    grid = (num_seqs, num_heads // hpb, num_splits)
    merge_args = (raw[0], part_out, part_ml, np.int32(num_splits), np.int32(head_size))
    suffix = SUFFIX[query.dtype]
    if runtime == "cupy":
        kernel = cuda_kernels._cupy_kernel(V9, V9 + suffix, query.device.index)
        merge = cuda_kernels._cupy_kernel(V9, f"{V9}_merge{suffix}", query.device.index)
        cargs = [0 if a is None else a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        kernel(grid, (THREADS,), tuple(cargs), shared_mem=shared)
        if num_splits > 1:
            merge((num_seqs, num_heads), (128,), tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                                                       for a in merge_args))  # fmt: skip
    else:
        source = cuda_kernels.read_kernel_source(V9)
        RawKernel(source, V9 + suffix, filename=f"{V9}.cu")(grid, (THREADS,), args, shared_mem=shared)
        if num_splits > 1:
            RawKernel(source, f"{V9}_merge{suffix}", filename=f"{V9}.cu")(
                (num_seqs, num_heads), (128,), merge_args
            )
    return out


def _lens(block_size: int) -> tuple[int, ...]:
    return (1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 40)


# (num_heads, num_kv_heads, head_size, block_size): groups 1, 4, 8 and 16 rows; head sizes 64 and 128;
# block sizes below, equal to and above the 16-token step, and one not a power of two
V9_SHAPES = [
    (2, 2, 64, 16),
    (8, 2, 128, 16),
    (8, 1, 64, 8),
    (16, 2, 128, 32),
    (16, 1, 64, 16),
    (8, 2, 64, 12),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", V9_SHAPES, ids=lambda s: "h{}kv{}-d{}-bs{}".format(*s))
def test_v9_emulator_matches_float64(shape, dtype):
    nh, nkv, hs, bs = shape
    lens = _lens(bs)
    case = make_decode_case(hash(shape) % 1000, len(lens), nh, nkv, hs, bs, lens, dtype=dtype)
    ref = reference_decode(case)
    assert_close(launch_v9(case, "emulator"), ref)
    # split contexts: pieces of one or more pages, some past a short sequence's end
    assert_close(launch_v9(case, "emulator", num_splits=3), ref)


def test_v9_emulator_heads_per_block_below_the_group():
    case = make_decode_case(7, 2, 8, 1, 64, 16, (17, 33), dtype=torch.float16)
    assert_close(launch_v9(case, "emulator", hpb=4), reference_decode(case))


def test_v9_emulator_guard_records_a_bad_page_and_never_reads_it():
    case = make_decode_case(3, 3, 8, 2, 64, 16, (20, 33, 5), dtype=torch.float16)
    ref = reference_decode(case)
    case["block_tables"][1, 1] = 10**6  # a page id far past the pool
    error = torch.zeros(5, dtype=torch.int32)
    out = launch_v9(case, "emulator", num_splits=2, error=error)
    assert error.tolist() == [1, 1, 1, 10**6, case["num_blocks"]]
    assert out[1].isnan().all()
    assert_close(out[[0, 2]], ref[[0, 2]])
    # a bad length: recorded with entry -1, its rows NaN
    case = make_decode_case(4, 2, 4, 1, 64, 16, (20, 5), dtype=torch.bfloat16)
    case["seq_lens"][0] = 1000
    error = torch.zeros(5, dtype=torch.int32)
    out = launch_v9(case, "emulator", error=error)
    assert error.tolist() == [1, 0, -1, 1000, case["block_tables"].shape[1] * 16]
    assert out[0].isnan().all() and not out[1].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [*V9_SHAPES, (32, 8, 128, 16), (32, 4, 128, 16), (64, 8, 128, 16)],
    ids=lambda s: "h{}kv{}-d{}-bs{}".format(*s),
)
def test_v9_gpu_matches_float64(shape, dtype):
    nh, nkv, hs, bs = shape
    lens = (*_lens(bs), 1000)
    case = make_decode_case(hash(shape) % 1000, len(lens), nh, nkv, hs, bs, lens, dtype=dtype, device="cuda")
    ref = reference_decode(case)
    for num_splits in (1, 4):
        assert_close(launch_v9(case, "cupy", num_splits=num_splits), ref)


@pytest.mark.gpu
def test_v9_gpu_guard():
    case = make_decode_case(3, 3, 8, 2, 128, 16, (20, 33, 5), dtype=torch.float16, device="cuda")
    ref = reference_decode(case)
    case["block_tables"][1, 1] = -5
    error = torch.zeros(5, dtype=torch.int32, device="cuda")
    out = launch_v9(case, "cupy", num_splits=2, error=error)
    assert error.tolist() == [1, 1, 1, -5, case["num_blocks"]]
    assert out[1].isnan().all()
    assert_close(out[[0, 2]], ref[[0, 2]])

"""Tests for the CUDA kernels in kernels/ and their launcher, vllmini.cuda_kernels.

1. every .cu file (the planted-bug ones in kernels/bugs/ too) compiles with NVRTC for every GPU
   architecture learners have -- no GPU needed, so this runs in CI;
2. every real kernel, run on the CPU through vllmini.emulator, matches the float64 reference on the
   attention tests' hostile cases (NaN-poisoned pages, aliased blocks, junk padding);
3. the same cases through CuPy on a GPU (marked gpu);
4. inputs are validated before any launch; the emulator backend equals the torch backend.
"""

import os

import numpy as np
import pytest
import torch
from attention_cases import (
    DECODE_GRID,
    DECODE_GRID_SMALL,
    assert_close,
    case_id,
    make_decode_case,
    reference_decode,
)

from vllmini import cuda_kernels
from vllmini.attention import paged_attention
from vllmini.cuda_kernels import check_kernel_errors, kernel_error_buffer
from vllmini.errors import (
    InvalidArgumentError,
    InvalidBlockTableError,
    InvalidTypeError,
    KernelSourceNotFoundError,
)

DECODE_KEYS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
KERNEL_FILES = cuda_kernels.kernel_files(include_bugs=True)
REAL_KERNELS = cuda_kernels.kernel_files(include_bugs=False)
VERSIONS = sorted(cuda_kernels.kernel_versions())  # every version whose .cu file is present
BEST = cuda_kernels.resolve_kernel_version(None).number
FLOAT_VERSIONS = [v for v in VERSIONS if torch.float32 in cuda_kernels.kernel_versions()[v].dtypes]
HALF_VERSIONS = [v for v in VERSIONS if torch.float16 in cuda_kernels.kernel_versions()[v].dtypes]
SPLIT_VERSIONS = [v for v in VERSIONS if cuda_kernels.kernel_versions()[v].has("split_context")]
TENSOR = cuda_kernels.TENSOR_CORES


def takes(version: int, params) -> bool:
    """Whether a kernel version runs a case's head size (version 10: 64 and 128 only)."""
    return version != TENSOR or params.head_size in cuda_kernels.TENSOR_CORE_HEAD_SIZES


def half_cases(grid):
    """(version, params) for every 16-bit version and every case of `grid` it takes."""
    return [pytest.param(v, p, id=f"v{v}-{case_id(p)}") for v in HALF_VERSIONS for p in grid if takes(v, p)]


def decode(case, backend, **kw):
    return paged_attention(*(case[k] for k in DECODE_KEYS), case["scale"], backend=backend, **kw)


def launch(case, runtime, version=None, **kw):
    """Call the launcher directly (no validation), as vllmini.paged_attention does after validating."""
    out = torch.empty_like(case["query"])
    args = [case[k] for k in DECODE_KEYS]
    return cuda_kernels.paged_attention_kernel(
        *args, case["scale"], out, runtime=runtime, version=version, **kw
    )


# ----------------------------------------------------------------------------- sources and NVRTC


def test_kernel_sources_are_found():
    names = [f.relative_to(cuda_kernels.kernel_dir()).as_posix() for f in KERNEL_FILES]
    for number in (2, 3, 4, 5, 6, 7, 8, 9):
        v = cuda_kernels.kernel_versions()[number]
        assert f"{v.file}.cu" in names
        assert cuda_kernels.read_kernel_source(v.file) == cuda_kernels.read_kernel_source(f"{v.file}.cu")
        for dtype in v.dtypes:  # every entry point the registry names is in the file
            assert f" {v.function(dtype)}(" in cuda_kernels.read_kernel_source(v.file)
    with pytest.raises(
        KernelSourceNotFoundError, match="paged_attention_5_half_warps"
    ):  # a FileNotFoundError
        cuda_kernels.read_kernel_source("no_such_kernel")


def test_version_registry_and_choice():
    versions = cuda_kernels.kernel_versions()
    assert set(versions) >= set(range(2, 11)) and BEST == 9
    assert all(v.file == f"paged_attention_{n}_{v.name}" for n, v in versions.items())
    assert cuda_kernels.resolve_kernel_version("half_warps").number == 5
    assert cuda_kernels.resolve_kernel_version("5_half_warps").number == 5
    assert cuda_kernels.resolve_kernel_version(np.int64(3)).number == 3
    assert cuda_kernels.resolve_kernel_version(None, torch.bfloat16).number == 9
    # the auto rule: version 10 for a 16-bit GQA group of head size 64 or 128 on tensor cores, else 9
    auto = cuda_kernels.resolve_kernel_version
    for dtype in (torch.float16, torch.bfloat16):
        assert auto(None, dtype, head_size=128, group=4).number == 10
        assert auto(None, dtype, head_size=64, group=16).number == 10
        assert auto(None, dtype, head_size=128, group=1).number == 9  # MHA
        assert auto(None, dtype, head_size=96, group=4).number == 9
        assert auto(None, dtype, head_size=128, group=4, tensor_cores=False).number == 9  # before sm_80
    assert auto(None, torch.float32, head_size=128, group=4).number == 9
    with pytest.raises(InvalidTypeError, match=r"kernel version 10 \(tensor_cores\) supports"):
        auto(10, torch.float32)
    for n in (2, 3, 4):  # the float32-only steps before 16-bit caches
        with pytest.raises(InvalidTypeError, match=rf"kernel version {n} \(\w+\) supports"):
            auto(n, torch.float16)
    with pytest.raises(InvalidArgumentError, match="kernel_version must be one of"):
        cuda_kernels.resolve_kernel_version(99)
    with pytest.raises(InvalidArgumentError, match="'nope' is not one of"):
        cuda_kernels.resolve_kernel_version("nope")
    with pytest.raises(InvalidTypeError, match="kernel_version must be an int"):
        cuda_kernels.resolve_kernel_version(4.0)
    if 1 in versions:
        with pytest.raises(InvalidTypeError, match="supports"):
            cuda_kernels.resolve_kernel_version(1, torch.float16)


def test_launch_plan_splits_only_when_the_batch_does_not_fill_the_gpu():
    guard = cuda_kernels.kernel_versions()[cuda_kernels.IDEAS["guard"]]
    # (a) B=64 H=32: 2048 blocks fill 132 SMs; (f) B=1 H=32 L=4096: 32 blocks -> 16 pieces of 256 tokens
    full = cuda_kernels.launch_plan(guard, 64, 32, 32, 128, 16, 256, torch.float16, 132)
    assert full.num_splits == 1 and full.grid == (64, 32, 1) and full.heads_per_block == 1
    one = cuda_kernels.launch_plan(guard, 1, 32, 32, 128, 16, 256, torch.float16, 132)
    assert one.num_splits == 16 and one.pages_per_split == 16 and one.grid == (1, 32, 16)
    # GQA: one block per KV head serves its 4 query heads (8 heads in 2 blocks of 4)
    gqa = cuda_kernels.launch_plan(guard, 64, 32, 8, 128, 16, 256, torch.float16, 132)
    assert gqa.heads_per_block == 4 and gqa.grid[1] == 8
    assert (
        cuda_kernels.launch_plan(guard, 4, 6, 2, 128, 16, 4, torch.float32, 132).heads_per_block == 1
    )  # group 3
    assert cuda_kernels.launch_plan(guard, 4, 8, 2, 256, 16, 4, torch.float16, 132).heads_per_block == 2
    # short contexts are never cut below MIN_SPLIT_TOKENS
    assert cuda_kernels.launch_plan(guard, 1, 4, 4, 64, 16, 8, torch.float32, 132).num_splits == 1
    # the pieces come from the longest sequence as the host knows it, not from the table's width
    wide = cuda_kernels.launch_plan(guard, 1, 32, 32, 128, 16, 2048, torch.float16, 132, None, 4096)
    assert wide.num_splits == 16 and wide.pages_per_split == 16


def test_launch_plan_of_the_tensor_core_version():
    tc = cuda_kernels.kernel_versions()[cuda_kernels.TENSOR_CORES]
    plan = lambda *a, **k: cuda_kernels.launch_plan(tc, *a, **k)  # noqa: E731
    # (e) GQA 32/8 B64: 512 blocks (a group of 4 each) on 3 x 132 slots; 3 pieces make 3.9 waves
    e = plan(64, 32, 8, 128, 16, 256, torch.float16, 132)
    assert e.heads_per_block == 4 and e.grid == (64, 8, 3) and e.pages_per_split == 86
    assert e.block == (128, 1, 1) and e.shared_mem == 4 * 8 * 130 * 4
    assert e.options == ("-DVLLMINI_ONLY_HEAD=128", "-DVLLMINI_ONLY_ROWS16=0")
    assert plan(32, 32, 8, 128, 16, 256, torch.float16, 132).num_splits == 1  # 256 blocks: one wave
    # a small batch fills one wave, pieces no shorter than MIN_SPLIT_TOKENS
    one = plan(1, 32, 8, 128, 16, 2048, torch.float16, 132)
    assert one.grid == (1, 8, 49) and one.pages_per_split == 42
    assert plan(1, 32, 8, 128, 16, 2048, torch.float16, 132, None, 1000).num_splits == 3
    # 16 rows: a group of 16, or its largest divisor <= 16
    g16 = plan(2, 16, 1, 64, 16, 4, torch.bfloat16, 132)
    assert g16.heads_per_block == 16 and g16.shared_mem == 4 * 16 * 66 * 4
    assert g16.options[1] == "-DVLLMINI_ONLY_ROWS16=1"
    assert plan(2, 24, 1, 64, 16, 4, torch.bfloat16, 132).heads_per_block == 12


def test_nvrtc_loads():
    """CI installs nvidia-cuda-nvrtc-cu12, so there a missing NVRTC is a failure, not a skip."""
    try:
        version = cuda_kernels.nvrtc_version()
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"NVRTC not installed here: {e}")
    assert version >= (11, 2)


# Every .cu file is compiled for the H100/H200: to a cubin for sm_90 (NVRTC, then ptxas), except versions
# 4-7 of the chain, compiled to PTX for compute_90 (NVRTC alone): they build every head-size copy at once and
# ptxas took 10-45 s each on CI's 2 cores (the GPU tests assemble and run them). A file whose code depends
# on the architecture (__CUDA_ARCH__) is built for every arch the package names.
ALL_COPIES = {
    f"{v.file}.cu"
    for v in cuda_kernels.VERSIONS
    if cuda_kernels.IDEAS["loads_in_flight"] <= v.number < cuda_kernels.IDEAS["fewer_instructions"]
}


def _targets(path) -> tuple[str, ...]:
    if "__CUDA_ARCH__" in path.read_text():
        return cuda_kernels.ARCHS
    return ("compute_90",) if path.name in ALL_COPIES else ("sm_90",)


ARCH_CASES = [(path, arch) for path in KERNEL_FILES for arch in _targets(path)]


@pytest.mark.parametrize(
    "path, arch",
    ARCH_CASES,
    ids=[f"{p.relative_to(cuda_kernels.kernel_dir()).as_posix()}-{a}" for p, a in ARCH_CASES],
)
def test_every_kernel_compiles_with_nvrtc(path, arch):
    if not os.environ.get("CI"):
        try:
            cuda_kernels.nvrtc_version()
        except RuntimeError as e:
            pytest.skip(f"NVRTC not installed here: {e}")
    # versions 8 and 9 hold 48 copies of its loop (3 dtypes x 8 head-size chunks x GQA or not) and a GPU build
    # compiles one chunk's copies at a time (cuda_kernels.launch_plan); here too: minutes -> seconds
    options = ("-DVLLMINI_ONLY_CHUNKS=4",) if "VLLMINI_ONLY_CHUNKS" in path.read_text() else ()
    built = cuda_kernels.compile_for_arch(path.read_text(), arch, name=path.name, options=options)
    if arch.startswith("sm_"):
        assert built[:4] == b"\x7fELF"  # a cubin is an ELF file
    else:
        text = built.decode() if isinstance(built, bytes) else built
        assert ".target sm_90" in text and ".entry" in text  # PTX with the kernels' entry points


def test_compile_errors_name_the_line():
    try:
        cuda_kernels.nvrtc_version()
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"NVRTC not installed here: {e}")
    with pytest.raises(RuntimeError, match=r"bad\.cu\(2\).*undefined"):
        cuda_kernels.compile_for_arch(
            'extern "C" __global__ void f(float* x) {\n  x[0] = y;\n}', "sm_80", name="bad.cu"
        )
    with pytest.raises(ValueError, match="sm_80"):
        cuda_kernels.compile_for_arch("", "ampere")
    ptx = cuda_kernels.compile_for_arch('extern "C" __global__ void f() {}', "compute_75")
    assert b".target sm_75" in ptx


# ----------------------------------------------------------------------------- emulator (CPU, CI)


@pytest.mark.parametrize("params", DECODE_GRID + DECODE_GRID_SMALL, ids=case_id)
def test_emulator_matches_reference(params):
    """The best version (the one backend="cupy" runs) on the whole attention grid."""
    case = make_decode_case(21, *params)
    assert_close(launch(case, "emulator"), reference_decode(case))


@pytest.mark.parametrize("version", FLOAT_VERSIONS)
@pytest.mark.parametrize("params", DECODE_GRID_SMALL, ids=case_id)
def test_every_version_on_the_emulator(params, version):
    """Every kernel version present, the same launcher, the small grid (each head and block size)."""
    case = make_decode_case(22, *params)
    assert_close(launch(case, "emulator", version), reference_decode(case))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("version", "params"), half_cases(DECODE_GRID_SMALL))
def test_emulator_half_types_match_reference(params, dtype, version):
    case = make_decode_case(20, *params, dtype=dtype)
    out = launch(case, "emulator", version)
    assert out.dtype == dtype
    assert_close(out, reference_decode(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("version", [v for v in SPLIT_VERSIONS if v != TENSOR])
@pytest.mark.parametrize("params", DECODE_GRID_SMALL, ids=case_id)
def test_split_context_merges_to_the_same_answer(params, version, num_splits, dtype):
    """Versions 7-9 cut into pieces (some past a shorter sequence's end, so empty), merged by log-sum-exp."""
    case = make_decode_case(36, *params, dtype=dtype)
    assert_close(launch(case, "emulator", version, num_splits=num_splits), reference_decode(case))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("params", [p for p in DECODE_GRID if takes(TENSOR, p)], ids=case_id)
def test_tensor_cores_on_the_attention_grid(params, dtype):
    """Version 10 through the public call on the emulator: the auto rule picks it for GQA; MHA asked for."""
    case = make_decode_case(43, *params, dtype=dtype)
    version = None if params.num_heads > params.num_kv_heads else TENSOR
    assert_close(decode(case, "emulator", kernel_version=version), reference_decode(case))
    assert_close(launch(case, "emulator", TENSOR, num_splits=3), reference_decode(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_one_token_returns_its_value_row_bit_for_bit(dtype):
    """With one token the softmax weight is exactly 1, so out == V: checks the 16-bit -> float widening
    on zeros, subnormals, the largest normal and infinities."""
    info = torch.finfo(dtype)
    specials = [0.0, 1.0, -2.75, info.tiny, -info.tiny, info.max, -info.max, float("inf"), -float("inf")]
    if dtype != torch.float32:
        specials += [info.tiny / 4, -info.tiny / 8, info.smallest_normal * 0.5]  # subnormals
    case = make_decode_case(19, 1, 2, 1, 64, 4, (1,), dtype=dtype)
    row = torch.zeros(64, dtype=torch.float64)
    row[: len(specials)] = torch.tensor(specials, dtype=torch.float64)
    page = int(case["block_tables"][0, 0])
    case["value_cache"][page, 0, 0] = row.to(dtype)
    out = launch(case, "emulator", 8)
    expected = case["value_cache"][page, 0, 0]
    assert torch.equal(out[0, 0], expected) and torch.equal(out[0, 1], expected)
    if dtype != torch.float32:  # version 10: the same, but for infinities (inf * 0 in the tile is NaN)
        case["value_cache"][page, 0, 0] = expected.nan_to_num(posinf=0.0, neginf=0.0)
        out = launch(case, "emulator", TENSOR)
        assert torch.equal(out[0, 0], case["value_cache"][page, 0, 0])


@pytest.mark.parametrize("bad_page", [None, -1, 10**6])
def test_emulator_checked_mode_sees_no_out_of_bounds_access(bad_page):
    """AddressSanitizer: the best version touches no byte outside its buffers, with junk padding ids and,
    with the guard on, a bad id in use: never dereferenced, its sequence NaN, the others right."""
    from vllmini.emulator import RawKernel

    case = make_decode_case(23, 3, 4, 2, 80, 8, (1, 8, 17))
    expected = reference_decode(case)
    if bad_page is not None:
        case["block_tables"][2, 1] = bad_page  # token 8 of sequence 2
    out = torch.empty_like(case["query"])
    num_seqs, num_heads, head_size = case["query"].shape
    v = cuda_kernels.resolve_kernel_version(None)
    plan = cuda_kernels.launch_plan(v, num_seqs, num_heads, 2, head_size, 8, 4, torch.float32, 1, 2)
    kernel = RawKernel(cuda_kernels.read_kernel_source(v.file), v.file, checked=True)
    merge = RawKernel(cuda_kernels.read_kernel_source(v.file), f"{v.file}_merge", checked=True)
    part_out = torch.empty(num_seqs, num_heads, plan.num_splits, head_size)
    part_ml = torch.empty(num_seqs, num_heads, plan.num_splits, 2)
    error = torch.zeros(5, dtype=torch.int32)
    sizes = (case["num_blocks"], 8, num_heads, head_size, 2, 4, plan.heads_per_block, plan.pages_per_split)
    args = (out, part_out, part_ml, *(case[k] for k in DECODE_KEYS), error, *map(np.int32, sizes))
    kernel(plan.grid, plan.block, (*args, np.float32(case["scale"])), shared_mem=plan.shared_mem)
    merge((num_seqs, num_heads), (128,), (out, part_out, part_ml, np.int32(plan.num_splits), np.int32(80)))
    if bad_page is None:
        assert_close(out, expected)
        assert error.tolist() == [0] * 5
    else:
        assert out[2].isnan().all()
        assert_close(out[:2], expected[:2])
        assert error.tolist() == [1, 2, 1, bad_page, case["num_blocks"]]


def test_emulator_handles_a_context_longer_than_any_fixed_buffer():
    """Nothing is sized by the context length: 1000 tokens in 1-token pages, 1000 page lookups a head."""
    case = make_decode_case(24, 1, 2, 1, 64, 1, (1000,))
    assert_close(launch(case, "emulator"), reference_decode(case))


def test_emulator_backend_equals_torch_backend():
    case = make_decode_case(25, 4, 8, 2, 96, 16, (5, 16, 17, 40))
    torch.testing.assert_close(decode(case, "emulator"), decode(case, "torch"), rtol=1e-5, atol=1e-5)


def test_emulator_is_deterministic():
    case = make_decode_case(26, 2, 4, 4, 64, 8, (9, 30))
    assert torch.equal(launch(case, "emulator"), launch(case, "emulator"))


def test_the_test_can_fail():
    """A kernel answer for different inputs does not pass as the reference."""
    case = make_decode_case(27, 2, 2, 2, 64, 8, (9, 12))
    out = launch(case, "emulator")
    case["query"] = case["query"].flip(0)
    with pytest.raises(AssertionError):
        assert_close(out, reference_decode(case))


# ----------------------------------------------------------------------------- the launcher's own checks


def test_launcher_refuses_what_the_kernel_cannot_do():
    case = make_decode_case(28, 1, 2, 2, 64, 8, (5,))
    with pytest.raises(InvalidArgumentError, match="has no in-kernel guard"):
        launch(case, "emulator", 4, error=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="runtime must be one of"):
        launch(case, "numba")
    double = {k: (v.double() if k in ("query", "key_cache", "value_cache") else v) for k, v in case.items()}
    with pytest.raises(TypeError, match="no paged-attention kernel takes torch.float64"):
        launch(double, "emulator")
    mixed = dict(case, key_cache=case["key_cache"].half())
    with pytest.raises(TypeError, match="key_cache must have the query's dtype torch.float32"):
        launch(mixed, "emulator")
    big = make_decode_case(28, 1, 1, 1, 512, 8, (5,))
    with pytest.raises(ValueError, match="head_size <= 256, got 512"):
        launch(big, "emulator")
    odd = make_decode_case(28, 1, 4, 2, 80, 8, (5,), dtype=torch.float16)
    with pytest.raises(ValueError, match="kernel version 10 supports head_size 64 or 128, got 80"):
        launch(odd, "emulator", TENSOR)
    most = case["block_tables"].shape[1] * 8  # the table's tokens
    with pytest.raises(ValueError, match=f"max_seq_len must be <= {most}, got {most + 1}"):
        launch(case, "emulator", max_seq_len=most + 1)
    with pytest.raises(ValueError, match="runtime 'cupy' needs all tensors on one CUDA device"):
        launch(case, "cupy")  # CPU tensors: refused with or without a GPU
    if torch.cuda.is_available():
        on_gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
        with pytest.raises(ValueError, match="runtime 'emulator' needs CPU tensors"):
            launch(on_gpu, "emulator")
        with pytest.raises(ValueError, match="runtime 'cupy' needs all tensors on one CUDA device"):
            launch(dict(on_gpu, seq_lens=case["seq_lens"]), "cupy")  # one tensor left on the CPU


def test_launch_plan_of_the_classic_versions():
    half = cuda_kernels.kernel_versions()[cuda_kernels.IDEAS["half_warps"]]
    plan = cuda_kernels.launch_plan(half, 3, 8, 8, 128, 16, 5, torch.float16, 132)
    assert plan.grid == (3, 8, 1) and plan.block == (256, 1, 1) and plan.num_splits == 1
    # one (max, sum, head_size partial outputs) record per lane group; 16-bit types use groups of 16 lanes
    assert plan.shared_mem == (256 // 16) * (128 + 2) * 4
    # version 6: a block per KV head serves its group of 4 (a record per lane group and head), no split
    blocks, split = (
        cuda_kernels.kernel_versions()[cuda_kernels.IDEAS[n]] for n in ("kv_head_blocks", "split_context")
    )
    five = cuda_kernels.launch_plan(blocks, 1, 32, 8, 128, 16, 256, torch.float16, 132)
    assert five.grid == (1, 8, 1) and five.heads_per_block == 4 and five.options == ()
    assert five.shared_mem == (256 // 16) * 4 * (128 + 2) * 4
    # version 7: the same block, and the context split until the grid fills the GPU
    six = cuda_kernels.launch_plan(split, 1, 32, 8, 128, 16, 256, torch.float16, 132)
    assert six.grid == (1, 8, 16) and six.pages_per_split == 16 and six.shared_mem == five.shared_mem


# ----------------------------------------------------------------------------- validation before launch


@pytest.mark.parametrize("backend", ["emulator", "cupy"])
@pytest.mark.parametrize("page", [-1, 10**6])
def test_out_of_range_block_id_is_rejected_before_launch(monkeypatch, backend, page):
    calls = []
    monkeypatch.setattr(cuda_kernels, "launch_paged_attention", lambda *a, **k: calls.append(k))
    device = "cuda" if backend == "cupy" and torch.cuda.is_available() else "cpu"
    case = make_decode_case(29, 2, 4, 2, 64, 8, (9, 4), device=device)
    case["block_tables"][0, 1] = page  # token 8 of sequence 0 lives in this page
    with pytest.raises(ValueError):
        decode(case, backend, validate=True)  # the host check: before any launch
    assert calls == []


@pytest.mark.parametrize("page", [-1, 10**6, 2**31 - 1])
def test_guard_on_the_emulator_without_the_host_check(page):
    """validate="guard": no host check; the kernel never reads the bad page, the sequence's rows are NaN,
    the other sequences are right, and check_kernel_errors() raises once, naming the entry."""
    case = make_decode_case(37, 3, 4, 2, 64, 8, (9, 4, 20))
    expected = reference_decode(case)
    case["block_tables"][0, 1] = page  # token 8 of sequence 0 lives in this page
    kernel_error_buffer("cpu").zero_()  # start clean
    out = decode(case, "emulator", validate="guard")
    assert out[0].isnan().all() and not out[1:].isnan().any()
    assert_close(out[1:], expected[1:])
    with pytest.raises(
        InvalidBlockTableError, match=rf"block_tables\[0, 1\] = {page} is not a block id in \[0, "
    ):
        check_kernel_errors("cpu")
    check_kernel_errors("cpu")  # cleared: no second raise
    assert kernel_error_buffer("cpu").tolist() == [0] * 5


def test_guard_sees_a_bad_seq_len_and_keeps_the_first_violation():
    case = make_decode_case(38, 2, 2, 2, 64, 8, (9, 4))
    case["seq_lens"][1] = 10**5  # longer than the table can hold
    case["block_tables"][0, 1] = -7
    out = decode(case, "emulator", validate="guard")
    assert out.isnan().all()
    with pytest.raises(InvalidBlockTableError, match=r"(seq_lens\[1\] = 100000 is out of range)|(= -7)"):
        check_kernel_errors()
    with pytest.raises(InvalidArgumentError, match="validate must be None, True, False or one of"):
        decode(case, "emulator", validate="sometimes")
    with pytest.raises(
        InvalidArgumentError, match="validate='guard' needs a kernel with the in-kernel guard"
    ):
        decode(case, "torch", validate="guard")
    with pytest.raises(InvalidArgumentError, match="needs a kernel with the in-kernel guard"):
        decode(case, "emulator", validate="guard", kernel_version=4)


def test_validate_false_trusts_and_the_default_on_cpu_checks_on_the_host():
    case = make_decode_case(39, 2, 2, 2, 64, 8, (9, 4))
    case["block_tables"][0, 1] = 10**6
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 1000000 is not a block id"):
        decode(case, "emulator")  # CPU tensors: the host check is free, so it is the default
    good = make_decode_case(39, 2, 2, 2, 64, 8, (9, 4))
    assert_close(decode(good, "emulator", validate=False), reference_decode(good))


@pytest.mark.parametrize("version", VERSIONS)
def test_public_call_selects_any_version(version):
    dtype = cuda_kernels.kernel_versions()[version].dtypes[0]
    case = make_decode_case(40, 3, 4, 2, 64, 16, (5, 17, 33), dtype=dtype)
    assert_close(decode(case, "emulator", kernel_version=version), reference_decode(case))
    with pytest.raises(InvalidArgumentError, match="kernel_version applies to backends"):
        decode(case, "torch", kernel_version=version)


def test_a_signature_is_checked_once_and_its_calls_stay_guarded(monkeypatch):
    """The checks that need no device data run once per call signature; what changes between calls (the
    tables' values) is still the guard's, and anything else about a call takes every check again."""
    import vllmini.attention as attention

    checks = []
    full = attention.validate_decode_args
    monkeypatch.setattr(attention, "validate_decode_args", lambda *a, **k: checks.append(1) or full(*a, **k))
    attention._CALLS.clear()
    case = make_decode_case(44, 3, 8, 2, 64, 16, (5, 17, 33), dtype=torch.float16)
    ref = reference_decode(case)
    for _ in range(3):
        assert_close(decode(case, "emulator", validate="guard"), ref)
    assert len(checks) == 1 and len(attention._CALLS) == 1
    strided = dict(case, query=case["query"].transpose(0, 1).contiguous().transpose(0, 1))
    assert_close(decode(strided, "emulator", validate="guard"), ref)  # not contiguous: checked again
    decode(case, "emulator")  # CPU tensors, the default host check: never skipped
    decode(case, "emulator")
    assert len(checks) == 4 and len(attention._CALLS) == 1
    kernel_error_buffer("cpu").zero_()
    case["block_tables"][2, 1] = 10**6  # a bad id in use, on the skipping path
    out = decode(case, "emulator", validate="guard")
    assert len(checks) == 4 and out[2].isnan().all() and not out[:2].isnan().any()
    with pytest.raises(InvalidBlockTableError, match=r"block_tables\[2, 1\] = 1000000"):
        check_kernel_errors("cpu")


def test_max_seq_len_from_the_host():
    case = make_decode_case(45, 3, 8, 2, 128, 16, (5, 17, 300), dtype=torch.bfloat16)
    ref = reference_decode(case)
    for validate in (True, "guard"):
        assert_close(decode(case, "emulator", validate=validate, max_seq_len=300), ref)
        assert_close(decode(case, "emulator", validate=validate, max_seq_len=310), ref)
    with pytest.raises(InvalidArgumentError, match=r"max_seq_len = 299 is below max\(seq_lens\) = 300"):
        decode(case, "emulator", max_seq_len=299)  # checked where the host has the lengths
    with pytest.raises(InvalidTypeError, match="max_seq_len must be an int"):
        decode(case, "emulator", validate="guard", max_seq_len=3.5)


# ----------------------------------------------------------------------------- CuPy on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("version", FLOAT_VERSIONS)
@pytest.mark.parametrize("params", DECODE_GRID, ids=case_id)
def test_cupy_matches_reference(params, version):
    case = make_decode_case(31, *params, device="cuda")
    assert_close(launch(case, "cupy", version), reference_decode(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("version", "params"), half_cases(DECODE_GRID[::2]) + half_cases(DECODE_GRID[1::2])[-8:]
)
def test_cupy_half_types_match_reference(params, dtype, version):
    case = make_decode_case(30, *params, dtype=dtype, device="cuda")
    out = launch(case, "cupy", version)
    assert out.dtype == dtype
    assert_close(out, reference_decode(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_cupy_best_version_block_sizes_and_splits(block_size, dtype, num_splits):
    case = make_decode_case(41, 4, 8, 2, 128, block_size, (1, 300, 1000, 77), dtype=dtype, device="cuda")
    assert_close(launch(case, "cupy", num_splits=num_splits), reference_decode(case))


@pytest.mark.gpu
def test_cupy_backend_equals_torch_backend_and_emulator():
    case = make_decode_case(32, 4, 8, 2, 128, 16, (5, 16, 17, 200), device="cuda")
    out = decode(case, "cupy")
    torch.testing.assert_close(out, decode(case, "torch"), rtol=1e-5, atol=1e-5)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    torch.testing.assert_close(out.cpu(), decode(cpu, "emulator"), rtol=1e-5, atol=1e-5)
    assert torch.equal(decode(case, "auto"), out)  # "auto" picks this kernel for CUDA tensors


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cupy_guard_without_a_sync_and_in_a_cuda_graph(dtype):
    """The default on CUDA tensors: no host check, the in-kernel guard. Captured in a CUDA graph, replays
    equal the eager call; a bad id put into the captured table gives NaN rows and a clear error later."""
    case = make_decode_case(42, 3, 8, 2, 128, 16, (40, 700, 5), dtype=dtype, device="cuda")
    check_kernel_errors()
    eager = decode(case, "cupy")  # also makes the error buffer (before capture)
    assert_close(eager, reference_decode(case))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode(case, "cupy")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    check_kernel_errors()  # nothing recorded
    case["block_tables"][1, 3] = 10**6  # in use by sequence 1 (700 tokens)
    graph.replay()
    assert captured[1].isnan().all() and torch.equal(captured[0], eager[0])
    with pytest.raises(InvalidBlockTableError, match=r"block_tables\[1, 3\] = 1000000"):
        check_kernel_errors()


@pytest.mark.gpu
def test_cupy_long_context():
    """32k tokens in one sequence: no shared-memory cap on the context length."""
    case = make_decode_case(33, 2, 4, 1, 128, 16, (32768, 5000), device="cuda")
    assert_close(launch(case, "cupy"), reference_decode(case))


@pytest.mark.gpu
def test_cupy_runs_on_torchs_current_stream():
    """The launch waits for earlier work on torch's current stream (here a busy side stream that then
    rewrites the query); a launch on CuPy's own default stream would read the old query."""
    case = make_decode_case(34, 3, 4, 4, 64, 16, (100, 7, 33), device="cuda")
    new_query = torch.randn_like(case["query"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # keep the side stream busy for tens of milliseconds
        case["query"].copy_(new_query)
        out = launch(case, "cupy")
    stream.synchronize()
    assert_close(out, reference_decode(case))  # reference of the new query


@pytest.mark.gpu
def test_cupy_page_offsets_past_2_to_the_31():
    """A page whose first element sits beyond 2**31 floats: the offsets must be 64-bit."""
    block_size, num_kv_heads, head_size = 16, 8, 128
    page_elems = block_size * num_kv_heads * head_size
    num_blocks = 2**31 // page_elems + 4
    need = 2 * num_blocks * page_elems * 4
    if torch.cuda.mem_get_info()[0] < need + 2**30:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    small = make_decode_case(35, 1, 8, num_kv_heads, head_size, block_size, (40,), device="cuda")
    case = dict(small)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    case["key_cache"] = torch.full(shape, float("nan"), device="cuda")
    case["value_cache"] = torch.full(shape, float("nan"), device="cuda")
    pages = torch.tensor(
        [num_blocks - 1, num_blocks - 3, num_blocks - 2, 0], dtype=torch.int32, device="cuda"
    )
    for i in range(3):  # 40 tokens: pages 0..2 of the small case, moved to the far end of the pool
        src = int(small["block_tables"][0, i])
        case["key_cache"][pages[i]] = small["key_cache"][src]
        case["value_cache"][pages[i]] = small["value_cache"][src]
    case["block_tables"] = pages[None, :]
    expected = reference_decode(small)
    out = launch(case, "cupy")
    del case
    torch.cuda.empty_cache()
    assert_close(out, expected)


# ---- the plain kernel (notebook 05)
# kernels/paged_attention_1_plain.cu: one thread block of 128 threads per (sequence, query head), the
# scores of the whole context in shared memory, a three-pass softmax. Launched directly with the same
# call as cupy.RawKernel, through the emulator on the CPU and through CuPy on a GPU.

PLAIN = "paged_attention_1_plain"
PLAIN_THREADS = 128


def plain_launch_args(case, out):
    """(grid, block, args, shared_mem) for the plain kernel on one decode case."""
    num_seqs, num_heads, head_size = case["query"].shape
    _, block_size, num_kv_heads, _ = case["key_cache"].shape
    max_blocks = case["block_tables"].shape[1]
    ints = (block_size, num_heads, head_size, num_kv_heads, max_blocks)
    args = (out, *(case[k] for k in DECODE_KEYS), *map(np.int32, ints), np.float32(case["scale"]))
    shared_mem = (max_blocks * block_size + PLAIN_THREADS) * 4  # the header's formula
    return (num_seqs, num_heads), (PLAIN_THREADS,), args, shared_mem


def plain_emulator(checked=False):
    from vllmini.emulator import RawKernel

    return RawKernel(cuda_kernels.read_kernel_source(PLAIN), PLAIN, checked=checked)


def launch_plain(case, kernel=None):
    out = torch.full_like(case["query"], float("nan"))
    grid, block, args, shared_mem = plain_launch_args(case, out)
    (kernel or plain_emulator())(grid, block, args, shared_mem=shared_mem)
    return out


def test_plain_kernel_source_has_the_fixed_signature():
    source = cuda_kernels.read_kernel_source(PLAIN)
    signature = source[source.index('extern "C" __global__ void paged_attention_1_plain(') :]
    signature = " ".join(line.split("//")[0] for line in signature[: signature.index("{")].splitlines())
    params = [
        " ".join(p.split()) for p in signature[signature.index("(") + 1 : signature.rindex(")")].split(",")
    ]
    assert params == [
        "float* out", "const float* q", "const float* k_cache", "const float* v_cache",
        "const int* block_tables", "const int* seq_lens", "const int block_size", "const int num_heads",
        "const int head_size", "const int num_kv_heads", "const int max_num_blocks_per_seq",
        "const float scale",
    ]  # fmt: skip


@pytest.mark.parametrize("params", DECODE_GRID + DECODE_GRID_SMALL, ids=case_id)
def test_plain_emulator_matches_reference(params):
    case = make_decode_case(41, *params)
    assert_close(launch_plain(case), reference_decode(case))


def test_plain_emulator_long_context_over_many_threads():
    """1000 tokens in 1-token pages: every thread takes several tokens, 1000 page lookups a head."""
    case = make_decode_case(42, 1, 2, 1, 64, 1, (1000,))
    assert_close(launch_plain(case), reference_decode(case))


def test_plain_emulator_checked_mode_and_thread_orders():
    """No byte outside the buffers (AddressSanitizer), and the same bits under four thread orders (a
    missing __syncthreads() in the reductions would change the answer with the order)."""
    case = make_decode_case(43, 3, 4, 2, 80, 8, (1, 8, 300))
    assert_close(launch_plain(case, plain_emulator(checked=True)), reference_decode(case))
    out = torch.full_like(case["query"], float("nan"))
    grid, block, args, shared_mem = plain_launch_args(case, out)
    plain_emulator().check_schedules(grid, block, args, shared_mem=shared_mem)
    assert_close(out, reference_decode(case))


def test_plain_kernel_agrees_with_the_current_kernel():
    case = make_decode_case(44, 4, 8, 2, 96, 16, (5, 16, 17, 40))
    torch.testing.assert_close(launch_plain(case), launch(case, "emulator"), rtol=1e-5, atol=1e-5)


def test_plain_kernel_refuses_another_block_size():
    from vllmini.emulator import KernelError

    case = make_decode_case(45, 1, 2, 2, 64, 8, (5,))
    out = torch.empty_like(case["query"])
    grid, _, args, shared_mem = plain_launch_args(case, out)
    with pytest.raises(KernelError):
        plain_emulator()(grid, (64,), args, shared_mem=shared_mem)


def test_plain_test_can_fail():
    """The plain kernel's answer for other inputs does not pass as the reference."""
    case = make_decode_case(46, 2, 2, 2, 64, 8, (9, 12))
    out = launch_plain(case)
    case["key_cache"] = case["key_cache"].flip(-1)
    with pytest.raises(AssertionError):
        assert_close(out, reference_decode(case))


@pytest.mark.gpu
@pytest.mark.parametrize("params", DECODE_GRID, ids=case_id)
def test_plain_cupy_matches_reference(params):
    import cupy

    case = make_decode_case(47, *params, device="cuda")
    kernel = cupy.RawKernel(cuda_kernels.read_kernel_source(PLAIN), PLAIN, options=cuda_kernels.NVRTC_OPTIONS)
    out = torch.full_like(case["query"], float("nan"))
    grid, block, args, shared_mem = plain_launch_args(case, out)
    torch.cuda.synchronize()
    kernel(grid, block, tuple(cupy.asarray(a) if isinstance(a, torch.Tensor) else a for a in args),
           shared_mem=shared_mem)  # fmt: skip
    cupy.cuda.Device().synchronize()
    assert_close(out, reference_decode(case))

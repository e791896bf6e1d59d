"""Tests for what every emulator launch checks: bounds of each memory access, races (racecheck), faults
that would kill Python (integer division by zero, illegal instructions), and the trust in the build cache."""

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

import vllmini
from vllmini import cuda_kernels
from vllmini.emulator import (
    RACECHECK_ENV,
    CompileError,
    KernelError,
    OutOfBoundsError,
    RaceError,
    RawKernel,
    _build,
)

KERNELS = Path(vllmini.__file__).resolve().parent.parent / "kernels"
SCHEDULES = ["in_order", "reverse", 0, 1, 12345]


def line_of(code: str, marker: str) -> int:
    """The 1-based line of the source that contains `marker`."""
    return next(i for i, line in enumerate(code.splitlines(), 1) if marker in line)


# ---------------------------------------------------------------- bounds: checked in the default mode
def test_dropped_bounds_check_is_caught_in_the_default_mode():
    # 05a's vector_add without its `if (i < n)`: the commonest beginner slip; 1000 elements, 1024 threads
    source = (KERNELS / "intro" / "vector_add.cu").read_text()
    assert "if (i < n) " in source
    broken = source.replace("if (i < n) ", "").replace("void vector_add(", "void vector_add_unchecked(")
    kernel = RawKernel(broken, "vector_add_unchecked")
    x, y, out = torch.randn(1000), torch.randn(1000), torch.zeros(1000)
    for schedule in ("in_order", "reverse"):
        with pytest.raises(OutOfBoundsError) as info:
            kernel(4, 256, (x, y, out, np.int32(1000)), schedule=schedule)
        error = info.value
        assert error.line == line_of(broken, "    out[i] = x[i] + y[i];")
        first = {"in_order": 1000, "reverse": 1023}[schedule]  # the first thread past the end to run
        # the read past x's end: named as x (byte 4 * first), or, when the allocator put y's guard zone
        # right after x's, as a read before y's start; the thread and the line are exact either way
        assert error.access == "read" and error.buffer in ("x", "y")
        assert error.offset == 4 * first if error.buffer == "x" else error.offset < 0
        assert str(error).startswith(f"vector_add_unchecked: vector_add.cu:{error.line}: thread (")
        assert f"thread ({first - 768},0,0) of block (3,0,0)" in str(error)
    fixed = RawKernel(source, "vector_add")  # the same launch with the check: no error, the right sum
    fixed(4, 256, (x, y, out, np.int32(1000)))
    assert torch.equal(out, x + y)


def test_write_past_the_output_and_into_a_const_buffer():
    code = (
        'extern "C" __global__ void copy(float* out, const float* x, int n) {\n'
        "    out[threadIdx.x] = x[threadIdx.x];\n"
        "    if (n >= 0 && threadIdx.x == 0) ((float*)x)[n] = 1.0f;  // writes through a const pointer\n"
        "}\n"
    )
    kernel = RawKernel(code, "copy")
    with pytest.raises(OutOfBoundsError) as info:
        kernel(1, 32, (torch.zeros(31), torch.zeros(32), -1))  # out is one element short
    assert (info.value.access, info.value.buffer, info.value.offset, info.value.line) == (
        "write",
        "out",
        124,
        2,
    )
    with pytest.raises(
        OutOfBoundsError, match=r"copy.cu:3: .*byte offset 8 of `x`, which the kernel declares"
    ):
        kernel(1, 32, (torch.zeros(32), torch.zeros(32), 2))
    with pytest.raises(OutOfBoundsError, match="null pointer"):
        kernel(1, 32, (None, torch.zeros(32), -1))


def test_planted_out_of_bounds_page_is_caught_without_checked_mode():
    code = (KERNELS / "bugs" / "paged_gather_oob.cu").read_text()
    kernel = RawKernel(code, "paged_gather")
    cache, out = torch.randn(4, 4, 2, 8), torch.zeros(10, 8)
    with pytest.raises(OutOfBoundsError) as info:
        kernel(10, 8, (out, cache, torch.tensor([2, 0, 7], dtype=torch.int32), 4, 4, 2, 0, 8))
    assert info.value.buffer == "key_cache" and info.value.offset >= cache.numel() * 4
    assert info.value.line == line_of(code, "<- the out-of-bounds read")


def test_bounds_checks_allow_aliasing_shared_memory_and_local_arrays():
    code = (
        'extern "C" __global__ void scale(float* out, const float* x, int n) {\n'
        "    __shared__ float s[64];\n"
        "    float local[8];\n"
        "    for (int k = 0; k < 8; ++k) local[k] = x[threadIdx.x] * k;\n"
        "    s[threadIdx.x] = local[n % 8];\n"
        "    __syncthreads();\n"
        "    out[threadIdx.x] = s[63 - threadIdx.x];\n"
        "}\n"
    )
    kernel = RawKernel(code, "scale")
    x = torch.randn(64)
    before = x.clone()
    kernel(1, 64, (x, x, 3))  # one tensor as the input and the output: one region, as on a GPU
    torch.testing.assert_close(x, 3 * before.flip(0))


# ---------------------------------------------------------------- races: racecheck and check_schedules
LOST_UPDATE = 'extern "C" __global__ void count(float* total) {\n    *total += 1.0f;\n}\n'


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lost_update_is_caught_on_every_run(schedule):
    kernel = RawKernel(LOST_UPDATE, "count")
    total = torch.zeros(1)
    kernel(1, 256, (total,), schedule=schedule)
    assert total.item() == 256  # what the emulator computes without racecheck (a GPU gives 1)
    with pytest.raises(RaceError) as info:
        kernel(1, 256, (torch.zeros(1),), schedule=schedule, racecheck=True)
    error = info.value
    assert error.memory == "global" and error.buffer == "total" and error.offset == 0
    assert error.lines == (2, 2) and error.threads[0] != error.threads[1]
    assert "count.cu:2: race on byte offset 0 of `total`" in str(error)
    with pytest.raises(RaceError):  # check_schedules: every order gives 256, the detector still sees it
        kernel.check_schedules(1, 256, (torch.zeros(1),))


def test_atomic_update_and_the_environment_switch(monkeypatch):
    atomic = RawKernel(LOST_UPDATE.replace("*total += 1.0f", "atomicAdd(total, 1.0f)"), "count")
    total = torch.zeros(1)
    atomic.check_schedules(1, 256, (total,))
    assert total.item() == 256
    racy = RawKernel(LOST_UPDATE, "count")
    monkeypatch.setenv(RACECHECK_ENV, "1")
    with pytest.raises(RaceError):
        racy(1, 256, (torch.zeros(1),))
    racy(1, 256, (torch.zeros(1),), racecheck=False)  # a launch may still say otherwise
    monkeypatch.setenv(RACECHECK_ENV, "yes")
    with pytest.raises(ValueError, match="VLLMINI_EMULATOR_RACECHECK must be 1 or 0, got 'yes'"):
        racy(1, 256, (torch.zeros(1),))


WARP_SYNC = """extern "C" __global__ void neighbour(float* out, const float* x) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    s[t] = x[t];
    SYNC;
    out[t] = s[t ^ 1];
}
"""


@pytest.mark.parametrize(
    ("sync", "race"),
    [("__syncthreads()", False), ("__syncwarp()", False), ("(void)__shfl_sync(0xffffffffu, 0, 0)", False),
     ("(void)0", True)],
)  # fmt: skip
def test_barriers_and_warp_collectives_order_shared_memory(sync, race):
    kernel = RawKernel(WARP_SYNC.replace("SYNC", sync), "neighbour")
    x, out = torch.randn(64), torch.zeros(64)
    if race:
        with pytest.raises(RaceError) as info:
            kernel(1, 64, (out, x), racecheck=True)
        # thread 0 read s[1] before thread 1 wrote it: found at the write, naming the read
        assert info.value.memory == "shared" and info.value.lines == (4, 6)
        assert "writes it here" in str(info.value) and "read it at neighbour.cu:6" in str(info.value)
    else:
        kernel(1, 64, (out, x), racecheck=True)
        assert torch.equal(out, x.view(32, 2).flip(1).reshape(64))


def test_two_threads_writing_one_output_is_a_race():
    code = 'extern "C" __global__ void last(int* out) {\n    out[blockIdx.x] = threadIdx.x;\n}\n'
    with pytest.raises(RaceError, match=r"last.cu:2: race on byte offset 0 of `out`.*writes.*wrote"):
        RawKernel(code, "last")(2, 32, (torch.zeros(2, dtype=torch.int32),), racecheck=True)
    RawKernel(code, "last")(2, 1, (torch.zeros(2, dtype=torch.int32),), racecheck=True)  # one thread: fine


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_planted_missing_barrier_is_a_race_on_every_run(schedule):
    code = (KERNELS / "bugs" / "normalize_missing_sync.cu").read_text()
    kernel = RawKernel(code, "normalize_rows")
    with pytest.raises(RaceError) as info:
        kernel(2, 128, (torch.zeros(2, 128), torch.rand(2, 128) + 1, 128), schedule=schedule, racecheck=True)
    assert info.value.memory == "shared"
    assert set(info.value.lines) <= {line_of(code, "s[t] += s[t + k]"), line_of(code, "/ s[0]")}


def test_planted_wrong_mask_is_a_warp_error_not_a_race():
    code = (KERNELS / "bugs" / "warp_sum_wrong_mask.cu").read_text()
    with pytest.raises(KernelError, match="mask 0x0000ffff") as info:
        RawKernel(code, "warp_sum")(1, 64, (torch.zeros(2), torch.randn(64)), racecheck=True)
    assert not isinstance(info.value, RaceError)


def test_every_intro_kernel_is_race_free():
    intro = {p.stem: p.read_text() for p in sorted((KERNELS / "intro").glob("*.cu"))}
    assert set(intro) == {"vector_add", "run_order", "block_sum", "warp_sum"}  # a new one needs a launch here
    x, y, out = torch.randn(300), torch.randn(300), torch.zeros(300)
    RawKernel(intro["vector_add"], "vector_add").check_schedules(2, 256, (x, y, out, np.int32(300)))
    assert torch.equal(out, x + y)
    counter, before, after = (torch.zeros(k, dtype=torch.int32) for k in (1, 16, 16))
    RawKernel(intro["run_order"], "run_order")(2, 8, (counter, before, after), racecheck=True)
    values, sums = torch.randn(2, 128), torch.zeros(2)
    RawKernel(intro["block_sum"], "block_sum").check_schedules(2, 128, (values, sums), shared_mem=512)
    torch.testing.assert_close(sums, values.sum(1))
    v, warp_out = torch.randn(128), torch.zeros(128)
    RawKernel(intro["warp_sum"], "warp_sum").check_schedules(1, 128, (v, warp_out))
    torch.testing.assert_close(warp_out.view(4, 32), v.view(4, 32).sum(1, keepdim=True).expand(4, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_paged_attention_kernel_is_race_free(monkeypatch, dtype):
    from attention_cases import assert_close, make_decode_case, reference_decode

    monkeypatch.setenv(RACECHECK_ENV, "1")  # every launch the package makes is race-checked
    case = make_decode_case(3, 3, 4, 2, 64, 8, (1, 17, 40), dtype=dtype)
    keys = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
    versions = cuda_kernels.kernel_versions()
    assert sorted(versions) == list(range(1, 11))
    for version, kernel in versions.items():
        if dtype not in kernel.dtypes:
            continue  # the plain kernel is float32 only; version 10 (tensor cores) 16-bit only
        out = vllmini.paged_attention(*(case[k] for k in keys), backend="emulator", kernel_version=version)
        assert_close(out, reference_decode(case), dtype)
    out = torch.empty_like(case["query"])  # kernel 9 splitting each context, with its log-sum-exp merge
    cuda_kernels.paged_attention_kernel(*(case[k] for k in keys), 64**-0.5, out, "emulator", num_splits=3)
    assert_close(out, reference_decode(case), dtype)


# ---------------------------------------------------------------- faults that would kill Python
MODULO = (
    'extern "C" __global__ void rem(int* o, const int* x, int bs) {\n'
    "    o[threadIdx.x] = x[threadIdx.x] % bs;\n"
    "}\n"
)


@pytest.mark.parametrize("checked", [False, True])
def test_integer_division_by_zero_is_a_kernel_error(checked):
    kernel = RawKernel(MODULO, "rem", checked=checked)
    x, o = torch.arange(1, 9, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(KernelError, match=r"rem: rem.cu:2: .*integer division by zero") as info:
        kernel(1, 8, (o, x, 0))
    assert not isinstance(info.value, OutOfBoundsError)
    kernel(1, 8, (o, x, 3))  # Python lives, and so does the kernel
    assert torch.equal(o, x % 3)


def test_illegal_instruction_is_a_kernel_error():
    code = (
        'extern "C" __global__ void stop(float* o) {\n'
        "    if (threadIdx.x == 3) __builtin_trap();\n"
        "    o[threadIdx.x] = 1;\n"
        "}\n"
    )
    with pytest.raises(KernelError, match=r"stop: stop.cu:2: thread \(3,0,0\).*illegal instruction"):
        RawKernel(code, "stop")(1, 4, (torch.zeros(4),))


# ---------------------------------------------------------------- the build cache is trusted code
@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VLLMINI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "emulator"


FILL = 'extern "C" __global__ void fill(float* out, float v) {\n    out[threadIdx.x] = v;\n}\n'


def build(**kw) -> Path:
    return _build.build(FILL, "fill.cu", ["fill"], kw.pop("options", ()), checked=False, **kw)


def test_cache_directory_is_private_and_libraries_are_rebuilt_when_others_may_write(cache):
    path = build()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0 and path.stat().st_uid == os.getuid()
    before = _build.compile_count
    assert build() == path and _build.compile_count == before  # cached
    path.chmod(0o775)  # a group member could have replaced it: not loaded, rebuilt
    assert build() == path and _build.compile_count == before + 1
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    path.unlink()
    path.symlink_to("/bin/true")  # a planted link is never followed
    assert build() == path and _build.compile_count == before + 2 and not path.is_symlink()
    cache.chmod(0o777)  # made private again before anything is read from it
    build()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_cache_owned_by_another_user_is_refused(cache, monkeypatch):
    path = build()
    monkeypatch.setattr(_build.os, "getuid", lambda: path.stat().st_uid + 1)
    assert not _build.trusted(path)
    with pytest.raises(CompileError, match=r"build cache .* belongs to another user.*VLLMINI_CACHE_DIR"):
        build()


def test_cache_key_hashes_source_compiler_and_options(cache, tmp_path, monkeypatch):
    plain, defined = build(), build(options=("-DVALUE=2",))
    assert plain != defined
    wrapper = tmp_path / "wrapped-c++"  # another compiler (here: the same one behind a script)
    wrapper.write_text(f'#!/bin/sh\nexec {_build.find_compiler()[0]} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    _build.find_compiler.cache_clear()
    try:
        assert build() not in (plain, defined)
    finally:
        monkeypatch.delenv("CXX")
        _build.find_compiler.cache_clear()
    assert build() == plain
    other = _build.build(FILL.replace("float v", "const float v"), "fill.cu", ["fill"], (), checked=False)
    assert other != plain

"""Tests for vllmini.emulator: CUDA source on the CPU, planted bugs caught every time, checked mode."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import vllmini
from vllmini.emulator import CompileError, KernelError, OutOfBoundsError, RawKernel, RawModule, _build
from vllmini.errors import InvalidArgumentError, InvalidTypeError, KernelBuildError, KernelLaunchError

TESTS = Path(__file__).resolve().parent / "emulator_kernels"
BUGS = Path(vllmini.__file__).resolve().parent.parent / "kernels" / "bugs"
SCHEDULES = ["in_order", "reverse", 0, 1, 12345]
FILL = 'extern "C" __global__ void fill(float* out, float v) { out[threadIdx.x] = v; }\n'


def source(path: Path) -> str:
    return path.read_text()


@pytest.fixture(scope="module")
def basics() -> RawModule:
    return RawModule(source(TESTS / "basics.cu"), filename="basics.cu")


@pytest.fixture(scope="module")
def gather_bug() -> RawKernel:
    return RawKernel(
        source(BUGS / "paged_gather_oob.cu"), "paged_gather", checked=True, filename="paged_gather_oob.cu"
    )


# ---------------------------------------------------------------- correct kernels give correct answers
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_vector_add(basics, schedule):
    n = 1000
    x, y = torch.randn(n), torch.randn(n)
    out = torch.full((n + 24,), float("nan"))  # the tail stays untouched
    basics.get_function("vector_add")((n + 255) // 256, 256, (x, y, out, n), schedule=schedule)
    torch.testing.assert_close(out[:n], x + y, rtol=0, atol=0)
    assert out[n:].isnan().all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_block_sum_with_shared_memory(basics, schedule):
    x = np.random.default_rng(0).standard_normal((6, 128))
    out = np.full(6, np.nan)
    basics.get_function("block_sum")(6, 128, (x, out), schedule=schedule)
    np.testing.assert_allclose(out, x.sum(axis=1), rtol=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warp_reductions(schedule):
    module = RawModule(source(TESTS / "warp_sum.cu"), filename="warp_sum.cu")
    x = torch.randn(8 * 32, dtype=torch.float64).float()
    out = torch.full((8,), float("nan"))
    module.get_function("warp_sum")(2, 128, (out, x), schedule=schedule)
    ref = x.double().view(8, 32).sum(1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    every = torch.full((256,), float("nan"))
    module.get_function("warp_allsum")(4, 64, (every, x), schedule=schedule)
    torch.testing.assert_close(every.double().view(8, 32), ref[:, None].expand(8, 32), rtol=1e-5, atol=1e-5)


def test_normalize_twin_is_correct_under_every_schedule():
    kernel = RawKernel(source(TESTS / "normalize.cu"), "normalize_rows")
    x = torch.rand(3, 128) + 1
    for schedule in SCHEDULES:
        out = torch.full_like(x, float("nan"))
        kernel(3, 128, (out, x, 128), schedule=schedule)
        torch.testing.assert_close(out.double(), x.double() / x.double().sum(1, keepdim=True))


def test_dynamic_shared_memory(basics):
    x = torch.arange(3 * 96, dtype=torch.int32).view(3, 96)
    out = torch.zeros_like(x)
    basics.get_function("reverse_rows")(3, 96, (x, out), shared_mem=96 * 4)
    assert torch.equal(out, x.flip(1))


def test_atomics(basics):
    values = torch.randint(0, 10, (999,), dtype=torch.int32)
    hist, total, max_seen = (
        torch.zeros(10, dtype=torch.int32),
        torch.zeros(1),
        torch.full((1,), -1, dtype=torch.int32),
    )
    basics.get_function("histogram")(8, 128, (values, 999, hist, total, max_seen))
    assert torch.equal(hist, torch.bincount(values, minlength=10).int())
    assert total.item() == values.sum().item() and max_seen.item() == values.max().item()


def test_2d_launch(basics):
    out = torch.zeros(6, 40, dtype=torch.int32)
    basics.get_function("coords")((5, 2), (8, 3), (out, 40))
    ref = 1000 * torch.arange(6)[:, None] + torch.arange(40)[None, :]
    assert torch.equal(out, ref.int())


def test_votes_and_broadcast(basics):
    x = torch.randn(64)
    x[32:] = x[32:].abs() + 0.1  # second warp: all positive
    ballots, any_all, bcast = (
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(64),
    )
    basics.get_function("warp_votes")(1, 64, (x, ballots.view(torch.uint32), any_all, bcast))
    bits = [sum(1 << i for i in range(32) if x[32 * w + i] > 0) for w in range(2)]
    assert [b & 0xFFFFFFFF for b in ballots.tolist()] == bits
    assert any_all.tolist() == [int(bits[0] != 0), int(bits[0] == 2**32 - 1), 1, 1]
    assert torch.equal(bcast, x.view(2, 32)[:, :1].expand(2, 32).reshape(64))


def test_half_bfloat16_and_math(basics):
    x = torch.tensor([0.0, -1.5, 3.14159, 1e-5, 65504.0, -7e4, 1e-8, 100.0])
    h, b, out = torch.empty(8, dtype=torch.float16), torch.empty(8, dtype=torch.bfloat16), torch.empty(8, 4)
    basics.get_function("conversions")(1, 32, (x, h, b, out, 8))
    assert torch.equal(h, x.half()) and torch.equal(b, x.bfloat16())
    assert torch.equal(out[:, 0], x.half().float()) and torch.equal(out[:, 1], x.bfloat16().float())
    torch.testing.assert_close(out[:, 2], torch.exp(x.clamp(max=10)))
    torch.testing.assert_close(out[:, 3], torch.rsqrt(x.abs() + 1))


def test_shared_memory_is_poisoned(basics):
    out = torch.zeros(64)
    basics.get_function("read_unwritten_shared")(2, 64, (out,))
    assert out[0] == 1.0 and out[1:].isnan().all()
    dyn = torch.zeros(3 * 32)
    basics.get_function("read_unwritten_dynamic")(3, 32, (dyn,), shared_mem=32 * 4)
    assert dyn.isnan().all()  # before every block, not only the first


def test_portable_ucontext_switch_gives_the_same_answers():
    # -DEMU_UCONTEXT selects the fallback used on aarch64 and macOS (swapcontext instead of assembly)
    module = RawModule(source(TESTS / "warp_sum.cu"), options=("-DEMU_UCONTEXT",), filename="warp_sum.cu")
    x = torch.randn(128)
    out = torch.zeros(4)
    module.get_function("warp_sum")(1, 128, (out, x), schedule=3)
    torch.testing.assert_close(out, x.view(4, 32).sum(1))
    bug = RawKernel(source(BUGS / "normalize_missing_sync.cu"), "normalize_rows", options=("-DEMU_UCONTEXT",))
    y = torch.rand(1, 64) + 1
    res = torch.zeros_like(y)
    bug(1, 64, (res, y, 64))
    assert not torch.allclose(res, y / y.sum())


def test_libraries_keep_separate_state(basics):
    # two kernel libraries in one process, launched in turn: neither sees the other's threads or errors
    warp = RawKernel(source(BUGS / "warp_sum_wrong_mask.cu"), "warp_sum")
    with pytest.raises(KernelError):
        warp(1, 32, (torch.zeros(1), torch.randn(32)))
    x, y, out = torch.randn(40), torch.randn(40), torch.zeros(40)
    basics.get_function("vector_add")(2, 32, (x, y, out, 40))
    assert torch.equal(out, x + y)


# ---------------------------------------------------------------- planted bugs: caught on every run
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_missing_barrier_gives_wrong_answer_every_time(schedule):
    kernel = RawKernel(source(BUGS / "normalize_missing_sync.cu"), "normalize_rows")
    x = torch.rand(4, 128) + 1
    ref = x.double() / x.double().sum(1, keepdim=True)
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        kernel(4, 128, (out, x, 128), schedule=schedule)
        wrong = ~torch.isclose(out.double(), ref, rtol=1e-4)
        assert wrong.any(dim=1).all()  # every row is wrong somewhere


def test_check_schedules_finds_the_race_and_passes_the_twin():
    x = torch.rand(2, 64) + 1
    out = torch.full_like(x, float("nan"))
    bug = RawKernel(source(BUGS / "normalize_missing_sync.cu"), "normalize_rows")
    with pytest.raises(KernelError, match="`out` differs between schedule 'in_order' and 'reverse'.*race"):
        bug.check_schedules(2, 64, (out, x, 64))
    twin = RawKernel(source(TESTS / "normalize.cu"), "normalize_rows")
    twin.check_schedules(2, 64, (out, x, 64))
    torch.testing.assert_close(out.double(), x.double() / x.double().sum(1, keepdim=True))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_wrong_shuffle_mask_raises_every_time(schedule):
    kernel = RawKernel(source(BUGS / "warp_sum_wrong_mask.cu"), "warp_sum")
    x, out = torch.randn(128), torch.zeros(4)
    with pytest.raises(KernelError, match=r"mask 0x0000ffff.*(does not include|not in the mask)"):
        kernel(1, 128, (out, x), schedule=schedule)
    with pytest.raises(KernelError, match=r"warp_sum_wrong_mask.cu:\d+"):  # named from the header line
        kernel(1, 128, (out, x), schedule=schedule)


def test_out_of_range_page_id_is_caught_with_its_line(gather_bug):
    nb, bs, h, d = 4, 4, 2, 8
    cache = torch.randn(nb, bs, h, d)
    lines = source(BUGS / "paged_gather_oob.cu").splitlines()
    bad_line = next(i + 1 for i, ln in enumerate(lines) if "the out-of-bounds read" in ln)
    for schedule in ("in_order", "reverse", 7):
        out = torch.full((10, d), float("nan"))
        table = torch.tensor([2, 0, 7], dtype=torch.int32)  # page 7 does not exist
        with pytest.raises(OutOfBoundsError) as info:
            gather_bug(10, d, (out, cache, table, nb, bs, h, 1, d), schedule=schedule)
        err = info.value
        assert err.access == "read" and err.buffer == "key_cache" and err.line == bad_line
        assert err.offset >= cache.numel() * 4
        assert f"paged_gather_oob.cu:{bad_line}: read of 4 bytes out of bounds" in str(err)


def test_far_out_page_id_is_still_blamed_on_the_cache(gather_bug):
    # page 30 of a 4-page cache: 7x the cache's size past its end, beyond any default red zone
    cache, out = torch.randn(4, 4, 2, 8), torch.zeros(10, 8)
    table = torch.tensor([2, 30, 1], dtype=torch.int32)
    with pytest.raises(OutOfBoundsError) as info:
        gather_bug(10, 8, (out, cache, table, 4, 4, 2, 0, 8))
    assert info.value.buffer == "key_cache" and info.value.offset == 30 * 4 * 2 * 8 * 4
    negative = torch.tensor([2, -1, 1], dtype=torch.int32)  # before the start
    with pytest.raises(OutOfBoundsError) as info:
        gather_bug(10, 8, (out, cache, negative, 4, 4, 2, 0, 8))
    assert info.value.buffer == "key_cache" and info.value.offset < 0


def test_checked_mode_runs_correct_launches_and_copies_outputs(gather_bug):
    nb, bs, h, d = 4, 4, 2, 8
    cache = torch.randn(nb, bs, h, d)
    table = torch.tensor([2, 0, 3], dtype=torch.int32)
    out = torch.full((10, d), float("nan"))
    gather_bug(10, d, (out, cache, table, nb, bs, h, 1, d))
    ref = cache[table.long()].reshape(12, h, d)[:10, 1]
    assert torch.equal(out, ref)


def test_write_out_of_bounds_is_caught():
    kernel = RawKernel(source(TESTS / "basics.cu"), "vector_add", checked=True, filename="basics.cu")
    x, y, out = torch.randn(100), torch.randn(100), torch.zeros(99)  # out is one element short
    with pytest.raises(OutOfBoundsError) as info:
        kernel(1, 128, (x, y, out, 100))
    assert info.value.access == "write" and info.value.buffer == "out" and info.value.offset == 99 * 4


def test_checked_mode_wild_address_and_local_array():
    module = RawModule(source(TESTS / "errors.cu"), checked=True, filename="errors.cu")
    with pytest.raises(OutOfBoundsError, match=r"errors.cu:\d+: read out of bounds \(SEGV\)"):
        module.get_function("wild_read")(1, 4, (torch.zeros(4), torch.zeros(4), 1 << 40))
    with pytest.raises(KernelError, match="deadlock"):  # kernel errors come back from the child too
        module.get_function("early_return_barrier")(1, 64, (torch.zeros(64), 40))


def test_gather_twin_skips_bad_pages():
    kernel = RawKernel(source(TESTS / "paged_gather.cu"), "paged_gather")
    cache, out = torch.randn(4, 4, 1, 8), torch.full((10, 8), float("nan"))
    kernel(10, 8, (out, cache, torch.tensor([2, 0, 7], dtype=torch.int32), 4, 4, 1, 0, 8))
    assert torch.equal(out[:8], cache[[2, 0]].reshape(8, 8)) and out[8:].isnan().all()


# ---------------------------------------------------------------- other errors: raised, never a hang
@pytest.fixture(scope="module")
def errors() -> RawModule:
    return RawModule(source(TESTS / "errors.cu"), filename="errors.cu")


@pytest.mark.parametrize("schedule", ["in_order", "reverse", 3])
def test_deadlock_raises(errors, schedule):
    with pytest.raises(KernelError, match="deadlock.*returned"):
        errors.get_function("early_return_barrier")(1, 64, (torch.zeros(64), 40), schedule=schedule)


def test_divergent_barriers_raise(errors):
    with pytest.raises(KernelError, match="different __syncthreads"):
        errors.get_function("divergent_barrier")(1, 32, (torch.zeros(32),))


def test_mismatched_collectives_raise(errors):
    with pytest.raises(KernelError, match="different warp collectives"):
        errors.get_function("mismatched_collectives")(1, 32, (torch.zeros(32),))


def test_exited_lane_in_mask_raises(errors):
    with pytest.raises(KernelError, match="lane 5"):
        errors.get_function("exited_lane_in_mask")(1, 32, (torch.zeros(32),))


def test_memory_faults_raise_instead_of_crashing(errors):
    x, out = torch.zeros(4), torch.zeros(4)
    # a wild index is stopped before the access, by the bounds check of every launch
    with pytest.raises(
        OutOfBoundsError, match=r"errors.cu:\d+: thread \(0,0,0\).*read of 4 bytes out of bounds"
    ):
        errors.get_function("wild_read")(1, 4, (x, out, 1 << 40))
    # a raw address has no known extent (bounds are not checked): the fault itself is caught, with its line
    with pytest.raises(KernelError, match=r"errors.cu:\d+: thread .*segmentation fault at address 0x10\b"):
        errors.get_function("wild_read")(1, 4, (16, out, 0))
    with pytest.raises(KernelError, match="stack overflow"):
        errors.get_function("huge_local_array")(1, 2, (out, 1 << 20))
    errors.get_function("wild_read")(1, 4, (x, out, 2))  # the library still works afterwards


def test_assert_raises_with_line(errors):
    kernel = errors.get_function("failing_assert")
    kernel(1, 4, (torch.zeros(4, dtype=torch.int32),))
    with pytest.raises(KernelError, match=r"errors.cu:\d+.*assert"):
        kernel(1, 4, (torch.tensor([0, 1, -1, 2], dtype=torch.int32),))


def test_argument_checks(basics):
    add = basics.get_function("vector_add")
    x, y, out = torch.randn(8), torch.randn(8), torch.zeros(8)
    with pytest.raises(TypeError, match="`x`.*float64.*float32"):
        add(1, 8, (x.double(), y, out, 8))
    with pytest.raises(TypeError, match="cannot pass float"):
        add(1, 8, (x, y, out, 8.0))
    fill = RawKernel(FILL, "fill")
    with pytest.raises(TypeError, match=r"np.float32\(2.5\)"):  # CuPy would send a double
        fill(1, 8, (out, 2.5))
    with pytest.raises(TypeError, match="numpy.int64"):
        add(1, 8, (x, y, out, np.int64(8)))
    with pytest.raises(TypeError, match="takes 4 arguments"):
        add(1, 8, (x, y, out))
    with pytest.raises(ValueError, match="not contiguous"):
        add(1, 8, (torch.randn(8, 2)[:, 0], y, out, 8))
    read_only = np.zeros(8, np.float32)
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        add(1, 8, (x, y, read_only, 8))
    with pytest.raises(TypeError, match="on cuda|CPU"):
        add(1, 8, (x, y, torch.zeros(8, device="meta"), 8))
    with pytest.raises(ValueError, match="1024"):
        add(1, (32, 33), (x, y, out, 8))
    with pytest.raises(ValueError, match="grid"):
        add(0, 8, (x, y, out, 8))
    with pytest.raises(ValueError, match="block"):
        add(1, (1, 1, 1, 1), (x, y, out, 8))
    with pytest.raises(ValueError, match="schedule"):
        add(1, 8, (x, y, out, 8), schedule="random")
    add(1, 8, (x.numpy(), y.numpy(), out.numpy(), np.int32(8)))  # numpy arrays and numpy scalars work
    assert torch.equal(out, x + y)


def test_unknown_kernel_name_and_compile_error():
    with pytest.raises(ValueError, match="kernels found: vector_add"):
        RawKernel(source(TESTS / "basics.cu").split("// out[b]")[0], "vector_sum")
    bad = 'extern "C" __global__ void broken(float* out) {\n    out[0] = undefined_thing;\n}\n'
    with pytest.raises(CompileError, match=r"broken.cu:2.*undefined_thing"):
        RawKernel(bad, "broken")
    unsupported = 'extern "C" __global__ void k(float* out) {\n    asm("trap;");\n}\n'  # inline PTX
    with pytest.raises(CompileError, match="k.cu"):
        RawKernel(unsupported, "k")


def test_printf_reaches_python_stdout(capsys):
    code = 'extern "C" __global__ void hello(int n) {\n    printf("thread %d of %d\\n", threadIdx.x, n);\n}\n'
    RawKernel(code, "hello")(1, 3, (3,))
    assert capsys.readouterr().out == "thread 0 of 3\nthread 1 of 3\nthread 2 of 3\n"


def test_compiled_library_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLMINI_CACHE_DIR", str(tmp_path))
    before = _build.compile_count
    RawKernel(FILL, "fill")
    assert _build.compile_count == before + 1
    kernel = RawKernel(FILL, "fill")  # same source, options and compiler: no new compile
    assert _build.compile_count == before + 1
    assert list((tmp_path / "emulator").glob("fill-*.so"))
    out = torch.zeros(4)
    kernel(1, 4, (out, np.float32(2.5)))
    assert (out == 2.5).all()


# ---------------------------------------------------------------- stopping: Ctrl-C and the time limit
# Each test runs in its own Python process with a timeout, so a broken stop fails the test instead of
# hanging CI. The parent builds the kernels first; the child finds them in the cache.
HANGS = TESTS / "hangs.cu"
CHILD_TIMEOUT_S = 120


def run_child(script: str, **env: str) -> dict:
    """Run `script` in a fresh Python; return the JSON object its last output line holds."""
    header = f"import json, os, signal, sys, threading, time\nimport numpy as np\nHANGS = {str(HANGS)!r}\n"
    proc = subprocess.run(
        [sys.executable, "-c", header + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=dict(os.environ, **env),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hangs() -> RawModule:
    module = RawModule(source(HANGS), filename="hangs.cu")
    for name in ("spin_wait", "count_blocks", "add_one"):
        module.get_function(name)  # built here, so the children find it in the cache
    return module


def test_ctrl_c_stops_a_thread_that_spins_forever(hangs):
    result = run_child("""
        from vllmini.emulator import RawModule
        module = RawModule(open(HANGS).read(), filename="hangs.cu")
        spin, flag = module.get_function("spin_wait"), np.zeros(1, np.int32)
        start = time.monotonic()  # before the timer starts: Ctrl-C comes at least 0.5 s after this
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            spin(1, 2, (flag,))
            outcome = "finished"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        stopped_after = time.monotonic() - start - 0.5
        flag[:] = 0
        spin(1, 2, (flag,), schedule="reverse")  # the same kernel again, in an order that finishes
        print(json.dumps({"outcome": outcome, "stopped_after": stopped_after, "flag": int(flag[0])}))
    """)
    assert result["outcome"] == "KeyboardInterrupt" and result["flag"] == 1
    assert 0 <= result["stopped_after"] < 1.0


def test_ctrl_c_from_outside_stops_a_huge_grid(hangs):
    script = """
        from vllmini.emulator import RawModule
        module = RawModule(open(HANGS).read(), filename="hangs.cu")
        count = np.zeros(1, np.uint64)
        print("launching", flush=True)
        try:
            module.get_function("count_blocks")(2**31 - 1, 1, (count,))
        except KeyboardInterrupt:
            module.get_function("add_one")(1, 4, (np.zeros(4, np.float32), np.zeros(4, np.float32)))
            print(json.dumps({"blocks_run": int(count[0])}), flush=True)
    """
    header = f"import json\nimport numpy as np\nHANGS = {str(HANGS)!r}\n"
    child = subprocess.Popen(
        [sys.executable, "-c", header + textwrap.dedent(script)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "launching"
        time.sleep(0.5)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        child.wait(timeout=CHILD_TIMEOUT_S)
        exited_after = time.monotonic() - sent
    finally:
        child.kill()
    result = json.loads(child.stdout.read().strip().splitlines()[-1])
    assert child.returncode == 0 and 0 < result["blocks_run"] < 2**31 - 1
    assert exited_after < 2.0  # the stop itself takes microseconds; the rest is Python shutting down


def test_time_limit_names_kernel_block_and_thread(hangs):
    result = run_child("""
        from vllmini.emulator import KernelError, RawModule
        from vllmini.errors import KernelLaunchError
        module = RawModule(open(HANGS).read(), filename="hangs.cu", time_limit=0.5)
        spin, flag = module.get_function("spin_wait"), np.zeros(1, np.int32)
        start = time.monotonic()
        try:
            spin(1, 2, (flag,))
            message = "finished"
        except KernelLaunchError as error:
            message = f"{type(error).__name__}: {error}"
        took = time.monotonic() - start
        count = np.zeros(1, np.uint64)
        try:
            module.get_function("count_blocks")((65535, 65535), 1, (count,), time_limit=0.3)
            grid_message = "finished"
        except KernelError as error:
            grid_message = str(error)
        spin(1, 2, (flag,), schedule="reverse")
        result = {"message": message, "took": took, "grid_message": grid_message, "flag": int(flag[0])}
        print(json.dumps(result))
    """)
    message = result["message"]
    assert message.startswith("KernelError: spin_wait: time limit reached in block (0,0,0)"), message
    assert "thread (0,0,0) of block (0,0,0) [warp 0 lane 0] was running" in message
    assert "threads of the block not finished: 2 of 2" in message and "time_limit=0.5 s" in message
    assert 0.5 <= result["took"] < 1.5 and result["flag"] == 1
    assert re.match(
        r"count_blocks: time limit reached in block \(\d+,\d+,0\) of grid \(65535,65535,1\)",
        result["grid_message"],
    )


def test_checked_mode_time_limit_and_ctrl_c(hangs):
    RawModule(source(HANGS), filename="hangs.cu", checked=True).get_function(
        "spin_wait"
    )  # build the ASan one
    result = run_child(
        """
        from vllmini.emulator import KernelError, RawModule
        spin = RawModule(open(HANGS).read(), filename="hangs.cu", checked=True).get_function("spin_wait")
        flag = np.zeros(1, np.int32)
        try:
            spin(1, 2, (flag,))  # the time limit comes from $VLLMINI_EMULATOR_TIME_LIMIT
            message = "finished"
        except KernelError as error:
            message = str(error)
        start = time.monotonic()  # before the timer starts: Ctrl-C comes at least 0.5 s after this
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            spin(1, 2, (flag,), time_limit=float("inf"))
            outcome = "finished"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        stopped_after = time.monotonic() - start - 0.5
        spin(1, 2, (flag,), schedule="reverse")
        print(json.dumps({"message": message, "outcome": outcome, "stopped_after": stopped_after,
                          "flag": int(flag[0])}))
        """,
        VLLMINI_EMULATOR_TIME_LIMIT="0.5",
    )
    assert "spin_wait: time limit reached in block (0,0,0)" in result["message"]
    assert "thread (0,0,0) of block (0,0,0) [warp 0 lane 0] was running" in result["message"]
    assert result["outcome"] == "KeyboardInterrupt" and 0 <= result["stopped_after"] < 1.0
    assert result["flag"] == 1


def test_time_limit_is_checked():
    with pytest.raises(ValueError, match="time_limit must be >= 0.001, got 0"):
        RawKernel(FILL, "fill", time_limit=0)
    with pytest.raises(TypeError, match="time_limit must be a number"):
        RawKernel(FILL, "fill")(1, 4, (torch.zeros(4), np.float32(1)), time_limit="5")


# ---------------------------------------------------------------- corners
@pytest.mark.parametrize("checked", [False, True])
def test_one_tensor_as_input_and_output(checked):
    add_one = RawModule(source(HANGS), filename="hangs.cu", checked=checked).get_function("add_one")
    same = torch.zeros(4)
    add_one(1, 4, (same, same))  # const input and output are one buffer: the write must stay
    assert same.tolist() == [1.0, 1.0, 1.0, 1.0]
    storage = torch.arange(8, dtype=torch.float32)
    add_one(1, 4, (storage[0:4], storage[2:6]))  # overlapping views: threads in order see earlier writes
    expected = torch.arange(8, dtype=torch.float64)
    for i in range(4):
        expected[2 + i] = expected[i] + 1
    assert torch.equal(storage.double(), expected)


def test_templated_kernel_does_not_break_the_others():
    code = source(HANGS)
    out = torch.zeros(4)
    RawKernel(code, "plain_after_template")(1, 4, (out,))
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="`scale` is a template"):
        RawKernel(code, "scale")


def test_errors_are_vllmini_errors(basics, errors):
    assert issubclass(CompileError, KernelBuildError) and issubclass(KernelError, KernelLaunchError)
    assert issubclass(OutOfBoundsError, KernelError)
    add = basics.get_function("vector_add")
    x, y, out = torch.randn(8), torch.randn(8), torch.zeros(8)
    with pytest.raises(InvalidArgumentError, match="schedule must be"):
        add(1, 8, (x, y, out, 8), schedule="random")
    with pytest.raises(InvalidArgumentError, match=r"grid\[1\] must be <= 65535, got 70000"):
        add((1, 70000), 8, (x, y, out, 8))
    with pytest.raises(InvalidTypeError, match=r"block\[0\] must be an int, got bool"):
        add(1, True, (x, y, out, 8))
    with pytest.raises(InvalidArgumentError, match=r"argument 3 `n` \(const int\) must be <= 2147483647"):
        add(1, 8, (x, y, out, 2**31))
    with pytest.raises(InvalidTypeError, match="`x`.*float64"):
        add(1, 8, (x.double(), y, out, 8))
    with pytest.raises(KernelLaunchError, match="deadlock"):
        errors.get_function("early_return_barrier")(1, 64, (torch.zeros(64), 40))

"""kernels/read_ceiling.cu, the plain read kernel whose bandwidth is the read ceiling (read_ceiling_us in
benchmarks/cuda_timing.py): on the CPU emulator it reads every 16-byte vector exactly once, whatever the
grid; on a GPU (marked gpu) its timing runs. Its NVRTC build is tests/test_kernels.py's (every .cu file)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from vllmini import cuda_kernels
from vllmini.emulator import RawKernel
from vllmini.errors import InvalidArgumentError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cuda_timing  # noqa: E402

SOURCE = cuda_kernels.read_kernel_source("read_ceiling")


def xor_of(kernel, n_vec, grid, block, seed=0):
    data = np.random.default_rng(seed).integers(0, 2**32, n_vec * 4, dtype=np.uint32)  # [n_vec] uint4
    sink = np.zeros(1, dtype=np.uint32)
    kernel((grid,), (block,), (data, np.int64(n_vec), sink), racecheck=True)
    return int(sink[0]), int(np.bitwise_xor.reduce(data))


@pytest.mark.parametrize("n_vec, grid, block", [(1, 1, 32), (37, 1, 32), (1000, 3, 64), (4099, 4, 256)])
def test_read_kernel_reads_every_vector_once(n_vec, grid, block):
    got, want = xor_of(RawKernel(SOURCE, "read_ceiling"), n_vec, grid, block)
    assert got == want  # and no race: the per-warp results meet through atomicXor


def test_the_test_can_fail():
    no_tail = SOURCE.replace("for (; i < n_vec; i += stride)", "for (; i < 0; i += stride)")
    assert no_tail != SOURCE
    got, want = xor_of(RawKernel(no_tail, "read_ceiling"), 1000, 3, 64)  # 1000 = 4 x 192 + 232 in the tail
    assert got != want


def test_timing_helper_is_importable_without_a_gpu():
    assert cuda_timing.read_ceiling_grid(132) == (132 * 8,)  # an H200: 8 blocks of 256 threads per SM
    for bad in (0, 100, 16.0):
        with pytest.raises(InvalidArgumentError, match="multiple of 16"):
            cuda_timing.read_ceiling_us(bad)


@pytest.mark.gpu
def test_read_ceiling_on_the_gpu():
    import torch

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    us = cuda_timing.read_ceiling_us(64 * 2**20, repeats=5, flush=flush)
    assert 0 < us < 1e6  # the XOR check inside ran first: every byte was read

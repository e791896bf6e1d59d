"""GPU timing for the benchmarks: CUDA events around each call, the median of many calls."""

import statistics
import warnings

import torch

from vllmini.errors import InvalidArgumentError


def median_us(fn, repeats: int, flush: torch.Tensor | None = None) -> float:
    """Median GPU time of fn() in microseconds, synchronized after each call. `flush`, a buffer larger than
    the L2 cache, is zeroed before each call so that the timed call reads its data from HBM."""
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


READ_THREADS = 256  # threads per block of kernels/read_ceiling.cu
READ_BLOCKS_PER_SM = 8  # 8 x 256 = 2048 threads, the most an SM holds (H100/H200, A100)


def read_ceiling_grid(num_sms: int) -> tuple[int]:
    """The read kernel's grid: enough blocks to fill every SM (its loop strides over the rest)."""
    return (num_sms * READ_BLOCKS_PER_SM,)


def read_ceiling_us(nbytes: int, repeats: int = 30, flush: torch.Tensor | None = None) -> float:
    """Median GPU time, in microseconds, of kernels/read_ceiling.cu reading `nbytes` (a multiple of 16)
    of random data once, with 16-byte loads over the whole GPU; nbytes / time is the read ceiling. The
    kernel's XOR of the data is checked against torch's first, so the timed kernel is known to read every
    byte. `flush`: as median_us (a buffer larger than L2, zeroed before each call). CUDA GPU and CuPy."""
    if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % 16:
        raise InvalidArgumentError(
            f"nbytes must be a positive multiple of 16 (one uint4 load), got {nbytes!r}"
        )
    import cupy
    import numpy as np

    from vllmini import cuda_kernels

    device = torch.cuda.current_device()
    source = cuda_kernels.read_kernel_source("read_ceiling")
    kernel = cupy.RawKernel(source, "read_ceiling", options=cuda_kernels.NVRTC_OPTIONS)
    data = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    grid = read_ceiling_grid(cuda_kernels.num_sms(device))
    args = (data.data_ptr(), np.int64(nbytes // 16), sink.data_ptr())
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older CuPy lacks the new API
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream, device)

    def read() -> None:
        with cupy.cuda.Device(device), stream:
            kernel(grid, (READ_THREADS,), args)

    read()
    want = np.bitwise_xor.reduce(data.cpu().numpy())
    assert sink.item() == want, f"read_ceiling's XOR {sink.item()} != {want}: it did not read every byte once"
    return median_us(read, repeats, flush)

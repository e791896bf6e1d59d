"""GPU timing for the benchmarks: CUDA events around each call, the median of many calls."""

import statistics

import torch


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

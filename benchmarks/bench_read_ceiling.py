"""The read ceiling: the HBM read bandwidth of a plain kernel (kernels/read_ceiling.cu), GPU only.

Every paged-attention decode step must read each byte of K and V once, so the fastest it can be is the
time a kernel needs just to read that many bytes. This script times kernels/read_ceiling.cu (16-byte
loads, a grid-stride loop over 8 blocks of 256 threads per SM, an XOR the compiler cannot drop) on the
sizes of K + V of benchmarks/RESULTS.md's shapes, head size 128, float16, and prints TB/s. CUDA events,
median of --repeats calls, L2 flushed (256 MB written) before every call.

    python benchmarks/bench_read_ceiling.py [--repeats 30]
"""

from __future__ import annotations

import argparse

import torch
from cuda_timing import read_ceiling_us

SIZES = {  # name: bytes of K and V one decode step reads (tokens x kv heads x 128 dims x 2 bytes x 2)
    "(f) B=1 H=32 L=4096": 4096 * 32 * 128 * 2 * 2,  # 67 MB
    "(d) B=1 H=32 L=32768": 32768 * 32 * 128 * 2 * 2,  # 537 MB
    "(e) GQA B=64 8kv L=4096": 64 * 4096 * 8 * 128 * 2 * 2,  # 1.07 GB
    "(a) B=64 H=32 L=4096": 64 * 4096 * 32 * 128 * 2 * 2,  # 4.29 GB
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_read_ceiling.py needs a CUDA GPU (and CuPy)")
    print(f"{torch.cuda.get_device_name()}, {args.repeats} repeats, L2 flushed before each call")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"{'shape':<26}{'bytes':>16}{'us':>10}{'TB/s':>8}")
    for name, nbytes in SIZES.items():
        us = read_ceiling_us(nbytes, args.repeats, flush)
        print(f"{name:<26}{nbytes:>16,}{us:>10.1f}{nbytes / us / 1e6:>8.2f}")


if __name__ == "__main__":
    main()

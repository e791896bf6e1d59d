"""How long the page-table explorer takes per click: the action and the redraw (status line + SVG).

Pins itself to one CPU core, then, for each pool size, clicks through a fixed script (adds, appends,
forks, steps, frees, a page turn) on a `PageTableExplorer` drawn in the foreground, and prints the
median and worst time per click, and the size of the picture sent to the browser. The goal is at most
0.3 s per click for pools up to 1000 blocks (notebook 03's explorer; the matplotlib PNG it replaced
took 1.2 s at 16 blocks and 2.6 s at 1000 on a loaded 2-core machine).

    python benchmarks/bench_explorer.py                 # pools of 16, 100 and 1000 blocks
    python benchmarks/bench_explorer.py --blocks 4000   # any sizes
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from vllmini.course.explorer import PageTableExplorer


def script(num_blocks: int, block_size: int) -> list[tuple[str, dict]]:
    """Clicks that fill about half the pool, share, copy and free, as a learner might."""
    long = max(1, num_blocks * block_size // 12)  # each long sequence takes about 1/12 of the pool
    clicks = [("add", {"tokens": long}), ("add", {"tokens": block_size + 1}), ("append", {"tokens": 3})]
    clicks += [("fork", {"seq": 1, "samples": 4}), ("step", {}), ("step", {}), ("add", {"tokens": long})]
    clicks += [("append", {"tokens": block_size, "seq": 0}), ("free", {"seq": 0}), ("add", {"tokens": 2})]
    clicks += [
        ("fork", {"seq": 2, "samples": 8}),
        ("step", {}),
        ("page", {"page": 0}),
        ("append", {"tokens": 1}),
    ]
    return clicks


def run(num_blocks: int, block_size: int) -> dict:
    e = PageTableExplorer(num_blocks, block_size, background=False)
    times = []
    for name, boxes in script(num_blocks, block_size):
        start = time.perf_counter()
        e.click(name, **boxes)
        times.append(time.perf_counter() - start)
        assert e.errors == {}, e.errors
    return {
        "blocks": num_blocks,
        "block_size": block_size,
        "clicks": len(times),
        "median_ms": 1000 * statistics.median(times),
        "max_ms": 1000 * max(times),
        "svg_kb": len(e.view.picture) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 100, 1000])
    parser.add_argument("--block-size", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the best is reported")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"explorer: time per click (action + status + SVG picture), {cores} core(s)")
    print(f"{'blocks':>7} {'block_size':>10} {'clicks':>6} {'median ms':>10} {'max ms':>8} {'SVG KiB':>8}")
    for num_blocks in args.blocks:
        for block_size in args.block_size:
            r = min((run(num_blocks, block_size) for _ in range(args.repeat)), key=lambda r: r["max_ms"])
            print(
                f"{r['blocks']:>7} {r['block_size']:>10} {r['clicks']:>6} {r['median_ms']:>10.1f} "
                f"{r['max_ms']:>8.1f} {r['svg_kb']:>8.0f}"
            )


if __name__ == "__main__":
    main()

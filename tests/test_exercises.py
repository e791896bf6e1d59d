"""Tests for vllmini.course.exercises: every check accepts a right answer and rejects a wrong one."""

import collections
import re
from pathlib import Path

import pytest
import torch

from vllmini.allocator import BlockAllocator
from vllmini.attention import paged_attention
from vllmini.course import cuda_exercises, exercises
from vllmini.emulator import KernelError, OutOfBoundsError, RaceError


def test_fp8_check():
    per_token, tokens = exercises.fp8_answer()
    assert per_token == 64 * 1024  # 2 x 32 layers x 8 kv heads x 128 x 1 byte
    exercises.check_fp8_kv(per_token, tokens)
    with pytest.raises(AssertionError, match="weights at 2 bytes"):
        exercises.check_fp8_kv(per_token, (80 * 2**30 - 8_030_261_248) // per_token)  # weights at 1 byte


def test_time_average_and_block_manager_checks():
    static, paged = exercises.time_average_answer()
    assert 0.14 < static < 0.24 and paged > 0.95
    exercises.check_time_average(static + 0.005, paged)
    with pytest.raises(AssertionError):
        exercises.check_time_average(0.243, paged)  # the at-completion snapshot is not the answer
    from vllmini import BlockManager
    from vllmini.course import memory

    bm = BlockManager(num_blocks=1024, block_size=16)
    for k, (i, o) in enumerate(memory.sample_requests(30, "sharegpt", seed=0)):
        bm.allocate(k, i + o)
    exercises.check_block_manager_share(bm.utilization()["token_utilization"])
    with pytest.raises(AssertionError):
        exercises.check_block_manager_share(0.9)


class Bitmap:
    def __init__(self, n):
        self.used = [False] * n

    def allocate(self):
        b = self.used.index(False)
        self.used[b] = True
        return b

    def free(self, b):
        self.used[b] = False


class Fifo:
    def __init__(self, n):
        self.q = collections.deque(range(n))

    def allocate(self):
        return self.q.popleft()

    def free(self, b):
        self.q.append(b)


def test_allocator_checks_tell_the_orders_apart():
    exercises.check_bitmap_allocator(Bitmap)
    exercises.check_fifo_allocator(Fifo)
    with pytest.raises(AssertionError):
        exercises.check_bitmap_allocator(Fifo)
    with pytest.raises(AssertionError):
        exercises.check_fifo_allocator(BlockAllocator)  # LIFO
    exercises.check_first_difference([("allocate",)] * 3 + [("free", 0), ("free", 1)])
    with pytest.raises(AssertionError):
        exercises.check_first_difference([("allocate",)] * 3 + [("free", 1), ("free", 0)])


class BrokenFork(BlockAllocator):
    def fork(self, block_ids):
        out = []
        for b in block_ids:
            self.incref(b)  # checks one id at a time: a bad id leaves the earlier ones changed
            out.append(b)
        return out


def test_failed_fork_and_leak_detector_checks():
    exercises.check_failed_fork_corrupts(BrokenFork, [("allocate",), ("fork", [0, 3])])
    with pytest.raises(AssertionError):
        exercises.check_failed_fork_corrupts(BlockAllocator, [("allocate",), ("fork", [0, 3])])

    class Pool:  # notebook 02's RefCountedAllocator, reduced
        def __init__(self, n):
            self.free_list, self.ref_counts = list(range(n - 1, -1, -1)), [0] * n

        def allocate(self):
            b = self.free_list.pop()
            self.ref_counts[b] = 1
            return b

        def free(self, b):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_list.append(b)

        def fork(self, ids):
            for b in ids:
                self.ref_counts[b] += 1

    class Good(Pool):
        def check(self):
            assert len(set(self.free_list)) == len(self.free_list)
            for b, rc in enumerate(self.ref_counts):
                assert (rc == 0) == (b in self.free_list)

    class Lazy(Pool):
        def check(self):
            assert len(set(self.free_list)) == len(self.free_list)

    exercises.check_leak_detector(Good)
    with pytest.raises(AssertionError, match="did not notice"):
        exercises.check_leak_detector(Lazy)


def test_attention_checks():
    exercises.check_gather_bytes(4 * 2**30)
    with pytest.raises(AssertionError):
        exercises.check_gather_bytes(2 * 2**30)  # keys only
    exercises.check_slots_read(lambda bt, n, bs: [bt[t // bs] * bs + t % bs for t in range(n)])
    with pytest.raises(AssertionError):
        exercises.check_slots_read(lambda bt, n, bs: [t for t in range(n)])
    exercises.check_batched_decode(lambda *a: paged_attention(*a, backend="torch"))
    with pytest.raises(AssertionError):
        exercises.check_batched_decode(lambda q, *a: torch.zeros_like(q))


def test_engine_checks():
    exercises.check_static_batch(lambda pool, m: pool // m)
    with pytest.raises(AssertionError):
        exercises.check_static_batch(lambda pool, m: round(pool / m))
    timeline = {4: ["waiting", "waiting", "prefill", "decode", "preempted", "waiting", "prefill", "finished"]}
    exercises.check_timeline(timeline, 4, first_admitted=2, steps_waiting=3)
    with pytest.raises(AssertionError):
        exercises.check_timeline(timeline, 4, first_admitted=2, steps_waiting=2)


def _sweep_point(policy, rate, ttft_p50):
    from types import SimpleNamespace

    ttft = SimpleNamespace(p50=ttft_p50)
    return SimpleNamespace(policy=policy, rate=rate, metrics=SimpleNamespace(ttft=ttft))


def test_ttft_knee_check():
    points = [_sweep_point("static", r, t) for r, t in [(4, 0.02), (16, 0.1), (24, 0.5), (32, 2.0)]]
    points += [_sweep_point("paged", r, t) for r, t in [(4, 0.02), (16, 0.02), (24, 0.03)]]
    exercises.check_ttft_knee(points, {"static": 24, "paged": None})
    with pytest.raises(AssertionError, match="static"):
        exercises.check_ttft_knee(points, {"static": 16, "paged": None})  # 5x is not past 10x
    with pytest.raises(AssertionError, match="paged"):
        exercises.check_ttft_knee(points, {"static": 24, "paged": 24})
    with pytest.raises(AssertionError, match="per policy"):
        exercises.check_ttft_knee(points, {"static": 24})


def test_fast_kernel_checks():
    nbytes = 2 * 64 * 4096 * 8 * 128 * 2
    exercises.check_decode_roofline(nbytes, nbytes / 4.49e12 * 1e6, 4.0)
    with pytest.raises(AssertionError, match="per KV head"):
        exercises.check_decode_roofline(4 * nbytes, nbytes / 4.49e12 * 1e6, 4.0)  # counted per query head
    with pytest.raises(AssertionError, match="intensity"):
        exercises.check_decode_roofline(nbytes, nbytes / 4.49e12 * 1e6, 1.0)

    def merge(parts):
        big = torch.stack([m for m, _, _ in parts]).max(dim=0).values
        w = [l * torch.exp(m - big) for m, l, _ in parts]
        return sum(wi[:, None] * o for wi, (_, _, o) in zip(w, parts, strict=True)) / sum(w)[:, None]

    def naive_merge(parts):  # exp(m) overflows for large scores
        w = [l * torch.exp(m) for m, l, _ in parts]
        return sum(wi[:, None] * o for wi, (_, _, o) in zip(w, parts, strict=True)) / sum(w)[:, None]

    exercises.check_lse_merge(merge)
    with pytest.raises(AssertionError, match="overflows"):
        exercises.check_lse_merge(naive_merge)
    with pytest.raises(AssertionError):
        exercises.check_lse_merge(lambda parts: sum(o for _, _, o in parts) / len(parts))  # unweighted mean

    def first_bad(bt, lens, num_blocks, bs):
        for s, n in enumerate(lens.tolist()):
            for j in range(-(-n // bs)):
                if not 0 <= int(bt[s, j]) < num_blocks:
                    return s, j
        return None

    def first_bad_with_padding(bt, lens, num_blocks, bs):  # also flags the -1 padding nobody reads
        bad = ((bt < 0) | (bt >= num_blocks)).nonzero().tolist()
        return tuple(bad[0]) if bad else None

    exercises.check_first_bad_entry(first_bad)
    with pytest.raises(AssertionError, match="expected"):
        exercises.check_first_bad_entry(first_bad_with_padding)


def test_page_table_checks(capsys):
    exercises.check_prefix_sharing(2, 0)
    with pytest.raises(AssertionError, match="FULL blocks"):
        exercises.check_prefix_sharing(2, 1)
    exercises.check_watermark([("A", 16), ("B", 16)])
    with pytest.raises(AssertionError, match="can still grow"):
        exercises.check_watermark([("A", 4), ("B", 4)])
    exercises.check_block_size(8)
    with pytest.raises(AssertionError, match="got 16"):
        exercises.check_block_size(16)
    exercises.check_padding([8, 9, 10, 11, 0, 1, 2, 3], [8, 9, 10, 11, 12, 13, 14, 15])
    with pytest.raises(AssertionError, match="padding -1"):
        exercises.check_padding([8, 9, 10, 11, 0, 1, 2, 3], [8, 9, 10, 11])
    assert capsys.readouterr().out.count("correct:") == 4


# ---- the CUDA exercises (kernels/exercises/*.cu), run on the CPU emulator

EXERCISES = Path(__file__).resolve().parents[1] / "kernels" / "exercises"
CUDA_CHECKS = {
    "warp_reduction.cu": cuda_exercises.check_warp_reduction_kernel,
    "split_merge.cu": cuda_exercises.check_split_merge_kernel,
}


SOLUTIONS = {  # the worked answer of each: a file of its own, or the kernel version it asks you to write
    "warp_reduction.cu": EXERCISES.parent / "paged_attention_2_warp_per_token.cu",
    "split_merge.cu": EXERCISES / "solutions" / "split_merge.cu",
}


def _body(text: str) -> str:
    """A kernel file from its first #define on: the code, without the header comment."""
    return text[text.index("#define") :]


def test_warp_reduction_skeleton_is_version_2_without_warp_sum():
    solution, skeleton = (
        _body(SOLUTIONS["warp_reduction.cu"].read_text()),
        _body((EXERCISES / "warp_reduction.cu").read_text()),
    )
    cut = lambda text: re.sub(r"(float warp_sum\(float v\) \{).*?(\n\})", r"\1\2", text, flags=re.S)  # noqa: E731
    assert cut(solution) != solution and cut(skeleton) != skeleton  # both have a warp_sum body to cut
    assert cut(skeleton) == cut(solution), "the exercise drifted from version 2 outside warp_sum's body"


@pytest.mark.parametrize("name", sorted(CUDA_CHECKS))
def test_cuda_exercise_solution_passes_and_skeleton_fails(name, capsys):
    check = CUDA_CHECKS[name]
    check(SOLUTIONS[name].read_text())
    assert capsys.readouterr().out.startswith("correct: ")
    skeleton = (EXERCISES / name).read_text()
    assert "TODO" in skeleton
    with pytest.raises(AssertionError, match=r"wrong values at sequence \d+, head \d+: out\[") as info:
        check(skeleton)  # it compiles and runs; only the answer is wrong
    assert "expected" in str(info.value)


WARP_BUGS = [  # (what the bug changes in the solution, the error, what its message must say)
    (
        ("0xffffffffu", "0x0000ffffu"),
        KernelError,
        r"paged_attention_2_warp_per_token.cu:\d+: .*0x0000ffff.*not in the mask",
    ),
    (("WARP_SIZE / 2; offset > 0", "WARP_SIZE / 4; offset > 0"), AssertionError, r"wrong values.*butterfly"),
    (
        ("if (lane == 0) scores[t]", "scores[t]"),
        RaceError,
        r"paged_attention_2_warp_per_token.cu:\d+: race on shared memory",
    ),
]
MERGE_BUGS = [
    (
        ("__syncthreads();  // every weight", "// every weight"),
        RaceError,
        r"split_merge.cu:\d+: race",
    ),
    (("expf(ml[2 * s] - M)", "expf(ml[2 * s])"), AssertionError, r"= nan, .*scores of size ~500.*overflows"),
    (("s < num_splits; s++) acc", "s <= num_splits; s++) acc"), OutOfBoundsError, r"read .* of `part_out`"),
]


@pytest.mark.parametrize(
    "name, bug", [("warp_reduction.cu", b) for b in WARP_BUGS] + [("split_merge.cu", b) for b in MERGE_BUGS]
)
def test_cuda_exercise_checks_name_a_planted_bug(name, bug):
    (old, new), error, message = bug
    solution = SOLUTIONS[name].read_text()
    assert old in solution
    with pytest.raises(error, match=message):
        CUDA_CHECKS[name](solution.replace(old, new))


# ---- notebook 08


def test_beam_replace_check():
    def right(bm, parents):
        for new, parent in parents.items():
            bm.fork(parent, new)
        for old in [s for s in bm.seq_ids if s not in parents]:
            bm.free(old)

    def frees_first(bm, parents):  # frees the survivors before forking them: fork of a freed sequence fails
        for old in [s for s in bm.seq_ids if s not in parents]:
            bm.free(old)

    def never_frees(bm, parents):
        for new, parent in parents.items():
            bm.fork(parent, new)

    exercises.check_beam_replace(right)
    for wrong in (frees_first, never_frees):
        with pytest.raises(AssertionError):
            exercises.check_beam_replace(wrong)


def test_memory_saved_check():
    from vllmini.checks import cdiv

    exercises.check_memory_saved(lambda n, p, o, bs: (n - 1) * (p // bs) / (n * cdiv(p + o, bs)))
    with pytest.raises(AssertionError):  # the exercise's formula counts every prompt token as shared
        exercises.check_memory_saved(lambda n, p, o, bs: (n - 1) * p / (n * (p + o)))
    assert exercises.memory_saved_answer(3, 10, 8, 4) == pytest.approx(2 * 2 / (3 * 5))

"""Tests for vllmini.course.memory: KV bytes per token, the synthetic workloads, the reservation
simulation."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllmini.course import memory
from vllmini.course.memory import (
    LLAMA_2_7B,
    LLAMA_2_70B,
    LLAMA_3_8B,
    MODEL_SHAPES,
    OPT_13B,
    TINYLLAMA_1_1B,
    ModelShape,
    kv_bytes_per_token,
    kv_tokens_that_fit,
    paged_reservation,
    requests_that_fit,
    reservation,
    reserved_slots,
    sample_requests,
    static_reservation,
)
from vllmini.errors import InvalidArgumentError, InvalidTypeError

KiB = 1024

# requests as (input_len, output_len) with input + output <= 2048
requests_st = st.lists(
    st.integers(1, 1500).flatmap(lambda i: st.tuples(st.just(i), st.integers(0, 2048 - i))),
    min_size=0,
    max_size=40,
)

# -----------------------------------------------------------------------------
# KV bytes per token


def test_opt_13b_is_800_kb_per_token():
    # Kwon et al. 2023: 2 (K and V) x 5120 hidden x 40 layers x 2 bytes = 800 KB per token
    assert kv_bytes_per_token(OPT_13B) == 2 * 5120 * 40 * 2 == 800 * KiB


def test_llama_2_7b_is_512_kb_per_token():
    assert kv_bytes_per_token(LLAMA_2_7B) == 512 * KiB


def test_gqa_shapes_store_fewer_kv_heads():
    # Llama-3-8B: same layers and head size as Llama-2-7B, but 8 kv heads for 32 query heads -> 4x less
    assert kv_bytes_per_token(LLAMA_3_8B) * 4 == kv_bytes_per_token(LLAMA_2_7B) == 512 * KiB
    assert kv_bytes_per_token(LLAMA_2_70B) == 2 * 80 * 8 * 128 * 2 == 320 * KiB
    assert kv_bytes_per_token(TINYLLAMA_1_1B) == 2 * 22 * 4 * 64 * 2 == 22 * KiB


def test_published_shapes():
    for shape in MODEL_SHAPES:
        assert shape.num_heads * shape.head_size == shape.hidden_size, shape.name
        assert shape.num_heads % shape.num_kv_heads == 0, shape.name
        assert shape.dtype_bytes == 2, shape.name
    assert (LLAMA_2_70B.num_layers, LLAMA_2_70B.num_heads, LLAMA_2_70B.num_kv_heads) == (80, 64, 8)
    assert (TINYLLAMA_1_1B.num_layers, TINYLLAMA_1_1B.hidden_size, TINYLLAMA_1_1B.num_kv_heads) == (
        22,
        2048,
        4,
    )


def test_kv_bytes_scale_with_dtype():
    fp32 = ModelShape("fp32", 32, 4096, 32, 32, 128, dtype_bytes=4)
    assert kv_bytes_per_token(fp32) == 2 * kv_bytes_per_token(LLAMA_2_7B)


def test_tokens_that_fit_after_weights():
    gib80 = 80 * 2**30
    expected = (gib80 - 6_738_415_616 * 2) // (512 * KiB)
    assert kv_tokens_that_fit(LLAMA_2_7B, gib80) == expected == 138_134
    assert kv_tokens_that_fit(LLAMA_2_70B, gib80) == 0  # 138 GB of fp16 weights do not fit
    assert kv_tokens_that_fit(ModelShape("no weights", 1, 8, 1, 1, 8), 64) == 2  # 32 bytes per token


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(head_size=-1), "head_size"),
        (dict(dtype_bytes=0), "dtype_bytes"),
        (dict(num_params=-5), "num_params"),
    ],
)
def test_bad_shape_raises(kwargs, word):
    base = dict(name="x", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=16)
    with pytest.raises(InvalidArgumentError, match=word):
        ModelShape(**{**base, **kwargs})


def test_bools_are_not_ints_and_numpy_ints_are():
    base = dict(name="x", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=16)
    for field in ("num_layers", "dtype_bytes", "num_params"):
        with pytest.raises(InvalidTypeError, match=f"{field} must be an int, got bool True"):
            ModelShape(**{**base, field: True})
    shape = ModelShape(**{**base, "num_layers": np.int64(3), "num_params": np.int32(7)})
    assert (shape.num_layers, shape.num_params) == (3, 7) and type(shape.num_layers) is int
    for call, name in (
        (lambda: sample_requests(True), "n"),
        (lambda: sample_requests(4, max_len=np.True_), "max_len"),
        (lambda: kv_tokens_that_fit(OPT_13B, True), "memory_bytes"),
        (lambda: reserved_slots(True, "oracle"), "final_len"),
        (lambda: reserved_slots(4, "paged", block_size=True), "block_size"),
        (lambda: static_reservation([(True, 3)], 2048), r"input_len of request \(True, 3\)"),
        (lambda: requests_that_fit([(1, 1)], False, "paged"), "kv_budget_tokens"),
    ):
        with pytest.raises(InvalidTypeError, match=f"{name} must be an int, got bool"):
            call()
    with pytest.raises(InvalidTypeError, match="progress must be a number, got bool"):
        paged_reservation([(1, 1)], 16, progress=True)
    assert sample_requests(np.int64(3), max_len=np.int32(64), seed=0) == sample_requests(
        3, max_len=64, seed=0
    )
    assert reserved_slots(np.int64(5), "paged", block_size=np.int64(4)) == 8


def test_bad_kv_arguments_raise():
    with pytest.raises(TypeError, match="ModelShape"):
        kv_bytes_per_token("OPT-13B")
    with pytest.raises(ValueError, match="-1"):
        kv_tokens_that_fit(OPT_13B, -1)


# -----------------------------------------------------------------------------
# synthetic workloads


@pytest.mark.parametrize(
    "workload, mean_in, mean_out", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)]
)
def test_workload_means_close_to_paper(workload, mean_in, mean_out):
    lengths = np.array(sample_requests(100_000, workload, max_len=2048, seed=1))  # (n, 2)
    assert lengths.mean(axis=0)[0] == pytest.approx(mean_in, rel=0.03)
    assert lengths.mean(axis=0)[1] == pytest.approx(mean_out, rel=0.03)


def test_workload_is_seeded_and_shaped():
    a = sample_requests(50, "sharegpt", seed=7)
    assert a == sample_requests(50, "sharegpt", seed=7)
    assert a != sample_requests(50, "sharegpt", seed=8)
    assert len(a) == 50 and all(isinstance(x, int) for pair in a for x in pair)
    assert sample_requests(0) == []


@pytest.mark.parametrize("max_len", [2, 16, 512, 2048])
def test_workload_clipped_to_max_len(max_len):
    lengths = np.array(sample_requests(20_000, "sharegpt", max_len=max_len, seed=3))
    assert lengths.min() >= 1
    assert (lengths.sum(axis=1) <= max_len).all()
    if max_len >= 512:
        assert (lengths.sum(axis=1) == max_len).any()  # the long tail does hit the cap


def test_clipping_truncates_the_same_draws():
    # the same seed at a smaller max_len gives the same requests, truncated: what a capped server sees
    long = sample_requests(1000, "sharegpt", max_len=4096, seed=5)
    short = sample_requests(1000, "sharegpt", max_len=512, seed=5)
    for (li, lo), (si, so) in zip(long, short, strict=True):
        assert si == min(li, 511) and so == max(1, min(lo, 512 - si))


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(n=-1), "-1"),
        (dict(workload="lmsys"), "lmsys"),
        (dict(max_len=1), "max_len"),
    ],
)
def test_bad_workload_arguments_raise(kwargs, word):
    with pytest.raises(InvalidArgumentError, match=word):
        sample_requests(**{"n": 10, **kwargs})
    with pytest.raises(InvalidTypeError, match="n must be an int, got float 2.5"):
        sample_requests(2.5)


# -----------------------------------------------------------------------------
# reservation schemes


def test_reserved_slots_by_hand():
    assert reserved_slots(100, "static", max_len=2048) == 2048
    assert reserved_slots(100, "pow2") == 128
    assert reserved_slots(128, "pow2") == 128
    assert reserved_slots(129, "pow2") == 256
    assert reserved_slots(1, "pow2") == 1
    assert reserved_slots(2500, "pow2", max_len=3000) == 3000  # never more than max_len
    assert reserved_slots(100, "oracle") == 100
    assert reserved_slots(100, "paged", block_size=16) == 112
    assert reserved_slots(96, "paged", block_size=16) == 96
    assert reserved_slots(100, "paged", block_size=16, num_tokens=17) == 32
    assert reserved_slots(5000, "paged", max_len=2048, block_size=16) == 5008  # paging has no max_len


def test_tiny_example():
    # max_len 16, block size 4: the picture in notebook 01
    reqs = [(5, 3), (2, 4), (9, 5)]
    static = static_reservation(reqs, max_len=16)
    paged = paged_reservation(reqs, block_size=4)
    assert (static.tokens, static.reserved_slots) == (28, 48)
    assert (paged.tokens, paged.reserved_slots) == (28, 32)
    half = paged_reservation(reqs, block_size=4, progress=0.5)  # 5+2, 2+2, 9+2 (round half to even)
    assert (half.tokens, half.reserved_slots) == (22, 24)
    assert static_reservation(reqs, 16, progress=0.5).reserved_slots == 48  # reserved up front anyway


def test_empty_set_of_requests():
    r = static_reservation([], 2048)
    assert (r.tokens, r.reserved_slots, r.token_share, r.wasted_slots) == (0, 0, 1.0, 0)


@given(requests_st, st.sampled_from([1, 2, 4, 16, 128]), st.floats(0, 1))
def test_static_share_below_paged_share(reqs, block_size, progress):
    static = static_reservation(reqs, 2048, progress)
    paged = paged_reservation(reqs, block_size, progress)
    assert static.tokens == paged.tokens
    assert static.token_share <= paged.token_share
    # paging wastes less than one block per request
    assert 0 <= paged.wasted_slots <= len(reqs) * (block_size - 1)
    if block_size == 1:
        assert paged.token_share == 1.0


@given(requests_st)
def test_schemes_are_ordered(reqs):
    # reserved slots: oracle <= pow2 <= static (when max_len is a power of two), and oracle <= paged
    res = {s: reservation(reqs, s, max_len=2048, block_size=16).reserved_slots for s in memory.SCHEMES}
    assert res["oracle"] <= res["pow2"] <= res["static"]
    assert res["oracle"] <= res["paged"] < res["oracle"] + 16 * max(1, len(reqs))


def test_synthetic_shares_are_in_the_expected_range():
    reqs = sample_requests(5000, "sharegpt", seed=0)
    static = static_reservation(reqs, 2048)
    paged = paged_reservation(reqs, 16)
    assert 0.2 < static.token_share < 0.3  # ~490 tokens of 2048
    assert paged.token_share > 0.98


@given(requests_st, st.sampled_from(memory.SCHEMES), st.integers(0, 20_000), st.integers(0, 20_000))
def test_fits_monotone_in_budget(reqs, scheme, a, b):
    lo, hi = sorted((a, b))
    n_lo = requests_that_fit(reqs, lo, scheme)
    n_hi = requests_that_fit(reqs, hi, scheme)
    assert 0 <= n_lo <= n_hi <= len(reqs)
    # the admitted prefix really fits, and one more would not
    used = sum(reserved_slots(sum(r), scheme) for r in reqs[:n_hi])
    assert used <= hi
    if n_hi < len(reqs):
        assert used + reserved_slots(sum(reqs[n_hi]), scheme) > hi


@given(requests_st, st.integers(0, 50_000))
def test_paged_fits_at_least_as_many_as_static(reqs, budget):
    assert requests_that_fit(reqs, budget, "paged") >= requests_that_fit(reqs, budget, "static")


def test_fits_by_hand():
    reqs = [(100, 200), (50, 50), (1000, 1000)]
    assert requests_that_fit(reqs, 4096, "static", max_len=2048) == 2
    assert requests_that_fit(reqs, 4095, "static", max_len=2048) == 1
    assert requests_that_fit(reqs, 304 + 112, "paged", block_size=16) == 2  # 19 + 7 blocks
    assert requests_that_fit(reqs, 304 + 111, "paged", block_size=16) == 1
    assert requests_that_fit(reqs, 0, "paged") == 0


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda: reserved_slots(0, "static"), "final_len"),
        (lambda: reserved_slots(3000, "static", max_len=2048), "3000"),
        (lambda: reserved_slots(10, "buddy"), "buddy"),
        (lambda: reserved_slots(10, "paged", block_size=0), "block_size"),
        (lambda: reserved_slots(10, "paged", num_tokens=11), "num_tokens"),
        (lambda: static_reservation([(0, 5)], 2048), r"\(0, 5\)"),
        (
            lambda: static_reservation([(5,)], 2048),
            r"each request \(input_len, output_len\) must be a pair, got \(5,\)",
        ),
        (lambda: static_reservation([(10, -1)], 2048), r"\(10, -1\)"),
        (lambda: static_reservation([(2000, 100)], 2048), r"\(2000, 100\)"),
        (lambda: static_reservation([(1, 1)], 2048, progress=1.5), "1.5"),
        (lambda: paged_reservation([(1, 1)], block_size=0), "block_size"),
        (lambda: requests_that_fit([(1, 1)], -3, "paged"), "-3"),
        (lambda: requests_that_fit([(1, 1)], 10, "lru"), "lru"),
        (lambda: requests_that_fit([(2000, 100)], 10_000, "static"), r"\(2000, 100\)"),
    ],
)
def test_bad_reservation_arguments_raise(call, word):
    with pytest.raises(InvalidArgumentError, match=word):
        call()

"""Tests for vllmini.kv_cache: writing through slot mappings, sizing, bytes, copy-on-write copies."""

import numpy as np
import pytest
import torch
from attention_cases import make_decode_case, reference_decode
from hypothesis import given
from hypothesis import strategies as st

import vllmini
from vllmini.attention import paged_attention
from vllmini.errors import BlockIdError, InvalidArgumentError, InvalidIndexError, InvalidTypeError
from vllmini.kv_cache import CACHE_DTYPES, PagedKVCache, check_cache_pair, reshape_and_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def nan_pools(num_blocks=5, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32):
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_each_token_to_its_slot(dtype, index_dtype):
    kc, vc = nan_pools(dtype=dtype)
    key, value = torch.randn(6, 2, 8).to(dtype), torch.randn(6, 2, 8).to(dtype)
    slots = [13, 0, -1, 7, 19, -1]
    reshape_and_cache(key, value, kc, vc, torch.tensor(slots, dtype=index_dtype))
    for i, s in enumerate(slots):
        if s >= 0:  # slot -> (block, offset)
            assert torch.equal(kc[s // 4, s % 4], key[i]) and torch.equal(vc[s // 4, s % 4], value[i])
    written = torch.zeros(5, 4, dtype=torch.bool)
    for s in slots:
        if s >= 0:
            written[s // 4, s % 4] = True
    assert kc[~written].isnan().all() and vc[~written].isnan().all()  # -1 and untouched slots unchanged


@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(1, 8),
    data=st.data(),
)
def test_reshape_and_cache_property(block_size, num_blocks, data):
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
    pad = data.draw(st.integers(0, 3))
    mapping = slots + [-1] * pad
    perm = data.draw(st.permutations(range(len(mapping))))
    mapping = [mapping[i] for i in perm]
    kc, vc = nan_pools(num_blocks, block_size, 1, 4)
    key = torch.arange(len(mapping) * 4, dtype=torch.float32).view(-1, 1, 4)
    reshape_and_cache(key, -key, kc, vc, torch.tensor(mapping, dtype=torch.int64))
    flat_k, flat_v = kc.view(num_slots, 4), vc.view(num_slots, 4)
    for i, s in enumerate(mapping):
        if s >= 0:
            assert torch.equal(flat_k[s], key[i, 0]) and torch.equal(flat_v[s], -key[i, 0])
    assert flat_k.isnan().all(1).sum() == num_slots - len(slots)


def test_reshape_and_cache_strided_inputs_and_cache():
    big_k = torch.full((3, 4, 2, 16), float("nan"))
    big_v = torch.full((3, 4, 2, 16), float("nan"))
    kc, vc = big_k[..., ::2], big_v[..., :8]  # non-contiguous caches are written in place
    key = torch.randn(2, 8, 3).permute(2, 0, 1)  # (3, 2, 8), non-contiguous
    value = torch.randn(3, 2, 8)
    reshape_and_cache(key, value, kc, vc, torch.tensor([5, 11, 0]))
    assert torch.equal(big_k[1, 1, :, ::2], key[0]) and torch.equal(big_v[2, 3, :, :8], value[1])
    assert big_k[1, 1, :, 1::2].isnan().all()  # the other half of the underlying storage untouched


def _write(kc, vc, key=None, value=None, slots=None):
    key = torch.randn(3, 2, 8) if key is None else key
    value = torch.randn(3, 2, 8) if value is None else value
    slots = torch.tensor([0, 1, 2]) if slots is None else slots
    reshape_and_cache(key, value, kc, vc, slots)


A, T = InvalidArgumentError, InvalidTypeError  # a ValueError and a TypeError
BAD_WRITES = [
    (dict(slots=torch.tensor([0, 20, 2])), A, r"slot_mapping\[1\] = 20 is out of range"),
    (dict(slots=torch.tensor([0, -2, 2])), A, r"slot_mapping\[1\] = -2 is out of range"),
    (dict(slots=torch.tensor([3, 4, 3])), A, "writes slot 3 more than once"),
    (
        dict(slots=torch.tensor([0.0, 1.0, 2.0])),
        T,
        r"slot_mapping must be one of \[torch.int32, torch.int64\]",
    ),
    (dict(slots=torch.tensor([0, 1])), A, r"slot_mapping must be \[num_tokens\] = \[3\], got shape \(2,\)"),
    (dict(slots=[0, 1, 2]), T, "slot_mapping must be a torch.Tensor"),
    (
        dict(key=torch.randn(3, 2, 4)),
        A,
        r"key must be \[num_tokens, num_kv_heads, head_size\] = \[\*, 2, 8\]",
    ),
    (dict(value=torch.randn(3, 1, 8)), A, r"value must be .* = \[\*, 2, 8\], got shape \(3, 1, 8\)"),
    (dict(value=torch.randn(2, 2, 8)), A, "key and value shapes differ"),
    (dict(key=torch.randn(3, 2, 8).half()), T, "key must be torch.float32, got torch.float16"),
    (dict(key=torch.randn(3, 2, 8).to("meta")), A, "key must be on cpu, got meta"),
    (dict(slots=torch.tensor([0, 1, 2], device="meta")), A, "slot_mapping must be on cpu, got meta"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD_WRITES, ids=[m for _, _, m in BAD_WRITES])
def test_reshape_and_cache_errors_leave_cache_unchanged(kw, exc, msg):
    kc, vc = nan_pools()
    with pytest.raises(exc, match=msg):
        _write(kc, vc, **kw)
    assert kc.isnan().all() and vc.isnan().all()


def test_reshape_and_cache_cache_errors():
    kc, vc = nan_pools()
    with pytest.raises(InvalidArgumentError, match="key_cache must be 4-D"):
        _write(kc[0], vc)
    with pytest.raises(InvalidArgumentError, match="same shape"):
        _write(kc, vc[:2])
    with pytest.raises(InvalidTypeError, match="value_cache is torch.float16"):
        _write(kc, vc.half())
    with pytest.raises(InvalidTypeError, match="floating dtype"):
        _write(kc.long(), vc.long())
    with pytest.raises(InvalidTypeError, match="float8_e4m3fn"):  # a float that attention cannot read
        check_cache_pair(kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn))
    with pytest.raises(InvalidTypeError, match="value_cache must be a torch.Tensor"):
        check_cache_pair(kc, vc.numpy())
    with pytest.raises(InvalidArgumentError, match="value_cache is on meta"):
        check_cache_pair(kc, vc.to("meta"))


# ----------------------------------------------------------------------------- PagedKVCache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_shapes_bytes_and_sizing(dtype):
    per_block = PagedKVCache.bytes_per_block(3, 2, 64, 16, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert per_block == 2 * 3 * 16 * 2 * 64 * itemsize
    cache = PagedKVCache(3, 2, 64, 16, num_blocks=7, dtype=dtype)
    assert len(cache.key_caches) == len(cache.value_caches) == 3
    for t in cache.key_caches + cache.value_caches:
        assert t.shape == (7, 16, 2, 64) and t.dtype == dtype and t.device.type == "cpu"
        assert t.is_contiguous() and not t.any()
    assert cache.nbytes == 7 * per_block == sum(t.nbytes for t in cache.key_caches + cache.value_caches)
    assert (cache.num_blocks, cache.num_slots, cache.dtype) == (7, 112, dtype)
    by_bytes = PagedKVCache(3, 2, 64, 16, memory_bytes=5 * per_block + per_block - 1, dtype=dtype)
    assert by_bytes.num_blocks == 5 and by_bytes.nbytes <= 6 * per_block - 1
    assert "num_blocks=5" in repr(by_bytes)


def test_cache_constructor_errors():
    with pytest.raises(A, match="exactly one of num_blocks, memory_bytes, gpu_memory_utilization"):
        PagedKVCache(1, 1, 8, 4)
    with pytest.raises(A, match="exactly one"):
        PagedKVCache(1, 1, 8, 4, num_blocks=2, memory_bytes=10**6)
    with pytest.raises(A, match="holds no block: one block needs 256 bytes"):
        PagedKVCache(1, 1, 8, 4, memory_bytes=255)
    with pytest.raises(A, match="gpu_memory_utilization needs a CUDA device"):
        PagedKVCache(1, 1, 8, 4, gpu_memory_utilization=0.5)
    with pytest.raises(A, match="num_blocks must be >= 1, got 0"):
        PagedKVCache(1, 1, 8, 4, num_blocks=0)
    with pytest.raises(A, match="head_size must be >= 1, got 0"):
        PagedKVCache(1, 1, 0, 4, num_blocks=2)
    with pytest.raises(A, match="memory_bytes must be >= 0, got -1"):
        PagedKVCache(1, 1, 8, 4, memory_bytes=-1)
    with pytest.raises(T, match=r"gpu_memory_utilization must be a number, got str '0.5'"):
        PagedKVCache(1, 1, 8, 4, gpu_memory_utilization="0.5", device="cuda")
    for bad in (True, 2.0, "2", np.True_):
        with pytest.raises(T, match="num_blocks must be an int"):
            PagedKVCache(1, 1, 8, 4, num_blocks=bad)
        with pytest.raises(T, match="num_layers must be an int"):
            PagedKVCache(bad, 1, 8, 4, num_blocks=2)


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.float8_e4m3fn, torch.complex64, "float16", None], ids=str
)
def test_cache_rejects_dtypes_attention_cannot_read(dtype):
    """float8 is a floating dtype, but paged attention cannot read it: refuse it here, listing the choices."""
    with pytest.raises(
        T, match=r"dtype must be one of \[torch.float32, torch.float16, torch.bfloat16, torch.float64\]"
    ):
        PagedKVCache(1, 1, 8, 4, num_blocks=2, dtype=dtype)


def test_cache_accepts_every_listed_dtype_and_numpy_ints():
    for dtype in CACHE_DTYPES:
        assert PagedKVCache(1, 1, 8, 4, num_blocks=2, dtype=dtype).key_caches[0].dtype == dtype
    cache = PagedKVCache(np.int64(2), np.int32(1), np.int16(8), np.uint8(4), num_blocks=np.int64(3))
    assert (cache.num_layers, cache.num_kv_heads, cache.head_size, cache.block_size) == (2, 1, 8, 4)
    assert all(type(v) is int for v in (cache.num_layers, cache.block_size, cache.num_blocks))
    assert PagedKVCache(1, 1, 8, 4, memory_bytes=np.int64(600)).num_blocks == 2  # 256 bytes a block
    key = torch.arange(16.0).view(2, 1, 8)
    cache.write(np.int64(1), key, -key, torch.tensor([5, 0]))
    assert torch.equal(cache.key_caches[1][1, 1, 0], key[0, 0]) and not cache.key_caches[0].any()
    cache.copy_blocks([(np.int64(1), np.int32(2))])
    assert torch.equal(cache.key_caches[1][2], cache.key_caches[1][1])
    cache.copy_blocks(np.array([[0, 2]]))  # an array of pairs works too
    assert torch.equal(cache.value_caches[1][2], cache.value_caches[1][0])


def test_write_then_paged_attention_reads_it_back():
    """End to end: scatter a sequence's K/V through its slots, read it through its block table."""
    torch.manual_seed(0)
    cache = PagedKVCache(2, 2, 16, 4, num_blocks=8)
    pages = [5, 2, 7]  # non-identity page table for one sequence of 10 tokens
    slots = torch.tensor([pages[t // 4] * 4 + t % 4 for t in range(10)])
    key, value = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    cache.write(1, key, value, slots)
    assert not cache.key_caches[0].any()  # other layer untouched
    q = torch.randn(1, 4, 16)
    out = paged_attention(
        q,
        cache.key_caches[1],
        cache.value_caches[1],
        torch.tensor([pages + [-1]], dtype=torch.int32),
        torch.tensor([10], dtype=torch.int32),
    )
    k, v = key.repeat_interleave(2, 1).transpose(0, 1), value.repeat_interleave(2, 1).transpose(0, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for bad in (2, -1):
        with pytest.raises(InvalidIndexError, match=rf"layer must be in \[0, 2\), got {bad}"):
            cache.write(bad, key, value, slots)
    with pytest.raises(T, match="layer must be an int, got bool"):
        cache.write(True, key, value, slots)


def test_copy_blocks_copies_every_layer_reading_before_writing():
    cache = PagedKVCache(2, 1, 4, 2, num_blocks=4)
    for layer in range(2):
        for b in range(4):
            cache.key_caches[layer][b] = 10 * layer + b
            cache.value_caches[layer][b] = -(10 * layer + b)
    cache.copy_blocks([(0, 1), (1, 2)])  # block 2 gets block 1's OLD contents
    for layer in range(2):
        got = cache.key_caches[layer][:, 0, 0, 0].tolist()
        assert got == [10 * layer + b for b in (0, 0, 1, 3)]
        assert torch.equal(cache.value_caches[layer], -cache.key_caches[layer])
    cache.copy_blocks([])
    before = [t.clone() for t in cache.key_caches]
    for pairs, exc, msg in (
        ([(0, 4)], BlockIdError, r"block id 4 in pair \(0, 4\) is out of range \[0, 4\)"),
        ([(-1, 0)], BlockIdError, "block id -1"),
        ([(0, 3), (1, 3)], A, "destination block appears more than once"),
        ([(0,)], A, r"each \(src_block, dst_block\) must be a pair, got \(0,\)"),
        ([5], A, "must be a pair, got 5"),
        ([(0.0, 1)], T, "src_block must be an int, got float 0.0"),
        ([(0, True)], T, "dst_block must be an int, got bool"),
    ):
        with pytest.raises(exc, match=msg):
            cache.copy_blocks(pairs)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.key_caches, strict=True))


def test_copy_on_write_keeps_the_forked_sequence_correct():
    """After copying a shared last block, the copy serves the child exactly as the original did."""
    case = make_decode_case(0, 1, 4, 2, 64, 8, (13,))
    cache = PagedKVCache(1, 2, 64, 8, num_blocks=case["num_blocks"])
    cache.key_caches[0].copy_(case["key_cache"])
    cache.value_caches[0].copy_(case["value_cache"])
    last = int(case["block_tables"][0, 1])
    free = next(b for b in range(cache.num_blocks) if b not in case["block_tables"][0, :2].tolist())
    cache.copy_blocks([(last, free)])
    child = case["block_tables"].clone()
    child[0, 1] = free
    out = paged_attention(case["query"], cache.key_caches[0], cache.value_caches[0], child, case["seq_lens"])
    torch.testing.assert_close(out.double(), reference_decode(case), rtol=1e-5, atol=1e-5)


def test_exported_from_package():
    assert vllmini.PagedKVCache is PagedKVCache and vllmini.reshape_and_cache is reshape_and_cache


@pytest.mark.gpu
def test_cuda_cache_sized_by_free_memory():
    free, _ = torch.cuda.mem_get_info()
    per_block = PagedKVCache.bytes_per_block(2, 8, 128, 16, torch.float16)
    cache = PagedKVCache(2, 8, 128, 16, gpu_memory_utilization=0.01, dtype=torch.float16, device="cuda")
    assert cache.key_caches[0].is_cuda and cache.nbytes <= 0.01 * free
    assert cache.num_blocks >= 0.9 * 0.01 * free / per_block  # free memory moves a little
    key = torch.randn(3, 8, 128, device="cuda", dtype=torch.float16)
    cache.write(0, key, key, torch.tensor([0, -1, 17], device="cuda", dtype=torch.int32))
    assert torch.equal(cache.key_caches[0][1, 1], key[2])
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        PagedKVCache(1, 1, 8, 4, gpu_memory_utilization=1.5, device="cuda")


def test_check_slot_mapping_and_the_unchecked_write():
    from vllmini.kv_cache import check_slot_mapping

    assert check_slot_mapping(torch.tensor([3, -1, 5]), 8) is True
    assert check_slot_mapping(torch.tensor([3, 4, 5], dtype=torch.int32), 8) is False
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = -1 .*expected a slot"):
        check_slot_mapping(torch.tensor([3, -1]), 8, allow_padding=False)
    with pytest.raises(ValueError, match="slot 4 more than once"):
        check_slot_mapping(torch.tensor([4, 1, 4]), 8)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 8"):
        check_slot_mapping(torch.tensor([8]), 8)
    kc, vc = torch.full((2, 4, 1, 2), float("nan")), torch.full((2, 4, 1, 2), float("nan"))
    k, v = torch.randn(3, 1, 2), torch.randn(3, 1, 2)
    slots = torch.tensor([6, 0, 3])
    reshape_and_cache(k, v, kc, vc, slots, validate=False)
    torch.testing.assert_close(kc.view(8, 1, 2)[slots], k)
    torch.testing.assert_close(vc.view(8, 1, 2)[slots], v)
    assert torch.isnan(kc.view(8, 1, 2)[[1, 2, 4, 5, 7]]).all()  # nothing else written


def test_padding_rows_are_not_written_without_a_sync():
    """padding=True (a CUDA graph's batch): -1 rows rewrite row 0's slot with row 0's bytes, nothing else."""
    kc, vc = torch.full((3, 4, 2, 8), float("nan")), torch.full((3, 4, 2, 8), float("nan"))
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([9, 2, -1, 4, -1])
    reshape_and_cache(k, v, kc, vc, slots, validate=False, padding=True)
    real = slots >= 0
    torch.testing.assert_close(kc.view(12, 2, 8)[slots[real]], k[real], rtol=0, atol=0)
    torch.testing.assert_close(vc.view(12, 2, 8)[slots[real]], v[real], rtol=0, atol=0)
    untouched = [s for s in range(12) if s not in (9, 2, 4)]
    assert torch.isnan(kc.view(12, 2, 8)[untouched]).all() and torch.isnan(vc.view(12, 2, 8)[untouched]).all()

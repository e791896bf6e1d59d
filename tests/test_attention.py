"""Tests for vllmini.attention: the torch backend against a float64 token-by-token reference,
prefill against scaled_dot_product_attention, validation, and the backend dispatch contract."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attention_cases import (
    DECODE_GRID,
    DECODE_GRID_SMALL,
    assert_close,
    case_id,
    gather_kv,
    make_decode_case,
    make_prefill_case,
    reference_decode,
    reference_prefill,
)
from hypothesis import given
from hypothesis import strategies as st

import vllmini
from vllmini import cuda_kernels
from vllmini.attention import (
    BACKENDS,
    cupy_usable,
    paged_attention,
    paged_prefill_attention,
    resolve_backend,
    validate_decode_args,
)
from vllmini.errors import InvalidBlockTableError

DECODE_KEYS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")


def decode(case, backend="torch", **kw):
    return paged_attention(*(case[k] for k in DECODE_KEYS), case["scale"], backend=backend, **kw)


def prefill(case, backend="torch"):
    args = [case[k] for k in DECODE_KEYS] + [case["query_start_loc"]]
    return paged_prefill_attention(*args, case["scale"], backend=backend)


@pytest.fixture(params=["view", "copy"])
def host_path(request, monkeypatch):
    """Run the table checks both ways: CPU tensors viewed in place, and the one device->host copy that
    CUDA tensors take (`_host_copy`, exercised here on the CPU)."""
    import vllmini.attention as attention

    if request.param == "copy":
        monkeypatch.setattr(attention, "_host_view", attention._host_copy)
    return request.param


# ----------------------------------------------------------------------------- decode correctness


@pytest.mark.parametrize("params", DECODE_GRID, ids=case_id)
def test_decode_fp32_matches_reference(params):
    case = make_decode_case(1, *params, dtype=torch.float32)
    out = decode(case)
    assert out.shape == case["query"].shape and out.dtype == torch.float32
    assert_close(out, reference_decode(case))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("params", DECODE_GRID_SMALL, ids=case_id)
def test_decode_other_dtypes_match_reference(params, dtype):
    case = make_decode_case(2, *params, dtype=dtype)
    out = decode(case)
    assert out.dtype == dtype
    assert_close(out, reference_decode(case))


def test_the_test_can_fail():
    """The reference and the tolerance catch a plain bug: the wrong kv head for GQA."""
    case = make_decode_case(3, 3, 8, 2, 64, 8, (5, 9, 17))
    ref = reference_decode(case)
    wrong = case["key_cache"].flip(2)  # swap kv heads
    out = paged_attention(case["query"], wrong, case["value_cache"], case["block_tables"], case["seq_lens"])
    with pytest.raises(AssertionError):
        assert_close(out, ref)


def test_gqa_head_mapping():
    """Query head h reads kv head h // (num_heads // num_kv_heads): make V of kv head j equal j."""
    num_heads, num_kv_heads = 12, 3
    case = make_decode_case(4, 2, num_heads, num_kv_heads, 64, 4, (3, 10))
    vc = torch.arange(num_kv_heads, dtype=torch.float32)[None, None, :, None].expand_as(case["value_cache"])
    out = paged_attention(
        case["query"], case["key_cache"], vc.clone(), case["block_tables"], case["seq_lens"]
    )
    want = (torch.arange(num_heads) // (num_heads // num_kv_heads)).float()
    torch.testing.assert_close(out[..., 0], want.expand(2, -1))


def test_scale_default_and_custom():
    case = make_decode_case(5, 2, 4, 4, 64, 8, (3, 20))
    default = paged_attention(*(case[k] for k in DECODE_KEYS))
    torch.testing.assert_close(default, decode(case), rtol=0, atol=0)  # case["scale"] = 64 ** -0.5
    case["scale"] = 0.37
    assert_close(decode(case), reference_decode(case))
    case["scale"] = 0.0  # uniform weights: the mean of the values
    _, v = gather_kv(case, 1)
    torch.testing.assert_close(decode(case)[1].double(), v.mean(0), rtol=1e-6, atol=1e-6)
    case["scale"] = 0.37
    want = decode(case)
    case["scale"] = np.float32(0.37)  # numpy scalars are numbers too (float32(0.37) != 0.37 exactly)
    torch.testing.assert_close(decode(case), want, rtol=1e-6, atol=1e-6)


def test_padding_entries_are_ignored_whatever_they_hold(host_path):
    case = make_decode_case(6, 3, 4, 2, 64, 8, (5, 16, 17))
    base = decode(case)
    bt = case["block_tables"]
    for junk in (-1, 2**31 - 1, -(2**31), 0):
        tables = bt.clone()
        for s, n in enumerate(case["seq_lens"].tolist()):
            tables[s, -(-n // 8) :] = junk
        case["block_tables"] = tables
        assert torch.equal(decode(case), base)


def test_unused_slots_never_leak_even_as_inf():
    case = make_decode_case(7, 2, 4, 4, 64, 8, (3, 12))
    ref = reference_decode(case)
    for cache in (case["key_cache"], case["value_cache"]):
        cache[cache.isnan()] = float("inf")
    assert_close(decode(case), ref)


def test_strided_and_transposed_inputs(host_path):
    params = DECODE_GRID_SMALL[1]
    case = make_decode_case(8, *params)
    ref = reference_decode(case)
    q, kc, vc, bt, sl = (case[k] for k in DECODE_KEYS)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # [S, H, D] with swapped strides
    kc_wide = torch.cat([kc, torch.full_like(kc, float("nan"))], dim=-1)  # sliced last dim
    vc_t = vc.transpose(1, 2).contiguous().transpose(1, 2)
    bt_wide = torch.stack([bt, torch.full_like(bt, -7)], dim=-1)[..., 0]  # every other element
    sl_strided = torch.stack([sl, sl * 100], dim=1)[:, 0]
    for t in (q_t, kc_wide[..., : kc.shape[-1]], vc_t, bt_wide, sl_strided):
        assert not t.is_contiguous()
    out = paged_attention(q_t, kc_wide[..., : kc.shape[-1]], vc_t, bt_wide, sl_strided, case["scale"])
    assert_close(out, ref)
    a = validate_decode_args(q_t, kc_wide[..., : kc.shape[-1]], vc_t, bt_wide, sl_strided)
    assert all(t.is_contiguous() for t in a[:5])


def test_int64_indices_give_the_same_answer(host_path):
    case = make_decode_case(9, 3, 4, 2, 80, 16, (1, 16, 33))
    base = decode(case)
    case["block_tables"] = case["block_tables"].long()
    case["seq_lens"] = case["seq_lens"].long()
    assert torch.equal(decode(case), base)
    a = validate_decode_args(*(case[k] for k in DECODE_KEYS))
    assert a.block_tables.dtype == torch.int32 and a.seq_lens.dtype == torch.int32
    assert a.max_seq_len == 33 and a.scale == 80**-0.5
    case["block_tables"][0, 1:] = 2**40  # int64 garbage in padding: still ignored
    assert torch.equal(decode(case), base)
    case["seq_lens"] = case["seq_lens"].int()  # int64 table with int32 lengths
    assert torch.equal(decode(case), base)


def test_equal_lengths_with_a_partly_filled_last_page():
    """Every sequence 7 tokens in 4-token pages: no padding to mask, but slot 3 of each last page is NaN."""
    case = make_decode_case(22, 3, 8, 2, 64, 4, (7, 7, 7))
    assert_close(decode(case), reference_decode(case))


def test_empty_batch():
    case = make_decode_case(10, 1, 4, 2, 64, 8, (5,))
    out = paged_attention(
        case["query"][:0],
        case["key_cache"],
        case["value_cache"],
        case["block_tables"][:0],
        case["seq_lens"][:0],
    )
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("backend", ["torch", "emulator"])
def test_empty_tables_from_the_block_manager(backend):
    """build_block_tables([]) gives (0, 0) tables: an empty output, not an error (issue 15, item 13)."""
    bm = vllmini.BlockManager(num_blocks=4, block_size=8)
    tables, lens = bm.build_block_tables([])
    assert tables.shape == (0, 0)
    kc = torch.zeros(4, 8, 2, 64)
    out = paged_attention(torch.zeros(0, 4, 64), kc, kc.clone(), tables, lens, backend=backend)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("backend", ["torch", "emulator"])
def test_all_scores_minus_inf_give_zero_rows(backend):
    """When every score of a sequence is -inf the softmax is 0/0; vllmini's choice is a zero row (attend
    to nothing, as SDPA does for fully masked rows): the torch backend, the kernel (version 9, the
    default) and the float64 reference agree (issue 15, item 8). Versions 2-5 give NaN there."""
    case = make_decode_case(11, 1, 2, 2, 64, 8, (13,))
    for t in range(13):  # k[0] = +inf, q[0] = -1: every score -inf for both heads
        page = int(case["block_tables"][0, t // 8])
        case["key_cache"][page, t % 8, :, 0] = float("inf")
    case["query"][0, :, 0] = -1.0
    ref = reference_decode(case)
    assert torch.equal(ref, torch.zeros_like(ref))
    assert torch.equal(decode(case, backend), torch.zeros_like(case["query"]))
    if backend == "emulator":  # and with the context split in two pieces, merged
        out = torch.empty_like(case["query"])
        args = [case[k] for k in DECODE_KEYS]
        cuda_kernels.paged_attention_kernel(*args, case["scale"], out, "emulator", num_splits=2)
        assert torch.equal(out, torch.zeros_like(out))


def test_single_token_prefill_equals_decode():
    case = make_decode_case(11, 4, 8, 2, 64, 8, (1, 7, 8, 9))
    case["query_start_loc"] = torch.arange(5, dtype=torch.int32)
    torch.testing.assert_close(prefill(case), decode(case), rtol=1e-6, atol=1e-6)


@given(
    seed=st.integers(0, 2**16),
    layout=st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3)]),
    head_size=st.sampled_from([8, 16, 64]),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    seq_lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
)
def test_decode_property(seed, layout, head_size, block_size, seq_lens):
    case = make_decode_case(seed, len(seq_lens), *layout, head_size, block_size, seq_lens)
    assert_close(decode(case), reference_decode(case))


# ----------------------------------------------------------------------------- prefill correctness

PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_size, block_size, seq_lens, query_lens)
    (4, 4, 64, 8, (9,), (9,)),  # whole prompt
    (4, 2, 80, 16, (20, 33, 1), (20, 33, 1)),  # several whole prompts, GQA
    (4, 1, 64, 8, (17, 24), (5, 8)),  # chunks that start mid-sequence, MQA
    (2, 2, 128, 1, (6, 3), (1, 2)),  # block_size 1
    (8, 2, 96, 32, (64, 40, 5), (31, 1, 5)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("params", PREFILL_CASES, ids=str)
def test_prefill_matches_reference(params, dtype):
    case = make_prefill_case(12, *params, dtype=dtype)
    out = prefill(case)
    assert out.shape == case["query"].shape and out.dtype == dtype
    assert_close(out, reference_prefill(case))


@pytest.mark.parametrize("params", PREFILL_CASES, ids=str)
def test_prefill_matches_sdpa_on_contiguous_data(params):
    """Lay each sequence out contiguously, then ask SDPA with an explicit causal mask (bottom-right)."""
    num_heads, num_kv_heads = params[0], params[1]
    case = make_prefill_case(13, *params, dtype=torch.float32)
    out = prefill(case)
    starts = case["query_start_loc"].tolist()
    for s, seq_len in enumerate(case["seq_lens"].tolist()):
        k, v = gather_kv(case, s)  # (L, kvh, hs) contiguous, float64
        q = case["query"][starts[s] : starts[s + 1]].double()  # (n, H, hs)
        n = q.shape[0]
        rep = num_heads // num_kv_heads
        k, v = k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
        pos = torch.arange(seq_len - n, seq_len)
        mask = torch.arange(seq_len)[None, :] <= pos[:, None]  # (n, L): True = may attend
        want = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=case["scale"])
        assert_close(out[starts[s] : starts[s + 1]], want.transpose(0, 1))


def test_prefill_strided_inputs():
    case = make_prefill_case(20, 4, 2, 64, 8, (17, 9), (5, 9))
    ref = reference_prefill(case)
    q = case["query"].transpose(0, 1).contiguous().transpose(0, 1)
    kc = torch.cat([case["key_cache"], case["key_cache"]], dim=-1)[..., :64]
    qsl = torch.stack([case["query_start_loc"], case["query_start_loc"]], 1)[:, 0]
    assert not (q.is_contiguous() or kc.is_contiguous() or qsl.is_contiguous())
    args = (q, kc, case["value_cache"], case["block_tables"], case["seq_lens"], qsl)
    assert_close(paged_prefill_attention(*args), ref)


@given(
    seed=st.integers(0, 2**16),
    layout=st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3)]),
    block_size=st.sampled_from([1, 4, 16]),
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 39)), min_size=1, max_size=5),
)
def test_prefill_property_ragged_chunks_gqa(seed, layout, block_size, lens):
    """The one-call batched prefill against float64, token by token: ragged lengths, GQA/MQA, and
    chunks that start at any position k > 0 (query rows are the last n of seq_len)."""
    seq_lens = [s for s, _ in lens]
    query_lens = [s - min(k, s - 1) for s, k in lens]  # k tokens already cached, the rest new
    case = make_prefill_case(seed, *layout, 16, block_size, seq_lens, query_lens)
    assert_close(prefill(case), reference_prefill(case))


def test_chunked_prefill_equals_whole_prefill():
    """Prefilling a prompt in chunks gives the same outputs as in one go."""
    whole = make_prefill_case(14, 4, 2, 64, 8, (23,), (23,))
    full = prefill(whole)
    pieces = []
    for lo, hi in ((0, 7), (7, 16), (16, 23)):
        chunk = dict(whole, query=whole["query"][lo:hi], seq_lens=torch.tensor([hi], dtype=torch.int32))
        chunk["query_start_loc"] = torch.tensor([0, hi - lo], dtype=torch.int32)
        pieces.append(prefill(chunk))
    torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- validation


def good_case():
    return make_decode_case(15, 2, 4, 2, 64, 8, (5, 12))


def bad(**overrides):
    case = good_case()
    case.update(overrides)
    return case


def _call(case):
    return paged_attention(*(case[k] for k in DECODE_KEYS), case.get("scale"), backend="torch")


C = good_case()
BAD_DECODE = [
    # (case overrides, exception, message fragment)
    ({"query": C["query"].numpy()}, TypeError, "query must be a torch.Tensor"),
    ({"query": C["query"][0]}, ValueError, "query must be 3-D"),
    ({"query": C["query"].double()}, TypeError, "query is torch.float64 but the caches are torch.float32"),
    ({"query": C["query"][..., :32]}, ValueError, "head_size 32 != cache head_size 64"),
    ({"query": C["query"][:, :3]}, ValueError, "(3) must be a positive multiple of num_kv_heads (2)"),
    ({"key_cache": C["key_cache"][0]}, ValueError, "key_cache must be 4-D"),
    ({"value_cache": C["value_cache"][:3]}, ValueError, "same shape"),
    ({"value_cache": C["value_cache"].half()}, TypeError, "value_cache is torch.float16"),
    ({"key_cache": C["key_cache"].long(), "value_cache": C["value_cache"].long()}, TypeError, "floating"),
    ({"block_tables": C["block_tables"].float()}, TypeError, "block_tables must be int32"),
    ({"block_tables": C["block_tables"][0]}, ValueError, "block_tables must be 2-D"),
    ({"block_tables": C["block_tables"][:1]}, ValueError, "block_tables must be [num_seqs=2"),
    ({"block_tables": C["block_tables"][:, :0]}, ValueError, "max_num_blocks_per_seq>=1"),
    ({"block_tables": C["block_tables"].tolist()}, TypeError, "block_tables must be a torch.Tensor"),
    ({"seq_lens": C["seq_lens"].float()}, TypeError, "seq_lens must be int32"),
    ({"seq_lens": C["seq_lens"][:1]}, ValueError, "seq_lens must be [num_seqs=2]"),
    ({"seq_lens": C["seq_lens"][None]}, ValueError, "seq_lens must be 1-D"),
    ({"seq_lens": torch.tensor([5, 0], dtype=torch.int32)}, ValueError, "seq_lens[1] = 0 is out of range"),
    ({"seq_lens": torch.tensor([-3, 5], dtype=torch.int32)}, ValueError, "seq_lens[0] = -3"),
    ({"seq_lens": torch.tensor([5, 25], dtype=torch.int32)}, ValueError, "3 * 8 = 24"),
    ({"scale": float("nan")}, ValueError, "scale must be finite"),
    ({"scale": "0.1"}, TypeError, "scale must be a number"),
]


@pytest.mark.parametrize("overrides,exc,msg", BAD_DECODE, ids=[m for _, _, m in BAD_DECODE])
def test_decode_validation_errors(overrides, exc, msg, host_path):
    with pytest.raises(exc) as info:
        _call(bad(**overrides))
    assert msg in str(info.value)


@pytest.mark.parametrize("page", [-1, 6, 10**6])
def test_out_of_range_page_in_use_is_rejected(page, host_path):
    case = good_case()
    assert case["num_blocks"] == 6
    case["block_tables"][1, 1] = page  # sequence 1 (length 12) reads blocks 0 and 1
    with pytest.raises(ValueError, match=rf"block_tables\[1, 1\] = {page} is not a block id in \[0, 6\)"):
        _call(case)


def test_devices_must_agree():
    case = good_case()
    case["seq_lens"] = case["seq_lens"].to("meta")
    with pytest.raises(ValueError, match="seq_lens is on meta but the caches are on cpu"):
        _call(case)
    case = good_case()
    case["query"] = case["query"].to("meta")
    with pytest.raises(ValueError, match="query is on meta"):
        _call(case)


def test_prefill_validation_errors(host_path):
    case = make_prefill_case(16, 4, 2, 64, 8, (9, 12), (3, 12))
    qsl = case["query_start_loc"]

    def call(**kw):
        c = dict(case, **kw)
        return prefill(c)

    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        call(query_start_loc=qsl.float())
    with pytest.raises(ValueError, match=r"query_start_loc must be \[num_seqs \+ 1\] = \[3\]"):
        call(query_start_loc=qsl[:2])
    with pytest.raises(ValueError, match="must start at 0 and end at num_tokens=15"):
        call(query_start_loc=torch.tensor([1, 3, 15], dtype=torch.int32))
    with pytest.raises(ValueError, match="must start at 0 and end at num_tokens=15"):
        call(query_start_loc=torch.tensor([0, 3, 14], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sequence 0 has 10 query .* seq_lens\[0\] = 9"):
        call(query_start_loc=torch.tensor([0, 10, 15], dtype=torch.int32))
    with pytest.raises(ValueError, match="sequence 0 has 0 query tokens"):
        call(query=case["query"][:12], query_start_loc=torch.tensor([0, 0, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=torch.tensor([9, 25], dtype=torch.int32))
    with pytest.raises(ValueError, match="paged_prefill_attention supports backend 'torch'"):
        prefill(case, backend="cupy")
    with pytest.raises(ValueError, match="backend must be one of"):
        prefill(case, backend="cuda")
    assert call(query_start_loc=qsl.long()).shape == (15, 4, 64)


# ----------------------------------------------------------------------------- dispatch


def test_backend_names_and_resolution():
    assert BACKENDS == ("auto", "torch", "cupy", "emulator")
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        decode(good_case(), backend="triton")
    with pytest.raises(ValueError, match="backend 'cupy' needs CUDA tensors"):
        decode(good_case(), backend="cupy")
    with pytest.raises(ValueError, match="emulator' runs on the CPU"):
        resolve_backend("emulator", torch.device("cuda"))


def test_auto_prefers_the_kernel_only_where_it_applies(monkeypatch):
    import vllmini.attention as attention

    monkeypatch.setattr(attention, "cupy_usable", lambda: True)
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, torch.float32) == "cupy"
    assert resolve_backend("auto", cuda, torch.float16) == "cupy"
    assert resolve_backend("auto", cuda, torch.bfloat16) == "cupy"
    assert resolve_backend("auto", cuda, torch.float64) == "torch"  # no float64 kernel
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"  # never the emulator
    monkeypatch.setattr(attention, "cupy_usable", lambda: False)
    assert resolve_backend("auto", cuda, torch.float32) == "torch"


def test_validation_happens_before_any_backend(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("kernel called with invalid input")

    monkeypatch.setattr(cuda_kernels, "launch_paged_attention", refuse)
    case = bad(seq_lens=torch.tensor([5, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_lens"):
        decode(case, backend="emulator")


def test_kernel_backends_get_normalized_inputs_and_preallocated_out(monkeypatch):
    """The contract with vllmini.cuda_kernels.launch_paged_attention."""
    seen = {}

    def fake_kernel(inputs, scale, out, runtime, version, error, num_splits, source, max_seq_len):
        query, key_cache, value_cache, block_tables, seq_lens = inputs
        seen.update(locals())
        return out.copy_(
            paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, backend="torch")
        )  # the launcher fills and returns out

    monkeypatch.setattr(cuda_kernels, "launch_paged_attention", fake_kernel)
    case = make_decode_case(17, 3, 4, 2, 64, 8, (1, 8, 9))
    case["block_tables"] = case["block_tables"].long()
    q = case["query"].transpose(0, 1).contiguous().transpose(0, 1)
    out = paged_attention(q, *(case[k] for k in DECODE_KEYS[1:]), backend="emulator")
    assert seen["runtime"] == "emulator" and seen["out"] is out
    assert seen["block_tables"].dtype == torch.int32 and seen["seq_lens"].dtype == torch.int32
    assert all(seen[k].is_contiguous() for k in (*DECODE_KEYS, "out"))
    assert seen["scale"] == 64**-0.5
    assert seen["version"].name == "guard" and seen["error"] is None  # CPU: host check, no guard (not used)
    assert_close(out, reference_decode(case))


def test_exported_from_package():
    assert vllmini.paged_attention is paged_attention
    assert vllmini.paged_prefill_attention is paged_prefill_attention


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("params", DECODE_GRID[::3], ids=case_id)
def test_decode_torch_backend_on_cuda(params, dtype):
    case = make_decode_case(18, *params, dtype=dtype, device="cuda")
    assert_close(decode(case, backend="torch"), reference_decode(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_decode_torch_backend_long_ragged_batch_on_cuda(dtype):
    """Long and short sequences together: masked SDPA over thousands of positions, NaN tails."""
    case = make_decode_case(36, 4, 8, 2, 128, 16, (3000, 1, 777, 2049), dtype=dtype, device="cuda")
    assert_close(decode(case, backend="torch"), reference_decode(case))


def _to_cuda(case: dict) -> dict:
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("overrides,exc,msg", BAD_DECODE, ids=[m for _, _, m in BAD_DECODE])
def test_decode_validation_errors_on_cuda(overrides, exc, msg):
    """CUDA tables take the one-copy path: the same errors, word for word."""
    with pytest.raises(exc) as info:
        _call(_to_cuda(bad(**overrides)))
    assert msg in str(info.value)


@pytest.mark.gpu
def test_out_of_range_pages_and_prefill_errors_on_cuda():
    case = good_case()
    case["block_tables"] = case["block_tables"].long()
    case["block_tables"][1, 1] = 2**40
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 1099511627776 is not a block id"):
        _call(_to_cuda(case))  # the torch backend: host check
    if cupy_usable():  # the kernel's default on CUDA: the guard, the id clamped to int32 (still out of range)
        out = decode(_to_cuda(case), "cupy")
        assert out[1].isnan().all()
        with pytest.raises(
            InvalidBlockTableError, match=r"block_tables\[1, 1\] = 2147483647 is not a block id"
        ):
            cuda_kernels.check_kernel_errors()
    case = make_prefill_case(16, 4, 2, 64, 8, (9, 12), (3, 12), device="cuda")
    case["query_start_loc"] = torch.tensor([0, 10, 15], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"sequence 0 has 10 query .* seq_lens\[0\] = 9"):
        prefill(case)


@pytest.mark.gpu
def test_prefill_on_cuda():
    case = make_prefill_case(19, 8, 2, 128, 16, (40, 17), (9, 17), device="cuda")
    assert_close(prefill(case), reference_prefill(case))


@pytest.mark.gpu
def test_auto_backend_on_cuda_matches_reference():
    for dtype in (torch.float32, torch.float16):
        case = make_decode_case(21, *DECODE_GRID_SMALL[1], dtype=dtype, device="cuda")
        assert_close(decode(case, backend="auto"), reference_decode(case))


# ----------------------------------------------------------------------------- validate once, run many


def test_check_block_tables_then_validate_false_gives_the_same_answer():
    from vllmini.attention import check_block_tables

    case = make_decode_case(41, 3, 4, 2, 64, 8, (1, 17, 40))  # ragged, NaN-poisoned padding
    kc, bt, sl = case["key_cache"], case["block_tables"], case["seq_lens"]
    assert check_block_tables(bt, sl, kc.shape[0], kc.shape[1]) == 40
    args = (case["query"], kc, case["value_cache"], bt, sl)
    checked = paged_attention(*args, backend="torch")
    unchecked = paged_attention(*args, backend="torch", validate=False)
    assert torch.isfinite(unchecked).all()
    torch.testing.assert_close(unchecked, checked, rtol=1e-6, atol=1e-6)
    bad = bt.clone()
    bad[1, 0] = kc.shape[0]  # sequence 1 reads block 0 of its row: out of range
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\]"):
        check_block_tables(bad, sl, kc.shape[0], kc.shape[1])
    with pytest.raises(ValueError, match="seq_lens"):
        check_block_tables(bt, sl.flip(0)[:2], kc.shape[0], kc.shape[1])

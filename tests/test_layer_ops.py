"""kernels/layer_ops.cu (the fused add + RMSNorm, RoPE + cache write, SiLU * up) against the model's
PyTorch code and float64: through the emulator on the CPU (CI; bounds and race checks on), and through
CuPy on a GPU. A whole model with the fused kernels gives the logits of the PyTorch path."""

import numpy as np
import pytest
import torch
from llama_cases import random_hf_model

from vllmini.attention import AttentionMetadata
from vllmini.cuda_kernels import DTYPE_SUFFIX, LAYER_OP_THREADS, launch_layer_op, read_kernel_source
from vllmini.emulator import OutOfBoundsError, RawKernel
from vllmini.kv_cache import FLOAT_DTYPES, PagedKVCache, reshape_and_cache
from vllmini.model import LlamaConfig, LlamaModel, RMSNorm, apply_rotary, rope_cos_sin

SOURCE = read_kernel_source("layer_ops")
HEADS, KV_HEADS, HEAD, BLOCK, BLOCKS = 4, 2, 16, 4, 6  # a GQA layer: q 64 wide, k and v 32 each
GRID = (5, HEADS + 2 * KV_HEADS)  # rope_and_cache: a block per (token, head)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def launch(name, grid, tensors, ints=(), floats=()):
    """One launch: the emulator with its bounds and race checks on (CPU tensors), else the package's CuPy
    launch (`launch_layer_op`, as the model calls it)."""
    like = tensors[0]
    if like.device.type == "cpu":
        sixteen = (torch.float16, torch.bfloat16)  # passed as their bits, as the kernel reads them
        bits = [0 if t is None else t.view(torch.uint16) if t.dtype in sixteen else t for t in tensors]
        args = (*bits, *map(np.int32, ints), *map(np.float32, floats))
        RawKernel(SOURCE, name + DTYPE_SUFFIX[like.dtype], racecheck=True)(grid, (LAYER_OP_THREADS,), args)
    else:
        launch_layer_op(name, like, grid, tensors, ints, floats)
        torch.cuda.synchronize()


def close(got, want, dtype):
    """Within a rounding step or two of `want` (the PyTorch path sums and rounds in another order)."""
    step = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=2 * step, rtol=2 * step)


def exact_close(got, exact, dtype):
    """Within the dtype's rounding of the float64 answer."""
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), exact, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [296, 2056])  # 16-byte chunks: part of the threads busy; some take two
def test_add_rms_norm(device, dtype, with_residual, hidden):
    g = torch.Generator().manual_seed(0)
    x, residual, weight = (
        torch.randn(s, generator=g).to(dtype).to(device) for s in ((3, hidden), (3, hidden), (hidden,))
    )
    norm = RMSNorm(hidden, 1e-5).to(dtype).to(device)
    norm.weight.data = weight
    want = norm(x, residual.clone() if with_residual else None)  # the PyTorch path
    r = residual.clone() if with_residual else None
    out = torch.empty_like(x)
    launch("add_rms_norm", (3,), (out, r, x, weight), (hidden,), (1e-5,))
    close(out, want[0], dtype)
    if with_residual:
        assert torch.equal(r, want[1])  # the rounded sum, written over the residual
    s = (x.double() + residual.double()) if with_residual else x.double()
    exact_close(out, weight.double() * s / s.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt(), dtype)
    fused = norm(x, residual.clone() if with_residual else None, fused=True)  # RMSNorm's own launch
    assert torch.equal(fused[0], out)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_takes_the_pytorch_path_where_its_chunks_do_not_fit(device):
    """A row that does not start on a 16-byte boundary, or a model whose hidden size is not a multiple of
    8, runs the PyTorch path: the kernel is never handed a misaligned row."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3 * 64 + 1, generator=g).to(device)
    x = base[1:].view(3, 64)  # 4 bytes past an aligned start
    norm = RMSNorm(64, 1e-5).to(device)
    assert x.data_ptr() % 16 and torch.equal(norm(x, fused=True)[0], norm(x)[0])
    shape = dict(vocab_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert LlamaModel(LlamaConfig(hidden_size=64, **shape)).fits_layer_ops
    assert not LlamaModel(LlamaConfig(hidden_size=68, **shape)).fits_layer_ops


def rope_case(device, dtype):
    """qkv of 5 tokens, one of them padding (slot -1), and empty caches filled with a marker."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * HEAD, generator=g).to(dtype).to(device)
    positions = torch.tensor([0, 7, 3, 31, 2], device=device)
    slots = torch.tensor([5, 0, 17, -1, 23], device=device)
    kc, vc = (torch.full((BLOCKS, BLOCK, KV_HEADS, HEAD), 9.0, dtype=dtype, device=device) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD)
    cos, sin = (
        t[:, 0] for t in rope_cos_sin(torch.arange(32, device=device), inv_freq.float().to(device), dtype)
    )
    return qkv, positions, slots, kc, vc, cos, sin


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_and_cache(device, dtype):
    qkv, positions, slots, kc, vc, cos, sin = rope_case(device, dtype)
    q = torch.empty(5, HEADS, HEAD, dtype=dtype, device=device)
    ints = (HEADS, KV_HEADS, HEAD, 32, BLOCKS * BLOCK)
    launch("rope_and_cache", GRID, (q, kc, vc, qkv, cos, sin, positions, slots), ints)
    # the PyTorch path: rotate, then write the non-padding rows
    qk = apply_rotary(
        qkv[:, : (HEADS + KV_HEADS) * HEAD].view(5, -1, HEAD), cos[positions, None], sin[positions, None]
    )
    v = qkv[:, (HEADS + KV_HEADS) * HEAD :].view(5, KV_HEADS, HEAD)
    kc_want, vc_want = (torch.full_like(kc, 9.0) for _ in range(2))
    reshape_and_cache(qk[:, HEADS:], v, kc_want, vc_want, slots)  # skips the -1 row
    close(q, qk[:, :HEADS], dtype)
    close(kc, kc_want, dtype)
    assert torch.equal(vc, vc_want)  # a copy, bit for bit
    # float64: each pair (x1, x2) rotated by pos * inv_freq
    x = qkv[:, : HEADS * HEAD].double().view(5, HEADS, 2, HEAD // 2)
    angle = positions.double()[:, None, None] * (
        1.0 / 10000 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD)
    ).to(device)
    c, s = angle.cos(), angle.sin()
    exact_close(q, torch.cat((x[:, :, 0] * c - x[:, :, 1] * s, x[:, :, 1] * c + x[:, :, 0] * s), -1), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_and_cache_never_reads_or_writes_out_of_range(device):
    """A position past the table gives NaN q and k (never a read past it); a slot past the cache is not
    written; on the CPU the emulator's bounds check would name any access outside the tensors."""
    qkv, positions, slots, kc, vc, cos, sin = rope_case(device, torch.float32)
    positions[1], slots[2] = 32, BLOCKS * BLOCK  # one past the table, one past the cache
    q = torch.empty(5, HEADS, HEAD, device=device)
    ints = (HEADS, KV_HEADS, HEAD, 32, BLOCKS * BLOCK)
    launch("rope_and_cache", GRID, (q, kc, vc, qkv, cos, sin, positions, slots), ints)
    assert q[1].isnan().all() and not q[[0, 2, 3, 4]].isnan().any()
    assert kc.view(-1, KV_HEADS, HEAD)[0].isnan().all()  # token 1's slot 0: its k is NaN, its v copied
    assert torch.equal(
        vc.view(-1, KV_HEADS, HEAD)[0], qkv[1, (HEADS + KV_HEADS) * HEAD :].view(KV_HEADS, HEAD)
    )
    written = {5, 0, 23}
    for slot in set(range(BLOCKS * BLOCK)) - written:  # slot 17's token pointed past the cache: skipped
        assert (kc.view(-1, KV_HEADS, HEAD)[slot] == 9).all() and (
            vc.view(-1, KV_HEADS, HEAD)[slot] == 9
        ).all()


def test_the_emulator_catches_a_cache_smaller_than_the_slots_say():
    """The guard trusts num_slots: told a larger cache than it is given, the emulator names the write."""
    qkv, positions, slots, kc, vc, cos, sin = rope_case("cpu", torch.float32)
    q = torch.empty(5, HEADS, HEAD)
    ints = (HEADS, KV_HEADS, HEAD, 32, BLOCKS * BLOCK)
    small = kc[:2]  # 8 slots; slot 17 and 23 are past it
    with pytest.raises(
        OutOfBoundsError, match=r"rope_and_cache: layer_ops\.cu:\d+: .* write of 4 bytes out of bounds"
    ):
        launch("rope_and_cache", GRID, (q, small, vc, qkv, cos, sin, positions, slots), ints)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_silu_and_mul(device, dtype):
    gate_up = torch.randn(3, 2 * 300, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    out = torch.empty(3, 300, dtype=dtype, device=device)
    launch("silu_and_mul", (3, 2), (out, gate_up), (300,))
    gate, up = gate_up.chunk(2, -1)
    close(out, torch.nn.functional.silu(gate) * up, dtype)
    exact_close(out, gate.double() * torch.sigmoid(gate.double()) * up.double(), dtype)


@pytest.mark.parametrize(
    "device, backend", [("cpu", "emulator"), pytest.param("cuda", "cupy", marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_on_the_fused_kernels_gives_the_pytorch_logits(device, backend, dtype):
    """A mixed batch (a prefill and two decodes) through a random GQA Llama: the fused kernels
    (backend "emulator" / "cupy") against the PyTorch ops (backend "torch"), the same cache written."""
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=dtype, device=device)
    cfg = model.config
    logits, caches = {}, {}
    for name in ("torch", backend):
        cache = PagedKVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            4,
            num_blocks=8,
            dtype=dtype,
            device=device,
        )
        tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
        meta = AttentionMetadata.build(
            [5, 1, 1], tables, [5, 3, 6], [0, 1, 2, 3, 4, 10, 21], 1, device=device
        )
        ids = torch.tensor([3, 9, 4, 1, 7, 11, 5], device=device)
        pos = torch.tensor([0, 1, 2, 3, 4, 2, 5], device=device)
        with torch.inference_mode():
            logits[name] = model(ids, pos, cache, meta, backend=name)
        caches[name] = cache.key_caches[0]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(logits[backend].float(), logits["torch"].float(), **tol)
    torch.testing.assert_close(caches[backend].float(), caches["torch"].float(), **tol)

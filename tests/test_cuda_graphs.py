"""Tests for the CUDA graphs of vllmini.model_runner: the captured sizes (CPU), a decode forward with no
host sync, and the engine's decode steps replayed from CUDA graphs against the eager engine (GPU)."""

import contextlib

import pytest
import torch

from vllmini.attention import AttentionMetadata, guarded_by_default, to_device
from vllmini.engine import LLMEngine
from vllmini.errors import InvalidArgumentError, InvalidBlockTableError
from vllmini.kv_cache import PagedKVCache
from vllmini.model import LlamaModel
from vllmini.model_runner import (
    capture_sizes,
    capture_widths,
    input_views,
    pack_inputs,
    padded_decode_forward,
)
from vllmini.sampling import SamplingParams

pytest.importorskip("transformers")
from engine_faults import corrupt_first_page  # noqa: E402
from llama_cases import random_hf_model  # noqa: E402 (needs transformers)


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and all(b % 8 == 0 for b in sizes[3:])
    assert sizes == sorted(set(sizes))
    with pytest.raises(InvalidArgumentError, match="max_batch_size"):
        capture_sizes(0)
    with pytest.raises(InvalidArgumentError, match="max_batch_size"):
        capture_sizes(513)


def test_capture_widths_double_from_256_tokens():
    assert capture_widths(128, 16) == [16, 32, 64, 128]  # 256, 512, 1024, 2048 tokens
    assert capture_widths(100, 16) == [16, 32, 64, 100]
    assert capture_widths(16, 16) == [16] and capture_widths(3, 16) == [3]
    assert capture_widths(64, 4) == [64]  # 256 tokens of block size 4


def _decode_batch(lens, block_size, num_blocks, seed=0):
    """A decode step of sequences of `lens` tokens on distinct random pages: ids, positions, meta (CPU)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    pages = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).int()
    slots = [
        int(pages[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size for s, n in enumerate(lens)
    ]
    ids = torch.randint(3, 100, (len(lens),), generator=g)
    meta = AttentionMetadata.build([1] * len(lens), pages, list(lens), slots, 0)
    meta.check_on_host(num_blocks, block_size)
    return ids, torch.tensor([n - 1 for n in lens]), meta


def test_packed_inputs_pad_with_rows_that_write_nothing():
    ids, pos, meta = _decode_batch([5, 9, 2], 4, 16)
    host = pack_inputs(ids, pos, meta, 4, 6)
    v_ids, v_pos, v_slots, v_lens, v_tables = input_views(host, 4, 6)
    assert v_ids.tolist() == ids.tolist() + [0] and v_pos.tolist() == pos.tolist() + [0]
    assert v_slots.tolist() == meta.slot_mapping.tolist() + [-1] and v_lens.tolist() == [5, 9, 2, 1]
    w = meta.block_tables.shape[1]
    assert (
        torch.equal(v_tables[:3, :w], meta.block_tables)
        and not v_tables[3].any()
        and not v_tables[:, w:].any()
    )


def test_the_recorded_forward_with_padding_equals_the_plain_forward_on_cpu():
    """What a graph records (padding rows, slot -1, no checks), run eagerly on the CPU: the real rows'
    logits and every cache write equal the unpadded forward's, and padding writes nothing."""
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=torch.float32)
    cfg = model.config
    caches = []
    for _ in range(2):
        cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, num_blocks=16)
        for t in cache.key_caches + cache.value_caches:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
        caches.append(cache)
    ids, pos, meta = _decode_batch([5, 9, 2], 4, 16, seed=3)
    want = model(ids, pos, caches[0], meta)
    got = padded_decode_forward(model, caches[1], "torch", pack_inputs(ids, pos, meta, 8, 6), 8, 6)
    assert got.shape == (8, cfg.vocab_size)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    written = torch.zeros(16 * 4, dtype=torch.bool)
    written[meta.slot_mapping.long()] = True
    for a, b in zip(
        caches[0].key_caches + caches[0].value_caches,
        caches[1].key_caches + caches[1].value_caches,
        strict=True,
    ):
        a, b = a.flatten(0, 1), b.flatten(0, 1)  # [slots, kv_heads, head_size]
        assert torch.equal(a[~written], b[~written])  # padding wrote nothing: every other slot untouched
        # the real rows' K/V: equal up to float32 rounding (a GEMM of 8 rows may round unlike one of 3)
        torch.testing.assert_close(a[written], b[written], rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def sync_is_an_error():
    """Every host<->device sync torch makes raises inside (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _clear_guard():
    from vllmini.cuda_kernels import check_kernel_errors

    with contextlib.suppress(InvalidBlockTableError):  # a record left by an earlier test's guarded call
        check_kernel_errors("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"])
def test_decode_forward_has_no_host_sync(backend):
    """The decode forward, its inputs checked on the host and moved from pinned memory, never syncs."""
    if backend == "cupy":
        pytest.importorskip("cupy")
    _clear_guard()
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=torch.float32, device="cuda")
    cache = PagedKVCache(2, 2, 16, 4, num_blocks=16, dtype=torch.float32, device="cuda")
    tables = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1]], dtype=torch.int32)
    lens = [5, 11, 2]
    slots = [int(tables[s, (n - 1) // 4]) * 4 + (n - 1) % 4 for s, n in enumerate(lens)]
    ids, pos = torch.tensor([3, 4, 5]), torch.tensor([n - 1 for n in lens])
    meta = AttentionMetadata.build([1, 1, 1], tables, lens, slots, 0)
    meta.check_on_host(16, 4)

    def forward():
        m = meta.to("cuda")
        return model(to_device(ids, "cuda"), to_device(pos, "cuda"), cache, m, backend=backend)

    want = forward()  # warm: kernels compiled, buffers made
    torch.cuda.synchronize()
    with sync_is_an_error():
        got = forward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [3], [40, 41, 42]]


def _generate(model, n, **kw):
    engine = LLMEngine(model, block_size=4, num_blocks=256, max_num_seqs=64, **kw)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i % 100] for i in range(n)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.output_token_ids for o in outs], engine


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graphs_give_the_eager_engines_tokens(dtype):
    """Greedy tokens with and without graphs: batch 1, 3 (padded to 4), 8 and 11 (above the largest
    captured size, 8: eager)."""
    _clear_guard()
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=dtype, device="cuda")
    for n in (1, 3, 8, 11):
        eager, e = _generate(model, n, use_cuda_graphs=False)
        graphed, g = _generate(model, n, use_cuda_graphs=True, max_cuda_graph_batch_size=8)
        assert e.graphs is None and g.graphs.sizes == [1, 2, 4, 8]
        assert graphed == eager, n


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_multi_step_replays_give_the_eager_engines_tokens(dtype, steps_run):
    """num_scheduler_steps=5 with graphs (batch 3, 8) and eagerly on the GPU (11: above the largest
    captured size): each step's argmax feeds the next replay on the device; max_tokens staggered (rows
    past theirs write nothing) and a stop token ends some samples mid-way."""
    _clear_guard()
    spy = steps_run
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=dtype, device="cuda")
    kw = dict(block_size=4, num_blocks=256, max_num_seqs=64, max_cuda_graph_batch_size=8)
    for n in (3, 8, 11):
        prompts = [PROMPTS[i % len(PROMPTS)] + [i % 100] for i in range(n)]
        params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(n)]
        stop = (
            LLMEngine(model, **kw).generate(prompts, params, use_tqdm=False)[0].output_token_ids[3]
        )  # some stop on it
        params = [
            SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, stop_token_ids=[stop]) for i in range(n)
        ]
        outs = {}
        for steps, graphs in ((1, False), (5, False), (5, True)):
            spy.clear()
            engine = LLMEngine(model, use_cuda_graphs=graphs, num_scheduler_steps=steps, **kw)
            outs[steps, graphs] = [
                o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)
            ]
            assert (5 in spy) == (steps > 1) and engine.num_forwards == len(engine.stats), (n, steps, spy)
        assert outs[5, True] == outs[5, False] == outs[1, False], n
        assert outs[1, False][0][-1] == stop


@pytest.mark.gpu
def test_a_graph_per_table_width_gives_the_eager_engines_tokens():
    """Contexts that grow across the 256- and 512-token widths replay the narrowest graph that holds them
    (its kernels split for that width) and give the eager engine's tokens."""
    _clear_guard()
    model = LlamaModel.from_pretrained(random_hf_model(max_position_embeddings=1024), device="cuda")
    kw = dict(block_size=16, num_blocks=256, max_num_seqs=4, max_model_len=1024, max_cuda_graph_batch_size=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[3 + i % 90 for i in range(n)] for n in (60, 250, 500)]
    eager = LLMEngine(model, use_cuda_graphs=False, **kw).generate(prompts, params, use_tqdm=False)
    engine = LLMEngine(model, use_cuda_graphs=True, **kw)
    assert engine.graphs.widths == [16, 32, 64]
    replayed = []
    run = engine.graphs.run
    engine.graphs.run = lambda ids, pos, meta: (
        replayed.append(engine.graphs.width_for(meta.block_tables.shape[1])) or run(ids, pos, meta)
    )
    graphed = engine.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in graphed] == [o.output_token_ids for o in eager]
    assert {16, 32} <= set(replayed) or {32, 64} <= set(replayed), replayed


@pytest.mark.gpu
def test_graphs_are_the_default_on_cuda_and_replay_without_a_sync():
    _clear_guard()
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=torch.float32, device="cuda")
    engine = LLMEngine(model, block_size=4, num_blocks=64, max_num_seqs=8)
    assert engine.graphs is not None and engine.graphs.sizes == [1, 2, 4, 8]
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill (eager)
    out = engine.scheduler.schedule()
    ids, pos, meta = engine.runner.prepare_inputs(out, engine.scheduler.block_manager)
    meta.check_on_host(engine.kv_cache.num_blocks, engine.kv_cache.block_size, tables=False)
    torch.cuda.synchronize()
    with sync_is_an_error():
        logits = engine.graphs.run(ids, pos, meta)  # refill the buffer, replay: no sync
    eager = model(to_device(ids, "cuda"), to_device(pos, "cuda"), engine.kv_cache, meta.to("cuda"))
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_a_bad_block_id_is_caught_under_graphs(monkeypatch):
    """The replayed kernel's guard records a bad page id; the engine fails the step and rolls it back."""
    _clear_guard()
    model = LlamaModel.from_pretrained(random_hf_model(), dtype=torch.float32, device="cuda")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(block_size=4, num_blocks=32, max_num_seqs=4, use_cuda_graphs=True)
    clean = LLMEngine(model, **kw).generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    engine = LLMEngine(model, **kw)
    if not guarded_by_default(engine.backend, engine.device, model.dtype):
        pytest.skip("the decode backend has no in-kernel guard (no CuPy): the host check catches it")
    rid = engine.add_request([5, 6, 7, 8, 9], params)
    engine.step()  # the prefill
    replays = []
    run = engine.graphs.run
    corrupt_first_page(engine, monkeypatch)
    monkeypatch.setattr(engine.graphs, "run", lambda *a: replays.append(1) or run(*a))
    with pytest.raises(InvalidBlockTableError, match=r"block_tables\[0, 0\] = 1000000"):
        engine.step()
    assert replays  # it was the replayed graph that saw it
    monkeypatch.undo()
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [rid]
    assert done[0].output_token_ids == clean[0].output_token_ids

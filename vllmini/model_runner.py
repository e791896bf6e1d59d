"""Runs the model for the engine (vLLM's GPUModelRunner): it owns the paged KV cache, picks the decode
attention backend, captures the decode CUDA graphs, turns a step's batch into input tensors
(`prepare_inputs`) and runs the forward (`execute`), with no host sync on a GPU decode step."""

from __future__ import annotations

import torch

from vllmini.attention import AttentionMetadata, guarded_by_default, to_device
from vllmini.block_manager import BlockManager
from vllmini.checks import cdiv
from vllmini.config import EngineConfig
from vllmini.cuda_kernels import check_kernel_errors
from vllmini.errors import InvalidArgumentError
from vllmini.kv_cache import PagedKVCache
from vllmini.model import LlamaModel
from vllmini.sequence import SchedulerOutput


def prepare_inputs(
    out: SchedulerOutput, block_manager: BlockManager, device=None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids (num_tokens,), positions (num_tokens,) and the AttentionMetadata of a batch: prefills
    first (tokens [num_computed_tokens, end), which may start mid-sequence), then one token per decode."""
    spans, ids, pos = out.spans, [], []
    for seq, (start, end) in zip(out.seqs, spans, strict=True):
        ids += seq.token_ids[start:end]
        pos += range(start, end)
    query_lens, seq_lens = [end - start for start, end in spans], [end for _, end in spans]
    block_tables, _ = block_manager.build_block_tables([s.seq_id for s in out.seqs])
    # static reservations hold more blocks than the tokens fill: read only the blocks in use
    block_tables = block_tables[:, : cdiv(max(seq_lens, default=1), block_manager.block_size)]
    meta = AttentionMetadata.build(
        query_lens, block_tables, seq_lens, out.slot_mapping, len(out.prefills), device=device
    )
    return (
        torch.tensor(ids, dtype=torch.int64, device=device),
        torch.tensor(pos, dtype=torch.int64, device=device),
        meta,
    )


class ModelRunner:
    """The model, its KV cache and how each step's forward runs (eager, or a replayed CUDA graph).
    `config` is the engine's, with max_model_len and max_num_batched_tokens resolved."""

    def __init__(self, model: LlamaModel, config: EngineConfig):
        self.model, self.config, self.device = model, config, model.device
        self.kv_cache = self._make_kv_cache()
        self.backend = self._resolve_backend(config.backend)  # "torch", "cupy" or "emulator"
        self.graphs = self._capture_graphs(config.use_cuda_graphs)  # a DecodeGraphs, or None: eager
        # the decode kernels check page ids on the GPU: then only the slots are checked on the host
        self.guarded = guarded_by_default(self.backend, self.device, model.dtype)

    def _make_kv_cache(self) -> PagedKVCache:
        c, cfg, dtype = self.config, self.model.config, self.model.dtype
        layout = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, c.block_size)
        num_blocks, memory, util = c.num_blocks, c.kv_cache_memory, c.gpu_memory_utilization
        if num_blocks is None and memory is None and util is None:
            if self.device.type == "cuda":
                util = 0.9
            else:  # CPU: room for 8 sequences of max_model_len, at most 1 GiB
                per_block = PagedKVCache.bytes_per_block(*layout, dtype)
                num_blocks = max(1, min(8 * cdiv(c.max_model_len, c.block_size), 2**30 // per_block))
        return PagedKVCache(
            *layout, num_blocks=num_blocks, memory_bytes=memory, gpu_memory_utilization=util, dtype=dtype,
            device=self.device,
        )  # fmt: skip

    def _resolve_backend(self, backend: str) -> str:
        """The decode backend to use. An explicit one that cannot run this dtype/device fails now, not at
        the first decode; "auto" falls back to "torch" when the CUDA kernel cannot run this model."""
        from vllmini.attention import paged_attention, resolve_backend

        concrete = resolve_backend(backend, self.device) if backend == "auto" else backend
        if concrete == "torch":
            return "torch"
        c = self.model.config
        kc = self.kv_cache.key_caches[0][:1]  # (1, block_size, nkv, hd): a one-block probe
        q = torch.zeros(1, c.num_attention_heads, c.head_dim, dtype=self.model.dtype, device=self.device)
        one = torch.ones(1, 1, dtype=torch.int32, device=self.device)
        try:
            paged_attention(q, kc, kc, one - 1, one[0], backend=concrete)
        except Exception as e:
            if backend == "auto":
                return "torch"
            raise InvalidArgumentError(
                f"backend {backend!r} cannot run this model ({self.model.dtype} on {self.device}): {e}"
            ) from e
        return concrete

    def _capture_graphs(self, wanted: bool | None):
        """Capture the decode CUDA graphs (vllmini.cuda_graphs) before any request runs, or None.
        wanted None: on for a CUDA model whose backend a graph can hold ("cupy", "torch")."""
        cuda = self.device.type == "cuda"
        if wanted is None:
            wanted = cuda and self.backend in ("cupy", "torch")
        if not wanted:
            return None
        if not cuda or self.backend not in ("cupy", "torch"):
            raise InvalidArgumentError(
                f"use_cuda_graphs=True needs a CUDA model and backend 'cupy' or 'torch', got device "
                f"{self.device} and backend {self.backend!r}"
            )
        from vllmini.cuda_graphs import DecodeGraphs

        c = self.config
        size = min(c.max_cuda_graph_batch_size, c.max_num_seqs)
        graphs = DecodeGraphs(
            self.model, self.kv_cache, self.backend, size, cdiv(c.max_model_len, c.block_size)
        )
        graphs.capture()
        return graphs

    def prepare_inputs(self, out: SchedulerOutput, block_manager: BlockManager):
        """`prepare_inputs` on the CPU (the engine moves them to the device without a sync)."""
        return prepare_inputs(out, block_manager)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """A step's copy-on-write copies: one indexed copy per cache tensor."""
        self.kv_cache.copy_blocks(pairs)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_manager: BlockManager) -> torch.Tensor:
        """The batch's forward: logits (S, V), one row per sequence. Fails (InvalidBlockTableError) if
        a kernel's guard saw a bad page id; the engine then rolls the step back."""
        input_ids, positions, meta = self.prepare_inputs(out, block_manager)  # on the CPU
        # the slots (and, without the kernels' guard, the tables) are checked here, on the host, so the
        # GPU forward needs no sync; the inputs then go to the GPU without one (pinned, non-blocking)
        kv = self.kv_cache
        meta.check_on_host(kv.num_blocks, kv.block_size, tables=not self.guarded)
        graphs = self.graphs
        if graphs is not None and not meta.num_prefills and graphs.size_for(meta.num_seqs) is not None:
            logits = graphs.run(input_ids, positions, meta)  # (S, V): one replay of a captured decode
        else:
            if self.device.type != "cpu":
                input_ids, positions = to_device(input_ids, self.device), to_device(positions, self.device)
                meta = meta.to(self.device)
            logits = self.model(input_ids, positions, kv, meta, backend=self.backend)  # (S, V)
        if self.device.type == "cuda":  # a bad page id seen by the kernels' in-kernel guard: fail the step
            check_kernel_errors(self.device)  # (one small device->host copy; the step is rolled back)
        return logits

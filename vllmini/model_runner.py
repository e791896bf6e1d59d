"""Runs the model for the engine (notebook 06; vLLM's GPUModelRunner): owns the paged KV cache, picks the
decode backend, turns a step's batch into tensors (`prepare_inputs`) and runs the forward (`execute`).

Decode steps replay CUDA graphs (`DecodeGraphs`), one per padded batch size (1, 2, 4, 8, then multiples
of 8) and table width (256, 512, 1024 ... tokens: the kernels split a context by the width a graph was
captured with, so a short batch replays a narrow graph): eager, the host spends longer issuing a decode's
launches than the GPU running them (benchmarks/RESULTS.md). A graph records pointers, so every input lives
in ONE static int32 buffer:

    input_ids (b,) | positions (b,) | slot_mapping (b,) | seq_lens (b,) | block_tables (b, max_blocks)
"""

from __future__ import annotations

import torch

from vllmini.attention import AttentionMetadata, to_device
from vllmini.block_manager import BlockManager
from vllmini.checks import as_int, cdiv
from vllmini.cuda_kernels import MIN_SPLIT_TOKENS, check_kernel_errors, kernel_error_buffer
from vllmini.errors import InvalidArgumentError
from vllmini.kv_cache import PagedKVCache, check_slot_mapping
from vllmini.model import LlamaModel
from vllmini.sequence import SchedulerOutput


def prepare_inputs(
    out: SchedulerOutput, block_manager: BlockManager, device=None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids (num_tokens,), positions (num_tokens,) and the AttentionMetadata of a batch."""
    spans, ids, pos = out.spans, [], []
    for seq, (start, end) in zip(out.prefills, spans, strict=False):  # the prefills' chunks (spans' head)
        ids += seq.token_ids[start:end]
        pos += range(start, end)
    query_lens, seq_lens = [end - start for start, end in spans], [end for _, end in spans]
    ids += [(s.output_token_ids or s.prompt_token_ids)[-1] for s in out.decodes]  # a decode: its last token
    pos += [n - 1 for n in seq_lens[len(out.prefills) :]]
    block_tables, _ = block_manager.build_block_tables([s.seq_id for s in out.seqs])
    # static reservations hold more blocks than the tokens fill: read only the blocks in use
    longest = max(seq_lens, default=1) + out.num_steps - 1  # multi-step: the last step's length
    block_tables = block_tables[:, : cdiv(longest, block_manager.block_size)]
    meta = AttentionMetadata.build(
        query_lens, block_tables, seq_lens, out.slot_mapping, len(out.prefills), device=device
    )
    ids, pos = torch.tensor([ids, pos], dtype=torch.int64, device=device)  # (2, num_tokens): one conversion
    return ids, pos, meta


class ModelRunner:
    """The model, its KV cache and each step's forward. `config`: the engine's EngineConfig."""

    def __init__(self, model: LlamaModel, config):
        self.model, self.config, self.device = model, config, model.device
        self.kv_cache = self._make_kv_cache()
        self.backend = self._resolve_backend(config.backend)  # "torch", "cupy" or "emulator"
        self.graphs = self._capture_graphs(config.use_cuda_graphs)  # a DecodeGraphs, or None: eager

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
        """The decode backend: one that cannot run this model fails now ("auto" falls back to "torch")."""
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
        """The decode CUDA graphs, captured before any request runs, or None."""
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
        """The batch's forward: logits (S, V). InvalidBlockTableError if the kernels' guard saw a bad page."""
        input_ids, positions, meta = self.prepare_inputs(out, block_manager)  # on the CPU
        kv = self.kv_cache  # checked on the host: the GPU forward needs no sync
        meta, _ = self.model.check_metadata(meta, kv, self.backend)
        graphs = self.graphs
        if graphs is not None and not meta.num_prefills and graphs.size_for(meta.num_seqs) is not None:
            logits = graphs.run(input_ids, positions, meta)  # (S, V): one replay of a captured decode
        else:
            if self.device.type != "cpu":
                input_ids, positions = to_device(input_ids, self.device), to_device(positions, self.device)
                meta = meta.to(self.device)
            logits = self.model(input_ids, positions, kv, meta, backend=self.backend)  # (S, V)
        if self.device.type == "cuda":  # the in-kernel guard's record (one small copy)
            check_kernel_errors(self.device)
        return logits

    @torch.inference_mode()
    def execute_steps(self, out: SchedulerOutput, block_manager: BlockManager) -> tuple[list, list]:
        """Multi-step: out.num_steps greedy forwards of a decode-only batch, each step's argmax fed to the
        next on the device (one host sync at the end). Returns (tokens, bad): per step, each decode's argmax
        and whether its logits row was not finite (`sample_batch`'s greedy rule)."""
        input_ids, positions, meta = self.prepare_inputs(out, block_manager)  # on the CPU
        meta, _ = self.model.check_metadata(meta, self.kv_cache, self.backend)
        later = torch.tensor(out.step_slots, dtype=torch.int32).view(-1, len(out.decodes))  # (steps 2.., S)
        check_slot_mapping(torch.cat([meta.slot_mapping.int(), later.view(-1)]), self.kv_cache.num_slots)
        rows, n, w, graphs = len(out.decodes), out.num_steps, meta.block_tables.shape[1], self.graphs
        if graphs is not None and graphs.size_for(rows) is not None:
            b, w = graphs.size_for(rows), graphs.width_for(w)
            buffer, forward = graphs.buffer, graphs.replayer(b, w)
        else:  # eager (the CPU too): the forward a graph records
            b = rows
            buffer = torch.empty((NUM_FIELDS + w) * b, dtype=torch.int32, device=self.device)
            forward = lambda: padded_decode_forward(self.model, self.kv_cache, self.backend, buffer, b, w)  # noqa: E731
        pin = self.device.type == "cuda"
        host = pack_inputs(input_ids, positions, meta, b, w, pin=pin)
        # the later steps' positions, slots and lengths (the buffer's fields 1-3, padding rows unchanged);
        # a row past its max_tokens (slot -1) stays at its last position, writing nothing
        ahead = host[b : NUM_FIELDS * b].view(1, NUM_FIELDS - 1, b).repeat(n - 1, 1, 1)
        grown = (later >= 0).int().cumsum(0)  # (steps 2.., S): tokens each row has grown by
        ahead[:, 0, :rows] += grown
        ahead[:, 1, :rows] = later
        ahead[:, 2, :rows] += grown
        buffer[: host.shape[0]].copy_(host, non_blocking=pin)
        ahead = ahead.pin_memory().to(self.device, non_blocking=True) if pin else ahead.to(self.device)
        found = torch.empty(n, 2, rows, dtype=torch.int64, device=self.device)  # (step, argmax | bad, row)
        for j in range(n):
            top, found[j, 0] = forward()[:rows].max(-1)
            found[j, 1] = (top < float("inf")).logical_not()
            if j + 1 < n:  # the next step's input: this step's argmax; then positions, slots, lengths
                buffer[:rows].copy_(found[j, 0])
                buffer[b : NUM_FIELDS * b].copy_(ahead[j].view(-1))
        if self.device.type == "cuda":
            check_kernel_errors(self.device)
        tokens, bad = found.transpose(0, 1).tolist()  # one sync
        return tokens, bad


NUM_FIELDS = 4  # input_ids, positions, slot_mapping, seq_lens; then the block tables
MAX_CAPTURE_SIZE = 512  # vLLM's default largest captured batch


def capture_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 8 up to max_batch_size (rounded up)."""
    m = as_int(max_batch_size, "max_batch_size", min=1, max=MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s < m] + list(range(16, m, 8))
    return sizes + [m if m <= 8 else cdiv(m, 8) * 8]


def capture_widths(max_width: int, block_size: int) -> list[int]:
    """Table widths (blocks) to capture: 256, 512, 1024 ... tokens, then max_width."""
    widths, tokens = [], MIN_SPLIT_TOKENS  # the shortest context piece: no narrower table splits differently
    while cdiv(tokens, block_size) < max_width:
        widths, tokens = widths + [cdiv(tokens, block_size)], tokens * 2
    return widths + [max_width]


def input_views(buffer: torch.Tensor, b: int, width: int) -> tuple[torch.Tensor, ...]:
    """The five inputs of a batch of b rows as views of the front of an int32 buffer."""
    ids, pos, slots, lens = (buffer[i * b : (i + 1) * b] for i in range(NUM_FIELDS))
    tables = buffer[NUM_FIELDS * b : (NUM_FIELDS + width) * b].view(b, width)
    return ids, pos, slots, lens, tables


def pack_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    b: int,
    width: int,
    *,
    pin: bool = False,
) -> torch.Tensor:  # ((NUM_FIELDS + width) * b,) int32 on the CPU
    """A decode batch of n <= b CPU rows laid out as `input_views` reads it; padding rows have token 0,
    slot -1 (not written), seq_len 1 and page 0 (read, output dropped)."""
    n, w = input_ids.shape[0], meta.block_tables.shape[1]
    assert 1 <= n <= b and w <= width, (n, b, w, width)
    host = torch.empty((NUM_FIELDS + width) * b, dtype=torch.int32, pin_memory=pin)
    ids, pos, slots, lens, tables = input_views(host, b, width)
    for dst, src, pad in ((ids, input_ids, 0), (pos, positions, 0), (slots, meta.slot_mapping, -1)):
        dst[:n], dst[n:] = src, pad
    lens[:n], lens[n:] = meta.seq_lens, 1
    tables.zero_()  # never read past a sequence's length
    tables[:n, :w] = meta.block_tables
    return host


def padded_decode_forward(model, kv_cache, backend: str, buffer: torch.Tensor, b: int, width: int):
    """Logits (b, vocab) of the b rows packed in `buffer`: the forward a graph records (CPU too)."""
    ids, pos, slots, lens, tables = input_views(buffer, b, width)
    meta = AttentionMetadata(
        slot_mapping=slots.long(),
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=buffer.device),
        num_prefills=0,
        num_prefill_tokens=0,
        host_checked=True,
        has_padding=True,
    )
    return model(ids.long(), pos.long(), kv_cache, meta, backend=backend)


class DecodeGraphs:
    """The captured decode forwards of one model on one KV cache, and their static input buffer."""

    def __init__(self, model, kv_cache, backend: str, max_batch_size: int, max_num_blocks_per_seq: int):
        # ModelRunner checked the device and backend (use_cuda_graphs=True on a CPU raises there)
        assert model.device.type == "cuda" and kv_cache.key_caches[0].device == model.device
        assert backend in ("torch", "cupy"), backend
        if kv_cache.num_slots >= 2**31:
            raise InvalidArgumentError(f"{kv_cache.num_slots} slots do not fit the int32 input buffer")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.widths = capture_widths(max_num_blocks_per_seq, kv_cache.key_caches[0].shape[1])
        self.width = self.widths[-1]
        self.device = model.device
        per_row = NUM_FIELDS + self.width
        self.buffer = torch.zeros(self.max_batch_size * per_row, dtype=torch.int32, device=self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (size, width) -> graph
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # (size, width) -> (size, vocab), per replay

    def _forward(self, b: int, width: int) -> torch.Tensor:
        """The decode forward of b rows with tables `width` blocks wide, reading only the static buffer."""
        return padded_decode_forward(self.model, self.kv_cache, self.backend, self.buffer, b, width)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, width), largest first, in one pool (before any request: dummy rows write
        slot 0)."""
        kernel_error_buffer(self.device)  # the guard's record must exist before the graphs point at it
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for b, w in ((b, w) for b in reversed(self.sizes) for w in reversed(self.widths)):
            self.buffer.zero_()
            input_views(self.buffer, b, w)[3].fill_(1)  # every dummy row: one token, page 0, slot 0
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm up (compiles the kernels, fills caches) off the capture
                self._forward(b, w)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b, w] = self._forward(b, w)
            self.graphs[b, w] = graph
        torch.cuda.synchronize(self.device)

    def replayer(self, b: int, w: int):
        """A function that replays the (b, w) graph and returns its logits (b, vocab) (multi-step)."""
        graph, logits = self.graphs[b, w], self.logits[b, w]
        return lambda: (graph.replay(), logits)[1]

    def width_for(self, width: int) -> int:
        """The narrowest captured table width that holds `width` blocks."""
        return next(w for w in self.widths if w >= width)

    def size_for(self, num_seqs: int) -> int | None:
        """The captured size that serves a decode batch of num_seqs, or None (run it eagerly)."""
        return next((b for b in self.sizes if b >= num_seqs), None) if num_seqs else None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits (num_seqs, vocab) of a host-checked decode batch of CPU tensors, by replay; a view of
        the graph's output: read it before the next run."""
        n = input_ids.shape[0]
        b = self.size_for(n)
        if b is None or meta.num_prefills or input_ids.device.type != "cpu" or not meta.host_checked:
            raise InvalidArgumentError(
                f"a graph replays a host-checked decode-only batch of CPU tensors of "
                f"1..{self.max_batch_size} sequences; got {n} sequences, {meta.num_prefills} prefills, "
                f"on {input_ids.device}"
            )
        w = meta.block_tables.shape[1]
        if w > self.width:
            raise InvalidArgumentError(f"block tables of {w} columns; the graphs hold {self.width}")
        w = self.width_for(w)
        host = pack_inputs(input_ids, positions, meta, b, w, pin=True)
        self.buffer[: host.shape[0]].copy_(host, non_blocking=True)
        self.graphs[b, w].replay()
        return self.logits[b, w][:n]

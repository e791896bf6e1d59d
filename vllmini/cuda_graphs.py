"""CUDA graphs for decode steps: capture the model's decode forward once per padded batch size, replay it.

A decode step launches about 20 kernels per layer; eager, the host spends more time issuing them than the
GPU spends running them (benchmarks/RESULTS.md: 115 ms of host time against 14 ms of GPU time for five
steps at batch 64). A CUDA graph records the launches once and replays them with one call. What a graph
records are pointers, so every input lives in ONE static int32 buffer that each step refills (one
host->device copy from pinned memory, non-blocking), and the graph for batch size b reads, from its front:

    input_ids (b,) | positions (b,) | slot_mapping (b,) | seq_lens (b,) | block_tables (b, max_blocks)

A batch of n sequences replays the graph of the smallest captured size b >= n (as vLLM does: 1, 2, 4, 8,
then multiples of 8 up to a maximum), with b - n padding rows (`pack_inputs`) whose logits are dropped.
The CuPy attention kernel runs on torch's current stream, so it is captured with the rest; its in-kernel
guard still records a bad page id, read by the engine after the replay (check_kernel_errors). Prefill,
mixed batches and batches above the largest size run eagerly. The captured forward is sync-free (no
.item(), no host checks: the engine checks the slot mapping on the host before it fills the buffer).
"""

from __future__ import annotations

import torch

from vllmini.attention import AttentionMetadata
from vllmini.checks import as_int, cdiv
from vllmini.cuda_kernels import kernel_error_buffer
from vllmini.errors import InvalidArgumentError

NUM_FIELDS = 4  # input_ids, positions, slot_mapping, seq_lens; then the block tables
MAX_CAPTURE_SIZE = 512  # vLLM's default largest captured batch


def capture_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 8 up to max_batch_size (and
    max_batch_size itself, rounded up to a multiple of 8 past 8)."""
    m = as_int(max_batch_size, "max_batch_size", min=1, max=MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s < m] + list(range(16, m, 8))
    return sizes + [m if m <= 8 else cdiv(m, 8) * 8]


def input_views(buffer: torch.Tensor, b: int, width: int) -> tuple[torch.Tensor, ...]:
    """The five inputs of a batch of b rows as views of the front of an int32 buffer: input_ids (b,),
    positions (b,), slot_mapping (b,), seq_lens (b,), block_tables (b, width)."""
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
    """A decode batch of n <= b sequences (CPU tensors) laid out as `input_views` reads it, padded to b
    rows: a padding row has token 0 at position 0, slot -1 (not written), seq_len 1 and page 0 (a valid
    block, read for one token, its output dropped); table columns past a row's own are page 0 too."""
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
    """Logits (b, vocab) of the decode batch of b rows packed in `buffer` (`pack_inputs`), padding rows
    included: the forward a graph records, reading nothing but the buffer. Runs on the CPU too (tests)."""
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
        if model.device.type != "cuda" or kv_cache.key_caches[0].device != model.device:
            raise InvalidArgumentError(
                f"CUDA graphs need the model and KV cache on one CUDA device, got {model.device} and "
                f"{kv_cache.key_caches[0].device}"
            )
        if backend not in ("torch", "cupy"):
            raise InvalidArgumentError(f"CUDA graphs capture backend 'torch' or 'cupy', got {backend!r}")
        if kv_cache.num_slots >= 2**31:
            raise InvalidArgumentError(f"{kv_cache.num_slots} slots do not fit the int32 input buffer")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.width = as_int(max_num_blocks_per_seq, "max_num_blocks_per_seq", min=1)
        self.device = model.device
        per_row = NUM_FIELDS + self.width
        self.buffer = torch.zeros(self.max_batch_size * per_row, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # size -> (size, vocab), written by each replay

    def _forward(self, b: int) -> torch.Tensor:
        """The decode forward of b rows, reading only the static buffer (what the graph records)."""
        return padded_decode_forward(self.model, self.kv_cache, self.backend, self.buffer, b, self.width)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, in one memory pool. The dummy rows write slot 0 (a free
        block before any request runs: call this before the first request)."""
        kernel_error_buffer(self.device)  # the guard's record must exist before the graphs point at it
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.sizes):
            self.buffer.zero_()
            input_views(self.buffer, b, self.width)[3].fill_(1)  # every dummy row: one token, page 0, slot 0
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm up (compiles the kernels, fills caches) off the capture
                self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def size_for(self, num_seqs: int) -> int | None:
        """The captured size that serves a decode batch of num_seqs, or None (run it eagerly)."""
        return next((b for b in self.sizes if b >= num_seqs), None) if num_seqs else None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits (num_seqs, vocab) of a decode-only batch given as CPU tensors (meta checked on the
        host), by replaying the graph of its padded size. The result is a view of the graph's output:
        read it before the next run."""
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
        host = pack_inputs(input_ids, positions, meta, b, self.width, pin=True)
        self.buffer[: host.shape[0]].copy_(host, non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n]

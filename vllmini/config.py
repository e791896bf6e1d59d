"""Every engine option in one checked dataclass (EngineConfig), and how LLMEngine's keyword arguments
become one."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from vllmini.attention import BACKENDS
from vllmini.checks import as_block_size, as_bool, as_fraction, as_int, one_of
from vllmini.errors import InvalidArgumentError, InvalidTypeError
from vllmini.scheduler import check_policy


@dataclass
class EngineConfig:
    """Every engine option, checked once, in one place (as nano-vllm's `Config`)."""

    block_size: int = 16  # tokens per KV block
    # what sizes the KV pool, at most one of: a block count, a byte budget, a share of free GPU memory. None
    # of them: 0.9 of free memory on a GPU; on a CPU room for 8 sequences of max_model_len (at most 1 GiB)
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # the longest prompt + output; None = max_position_embeddings
    backend: str = "auto"  # decode attention: "auto", "torch", "cupy" or "emulator" (vllmini.attention)
    policy: str = "paged"  # "paged", "static" or "oracle" (vllmini.scheduler)
    watermark: float = 0.01  # share of the pool new requests must leave free, so running ones can grow
    max_num_seqs: int = 256  # the most sequences in one batch (a request with n samples counts n)
    # the most tokens in one forward; None = max(max_model_len, 2048). Without chunked prefill it must be
    # >= max_model_len (a prompt is prefilled in one forward); with it, anything >= 1
    max_num_batched_tokens: int | None = None
    seed: int = 0  # derives the seed of every request that has none
    # reuse the KV blocks of a prompt prefix computed before (policy "paged" only). Off by default: with
    # nothing shared it cost 2-4% tokens/s on an H200 (benchmarks/RESULTS.md)
    enable_prefix_caching: bool = False
    # split prompts over several steps so a step never exceeds max_num_batched_tokens: running decodes go
    # first, prefills take chunks of what is left (vLLM's chunked prefill; Agrawal et al., Sarathi, 2023).
    # On by default: it cost no throughput on an H200 (benchmarks/RESULTS.md)
    enable_chunked_prefill: bool = True
    # replay decode-only steps from CUDA graphs captured at start-up, one per padded batch size 1, 2, 4, 8,
    # 16, 24, ... max_cuda_graph_batch_size (vllmini.cuda_graphs); prefill/mixed steps and larger batches
    # run eagerly. None: on for a CUDA model with backend "cupy" or "torch", off on the CPU (True raises)
    use_cuda_graphs: bool | None = None
    max_cuda_graph_batch_size: int = 256  # the largest decode batch replayed from a graph (at most 512)

    def __post_init__(self):
        self.block_size = as_block_size(self.block_size)
        for name in ("num_blocks", "kv_cache_memory", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, as_int(getattr(self, name), name, min=1))
        if self.gpu_memory_utilization is not None:
            self.gpu_memory_utilization = as_fraction(
                self.gpu_memory_utilization, "gpu_memory_utilization", "(0, 1]"
            )
        sizing = ("num_blocks", "kv_cache_memory", "gpu_memory_utilization")
        sizes = [name for name in sizing if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise InvalidArgumentError(
                f"num_blocks, kv_cache_memory and gpu_memory_utilization each size the KV cache: give "
                f"exactly one of them (or none for the default), got {sizes}"
            )
        one_of(self.backend, "backend", BACKENDS)
        self.watermark = as_fraction(self.watermark, "watermark", "[0, 1)")
        self.max_num_seqs = as_int(self.max_num_seqs, "max_num_seqs", min=1)
        self.seed = as_int(self.seed, "seed")
        self.enable_prefix_caching = as_bool(self.enable_prefix_caching, "enable_prefix_caching")
        check_policy(self.policy, self.enable_prefix_caching)
        self.enable_chunked_prefill = as_bool(self.enable_chunked_prefill, "enable_chunked_prefill")
        if self.use_cuda_graphs is not None:
            self.use_cuda_graphs = as_bool(self.use_cuda_graphs, "use_cuda_graphs")
        self.max_cuda_graph_batch_size = as_int(
            self.max_cuda_graph_batch_size, "max_cuda_graph_batch_size", min=1, max=512
        )
        if self.max_model_len is not None:
            self.check_batched_tokens(self.max_model_len)

    def check_batched_tokens(self, max_model_len: int) -> None:
        """Without chunked prefill, max_num_batched_tokens must hold a whole prompt of max_model_len."""
        batched = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and batched is not None and batched < max_model_len:
            raise InvalidArgumentError(
                f"max_num_batched_tokens={batched} is smaller than max_model_len={max_model_len}: a "
                f"whole prompt must fit in one forward (or set enable_chunked_prefill=True)"
            )


def make_config(config: EngineConfig | None, kwargs: dict) -> EngineConfig:
    """`config` (default EngineConfig()) with `kwargs` replacing its fields; checked."""
    if config is None:
        config = EngineConfig()
    elif not isinstance(config, EngineConfig):
        raise InvalidTypeError(f"config must be an EngineConfig or None, got {type(config).__name__}")
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise InvalidTypeError(f"unknown engine option(s) {unknown}; EngineConfig has {sorted(names)}")
    return replace(config, **kwargs)  # runs __post_init__: every field checked again

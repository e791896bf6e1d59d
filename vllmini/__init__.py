"""vllmini: a PagedAttention KV-cache engine built from scratch.

Data flows one way: allocator -> block table -> KV cache -> attention (torch, then CUDA kernels)
-> model -> scheduler -> engine. `import vllmini` stays light: names load on first use, and
jupyter, ipywidgets, matplotlib and cupy are imported only by the pieces that draw or launch kernels.
"""

from importlib import import_module

__version__ = "0.2.0"

# module -> the public names it defines
_NAMES = {
    "errors": "VllminiError OutOfBlocksError InvalidArgumentError InvalidTypeError BlockIdError "
    "InvalidIndexError CheckpointError CheckpointNotFoundError KernelBuildError KernelLaunchError "
    "KernelSourceNotFoundError InvalidBlockTableError EngineStateError",
    "allocator": "BlockAllocator",
    "block_table": "BlockTable",
    "block_manager": "BlockManager",
    "kv_cache": "PagedKVCache reshape_and_cache",
    "attention": "paged_attention paged_prefill_attention check_kernel_errors",
    "model": "LlamaConfig LlamaModel",
    "scheduler": "Sequence Scheduler",
    "sampling": "SamplingParams",
    "config": "EngineConfig",
    "outputs": "RequestOutput CompletionOutput Logprob",
    "engine": "LLMEngine",
}
_EXPORTS = {name: module for module, names in _NAMES.items() for name in names.split()}
_SUBMODULES = set(
    "errors checks memory allocator block_table block_manager prefix_cache kv_cache attention "
    "attention_checks kernel_registry launch_plan cuda_kernels emulator loader models model sequence "
    "chunked_prefill scheduler sampling outputs processing interrupts config model_runner cuda_graphs "
    "engine arrivals serving latency exercises viz".split()
)

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f"vllmini.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return import_module(f"vllmini.{name}")
    raise AttributeError(f"module 'vllmini' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)

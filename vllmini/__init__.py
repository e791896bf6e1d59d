"""vllmini: a PagedAttention KV-cache engine built from scratch, one module per notebook.

`import vllmini` stays light: names load on first use (the only module that re-exports).
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
    "attention": "paged_attention paged_prefill_attention",
    "cuda_kernels": "check_kernel_errors",
    "model": "LlamaConfig LlamaModel",
    "sequence": "Sequence",
    "scheduler": "Scheduler",
    "sampling": "SamplingParams",
    "outputs": "RequestOutput CompletionOutput Logprob",
    "engine": "LLMEngine EngineConfig",
}
_EXPORTS = {name: module for module, names in _NAMES.items() for name in names.split()}
_SUBMODULES = set(
    "errors checks allocator block_table block_manager prefix_cache kv_cache attention cuda_kernels "
    "emulator model models sequence scheduler sampling outputs model_runner engine course".split()
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

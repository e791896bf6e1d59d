"""Compile and launch the CUDA kernels of kernels/*.cu on torch tensors.

Which kernels exist is `vllmini.kernel_registry`, how one call is shaped (grid, block, context split) is
`vllmini.launch_plan`; their public names are importable from here too. Two runtimes run the same source:
    "cupy"      NVRTC-compiled through cupy.RawModule (once per device), launched on torch's current
                stream with raw device pointers (no cupy.asarray per argument: ~6 us instead of ~29 us).
    "emulator"  vllmini.emulator.RawKernel: the unmodified source compiled for the CPU (tests, CI, laptops).
compile_for_arch() compiles a source for a given GPU architecture with CuPy's low-level NVRTC binding; it
needs neither a GPU nor a driver (only the nvidia-cuda-nvrtc wheel), which is how CI checks every kernel.
Callers normally go through vllmini.paged_attention(..., backend="cupy"|"emulator"), which validates the
inputs first.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from vllmini.checks import one_of
from vllmini.errors import InvalidArgumentError, InvalidTypeError, KernelBuildError
from vllmini.kernel_registry import (  # noqa: F401 (re-exported: every name importable from here)
    DTYPE_SUFFIX,
    VERSIONS,
    KernelVersion,
    kernel_dir,
    kernel_files,
    kernel_versions,
    read_kernel_source,
    resolve_kernel_version,
)
from vllmini.launch_plan import (  # noqa: F401 (re-exported: every name importable from here)
    EMULATOR_SMS,
    MERGE_THREADS,
    LaunchPlan,
    launch_plan,
    num_sms,
)

RUNTIMES = ("cupy", "emulator")
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")  # T4, A100, RTX 30xx/A10, L4/RTX 40xx, H100/H200
NVRTC_OPTIONS = ("--std=c++17",)

MAX_HEAD_SIZE = 256  # versions 2-5: head_size / 32 floats per lane in registers
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
DEFAULT_SHARED_BYTES = 48 * 1024  # dynamic shared memory a block gets without opting in
MAX_SHARED_BYTES = 232448  # the most an H100/H200 block may opt into (227 KiB); less on older GPUs

_cupy_modules: dict[tuple[str, int], object] = {}  # (file, device) -> cupy.RawModule
_cupy_kernels: dict[tuple[str, str, int], object] = {}  # (file, function, device) -> kernel
_cupy_streams: dict[tuple[int, int], object] = {}  # (device, torch stream handle) -> cupy.ExternalStream


# ----------------------------------------------------------------------------- NVRTC without a GPU


def _nvrtc():
    """CuPy's low-level NVRTC binding; it loads libnvrtc (e.g. from nvidia-cuda-nvrtc-cu12) on first use."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise KernelBuildError(
            "compiling CUDA needs CuPy: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12"
        ) from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loads; KernelBuildError when none loads."""
    try:
        return tuple(_nvrtc().getVersion())
    except Exception as e:  # CuPy raises several types when the shared library is missing
        raise KernelBuildError(
            f"cannot load NVRTC ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc-cu12"
        ) from e


def compile_for_arch(
    source: str, arch: str, *, name: str = "kernel.cu", options: tuple[str, ...] = ()
) -> bytes:
    """Compile CUDA source for one architecture with NVRTC, no GPU needed.

    arch "sm_XX" gives a cubin, "compute_XX" gives PTX. Raises RuntimeError with NVRTC's log on errors.
    """
    if not (arch.startswith("sm_") or arch.startswith("compute_")) or not arch.split("_", 1)[1].isdigit():
        raise InvalidArgumentError(f"arch must look like 'sm_80' or 'compute_80', got {arch!r}")
    nvrtc = _nvrtc()
    nvrtc_version()  # a clear error when libnvrtc is missing
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS, *options])
        except Exception as e:
            log = nvrtc.getProgramLog(prog)
            raise KernelBuildError(f"NVRTC failed to compile {name} for {arch}:\n{log}") from e
        return nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


# ----------------------------------------------------------------------------- kernels for each runtime


def _cupy_kernel(
    file: str, function: str, device: int, source: str | None = None, options: tuple[str, ...] = ()
):
    """cupy.RawKernel for kernels/<file>.cu::function on a device; the file is compiled once per device
    and set of extra NVRTC options. `source` replaces the file's text (benchmarks comparing variants)."""
    key = (file if source is None else f"{file}@{hash(source)}") + "".join(options)
    if (key, function, device) not in _cupy_kernels:
        import cupy

        with cupy.cuda.Device(device):
            if (key, device) not in _cupy_modules:
                code = read_kernel_source(file) if source is None else source
                _cupy_modules[key, device] = cupy.RawModule(code=code, options=(*NVRTC_OPTIONS, *options))
            _cupy_kernels[key, function, device] = _cupy_modules[key, device].get_function(function)
    return _cupy_kernels[key, function, device]


def _torch_stream(device: torch.device):
    """torch's current stream on a device, as a CuPy stream (cached by handle)."""
    import cupy

    handle = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, handle)
    if key not in _cupy_streams:
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older CuPy lacks the new API
            warnings.simplefilter("ignore", DeprecationWarning)
            _cupy_streams[key] = cupy.cuda.ExternalStream(handle, device.index)
    return _cupy_streams[key]


@functools.cache
def _emulator_kernel(file: str, function: str):
    """vllmini.emulator.RawKernel for kernels/<file>.cu::function (the emulator caches the build)."""
    from vllmini.emulator import RawKernel

    return RawKernel(read_kernel_source(file), function)


# ----------------------------------------------------------------------------- launching any version


def paged_attention_kernel(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_num_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_size], query's dtype, written
    runtime: str = "cupy",
    *,
    version: KernelVersion | int | str | None = None,
    error: torch.Tensor | None = None,  # int32 [5] guard record (versions with guard=True), or None
    num_splits: int | None = None,
    source: str | None = None,
    _validated: bool = False,
) -> torch.Tensor:
    """Launch one kernel version (None: the best, resolve_kernel_version) on validated, contiguous
    inputs; fills and returns out. Sync-free: nothing is read back from the device. runtime "cupy" needs
    CUDA tensors, "emulator" CPU tensors. `error` turns on the in-kernel guard of versions that have one:
    bad page ids are never read, their rows come out NaN and the first one is recorded in `error`
    (vllmini.attention.check_kernel_errors); without it the kernel trusts the tables. `num_splits` forces
    version 5's context split (tests); `source` (cupy only) launches another text with the same
    arguments, for benchmarks of variants."""
    kernel = version if isinstance(version, KernelVersion) else resolve_kernel_version(version, query.dtype)
    inputs = (query, key_cache, value_cache, block_tables, seq_lens)
    _check_call(kernel, runtime, (*inputs, out), error, _validated)
    num_seqs, num_heads, head_size = query.shape
    if num_seqs == 0:
        return out
    plan = _plan_call(kernel, runtime, query, key_cache, block_tables, num_splits)
    # the kernels read 16-byte vectors: a view that starts mid-row (a rare, odd storage offset) is copied
    query, key_cache, value_cache = (
        t if t.data_ptr() % 16 == 0 else t.clone() for t in (query, key_cache, value_cache)
    )
    args, out_raw, (part_out, part_ml) = _kernel_args(
        kernel, plan, (query, key_cache, value_cache, block_tables, seq_lens), out, error, scale
    )
    # version 5's compile options pick its copy of the kernel; the emulator builds every copy once
    options = plan.options if kernel.number >= 5 and runtime == "cupy" else ()
    device = query.device

    def launch(function: str, grid, block, launch_args, shared_mem: int) -> None:
        _launch(kernel.file, function, runtime, device, grid, block, launch_args, shared_mem, source, options)

    launch(kernel.function(query.dtype), plan.grid, plan.block, args, plan.shared_mem)
    if kernel.number < 5:
        if out_raw is not out:
            out.copy_(out_raw)  # the kernel accumulates and writes float32; round once, here
    elif plan.num_splits > 1:
        merge_args = (out_raw, part_out, part_ml, np.int32(plan.num_splits), np.int32(head_size))
        merge = f"{kernel.file}_merge{DTYPE_SUFFIX[query.dtype]}"
        launch(merge, (num_seqs, num_heads, 1), (MERGE_THREADS, 1, 1), merge_args, 0)
    return out


def _check_call(kernel: KernelVersion, runtime: str, tensors: tuple, error, validated: bool) -> None:
    """What no kernel survives: wrong runtime/device, dtypes, layout, head size, grid limits, a guard
    record for a version without one. After vllmini.paged_attention's checks (`validated`: dtypes,
    shapes, devices and layout done), only what they do not cover."""
    query, key_cache, out = tensors[0], tensors[1], tensors[5]
    head_size, num_heads, num_kv_heads = query.shape[2], query.shape[1], key_cache.shape[2]
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "out")
    if not validated:
        one_of(runtime, "runtime", RUNTIMES)
        if query.dtype not in kernel.dtypes:
            raise InvalidTypeError(
                f"kernel version {kernel.number} ({kernel.name}) supports {list(kernel.dtypes)}, "
                f"got query of {query.dtype}"
            )
        for arg, t in zip(names[1:3], tensors[1:3], strict=True):
            if t.dtype != query.dtype:
                raise InvalidTypeError(f"{arg} must have the query's dtype {query.dtype}, got {t.dtype}")
        for arg, t in zip(names[3:5], tensors[3:5], strict=True):
            if t.dtype != torch.int32:
                raise InvalidTypeError(f"{arg} must be int32, got {t.dtype}")
        for arg, t in zip(names, tensors, strict=True):
            if not t.is_contiguous():
                raise InvalidArgumentError(f"{arg} must be contiguous (vllmini.paged_attention makes it so)")
        if num_heads > MAX_GRID_YZ:
            raise InvalidArgumentError(f"num_heads must be <= {MAX_GRID_YZ} (gridDim.y), got {num_heads}")
        if num_heads % num_kv_heads != 0:
            raise InvalidArgumentError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if runtime == "cupy" and any(t.device.type != "cuda" or t.device != query.device for t in tensors):
            raise InvalidArgumentError(
                f"runtime 'cupy' needs all tensors on one CUDA device; query is on {query.device}"
            )
        if runtime == "emulator" and any(t.device.type != "cpu" for t in tensors):
            raise InvalidArgumentError(f"runtime 'emulator' needs CPU tensors, query is on {query.device}")
    if kernel.number > 1 and head_size > MAX_HEAD_SIZE:
        raise InvalidArgumentError(
            f"kernel version {kernel.number} supports head_size <= {MAX_HEAD_SIZE}, got {head_size}"
        )
    if out.dtype != query.dtype or out.shape != query.shape:
        raise InvalidArgumentError(
            f"out must be {query.dtype} {tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    if error is not None and not kernel.guard:
        raise InvalidArgumentError(
            f"kernel version {kernel.number} ({kernel.name}) has no in-kernel guard; pass error=None"
        )


def _plan_call(kernel: KernelVersion, runtime: str, query, key_cache, block_tables, num_splits) -> LaunchPlan:
    """The launch plan of one call (launch_plan, for the GPU's SMs or EMULATOR_SMS); InvalidArgumentError
    when a block would need more shared memory than an H100/H200 block may have."""
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_num_blocks_per_seq = block_tables.shape[1]
    sms = num_sms(query.device.index) if runtime == "cupy" else EMULATOR_SMS
    plan = launch_plan(
        kernel, num_seqs, num_heads, num_kv_heads, head_size, block_size, max_num_blocks_per_seq, query.dtype,
        sms, num_splits,
    )  # fmt: skip
    if plan.shared_mem > MAX_SHARED_BYTES:  # version 1 keeps every score of the context in shared memory
        raise InvalidArgumentError(
            f"kernel version {kernel.number} needs {plan.shared_mem} bytes of shared memory "
            f"for a block table of {max_num_blocks_per_seq} x {block_size} tokens; "
            f"at most {MAX_SHARED_BYTES} (H100/H200)"
        )
    return plan


def _kernel_args(kernel: KernelVersion, plan, inputs: tuple, out: torch.Tensor, error, scale: float):
    """The launch arguments of version `v` (in its .cu signature's order), the buffer the kernel writes,
    and version 5's split partials (None, None without a split)."""
    query, key_cache, value_cache, block_tables, seq_lens = inputs
    num_seqs, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    raw = [t if t.dtype == torch.float32 else t.view(torch.uint16) for t in (query, key_cache, value_cache)]
    ints = (block_size, num_heads, head_size, num_kv_heads, block_tables.shape[1])
    if kernel.number < 5:  # (out float32, q, k, v, tables, lens, sizes..., scale); out cast after
        out_raw = out if out.dtype == torch.float32 else out.new_empty(out.shape, dtype=torch.float32)
        args = (out_raw, *raw, block_tables, seq_lens, *map(np.int32, ints), np.float32(scale))
        return args, out_raw, (None, None)
    # (out, split partials, q, k, v, tables, lens, guard record, sizes..., scale)
    out_raw = out if out.dtype == torch.float32 else out.view(torch.uint16)
    part_out = part_ml = None
    if plan.num_splits > 1:
        part_out = out.new_empty(num_seqs, num_heads, plan.num_splits, head_size, dtype=torch.float32)
        part_ml = out.new_empty(num_seqs, num_heads, plan.num_splits, 2, dtype=torch.float32)
    sizes = (num_blocks, *ints, plan.heads_per_block, plan.pages_per_split)
    args = (out_raw, part_out, part_ml, *raw, block_tables, seq_lens, error, *map(np.int32, sizes),
            np.float32(scale))  # fmt: skip
    return args, out_raw, (part_out, part_ml)


def _launch(file, function, runtime, device, grid, block, args, shared_mem, source, options) -> None:
    """One launch through CuPy (on torch's current stream, raw pointers) or the emulator."""
    if runtime == "cupy":
        import cupy

        kernel = _cupy_kernel(file, function, device.index, source, options)
        if shared_mem > DEFAULT_SHARED_BYTES and kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem  # opt in (raises if the GPU has less)
        cargs = tuple(0 if a is None else a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        with cupy.cuda.Device(device.index), _torch_stream(device):
            kernel(grid, block, cargs, shared_mem=shared_mem)
    else:
        _emulator_kernel(file, function)(grid, block, args, shared_mem=shared_mem)

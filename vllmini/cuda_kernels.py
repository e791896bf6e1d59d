"""The CUDA kernels of kernels/*.cu: find their source, compile it, and launch it on torch tensors.

The .cu files are plain text that this module reads; nothing is copied into Python strings. Two runtimes
run the same source:
    "cupy"      NVRTC-compiled through cupy.RawModule (once per device), launched on torch's current
                stream with raw device pointers (no cupy.asarray per argument: ~6 us instead of ~29 us).
    "emulator"  vllmini.emulator.RawKernel: the unmodified source compiled for the CPU (tests, CI, laptops).
compile_for_arch() compiles a source for a given GPU architecture with CuPy's low-level NVRTC binding; it
needs neither a GPU nor a driver (only the nvidia-cuda-nvrtc wheel), which is how CI checks every kernel.

Callers normally go through vllmini.paged_attention(..., backend="cupy"|"emulator"), which validates the
inputs first; the launchers here assume validated, contiguous inputs.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

RUNTIMES = ("cupy", "emulator")
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")  # T4, A100, RTX 30xx/A10, L4/RTX 40xx, H100/H200
NVRTC_OPTIONS = ("--std=c++17",)

# paged_attention_v1 launch shape: one thread block of NUM_THREADS per (sequence, query head).
NUM_THREADS = 256
WARP_SIZE = 32
MAX_HEAD_SIZE = 256  # the kernel keeps head_size / 32 floats per lane in registers (MAX_HEAD_SIZE in the .cu)
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (the head axis)
# element type -> kernel entry point; 16-bit types travel as their raw bits (unsigned short in the kernel)
V1_FUNCTIONS = {
    torch.float32: "paged_attention_v1",
    torch.float16: "paged_attention_v1_f16",
    torch.bfloat16: "paged_attention_v1_bf16",
}

_cupy_modules: dict[tuple[str, int], object] = {}  # (file, device) -> cupy.RawModule
_cupy_kernels: dict[tuple[str, str, int], object] = {}  # (file, function, device) -> kernel
_cupy_streams: dict[tuple[int, int], object] = {}  # (device, torch stream handle) -> cupy.ExternalStream
_emulator_kernels: dict[tuple[str, str], object] = {}  # (file, function) -> vllmini.emulator.RawKernel


# ----------------------------------------------------------------------------- finding the sources


def kernel_dir() -> Path:
    """The folder of .cu files: vllmini/kernels/ inside an installed wheel, else the checkout's kernels/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no kernels/ folder: looked in {here / 'kernels'} and {here.parent / 'kernels'}")


def kernel_files(include_bugs: bool = True) -> list[Path]:
    """Every .cu file under kernel_dir(), sorted; the planted-bug kernels of kernels/bugs/ when asked."""
    files = sorted(kernel_dir().rglob("*.cu"))
    if not include_bugs:
        files = [f for f in files if "bugs" not in f.relative_to(kernel_dir()).parts]
    return files


def read_kernel_source(name: str) -> str:
    """The text of kernels/<name>.cu; name may include a subfolder ("bugs/x") and may end in .cu."""
    path = kernel_dir() / (name if name.endswith(".cu") else f"{name}.cu")
    if not path.is_file():
        known = [str(f.relative_to(kernel_dir()).with_suffix("")) for f in kernel_files()]
        raise FileNotFoundError(f"no kernel source {name!r} in {kernel_dir()}; expected one of {known}")
    return path.read_text()


# ----------------------------------------------------------------------------- NVRTC without a GPU


def _nvrtc():
    """CuPy's low-level NVRTC binding; it loads libnvrtc (e.g. from nvidia-cuda-nvrtc-cu12) on first use."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise RuntimeError(
            "compiling CUDA needs CuPy: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12"
        ) from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loads; raises RuntimeError when none can be loaded."""
    try:
        return tuple(_nvrtc().getVersion())
    except Exception as e:  # CuPy raises several types when the shared library is missing
        raise RuntimeError(
            f"cannot load NVRTC ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc-cu12"
        ) from e


def compile_for_arch(
    source: str, arch: str, *, name: str = "kernel.cu", options: tuple[str, ...] = ()
) -> bytes:
    """Compile CUDA source for one architecture with NVRTC, no GPU needed.

    arch "sm_XX" gives a cubin, "compute_XX" gives PTX. Raises RuntimeError with NVRTC's log on errors.
    """
    if not (arch.startswith("sm_") or arch.startswith("compute_")) or not arch.split("_", 1)[1].isdigit():
        raise ValueError(f"arch must look like 'sm_80' or 'compute_80', got {arch!r}")
    nvrtc = _nvrtc()
    nvrtc_version()  # a clear error when libnvrtc is missing
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS, *options])
        except Exception as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile {name} for {arch}:\n{log}") from e
        return nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


# ----------------------------------------------------------------------------- kernels for each runtime


def _cupy_kernel(file: str, function: str, device: int, source: str | None = None):
    """cupy.RawKernel for kernels/<file>.cu::function on a device; the file is compiled once per device.
    `source` replaces the file's text (benchmarks comparing kernel versions); cached under its own key."""
    key = file if source is None else f"{file}@{hash(source)}"
    if (key, function, device) not in _cupy_kernels:
        import cupy

        with cupy.cuda.Device(device):
            if (key, device) not in _cupy_modules:
                code = read_kernel_source(file) if source is None else source
                _cupy_modules[key, device] = cupy.RawModule(code=code, options=NVRTC_OPTIONS)
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


def _emulator_kernel(file: str, function: str):
    """vllmini.emulator.RawKernel for kernels/<file>.cu::function (the emulator caches the build)."""
    key = (file, function)
    if key not in _emulator_kernels:
        from vllmini.emulator import RawKernel

        _emulator_kernels[key] = RawKernel(read_kernel_source(file), function)
    return _emulator_kernels[key]


# ----------------------------------------------------------------------------- paged_attention_v1


def launch_config_v1(num_seqs: int, num_heads: int, head_size: int) -> tuple[tuple, tuple, int]:
    """(grid, block, shared_mem bytes) for paged_attention_v1: a block of NUM_THREADS per (seq, head)."""
    num_groups = NUM_THREADS // 16  # lane groups: 32 lanes for float32, 16 for 16-bit types (the most)
    shared_mem = num_groups * (head_size + 2) * 4  # per-group max, sum and partial output (float32)
    return (num_seqs, num_heads, 1), (NUM_THREADS, 1, 1), shared_mem


def paged_attention_v1(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_num_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_size], written
    runtime: str = "cupy",
    *,
    source: str | None = None,
) -> torch.Tensor:
    """Launch kernels/paged_attention_v1.cu on validated, contiguous inputs; fills and returns out.

    query and caches float32, float16 or bfloat16 (out in the same dtype; the kernel computes in float32).
    runtime "cupy" needs CUDA tensors, "emulator" CPU tensors. `source` (cupy only) launches another
    version of the file's text with the same arguments, for benchmarks that compare versions. Checks only
    what the kernel itself cannot survive (dtype, head size, grid size, contiguity);
    vllmini.paged_attention checks the rest.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_num_blocks_per_seq = block_tables.shape[1]
    if query.dtype not in V1_FUNCTIONS:
        raise TypeError(f"paged_attention_v1 supports {list(V1_FUNCTIONS)}, got query of {query.dtype}")
    for arg, t in (("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if t.dtype != query.dtype:
            raise TypeError(f"{arg} must have the query's dtype {query.dtype}, got {t.dtype}")
    for arg, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{arg} must be int32, got {t.dtype}")
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, out)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "out")
    for arg, t in zip(names, tensors, strict=True):
        if not t.is_contiguous():
            raise ValueError(f"{arg} must be contiguous (vllmini.paged_attention makes it so)")
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"paged_attention_v1 supports head_size <= {MAX_HEAD_SIZE}, got {head_size}")
    if num_heads > MAX_GRID_Y:
        raise ValueError(
            f"paged_attention_v1 supports num_heads <= {MAX_GRID_Y} (gridDim.y); got {num_heads}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_seqs == 0:
        return out

    if runtime == "cupy" and any(t.device.type != "cuda" or t.device != query.device for t in tensors):
        raise ValueError(f"runtime 'cupy' needs all tensors on one CUDA device; query is on {query.device}")
    if runtime == "emulator" and any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"runtime 'emulator' needs CPU tensors, query is on {query.device}")

    # the kernel reads 16-byte vectors: a view that starts mid-row (a rare, odd storage offset) is copied
    query, key_cache, value_cache = (
        t if t.data_ptr() % 16 == 0 else t.clone() for t in (query, key_cache, value_cache)
    )
    grid, block, shared_mem = launch_config_v1(num_seqs, num_heads, head_size)
    function = V1_FUNCTIONS[query.dtype]
    out32 = (
        out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    )
    inputs = [
        t if t.dtype == torch.float32 else t.view(torch.uint16) for t in (query, key_cache, value_cache)
    ]
    ints = [np.int32(x) for x in (block_size, num_heads, head_size, num_kv_heads, max_num_blocks_per_seq)]
    if runtime == "cupy":
        kernel = _cupy_kernel("paged_attention_v1", function, query.device.index, source)
        pointers = [t.data_ptr() for t in (out32, *inputs, block_tables, seq_lens)]
        import cupy

        with cupy.cuda.Device(query.device.index), _torch_stream(query.device):
            kernel(grid, block, (*pointers, *ints, np.float32(scale)), shared_mem=shared_mem)
    else:
        kernel = _emulator_kernel("paged_attention_v1", function)
        args = (out32, *inputs, block_tables, seq_lens, *ints, np.float32(scale))
        kernel(grid, block, args, shared_mem=shared_mem)
    if out32 is not out:
        out.copy_(out32)  # the kernel accumulates and writes float32; round once, here
    return out

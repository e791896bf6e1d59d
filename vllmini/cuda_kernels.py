"""The CUDA kernels of kernels/*.cu: which exist (the registry), how one call is shaped (the launch plan),
and how they are compiled and launched on torch tensors.

The .cu files are plain text that the package reads (vllmini/kernels/ in a wheel, the top-level kernels/
in a checkout). Versions: kernels/paged_attention_<n>_<what it adds>.cu, one file per idea (VERSIONS).
With none asked for, the best is used (`resolve_kernel_version`): today version 5 for every dtype, at or
near the read ceiling on every shape measured (benchmarks/RESULTS.md). Two runtimes run the same source:
    "cupy"      NVRTC-compiled through cupy.RawModule (once per device), launched on torch's current
                stream with raw device pointers (no cupy.asarray per argument: ~6 us instead of ~29 us).
    "emulator"  vllmini.emulator.RawKernel: the unmodified source compiled for the CPU (tests, CI, laptops).
compile_for_arch() compiles a source for a given GPU architecture with CuPy's low-level NVRTC binding; it
needs neither a GPU nor a driver (only the nvidia-cuda-nvrtc wheel), which is how CI checks every kernel.
Two ways in: `paged_attention_kernel` checks its arguments and launches one version;
vllmini.paged_attention(..., backend="cupy"|"emulator") checks its own and calls `launch_paged_attention`.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from vllmini.checks import as_int, cdiv, one_of
from vllmini.errors import (
    InvalidArgumentError,
    InvalidBlockTableError,
    InvalidTypeError,
    KernelBuildError,
    KernelSourceNotFoundError,
)
from vllmini.kv_cache import FLOAT_DTYPES

RUNTIMES = ("cupy", "emulator")
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")  # T4, A100, RTX 30xx/A10, L4/RTX 40xx, H100/H200
NVRTC_OPTIONS = ("--std=c++17",)
DTYPE_SUFFIX = dict(zip(FLOAT_DTYPES, ("", "_f16", "_bf16"), strict=True))  # entry point name suffixes

WARP_SIZE = 32
MAX_HEAD_SIZE = 256  # versions 2-5: head_size / 32 floats per lane in registers
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
DEFAULT_SHARED_BYTES = 48 * 1024  # dynamic shared memory a block gets without opting in
MAX_SHARED_BYTES = 232448  # the most an H100/H200 block may opt into (227 KiB); less on older GPUs
EMULATOR_SMS = 4  # the "multiprocessors" launch_plan assumes for the emulator (a CPU runs blocks one by one)
SPLIT_TARGET_BLOCKS_PER_SM = 8  # version 5 splits contexts until the grid has this many blocks per SM
MIN_SPLIT_TOKENS = 256  # ... but into no piece shorter than this (the merge would cost more than it gains)
MERGE_THREADS = 128
ERROR_FIELDS = 5  # the guard's record: flag, sequence, table entry (-1: seq_lens), value, limit

_cupy_modules: dict[tuple[str, int], object] = {}  # (file, device) -> cupy.RawModule
_cupy_kernels: dict[tuple[str, str, int], object] = {}  # (file, function, device) -> kernel
_cupy_streams: dict[tuple[int, int], object] = {}  # (device, torch stream handle) -> cupy.ExternalStream
_error_buffers: dict[torch.device, torch.Tensor] = {}  # device -> int32 [ERROR_FIELDS], zero when clean


# ----------------------------------------------------------------------------- the registry


def kernel_dir() -> Path:
    """The folder of .cu files: vllmini/kernels/ inside an installed wheel, else the checkout's kernels/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if candidate.is_dir():
            return candidate
    raise KernelSourceNotFoundError(
        f"no kernels/ folder: looked in {here / 'kernels'} and {here.parent / 'kernels'}"
    )


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
        raise KernelSourceNotFoundError(
            f"no kernel source {name!r} in {kernel_dir()}; expected one of {known}"
        )
    return path.read_text()


@dataclass(frozen=True)
class KernelVersion:
    """One paged-attention kernel: kernels/paged_attention_<number>_<name>.cu and how to launch it."""

    number: int
    name: str  # what the version adds, e.g. "half_warps"
    dtypes: tuple[torch.dtype, ...]  # element types it has entry points for
    threads: int  # threads per block
    guard: bool  # checks page ids in the kernel, records the first bad one (kernel_error_buffer)
    summary: str  # one line: what it adds

    @property
    def file(self) -> str:
        """The file stem, also the float32 entry point's name."""
        return f"paged_attention_{self.number}_{self.name}"

    def function(self, dtype: torch.dtype) -> str:
        """The entry point for an element type: the stem, then _f16 / _bf16 for 16-bit types."""
        return self.file + DTYPE_SUFFIX[dtype]


# every version the course has, in order; kernel_versions() keeps those whose file is present
VERSIONS: tuple[KernelVersion, ...] = (
    KernelVersion(
        1, "plain", (torch.float32,), 128, False, "scores in shared memory, three passes (notebook 05)"
    ),
    KernelVersion(2, "warp_softmax", FLOAT_DTYPES, 256, False, "a warp per token, online softmax per warp"),
    KernelVersion(3, "vector_loads", FLOAT_DTYPES, 256, False, "lanes own consecutive dims: 16-byte loads"),
    KernelVersion(4, "half_warps", FLOAT_DTYPES, 256, False, "16-bit rows in half warps: 2 tokens a warp"),
    KernelVersion(
        5, "gqa_split", FLOAT_DTYPES, 128, True, "a block per KV head, split contexts, fewer shuffles, guard"
    ),
)


@functools.cache
def _present_versions() -> tuple[KernelVersion, ...]:
    """The versions whose .cu file is present (a missing file: simply absent), looked up once (~100 us)."""
    try:
        return tuple(v for v in VERSIONS if (kernel_dir() / f"{v.file}.cu").is_file())
    except KernelSourceNotFoundError:
        return ()


def kernel_versions() -> dict[int, KernelVersion]:
    """The versions whose .cu file is present (when first asked), by number."""
    return {v.number: v for v in _present_versions()}


def resolve_kernel_version(
    version: KernelVersion | int | str | None, dtype: torch.dtype | None = None
) -> KernelVersion:
    """A KernelVersion from a number (4), a name ("half_warps"), a stem ("4_half_warps") or itself; None
    picks the best: the highest-numbered version present that has an entry point for `dtype` (today 5 for
    every dtype; version 5 then chooses its own heads per block and context splits, see launch_plan)."""
    versions = kernel_versions()
    if isinstance(version, KernelVersion):
        chosen = version
    elif version is None:
        usable = [v for v in versions.values() if dtype is None or dtype in v.dtypes]
        if not usable:
            raise InvalidTypeError(
                f"no paged-attention kernel takes {dtype}; kernels exist for {FLOAT_DTYPES}"
            )
        return max(usable, key=lambda v: v.number)
    elif isinstance(version, str):
        found = [v for v in versions.values() if version in (v.name, f"{v.number}_{v.name}", v.file)]
        if not found:
            names = [f"{v.number}_{v.name}" for v in versions.values()]
            raise InvalidArgumentError(f"kernel_version {version!r} is not one of {names} (or their numbers)")
        chosen = found[0]
    else:
        number = as_int(version, "kernel_version")
        if number not in versions:
            raise InvalidArgumentError(
                f"kernel_version must be one of {sorted(versions)} (the kernels/ files present), got {number}"
            )
        chosen = versions[number]
    if dtype is not None and dtype not in chosen.dtypes:
        raise InvalidTypeError(
            f"kernel version {chosen.number} ({chosen.name}) supports {list(chosen.dtypes)}, got {dtype}"
        )
    return chosen


# ----------------------------------------------------------------------------- the launch plan


class LaunchPlan(NamedTuple):
    """How one call launches a version: the main kernel's shape and, for version 5, its work split."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int  # dynamic shared memory, bytes
    heads_per_block: int  # query heads one block serves (version 5: a GQA group, at most 4)
    num_splits: int  # context pieces per (sequence, head block); > 1 adds the merge kernel
    pages_per_split: int
    options: tuple[str, ...]  # extra NVRTC options (version 5 compiles one head-size copy per module)


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (asked once)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_plan(
    version: KernelVersion,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_num_blocks_per_seq: int,
    dtype: torch.dtype,
    sms: int,
    num_splits: int | None = None,
) -> LaunchPlan:
    """The launch of `version` for these sizes on a GPU with `sms` multiprocessors.

    Versions 1-4: one block per (sequence, query head). Version 5: one block per (sequence, group of
    heads_per_block query heads sharing a KV head, context piece); heads_per_block is the largest of 4, 2,
    1 that divides the GQA group (2 at most for 16-bit head sizes above 128: registers). The context is
    split when the grid would have fewer than SPLIT_TARGET_BLOCKS_PER_SM blocks per SM, into as many
    pieces as fill it but none shorter than MIN_SPLIT_TOKENS tokens. The lengths are not known on the
    host without a sync, so the pieces are cut from the block table's width (max_num_blocks_per_seq *
    block_size); a piece past a shorter sequence's end exits at once. `num_splits` forces a count."""
    chunks = cdiv(head_size, WARP_SIZE)  # 32-dim chunks of a head
    if version.number < 5:
        if version.number == 1:
            shared_mem = (max_num_blocks_per_seq * block_size + version.threads) * 4  # scores + scratch
        else:
            shared_mem = (version.threads // 16) * (head_size + 2) * 4  # per lane group: max, sum, output
        return LaunchPlan(
            (num_seqs, num_heads, 1), (version.threads, 1, 1), shared_mem, 1, 1, max_num_blocks_per_seq, ()
        )
    group = num_heads // num_kv_heads
    sixteen = dtype != torch.float32
    hb_max = 1 if group == 1 else (2 if sixteen and chunks > 4 else 4)
    heads_per_block = max(h for h in (4, 2, 1) if h <= hb_max and group % h == 0)
    compiled_hb = 1 if heads_per_block == 1 else hb_max  # the copy's HBMAX (registers, shared memory)
    blocks = num_seqs * (num_heads // heads_per_block)
    if num_splits is None:
        target = SPLIT_TARGET_BLOCKS_PER_SM * sms
        longest = max_num_blocks_per_seq * block_size
        num_splits = 1 if blocks >= target else min(cdiv(target, blocks), max(1, longest // MIN_SPLIT_TOKENS))
    num_splits = max(1, min(num_splits, max_num_blocks_per_seq))
    pages_per_split = cdiv(max_num_blocks_per_seq, num_splits)
    num_splits = cdiv(max_num_blocks_per_seq, pages_per_split)  # no empty piece at the end
    lane_group = 16 if sixteen else 32
    shared_mem = (version.threads // lane_group) * compiled_hb * (head_size + 2) * 4
    options = (f"-DVLLMINI_ONLY_CHUNKS={chunks}", f"-DVLLMINI_ONLY_GQA={int(heads_per_block > 1)}")
    grid = (num_seqs, num_heads // heads_per_block, num_splits)
    return LaunchPlan(
        grid, (version.threads, 1, 1), shared_mem, heads_per_block, num_splits, pages_per_split, options
    )


# ----------------------------------------------------------------------------- compiling


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
) -> torch.Tensor:
    """Launch one kernel version (None: the best, resolve_kernel_version) on contiguous inputs; fills and
    returns out. First checks what no kernel survives (runtime and devices, dtypes, layout, a guard record
    for a version without a guard), then `launch_paged_attention`. Sync-free: nothing is read back from
    the device. runtime "cupy" needs CUDA tensors, "emulator" CPU tensors. `error` turns on the in-kernel
    guard of versions that have one: bad page ids are never read, their rows come out NaN and the first
    one is recorded in `error` (see check_kernel_errors); without it the kernel trusts the tables.
    `num_splits` forces version 5's context split (tests); `source` (cupy only) launches another text
    with the same arguments, for benchmarks of variants."""
    kernel = resolve_kernel_version(version, query.dtype)
    one_of(runtime, "runtime", RUNTIMES)
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, out)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "out")
    for arg, t in zip(names[1:3], tensors[1:3], strict=True):
        if t.dtype != query.dtype:
            raise InvalidTypeError(f"{arg} must have the query's dtype {query.dtype}, got {t.dtype}")
    for arg, t in zip(names[3:5], tensors[3:5], strict=True):
        if t.dtype != torch.int32:
            raise InvalidTypeError(f"{arg} must be int32, got {t.dtype}")
    for arg, t in zip(names, tensors, strict=True):
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{arg} must be contiguous (vllmini.paged_attention makes it so)")
    if query.shape[1] % key_cache.shape[2] != 0:
        raise InvalidArgumentError(
            f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({key_cache.shape[2]})"
        )
    if runtime == "cupy" and any(t.device.type != "cuda" or t.device != query.device for t in tensors):
        raise InvalidArgumentError(
            f"runtime 'cupy' needs all tensors on one CUDA device; query is on {query.device}"
        )
    if runtime == "emulator" and any(t.device.type != "cpu" for t in tensors):
        raise InvalidArgumentError(f"runtime 'emulator' needs CPU tensors, query is on {query.device}")
    if out.dtype != query.dtype or out.shape != query.shape:
        raise InvalidArgumentError(
            f"out must be {query.dtype} {tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    if error is not None and not kernel.guard:
        raise InvalidArgumentError(
            f"kernel version {kernel.number} ({kernel.name}) has no in-kernel guard; pass error=None"
        )
    inputs = (query, key_cache, value_cache, block_tables, seq_lens)
    return launch_paged_attention(inputs, scale, out, runtime, kernel, error, num_splits, source)


def launch_paged_attention(
    inputs: tuple[torch.Tensor, ...],  # (query, key_cache, value_cache, block_tables, seq_lens)
    scale: float,
    out: torch.Tensor,
    runtime: str,
    kernel: KernelVersion,
    error: torch.Tensor | None = None,
    num_splits: int | None = None,
    source: str | None = None,
) -> torch.Tensor:
    """`paged_attention_kernel` after its checks, for a caller that made the same ones
    (vllmini.paged_attention). Raises only for the limits of the kernel and the GPU (head size, grid,
    shared memory), which depend on the launch alone and no caller checks."""
    query, key_cache, value_cache, block_tables, seq_lens = inputs
    assert out.shape == query.shape and out.dtype == query.dtype and (error is None or kernel.guard)
    (num_seqs, num_heads, head_size), (_, block_size, num_kv_heads, _) = query.shape, key_cache.shape
    if kernel.number > 1 and head_size > MAX_HEAD_SIZE:
        raise InvalidArgumentError(
            f"kernel version {kernel.number} supports head_size <= {MAX_HEAD_SIZE}, got {head_size}"
        )
    if num_heads > MAX_GRID_YZ:
        raise InvalidArgumentError(f"num_heads must be <= {MAX_GRID_YZ} (gridDim.y), got {num_heads}")
    if num_seqs == 0:
        return out
    sms = num_sms(query.device.index) if runtime == "cupy" else EMULATOR_SMS
    width = block_tables.shape[1]  # max_num_blocks_per_seq
    plan = launch_plan(
        kernel, num_seqs, num_heads, num_kv_heads, head_size, block_size, width, query.dtype, sms, num_splits
    )
    if plan.shared_mem > MAX_SHARED_BYTES:  # version 1 keeps every score of the context in shared memory
        raise InvalidArgumentError(
            f"kernel version {kernel.number} needs {plan.shared_mem} bytes of shared memory for a block "
            f"table of {width} x {block_size} tokens; at most {MAX_SHARED_BYTES} (H100/H200)"
        )
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


# ----------------------------------------------------------------------------- the in-kernel guard's record


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def kernel_error_buffer(device: torch.device | str) -> torch.Tensor:
    """The int32 [5] buffer the guarded kernels on `device` record their first violation in (made on
    first use: make one guarded call before capturing a CUDA graph)."""
    device = _normalize_device(device)
    if device not in _error_buffers:
        _error_buffers[device] = torch.zeros(ERROR_FIELDS, dtype=torch.int32, device=device)
    return _error_buffers[device]


def check_kernel_errors(device: torch.device | str | None = None) -> None:
    """Raise InvalidBlockTableError if a guarded kernel call (validate="guard", the default for CUDA
    tensors) saw a bad block id or seq_len since the last check; clears the record. One device->host
    copy (a sync) per device checked: call it once per step (the engine does, before committing a
    step), not per layer. `device` None checks every device that has a record."""
    devices = list(_error_buffers) if device is None else [_normalize_device(device)]
    for d in devices:
        buf = _error_buffers.get(d)
        if buf is None:
            continue
        flag, seq, entry, value, limit = buf.tolist()
        if not flag:
            continue
        buf.zero_()
        if entry < 0:
            raise InvalidBlockTableError(
                f"seq_lens[{seq}] = {value} is out of range: expected 1 .. max_num_blocks_per_seq * "
                f"block_size = {limit} (seen on {d} by the in-kernel guard; that sequence's output is NaN)"
            )
        raise InvalidBlockTableError(
            f"block_tables[{seq}, {entry}] = {value} is not a block id in [0, {limit}) (seen on {d} by the "
            f"in-kernel guard of a paged_attention call since the last check; that sequence's output is NaN)"
        )

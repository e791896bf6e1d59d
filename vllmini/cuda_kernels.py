"""The CUDA kernels of kernels/paged_attention_<n>_<what it adds>.cu: the registry (VERSIONS), the launch
plan, and a launch on torch tensors through "cupy" (NVRTC, cuLaunchKernel on torch's current stream) or the
"emulator" (the same source on the CPU). `paged_attention_kernel` is the checked public launch."""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
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
MAX_HEAD_SIZE = 256  # versions 3-9: head_size / 32 floats per lane in registers
TENSOR_CORE_HEAD_SIZES = (64, 128)  # version 10: one compiled copy per head size
TENSOR_CORE_ARCH = (8, 0)  # mma.sync m16n8k16 with bf16 inputs: sm_80 and newer
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
DEFAULT_SHARED_BYTES = 48 * 1024  # dynamic shared memory a block gets without opting in
MAX_SHARED_BYTES = 232448  # the most an H100/H200 block may opt into (227 KiB); less on older GPUs
EMULATOR_SMS = 4  # the "multiprocessors" launch_plan assumes for the emulator (a CPU runs blocks one by one)
# Blocks resident on one SM (an H200's, measured with cuOccupancyMaxActiveBlocksPerMultiprocessor): the
# split rule fills one wave of them. Version 9: 118-128 registers x 128 threads, 4 blocks; its 16-bit GQA
# copies 157-158 registers, 3. Version 10: 168 registers, 3.
SPLIT_BLOCKS_PER_SM = 4
GQA16_BLOCKS_PER_SM = 3
TENSOR_CORE_BLOCKS_PER_SM = 3
MAX_SPLITS = 4  # a grid that fills a wave already is cut in at most this many pieces (the fullest last wave)
MIN_SPLIT_TOKENS = 256  # no context piece shorter than this (the merge would cost more than it gains)
MERGE_THREADS = 128
LAYER_OP_THREADS = 256  # kernels/layer_ops.cu's THREADS: its largest head size
LAYER_OP_HIDDEN = 256 * 32  # kernels/layer_ops.cu's add_rms_norm: THREADS * ROW_VALUES
ERROR_FIELDS = 5  # the guard's record: flag, sequence, table entry (-1: seq_lens), value, limit

_error_buffers: dict[torch.device, torch.Tensor] = {}  # device -> int32 [ERROR_FIELDS], zero when clean


def kernel_dir() -> Path:
    """The folder of .cu files: vllmini/kernels/ inside an installed wheel, else the checkout's kernels/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if candidate.is_dir():
            return candidate
    raise KernelSourceNotFoundError(f"no kernels/ folder in {here} or {here.parent}")


def kernel_files(include_bugs: bool = True) -> list[Path]:
    """Every .cu file under kernel_dir(), sorted; the planted-bug kernels of kernels/bugs/ when asked."""
    files = sorted(kernel_dir().rglob("*.cu"))
    return [f for f in files if include_bugs or "bugs" not in f.relative_to(kernel_dir()).parts]


def read_kernel_source(name: str) -> str:
    """The text of kernels/<name>.cu; name may include a subfolder ("bugs/x") and may end in .cu."""
    path = kernel_dir() / (name if name.endswith(".cu") else f"{name}.cu")
    if not path.is_file():
        known = [str(f.relative_to(kernel_dir()).with_suffix("")) for f in kernel_files()]
        raise KernelSourceNotFoundError(f"no kernel source {name!r} in {kernel_dir()}; one of {known}")
    return path.read_text()


@dataclass(frozen=True)
class KernelVersion:
    """One paged-attention kernel (kernels/paged_attention_<number>_<name>.cu): version n - 1 plus `name`."""

    number: int
    name: str  # the one idea it adds, e.g. "half_warps"
    dtypes: tuple[torch.dtype, ...]  # element types it has entry points for
    threads: int  # threads per block
    summary: str  # one line: what it adds

    @property
    def file(self) -> str:
        """The file stem, also the float32 entry point's name."""
        return f"paged_attention_{self.number}_{self.name}"

    def function(self, dtype: torch.dtype) -> str:
        """The entry point for an element type: the stem, then _f16 / _bf16 for 16-bit types."""
        return self.file + DTYPE_SUFFIX[dtype]

    def has(self, idea: str) -> bool:
        """Whether this version has `idea` (a version's name): its own, or an earlier version's."""
        return self.number >= IDEAS[idea]

    @property
    def guard(self) -> bool:
        """Checks page ids and lengths in the kernel and records the first bad one (kernel_error_buffer)."""
        return self.has("guard")


# every version, in order, each the previous one plus one idea: (number, name, dtypes, threads, summary)
FP32 = (torch.float32,)
VERSIONS: tuple[KernelVersion, ...] = tuple(KernelVersion(*row) for row in (
    (1, "plain", FP32, 128, "scores in shared memory, three passes (notebook 05b)"),
    (2, "warp_per_token", FP32, 128, "a warp per token: lanes split a K row, a shuffle sums them"),
    (3, "online_softmax", FP32, 128, "one pass: a running max, sum and output per warp, no scores"),
    (4, "loads_in_flight", FP32, 256, "more bytes in flight: 16-byte loads, 8 rows a warp before use"),
    (5, "half_warps", FLOAT_DTYPES, 256, "16-bit caches: a row to half a warp, 2 tokens a warp"),
    (6, "kv_head_blocks", FLOAT_DTYPES, 256, "one block per KV head serves its query group"),
    (7, "split_context", FLOAT_DTYPES, 256, "long contexts split over blocks, merged by log-sum-exp"),
    (8, "fewer_instructions", FLOAT_DTYPES, 128, "transposed butterfly, one exp2 a lane, output in the input "
     "dtype"),
    (9, "guard", FLOAT_DTYPES, 128, "page ids and lengths checked in the kernel, without a host sync"),
    (10, "tensor_cores", FLOAT_DTYPES[1:], 128, "a GQA group packed into an mma tile: QK^T and P.V on tensor "
     "cores"),
))  # fmt: skip
IDEAS = {v.name: v.number for v in VERSIONS}  # idea -> the version that adds it
TENSOR_CORES = IDEAS["tensor_cores"]  # the version the auto rule picks for a 16-bit GQA group


@functools.cache
def kernel_versions() -> Mapping[int, KernelVersion]:
    """The versions whose .cu file is present (looked up once, ~100 us), by number; read-only."""
    try:
        return MappingProxyType({v.number: v for v in VERSIONS if (kernel_dir() / f"{v.file}.cu").is_file()})
    except KernelSourceNotFoundError:
        return MappingProxyType({})


def resolve_kernel_version(
    version: KernelVersion | int | str | None,  # None: 10 for a 16-bit GQA group on tensor cores, else 9
    dtype: torch.dtype | None = None,
    *,
    head_size: int | None = None,  # 9 is picked for 64 or 128
    group: int = 1,
    tensor_cores: bool = True,  # sm_80+, or the emulator
) -> KernelVersion:
    """A KernelVersion from a number, a name ("half_warps"), a stem ("5_half_warps") or itself."""
    versions = kernel_versions()
    if version is None:
        tc = versions.get(TENSOR_CORES)
        if tc and dtype in tc.dtypes and head_size in TENSOR_CORE_HEAD_SIZES and group > 1 and tensor_cores:
            return tc
        usable = [v for n, v in versions.items() if n < TENSOR_CORES and (dtype is None or dtype in v.dtypes)]
        if not usable:
            raise InvalidTypeError(f"no paged-attention kernel takes {dtype}, only {FLOAT_DTYPES}")
        return usable[-1]
    if isinstance(version, str):
        found = [v for v in versions.values() if version in (v.name, f"{v.number}_{v.name}", v.file)]
        if not found:
            names = [f"{v.number}_{v.name}" for v in versions.values()]
            raise InvalidArgumentError(f"kernel_version {version!r} is not one of {names} (or their numbers)")
        version = found[0]
    elif not isinstance(version, KernelVersion):
        if (number := as_int(version, "kernel_version")) not in versions:
            raise InvalidArgumentError(
                f"kernel_version must be one of {sorted(versions)} (the kernels/ files present), got {number}"
            )
        version = versions[number]
    if dtype is not None and dtype not in version.dtypes:
        raise InvalidTypeError(
            f"kernel version {version.number} ({version.name}) supports {list(version.dtypes)}, got {dtype}"
        )
    return version


@functools.cache
def has_tensor_cores(device_index: int) -> bool:
    """True when the CUDA device runs version 10's mma.sync m16n8k16 (sm_80 or newer; asked once)."""
    return torch.cuda.get_device_capability(device_index) >= TENSOR_CORE_ARCH


class LaunchPlan(NamedTuple):
    """How one call launches a version: the main kernel's shape and, from version 6, its work split."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int  # dynamic shared memory, bytes
    heads_per_block: int  # query heads one block serves (a GQA group, or part of one)
    num_splits: int  # context pieces per (sequence, head block); > 1 adds the merge kernel
    pages_per_split: int
    options: tuple[str, ...]  # extra NVRTC options (versions 8-10 compile one copy per module)


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (asked once)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=4096)
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
    max_seq_len: int | None = None,
) -> LaunchPlan:
    """The launch of `version` on `sms` multiprocessors (cached; notebook 07 tells the rule): a block per
    (sequence, query head) for 1-5, per (sequence, heads of a group) from 6, per context piece too from 7."""
    chunks, block = cdiv(head_size, WARP_SIZE), (version.threads, 1, 1)  # 32-dim chunks of a head
    if not version.has("kv_head_blocks"):
        if not version.has("online_softmax"):
            shared_mem = (max_num_blocks_per_seq * block_size + version.threads) * 4  # scores + scratch
        else:
            shared_mem = (version.threads // 16) * (head_size + 2) * 4  # per lane group: max, sum, output
        return LaunchPlan((num_seqs, num_heads, 1), block, shared_mem, 1, 1, max_num_blocks_per_seq, ())
    group = num_heads // num_kv_heads
    longest = max_num_blocks_per_seq * block_size if max_seq_len is None else max_seq_len
    used = min(cdiv(longest, block_size), max_num_blocks_per_seq)  # the pages the pieces cover
    sixteen = dtype != torch.float32
    if not version.has("tensor_cores"):
        hb_max = 1 if group == 1 else (2 if sixteen and chunks > 4 else 4)
        heads_per_block = max(h for h in (4, 2, 1) if h <= hb_max and group % h == 0)
        lane_groups = version.threads // (16 if sixteen else 32)
        if version.has("fewer_instructions"):  # shared memory strided by the compiled copy's HBMAX
            shared_mem = lane_groups * (1 if heads_per_block == 1 else hb_max) * (head_size + 2) * 4
            options = (f"-DVLLMINI_ONLY_CHUNKS={chunks}", f"-DVLLMINI_ONLY_GQA={int(heads_per_block > 1)}")
        else:
            shared_mem, options = lane_groups * heads_per_block * (head_size + 2) * 4, ()
        slots = (GQA16_BLOCKS_PER_SM if sixteen and heads_per_block > 1 else SPLIT_BLOCKS_PER_SM) * sms
    else:
        heads_per_block = max(h for h in range(1, 17) if group % h == 0)
        rows16 = heads_per_block > 8
        shared_mem = (version.threads // WARP_SIZE) * (16 if rows16 else 8) * (head_size + 2) * 4
        options = (f"-DVLLMINI_ONLY_HEAD={head_size}", f"-DVLLMINI_ONLY_ROWS16={int(rows16)}")
        slots = TENSOR_CORE_BLOCKS_PER_SM * sms
    blocks = num_seqs * (num_heads // heads_per_block)
    if not version.has("split_context"):
        num_splits = 1
    elif num_splits is None:
        num_splits = _num_splits(blocks, slots, longest)
    num_splits = max(1, min(num_splits, used))
    pages_per_split = cdiv(used, num_splits)
    num_splits = cdiv(used, pages_per_split)  # no empty piece at the end
    grid = (num_seqs, num_heads // heads_per_block, num_splits)
    return LaunchPlan(grid, block, shared_mem, heads_per_block, num_splits, pages_per_split, options)


def _num_splits(blocks: int, slots: int, longest: int) -> int:
    """Context pieces for `blocks` on `slots` resident blocks: one wave or less, fill it; more, the fullest
    last wave (pieces of at least MIN_SPLIT_TOKENS)."""
    most = max(1, longest // MIN_SPLIT_TOKENS)
    if blocks <= slots:
        return max(1, min(slots // blocks, most))
    fill = lambda s: cdiv(blocks * s, slots) * slots / (blocks * s)  # noqa: E731  (ceil(waves) / waves)
    return min(range(1, min(MAX_SPLITS, most) + 1), key=fill)


def _nvrtc():
    """CuPy's NVRTC binding, its library loaded (e.g. from nvidia-cuda-nvrtc-cu12); else KernelBuildError."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise KernelBuildError("CUDA needs CuPy: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12") from e
    try:
        nvrtc.getVersion()
    except Exception as e:  # CuPy raises several types when the shared library is missing
        raise KernelBuildError(f"cannot load NVRTC ({e!r}); pip install nvidia-cuda-nvrtc-cu12") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loads."""
    return tuple(_nvrtc().getVersion())


def compile_for_arch(source: str, arch: str, *, name: str = "kernel.cu", options: tuple = ()) -> bytes:
    """NVRTC, no GPU needed: a cubin for "sm_XX", PTX for "compute_XX"; KernelBuildError with the log."""
    if not (arch.startswith("sm_") or arch.startswith("compute_")) or not arch.split("_", 1)[1].isdigit():
        raise InvalidArgumentError(f"arch must look like 'sm_80' or 'compute_80', got {arch!r}")
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS, *options])
        return nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
    except Exception as e:
        raise KernelBuildError(
            f"NVRTC failed to compile {name} for {arch}:\n{nvrtc.getProgramLog(prog)}"
        ) from e
    finally:
        nvrtc.destroyProgram(prog)


@functools.cache
def _cupy_module(file: str, device: int, source: str | None, options: tuple):
    """cupy.RawModule of kernels/<file>.cu (or `source`: benchmarks comparing variants), once per device."""
    import cupy

    code = read_kernel_source(file) if source is None else source
    return cupy.RawModule(code=code, options=(*NVRTC_OPTIONS, *options))  # compiled on first get_function


@functools.cache
def _cupy_kernel(file: str, function: str, device: int, source: str | None = None, options: tuple = ()):
    """cupy.RawKernel for kernels/<file>.cu::function on a device, compiled once per set of options."""
    import cupy

    with cupy.cuda.Device(device):
        return _cupy_module(file, device, source, options).get_function(function)


@functools.cache
def _emulator_kernel(file: str, function: str):
    """vllmini.emulator.RawKernel for kernels/<file>.cu::function (the emulator caches the build)."""
    from vllmini.emulator import RawKernel

    return RawKernel(read_kernel_source(file), function)


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
    num_splits: int | None = None,  # forces a split (tests)
    source: str | None = None,  # another kernel text (benchmarks)
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Check what no kernel survives, launch one version (None: the auto rule) sync-free, fill `out`."""
    one_of(runtime, "runtime", RUNTIMES)
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, out)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "out")
    for i, (arg, t) in enumerate(zip(names, tensors, strict=True)):
        if i in (1, 2) and t.dtype != query.dtype:
            raise InvalidTypeError(f"{arg} must have the query's dtype {query.dtype}, got {t.dtype}")
        if i in (3, 4) and t.dtype != torch.int32:
            raise InvalidTypeError(f"{arg} must be int32, got {t.dtype}")
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{arg} must be contiguous (vllmini.paged_attention makes it so)")
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
    check_head_layout(query.shape[1], key_cache.shape[2])
    kernel = resolve_call_version(version, query, key_cache.shape[2], runtime)
    if error is not None and not kernel.guard:
        raise InvalidArgumentError(f"kernel version {kernel.number} has no in-kernel guard; pass error=None")
    return launch_paged_attention(
        tensors[:5], scale, out, runtime, kernel, error, num_splits, source, max_seq_len
    )


def check_head_layout(num_heads: int, num_kv_heads: int) -> None:
    """num_heads a positive multiple of num_kv_heads (each KV head serves a group of query heads)."""
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )


def resolve_call_version(version, query: torch.Tensor, num_kv_heads: int, runtime: str) -> KernelVersion:
    """resolve_kernel_version for a call on `query` (head layout checked): dtype, head size, group, GPU."""
    _, num_heads, head_size = query.shape
    cores, group = runtime == "emulator" or has_tensor_cores(query.device.index), num_heads // num_kv_heads
    return resolve_kernel_version(version, query.dtype, head_size=head_size, group=group, tensor_cores=cores)


def launch_paged_attention(
    inputs: tuple[torch.Tensor, ...],  # (query, key_cache, value_cache, block_tables, seq_lens)
    scale: float,
    out: torch.Tensor,
    runtime: str,
    kernel: KernelVersion,
    error: torch.Tensor | None = None,
    num_splits: int | None = None,
    source: str | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """`paged_attention_kernel` after its checks (vllmini.paged_attention makes its own): plan_call, run."""
    query, key_cache, _, block_tables, _ = inputs
    shapes = (query.shape, key_cache.shape, block_tables.shape[1])
    call = plan_call(kernel, runtime, query.device, query.dtype, *shapes, num_splits, max_seq_len, source)
    return out if call is None else call.run(inputs, out, error, scale)


# torch's current stream of a device, as an int
_raw_stream = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream
)


class PreparedCall(NamedTuple):
    """Everything the calls of one shape share (`plan_call`); `run` launches one call."""

    plan: LaunchPlan
    main: object  # the kernel, called as (grid, block, shared_mem, stream, *values): _Packer or _emulated
    merge: object | None  # the same for the merge kernel when the context is split, else None
    ints: tuple[int, ...]  # the main kernel's int32 arguments, in its signature's order
    part_floats: int  # floats of part_out and part_ml together, 0 without a split
    device: torch.device
    kernel: KernelVersion
    head_size: int

    def run(self, inputs: tuple, out: torch.Tensor, error: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Allocate the split's partials, gather the pointers, launch on torch's current stream: fills out."""
        query, key_cache, value_cache = inputs[:3]
        if (query.data_ptr() | key_cache.data_ptr() | value_cache.data_ptr()) & 15:
            # the kernels read 16-byte vectors: a view that starts mid-row (an odd storage offset) is copied
            inputs = tuple(t if t.data_ptr() % 16 == 0 else t.clone() for t in inputs)
        plan, device, kernel = self.plan, self.device, self.kernel
        out_raw, part_out, part_ml = out, 0, 0
        if out.dtype != torch.float32 and not kernel.has("fewer_instructions"):
            out_raw = torch.empty(out.shape, device=device)  # versions 1-7 write float32: rounded once, after
        values = [out_raw.data_ptr()]
        if kernel.has("split_context"):
            if self.merge is not None:
                part = torch.empty(self.part_floats, dtype=torch.float32, device=device)  # part_out, part_ml
                part_out = part.data_ptr()
                part_ml = part_out + 4 * self.part_floats // (self.head_size + 2) * self.head_size
            values += (part_out, part_ml)
        values += [t.data_ptr() for t in inputs]
        if kernel.guard:
            values.append(0 if error is None else error.data_ptr())
        stream = 0
        if device.type == "cuda":
            if torch.cuda.current_device() != device.index:
                with torch.cuda.device(device.index):  # the kernels belong to the device's context
                    return self.run(inputs, out, error, scale)
            stream = _raw_stream(device.index)
        self.main(plan.grid, plan.block, plan.shared_mem, stream, *values, *self.ints, scale)
        if self.merge is not None:
            grid = (plan.grid[0], plan.grid[1] * plan.heads_per_block, 1)  # (sequence, query head)
            merge_values = (out_raw.data_ptr(), part_out, part_ml, plan.num_splits, self.head_size)
            self.merge(grid, (MERGE_THREADS, 1, 1), 0, stream, *merge_values)
        if out_raw is not out:
            out.copy_(out_raw)
        return out


@functools.lru_cache(maxsize=1024)
def plan_call(
    kernel, runtime, device, dtype, q_shape, kc_shape, width, num_splits=None, max_seq_len=None, source=None
) -> PreparedCall | None:
    """The plan half of a call, once per shape: its checks, plan, kernels, int arguments (None: no seqs)."""
    (num_seqs, num_heads, head_size), (num_blocks, block_size, num_kv_heads, _) = q_shape, kc_shape
    tensor_cores = kernel.has("tensor_cores")
    if tensor_cores and head_size not in TENSOR_CORE_HEAD_SIZES:
        raise InvalidArgumentError(
            f"kernel version {kernel.number} supports head_size 64 or 128, got {head_size}"
        )
    if kernel.number > 1 and head_size > MAX_HEAD_SIZE:
        raise InvalidArgumentError(
            f"kernel version {kernel.number}: head_size <= {MAX_HEAD_SIZE}, got {head_size}"
        )
    if num_heads > MAX_GRID_YZ:
        raise InvalidArgumentError(f"num_heads must be <= {MAX_GRID_YZ} (gridDim.y), got {num_heads}")
    if runtime == "cupy" and tensor_cores and not has_tensor_cores(device.index):
        raise InvalidArgumentError(
            f"kernel version {kernel.number} needs tensor cores (sm_80+); {device} has none"
        )
    if max_seq_len is not None:
        max_seq_len = as_int(max_seq_len, "max_seq_len", min=1, max=width * block_size)
    if num_seqs == 0:
        return None
    sms = num_sms(device.index) if runtime == "cupy" else EMULATOR_SMS
    sizes = (num_seqs, num_heads, num_kv_heads, head_size, block_size, width)
    plan = launch_plan(kernel, *sizes, dtype, sms, num_splits, max_seq_len)
    if plan.shared_mem > MAX_SHARED_BYTES:  # version 1 keeps every score of the context in shared memory
        raise InvalidArgumentError(
            f"kernel version {kernel.number} needs {plan.shared_mem} bytes of shared memory for a block "
            f"table of {width} x {block_size} tokens; at most {MAX_SHARED_BYTES} (H100/H200)"
        )
    # the arguments each idea adds to the signature: (num_blocks), heads_per_block, pages_per_split
    ints = (num_blocks,) * kernel.guard + (block_size, num_heads, head_size, num_kv_heads, width)
    ints += (plan.heads_per_block,) * kernel.has("kv_head_blocks")
    ints += (plan.pages_per_split,) * kernel.has("split_context")
    split = plan.num_splits > 1
    merge_name = f"{kernel.file}_merge" + (DTYPE_SUFFIX[dtype] if kernel.has("fewer_instructions") else "")
    names, file, index = (kernel.function(dtype), merge_name if split else None), kernel.file, device.index
    if runtime == "emulator":
        main, merge = (name and functools.partial(_emulated, _emulator_kernel(file, name)) for name in names)
    else:  # from version 8: plan.options pick one copy of the kernel per module
        main, merge = (name and _cupy_kernel(file, name, index, source, plan.options) for name in names)
        if plan.shared_mem > DEFAULT_SHARED_BYTES and main.max_dynamic_shared_size_bytes < plan.shared_mem:
            main.max_dynamic_shared_size_bytes = plan.shared_mem  # opt in (raises if the GPU has less)
        pointers = 6 + 2 * kernel.has("split_context") + kernel.guard  # out, (partials), inputs, (error)
        main, merge = _Packer(main, pointers, len(ints), 1), merge and _Packer(merge, 3, 2, 0)
    part_floats = num_seqs * num_heads * plan.num_splits * (head_size + 2) if split else 0
    return PreparedCall(plan, main, merge, ints, part_floats, device, kernel, head_size)


class _Packer:
    """A cupy kernel and its cuLaunchKernel arguments, an 8-byte slot each, packed per launch (one thread)."""

    def __init__(self, kernel, pointers: int, ints: int, floats: int):
        from cupy_backends.cuda.api import driver

        self.launch, self.function = driver.launchKernel, kernel.kernel.ptr
        n = pointers + ints + floats
        self.struct = struct.Struct("<" + "Q" * pointers + "i4x" * ints + "f4x" * floats)
        self.buffer = ctypes.create_string_buffer(8 * n)
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
        self.address = ctypes.addressof(self.params)

    def __call__(self, grid, block, shared_mem: int, stream: int, *values) -> None:
        self.struct.pack_into(self.buffer, 0, *values)
        self.launch(self.function, *grid, *block, shared_mem, stream, self.address, 0)


def launch_layer_op(name: str, like: torch.Tensor, grid: tuple, tensors, ints=(), floats=()) -> None:
    """One launch of kernels/layer_ops.cu::<name> (_f16, _bf16: like's dtype) on like's device (CPU: the
    emulator); arguments in the signature's order: tensors (None: a null pointer), int32s, float32s."""
    file, pointers = "layer_ops", tuple(0 if t is None else t.data_ptr() for t in tensors)
    function, device = name + DTYPE_SUFFIX[like.dtype], like.device
    grid, block = (*grid, 1, 1, 1)[:3], (LAYER_OP_THREADS, 1, 1)
    if device.type == "cpu":
        return _emulated(_emulator_kernel(file, function), grid, block, 0, 0, *pointers, *ints, *floats)
    packer = _layer_op_packer(file, function, device.index, len(pointers), len(ints), len(floats))
    packer(grid, block, 0, _raw_stream(device.index), *pointers, *ints, *floats)


@functools.cache
def _layer_op_packer(file: str, function: str, device: int, pointers: int, ints: int, floats: int):
    return _Packer(_cupy_kernel(file, function, device), pointers, ints, floats)


def _emulated(kernel, grid, block, shared_mem: int, stream: int, *values) -> None:
    """An emulator kernel behind _Packer's call: the same values (pointers as raw CPU addresses)."""
    values = tuple(np.float32(v) if type(v) is float else v for v in values)  # the scale, as _Packer packs it
    kernel(grid, block, values, shared_mem=shared_mem)


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def kernel_error_buffer(device: torch.device | str) -> torch.Tensor:
    """The int32 [5] record of the guarded kernels on `device` (made on first use: before a graph capture)."""
    device = _normalize_device(device)
    if device not in _error_buffers:
        _error_buffers[device] = torch.zeros(ERROR_FIELDS, dtype=torch.int32, device=device)
    return _error_buffers[device]


def check_kernel_errors(device: torch.device | str | None = None) -> None:
    """Raise (and clear) what a guarded kernel recorded since the last check; one sync: once per step."""
    for d in list(_error_buffers) if device is None else [_normalize_device(device)]:
        buf = _error_buffers.get(d)
        flag, seq, entry, value, limit = [0] * ERROR_FIELDS if buf is None else buf.tolist()
        if not flag:
            continue
        buf.zero_()
        what = f"block_tables[{seq}, {entry}] = {value} is not a block id in [0, {limit})"
        if entry < 0:
            what = f"seq_lens[{seq}] = {value} is out of range: expected 1 .. {limit} (the table's tokens)"
        raise InvalidBlockTableError(
            f"{what} (seen on {d} by the in-kernel guard since the last check; that sequence's output is NaN)"
        )

"""RawKernel / RawModule: launch compiled CUDA source on CPU tensors, in process or under AddressSanitizer."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from vllmini.emulator import _build
from vllmini.errors import VllminiError

MAX_THREADS_PER_BLOCK = 1024
_MAX_BLOCK = (1024, 1024, 64)
_MAX_GRID = (2**31 - 1, 65535, 65535)
_launch_lock = threading.Lock()  # the runtime keeps its state in globals: one launch at a time


class KernelError(VllminiError):
    """The kernel did something CUDA leaves undefined: a deadlock, a bad warp mask, a failed assert, ..."""


class OutOfBoundsError(KernelError):
    """Checked mode: the kernel read or wrote outside a buffer argument (access, buffer, offset, line)."""

    def __init__(
        self,
        message: str,
        *,
        access: str = "",
        buffer: str = "",
        offset: int | None = None,
        line: int | None = None,
        report: str = "",
    ):
        super().__init__(message)
        self.access, self.buffer, self.offset, self.line, self.report = access, buffer, offset, line, report


# element kind + size of the C type -> accepted dtypes (torch or numpy names)
_KIND_DTYPES = {
    "f4": {"float32"},
    "f8": {"float64"},
    "h2": {"float16"},
    "b2": {"bfloat16"},
    "i1": {"int8"},
    "i2": {"int16"},
    "i4": {"int32"},
    "i8": {"int64"},
    "u1": {"uint8"},
    "u2": {"uint16"},
    "u4": {"uint32"},
    "u8": {"uint64"},
    "c1": {"int8", "uint8", "bool"},
    "B1": {"bool", "uint8"},
}
_SCALAR_CTYPES = {
    "f4": ctypes.c_float,
    "f8": ctypes.c_double,
    "i1": ctypes.c_int8,
    "i2": ctypes.c_int16,
    "i4": ctypes.c_int32,
    "i8": ctypes.c_int64,
    "u1": ctypes.c_uint8,
    "u2": ctypes.c_uint16,
    "u4": ctypes.c_uint32,
    "u8": ctypes.c_uint64,
    "c1": ctypes.c_int8,
    "B1": ctypes.c_bool,
}


def _dims(value: Any, what: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    dims = (
        (value,)
        if isinstance(value, (int, np.integer))
        else tuple(value)
        if isinstance(value, (tuple, list))
        else None
    )
    if dims is None or not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) for d in dims):
        raise ValueError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    for axis, (d, lim) in enumerate(zip(dims, limits, strict=True)):
        if not 1 <= d <= lim:
            raise ValueError(f"{what}[{axis}] = {d} is outside CUDA's range 1..{lim} (got {what}={value!r})")
    return dims


class RawKernel:
    """One `extern "C" __global__` function of CUDA source, run on the CPU; mirrors cupy.RawKernel.

    kernel = RawKernel(code, "vector_add"); kernel((blocks,), (threads,), (x, y, out, np.int32(n)))
    checked=True runs every launch in an AddressSanitizer child process that reports out-of-bounds accesses.
    schedule: "in_order" | "reverse" | an int seed (a seeded shuffle of the threads at every pass).
    filename: the name messages use for the source (default: the `// file.cu` the source's first line
    names, as kernel headers here do, else "<name>.cu").
    """

    def __init__(
        self,
        code: str,
        name: str,
        *,
        checked: bool = False,
        options: tuple[str, ...] = (),
        schedule: str | int = "in_order",
        filename: str | None = None,
    ):
        if not isinstance(code, str) or not isinstance(name, str):
            raise TypeError(f"code and name must be str, got {type(code).__name__} and {type(name).__name__}")
        kernels = _build.find_kernels(code)
        if name not in kernels:
            found = ", ".join(sorted(kernels)) or "none"
            raise ValueError(f"no `__global__ void {name}(...)` in the source (kernels found: {found})")
        self.code, self.name, self.checked, self.options = code, name, bool(checked), tuple(options)
        self.schedule = schedule
        _schedule_code(schedule)
        self.filename = filename or _source_name(code) or f"{name}.cu"
        self.info = kernels[name]
        self._uses_printf = "printf" in code  # then its output is captured and written to sys.stdout
        names = sorted(kernels)
        self._index = names.index(name)
        self._path = _build.build(code, self.filename, names, self.options, checked=self.checked)
        # the signature (C types as the compiler sees them) comes from the in-process library
        lib = _build.load(_build.build(code, self.filename, names, self.options, checked=False))
        self._lib = None if self.checked else lib
        self.param_codes = tuple(c for c in lib.emu_signature(self._index).decode().split(";") if c)
        if len(self.param_codes) != len(self.info.param_names):  # the source scan missed something
            self.info = _build.KernelInfo(
                name, tuple(f"arg{i}" for i in range(len(self.param_codes))), tuple(self.param_codes)
            )

    def __repr__(self) -> str:
        return f"RawKernel({self.name!r}, checked={self.checked}, schedule={self.schedule!r})"

    def __call__(
        self, grid: Any, block: Any, args: tuple, *, shared_mem: int = 0, schedule: str | int | None = None
    ) -> None:
        grid3 = _dims(grid, "grid", _MAX_GRID)
        block3 = _dims(block, "block", _MAX_BLOCK)
        threads = block3[0] * block3[1] * block3[2]
        if threads > MAX_THREADS_PER_BLOCK:
            raise ValueError(
                f"block {block!r} has {threads} threads; CUDA allows at most {MAX_THREADS_PER_BLOCK}"
            )
        if not 0 <= int(shared_mem) <= _build.DYNAMIC_SHARED_BYTES:
            raise ValueError(f"shared_mem={shared_mem} bytes is outside 0..{_build.DYNAMIC_SHARED_BYTES}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.param_codes):
            raise TypeError(
                f"{self.name} takes {len(self.param_codes)} arguments "
                f"({', '.join(self.info.param_names)}), got {len(args)}"
            )
        sched, seed = _schedule_code(self.schedule if schedule is None else schedule)
        converted = [self._convert(i, a) for i, a in enumerate(args)]
        if self.checked:
            _run_checked(self, converted, grid3, block3, sched, seed)
            return
        holders = [c for c, _ in converted]
        argv = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        g, b = (ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3)
        with _launch_lock, _kernel_stdout(self._uses_printf):
            rc = self._lib.emu_launch(self._index, argv, g, b, sched, seed)
            message = self._lib.emu_error().decode(errors="replace") if rc else ""
        if rc:
            raise KernelError(f"{self.name}: {message}")

    def check_schedules(
        self,
        grid: Any,
        block: Any,
        args: tuple,
        *,
        shared_mem: int = 0,
        schedules: tuple = ("in_order", "reverse", 1, 2),
    ) -> None:
        """Launch once per schedule on copies of the buffers; raise KernelError if any output differs.

        A result that depends on the order of the threads means a race: a missing __syncthreads(), two
        threads writing one place, a read of a slot another thread writes in the same phase. Outputs are
        compared bit for bit (NaN equals NaN); float atomics whose order changes the rounding also count.
        On success the buffers hold the first schedule's result, as after a normal launch.
        """
        converted = (
            [self._convert(i, a) for i, a in enumerate(args)] if len(args) == len(self.param_codes) else []
        )
        writable = [i for i, (_, buf) in enumerate(converted) if buf is not None and buf[3]]
        originals = {i: ctypes.string_at(converted[i][1][1], converted[i][1][2]) for i in writable}
        results = []
        for schedule in schedules:
            for i in writable:
                ctypes.memmove(converted[i][1][1], originals[i], len(originals[i]))
            self(grid, block, args, shared_mem=shared_mem, schedule=schedule)
            results.append({i: ctypes.string_at(converted[i][1][1], converted[i][1][2]) for i in writable})
        for schedule, result in zip(schedules[1:], results[1:], strict=True):
            for i in writable:
                if result[i] != results[0][i]:
                    where = _first_difference(args[i], results[0][i], result[i])
                    raise KernelError(
                        f"{self.name}: `{self.info.param_names[i]}` differs between schedule "
                        f"{schedules[0]!r} and {schedule!r} ({where}): the result depends on the order of "
                        f"the threads, a race "
                        f"(a missing __syncthreads()?)"
                    )
        for i in writable:  # leave the first schedule's result, like a plain launch
            ctypes.memmove(converted[i][1][1], results[0][i], len(results[0][i]))

    # -------------------------------------------------------- arguments
    def _describe(self, i: int) -> str:
        return f"argument {i} `{self.info.param_names[i]}` ({self.info.param_types[i]})"

    def _convert(self, i: int, arg: Any) -> tuple[ctypes._SimpleCData, Any]:
        """(ctypes holder of the value passed, the buffer object or None)."""
        code = self.param_codes[i]
        if code.startswith("X") or code[1:2] == "s" and code[0] == "S":
            raise TypeError(f"{self._describe(i)}: this parameter type is not supported by the emulator")
        if code[0] == "P":
            return _pointer_arg(self, i, code, arg)
        return _scalar_arg(self, i, code[1:], arg), None


def _first_difference(arg: Any, a: bytes, b: bytes) -> str:
    item = arg.element_size() if type(arg).__module__.startswith("torch") else getattr(arg, "itemsize", 1)
    diff = next(j for j in range(len(a)) if a[j] != b[j]) // item
    count = sum(a[j * item : (j + 1) * item] != b[j * item : (j + 1) * item] for j in range(len(a) // item))
    return f"{count} of {len(a) // item} elements, the first at flat index {diff}"


@contextmanager
def _kernel_stdout(enabled: bool):
    """Send what the C code prints to file descriptor 1 through sys.stdout (so notebooks show it)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            if text:
                sys.stdout.write(text)


def _source_name(code: str) -> str | None:
    """ "x.cu" when the source's first line is a header comment that starts with the file's name."""
    m = re.match(r"\s*//\s*([\w./-]+\.cu)\b", code)
    return m.group(1).rsplit("/", 1)[-1] if m else None


def _schedule_code(schedule: str | int) -> tuple[int, int]:
    if schedule == "in_order":
        return 0, 0
    if schedule == "reverse":
        return 1, 0
    if isinstance(schedule, (int, np.integer)) and not isinstance(schedule, bool):
        return 2, int(schedule) & (2**64 - 1)
    raise ValueError(f"schedule must be 'in_order', 'reverse' or an int seed, got {schedule!r}")


def _dtype_name(arg: Any) -> str:
    return str(arg.dtype).removeprefix("torch.")


def _pointer_arg(k: RawKernel, i: int, code: str, arg: Any) -> tuple[ctypes.c_void_p, Any]:
    elem = code[2:].split("x")[0]
    lanes = int(code.split("x")[1]) if "x" in code else 1
    writable = code[1] == "m"
    if arg is None:
        return ctypes.c_void_p(0), None
    if type(arg).__module__.startswith("torch"):
        if arg.device.type != "cpu":
            raise TypeError(f"{k._describe(i)}: the emulator runs on the CPU; got a tensor on {arg.device}")
        if not arg.is_contiguous():
            raise ValueError(
                f"{k._describe(i)}: tensor of shape {tuple(arg.shape)} is not contiguous; pass .contiguous()"
            )
        ptr, nbytes = arg.data_ptr(), arg.numel() * arg.element_size()
    elif isinstance(arg, np.ndarray):
        if not arg.flags.c_contiguous:
            raise ValueError(f"{k._describe(i)}: array of shape {arg.shape} is not C-contiguous")
        if writable and not arg.flags.writeable:
            raise ValueError(
                f"{k._describe(i)}: the kernel may write through this pointer; the array is read-only"
            )
        ptr, nbytes = arg.ctypes.data, arg.nbytes
    elif isinstance(arg, (int, np.integer, ctypes.c_void_p)) and not isinstance(arg, bool) and not k.checked:
        value = arg.value if isinstance(arg, ctypes.c_void_p) else int(arg)
        return ctypes.c_void_p(value), None  # a raw address: trusted, unchecked
    else:
        extra = " (checked mode needs the tensor itself, to know the buffer's size)" if k.checked else ""
        raise TypeError(
            f"{k._describe(i)}: expected a CPU torch tensor or numpy array, got {type(arg).__name__}{extra}"
        )
    accepted = _KIND_DTYPES.get(elem)
    if accepted is not None and _dtype_name(arg) not in accepted:
        raise TypeError(
            f"{k._describe(i)}: got a {_dtype_name(arg)} buffer, expected {' or '.join(sorted(accepted))}"
        )
    align = int(elem[1:]) * lanes if elem[1:].isdigit() else 1
    if ptr % max(1, align):
        raise ValueError(
            f"{k._describe(i)}: address {ptr:#x} is not aligned to {align} bytes as the type requires"
        )
    return ctypes.c_void_p(ptr), (arg, ptr, nbytes, writable)


def _scalar_arg(k: RawKernel, i: int, elem: str, arg: Any) -> ctypes._SimpleCData:
    ctype = _SCALAR_CTYPES.get(elem)
    if ctype is None:
        raise TypeError(f"{k._describe(i)}: scalar parameters of this type are not supported by the emulator")
    if type(arg).__module__.startswith("torch") or isinstance(arg, np.ndarray):
        raise TypeError(f"{k._describe(i)}: expected a scalar, got a {type(arg).__name__}")
    kind, size = elem[0], int(elem[1])
    if isinstance(arg, np.generic):
        # numpy scalars travel as their own bytes (as in CuPy), so the size and kind must match exactly
        want = {"f": "f", "i": "i", "u": "u", "c": "iu", "B": "b?"}[kind]
        if arg.dtype.itemsize != size or arg.dtype.kind not in want:
            raise TypeError(
                f"{k._describe(i)}: got numpy.{arg.dtype}, which is {arg.dtype.itemsize} bytes; "
                f"pass a {'np.float' if kind == 'f' else 'np.int' if kind != 'u' else 'np.uint'}{8 * size}"
            )
        return ctype(arg.item())
    if isinstance(arg, bool) or isinstance(arg, int) and kind in "iucB":
        value = int(arg)
        bits = 8 * size
        lo, hi = (0, 2**bits - 1) if kind in "uB" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        if not lo <= value <= hi:
            raise OverflowError(f"{k._describe(i)}: {value} does not fit in {bits} bits")
        return ctype(value)
    if isinstance(arg, (int, float)) and kind == "f":
        if size == 4:
            raise TypeError(
                f"{k._describe(i)}: a Python {type(arg).__name__} travels as an 8-byte double (CuPy does "
                f"the same), which a `float` parameter misreads; pass np.float32({arg!r})"
            )
        return ctype(float(arg))
    raise TypeError(f"{k._describe(i)}: cannot pass {type(arg).__name__} {arg!r}")


# ---------------------------------------------------------------- checked mode (AddressSanitizer child)
_ASAN_HEAD = re.compile(r"ERROR: AddressSanitizer: ([\w-]+)")
_ASAN_ACCESS = re.compile(r"(READ|WRITE) of size (\d+) at (0x[0-9a-f]+)")
_ASAN_REGION = re.compile(
    r"(0x[0-9a-f]+) is located (\d+) bytes (?:to the )?(after|before|right of|left of|inside of)"
    r" (?:the )?(\d+)-byte region \[(0x[0-9a-f]+),\s*(0x[0-9a-f]+)\)"
)
_BUFFER = re.compile(r"emu-buffer (\d+) (0x[0-9a-f]+|\(nil\)) (\d+)")


def _run_checked(k: RawKernel, converted: list, grid3: tuple, block3: tuple, sched: int, seed: int) -> None:
    with tempfile.TemporaryDirectory(prefix="vllmini-emu-") as tmp:
        lines = [
            f"{k._index} {' '.join(map(str, grid3))} {' '.join(map(str, block3))} "
            f"{sched} {seed} {len(converted)}"
        ]
        outputs = {}
        seen = {}
        for i, (holder, buf) in enumerate(converted):
            if buf is None and isinstance(holder, ctypes.c_void_p):
                lines.append("null")
                continue
            if buf is None:
                raw = ctypes.string_at(ctypes.addressof(holder), ctypes.sizeof(holder))
                lines.append(f"scalar {len(raw)} {raw.hex()}")
                continue
            _, ptr, nbytes, writable = buf
            if (ptr, nbytes) in seen:  # the same tensor twice: one buffer, as on the GPU
                lines.append(f"alias {seen[(ptr, nbytes)]}")
                continue
            seen[(ptr, nbytes)] = i
            src = Path(tmp) / f"in{i}"
            src.write_bytes(ctypes.string_at(ptr, nbytes))
            out = Path(tmp) / f"out{i}" if writable else None
            if out is not None:
                outputs[i] = (out, ptr, nbytes)
            lines.append(f"ptr {nbytes} {src} {out or '-'}")
        spec = Path(tmp) / "spec"
        spec.write_text("\n".join(lines) + "\n")
        env = dict(
            os.environ,
            ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:symbolize=1:detect_stack_use_after_return=0"
            ":allow_user_segv_handler=1:handle_segv=1:print_summary=1",
        )
        proc = subprocess.run([str(k._path), str(spec)], capture_output=True, text=True, env=env)
        if proc.stdout:  # the kernel's printf output
            sys.stdout.write(proc.stdout)
        if proc.returncode == 0:
            for out, ptr, nbytes in outputs.values():
                data = out.read_bytes()
                ctypes.memmove(ptr, data, min(nbytes, len(data)))
            return
        stderr = proc.stderr
        if "emu-kernel-error:" in stderr:
            message = stderr.split("emu-kernel-error:", 1)[1].strip()
            raise KernelError(f"{k.name}: {message}")
        raise _asan_error(k, stderr, proc.returncode)


def _asan_error(k: RawKernel, report: str, returncode: int) -> Exception:
    head = _ASAN_HEAD.search(report)
    if head is None:
        tail = "\n".join(report.strip().splitlines()[-15:])
        return KernelError(f"{k.name}: the checked run crashed (exit status {returncode}):\n{tail}")
    access = _ASAN_ACCESS.search(report) or re.search(r"caused by a (READ|WRITE) memory access", report)
    kind = access.group(1).lower() if access else "access"
    size = int(access.group(2)) if access and access.lastindex >= 2 else 0
    line = None
    frame = re.search(re.escape(k.filename) + r":(\d+)", report)
    if frame:
        line = int(frame.group(1))
    buffer, offset, where = "", None, ""
    address = int(access.group(3), 16) if access and access.lastindex >= 3 else None
    if address is not None:  # which buffer's guard space (or red zone) holds the address?
        best = None
        for m in _BUFFER.finditer(report):
            if m.group(2) == "(nil)":
                continue
            start, length = int(m.group(2), 16), int(m.group(3))
            guard = min(max(length, 65536), 64 << 20)
            if start - guard <= address < start + length + guard:
                distance = start - address if address < start else address - (start + length)
                if best is None or distance < best[0]:
                    best = (distance, int(m.group(1)), start, length)
        if best is not None:
            _, i, start, length = best
            buffer, offset = k.info.param_names[i], address - start
            where = f"byte offset {offset} of `{buffer}`, a {length}-byte buffer"
    if not where:
        region = _ASAN_REGION.search(report)
        if region:
            where = f"{region.group(2)} bytes {region.group(3)} a {region.group(4)}-byte region"
        elif head.group(1) == "SEGV":
            where = "an address far outside every buffer"
        else:
            where = "memory that is not a kernel argument (a local array, shared memory or a stray pointer)"
    at = f"{k.filename}:{line}" if line else k.filename
    what = f"{kind} of {size} bytes" if size else kind
    kind_note = "" if buffer else f" ({head.group(1)})"  # ASan's name helps only when no buffer matched
    message = f"{at}: {what} out of bounds{kind_note} at {where}"
    return OutOfBoundsError(message, access=kind, buffer=buffer, offset=offset, line=line, report=report)


class RawModule:
    """Several kernels from one source; mirrors cupy.RawModule(code=..., options=...).get_function(name)."""

    def __init__(
        self,
        code: str,
        *,
        options: tuple[str, ...] = (),
        checked: bool = False,
        schedule: str | int = "in_order",
        filename: str | None = None,
    ):
        self.code, self.options, self.checked, self.schedule, self.filename = (
            code,
            tuple(options),
            checked,
            schedule,
            filename,
        )
        self._kernels: dict[str, RawKernel] = {}

    def get_function(self, name: str) -> RawKernel:
        if name not in self._kernels:
            self._kernels[name] = RawKernel(
                self.code,
                name,
                checked=self.checked,
                options=self.options,
                schedule=self.schedule,
                filename=self.filename,
            )
        return self._kernels[name]

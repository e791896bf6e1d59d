"""RawKernel / RawModule: CUDA source compiled for the CPU, launched like cupy.RawKernel on CPU tensors."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from vllmini.checks import as_int
from vllmini.emulator._args import Arg, convert
from vllmini.emulator._build import DYNAMIC_SHARED_BYTES, KernelInfo, build, find_kernels, load
from vllmini.emulator._checked import run_checked
from vllmini.emulator._launch import launch_in_process, racecheck_default, time_limit_seconds
from vllmini.emulator._report import KernelBinary, KernelError
from vllmini.errors import InvalidArgumentError, InvalidTypeError

MAX_THREADS_PER_BLOCK = 1024
_MAX_BLOCK = (1024, 1024, 64)
_MAX_GRID = (2**31 - 1, 65535, 65535)


def _dims(value: Any, name: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    """A grid or block size (an int or 1 to 3 ints) as three ints within CUDA's limits."""
    dims = list(value) if isinstance(value, (tuple, list)) else [value]
    if not 1 <= len(dims) <= 3:
        raise InvalidArgumentError(f"{name} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    dims += [1] * (3 - len(dims))
    return tuple(
        as_int(d, f"{name}[{axis}]", min=1, max=lim)
        for axis, (d, lim) in enumerate(zip(dims, limits, strict=True))
    )


def _schedule_code(schedule: str | int) -> tuple[int, int]:
    """(order, seed) as emu_launch takes them: 0 in order, 1 reverse, 2 a shuffle seeded with seed."""
    if schedule == "in_order":
        return 0, 0
    if schedule == "reverse":
        return 1, 0
    if isinstance(schedule, (int, np.integer)) and not isinstance(schedule, bool):
        return 2, int(schedule) & (2**64 - 1)
    raise InvalidArgumentError(f"schedule must be 'in_order', 'reverse' or an int seed, got {schedule!r}")


def _source_name(code: str) -> str | None:
    """ "x.cu" when the source's first line is a header comment that starts with the file's name."""
    match = re.match(r"\s*//\s*([\w./-]+\.cu)\b", code)
    return match.group(1).rsplit("/", 1)[-1] if match else None


def _first_difference(arg: Any, a: bytes, b: bytes) -> str:
    item = arg.element_size() if type(arg).__module__.startswith("torch") else getattr(arg, "itemsize", 1)
    count = len(a) // item
    differ = [j for j in range(count) if a[j * item : (j + 1) * item] != b[j * item : (j + 1) * item]]
    return f"{len(differ)} of {count} elements, the first at flat index {differ[0]}"


class RawKernel:
    """One `extern "C" __global__` function of CUDA source, run on the CPU; mirrors cupy.RawKernel.

    kernel = RawKernel(code, "vector_add"); kernel((blocks,), (threads,), (x, y, out, np.int32(n)))
    Every launch checks each memory access against the buffer arguments (OutOfBoundsError, with the line).
    racecheck=True also reports two threads of a block that touch one byte between barriers, one writing,
    neither atomic (RaceError; check_schedules does this too); None: $VLLMINI_EMULATOR_RACECHECK=1 turns
    it on for every launch (slower: a shadow byte record per byte of memory; use it in tests).
    checked=True runs every launch in an AddressSanitizer child process (also local arrays, stray pointers).
    schedule: "in_order" | "reverse" | an int seed (a seeded shuffle of the threads at every pass).
    time_limit: seconds a launch may take before KernelError (None: $VLLMINI_EMULATOR_TIME_LIMIT, else none).
    filename: the name messages use for the source (default: the `// file.cu` the source's first line
    names, as kernel headers here do, else "<name>.cu").
    Public attributes: name, info (parameter names and C types), param_codes, path (the compiled library,
    or in checked mode the ASan executable) and index (the kernel's place in it).
    """

    def __init__(
        self,
        code: str,
        name: str,
        *,
        checked: bool = False,
        racecheck: bool | None = None,
        options: tuple[str, ...] = (),
        schedule: str | int = "in_order",
        filename: str | None = None,
        time_limit: float | None = None,
    ):
        if not isinstance(code, str) or not isinstance(name, str):
            raise InvalidTypeError(
                f"code and name must be str, got {type(code).__name__} and {type(name).__name__}"
            )
        kernels = find_kernels(code)
        if name not in kernels:
            found = ", ".join(sorted(kernels)) or "none"
            raise InvalidArgumentError(
                f"no `__global__ void {name}(...)` in the source (kernels found: {found})"
            )
        if kernels[name].is_template:
            raise InvalidArgumentError(
                f"`{name}` is a template (`template <...> __global__`); the emulator launches plain "
                f'kernels by name only: add an `extern "C"` kernel that calls it with the types you need'
            )
        self.code, self.name, self.checked, self.options = code, name, bool(checked), tuple(options)
        self.racecheck = racecheck
        _schedule_code(schedule), time_limit_seconds(time_limit)  # checked now, used at every launch
        self.schedule, self.time_limit = schedule, time_limit
        self.filename = filename or _source_name(code) or f"{name}.cu"
        self.info = kernels[name]
        self._uses_printf = "printf" in code  # then its output is captured and written to sys.stdout
        names = sorted(kernel for kernel, info in kernels.items() if not info.is_template)
        self.index = names.index(name)
        self.path = build(code, self.filename, names, self.options, checked=self.checked)
        # the signature (C types as the compiler sees them) comes from the in-process library
        library = build(code, self.filename, names, self.options, checked=False)
        self._lib = load(library)
        self._binary = KernelBinary(library, self.index, name, self.filename, self.info.param_names)
        self.param_codes = tuple(filter(None, self._lib.emu_signature(self.index).decode().split(";")))
        if len(self.param_codes) != len(self.info.param_names):  # the source scan missed something
            self.info = KernelInfo(
                name, tuple(f"arg{i}" for i in range(len(self.param_codes))), tuple(self.param_codes)
            )
            self._binary = KernelBinary(library, self.index, name, self.filename, self.info.param_names)

    def __repr__(self) -> str:
        return f"RawKernel({self.name!r}, checked={self.checked}, schedule={self.schedule!r})"

    def __call__(
        self,
        grid: Any,
        block: Any,
        args: tuple,
        *,
        shared_mem: int = 0,
        schedule: str | int | None = None,
        time_limit: float | None = None,
        racecheck: bool | None = None,
    ) -> None:
        """Launch over `grid` blocks of `block` threads; time_limit (seconds) and racecheck override the
        kernel's. A racecheck launch runs in this process (bounds-checked) even for a checked kernel."""
        grid3 = _dims(grid, "grid", _MAX_GRID)
        block3 = _dims(block, "block", _MAX_BLOCK)
        threads = block3[0] * block3[1] * block3[2]
        if threads > MAX_THREADS_PER_BLOCK:
            raise InvalidArgumentError(
                f"block {block!r} has {threads} threads; CUDA allows at most {MAX_THREADS_PER_BLOCK}"
            )
        as_int(shared_mem, "shared_mem", min=0, max=DYNAMIC_SHARED_BYTES)
        order = _schedule_code(self.schedule if schedule is None else schedule)
        limit = time_limit_seconds(self.time_limit if time_limit is None else time_limit)
        converted = self.convert(args)
        racecheck = racecheck_default(self.racecheck if racecheck is None else racecheck)
        if self.checked and not racecheck:
            program = KernelBinary(self.path, self.index, self.name, self.filename, self.info.param_names)
            run_checked(program, converted, grid3, block3, order, limit)
        else:
            launch_in_process(
                self._lib, self._binary, converted, grid3, block3, order,
                time_limit=limit, capture_printf=self._uses_printf, racecheck=racecheck,
            )  # fmt: skip

    def convert(self, args: tuple) -> list[Arg]:
        """Check `args` against the kernel's parameters; the C values to pass, and the buffers."""
        if not isinstance(args, (tuple, list)):
            raise InvalidTypeError(f"args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.param_codes):
            raise InvalidTypeError(
                f"{self.name} takes {len(self.param_codes)} arguments "
                f"({', '.join(self.info.param_names)}), got {len(args)}"
            )
        return [
            convert(code, arg, self.info.describe(i), checked=self.checked)
            for i, (code, arg) in enumerate(zip(self.param_codes, args, strict=True))
        ]

    def check_schedules(
        self,
        grid: Any,
        block: Any,
        args: tuple,
        *,
        shared_mem: int = 0,
        schedules: tuple = ("in_order", "reverse", 1, 2),
        racecheck: bool = True,
    ) -> None:
        """Launch once per schedule on copies of the buffers; raise KernelError if any output differs,
        then (racecheck) once more with the race detector: RaceError names both threads and lines.

        A result that depends on the order of the threads means a race: a missing __syncthreads(), two
        threads writing one place, a read of a slot another thread writes in the same phase. Outputs are
        compared bit for bit (NaN equals NaN); float atomics whose order changes the rounding also count.
        A race that gives the same answer in every order (256 threads doing `total += 1.0f`: 256 here, 1 on
        a GPU) is left to the race detector. On success the buffers hold the first schedule's result, as
        after a normal launch.
        """
        outputs = {
            i: arg.buffer for i, arg in enumerate(self.convert(args)) if arg.buffer and arg.buffer.writable
        }
        originals = {i: buffer.read() for i, buffer in outputs.items()}
        results = []
        for schedule in schedules:
            for i, buffer in outputs.items():
                buffer.write(originals[i])
            self(grid, block, args, shared_mem=shared_mem, schedule=schedule, racecheck=False)
            results.append({i: buffer.read() for i, buffer in outputs.items()})
        for schedule, result in zip(schedules[1:], results[1:], strict=True):
            for i in (i for i in outputs if result[i] != results[0][i]):
                where = _first_difference(args[i], results[0][i], result[i])
                raise KernelError(
                    f"{self.name}: `{self.info.param_names[i]}` differs between schedule {schedules[0]!r} "
                    f"and {schedule!r} ({where}): the result depends on the order of the threads, a race "
                    f"(a missing __syncthreads()?)"
                )
        if racecheck:
            for i, buffer in outputs.items():
                buffer.write(originals[i])
            self(grid, block, args, shared_mem=shared_mem, schedule=schedules[0], racecheck=True)
        for i, buffer in outputs.items():  # leave the first schedule's result, like a plain launch
            buffer.write(results[0][i])


class RawModule:
    """Several kernels from one source; mirrors cupy.RawModule(code=..., options=...).get_function(name)."""

    def __init__(
        self,
        code: str,
        *,
        options: tuple[str, ...] = (),
        checked: bool = False,
        racecheck: bool | None = None,
        schedule: str | int = "in_order",
        filename: str | None = None,
        time_limit: float | None = None,
    ):
        self.code = code
        self.settings = dict(
            options=tuple(options),
            checked=checked,
            racecheck=racecheck,
            schedule=schedule,
            filename=filename,
            time_limit=time_limit,
        )
        self._kernels: dict[str, RawKernel] = {}

    def get_function(self, name: str) -> RawKernel:
        """The kernel `name`, built on first use."""
        if name not in self._kernels:
            self._kernels[name] = RawKernel(self.code, name, **self.settings)
        return self._kernels[name]

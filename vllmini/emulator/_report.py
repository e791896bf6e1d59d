"""What a failed launch says: the emulator's errors, and the kernel lines and buffers they name.

The C side (emu_check.h, emu_runtime.h) reports facts: an address, a return address inside the library,
which threads. This module turns them into a message a learner can act on: the kernel line (read from the
library's line tables with addr2line), the buffer argument and the byte offset.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vllmini.emulator._args import Arg
from vllmini.errors import KernelLaunchError

ERR_BOUNDS, ERR_RACE, ERR_SIGNAL = 1, 2, 3  # emu_check.h's ErrorKind
_FAR = 1 << 30  # an address further than this from every buffer is not blamed on one


class KernelError(KernelLaunchError):
    """The kernel did something CUDA leaves undefined (a deadlock, a bad warp mask, a failed assert, a
    memory fault, a race), or ran past its time limit."""


class OutOfBoundsError(KernelError):
    """The kernel read or wrote outside a buffer argument (access, buffer, offset, line)."""

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


class RaceError(KernelError):
    """Two threads of a block touched one byte between two barriers, at least one writing, neither atomic.

    memory: "shared" or "global"; buffer and offset (global memory); threads and lines: the access that
    found the race, then the earlier one (a line is None where unknown)."""

    def __init__(
        self,
        message: str,
        *,
        memory: str,
        buffer: str,
        offset: int | None,
        threads: tuple[str, str],
        lines: tuple[int | None, int | None],
    ):
        super().__init__(message)
        self.memory, self.buffer, self.offset, self.threads, self.lines = (
            memory,
            buffer,
            offset,
            threads,
            lines,
        )


@dataclass(frozen=True)
class KernelBinary:
    """One kernel of a compiled library (or checked-mode executable): what a launch runs, what errors name."""

    path: Path
    index: int  # the kernel's place in the launcher table
    name: str
    filename: str  # the name the source's lines carry
    param_names: tuple[str, ...]

    def line(self, pc: int) -> int | None:
        """The kernel line of a return address (an offset into the library, as the C side reports it)."""
        return None if pc <= 0 else source_line(str(self.path), pc - 1, self.filename)


@functools.cache
def source_line(path: str, offset: int, filename: str) -> int | None:
    """The line of `filename` that the code at `offset` in library `path` comes from (inlined calls
    included: the innermost frame in the kernel's file), or None (no addr2line, no line tables)."""
    tool = shutil.which("addr2line")
    if tool is None:
        return None
    proc = subprocess.run([tool, "-i", "-e", path, hex(offset)], capture_output=True, text=True)
    for entry in proc.stdout.splitlines():
        file, _, line = entry.split(" ")[0].rpartition(":")
        if Path(file).name == filename and line.isdigit():
            return int(line)
    return None


def _where(args: list[Arg], names: tuple[str, ...], address: int) -> tuple[str, int, int] | None:
    """(name, byte offset, size) of the buffer argument holding `address`, else the nearest one."""
    best = None
    for arg, name in zip(args, names, strict=True):
        if arg.buffer is None:
            continue
        start, size = arg.buffer.address, arg.buffer.nbytes
        distance = (
            0 if start <= address < start + size else min(abs(address - start), abs(address - start - size))
        )
        if distance < _FAR and (best is None or distance < best[0]):
            best = (distance, name, address - start, size)
    return None if best is None else best[1:]


def launch_error(kernel: KernelBinary, message: str, info: list[int], args: list[Arg]) -> KernelError:
    """The error for a launch that failed with the C side's `message` and error facts `info`."""
    kind, address, size, write = info[:4]
    line = kernel.line(info[4])
    at = f"{kernel.filename}:{line}" if line else kernel.filename
    if kind == ERR_BOUNDS:
        access = "write" if write else "read"
        found = _where(args, kernel.param_names, address)
        if found and info[10]:
            where = f"byte offset {found[1]} of `{found[0]}`, which the kernel declares const"
        elif found:
            where = f"byte offset {found[1]} of `{found[0]}`, a {found[2]}-byte buffer"
        elif address < 65536:
            where = f"address {address:#x}, through a null pointer (an argument passed as None?)"
        else:
            where = (
                f"address {address:#x}, outside every buffer argument, shared memory and the thread's stack"
            )
        text = f"{kernel.name}: {at}: {message}: {access} of {size} bytes out of bounds at {where}"
        buffer, offset = (found[0], found[1]) if found else ("", None)
        return OutOfBoundsError(text, access=access, buffer=buffer, offset=offset, line=line)
    if kind == ERR_RACE:
        thread, other = message.split("|")
        other_line = kernel.line(info[6])
        found = None if info[9] else _where(args, kernel.param_names, address)
        where = (
            "shared memory" if info[9] else f"byte offset {found[1]} of `{found[0]}`" if found else "memory"
        )
        other_at = f"{kernel.filename}:{other_line}" if other_line else "another line"
        text = (
            f"{kernel.name}: {at}: race on {where}: {thread} {'writes' if write else 'reads'} it here, and "
            f"{other} {'wrote' if info[8] else 'read'} it at {other_at}, with no __syncthreads() between "
            f"them (nor a warp collective both took part in), and neither access is atomic"
        )
        return RaceError(
            text,
            memory="shared" if info[9] else "global",
            buffer=found[0] if found else "",
            offset=found[1] if found else None,
            threads=(thread, other),
            lines=(line, other_line),
        )
    if line and not message.startswith(f"{kernel.filename}:"):  # a signal or a stack overflow, with its line
        message = f"{at}: {message.replace('; run it with checked=True to find the line', '')}"
    return KernelError(f"{kernel.name}: {message}")

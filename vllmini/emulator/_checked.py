"""Checked mode: run one launch in an AddressSanitizer child process and turn its report into an error."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vllmini.emulator._args import Arg
from vllmini.emulator._report import KernelBinary, KernelError, OutOfBoundsError

_ASAN_OPTIONS = (
    "detect_leaks=0:abort_on_error=0:symbolize=1:detect_stack_use_after_return=0:handle_sigill=1"
    ":allow_user_segv_handler=1:handle_segv=1:print_summary=1"
)
_ASAN_HEAD = re.compile(r"ERROR: AddressSanitizer: ([\w-]+)")
_ASAN_ACCESS = re.compile(r"(READ|WRITE) of size (\d+) at (0x[0-9a-f]+)")
_ASAN_REGION = re.compile(
    r"(0x[0-9a-f]+) is located (\d+) bytes (?:to the )?(after|before|right of|left of|inside of)"
    r" (?:the )?(\d+)-byte region \[(0x[0-9a-f]+),\s*(0x[0-9a-f]+)\)"
)
_BUFFER = re.compile(r"emu-buffer (\d+) (0x[0-9a-f]+|\(nil\)) (\d+)")
_SIGNALS = {  # ASan's name of a signal that is not a memory access -> what it means in a kernel
    "FPE": "integer division by zero (SIGFPE: x / 0 or x % 0 on integers, or INT_MIN / -1)",
    "ILL": "illegal instruction (SIGILL)",
}
_STOP_GRACE_S = 30.0  # the child stops itself at the time limit; this much later it is killed


@dataclass
class Region:
    """Bytes that one or more buffer arguments cover (overlapping buffers share one, as on the GPU)."""

    start: int
    end: int
    writable: bool
    args: list[int] = field(default_factory=list)


def regions(args: list[Arg]) -> list[Region]:
    """The buffer arguments grouped into regions of overlapping memory, in address order."""
    found: list[Region] = []
    for i in sorted((i for i, arg in enumerate(args) if arg.buffer), key=lambda i: args[i].buffer.address):
        buffer = args[i].buffer
        last = found[-1] if found else None
        if last is not None and (buffer.address < last.end or buffer.address == last.start):
            last.end = max(last.end, buffer.address + buffer.nbytes)
            last.writable |= buffer.writable
        else:
            last = Region(buffer.address, buffer.address + buffer.nbytes, buffer.writable)
            found.append(last)
        last.args.append(i)
    return found


def _spec(kernel: KernelBinary, args: list[Arg], groups: list[Region], launch: tuple, tmp: Path) -> Path:
    """Write the child's spec (see emu_main.h) and one input file per region; return the spec's path."""
    lines = [" ".join(map(str, (kernel.index, *launch, len(groups), len(args))))]
    for number, region in enumerate(groups):
        (tmp / f"in{number}").write_bytes(ctypes.string_at(region.start, region.end - region.start))
        output = tmp / f"out{number}" if region.writable else "-"
        lines.append(f"{region.end - region.start} {tmp / f'in{number}'} {output}")
    for i, arg in enumerate(args):
        if arg.buffer is not None:
            number = next(n for n, region in enumerate(groups) if i in region.args)
            lines.append(f"buffer {number} {arg.buffer.address - groups[number].start} {arg.buffer.nbytes}")
        elif isinstance(arg.value, ctypes.c_void_p):  # None (checked mode refuses raw addresses)
            lines.append("null")
        else:
            lines.append(f"scalar {ctypes.sizeof(arg.value)} {bytes(arg.value).hex()}")
    (tmp / "spec").write_text("\n".join(lines) + "\n")
    return tmp / "spec"


def run_checked(
    kernel: KernelBinary,
    args: list[Arg],
    grid: tuple,
    block: tuple,
    schedule: tuple[int, int],
    time_limit: float | None,
) -> None:
    """Launch in the ASan executable; copy the outputs back, or raise KernelError / OutOfBoundsError."""
    limit_ms = 0 if time_limit is None else max(1, round(time_limit * 1000))
    timeout = None if time_limit is None else time_limit + _STOP_GRACE_S
    groups = regions(args)
    with tempfile.TemporaryDirectory(prefix="vllmini-emu-") as tmp:
        spec = _spec(kernel, args, groups, (*grid, *block, *schedule, limit_ms), Path(tmp))
        command, env = [str(kernel.path), str(spec)], dict(os.environ, ASAN_OPTIONS=_ASAN_OPTIONS)
        try:  # on Ctrl-C, subprocess.run kills the child and the KeyboardInterrupt goes on
            proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelError(
                f"{kernel.name}: the checked run did not stop at its time limit; killed"
            ) from None
        if proc.stdout:  # the kernel's printf output
            sys.stdout.write(proc.stdout)
        if proc.returncode == 0:
            for number, region in enumerate(groups):
                if region.writable:
                    data = (Path(tmp) / f"out{number}").read_bytes()
                    ctypes.memmove(region.start, data, min(len(data), region.end - region.start))
            return
    if "emu-kernel-error:" in proc.stderr:
        raise KernelError(f"{kernel.name}: {proc.stderr.split('emu-kernel-error:', 1)[1].strip()}")
    raise asan_error(kernel, proc.stderr, proc.returncode)


def _blamed_buffer(kernel: KernelBinary, report: str, address: int) -> tuple[str, int, int] | None:
    """(name, offset, size) of the buffer argument whose guard space (or red zone) holds the address."""
    best = None
    for match in _BUFFER.finditer(report):
        if match.group(2) == "(nil)":
            continue
        start, length = int(match.group(2), 16), int(match.group(3))
        guard = min(max(length, 65536), 64 << 20)
        if start - guard <= address < start + length + guard:
            distance = start - address if address < start else address - (start + length)
            if best is None or distance < best[0]:
                best = (distance, int(match.group(1)), start, length)
    if best is None:
        return None
    _, i, start, length = best
    return kernel.param_names[i], address - start, length


def asan_error(kernel: KernelBinary, report: str, returncode: int) -> KernelError:
    """The error an AddressSanitizer report describes: an OutOfBoundsError naming access, buffer, line."""
    head = _ASAN_HEAD.search(report)
    if head is None:
        tail = "\n".join(report.strip().splitlines()[-15:])
        return KernelError(f"{kernel.name}: the checked run crashed (exit status {returncode}):\n{tail}")
    frame = re.search(re.escape(kernel.filename) + r":(\d+)", report)
    line = int(frame.group(1)) if frame else None
    at = f"{kernel.filename}:{line}" if line else kernel.filename
    if head.group(1) in _SIGNALS:  # not a memory access: an arithmetic fault or an illegal instruction
        return KernelError(f"{kernel.name}: {at}: {_SIGNALS[head.group(1)]}")
    access = _ASAN_ACCESS.search(report) or re.search(r"caused by a (READ|WRITE) memory access", report)
    kind = access.group(1).lower() if access else "access"
    size = int(access.group(2)) if access and access.lastindex >= 2 else 0
    address = int(access.group(3), 16) if access and access.lastindex >= 3 else None
    blamed = None if address is None else _blamed_buffer(kernel, report, address)
    buffer, offset = blamed[:2] if blamed else ("", None)
    if blamed:
        where = f"byte offset {offset} of `{buffer}`, a {blamed[2]}-byte buffer"
    elif region := _ASAN_REGION.search(report):
        where = f"{region.group(2)} bytes {region.group(3)} a {region.group(4)}-byte region"
    elif head.group(1) == "SEGV":
        where = "an address far outside every buffer"
    else:
        where = "memory that is not a kernel argument (a local array, shared memory or a stray pointer)"
    what = f"{kind} of {size} bytes" if size else kind
    kind_note = "" if buffer else f" ({head.group(1)})"  # ASan's name helps only when no buffer matched
    message = f"{at}: {what} out of bounds{kind_note} at {where}"
    return OutOfBoundsError(message, access=kind, buffer=buffer, offset=offset, line=line, report=report)

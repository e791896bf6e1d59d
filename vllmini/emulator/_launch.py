"""Launching in this process: the kernel runs on a worker thread while the caller waits, so Ctrl-C and
the time limit are handled at once and can stop it (emu_stop) even when a CUDA thread never yields."""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import numpy as np

from vllmini.checks import as_float
from vllmini.emulator._args import Arg
from vllmini.emulator._checked import regions
from vllmini.emulator._report import KernelBinary, KernelError, launch_error
from vllmini.errors import InvalidArgumentError, InvalidTypeError

TIME_LIMIT_ENV = "VLLMINI_EMULATOR_TIME_LIMIT"  # seconds; the default time limit of every launch
RACECHECK_ENV = "VLLMINI_EMULATOR_RACECHECK"  # "1": race-check every launch that does not say otherwise
INTERRUPTED, TIME_LIMIT = 2, 3  # emu_launch results and emu_stop reasons (emu_runtime.h's Result)
CHECK_BOUNDS, CHECK_RACES = 1, 2  # what a launch checks (emu_check.h's CheckBits)
_STOP_GRACE_S = 5.0  # a stopped launch returns within microseconds; this long means something is broken
_POLL_S = 0.05  # the waiting thread wakes this often, so it sees a Ctrl-C that another thread received
_launch_lock = threading.Lock()  # the runtime keeps its state in globals: one launch at a time
_launch_ids = itertools.count(1)


def time_limit_seconds(time_limit: float | None) -> float | None:
    """The time limit in seconds (None: no limit): `time_limit`, else $VLLMINI_EMULATOR_TIME_LIMIT."""
    name = "time_limit"
    if time_limit is None:
        text = os.environ.get(TIME_LIMIT_ENV, "").strip()
        if not text:
            return None
        try:
            time_limit, name = float(text), f"${TIME_LIMIT_ENV}"
        except ValueError:
            raise InvalidArgumentError(
                f"${TIME_LIMIT_ENV} must be a number of seconds, got {text!r}"
            ) from None
    seconds = as_float(time_limit, name, min=0.001, finite=False)
    return None if seconds == float("inf") else seconds


def racecheck_default(racecheck: bool | None) -> bool:
    """`racecheck`, else whether $VLLMINI_EMULATOR_RACECHECK asks for it ("1"/"0", empty: no)."""
    if racecheck is not None:
        if not isinstance(racecheck, (bool, np.bool_)):
            raise InvalidTypeError(f"racecheck must be True, False or None, got {racecheck!r}")
        return bool(racecheck)
    text = os.environ.get(RACECHECK_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise InvalidArgumentError(f"${RACECHECK_ENV} must be 1 or 0, got {text!r}")
    return text == "1"


@contextmanager
def kernel_stdout(enabled: bool):
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


def _wait(done: threading.Event, timeout: float | None) -> bool:
    """done.wait(timeout), waking every _POLL_S so that Python runs its SIGINT handler in time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        if done.wait(max(left, 0.0)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def check_spans(args: list[Arg], checks: int) -> tuple[int, ctypes.Array, int]:
    """(checks, regions, count) for emu_set_checks: the memory the buffer arguments cover, overlapping
    buffers merged (as (start, end, writable) triples). An argument given as a raw address has no known
    extent, so then bounds are not checked."""
    if any(arg.buffer is None and isinstance(arg.value, ctypes.c_void_p) and arg.value.value for arg in args):
        checks &= ~CHECK_BOUNDS
    spans = [(region.start, region.end, int(region.writable)) for region in regions(args)]
    flat = (ctypes.c_ulonglong * max(1, 3 * len(spans)))(*[n for span in spans for n in span])
    return checks, flat, len(spans)


def launch_in_process(
    lib: ctypes.CDLL,
    kernel: KernelBinary,
    args: list[Arg],
    grid: tuple,
    block: tuple,
    schedule: tuple[int, int],
    *,
    time_limit: float | None,
    capture_printf: bool,
    racecheck: bool = False,
) -> None:
    """Run `kernel` of `lib` over the grid, its memory accesses bounds-checked (and with racecheck, checked
    for races); raise KernelError (OutOfBoundsError, RaceError) on a kernel error or the time limit.

    Ctrl-C stops the launch and the KeyboardInterrupt goes on; the library is ready for the next launch."""
    name, index = kernel.name, kernel.index
    checks, spans, num_spans = check_spans(args, CHECK_BOUNDS | (CHECK_RACES if racecheck else 0))
    argv = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(arg.value) for arg in args])
    grid_c, block_c = (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block)
    launch_id, done, outcome = next(_launch_ids), threading.Event(), {}

    def work() -> None:
        try:
            with _launch_lock, kernel_stdout(capture_printf):
                lib.emu_set_checks(checks, spans, num_spans)
                outcome["result"] = lib.emu_launch(index, argv, grid_c, block_c, *schedule, launch_id)
                outcome["message"] = lib.emu_error().decode(errors="replace")
                info = (ctypes.c_ulonglong * 16)()
                lib.emu_error_info(info)
                outcome["info"] = list(info)
        except BaseException as error:  # handed to the caller below
            outcome["error"] = error
        finally:
            done.set()

    try:
        threading.Thread(target=work, name=f"vllmini.emulator {name}", daemon=True).start()
        finished = _wait(done, time_limit)
        if not finished:
            lib.emu_stop(launch_id, TIME_LIMIT)
            finished = _wait(done, _STOP_GRACE_S)
    except BaseException:  # Ctrl-C (KeyboardInterrupt) or another exception while waiting: stop, then go on
        lib.emu_stop(launch_id, INTERRUPTED)
        done.wait(_STOP_GRACE_S)
        raise
    if not finished:
        raise KernelError(f"{name}: did not stop within {_STOP_GRACE_S:g} s of reaching its time limit")
    if "error" in outcome:
        raise outcome["error"]
    if outcome["result"] == TIME_LIMIT:
        raise KernelError(f"{name}: {outcome['message']} (time_limit={time_limit:g} s)")
    if outcome["result"]:
        raise launch_error(kernel, outcome["message"], outcome["info"], args)

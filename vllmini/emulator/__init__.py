"""Run unmodified CUDA (.cu) source on the CPU, with the same call as cupy.RawKernel.

    from vllmini.emulator import RawKernel
    kernel = RawKernel(source, "vector_add")            # compiled once with the system C++ compiler, cached
    kernel((num_blocks,), (256,), (x, y, out, np.int32(n)))   # CPU torch tensors / numpy arrays

How: the source is compiled as C++17 after `cuda_emu.h`, a header that defines the CUDA built-ins, and
before `emu_runtime.h`, a small scheduler. Blocks run one after another on one worker OS thread (the
caller waits; see Stopping); inside a block every CUDA thread is a fiber with its own stack. Threads run
in a fixed order (`schedule="in_order"`, `"reverse"`, or an int seed for a seeded shuffle), each until it
reaches `__syncthreads()`, a warp collective (`__shfl_*_sync`, `__ballot_sync`, `__syncwarp`, ...) or its
end. Nothing else switches threads, so a race gives the same wrong answer on every run. Shared memory
(`__shared__`, and dynamic `extern __shared__ T name[]`, up to 227 KiB) is filled with 0xFF bytes (NaN as
float, -1 as int) before every block, so reading it before it is written shows up. Compiled libraries are
cached under $VLLMINI_CACHE_DIR/emulator, else $XDG_CACHE_HOME/vllmini/emulator, else
~/.cache/vllmini/emulator.

What it catches, on every run (KernelError, a KernelLaunchError): a deadlock (threads at `__syncthreads()`
that others never reach, or that returned early), threads at different `__syncthreads()` lines, lanes of
one mask at different collectives, a collective whose mask leaves out the caller, names an exited lane or a
lane past the block's end, a shuffle that reads a lane outside the mask (so a wrong mask is caught on every
run), `assert`/`__trap`, and a memory fault inside the kernel (a wild index, a thread's stack overflowing
its 256 KiB): an exception instead of a dead Python; checked=True then finds the line. Before any launch
(InvalidArgumentError / InvalidTypeError, a ValueError / TypeError): more than 1024 threads per block, bad
grid/block sizes, argument types that do not match the kernel's C parameters (a float64 tensor for a
`const float*`, a Python float for a `float`, which CuPy would send as a double), non-contiguous tensors.
Compile errors raise CompileError (a KernelBuildError) with the compiler's message and the kernel line.
What it cannot catch: a race that needs truly parallel threads to go wrong (use check_schedules), an
out-of-bounds index that lands in memory Python owns (use checked=True), and a thread that spins on a
value another thread would set: that is a hang here (only the time limit or Ctrl-C ends it), as it may be
on a GPU.

Stopping: a launch runs on a worker thread while the calling thread waits, so Ctrl-C stops it at once
(well within a second), wherever it is -- in a huge grid, or in a thread spinning forever -- and the
KeyboardInterrupt goes on as usual; the emulator is ready for the next launch. `time_limit=` seconds (on
RawKernel, RawModule or one call; default $VLLMINI_EMULATOR_TIME_LIMIT, else none) stops a launch that
takes longer with a KernelError naming the kernel, the block and the thread that had not finished, and
what the other threads of that block wait at. Outputs are then partly written. In checked mode the child
process is stopped the same way (or killed on Ctrl-C). Kernel printf output goes to sys.stdout.

Supported CUDA subset: see the top of cuda_emu.h (built-ins, barriers, shuffles and votes, atomics, vector
types, math intrinsics, __half/__nv_bfloat16 storage types). Not supported: cooperative groups, tensor cores,
inline PTX, textures, grid sync, __constant__ set from the host.
Platforms: Linux (x86-64, aarch64) with g++ or clang++; macOS with clang++ (shared memory not poisoned
there). x86-64 Linux switches fibers with a few lines of assembly (~10 M switches/s); elsewhere it uses
ucontext's swapcontext (~1 M/s, a system call each). Only x86-64 Linux with g++ is tested here (both
switch paths). Windows: use WSL. A missing compiler raises CompileError saying what to install.
Templated kernels (`template <...> __global__`) compile, but only plain kernels are launched by name.

Race check: `kernel.check_schedules(grid, block, args)` launches under several thread orders and raises
KernelError when an output differs between them (a missing barrier shows up this way in any kernel).
Checked mode, `RawKernel(..., checked=True)`: see CHECKED_MODE below.
"""

from vllmini.emulator._build import CompileError, cache_dir
from vllmini.emulator._kernel import RawKernel, RawModule
from vllmini.emulator._launch import RACECHECK_ENV, TIME_LIMIT_ENV
from vllmini.emulator._report import KernelError, OutOfBoundsError, RaceError

CHECKED_MODE = """\
Checked mode (RawKernel(code, name, checked=True)) builds the kernel with AddressSanitizer into a small
executable and runs each launch in a child process. Every buffer argument gets its own allocation with
poisoned guard space before and after it, as large as the buffer itself (at least 64 KiB, at most
64 MiB a side); outputs are copied back when the run succeeds. Same scheduler, same answers.

Aliasing: buffer arguments that overlap in memory (one tensor passed as a const input and as the
output, or two views of one tensor) share one allocation, as on the GPU, so writes through either are seen
through both and copied back.

It catches, on every run, and names the access (read/write), the buffer argument, the byte offset
(negative = before the start) and the kernel line (OutOfBoundsError: .access .buffer .offset .line):
  * reads and writes past the end or before the start of a buffer argument, up to a whole buffer's
    size away: e.g. a page id from the block table that is >= num_blocks or negative, used to index
    the KV cache, or an output one element too short;
  * overflows of a thread's local arrays (stack-buffer-overflow, reported without a buffer name);
  * wild addresses far from everything (reported as SEGV, with the line).
It cannot catch:
  * an in-bounds but wrong index: reading the wrong page, another sequence's row of block_tables, a
    slot past seq_len inside the last page (vllmini poisons those with NaN so they show in results);
  * an access so far past a buffer that it lands inside another buffer's valid memory, or one from a
    buffer into another that overlaps it (aliased buffers share one allocation);
  * out-of-bounds accesses to shared memory (it is thread-local storage, without guard space);
  * reads of uninitialised memory (shared memory is poisoned with NaN instead, which is often visible);
  * races that need truly parallel threads (checked mode uses the same deterministic scheduler).
Cost: one extra compile with -fsanitize=address (a few seconds, cached) and a process per launch; use
it in tests and to find a bug. It needs AddressSanitizer (libasan with g++, or clang).
"""

__all__ = [
    "CHECKED_MODE",
    "CompileError",
    "KernelError",
    "OutOfBoundsError",
    "RACECHECK_ENV",
    "RaceError",
    "RawKernel",
    "RawModule",
    "TIME_LIMIT_ENV",
    "cache_dir",
]

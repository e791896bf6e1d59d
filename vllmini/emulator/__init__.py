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
float, -1 as int) before every block, so reading it before it is written shows up.

Trust: this is HOST code. The .cu source is compiled as ordinary C++ and loaded into the Python process
(checked mode: into a child process), with all the rights of that process: a constructor, a file or
network call in a .cu file runs like Python code would. Run only kernels you would run as Python.
Compiled libraries are cached under $VLLMINI_CACHE_DIR/emulator, else $XDG_CACHE_HOME/vllmini/emulator,
else ~/.cache/vllmini/emulator. The directory is created private (0700) and made private again if others
may write to it; one owned by another user is refused (CompileError). A cached file is loaded only when
this user owns it, no one else may write to it and it is not a link; otherwise it is rebuilt. The cache
key is a hash of the translation unit (the source and every emulator header), the compiler (path, version,
size and date of its file) and every compiler flag, options included.

Memory checks, on every launch: the library is compiled with the per-access calls of -fsanitize=thread
(without ThreadSanitizer's runtime: emu_check.h answers them), so each load and store of kernel code is
checked BEFORE it happens against the buffer arguments (a write: a non-const one), the block's shared
memory, the thread's own stack and the library's static data. A stray access raises OutOfBoundsError
naming the kernel, the thread, the kernel line, the buffer and the byte offset (dropping `if (i < n)`
from vector_add is caught on every run), and never touches Python's memory. Cost: 5-30% on the course's
kernels 2-6, up to ~6x on a kernel made of plain loads in a loop (kernel 1); tests/test_kernels.py takes
about the same time. Not checked: an argument passed as a raw address (its extent is unknown: then no
bounds are checked in that launch), accesses made inside C library calls (memcpy, printf), an index that
lands inside ANOTHER buffer argument, and dynamic shared memory past `shared_mem` (227 KiB are there).

Races (racecheck=True on RawKernel or a call, $VLLMINI_EMULATOR_RACECHECK=1 for every launch, and at the
end of check_schedules): like compute-sanitizer's racecheck, two threads of one block that touch the same
byte of shared or global memory, at least one writing, neither through an atomic, with no __syncthreads()
between them -- nor a warp collective (__syncwarp, a shuffle, a vote) that both took part in -- raise
RaceError naming both threads, both lines and the memory (e.g. 256 threads doing `total += 1.0f`, which
gives 256 here in every thread order and 1 on a GPU, is caught on every run). It keeps 32 bytes of
shadow per byte of every buffer and of shared memory (virtual memory, touched only where the kernel goes),
and is several times slower: a tool for tests. It cannot see: races between blocks (blocks run one after
another here, in a fixed order, so the order of blocks is never varied either), ordering through
__threadfence or flags that threads spin on, an atomic mixed with a plain access of the same byte,
__device__ global variables, memory touched inside C library calls, and it reports the first race only.

What else it catches, on every run (KernelError, a KernelLaunchError): a deadlock (threads at
`__syncthreads()` that others never reach, or that returned early), threads at different `__syncthreads()`
lines, lanes of one mask at different collectives, a collective whose mask leaves out the caller, names an
exited lane or a lane past the block's end, a shuffle that reads a lane outside the mask (so a wrong mask
is caught on every run), `assert`/`__trap`, and a fault inside the kernel (a thread's stack overflowing
its 256 KiB, a wild raw pointer, an integer division or remainder by zero (SIGFPE), an illegal
instruction, a bus error): an exception naming the kernel, the thread and the line instead of a dead
Python. Before any launch (InvalidArgumentError / InvalidTypeError, a ValueError / TypeError): more than
1024 threads per block, bad grid/block sizes, argument types that do not match the kernel's C parameters
(a float64 tensor for a `const float*`, a Python float for a `float`, which CuPy would send as a double),
non-contiguous tensors.
Compile errors raise CompileError (a KernelBuildError) with the compiler's message and the kernel line.
What it cannot catch: the limits of the memory checks and of racecheck above, and a thread that spins on a
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
KernelError when an output differs between them (a missing barrier shows up this way in any kernel), then
once more with racecheck (RaceError).
Checked mode, `RawKernel(..., checked=True)`: see CHECKED_MODE below.
"""

from vllmini.emulator._build import CompileError, cache_dir
from vllmini.emulator._kernel import RawKernel, RawModule
from vllmini.emulator._launch import RACECHECK_ENV, TIME_LIMIT_ENV
from vllmini.emulator._report import KernelError, OutOfBoundsError, RaceError

CHECKED_MODE = """\
Checked mode (RawKernel(code, name, checked=True)) builds the kernel with AddressSanitizer into a small
executable and runs each launch in a child process (a racecheck launch still runs in this process). Every
buffer argument gets its own allocation with
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
  * wild addresses far from everything (reported as SEGV, with the line);
  * an integer division by zero (SIGFPE) or an illegal instruction, with the line (a KernelError).
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

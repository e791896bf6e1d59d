"""Turn CUDA source text into a C++ translation unit, compile it with the system compiler, cache the result.

The translation unit is: cuda_emu.h, a `#line 1 "<file>.cu"` directive, the kernel source exactly as given,
definitions for its dynamic shared memory, a launcher table, and emu_runtime.h. Builds are cached on disk
(keyed by a hash of everything that goes into them) and in memory, so a kernel compiles once per machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from vllmini.errors import InvalidArgumentError, InvalidTypeError, KernelBuildError

HERE = Path(__file__).resolve().parent
# everything a build includes: part of the cache key
HEADER_FILES = tuple(
    "cuda_emu.h emu_mma.h emu_runtime.h emu_check.h emu_entry.h emu_main.h "
    "include/cuda_fp16.h include/cuda_bf16.h include/cuda_runtime.h".split()
)
DYNAMIC_SHARED_BYTES = 232448  # 227 KiB: the most dynamic shared memory an H100/H200 block may opt into
BUILD_VERSION = "3"  # bump when the generated code changes in a way the hashed files do not show

# NVRTC/nvcc options that mean nothing on a CPU; everything else except -D/-U/-I is refused
_IGNORED_OPTIONS = tuple(
    "-arch --gpu-architecture -std --std --use_fast_math -use_fast_math -lineinfo "
    "--generate-line-info -G --device-debug --fmad -fmad -rdc --relocatable-device-code "
    "-default-device --extra-device-vectorization -dopt --restrict -ftz -prec-div -prec-sqrt --ftz "
    "--prec-div --prec-sqrt -dlto --dlink-time-opt".split()
)

compile_count = 0  # how many times this process ran the C++ compiler (tests read it to check the cache)
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class CompileError(KernelBuildError):
    """The C++ compiler rejected the kernel (message and kernel line included), or there is no compiler."""


@dataclass(frozen=True)
class KernelInfo:
    """What the source says about one `__global__` function: its name, parameter names and C types."""

    name: str
    param_names: tuple[str, ...]
    param_types: tuple[str, ...]  # the C type text, e.g. "const float* __restrict__"
    is_template: bool = False  # `template <...> __global__ ...`: compiled, but not launchable by name

    def describe(self, i: int) -> str:
        """How messages name parameter i: its position, name and C type."""
        return f"argument {i} `{self.param_names[i]}` ({self.param_types[i]})"


def cache_dir() -> Path:
    """Where compiled kernels live: $VLLMINI_CACHE_DIR/emulator, else $XDG_CACHE_HOME/vllmini/emulator,
    else ~/.cache/vllmini/emulator."""
    if os.environ.get("VLLMINI_CACHE_DIR"):
        return Path(os.environ["VLLMINI_CACHE_DIR"]) / "emulator"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllmini" / "emulator"


def check_platform() -> None:
    """Refuse Windows early, with what to do instead (fibers need POSIX)."""
    if sys.platform.startswith("win"):
        raise CompileError(
            "the CUDA emulator needs Linux or macOS (it runs CUDA threads as fibers); on Windows use WSL "
            "(https://learn.microsoft.com/windows/wsl/) and install g++ there"
        )


@functools.cache
def find_compiler() -> tuple[str, str]:
    """(path, version line) of the C++ compiler: $CXX, else c++, g++, clang++."""
    check_platform()
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True)
            if out.returncode == 0:
                return path, out.stdout.splitlines()[0] if out.stdout else name
    hint = (
        "xcode-select --install"
        if sys.platform == "darwin"
        else "sudo apt-get install g++  (or dnf install gcc-c++)"
    )
    raise CompileError(f"no C++ compiler found (looked for {', '.join(candidates)}); install one: {hint}")


# ---------------------------------------------------------------- reading the source (never editing it)
def strip_comments(code: str) -> str:
    """The source with comments and string contents blanked out, same length and line breaks."""

    def blank(match: re.Match) -> str:
        text = match.group(0)
        if text.startswith(('"', "'")):
            return text[0] + re.sub(r"[^\n]", " ", text[1:-1]) + text[-1]
        return re.sub(r"[^\n]", " ", text)

    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', blank, code, flags=re.S)


_KERNEL_RE = re.compile(
    r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?"
    r"([A-Za-z_]\w*)\s*\("
)
_EXTERN_SHARED_RE = re.compile(
    r"extern\s+__shared__\s+((?:__align__\s*\(\s*\d+\s*\)\s*)?)([A-Za-z_][\w\s:<>,]*?)"
    r"\s*([A-Za-z_]\w*)\s*\[\s*\]"
)


def find_kernels(code: str) -> dict[str, KernelInfo]:
    """Every `__global__ void name(...)` in the source, with its parameter names and types."""
    text = strip_comments(code)
    kernels = {}
    for match in _KERNEL_RE.finditer(text):
        params = text[match.end() : _closing(text, match.end() - 1, "(", ")")]
        names, types = [], []
        if params.strip() not in ("", "void"):
            for position, part in enumerate(_split_top_level(params)):
                part = " ".join(part.split("=")[0].split())
                parsed = re.match(r"(.*?)([A-Za-z_]\w*)\s*(\[[^\]]*\])?\s*$", part)
                if parsed and parsed.group(1).strip():
                    types.append(parsed.group(1).strip())
                    names.append(parsed.group(2))
                else:
                    types.append(part)
                    names.append(f"arg{position}")
        name = match.group(1)
        kernels[name] = KernelInfo(name, tuple(names), tuple(types), _after_template(text, match.start()))
    return kernels


def _closing(text: str, start: int, open_: str, close: str, step: int = 1) -> int:
    """Index of the bracket that closes the one at `start` (step=-1: opens the one at `start`), or -1."""
    depth, i = 0, start
    while 0 <= i < len(text):
        depth += (text[i] == open_) - (text[i] == close)
        if depth == 0:
            return i
        i += step
    return -1


def _after_template(text: str, start: int) -> bool:
    """True when the declaration at `start` follows a `template <...>` clause."""
    before = text[:start].rstrip()
    if not before.endswith(">"):
        return False
    opening = _closing(before, len(before) - 1, ">", "<", step=-1)
    return opening > 0 and re.search(r"\btemplate\s*$", before[:opening]) is not None


def _split_top_level(params: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(params):
        depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(params[start:i])
            start = i + 1
    parts.append(params[start:])
    return parts


def find_dynamic_shared(code: str) -> list[tuple[str, str, str]]:
    """(align, type, name) of every `extern __shared__ T name[];` declaration, one per name."""
    seen = {}
    for match in _EXTERN_SHARED_RE.finditer(strip_comments(code)):
        align, ctype, name = match.groups()
        seen.setdefault(name, (align.strip(), " ".join(ctype.split()), name))
    return list(seen.values())


# ---------------------------------------------------------------- the translation unit
def translation_unit(code: str, filename: str, kernel_names: list[str], *, main: bool) -> str:
    """C++ text: header, the untouched source, dynamic shared memory, the launcher table, the runtime."""
    # thread_local: one copy per OS thread = per block, like every other __shared__ object here
    dynamic_shared = "".join(
        f"{align or '__align__(16)'} thread_local {ctype} {name}[{DYNAMIC_SHARED_BYTES} / sizeof({ctype})];\n"
        for align, ctype, name in find_dynamic_shared(code)
    )
    entries = "".join(
        f"EMU_UNCHECKED static void __emu_entry_{name}(void** a) {{ __emu::call(&{name}, a); }}\n"
        f"static std::string __emu_sig_{name}() {{ return __emu::signature(&{name}); }}\n"
        for name in kernel_names
    )
    table = "".join(f'    {{"{name}", __emu_entry_{name}, __emu_sig_{name}}},\n' for name in kernel_names)
    main_include = '#include "emu_main.h"\n' if main else ""
    return f"""// generated by vllmini.emulator: do not edit
#include "cuda_emu.h"
#line 1 "{filename}"
{code}
#line 1 "<vllmini.emulator launcher>"
{dynamic_shared}#include "emu_runtime.h"
{entries}static const __emu::KernelEntry __emu_table[] = {{
{table}}};
#include "emu_entry.h"
{main_include}"""


def _hash(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _option_flags(options: tuple[str, ...]) -> list[str]:
    flags = []
    for opt in options:
        if not isinstance(opt, str):
            raise InvalidTypeError(f"options must be strings, got {type(opt).__name__} {opt!r}")
        if opt.startswith(("-D", "-U", "-I")):
            flags.append(opt)
        elif not opt.startswith(_IGNORED_OPTIONS):
            raise InvalidArgumentError(
                f"option {opt!r} is not supported by the CPU emulator (it accepts -D, -U, -I and ignores "
                f"GPU-only flags such as -arch, -std, --use_fast_math)"
            )
    return flags


def compile_flags(version: str, flags: list[str], *, checked: bool) -> list[list[str]]:
    """The compiler's arguments (before the source and output names), one list per step.

    In-process library: compiled with the per-access calls of -fsanitize=thread (whose runtime is NOT
    linked: emu_check.h defines the calls, to check bounds and races) and line tables (-g1: the kernel line
    of an error), then linked. Checked mode: one step, an AddressSanitizer executable."""
    common = ["-std=c++17", "-pthread", "-fno-strict-aliasing", f"-I{HERE}", f"-I{HERE / 'include'}", *flags]
    link_dl = ["-ldl"] if sys.platform.startswith("linux") else []
    if checked:
        mode = ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
        if "clang" in version.lower():
            mode.append("-shared-libsan")  # the ASan runtime keeps its thread-locals out of our TLS block
        return [[*common, *mode, *link_dl]]
    hooks = (
        ["-fno-sanitize-thread-func-entry-exit"]
        if "clang" in version.lower()
        else ["--param=tsan-instrument-func-entry-exit=0"]
    )
    compile_step = [
        *common,
        "-c",
        "-O2",
        "-g1",
        "-gdwarf-4",
        "-fPIC",
        "-fstack-clash-protection",  # a large frame touches its pages top down: it meets the guard page first
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
    ]
    link_step = ["-shared", "-pthread", *link_dl]
    return [[*compile_step, "-fsanitize=thread", *hooks], link_step]


def build(
    code: str, filename: str, kernel_names: list[str], options: tuple[str, ...], *, checked: bool
) -> Path:
    """Compile (or find in the cache) a shared library, or with checked=True an ASan executable.

    The cache key hashes the translation unit (the source and every header), the compiler (path, version,
    size and date of its file) and every flag it is given; see private_cache_dir and trusted for who may
    have written a cached file."""
    global compile_count
    cxx, version = find_compiler()
    steps = compile_flags(version, _option_flags(options), checked=checked)
    headers = "".join((HERE / name).read_text() for name in HEADER_FILES)
    tu = translation_unit(code, filename, kernel_names, main=checked)
    compiler = os.stat(cxx)
    compiler_file = f"{compiler.st_size}:{compiler.st_mtime_ns}"
    key = _hash(BUILD_VERSION, tu, headers, repr(steps), cxx, version, compiler_file, sys.platform)
    out_dir = private_cache_dir()
    target = out_dir / (f"{Path(filename).stem}-{key}" + (".asan" if checked else ".so"))
    if target.exists() and trusted(target):
        return target
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src, obj, out = Path(tmp) / "tu.cpp", Path(tmp) / "tu.o", Path(tmp) / "out"
        src.write_text(tu)
        with _lock:
            compile_count += 1
        if checked:
            commands = [[cxx, *steps[0], str(src), "-o", str(out)]]
        else:
            commands = [
                [cxx, *steps[0], str(src), "-o", str(obj)],
                [cxx, str(obj), *steps[1], "-o", str(out)],
            ]
        for cmd in commands:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise CompileError(_compile_message(proc.stderr, filename, checked))
        out.chmod(0o700)
        os.replace(out, target)  # atomic: a concurrent build of the same key is harmless
    return target


def private_cache_dir() -> Path:
    """cache_dir(), created private (0700) if missing; refused when another user owns it, made private again
    when it is ours but others may write to it (a kernel library there is code this process will run)."""
    path = cache_dir()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise CompileError(
            f"the emulator's build cache {path} belongs to another user (uid {info.st_uid}); libraries there "
            f"would run inside this process. Set VLLMINI_CACHE_DIR to a directory of your own"
        )
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def trusted(path: Path) -> bool:
    """True when a cached build may be loaded: a file owned by this user that no one else may write."""
    info = path.lstat()
    return (
        path.is_file() and not path.is_symlink() and info.st_uid == os.getuid() and not info.st_mode & 0o022
    )


def _compile_message(stderr: str, filename: str, checked: bool) -> str:
    """One headline naming the kernel line, then the compiler's own output (trimmed)."""
    lines = [line for line in stderr.splitlines() if "tu.cpp" not in line]
    errors = [line.strip() for line in lines if "error" in line.lower()]
    in_kernel = [line for line in errors if line.startswith(f"{filename}:")]
    head = (in_kernel or errors or ["the C++ compiler failed"])[0]
    origin = next(
        (line.strip() for line in lines if line.startswith(f"{filename}:") and "required from" in line), None
    )
    if not in_kernel and origin:
        head += f" [{origin.split(':   required')[0].split(': required')[0]}]"
    if "asm" in stderr or "Assembler" in stderr:
        head += " (inline PTX / asm is not supported by the CPU emulator)"
    if checked and "asan" in stderr.lower() and ("cannot find" in stderr or "not found" in stderr):
        head = "AddressSanitizer is missing: install libasan (apt-get install libasan8) or use clang"
    body = "\n".join(lines[:40])
    return (
        f"{head}\n(the emulator supports the CUDA subset listed in vllmini/emulator/cuda_emu.h)\n"
        f"--- compiler output ---\n{body}"
    )


def load(path: Path) -> ctypes.CDLL:
    """dlopen a compiled kernel library once per process."""
    key = str(path)
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            lib = ctypes.CDLL(key)
            dims, u64 = ctypes.POINTER(ctypes.c_uint), ctypes.c_ulonglong
            # emu_launch(kernel, args, grid, block, schedule, seed, launch id); emu_stop(launch id, reason)
            lib.emu_launch.restype = ctypes.c_int
            lib.emu_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, dims, dims, ctypes.c_int, u64, u64]
            lib.emu_stop.restype = None
            lib.emu_stop.argtypes = [u64, ctypes.c_int]
            lib.emu_error.restype = ctypes.c_char_p
            lib.emu_signature.restype = ctypes.c_char_p
            lib.emu_signature.argtypes = [ctypes.c_int]
            lib.emu_error_info.restype = None
            lib.emu_error_info.argtypes = [ctypes.c_void_p]
            lib.emu_set_checks.restype = ctypes.c_int
            lib.emu_set_checks.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            _loaded[key] = lib
    return lib

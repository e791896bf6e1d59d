"""Which CUDA kernels exist: the .cu files of kernels/ and the paged-attention versions among them.

The .cu files are plain text that the package reads (vllmini/kernels/ in a wheel, the top-level kernels/
in a checkout). Versions: kernels/paged_attention_<n>_<what it adds>.cu, one file per idea (VERSIONS).
With none asked for, the best is used (`resolve_kernel_version`): today version 5 for every dtype, at or
near the read ceiling on every shape measured (benchmarks/RESULTS.md); `vllmini.paged_attention(...,
kernel_version=n)` selects another for teaching and benchmarking. `vllmini.cuda_kernels` compiles and
launches them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from vllmini.checks import as_int
from vllmini.errors import InvalidArgumentError, InvalidTypeError, KernelSourceNotFoundError

DTYPE_SUFFIX = {torch.float32: "", torch.float16: "_f16", torch.bfloat16: "_bf16"}  # entry point suffixes


# ----------------------------------------------------------------------------- finding the sources


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


# ----------------------------------------------------------------------------- the versions


@dataclass(frozen=True)
class KernelVersion:
    """One paged-attention kernel: kernels/paged_attention_<number>_<name>.cu and how to launch it."""

    number: int
    name: str  # what the version adds, e.g. "half_warps"
    dtypes: tuple[torch.dtype, ...]  # element types it has entry points for
    threads: int  # threads per block
    guard: bool  # checks page ids in the kernel (the error buffer of vllmini.attention)
    summary: str  # one line: what it adds

    @property
    def file(self) -> str:
        """The file stem, also the float32 entry point's name."""
        return f"paged_attention_{self.number}_{self.name}"

    def function(self, dtype: torch.dtype) -> str:
        """The entry point for an element type: the stem, then _f16 / _bf16 for 16-bit types."""
        return self.file + DTYPE_SUFFIX[dtype]

    def available(self) -> bool:
        """True when its .cu file is present (a version whose file is missing is simply absent)."""
        try:
            return (kernel_dir() / f"{self.file}.cu").is_file()
        except KernelSourceNotFoundError:
            return False


_ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# every version the course has, in order; kernel_versions() keeps those whose file is present
VERSIONS: tuple[KernelVersion, ...] = (
    KernelVersion(
        1, "plain", (torch.float32,), 128, False, "scores in shared memory, three passes (notebook 05)"
    ),
    KernelVersion(2, "warp_softmax", _ALL_DTYPES, 256, False, "a warp per token, online softmax per warp"),
    KernelVersion(3, "vector_loads", _ALL_DTYPES, 256, False, "lanes own consecutive dims: 16-byte loads"),
    KernelVersion(4, "half_warps", _ALL_DTYPES, 256, False, "16-bit rows in half warps: 2 tokens a warp"),
    KernelVersion(
        5, "gqa_split", _ALL_DTYPES, 128, True, "a block per KV head, split contexts, fewer shuffles, guard"
    ),
)


@functools.cache
def _present_versions() -> tuple[KernelVersion, ...]:
    return tuple(v for v in VERSIONS if v.available())  # looked up once: file checks cost ~100 us a call


def kernel_versions() -> dict[int, KernelVersion]:
    """The versions whose .cu file is present (when first asked), by number."""
    return {v.number: v for v in _present_versions()}


def resolve_kernel_version(version: int | str | None, dtype: torch.dtype | None = None) -> KernelVersion:
    """A KernelVersion from a number (4), a name ("half_warps") or a stem ("4_half_warps"); None picks the
    best: the highest-numbered version present that has an entry point for `dtype` (today 5 for every
    dtype; version 5 then chooses its own heads per block and context splits, see launch_plan)."""
    versions = kernel_versions()
    if version is None:
        usable = [v for v in versions.values() if dtype is None or dtype in v.dtypes]
        if not usable:
            raise InvalidTypeError(
                f"no paged-attention kernel takes {dtype}; kernels exist for {_ALL_DTYPES}"
            )
        return max(usable, key=lambda v: v.number)
    if isinstance(version, str):
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

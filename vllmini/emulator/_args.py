"""Kernel arguments: check each Python value against the C parameter type the compiler reported, and turn
it into what the launcher passes (a ctypes value, and for a tensor or array, where its bytes are)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllmini.checks import as_int
from vllmini.errors import InvalidArgumentError, InvalidTypeError

# element code of the C type (kind + bytes: emu_runtime.h's Code) -> the dtypes a buffer of it may have
_KIND_DTYPES = {
    "f4": {"float32"},
    "f8": {"float64"},
    "h2": {"float16"},
    "b2": {"bfloat16"},
    "c1": {"int8", "uint8", "bool"},
    "B1": {"bool", "uint8"},
} | {
    f"{kind}{size}": {f"{name}{8 * size}"}
    for kind, name in (("i", "int"), ("u", "uint"))
    for size in (1, 2, 4, 8)
}
# element code -> the ctypes type a scalar parameter of it is passed as
_SCALAR_CTYPES = {
    code: np.ctypeslib.as_ctypes_type(min(dtypes))
    for code, dtypes in _KIND_DTYPES.items()
    if code[0] in "fiu"
} | {"c1": ctypes.c_int8, "B1": ctypes.c_bool}


@dataclass(frozen=True)
class Buffer:
    """The memory of a tensor or array passed for a pointer parameter."""

    obj: Any  # the tensor or array itself, kept alive while the launch runs
    address: int
    nbytes: int
    writable: bool  # a pointer to non-const: the kernel may write through it

    def read(self) -> bytes:
        """A copy of the buffer's bytes."""
        return ctypes.string_at(self.address, self.nbytes)

    def write(self, data: bytes) -> None:
        """Overwrite the buffer with `data` (at most nbytes of it)."""
        ctypes.memmove(self.address, data, min(len(data), self.nbytes))


@dataclass(frozen=True)
class Arg:
    """One converted argument: the C value passed, and for a tensor or array, its buffer."""

    value: ctypes._SimpleCData
    buffer: Buffer | None = None


def convert(code: str, value: Any, what: str, *, checked: bool) -> Arg:
    """`value` as an argument for the parameter with signature code `code` (see emu_runtime.h's
    param_code); `what` names the parameter in messages. checked: raw addresses are refused."""
    if code.startswith("X") or code.startswith("Ss"):
        raise InvalidTypeError(f"{what}: this parameter type is not supported by the emulator")
    if code.startswith("P"):
        return _pointer(code, value, what, checked)
    return Arg(_scalar(code[1:], value, what))


def _dtype_name(value: Any) -> str:
    return str(value.dtype).removeprefix("torch.")


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _pointer(code: str, value: Any, what: str, checked: bool) -> Arg:
    elem = code[2:].split("x")[0]
    lanes = int(code.split("x")[1]) if "x" in code else 1
    writable = code[1] == "m"
    if value is None:
        return Arg(ctypes.c_void_p(0))
    if _is_tensor(value):
        if value.device.type != "cpu":
            raise InvalidTypeError(f"{what}: the emulator runs on the CPU; got a tensor on {value.device}")
        if not value.is_contiguous():
            raise InvalidArgumentError(
                f"{what}: tensor of shape {tuple(value.shape)} is not contiguous; pass .contiguous()"
            )
        address, nbytes = value.data_ptr(), value.numel() * value.element_size()
    elif isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise InvalidArgumentError(f"{what}: array of shape {value.shape} is not C-contiguous")
        if writable and not value.flags.writeable:
            raise InvalidArgumentError(
                f"{what}: the kernel may write through this pointer; the array is read-only"
            )
        address, nbytes = value.ctypes.data, value.nbytes
    elif (
        isinstance(value, (int, np.integer, ctypes.c_void_p)) and not isinstance(value, bool) and not checked
    ):
        address = value.value if isinstance(value, ctypes.c_void_p) else int(value)
        return Arg(ctypes.c_void_p(address))  # a raw address: trusted, unchecked
    else:
        extra = " (checked mode needs the tensor itself, to know the buffer's size)" if checked else ""
        raise InvalidTypeError(
            f"{what}: expected a CPU torch tensor or numpy array, got {type(value).__name__}{extra}"
        )
    accepted = _KIND_DTYPES.get(elem)
    if accepted is not None and _dtype_name(value) not in accepted:
        raise InvalidTypeError(
            f"{what}: got a {_dtype_name(value)} buffer, expected {' or '.join(sorted(accepted))}"
        )
    align = int(elem[1:]) * lanes if elem[1:].isdigit() else 1
    if address % align:
        raise InvalidArgumentError(
            f"{what}: address {address:#x} is not aligned to {align} bytes as the type needs"
        )
    return Arg(ctypes.c_void_p(address), Buffer(value, address, nbytes, writable))


def _scalar(elem: str, value: Any, what: str) -> ctypes._SimpleCData:
    ctype = _SCALAR_CTYPES.get(elem)
    if ctype is None:
        raise InvalidTypeError(f"{what}: scalar parameters of this type are not supported by the emulator")
    if _is_tensor(value) or isinstance(value, np.ndarray):
        raise InvalidTypeError(f"{what}: expected a scalar, got a {type(value).__name__}")
    kind, size = elem[0], int(elem[1])
    if isinstance(value, np.generic):
        # numpy scalars travel as their own bytes (as in CuPy), so the size and kind must match exactly
        if (
            value.dtype.itemsize != size
            or value.dtype.kind not in {"f": "f", "i": "i", "u": "u", "c": "iu", "B": "b"}[kind]
        ):
            wanted = {"f": "np.float", "u": "np.uint"}.get(kind, "np.int")
            raise InvalidTypeError(
                f"{what}: got numpy.{value.dtype}, which is {value.dtype.itemsize} bytes; "
                f"pass a {wanted}{8 * size}"
            )
        return ctype(value.item())
    if kind == "B" and isinstance(value, bool):
        return ctype(value)
    if kind in "iucB" and isinstance(value, int):
        bits = 8 * size
        low, high = {"B": (0, 1), "u": (0, 2**bits - 1)}.get(kind, (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1))
        return ctype(as_int(value, what, min=low, max=high))
    if kind == "f" and isinstance(value, (int, float)) and not isinstance(value, bool):
        if size == 4:
            raise InvalidTypeError(
                f"{what}: a Python {type(value).__name__} travels as an 8-byte double (CuPy does the same), "
                f"which a `float` parameter misreads; pass np.float32({value!r})"
            )
        return ctype(float(value))
    raise InvalidTypeError(f"{what}: cannot pass {type(value).__name__} {value!r}")

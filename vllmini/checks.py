"""The argument checks every public entry point shares, and small shared formulas (`cdiv`). Each check
returns the cleaned value or raises a VllminiError naming the argument, the bad value and what was
expected. numpy and torch integer scalars count as ints; bools and floats do not."""

from __future__ import annotations

import math
import operator

from vllmini.errors import InvalidArgumentError, InvalidIndexError, InvalidTypeError


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b: the blocks needed for a tokens."""
    return -(-a // b)


def _is_bool(value) -> bool:
    """True for Python, numpy and torch booleans (which `operator.index` and `float` would accept)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def as_int(value, name: str, *, min: int | None = None, max: int | None = None) -> int:
    """`value` as a Python int within [min, max] (either bound optional)."""
    if type(value) is not int:  # (a plain int, the common case, needs no conversion)
        if _is_bool(value):
            raise InvalidTypeError(f"{name} must be an int, got bool {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if min is not None and value < min:
        raise InvalidArgumentError(f"{name} must be >= {min}, got {value}")
    if max is not None and value > max:
        raise InvalidArgumentError(f"{name} must be <= {max}, got {value}")
    return value


def as_seed(value, name: str = "seed") -> int:
    """`value` as a seed `torch.Generator.manual_seed` takes: an int in [-2**63, 2**64)."""
    return as_int(value, name, min=-(2**63), max=2**64 - 1)


def as_hashable(value, name: str):
    """`value` if it can be a dict key (e.g. a sequence id: an int, a str, a tuple of them)."""
    try:
        hash(value)
    except TypeError:
        raise InvalidTypeError(f"{name} must be hashable (an int, str or tuple), got {value!r}") from None
    return value


def as_block_size(value) -> int:
    """`value` as a block size: tokens per KV block, an int >= 1 (the one check every constructor uses)."""
    return as_int(value, "block_size", min=1)


def as_index(value, name: str, size: int) -> int:
    """`value` as an int index in [0, size); out of range is an IndexError (InvalidIndexError)."""
    value = as_int(value, name)
    if not 0 <= value < size:
        raise InvalidIndexError(f"{name} must be in [0, {size}), got {value}")
    return value


def as_pair(value, name: str) -> tuple:
    """`value` unpacked as two items, e.g. a (src_block, dst_block) pair; `name` says which pair."""
    try:
        first, second = value
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a pair, got {value!r}") from None
    return first, second


def as_float(
    value, name: str, *, min: float | None = None, max: float | None = None, finite: bool = True
) -> float:
    """`value` (any real number but a bool) as a Python float within [min, max]."""
    if _is_bool(value):
        raise InvalidTypeError(f"{name} must be a number, got bool {value!r}")
    if not hasattr(value, "__float__") or isinstance(value, (str, bytes)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InvalidTypeError(f"{name} must be a real number, got {value!r}") from None
    if finite and not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite, got {value}")
    if min is not None and not value >= min:
        raise InvalidArgumentError(f"{name} must be >= {min}, got {value}")
    if max is not None and not value <= max:
        raise InvalidArgumentError(f"{name} must be <= {max}, got {value}")
    return value


def as_fraction(value, name: str, interval: str) -> float:
    """`value` as a float in `interval`: "(0, 1]" or "[0, 1)"."""
    value = as_float(value, name)
    if not (0.0 < value <= 1.0 if interval == "(0, 1]" else 0.0 <= value < 1.0):
        raise InvalidArgumentError(f"{name} must be in {interval}, got {value}")
    return value


def one_of(value, name: str, choices) -> object:
    """`value` if it is one of `choices`, else an error listing them."""
    if value not in choices:
        raise InvalidArgumentError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_tensor(
    t,
    name: str,
    *,
    ndim: int | None = None,
    dtypes=None,
    device=None,
    shape: tuple | None = None,  # None entries: any size
    shape_desc: str | None = None,  # the layout, for messages: e.g. "[num_seqs, num_heads, head_size]"
):
    """`t` if it is a torch.Tensor of `ndim`, one of `dtypes`, on `device`, of `shape`."""
    import torch

    desc = f" {shape_desc}" if shape_desc else ""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor{desc}, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D{desc}, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
        if t.dtype not in dtypes:
            want = dtypes[0] if len(dtypes) == 1 else f"one of {list(dtypes)}"
            raise InvalidTypeError(f"{name} must be {want}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise InvalidArgumentError(f"{name} must be on {device}, got {t.device}")
    if shape is not None and (
        t.dim() != len(shape) or any(w is not None and s != w for s, w in zip(t.shape, shape, strict=True))
    ):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        want = f"{shape_desc} = {want}" if shape_desc else f"of shape {want}"
        raise InvalidArgumentError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    return t


def as_bool(value, name: str) -> bool:
    """`value` if it is a bool (numpy's or torch's too); ints and strings are refused."""
    if not _is_bool(value) or getattr(value, "ndim", 0) != 0:
        raise InvalidTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def as_token_ids(values, name: str) -> list[int]:
    """A list of token ids from a list/tuple/range of ints or a 1-D integer tensor or array."""
    if hasattr(values, "dtype") and hasattr(values, "tolist"):  # a torch tensor or numpy array
        if values.ndim != 1 or "int" not in str(values.dtype):  # floats, complex and bool are refused
            raise InvalidTypeError(
                f"{name} must be a 1-D integer tensor or array, got {values.dtype} of shape "
                f"{tuple(values.shape)}"
            )
        values = values.tolist()
    elif not isinstance(values, (list, tuple, range)):
        raise InvalidTypeError(
            f"{name} must be a list of int token ids, got {type(values).__name__} {values!r}"
        )
    return [as_int(v, f"{name}[{i}]") for i, v in enumerate(values)]

"""Tests for vllmini.checks: what counts as an int, a float, an index, and the messages of check_tensor."""

import numpy as np
import pytest
import torch

from vllmini.checks import as_float, as_fraction, as_index, as_int, as_pair, cdiv, check_tensor
from vllmini.errors import InvalidArgumentError, InvalidIndexError, InvalidTypeError


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3)], ids=repr)
def test_as_int_takes_python_numpy_and_torch_ints(value):
    got = as_int(value, "n", min=3, max=3)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", [True, np.True_, torch.tensor(False)], ids=repr)
def test_bools_are_neither_ints_nor_floats(value):
    with pytest.raises(InvalidTypeError, match="n must be an int, got bool"):
        as_int(value, "n")
    with pytest.raises(InvalidTypeError, match="x must be a number, got bool"):
        as_float(value, "x")


@pytest.mark.parametrize("value", [2.0, "2", None, torch.tensor(2.0), torch.tensor([1, 2])], ids=repr)
def test_as_int_rejects_non_ints(value):
    with pytest.raises(InvalidTypeError, match="n must be an int"):
        as_int(value, "n")


def test_as_int_bounds_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="n must be >= 1, got 0"):
        as_int(0, "n", min=1)
    with pytest.raises(InvalidArgumentError, match="n must be <= 4, got 5"):
        as_int(np.int64(5), "n", max=4)


@pytest.mark.parametrize("value", [0.5, np.float32(0.5), np.float64(0.5), torch.tensor(0.5), 1], ids=repr)
def test_as_float_takes_numpy_and_torch_scalars(value):
    got = as_float(value, "scale", min=0.0, max=1.0)
    assert got == float(value) and type(got) is float


def test_as_float_rejects_strings_and_non_finite():
    with pytest.raises(InvalidTypeError, match="scale must be a number, got str"):
        as_float("0.5", "scale")
    with pytest.raises(InvalidArgumentError, match="scale must be finite, got nan"):
        as_float(np.float32("nan"), "scale")


def test_as_index_is_an_index_error():
    assert as_index(np.int64(2), "layer", 3) == 2
    for bad in (3, -1):
        with pytest.raises(InvalidIndexError, match=rf"layer must be in \[0, 3\), got {bad}"):
            as_index(bad, "layer", 3)
    assert issubclass(InvalidIndexError, IndexError)


def test_as_pair():
    assert as_pair(np.array([3, 4]), "p") == (3, 4) and as_pair([None, 1], "p") == (None, 1)
    for bad in ((1,), (1, 2, 3), 5, None):
        with pytest.raises(InvalidArgumentError, match="p must be a pair, got"):
            as_pair(bad, "p")


def test_cdiv():
    assert (
        [cdiv(a, 4) for a in range(10)] == [-(-a // 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    )


def test_check_tensor_messages():
    t = torch.zeros(2, 3, dtype=torch.float16)
    assert check_tensor(t, "x", ndim=2, dtypes=torch.float16, device="cpu", shape=(None, 3)) is t
    with pytest.raises(InvalidTypeError, match="x must be a torch.Tensor, got list"):
        check_tensor([1], "x")
    with pytest.raises(InvalidArgumentError, match=r"x must be 3-D \[a, b, c\], got shape \(2, 3\)"):
        check_tensor(t, "x", ndim=3, shape_desc="[a, b, c]")
    with pytest.raises(
        InvalidTypeError, match=r"x must be one of \[torch.float32, torch.bfloat16\], got torch.float16"
    ):
        check_tensor(t, "x", dtypes=(torch.float32, torch.bfloat16))
    with pytest.raises(InvalidArgumentError, match="x must be on meta, got cpu"):
        check_tensor(t, "x", device="meta")
    with pytest.raises(InvalidArgumentError, match=r"x must be \[rows, 4\] = \[\*, 4\], got shape \(2, 3\)"):
        check_tensor(t, "x", shape=(None, 4), shape_desc="[rows, 4]")
    with pytest.raises(InvalidArgumentError, match=r"x must be of shape \[2\], got shape \(2, 3\)"):
        check_tensor(t, "x", shape=(2,))


@pytest.mark.parametrize(
    "value, interval, ok",
    [(0.0, "(0, 1]", False), (1.0, "(0, 1]", True), (0.0, "[0, 1)", True), (1.0, "[0, 1)", False),
     (-0.1, "[0, 1)", False), (1.5, "(0, 1]", False), (0.5, "(0, 1]", True)],
)  # fmt: skip
def test_as_fraction_checks_the_interval_it_names(value, interval, ok):
    if ok:
        assert as_fraction(value, "share", interval) == value
    else:
        with pytest.raises(
            InvalidArgumentError, match=rf"share must be in \{interval[0]}0, 1\{interval[-1]}, got"
        ):
            as_fraction(value, "share", interval)

"""Gradient messages (qps/ps/messages.py): encoding, decoding, validation. Pure."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import numpy as np
import pytest

from qps import wire
from qps.errors import DataLossError, InvalidArgumentError
from qps.ps.messages import (
    GradientMessage,
    SparseGradient,
    check_gradient,
    decode_message,
    encode_message,
    is_finite,
    narrower,
    widen,
)
from qps.varspec import VariableSpec


def _msg() -> GradientMessage:
    return GradientMessage(
        worker="w0",
        step=7,
        shard=1,
        nonce="ab12.3",
        grads={
            "dense/w": np.arange(6, dtype=np.float32).reshape(2, 3),
            "emb": SparseGradient(np.array([4, 0, 4], np.int64), np.ones((3, 2), np.float64)),
            "scalar": np.array(2.5, np.float64),
        },
        versions={"dense/w": 12, "emb": 3},
        global_step=True,
        time=123.5,
    )


def test_round_trip() -> None:
    m = _msg()
    data = encode_message(m)
    out = decode_message(data)
    assert out.id == "w0/7/1/ab12.3" == m.id
    assert (out.worker, out.step, out.shard, out.nonce) == ("w0", 7, 1, "ab12.3")
    assert out.global_step and out.time == 123.5
    assert out.versions == {"dense/w": 12, "emb": 3}
    assert list(out.grads) == ["dense/w", "emb", "scalar"]
    np.testing.assert_array_equal(out.grads["dense/w"], m.grads["dense/w"])
    e = out.grads["emb"]
    assert isinstance(e, SparseGradient)
    np.testing.assert_array_equal(e.indices, [4, 0, 4])
    assert e.values.dtype == np.float64 and e.values.shape == (3, 2)
    s = out.grads["scalar"]
    assert isinstance(s, np.ndarray) and s.shape == () and float(s) == 2.5
    assert out.rows == 2 + 3 + 1


def test_decode_from_uint8_array_is_zero_copy() -> None:
    data = np.frombuffer(encode_message(_msg()), np.uint8)
    out = decode_message(data)
    g = out.grads["dense/w"]
    assert isinstance(g, np.ndarray) and not g.flags.writeable
    assert np.shares_memory(g, data)


def test_empty_message() -> None:
    m = GradientMessage(worker="w", step=0, shard=0, nonce="n", global_step=True)
    out = decode_message(encode_message(m))
    assert out.grads == {} and out.global_step and out.rows == 0


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-3],  # truncated
        lambda b: b + b"\0" * 8,  # trailing
        lambda b: b"XX" + b[2:],  # bad magic
        lambda b: b"",  # empty
    ],
)
def test_corrupt_bytes_raise_data_loss(mutate) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DataLossError):
        decode_message(mutate(encode_message(_msg())))


def _raw(meta: object, arrays: list[np.ndarray], names: list[str]) -> bytes:
    head = np.frombuffer(msgpack.packb(meta), np.uint8)
    return wire.encode([head, *arrays], names=["@meta", *names])


GOOD_META = {"format": 1, "worker": "w", "step": 1, "shard": 0, "nonce": "n", "vars": []}


@pytest.mark.parametrize(
    ("meta", "arrays", "names", "text"),
    [
        ({**GOOD_META, "format": 2}, [], [], "format 2"),
        ({**GOOD_META, "worker": ""}, [], [], "worker"),
        ({**GOOD_META, "step": -1}, [], [], "step"),
        ({**GOOD_META, "vars": "x"}, [], [], "'vars' is not a list"),
        ({**GOOD_META, "vars": [["w", "d", 0]]}, [], [], "components of 'w'"),
        (
            {**GOOD_META, "vars": [["w", "s", 0]]},
            [np.zeros(2, np.int32), np.zeros((2, 1))],
            ["i:w", "v:w"],
            "int64",
        ),
        (GOOD_META, [np.zeros(2)], ["d:w"], "not named"),
        ({**GOOD_META, "vars": [["w", "x", 0]]}, [np.zeros(2)], ["d:w"], "kind 'x'"),
        (
            {**GOOD_META, "vars": [["w", "d", 0], ["w", "d", 0]]},
            [np.zeros(2), np.zeros(2)],
            ["d:w", "d:w"],
            "twice",
        ),
        ([1, 2], [], [], "not a map"),
    ],
)
def test_bad_meta_raises_data_loss(meta, arrays, names, text) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DataLossError, match=text):
        decode_message(_raw(meta, arrays, names))


def test_first_component_must_be_meta() -> None:
    with pytest.raises(DataLossError, match="@meta"):
        decode_message(wire.encode([np.zeros(3)], names=["d:w"]))


def test_random_bytes_never_raise_anything_else() -> None:
    rng = np.random.default_rng(5)
    good = encode_message(_msg())
    for _ in range(300):
        b = bytearray(good)
        for _ in range(rng.integers(1, 6)):
            b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        with contextlib.suppress(DataLossError):
            decode_message(bytes(b))


SPEC = VariableSpec(np.dtype(np.float32), (4, 3))


def test_check_gradient_dense_ok_and_lists_converted() -> None:
    g = check_gradient("w", SPEC, np.ones((4, 3), np.float32))
    assert isinstance(g, np.ndarray) and g.dtype == np.float32
    g2 = check_gradient("w", SPEC, [[1.0, 2.0, 3.0]] * 4)
    assert isinstance(g2, np.ndarray) and g2.dtype == np.float32 and g2.shape == (4, 3)


def test_check_gradient_sparse_ok() -> None:
    g = check_gradient("w", SPEC, ([3, 0], np.ones((2, 3), np.float32)))
    assert isinstance(g, SparseGradient) and g.indices.dtype == np.int64


@pytest.mark.parametrize(
    ("grad", "text"),
    [
        (np.ones((4, 2), np.float32), r"gradient of 'w' has shape \[4,2\], the variable \[4,3\]"),
        (np.ones((4, 3), np.float64), "is float64, the variable float32"),
        (([0, 4], np.ones((2, 3), np.float32)), r"is not in \[0, 4\)"),
        (([0, 1], np.ones((3, 3), np.float32)), r"values have shape \[3,3\]"),
        (([[0]], np.ones((1, 3), np.float32)), "must be 1-D"),
        ((np.array([0.5]), np.ones((1, 3), np.float32)), "integers"),
        ((1, 2, 3), "pair"),
        ("abc", "not numeric"),
    ],
)
def test_check_gradient_errors(grad, text) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=text):
        check_gradient("w", SPEC, grad)


def test_a_narrower_float_gradient_is_taken_as_it_is_and_widened_exactly() -> None:
    """float16 for a float32 variable (and float16/float32 for float64): compressed on
    purpose, kept as sent; widen() gives the variable's dtype, every value exact. A
    wider float, an int, or a narrower one for a float16 variable is still refused."""
    rng = np.random.default_rng(3)
    half = rng.standard_normal((4, 3)).astype(np.float16)
    g = check_gradient("w", SPEC, half)
    assert isinstance(g, np.ndarray) and g.dtype == np.float16
    wide = widen(g, SPEC)
    assert wide.dtype == np.float32 and np.array_equal(wide, half.astype(np.float32))
    rows = check_gradient("w", SPEC, ([1, 3], half[:2]))
    assert isinstance(rows, SparseGradient) and rows.values.dtype == np.float16
    wrows = widen(rows, SPEC)
    assert isinstance(wrows, SparseGradient) and wrows.values.dtype == np.float32
    assert wrows.indices.tolist() == [1, 3]
    f64 = VariableSpec(np.dtype(np.float64), (4, 3))
    for narrow in (np.float16, np.float32):
        assert widen(check_gradient("d", f64, half.astype(narrow)), f64).dtype == np.float64
    f16 = VariableSpec(np.dtype(np.float16), (4, 3))
    assert widen(check_gradient("h", f16, half), f16) is not None
    with pytest.raises(InvalidArgumentError, match="is float32, the variable float16"):
        check_gradient("h", f16, half.astype(np.float32))
    with pytest.raises(InvalidArgumentError, match="is int32, the variable float32"):
        check_gradient("w", SPEC, np.ones((4, 3), np.int32))
    assert narrower(np.dtype(np.float16), np.dtype(np.float32))
    assert not narrower(np.dtype(np.int8), np.dtype(np.float32))
    assert not narrower(np.dtype(np.float32), np.dtype(np.float32))


def test_check_gradient_refuses_int_variables_and_sparse_scalars() -> None:
    with pytest.raises(InvalidArgumentError, match="only floating-point"):
        check_gradient("n", VariableSpec(np.dtype(np.int64), (3,)), np.ones(3, np.int64))
    with pytest.raises(InvalidArgumentError, match="scalar"):
        check_gradient("s", VariableSpec(np.dtype(np.float32), ()), ([0], [1.0]))


def test_is_finite() -> None:
    assert is_finite(np.ones(3))
    assert not is_finite(np.array([1.0, np.nan]))
    assert not is_finite(SparseGradient(np.array([0]), np.array([[np.inf]])))
    assert is_finite(SparseGradient(np.zeros(0, np.int64), np.zeros((0, 2))))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_is_finite_finds_one_bad_value_and_accepts_huge_finite_ones(dtype: Any) -> None:
    big = np.finfo(dtype).max
    x = np.full((64, 33), big, dtype)  # its dot product with itself overflows
    assert is_finite(x)
    assert is_finite(x[:, ::2])  # not contiguous
    for bad in (np.nan, np.inf, -np.inf):
        y = np.ones((64, 33), dtype)
        y[40, 8] = bad
        assert not is_finite(y)
        assert not is_finite(y[:, ::2])

"""Tests of qps.wire, the tensor <-> bytes codec."""

from __future__ import annotations

import struct
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qps import wire
from qps.errors import DataLossError, InvalidArgumentError

ALL_CODES = ["b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"]
ALL_DTYPES = [np.dtype(np.bool_)] + [np.dtype("<" + c) for c in ALL_CODES[1:]]

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def _sample(dt: np.dtype[Any], shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw = raw & 1
    return raw.view(dt).reshape(shape).copy()


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype (as little-endian), shape and bytes (so NaN payloads count)."""
    le = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    return (
        b.dtype == le
        and a.shape == b.shape
        and np.ascontiguousarray(a, dtype=le).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def _roundtrip(arrays: list[Any], names: list[str] | None = None) -> wire.Message:
    data = wire.encode(arrays, names)
    msg = wire.decode(data)
    assert len(msg.arrays) == len(arrays)
    for a, b in zip(arrays, msg.arrays, strict=True):
        assert _same(np.asarray(a), b)
    return msg


def _craft(header: Any, body: bytes = b"", flags: int = 0, *, raw: bytes | None = None) -> bytes:
    """A message with an arbitrary header object (or raw header bytes) and body."""
    hb = raw if raw is not None else msgpack.packb(header)
    head = b"QW" + bytes([1, flags]) + struct.pack("<I", len(hb)) + hb
    return head + bytes(-len(head) % 8) + body


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


# --------------------------------------------------------------------------- round trips


def test_constants() -> None:
    assert wire.FORMAT_VERSION == 1
    assert wire.MAX_MESSAGE_BYTES == 2**31 - 1
    assert wire.MAX_NDIM == 32


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_roundtrip_every_dtype(dt: np.dtype[Any]) -> None:
    a = _sample(dt, (3, 5))
    msg = _roundtrip([a, _sample(dt, (7,), seed=1)])
    assert msg.names is None
    assert wire.dtype_from_code(wire.dtype_code(dt)) == dt


def test_dtype_codes() -> None:
    assert [wire.dtype_code(d) for d in ALL_DTYPES] == ALL_CODES
    assert wire.dtype_code(">f4") == "f4"
    assert wire.dtype_code(np.float64) == "f8"
    assert wire.dtype_code(bool) == "b1"
    for bad in ("O", "U3", "S", bytes, "V4", "c8", "c16", "M8[ns]", "m8[s]", np.longdouble):
        with pytest.raises(InvalidArgumentError, match="cannot be sent"):
            wire.dtype_code(bad)
    with pytest.raises(InvalidArgumentError):
        wire.dtype_code("not a dtype")
    for bad_code in ("c8", "f16", "", "F4", "<f4", "bool"):
        with pytest.raises(DataLossError, match="unknown dtype code"):
            wire.dtype_from_code(bad_code)


def test_string_dtype_codes() -> None:
    for n in (1, 2, 7, 1000, wire.MAX_STRING_ITEMSIZE):
        assert wire.dtype_code(np.dtype(f"S{n}")) == f"S{n}"
        assert wire.dtype_from_code(f"S{n}") == np.dtype(f"S{n}")
    assert wire.dtype_code("|S3") == wire.dtype_code(np.bytes_(b"abc").dtype) == "S3"
    bad_codes = ["S", "S0", "S01", "S007", "S-1", "S+1", "S 1", "S1 ", "S1.0", "s1", "S1a"]
    bad_codes += ["S\u0661", "S\uff11", f"S{wire.MAX_STRING_ITEMSIZE + 1}", "S" + "9" * 30]
    bad_codes += ["S" + "1" * 5000, "U1", "<S1", "|S1", "O"]
    for bad_code in bad_codes:
        with pytest.raises(DataLossError, match="unknown dtype code"):
            wire.dtype_from_code(bad_code)


def test_zero_dim_and_scalars() -> None:
    msg = _roundtrip([np.float32(3.5), np.array(7, np.int16), np.array(True)])
    assert [a.shape for a in msg.arrays] == [(), (), ()]
    msg = wire.decode(wire.encode([1, 2.5, True, [1, 2]]))
    assert [a.dtype for a in msg.arrays] == [np.int64, np.float64, np.bool_, np.int64]
    assert [a.tolist() for a in msg.arrays] == [1, 2.5, True, [1, 2]]


def test_zero_size_arrays() -> None:
    arrays = [
        np.zeros((0,), np.float32),
        np.zeros((3, 0, 2), np.int64),
        np.arange(3, dtype=np.uint8),
        np.zeros((0, 5), np.bool_),
    ]
    msg = _roundtrip(arrays)
    assert [a.shape for a in msg.arrays] == [(0,), (3, 0, 2), (3,), (0, 5)]
    _roundtrip([])
    _roundtrip([np.zeros(0, np.float64)])


def test_multidim_noncontiguous_and_fortran() -> None:
    base = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5)
    sliced = base[:, ::2, 1:, ::-1]
    fortran = np.asfortranarray(base[0])
    assert not sliced.flags.c_contiguous and not fortran.flags.c_contiguous
    _roundtrip([base, sliced, fortran, base.T])
    parts = wire.encode_parts([sliced])
    assert bytes(parts[1]) == np.ascontiguousarray(sliced).tobytes()


def test_big_endian_input() -> None:
    for code in ALL_CODES[1:]:
        a = _sample(np.dtype(">" + code), (4, 3))
        le = a.astype(a.dtype.newbyteorder("<"))
        assert wire.encode([a]) == wire.encode([le])
        (out,) = wire.decode_arrays(wire.encode([a]))
        assert out.dtype == np.dtype("<" + code)
        np.testing.assert_array_equal(out, a)


def test_names_and_mappings() -> None:
    data = wire.encode({"x": np.arange(3.0), "label": np.int64(4)})
    assert data[3] == 1  # names flag
    msg = wire.decode(data)
    assert msg.names == ["x", "label"]
    arrays, names = msg  # a NamedTuple
    assert arrays[1] == 4
    assert names == ["x", "label"]
    assert wire.decode(wire.encode([1, 2], names=["a", "b"])).names == ["a", "b"]
    assert wire.decode(wire.encode([], names=[])).names == []
    assert wire.encode([1], names=None)[3] == 0
    with pytest.raises(InvalidArgumentError, match="names"):
        wire.encode({"a": 1}, names=["a"])
    with pytest.raises(InvalidArgumentError, match="2 names"):
        wire.encode([1], names=["a", "b"])
    with pytest.raises(InvalidArgumentError, match="str"):
        wire.encode([1], names=[3])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="str"):
        wire.encode({1: 1})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError):
        wire.encode([1, 2], names="ab")


def test_encode_rejects_bad_arrays() -> None:
    bad_inputs = [
        (np.array([1, "a"], dtype=object), "object"),
        (np.array(["ab"]), "<U2"),
        (np.array([b"ab", None], dtype=object), "object"),
        (np.zeros(2, np.complex64), "complex64"),
        (np.zeros(2, "M8[ns]"), "datetime64"),
        (np.zeros(2, "V4"), "V4"),
        (np.zeros(2, [("a", "<f4")]), "cannot be sent"),
        (np.zeros(2, np.longdouble), "cannot be sent"),
        ("text", "<U4"),
        (1 + 2j, "complex"),
    ]
    for a, needle in bad_inputs:
        with pytest.raises(InvalidArgumentError, match=needle):
            wire.encode([np.float32(1), a])
    with pytest.raises(InvalidArgumentError):
        wire.encode([[1, [2, 3]]])  # ragged
    with pytest.raises(InvalidArgumentError, match="dimensions"):
        wire.encode([np.zeros((1,) * 33)])
    wire.encode([np.zeros((1,) * 32)])
    with pytest.raises(InvalidArgumentError, match="wrap"):
        wire.encode(np.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        wire.encode("abc")


# --------------------------------------------------------------------------- strings


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 64, 255, 1000])
def test_roundtrip_strings_of_every_width(n: int) -> None:
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 256, size=(3, 2, n), dtype=np.uint8)
    a = raw.view(f"S{n}").reshape(3, 2)  # any bytes, NULs included
    msg = _roundtrip([a, np.int64(5), a[0, 0], a[:, ::-1]])
    assert [b.dtype for b in msg.arrays] == [a.dtype, np.int64, a.dtype, a.dtype]
    data = wire.encode([a])
    assert data.endswith(a.tobytes())  # the raw buffer, nothing added
    assert wire.header_bytes([a.dtype], [a.shape]) == data[: len(data) - a.nbytes]


def test_roundtrip_strings_edge_cases() -> None:
    empties = np.array([b"", b""])  # S1 of NULs
    assert empties.dtype == "S1"
    zero = np.zeros((0,), "S5")
    zero2 = np.zeros((2, 0, 3), "S1000")
    scalar = np.array(b"hello")
    text = np.array(["é", "x"]).astype(object)
    utf8 = np.array([s.encode() for s in text.tolist()])
    msg = _roundtrip([empties, zero, zero2, scalar, utf8], ["e", "z", "z2", "s", "u"])
    assert msg.arrays[0].tolist() == [b"", b""]
    assert msg.arrays[1].shape == (0,) and msg.arrays[1].dtype == "S5"
    assert msg.arrays[2].shape == (2, 0, 3) and msg.arrays[2].dtype == "S1000"
    assert msg.arrays[3].shape == () and msg.arrays[3].item() == b"hello"
    assert [b.decode() for b in msg.arrays[4].tolist()] == ["é", "x"]
    # the wire keeps every byte; numpy drops trailing NULs when an item is read
    nul = np.array([b"a\x00b", b"a"], "S3")
    (back,) = wire.decode_arrays(wire.encode([nul]))
    assert back.tobytes() == nul.tobytes() and back.tolist() == [b"a\x00b", b"a"]
    # lists of bytes and numpy bytes scalars are arrays like any other
    assert wire.decode_arrays(wire.encode([[b"ab", b"c"]]))[0].tolist() == [b"ab", b"c"]
    assert wire.decode_arrays(wire.encode([np.bytes_(b"")]))[0].dtype == "S1"


def test_strings_are_zero_copy() -> None:
    a = np.array([b"abc", b"de", b"f"])
    parts = wire.encode_parts([np.arange(3, dtype=np.uint8), a])
    assert np.shares_memory(np.frombuffer(parts[-1], np.uint8), a)
    data = wire.encode([np.arange(3, dtype=np.uint8), a])
    out = wire.decode(data).arrays[1]
    assert np.shares_memory(out, np.frombuffer(data, np.uint8)) and not out.flags.writeable
    assert out.tolist() == [b"abc", b"de", b"f"]


def test_corrupt_string_headers() -> None:
    body = b"\0" * 64
    for code in ("S0", "S", "S01", "S-2", "S2147483648", "S1e3", "U2", "S2.0"):
        with pytest.raises(DataLossError, match="unknown dtype code"):
            wire.decode(_craft([[[code, [2]]], None], body))
    # sizes follow from the itemsize: a wrong width is a wrong length
    body = np.array([b"abcde", b"x"]).tobytes()  # S5 x 2: 10 bytes
    assert wire.decode(_craft([[["S5", [2]]], None], body)).arrays[0].tolist() == [b"abcde", b"x"]
    for code, needle in (("S4", "trailing"), ("S6", "truncated"), ("S2147483647", "declares")):
        with pytest.raises(DataLossError, match=needle):
            wire.decode(_craft([[[code, [2]]], None], body))
    with pytest.raises(DataLossError, match="too large"):
        wire.decode(_craft([[["S1000", [0, 2**62]]], None]))
    with pytest.raises(DataLossError, match="too large"):
        wire.decode(_craft([[["S2147483647", [2**31, 2**31]]], None], b"\0" * 8))
    with pytest.raises(DataLossError, match="limit 100"):
        wire.decode(_craft([[["S40", [3]]], None], b"\0" * 120), max_bytes=100)


def test_encode_rows_fixed_width_strings() -> None:
    dtypes, shapes = [np.dtype("S3"), np.int32], [(2,), ()]
    a = np.array([[b"ab", b"c"], [b"", b"xyz"], [b"q", b"rs"]], "S3")
    b = np.arange(3, dtype=np.int32)
    rows = wire.encode_rows([a, b], dtypes, shapes)
    assert [bytes(r) for r in rows] == [wire.encode([a[i], b[i]]) for i in range(3)]
    back = wire.decode_rows(rows, dtypes, shapes)
    assert back is not None and _same(a, back[0]) and _same(b, back[1])
    with pytest.raises(InvalidArgumentError, match="dtype"):
        wire.encode_rows([a.astype("S4"), b], dtypes, shapes)
    other = wire.encode([a[0].astype("S4"), b[0]])  # another width: another message
    assert wire.decode_rows([bytes(rows[0]), other], dtypes, shapes) is None


class _FakeCupy:
    """Duck-types the bits of a CuPy array that the codec uses."""

    def __init__(self, host: np.ndarray) -> None:
        self._host = host
        self.__cuda_array_interface__ = {"shape": host.shape}

    def get(self) -> np.ndarray:
        return self._host


def test_cupy_like_arrays() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert wire.encode([_FakeCupy(a)]) == wire.encode([a])
    rows = wire.encode_rows([_FakeCupy(a)], [np.float32], [(3,)])
    assert [bytes(r) for r in rows] == [wire.encode([a[0]]), wire.encode([a[1]])]


# --------------------------------------------------------------------------- zero copy and layout


def test_zero_copy_encode_and_decode() -> None:
    a = np.arange(9, dtype=np.float32)  # 36 bytes: 4 bytes of padding follow
    b = np.arange(3, dtype=np.int8)
    parts = wire.encode_parts([a, b])
    assert len(parts) == 4
    assert isinstance(parts[1], memoryview) and isinstance(parts[3], memoryview)
    assert np.shares_memory(np.frombuffer(parts[1], np.uint8), a)
    assert np.shares_memory(np.frombuffer(parts[3], np.uint8), b)
    assert parts[2] == b"\0" * 4
    assert b"".join(parts) == wire.encode([a, b])

    data = wire.encode([a, np.arange(5, dtype=np.int64)])
    out = wire.decode(data).arrays
    whole = np.frombuffer(data, np.uint8)
    assert len(out) == 2
    for arr in out:
        assert np.shares_memory(arr, whole)
        assert not arr.flags.writeable
    assert out[0].base is not None

    mutable = bytearray(data)
    out2 = wire.decode(mutable).arrays
    assert out2[0].flags.writeable
    out2[0][0] = 42.0
    assert wire.decode(bytes(mutable)).arrays[0][0] == 42.0

    # a memoryview slice of a larger buffer
    big = bytearray(b"x" * 16) + data + bytearray(b"y" * 5)
    view = memoryview(big)[16 : 16 + len(data)]
    out3 = wire.decode(view).arrays
    assert np.shares_memory(out3[1], np.frombuffer(big, np.uint8))
    np.testing.assert_array_equal(out3[1], np.arange(5))


def test_buffers_aligned_to_8() -> None:
    arrays = [
        np.arange(3, dtype=np.uint8),
        np.arange(5, dtype=np.int16),
        np.float64(1.5),
        np.ones((3, 3), np.bool_),
        np.arange(7, dtype=np.float32),
        np.arange(2, dtype=np.int64),
    ]
    for names in (None, ["a", "bb", "c", "ddd", "e", "f"]):
        data = wire.encode(arrays, names)
        start = _addr(np.frombuffer(data, np.uint8))
        offsets = [_addr(a) - start for a in wire.decode(data).arrays]
        assert len(offsets) == len(arrays) == 6
        assert all(off % 8 == 0 for off in offsets), offsets
        # buffers follow one another with < 8 bytes of padding, and end the message
        for (off, a), nxt in zip(zip(offsets, arrays, strict=True), offsets[1:], strict=False):
            assert 0 <= nxt - (off + a.nbytes) < 8
        assert offsets[-1] + arrays[-1].nbytes == len(data)


def test_header_bytes_is_prefix_of_encode() -> None:
    cases: list[tuple[list[Any], list[str] | None]] = [
        ([np.zeros((2, 3), np.float32), np.int64(1)], None),
        ([np.zeros(0, np.uint8)], ["empty"]),
        ([], None),
        ([np.zeros((4, 0, 1), np.float16), np.ones(3, np.bool_)], ["a", "ü"]),
    ]
    for arrays, names in cases:
        data = wire.encode(arrays, names)
        head = wire.header_bytes([a.dtype for a in arrays], [np.shape(a) for a in arrays], names)
        assert len(head) % 8 == 0
        assert data.startswith(head)
        assert bytes(wire.encode_parts(arrays, names)[0]) == head
    assert wire.header_bytes(["f4"], [[784]]) == wire.header_bytes([np.float32], [(784,)])
    with pytest.raises(InvalidArgumentError):
        wire.header_bytes([np.float32], [(1,), (2,)])
    with pytest.raises(InvalidArgumentError):
        wire.header_bytes([np.float32], [(-1,)])
    with pytest.raises(InvalidArgumentError):
        wire.header_bytes([np.float32], [784])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        wire.header_bytes([object], [()])
    with pytest.raises(InvalidArgumentError):
        wire.header_bytes([np.float32], [(1,) * 33])


# --------------------------------------------------------------------------- batch fast path

ROW_SPECS: list[tuple[list[Any], list[tuple[int, ...]]]] = [
    ([np.float32, np.int64], [(784,), ()]),
    ([np.dtype("S5"), np.float32], [(2,), (3,)]),
    ([np.uint8, np.int16, np.float64], [(3,), (5,), (2, 2)]),
    ([np.bool_, np.float16], [(3, 1), (1,)]),
    ([np.int32], [(0, 4)]),
    ([np.uint64, np.int8], [(), ()]),
]


@pytest.mark.parametrize(("dtypes", "shapes"), ROW_SPECS)
@pytest.mark.parametrize("batch", [1, 5])
def test_encode_rows_matches_encode(
    dtypes: list[Any], shapes: list[tuple[int, ...]], batch: int
) -> None:
    arrays = [
        _sample(np.dtype(dt), (batch, *s), seed=j)
        for j, (dt, s) in enumerate(zip(dtypes, shapes, strict=True))
    ]
    rows = wire.encode_rows(arrays, dtypes, shapes)
    assert len(rows) == batch
    for i, row in enumerate(rows):
        assert isinstance(row, memoryview)
        assert bytes(row) == wire.encode([a[i] for a in arrays])
    back = wire.decode_rows([bytes(r) for r in rows], dtypes, shapes)
    assert back is not None
    for a, b in zip(arrays, back, strict=True):
        assert _same(a, b)
        assert b.flags.c_contiguous and b.flags.writeable
    back2 = wire.decode_rows(rows, dtypes, shapes)  # memoryviews are fine too
    assert back2 is not None and all(_same(a, b) for a, b in zip(arrays, back2, strict=True))


def test_encode_rows_big_endian_and_noncontiguous() -> None:
    x = np.arange(4 * 6, dtype=">f4").reshape(4, 6)
    y = np.arange(4 * 10, dtype=np.int64).reshape(4, 10)[:, ::2]
    rows = wire.encode_rows([x, y], [np.float32, np.int64], [(6,), (5,)])
    assert len(rows) == 4
    for i, row in enumerate(rows):
        assert bytes(row) == wire.encode([x[i], y[i]])


def test_encode_rows_errors_and_empty() -> None:
    spec = ([np.float32, np.int64], [(3,), ()])
    x = np.zeros((2, 3), np.float32)
    y = np.zeros(2, np.int64)
    assert wire.encode_rows([x[:0], y[:0]], *spec) == []
    with pytest.raises(InvalidArgumentError, match="arrays"):
        wire.encode_rows([x], *spec)
    with pytest.raises(InvalidArgumentError, match="shape"):
        wire.encode_rows([np.zeros((2, 4), np.float32), y], *spec)
    with pytest.raises(InvalidArgumentError, match="shape"):
        wire.encode_rows([np.zeros(3, np.float32), y], *spec)
    with pytest.raises(InvalidArgumentError, match="batch"):
        wire.encode_rows([x, np.zeros(3, np.int64)], *spec)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        wire.encode_rows([x.astype(np.float64), y], *spec)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        wire.encode_rows([x, y.astype(np.int32)], *spec)
    with pytest.raises(InvalidArgumentError):
        wire.encode_rows([], [], [])


def test_decode_rows_fallback_cases() -> None:
    dtypes, shapes = [np.uint8, np.float32], [(3,), (2,)]
    a = np.arange(12, dtype=np.uint8).reshape(4, 3)
    b = np.arange(8, dtype=np.float32).reshape(4, 2)
    blobs = [bytes(r) for r in wire.encode_rows([a, b], dtypes, shapes)]
    assert wire.decode_rows(blobs, dtypes, shapes) is not None

    empty = wire.decode_rows([], dtypes, shapes)
    assert empty is not None and [e.shape for e in empty] == [(0, 3), (0, 2)]

    # one blob too short, one too long (same total length)
    assert wire.decode_rows([blobs[0][:-1], blobs[1] + b"\0", *blobs[2:]], dtypes, shapes) is None
    assert wire.decode_rows([*blobs[:3], blobs[3] + b"\0"], dtypes, shapes) is None
    # a blob for a different spec of the same length: f4[2] -> i4[2]
    other = wire.encode([a[1], b[1].view(np.int32)])
    assert len(other) == len(blobs[1])
    assert wire.decode_rows([blobs[0], other, *blobs[2:]], dtypes, shapes) is None
    # bad padding between buffers (u1[3] is followed by 5 pad bytes)
    off = len(wire.header_bytes(dtypes, shapes)) + 3
    padded = bytearray(blobs[2])
    padded[off] = 1
    assert wire.decode_rows([*blobs[:2], bytes(padded), blobs[3]], dtypes, shapes) is None
    with pytest.raises(DataLossError, match="padding"):
        wire.decode(bytes(padded))
    # bool bytes other than 0/1
    good = wire.encode_rows([np.ones((2, 2), np.bool_)], [np.bool_], [(2,)])
    bad = bytearray(good[1])
    bad[-1] = 2
    assert wire.decode_rows([bytes(good[0]), bytes(bad)], [np.bool_], [(2,)]) is None
    with pytest.raises(DataLossError, match="bool"):
        wire.decode(bytes(bad))


# --------------------------------------------------------------------------- errors


def _valid() -> bytes:
    return wire.encode(
        {"a": np.arange(3, dtype=np.uint8), "b": np.float64(2.0), "c": np.ones((2, 2), np.int32)}
    )


def test_bad_magic_version_flags() -> None:
    data = _valid()
    for bad in (b"XW" + data[2:], b"qw" + data[2:], b"X", b"\x00" * 20):
        with pytest.raises(DataLossError, match="bad magic"):
            wire.decode(bad)
    with pytest.raises(DataLossError, match="version 2"):
        wire.decode(data[:2] + b"\x02" + data[3:])
    with pytest.raises(DataLossError, match="version 0"):
        wire.decode(data[:2] + b"\x00" + data[3:])
    for flags in (0x02, 0x80, 0xFF):
        with pytest.raises(DataLossError, match="flag"):
            wire.decode(data[:3] + bytes([flags]) + data[4:])
    # names flag cleared while names are present, and set without names
    with pytest.raises(DataLossError, match="names"):
        wire.decode(data[:3] + b"\x00" + data[4:])
    plain = wire.encode([np.arange(3, dtype=np.uint8)])
    with pytest.raises(DataLossError, match="names"):
        wire.decode(plain[:3] + b"\x01" + plain[4:])


def test_truncated_at_every_length() -> None:
    data = _valid()
    for n in range(len(data)):
        with pytest.raises(DataLossError, match=r"truncated|bad magic"):
            wire.decode(data[:n])
        with pytest.raises(DataLossError):
            wire.decode(memoryview(data)[:n])
    assert wire.decode(data).names == ["a", "b", "c"]


def test_trailing_bytes() -> None:
    data = _valid()
    for extra in (b"\0", b"\0" * 8, b"garbage!!"):
        with pytest.raises(DataLossError, match="trailing bytes"):
            wire.decode(data + extra)
    with pytest.raises(DataLossError, match="trailing bytes"):
        wire.decode(wire.encode([]) + b"\0")


def test_oversized_and_overflowing_sizes() -> None:
    huge = _craft([[["f4", [2**30, 4]]], None], b"\0" * 16)
    with pytest.raises(DataLossError, match=r"declares 1717986\d+ bytes, limit 2147483647"):
        wire.decode(huge)
    data = _valid()
    with pytest.raises(DataLossError, match="limit 64"):
        wire.decode(data, max_bytes=64)
    assert wire.decode(data, max_bytes=len(data)).names == ["a", "b", "c"]
    with pytest.raises(DataLossError, match="limit"):
        wire.decode(data, max_bytes=len(data) - 1)
    for dims in ([2**63, 2**63], [2**64 - 1] * 3, [2**62, 2**62, 16]):
        with pytest.raises(DataLossError, match=r"declares|too large"):
            wire.decode(_craft([[["u8", dims]], None], b"\0" * 8))
    # a zero dimension makes the array empty, but numpy still could not describe the rest
    with pytest.raises(DataLossError, match="too large"):
        wire.decode(_craft([[["f8", [0, 2**63 - 1]]], None]))
    (ok,) = wire.decode_arrays(_craft([[["u1", [0, 2**40]]], None]))
    assert ok.shape == (0, 2**40)
    # a header_len that points far beyond the data
    with pytest.raises(DataLossError, match="truncated"):
        wire.decode(b"QW\x01\x00" + struct.pack("<I", 1000) + b"\x90")
    with pytest.raises(DataLossError, match="declares"):
        wire.decode(b"QW\x01\x00" + struct.pack("<I", 2**32 - 1) + b"\x90")


# --------------------------------------------------------------------------- one case per rule
# Every rule decode enforces on the framing, the header and the body, each way of breaking
# it its own case. Each case starts from a valid message (_F4_MSG, _NAMED_MSG, ...; see
# test_rule_baselines_decode) and breaks one thing, and asserts the exact error class and
# the words of the rule that caught it, so that no rule hides behind another.

_MAX = wire.MAX_MESSAGE_BYTES
_F4 = ["f4", [2]]  # one component of 8 bytes
_F4_MSG = _craft([[_F4], None], b"\0" * 8)
_NAMED_MSG = _craft([[_F4], ["x"]], b"\0" * 8, flags=1)
_F4_HEND = 8 + len(msgpack.packb([[_F4], None]))  # where _F4_MSG's header ends
_F4_BUF0 = len(_F4_MSG) - 8  # where its buffer starts (after the header padding)
_U1_F4 = [["u1", [3]], ["f4", [1]]]  # u1[3], 5 bytes of padding, f4[1]
_U1_F4_MSG = _craft([_U1_F4, None], b"\1\2\3" + b"\0" * 5 + b"\0" * 4)
_BOOLS_MSG = _craft([[["b1", [4]], ["b1", [2]]], None], b"\0\1\1\0" + b"\0" * 4 + b"\1\0")


def _prefix(version: int = 1, flags: int = 0, header_len: int = 0) -> bytes:
    return b"QW" + bytes([version, flags]) + struct.pack("<I", header_len)


def _set(data: bytes, pos: int, value: int) -> bytes:
    out = bytearray(data)
    out[pos] = value
    return bytes(out)


def _head_len(header: Any) -> int:
    """The length of a crafted message with this header and no body."""
    return len(_craft(header))


def _rule(
    case_id: str,
    data: Any,
    needle: str,
    *,
    max_bytes: int = _MAX,
    error: type[Exception] = DataLossError,
    marks: Any = (),
) -> Any:
    return pytest.param(data, max_bytes, error, needle, id=case_id, marks=marks)


def _hdr(case_id: str, header: Any, needle: str, flags: int = 0) -> Any:
    """A header-rule case: ``header`` with the 8-byte body of ``_F4_MSG``."""
    return _rule(case_id, _craft(header, b"\0" * 8, flags), needle)


def _raw_hdr(case_id: str, raw: bytes) -> Any:
    return _rule(case_id, _craft(None, raw=raw), "bad qps message header: not valid msgpack")


def _code(case_id: str, code: str, marks: Any = ()) -> Any:
    data = _craft([[[code, [2]]], None], b"\0" * 8)
    return _rule(case_id, data, f"unknown dtype code {code!r}", marks=marks)


def _dim(case_id: str, dims: list[Any], bad: Any, j: int = 0) -> Any:
    comps = [_F4, ["u1", dims]] if j else [["u1", dims]]
    return _hdr(case_id, [comps, None], f"component {j}: dimension {bad!r} is not an int >= 0")


def _huge(case_id: str, code: str, dims: list[int]) -> Any:
    return _hdr(case_id, [[[code, dims]], None], f"component 0: shape {dims} is too large")


_TOO_BIG = [["f4", [2**30, 4]]]  # 16 GiB
_TWO_60 = [["u1", [60]], ["u1", [60]]]  # each fits in 100 bytes, both do not

DECODE_RULES = [
    # the input must be a C-contiguous bytes-like object (a programming error)
    _rule("input-str", "QW", "got str", error=InvalidArgumentError),
    _rule("input-int", 5, "got int", error=InvalidArgumentError),
    _rule("input-list", list(_F4_MSG), "got list", error=InvalidArgumentError),
    _rule(
        "input-noncontiguous-memoryview",
        memoryview(np.zeros((4, 4), np.uint8)[:, ::2]),
        "buffer is not C-contiguous bytes",
        error=InvalidArgumentError,
    ),
    # under 8 bytes: a bad magic if what there is is not a prefix of b"QW", else truncated
    _rule("short-empty", b"", "truncated: 0 bytes, a qps message has at least 8"),
    _rule("short-magic-q", b"Q", "truncated: 1 bytes, a qps message has at least 8"),
    _rule("short-bad-first-byte", b"X", "not a qps message (bad magic b'X')"),
    _rule("short-bad-second-byte", b"QX\x01", "not a qps message (bad magic b'QX')"),
    _rule("short-good-magic", _F4_MSG[:7], "truncated: 7 bytes, a qps message has at least 8"),
    # magic
    _rule("bad-magic", b"XW" + _F4_MSG[2:], "bad magic b'XW', expected b'QW'"),
    _rule("bad-magic-lowercase", b"qw" + _F4_MSG[2:], "bad magic b'qw', expected b'QW'"),
    # version
    _rule("version-0", _set(_F4_MSG, 2, 0), "unsupported qps wire format version 0"),
    _rule("version-2", _set(_F4_MSG, 2, 2), "unsupported qps wire format version 2"),
    _rule("version-255", _set(_F4_MSG, 2, 255), "unsupported qps wire format version 255"),
    # flags: only bit 0 (names) is defined
    _rule("flag-bit-1", _set(_F4_MSG, 3, 0x02), "unknown flag bits 0x02 (flags 0x02)"),
    _rule("flag-bit-7", _set(_F4_MSG, 3, 0x80), "unknown flag bits 0x80 (flags 0x80)"),
    _rule("flag-bit-1-beside-names", _set(_NAMED_MSG, 3, 0x03), "unknown flag bits 0x02"),
    # header_len: within max_bytes, then within the data
    _rule(
        "header-len-past-default-limit",
        _prefix(header_len=2**32 - 1) + b"\x90",
        f"message declares at least {2**32 + 7} bytes, limit {_MAX}",
    ),
    _rule(
        "header-len-past-max-bytes",
        _F4_MSG,
        f"message declares at least {_F4_HEND} bytes, limit {_F4_HEND - 1}",
        max_bytes=_F4_HEND - 1,
    ),
    _rule(
        "header-len-past-the-data",
        _prefix(header_len=1000) + b"\x90",
        "truncated: header declares 1000 bytes but 1 follow the prefix",
    ),
    # the header must be one well-formed msgpack object, nothing after it
    _raw_hdr("msgpack-empty", b""),
    _raw_hdr("msgpack-reserved-byte", b"\xc1"),
    _raw_hdr("msgpack-incomplete", b"\x92\x90"),
    _raw_hdr("msgpack-extra-data", b"\x92\x90\xc0\xc0"),
    _raw_hdr("msgpack-invalid-utf8", b"\x92\x91\x92\xa2\xff\xfe\x90\xc0"),
    _raw_hdr("msgpack-too-deep", b"\x91" * 5000 + b"\xc0"),
    _raw_hdr("msgpack-array-longer-than-header", b"\xdd\xff\xff\xff\xff"),
    _raw_hdr("msgpack-str-longer-than-header", b"\xdb\xff\xff\xff\xff"),
    _raw_hdr("msgpack-int-map-key", msgpack.packb({1: 2})),
    _rule(
        "header-len-one-short",
        _F4_MSG[:4] + struct.pack("<I", _F4_HEND - 9) + _F4_MSG[8:],
        "bad qps message header: not valid msgpack",
    ),
    _rule(
        "header-len-one-long",  # the header takes a padding byte: extra data
        _F4_MSG[:4] + struct.pack("<I", _F4_HEND - 7) + _F4_MSG[8:],
        "bad qps message header: not valid msgpack",
    ),
    # the header is the array [components, names]
    _hdr("top-map", {"c": [], "n": None}, "expected a 2-element array [components, names]"),
    _hdr("top-int", 7, "expected a 2-element array [components, names]"),
    _hdr("top-nil", None, "expected a 2-element array [components, names]"),
    _hdr("top-ext", msgpack.ExtType(1, b"x"), "expected a 2-element array [components, names]"),
    _hdr("top-empty-array", [], "expected a 2-element array [components, names]"),
    _hdr("top-1-element", [[_F4]], "expected a 2-element array [components, names]"),
    _hdr("top-3-element", [[_F4], None, None], "expected a 2-element array [components, names]"),
    # components is an array
    _hdr("components-map", [{"f4": [2]}, None], "components must be an array, got dict"),
    _hdr("components-nil", [None, None], "components must be an array, got NoneType"),
    _hdr("components-str", ["f4", None], "components must be an array, got str"),
    # each component is the array [dtype, shape]
    _hdr("component-str", [["f4"], None], "component 0 must be a 2-element array [dtype, shape]"),
    _hdr("component-map", [[{"f4": [2]}], None], "component 0 must be a 2-element array"),
    _hdr("component-1-element", [[["f4"]], None], "component 0 must be a 2-element array"),
    _hdr("component-3-element", [[["f4", [2], 0]], None], "component 0 must be a 2-element array"),
    _hdr("second-component-int", [[_F4, 3], None], "component 1 must be a 2-element array"),
    # the dtype code is a string...
    _hdr("dtype-int", [[[4, [2]]], None], "component 0: dtype code must be a string, got int"),
    _hdr(
        "dtype-bin", [[[b"f4", [2]]], None], "component 0: dtype code must be a string, got bytes"
    ),
    _hdr("dtype-nil", [[[None, [2]]], None], "dtype code must be a string, got NoneType"),
    _hdr("dtype-array", [[[["f4"], [2]]], None], "dtype code must be a string, got list"),
    _hdr("second-dtype-int", [[_F4, [4, [2]]], None], "component 1: dtype code must be a string"),
    # ...and a known code
    _code("dtype-unknown", "c8"),
    _code("dtype-empty", ""),
    _code("dtype-byte-order-prefix", "<f4"),
    _code("dtype-numpy-name", "float32"),
    _code("dtype-uppercase", "F4"),
    _code("dtype-unicode", "U1"),
    _code("dtype-object", "O"),
    _code("dtype-bytes-without-width", "S"),
    _code("dtype-bytes-zero-width", "S0"),
    _code("dtype-bytes-leading-zero", "S01"),
    _code("dtype-bytes-plus-sign", "S+1"),
    _code("dtype-bytes-negative-width", "S-1"),
    _code("dtype-bytes-past-max-width", f"S{wire.MAX_STRING_ITEMSIZE + 1}"),
    _code("dtype-bytes-non-ascii-digit", "S\u0661"),
    _code("dtype-bytes-trailing-space", "S1 "),
    _code("dtype-bytes-lowercase", "s1"),
    _rule(
        "dtype-bf16-without-ml_dtypes",
        _craft([[["bf16", [2]]], None], b"\0" * 4),
        "dtype code 'bf16' needs the optional package ml_dtypes",
        marks=pytest.mark.skipif(ml_dtypes is not None, reason="ml_dtypes is installed"),
    ),
    # the shape is an array...
    _hdr("shape-str", [[["f4", "2"]], None], "component 0: shape must be an array, got str"),
    _hdr("shape-int", [[["f4", 2]], None], "component 0: shape must be an array, got int"),
    _hdr("shape-nil", [[["f4", None]], None], "component 0: shape must be an array, got NoneType"),
    _hdr("shape-map", [[["f4", {"0": 2}]], None], "component 0: shape must be an array, got dict"),
    _hdr("shape-bin", [[["f4", b"\x02"]], None], "component 0: shape must be an array, got bytes"),
    # ...of at most MAX_NDIM dimensions...
    _hdr("ndim-33", [[["u1", [1] * 33]], None], "component 0 has 33 dimensions, most is 32"),
    _hdr("ndim-33-empty", [[["u1", [0] * 33]], None], "component 0 has 33 dimensions, most is 32"),
    # ...each an int >= 0 (msgpack's bool is no int)...
    _dim("dim-negative", [-1], -1),
    _dim("dim-most-negative", [-(2**63)], -(2**63)),
    _dim("dim-negative-after-a-good-one", [2, -1], -1),
    _dim("dim-negative-in-second-component", [-3], -3, j=1),
    _dim("dim-float", [2.0], 2.0),
    _dim("dim-bool-true", [True], True),
    _dim("dim-bool-false", [False], False),
    _dim("dim-nil", [None], None),
    _dim("dim-str", ["2"], "2"),
    _dim("dim-array", [[2]], [2]),
    # ...whose bytes (zero dimensions aside) numpy can describe
    _huge("dim-past-intp", "u1", [2**63]),
    _huge("dim-u64-max", "u1", [2**64 - 1]),
    _huge("shape-product-past-intp", "u1", [2**32, 2**32]),
    _huge("itemsize-times-count-past-intp", "f8", [2**60]),
    _huge("bytes-width-times-count-past-intp", "S2147483647", [2**33]),
    _huge("zero-dim-beside-a-huge-rest", "f8", [0, 2**63 - 1]),
    # names: an array of one str per component exactly when flag bit 0 is set
    _hdr(
        "names-flag-but-nil", [[_F4], None], "flags say names are present but names is NoneType", 1
    ),
    _hdr("names-flag-but-str", [[_F4], "x"], "flags say names are present but names is str", 1),
    _hdr(
        "names-flag-but-map", [[_F4], {"x": 0}], "flags say names are present but names is dict", 1
    ),
    _hdr("names-too-many", [[_F4], ["x", "y"]], "2 names for 1 components", 1),
    _hdr("names-too-few", [[_F4], []], "0 names for 1 components", 1),
    _hdr("name-int", [[_F4], [1]], "names must be strings, got int", 1),
    _hdr("name-bin", [[_F4], [b"x"]], "names must be strings, got bytes", 1),
    _hdr("name-nil", [[_F4], [None]], "names must be strings, got NoneType", 1),
    _hdr("names-without-flag", [[_F4], ["x"]], "names present but the names flag is not set"),
    _hdr("empty-names-without-flag", [[_F4], []], "names present but the names flag is not set"),
    _hdr("names-str-without-flag", [[_F4], "x"], "names present but the names flag is not set"),
    # the size the header implies: within max_bytes...
    _rule(
        "size-past-default-limit",
        _craft([_TOO_BIG, None], b"\0" * 16),
        f"message declares {_head_len([_TOO_BIG, None]) + 2**34} bytes, limit {_MAX}",
    ),
    _rule(
        "size-past-max-bytes",
        _F4_MSG,
        f"message declares {len(_F4_MSG)} bytes, limit {len(_F4_MSG) - 1}",
        max_bytes=len(_F4_MSG) - 1,
    ),
    _rule(
        "components-together-past-max-bytes",
        _craft([_TWO_60, None], b"\0" * 124),
        f"message declares {_head_len([_TWO_60, None]) + 124} bytes, limit 100",
        max_bytes=100,
    ),
    # ...and exactly the length of the data: no fewer bytes...
    _rule(
        "truncated-last-byte",
        _F4_MSG[:-1],
        f"truncated: header implies {len(_F4_MSG)} bytes, got {len(_F4_MSG) - 1}",
    ),
    _rule(
        "truncated-whole-buffer",
        _F4_MSG[:_F4_BUF0],
        f"truncated: header implies {len(_F4_MSG)} bytes, got {_F4_BUF0}",
    ),
    _rule(
        "truncated-in-header-padding",
        _F4_MSG[: _F4_HEND + 1],
        f"truncated: header implies {len(_F4_MSG)} bytes, got {_F4_HEND + 1}",
    ),
    _rule(
        "truncated-bytes-width-too-wide",  # S6[2] is 12 bytes: 10 given
        _craft([[["S6", [2]]], None], b"abcdefghij"),
        "truncated: header implies",
    ),
    # ...and no more
    _rule("trailing-one-byte", _F4_MSG + b"\0", f"trailing bytes: 1 after the {len(_F4_MSG)}-byte"),
    _rule(
        "trailing-padding-after-last-buffer",
        _craft([[["u1", [3]]], None], b"abc" + b"\0" * 5),
        "trailing bytes: 5 after the",
    ),
    _rule(
        "trailing-after-no-components",
        wire.encode([]) + b"\0",
        f"trailing bytes: 1 after the {len(wire.encode([]))}-byte message",
    ),
    _rule(
        "trailing-bytes-width-too-narrow",  # S4[2] is 8 bytes: 10 given
        _craft([[["S4", [2]]], None], b"abcdefghij"),
        "trailing bytes: 2 after the",
    ),
    # padding is zeros
    _rule(
        "nonzero-header-padding",
        _set(_F4_MSG, _F4_BUF0 - 1, 1),
        f"nonzero padding in bytes [{_F4_HEND}, {_F4_BUF0})",
    ),
    _rule(
        "nonzero-padding-between-buffers",
        _set(_U1_F4_MSG, len(_U1_F4_MSG) - 5, 0x80),
        f"nonzero padding in bytes [{len(_U1_F4_MSG) - 9}, {len(_U1_F4_MSG) - 4})",
    ),
    # bool bytes are 0 or 1
    _rule(
        "bool-byte-2",
        _set(_BOOLS_MSG, len(_BOOLS_MSG) - 10, 2),
        "component 0: bool bytes other than 0 and 1",
    ),
    _rule(
        "bool-byte-255",
        _set(_BOOLS_MSG, len(_BOOLS_MSG) - 7, 255),
        "component 0: bool bytes other than 0 and 1",
    ),
    _rule(
        "bool-in-second-component",
        _set(_BOOLS_MSG, len(_BOOLS_MSG) - 1, 3),
        "component 1: bool bytes other than 0 and 1",
    ),
]


@pytest.mark.parametrize(("data", "max_bytes", "error", "needle"), DECODE_RULES)
def test_decode_enforces_each_rule(
    data: Any, max_bytes: int, error: type[Exception], needle: str
) -> None:
    with pytest.raises(error) as info:
        wire.decode(data, max_bytes=max_bytes)
    assert type(info.value) is error  # the class itself, not some subclass
    assert needle in str(info.value), str(info.value)


def test_rule_baselines_decode() -> None:
    """The valid messages the rule cases break, each as its case would need it."""
    (a,) = wire.decode(_F4_MSG, max_bytes=len(_F4_MSG)).arrays  # the limit is inclusive
    assert a.dtype == np.float32 and a.shape == (2,)
    msg = wire.decode(_NAMED_MSG)
    assert msg.names == ["x"] and msg.arrays[0].shape == (2,)
    assert [b.tolist() for b in wire.decode(_U1_F4_MSG).arrays] == [[1, 2, 3], [0.0]]
    bools = wire.decode(_BOOLS_MSG).arrays
    assert [b.tolist() for b in bools] == [[False, True, True, False], [True, False]]
    for header, body in (
        ([[["u1", [1] * 32]], None], b"\0"),  # MAX_NDIM dimensions
        ([[["u1", [0] * 32]], None], b""),
        ([[["u1", [0, 2**40]]], None], b""),  # empty, and numpy can describe it
        ([[["S2147483647", [0, 2]]], None], b""),
        ([[["S3", []]], None], b"abc"),
        ([[], None], b""),
    ):
        assert len(wire.decode(_craft(header, body)).arrays) == len(header[0])
    assert wire.decode(_craft([[], []], flags=1)).names == []


@pytest.mark.skipif(ml_dtypes is not None, reason="ml_dtypes is installed")
def test_bf16_needs_ml_dtypes() -> None:
    with pytest.raises(DataLossError, match="ml_dtypes"):
        wire.decode(_craft([[["bf16", [2]]], None], b"\0" * 4))
    with pytest.raises(DataLossError, match="ml_dtypes"):
        wire.dtype_from_code("bf16")


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_bf16_roundtrip() -> None:
    a = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    assert wire.dtype_code(a.dtype) == "bf16"
    _roundtrip([a])
    rows = wire.encode_rows([a], [a.dtype], [(3,)])
    assert bytes(rows[1]) == wire.encode([a[1]])


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(InvalidArgumentError):
        wire.decode("QW")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        wire.decode(memoryview(np.zeros((4, 4), np.uint8)[:, ::2]))  # non-contiguous


# --------------------------------------------------------------------------- split_chunks


def test_split_chunks() -> None:
    data = bytes(range(256)) * 3
    chunks = wire.split_chunks(data, 100)
    assert [len(c) for c in chunks] == [100] * 7 + [68]
    assert b"".join(chunks) == data
    assert all(isinstance(c, memoryview) and c.obj is data for c in chunks)
    assert wire.split_chunks(data, len(data)) == [memoryview(data)]
    assert wire.split_chunks(b"", 10) == []
    assert b"".join(wire.split_chunks(memoryview(data)[5:], 7)) == data[5:]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError):
            wire.split_chunks(data, bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- property tests

_dtypes = (
    st.sampled_from(ALL_DTYPES)
    | st.sampled_from([np.dtype(">" + c) for c in ALL_CODES[1:] if c[1] != "1"])
    | st.integers(1, 20).map(lambda n: np.dtype(f"S{n}"))
)
_arrays = _dtypes.flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
)


@settings(max_examples=150, deadline=None)
@given(
    arrays=st.lists(_arrays, min_size=0, max_size=4),
    with_names=st.booleans(),
    name_pool=st.lists(st.text(max_size=6), min_size=4, max_size=4),
    transpose=st.booleans(),
)
def test_property_roundtrip(
    arrays: list[np.ndarray], with_names: bool, name_pool: list[str], transpose: bool
) -> None:
    if transpose:
        arrays = [a.T for a in arrays]
    names = name_pool[: len(arrays)] if with_names else None  # any text, "" and repeats too
    msg = _roundtrip(arrays, names)
    assert msg.names == names
    data = wire.encode(arrays, names)
    # a bytearray decodes to the same arrays, writable this time
    again = wire.decode(bytearray(data))
    assert all(_same(a, b) for a, b in zip(arrays, again.arrays, strict=True))
    assert all(b.flags.writeable for b in again.arrays)
    assert data.startswith(
        wire.header_bytes([a.dtype for a in arrays], [a.shape for a in arrays], names)
    )


_SEEDS = [
    wire.encode([np.arange(5, dtype=np.float32), np.int64(3)]),
    wire.encode({"x": np.ones((2, 3), np.bool_), "y": np.zeros(0, np.uint16)}),
    wire.encode([np.arange(3, dtype=np.uint8), np.arange(2, dtype=np.float16), np.float64(1)]),
    wire.encode([]),
    wire.encode([np.array([b"ab", b"", b"xyz"]), np.array([[b"q"]], "S10"), np.int8(1)]),
]


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    u32 = st.integers(0, 2**32 - 1)
    data = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        kinds = ["flip", "set", "insert", "delete", "truncate", "append", "header_len"]
        kind = draw(st.sampled_from(kinds))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=9))
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 9))]
        elif kind == "append":  # an extension past the end, zeros (padding-like) or not
            data += draw(st.binary(min_size=1, max_size=9) | st.integers(1, 9).map(bytes))
        elif kind == "header_len" and len(data) >= 8:  # a little off, or anything
            (hl,) = struct.unpack_from("<I", data, 4)
            hl = (
                min(max(0, hl + draw(st.integers(-8, 8))), 2**32 - 1)
                if draw(st.booleans())
                else draw(u32)
            )
            data[4:8] = struct.pack("<I", hl)
        else:
            del data[pos:]
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_mutated() | st.binary(max_size=64) | st.binary(max_size=40).map(b"QW\x01\x00".__add__))
def test_fuzz_decode_only_raises_data_loss(data: bytes) -> None:
    try:
        msg = wire.decode(data)
    except DataLossError:
        return
    # whatever decodes lies inside the data and survives a re-encode unchanged
    whole = np.frombuffer(data, np.uint8)
    for a in msg.arrays:
        assert a.size == 0 or np.shares_memory(a, whole)
    again = wire.decode(wire.encode(msg.arrays, msg.names))
    assert again.names == msg.names
    assert all(_same(a, b) for a, b in zip(msg.arrays, again.arrays, strict=True))
    # and is well formed: this version's prefix, flags that match the names, bools 0/1,
    # and after the header zero padding, then exactly the buffers (and padding) encode
    # writes (the msgpack itself may be spelled another way than encode spells it)
    assert data[:3] == b"QW\x01" and data[3] == (msg.names is not None)
    (hl,) = struct.unpack_from("<I", data, 4)
    body = b"".join(wire.encode_parts(msg.arrays, msg.names)[1:])
    start = len(data) - len(body)
    assert start == (8 + hl + 7) // 8 * 8
    assert data[8 + hl : start] == bytes(start - 8 - hl) and data[start:] == body
    assert all(a.view(np.uint8).max(initial=0) <= 1 for a in msg.arrays if a.dtype == np.bool_)


@settings(max_examples=100, deadline=None)
@given(blob=_mutated())
def test_fuzz_decode_rows_returns_none_or_valid(blob: bytes) -> None:
    dtypes, shapes = [np.float32, np.int64], [(5,), ()]
    good = wire.encode_rows([np.zeros((1, 5), np.float32), np.zeros(1, np.int64)], dtypes, shapes)
    out = wire.decode_rows([bytes(good[0]), blob], dtypes, shapes)
    if out is not None:
        ref = wire.decode(blob).arrays
        np.testing.assert_array_equal(out[0][1], ref[0])
        np.testing.assert_array_equal(out[1][1], ref[1])


# --------------------------------------------------------------------------- allocation bound
# decode makes zero-copy views: whatever the bytes say, it allocates only the header copy
# and what parsing that header takes, never the size the header declares.


def _peak_while(fn: Any) -> tuple[Any, int]:
    """``fn()``'s result (or its DataLossError) and the peak bytes traced while it ran."""
    wire.decode(_SEEDS[0])  # first-call costs (imports, caches) are not the input's
    tracemalloc.start()
    try:
        try:
            out: Any = fn()
        except DataLossError as exc:
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


#: what decoding a header of a few hundred bytes may allocate (parsed objects, the cache)
_HEADER_ALLOC = 256 << 10


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_mutated(), limit=st.integers(0, 400))
def test_fuzz_mutated_messages_respect_the_limit_and_allocate_little(
    data: bytes, limit: int
) -> None:
    out, peak = _peak_while(lambda: wire.decode(data, max_bytes=limit))
    assert peak < _HEADER_ALLOC + 64 * len(data), (peak, len(data))
    if isinstance(out, DataLossError):
        return
    assert len(data) <= limit  # a message that decodes declared exactly its length
    whole = np.frombuffer(data, np.uint8)
    assert all(a.size == 0 or np.shares_memory(a, whole) for a in out.arrays)
    assert sum(a.nbytes for a in out.arrays) <= len(data)


_huge_dims = st.lists(
    st.one_of(st.integers(0, 8), st.integers(2**20, 2**64 - 1)), min_size=0, max_size=6
)
_codes = st.sampled_from([*ALL_CODES, "S1", "S7", "S2147483647", "S9999999999", "S0"])


@settings(max_examples=200, deadline=None)
@given(
    comps=st.lists(st.tuples(_codes, _huge_dims), min_size=1, max_size=3),
    body=st.integers(0, 64),
    limit=st.sampled_from([64, 2**20, wire.MAX_MESSAGE_BYTES]),
)
def test_fuzz_huge_declared_shapes_are_refused_before_allocation(
    comps: list[tuple[str, list[int]]], body: int, limit: int
) -> None:
    data = _craft([[[c, d] for c, d in comps], None], b"\0" * body)
    out, peak = _peak_while(lambda: wire.decode(data, max_bytes=limit))
    assert peak < _HEADER_ALLOC, peak
    if not isinstance(out, DataLossError):
        # only a message whose arrays fit in the bytes given decodes (empty ones may
        # declare any shape)
        assert len(data) <= limit
        assert sum(a.nbytes for a in out.arrays) <= body


# Structural fuzz: the header of a valid message, unpacked, with one node of its tree
# replaced, removed or added (any msgpack value, or one of the kind a header holds there),
# and the flags left or changed. That reaches every rule of the header, not only the ones
# a byte flip of a valid header happens to hit, and sometimes gives another valid message.
_anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=4)
    | st.binary(max_size=4),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=2), kids, max_size=2)
    ),
    max_leaves=6,
)
_header_parts = (
    st.integers(0, 4)
    | st.integers(-3, -1)
    | st.integers(2**20, 2**64 - 1)
    | _codes
    | st.sampled_from(["bf16", "S", "S01", "c8", "", "<f4"])
    | st.text(max_size=3)
    | st.lists(st.integers(0, 3), max_size=3)
    | st.lists(st.just(1), min_size=31, max_size=34)
)
_small_arrays = (
    st.sampled_from(ALL_DTYPES) | st.integers(1, 5).map(lambda n: np.dtype(f"S{n}"))
).flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=3)))


def _list_slots(node: Any, depth: int = 0) -> list[tuple[int, list[Any], int]]:
    """(depth, list, index) of every list element of a header tree."""
    out: list[tuple[int, list[Any], int]] = []
    if type(node) is list:
        for k, child in enumerate(node):
            out.append((depth, node, k))
            out += _list_slots(child, depth + 1)
    return out


@st.composite
def _twisted_message(draw: st.DrawFn) -> tuple[bytes, int]:
    arrays = draw(st.lists(_small_arrays, min_size=1, max_size=3))
    n = len(arrays)
    names = draw(st.none() | st.lists(st.text(max_size=3), min_size=n, max_size=n))
    data = wire.encode(arrays, names)
    (hl,) = struct.unpack_from("<I", data, 4)
    header = msgpack.unpackb(data[8 : 8 + hl])
    body = data[(8 + hl + 7) // 8 * 8 :]  # the buffers, after the header padding
    # deepest first: hypothesis leans to the first choices, and the rules nest
    slots = [(parent, k) for _, parent, k in sorted(_list_slots(header), key=lambda t: -t[0])]
    how = draw(st.sampled_from(["replace", "delete", "insert", "none"]))
    value = draw(_header_parts | _anything)
    if how != "none":
        parent, k = draw(st.sampled_from(slots))
        if how == "replace":
            parent[k] = value
        elif how == "delete":
            del parent[k]
        else:
            parent.insert(k, value)
    flags = data[3] if draw(st.booleans()) else draw(st.sampled_from([0, 1]) | st.integers(0, 255))
    return _craft(header, body, flags), flags


def _outcome(data: Any) -> Any:
    """What decoding ``data`` gives, in a form that compares across buffer types."""
    try:
        msg = wire.decode(data)
    except DataLossError as exc:
        return ("error", str(exc))
    layout = [(a.dtype.str, a.shape, a.tobytes()) for a in msg.arrays]
    return ("ok", layout, msg.names)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=_twisted_message())
def test_fuzz_structured_headers(message: tuple[bytes, int]) -> None:
    """Any header object: decode refuses it with DataLossError (any other exception fails
    the test), or accepts it and then the message is exactly what encode writes for the
    arrays it gives. Nothing the header declares is allocated, and bytes, bytearray and a
    memoryview into a larger buffer all give the same outcome."""
    data, flags = message
    out, peak = _peak_while(lambda: wire.decode(data))
    assert peak < _HEADER_ALLOC + 64 * len(data), peak
    padded = bytearray(b"x" * 3) + data + bytearray(b"y" * 5)
    expected = _outcome(data)
    assert _outcome(bytearray(data)) == expected
    assert _outcome(memoryview(padded)[3 : 3 + len(data)]) == expected
    if isinstance(out, DataLossError):
        assert str(out) == expected[1]
        return
    # accepted: the names follow flag bit 0, and the bytes are encode's, no more, no less
    assert flags in (0, 1)
    assert (out.names is not None) == (flags == 1)
    assert out.names is None or len(out.names) == len(out.arrays)
    assert wire.encode(out.arrays, out.names) == data

"""The qps wire format: a pure codec between lists of tensors and bytes.

No Redis and no I/O here; see ``docs/wire.md`` for the layout. One message is::

    b"QW" | u8 version (=1) | u8 flags | u32 header_len | msgpack header
    | zero padding to a multiple of 8 | buffer 0 | zero padding | buffer 1 | ...

All integers are little-endian. The header is the msgpack array
``[[[dtype_code, [dim, ...]], ...], names_or_nil]``; buffer sizes and offsets follow
from dtype and shape and are never stored. Every buffer starts at a multiple of 8 from
the start of the message and there is no padding after the last one.

Decoding never trusts the bytes: anything malformed raises
:class:`~qps.errors.DataLossError` and nothing else. Arrays passed to the encoder that the
format cannot carry raise :class:`~qps.errors.InvalidArgumentError`. The format never
uses pickle, so decoding untrusted bytes cannot run code.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from qps.errors import DataLossError, InvalidArgumentError

try:  # optional: bfloat16 support
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MAX_NDIM",
    "MAX_STRING_ITEMSIZE",
    "EncodedRows",
    "Message",
    "decode",
    "decode_arrays",
    "decode_rows",
    "dtype_code",
    "dtype_from_code",
    "encode",
    "encode_parts",
    "encode_rows",
    "encode_rows_lazily",
    "header_bytes",
    "split_chunks",
]

FORMAT_VERSION = 1
"""The format version this module writes and the only one it reads."""

MAX_MESSAGE_BYTES = 2**31 - 1
"""Default limit on the size a message may declare (2 GiB - 1)."""

MAX_NDIM = 32
"""Most dimensions one component may have."""

MAGIC = b"QW"
_FLAG_NAMES = 0x01
_PREFIX = struct.Struct("<2sBBI")  # magic, version, flags, header_len
_PREFIX_LEN = _PREFIX.size  # 8
_ALIGN = 8
_U32_MAX = 2**32 - 1
_INTP_MAX = int(np.iinfo(np.intp).max)
_ZEROS = bytes(_ALIGN)
_PADS = tuple(bytes(i) for i in range(_ALIGN))
# Headers up to this size are parsed once and remembered; larger ones are parsed each time
# so that the cache cannot pin large amounts of memory.
_CACHED_HEADER_MAX = 4096

_DTYPE_BY_CODE: dict[str, np.dtype[Any]] = {
    "b1": np.dtype(np.bool_),
    "i1": np.dtype("<i1"),
    "i2": np.dtype("<i2"),
    "i4": np.dtype("<i4"),
    "i8": np.dtype("<i8"),
    "u1": np.dtype("<u1"),
    "u2": np.dtype("<u2"),
    "u4": np.dtype("<u4"),
    "u8": np.dtype("<u8"),
    "f2": np.dtype("<f2"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
}
_BF16: np.dtype[Any] | None = None
if _ml_dtypes is not None:
    _BF16 = np.dtype(_ml_dtypes.bfloat16)
    # ml_dtypes types are native-endian only; the wire stores little-endian.
    if sys.byteorder == "little":
        _DTYPE_BY_CODE["bf16"] = _BF16
_CODE_BY_DTYPE: dict[np.dtype[Any], str] = {dt: code for code, dt in _DTYPE_BY_CODE.items()}
_SUPPORTED = (
    "bool, int8-64, uint8-64, float16/32/64, bfloat16 (with ml_dtypes) and fixed-width "
    "bytes S1..S2147483647"
)
MAX_STRING_ITEMSIZE = 2**31 - 1
"""Widest fixed-width bytes dtype (``S<n>``) the format carries: numpy's own limit."""
_STRING_CODE_MAX_LEN = 1 + len(str(MAX_STRING_ITEMSIZE))

Shape = tuple[int, ...]


class Message(NamedTuple):
    """A decoded message: its arrays, in order, and their names if it carried any."""

    arrays: list[npt.NDArray[Any]]
    names: list[str] | None


# --------------------------------------------------------------------------- dtypes


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def dtype_code(dt: npt.DTypeLike) -> str:
    """Return the wire code (``"f4"``, ``"b1"``, ``"bf16"``, ``"S5"``, ...) of dtype ``dt``.

    Either byte order is accepted: the wire always stores little-endian. A fixed-width
    bytes dtype ``S<n>`` has the code ``"S<n>"`` (its itemsize is part of the code).

    Raises:
        InvalidArgumentError: ``dt`` is not a dtype, or not one the format carries
            (object, unicode ``U``, bytes without a width (``S0``), void/structured,
            complex, datetime, longdouble...).
    """
    try:
        d = np.dtype(dt)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{dt!r} is not a numpy dtype: {e}") from e
    code = _CODE_BY_DTYPE.get(d)
    if code is not None:
        return code
    return _code_slow(d)


def _code_slow(d: np.dtype[Any]) -> str:
    """The code of a dtype that is not in the table as is (e.g. big-endian, bytes)."""
    if d.kind in "biuf" and d.fields is None and d.subdtype is None:
        code = _CODE_BY_DTYPE.get(d.newbyteorder("<"))
        if code is not None:
            return code
    if d.kind == "S" and d.itemsize > 0:
        return f"S{d.itemsize}"
    raise InvalidArgumentError(
        f"dtype {d} ({d.str}) cannot be sent on the qps wire; supported: {_SUPPORTED}"
    )


def dtype_from_code(code: str) -> np.dtype[Any]:
    """Return the little-endian numpy dtype of a wire dtype code.

    Raises:
        DataLossError: ``code`` is not a known code (for bytes: not ``"S<n>"`` with ``n``
            written in decimal without leading zeros, ``1 <= n <=``
            :data:`MAX_STRING_ITEMSIZE`), or is ``"bf16"`` and ``ml_dtypes`` is not
            installed.
    """
    dt = _DTYPE_BY_CODE.get(code) if type(code) is str else None
    if dt is not None:
        return dt
    if type(code) is str and code.startswith("S"):
        return _string_dtype(code)
    if code == "bf16":
        raise DataLossError("dtype code 'bf16' needs the optional package ml_dtypes")
    raise DataLossError(f"unknown dtype code {code!r}")


@functools.lru_cache(maxsize=256)
def _string_dtype(code: str) -> np.dtype[Any]:
    """The ``S<n>`` dtype of a bytes code; only the canonical spelling is accepted."""
    digits = code[1:]
    if (
        len(code) <= _STRING_CODE_MAX_LEN
        and digits.isascii()
        and digits.isdigit()
        and digits[0] != "0"
        and int(digits) <= MAX_STRING_ITEMSIZE
    ):
        return np.dtype(code)
    raise DataLossError(f"unknown dtype code {code!r} (bytes codes are S1..S{MAX_STRING_ITEMSIZE})")


# --------------------------------------------------------------------------- encoding


def _to_numpy(x: Any, j: int) -> npt.NDArray[Any]:
    """Component ``j`` as a host numpy array (CuPy arrays are copied to the host)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__") and hasattr(x, "get"):
        x = x.get()
        if isinstance(x, np.ndarray):
            return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgumentError(f"component {j} is not convertible to an array: {e}") from e


def _split_input(
    arrays: Sequence[Any] | Mapping[str, Any], names: Sequence[str] | None
) -> tuple[Sequence[Any], tuple[str, ...] | None]:
    """Validate ``arrays``/``names`` and return (components, names tuple or None)."""
    if type(arrays) is list or type(arrays) is tuple:
        items: Sequence[Any] = arrays
    elif isinstance(arrays, Mapping):
        if names is not None:
            raise InvalidArgumentError(
                "names= cannot be given with a mapping: its keys are the names"
            )
        keys = tuple(arrays.keys())
        for k in keys:
            if type(k) is not str:
                raise InvalidArgumentError(f"component names must be str, got {k!r}")
        return list(arrays.values()), keys
    elif isinstance(arrays, Sequence) and not isinstance(arrays, (str, bytes, bytearray)):
        items = arrays
    else:
        raise InvalidArgumentError(
            "arrays must be a sequence or a mapping of arrays, got "
            f"{type(arrays).__name__} (wrap a single array in a list)"
        )
    return items, _check_names(names, len(items))


def _check_names(names: Sequence[str] | None, count: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise InvalidArgumentError(f"names must be a sequence of str, got {type(names).__name__}")
    names_t = tuple(names)
    for k in names_t:
        if type(k) is not str:
            raise InvalidArgumentError(f"component names must be str, got {k!r}")
    if len(names_t) != count:
        raise InvalidArgumentError(f"{len(names_t)} names given for {count} components")
    return names_t


@functools.lru_cache(maxsize=1024)
def _header(
    codes: tuple[str, ...], shapes: tuple[Shape, ...], names: tuple[str, ...] | None
) -> bytes:
    """The padded header prefix for already validated codes/shapes/names."""
    comps = [[c, list(s)] for c, s in zip(codes, shapes, strict=True)]
    body: bytes = msgpack.packb([comps, None if names is None else list(names)], use_bin_type=True)
    if len(body) > _U32_MAX:
        raise InvalidArgumentError(f"header of {len(body)} bytes does not fit the u32 length")
    flags = 0 if names is None else _FLAG_NAMES
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(body))
    end = _PREFIX_LEN + len(body)
    return prefix + body + _PADS[_align(end) - end]


def _raw(a: npt.NDArray[Any]) -> bytes | memoryview:
    """The C-order bytes of little-endian array ``a``: a view when possible, else a copy."""
    if not a.flags.c_contiguous:
        return a.tobytes()
    if a.size == 0:
        return b""
    try:
        return a.data.cast("B")
    except (TypeError, ValueError, BufferError):  # e.g. extension dtypes without a buffer format
        return a.reshape(-1).view(np.uint8).data


def encode_parts(
    arrays: Sequence[Any] | Mapping[str, Any], names: Sequence[str] | None = None
) -> list[bytes | memoryview]:
    """Encode arrays into the parts of one message, ready for ``b"".join`` or a writev.

    Part 0 is the header (magic through the padding before buffer 0). Then, for each
    component, its raw buffer (a zero-copy ``memoryview`` of the array when it is already
    C-contiguous little-endian, else a contiguous copy), followed, except after the last,
    by a part of zero bytes when the buffer length is not a multiple of 8.

    Args:
        arrays: a sequence of array-likes (numpy arrays, numpy or Python scalars, nested
            lists, CuPy arrays: anything with ``__cuda_array_interface__`` and ``.get()``),
            or a mapping ``name -> array``, whose keys become the names.
        names: optional names, one str per array (not with a mapping).

    Raises:
        InvalidArgumentError: a dtype the format cannot carry (named in the message), more
            than :data:`MAX_NDIM` dimensions, names that are not str or do not match the
            arrays in number, or an ``arrays`` that is not a sequence or mapping.
    """
    items, names_t = _split_input(arrays, names)
    arrs: list[npt.NDArray[Any]] = []
    codes: list[str] = []
    shapes: list[Shape] = []
    for j, x in enumerate(items):
        a = x if type(x) is np.ndarray else _to_numpy(x, j)
        code = _CODE_BY_DTYPE.get(a.dtype)
        if code is None:
            try:
                code = _code_slow(a.dtype)
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"component {j}: {e}") from None
            if a.dtype.kind != "S":  # bytes have no byte order: sent as they are
                a = a.astype(_DTYPE_BY_CODE[code], order="C")
        if a.ndim > MAX_NDIM:
            raise InvalidArgumentError(f"component {j} has {a.ndim} dimensions, most is {MAX_NDIM}")
        arrs.append(a)
        codes.append(code)
        shapes.append(a.shape)
    parts: list[bytes | memoryview] = [_header(tuple(codes), tuple(shapes), names_t)]
    last = len(arrs) - 1
    for j, a in enumerate(arrs):
        parts.append(_raw(a))
        if j != last:
            pad = -a.nbytes % _ALIGN
            if pad:
                parts.append(_PADS[pad])
    return parts


def encode(arrays: Sequence[Any] | Mapping[str, Any], names: Sequence[str] | None = None) -> bytes:
    """Encode arrays into one message; ``b"".join(encode_parts(arrays, names))``.

    Raises:
        InvalidArgumentError: as :func:`encode_parts`.
    """
    return b"".join(encode_parts(arrays, names))


def _check_shape(s: Any, j: int) -> Shape:
    if isinstance(s, (str, bytes)) or not isinstance(s, (Sequence, np.ndarray)):
        raise InvalidArgumentError(f"shape {j} must be a sequence of ints, got {s!r}")
    out: list[int] = []
    for d in s:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d <= _INTP_MAX:
            raise InvalidArgumentError(f"shape {j}: dimension {d!r} is not an int >= 0")
        out.append(int(d))
    if len(out) > MAX_NDIM:
        raise InvalidArgumentError(f"shape {j} has {len(out)} dimensions, most is {MAX_NDIM}")
    return tuple(out)


def _normalize_spec(
    dtypes: Sequence[npt.DTypeLike], shapes: Sequence[Sequence[int]]
) -> tuple[tuple[str, ...], tuple[Shape, ...]]:
    if len(dtypes) != len(shapes):
        raise InvalidArgumentError(f"{len(dtypes)} dtypes but {len(shapes)} shapes")
    codes = tuple(dtype_code(d) for d in dtypes)
    shps = tuple(_check_shape(s, j) for j, s in enumerate(shapes))
    return codes, shps


def header_bytes(
    dtypes: Sequence[npt.DTypeLike],
    shapes: Sequence[Sequence[int]],
    names: Sequence[str] | None = None,
) -> bytes:
    """The exact header prefix (magic through the padding before buffer 0) that
    :func:`encode` writes for arrays of these dtypes and shapes (and names).

    Raises:
        InvalidArgumentError: unsupported dtype, bad shape (not ints >= 0, more than
            :data:`MAX_NDIM` dims), or dtypes/shapes/names of different lengths.
    """
    codes, shps = _normalize_spec(dtypes, shapes)
    return _header(codes, shps, _check_names(names, len(codes)))


# --------------------------------------------------------------------------- decoding


class _Layout(NamedTuple):
    """What a validated header implies; shared (cached), so never mutated."""

    comps: tuple[tuple[np.dtype[Any], int, int, Shape], ...]  # dtype, count, offset, shape
    bools: tuple[int, ...]  # indices of bool components (bytes must be 0 or 1)
    pads: tuple[tuple[int, int], ...]  # [start, end) ranges that must hold zeros
    total: int  # exact message length
    names: tuple[str, ...] | None


def _bad(what: str) -> DataLossError:
    return DataLossError(f"bad qps message header: {what}")


def _parse_header(flags: int, hb: bytes) -> _Layout:
    """Validate header bytes ``hb`` and compute the layout. Raises DataLossError only."""
    try:
        obj = msgpack.unpackb(hb, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several types (ValueError, TypeError, ...)
        raise _bad(f"not valid msgpack ({type(e).__name__}: {e})") from e
    if type(obj) is not list or len(obj) != 2:
        raise _bad("expected a 2-element array [components, names]")
    comps_obj, names_obj = obj
    if type(comps_obj) is not list:
        raise _bad(f"components must be an array, got {type(comps_obj).__name__}")
    comps: list[tuple[np.dtype[Any], int, int, Shape]] = []
    bools: list[int] = []
    pads: list[tuple[int, int]] = []
    end = _PREFIX_LEN + len(hb)
    pos = _align(end)
    if pos != end:
        pads.append((end, pos))
    for j, c in enumerate(comps_obj):
        if type(c) is not list or len(c) != 2:
            raise _bad(f"component {j} must be a 2-element array [dtype, shape]")
        code, dims = c
        if type(code) is not str:
            raise _bad(f"component {j}: dtype code must be a string, got {type(code).__name__}")
        dt = dtype_from_code(code)
        if type(dims) is not list:
            raise _bad(f"component {j}: shape must be an array, got {type(dims).__name__}")
        if len(dims) > MAX_NDIM:
            raise _bad(f"component {j} has {len(dims)} dimensions, most is {MAX_NDIM}")
        count = 1
        nonzero = dt.itemsize
        for d in dims:
            if type(d) is not int or d < 0:
                raise _bad(f"component {j}: dimension {d!r} is not an int >= 0")
            count *= d
            if d:
                nonzero *= d
        if nonzero > _INTP_MAX:  # numpy could not even describe such a shape
            raise _bad(f"component {j}: shape {dims} is too large")
        if j:
            start = _align(pos)
            if start != pos:
                pads.append((pos, start))
            pos = start
        comps.append((dt, count, pos, tuple(dims)))
        if dt.kind == "b":
            bools.append(j)
        pos += count * dt.itemsize
    if flags & _FLAG_NAMES:
        if type(names_obj) is not list:
            raise _bad(f"flags say names are present but names is {type(names_obj).__name__}")
        if len(names_obj) != len(comps):
            raise _bad(f"{len(names_obj)} names for {len(comps)} components")
        for k in names_obj:
            if type(k) is not str:
                raise _bad(f"names must be strings, got {type(k).__name__}")
        names: tuple[str, ...] | None = tuple(names_obj)
    else:
        if names_obj is not None:
            raise _bad("names present but the names flag is not set")
        names = None
    return _Layout(tuple(comps), tuple(bools), tuple(pads), pos, names)


_parse_header_cached = functools.lru_cache(maxsize=1024)(_parse_header)


def _byte_buffer(data: Any) -> bytes | bytearray | memoryview:
    """``data`` as something indexed and sliced by byte."""
    t = type(data)
    if t is bytes or t is bytearray:
        return data  # type: ignore[no-any-return]
    try:
        mv = memoryview(data)
    except TypeError as e:
        raise InvalidArgumentError(
            f"expected bytes, bytearray or memoryview, got {t.__name__}"
        ) from e
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError as e:
            raise InvalidArgumentError(f"buffer is not C-contiguous bytes: {e}") from e
    return mv


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one message. The arrays are zero-copy ``np.frombuffer`` views into ``data``
    (read-only when ``data`` is ``bytes``); copy them to outlive or modify it.

    Everything is validated before any array is made: magic, version, flags, header
    length, header structure, dtype codes, dimensions, the declared size against
    ``max_bytes``, the exact total length and the zero padding.

    Raises:
        DataLossError: the bytes are not a well-formed message of this format version, or
            declare more than ``max_bytes`` bytes. Never any other error for bad bytes.
        InvalidArgumentError: ``data`` is not a bytes-like object (a programming error).
    """
    buf = _byte_buffer(data)
    n = len(buf)
    if n < _PREFIX_LEN:
        k = min(n, len(MAGIC))
        if bytes(buf[:k]) != MAGIC[:k]:
            raise DataLossError(f"not a qps message (bad magic {bytes(buf[:k])!r})")
        raise DataLossError(f"truncated: {n} bytes, a qps message has at least {_PREFIX_LEN}")
    magic, version, flags, hl = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise DataLossError(f"not a qps message (bad magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise DataLossError(
            f"unsupported qps wire format version {version} (this build reads {FORMAT_VERSION})"
        )
    if flags & ~_FLAG_NAMES:
        raise DataLossError(f"unknown flag bits 0x{flags & ~_FLAG_NAMES:02x} (flags 0x{flags:02x})")
    hend = _PREFIX_LEN + hl
    if hend > max_bytes:
        raise DataLossError(f"message declares at least {hend} bytes, limit {max_bytes}")
    if hend > n:
        raise DataLossError(
            f"truncated: header declares {hl} bytes but {n - _PREFIX_LEN} follow the prefix"
        )
    hb = bytes(buf[_PREFIX_LEN:hend])
    lay = _parse_header_cached(flags, hb) if hl <= _CACHED_HEADER_MAX else _parse_header(flags, hb)
    total = lay.total
    if total > max_bytes:
        raise DataLossError(f"message declares {total} bytes, limit {max_bytes}")
    if n != total:
        if n < total:
            raise DataLossError(f"truncated: header implies {total} bytes, got {n}")
        raise DataLossError(f"trailing bytes: {n - total} after the {total}-byte message")
    for a, b in lay.pads:
        if buf[a:b] != _ZEROS[: b - a]:
            raise DataLossError(f"nonzero padding in bytes [{a}, {b})")
    arrays = [np.frombuffer(buf, dt, cnt, off).reshape(shape) for dt, cnt, off, shape in lay.comps]
    for j in lay.bools:
        arr = arrays[j]
        if arr.size and arr.view(np.uint8).max() > 1:
            raise DataLossError(f"component {j}: bool bytes other than 0 and 1")
    names = lay.names
    return Message(arrays, None if names is None else list(names))


def decode_arrays(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MESSAGE_BYTES
) -> list[npt.NDArray[Any]]:
    """``decode(data, max_bytes=max_bytes).arrays``.

    Raises:
        DataLossError: as :func:`decode`.
        InvalidArgumentError: as :func:`decode`.
    """
    return decode(data, max_bytes=max_bytes).arrays


# --------------------------------------------------------------------------- batches


class _RowLayout(NamedTuple):
    """Constant facts about one element of a fixed-shape spec."""

    codes: tuple[str, ...]
    dtypes: tuple[np.dtype[Any], ...]
    shapes: tuple[Shape, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    header: npt.NDArray[np.uint8]  # the header prefix as uint8
    inner_pads: tuple[tuple[int, int], ...]  # zero ranges between buffers
    length: int  # bytes per element message


@functools.lru_cache(maxsize=256)
def _row_layout_norm(codes: tuple[str, ...], shapes: tuple[Shape, ...]) -> _RowLayout:
    head = _header(codes, shapes, None)
    dts = tuple(dtype_from_code(c) for c in codes)
    offsets: list[int] = []
    nbytes: list[int] = []
    pads: list[tuple[int, int]] = []
    pos = len(head)
    for j, (dt, s) in enumerate(zip(dts, shapes, strict=True)):
        if j:
            start = _align(pos)
            if start != pos:
                pads.append((pos, start))
            pos = start
        nb = math.prod(s) * dt.itemsize
        offsets.append(pos)
        nbytes.append(nb)
        pos += nb
    header = np.frombuffer(head, np.uint8)
    return _RowLayout(codes, dts, shapes, tuple(offsets), tuple(nbytes), header, tuple(pads), pos)


@functools.lru_cache(maxsize=256)
def _row_layout_raw(dtypes: tuple[Any, ...], shapes: tuple[tuple[Any, ...], ...]) -> _RowLayout:
    codes, shps = _normalize_spec(dtypes, shapes)
    return _row_layout_norm(codes, shps)


def _row_layout(dtypes: Sequence[npt.DTypeLike], shapes: Sequence[Sequence[int]]) -> _RowLayout:
    try:
        key_s = tuple(tuple(s) for s in shapes)
        return _row_layout_raw(tuple(dtypes), key_s)
    except TypeError:  # unhashable or non-iterable spec: validate it the slow way
        codes, shps = _normalize_spec(dtypes, shapes)
        return _row_layout_norm(codes, shps)


def encode_rows(
    arrays: Sequence[Any], dtypes: Sequence[npt.DTypeLike], shapes: Sequence[Sequence[int]]
) -> list[memoryview]:
    """Encode a batch of fixed-shape elements into one message per element.

    ``arrays[j]`` has shape ``[B] + shapes[j]`` and dtype ``dtypes[j]`` (either byte
    order); element ``i`` of the result equals ``encode([a[i] for a in arrays])`` byte for
    byte. All ``B`` messages live in one ``(B, element_len)`` buffer filled by a few
    vectorized copies; the result holds memoryviews of its rows.

    Raises:
        InvalidArgumentError: a bad spec (see :func:`header_bytes`), no components, a
            component count, shape or batch size that does not match, or a dtype that
            is not the spec's.
    """
    return encode_rows_lazily(arrays, dtypes, shapes).messages()


class EncodedRows:
    """The messages of a batch of fixed-shape elements, made a window of rows at a time
    (:func:`encode_rows_lazily`): what :func:`encode_rows` gives, back to back, without
    a copy of the whole batch. The arrays are read when a window is made: they must
    not change meanwhile."""

    __slots__ = ("_lay", "_srcs", "nbytes", "row_bytes", "rows")

    def __init__(self, lay: _RowLayout, srcs: list[npt.NDArray[Any]], rows: int) -> None:
        self._lay = lay
        self._srcs = srcs
        self.rows = rows
        self.row_bytes = lay.length
        #: the size of all the messages together
        self.nbytes = rows * lay.length

    def __len__(self) -> int:
        return self.rows

    def encode(self, start: int, stop: int) -> memoryview:
        """The messages of rows ``start`` to ``stop`` (excluded), back to back, in a new
        buffer."""
        lay = self._lay
        count = stop - start
        out = np.empty((count, lay.length), np.uint8)
        out[:, : len(lay.header)] = lay.header
        for p0, p1 in lay.inner_pads:
            out[:, p0:p1] = 0
        for j, a in enumerate(self._srcs):
            nb = lay.nbytes[j]
            if nb == 0:
                continue
            off = lay.offsets[j]
            dt = lay.dtypes[j]
            dst = out[:, off : off + nb]
            src = a[start:stop]
            if a.dtype == dt and a.flags.c_contiguous:
                dst[...] = src.reshape(count, -1).view(np.uint8)
            else:  # non-contiguous or other byte order: let numpy copy and byte-swap
                view = np.reshape(dst.view(dt), (count, *lay.shapes[j]), copy=False)
                view[...] = src
        return out.data.cast("B")

    def messages(self) -> list[memoryview]:
        """All the messages, as :func:`encode_rows` gives them (one buffer, its rows)."""
        if not self.rows:
            return []
        length = self.row_bytes
        flat = self.encode(0, self.rows)
        return [flat[i : i + length] for i in range(0, self.nbytes, length)]

    def windows(
        self, max_bytes: int, start: int = 0, count: int | None = None
    ) -> Iterable[memoryview]:
        """The messages of ``count`` rows from row ``start`` (all the rest: None) in
        windows of whole rows of at most ``max_bytes`` (at least one row), each made
        when it is asked for; every ``iter()`` starts over."""
        stop = self.rows if count is None else min(self.rows, start + count)
        step = max(1, max_bytes // max(1, self.row_bytes))
        return _Windows(self, start, stop, step)


class _Windows:
    __slots__ = ("_rows", "_start", "_step", "_stop")

    def __init__(self, rows: EncodedRows, start: int, stop: int, step: int) -> None:
        self._rows = rows
        self._start = start
        self._stop = stop
        self._step = step

    def __iter__(self) -> Iterator[memoryview]:
        rows, stop, step = self._rows, self._stop, self._step
        for at in range(self._start, stop, step):
            yield rows.encode(at, min(at + step, stop))


def encode_rows_lazily(
    arrays: Sequence[Any], dtypes: Sequence[npt.DTypeLike], shapes: Sequence[Sequence[int]]
) -> EncodedRows:
    """The batch :func:`encode_rows` encodes, checked now and encoded on demand.

    Raises:
        InvalidArgumentError: as :func:`encode_rows`.
    """
    lay = _row_layout(dtypes, shapes)
    ncomp = len(lay.codes)
    if len(arrays) != ncomp:
        raise InvalidArgumentError(f"{len(arrays)} arrays for a spec of {ncomp} components")
    if ncomp == 0:
        raise InvalidArgumentError("encode_rows needs at least one component")
    srcs: list[npt.NDArray[Any]] = []
    batch = -1
    for j, x in enumerate(arrays):
        a = x if type(x) is np.ndarray else _to_numpy(x, j)
        shape = lay.shapes[j]
        if a.shape[1:] != shape or a.ndim != len(shape) + 1:
            raise InvalidArgumentError(
                f"component {j}: shape {a.shape}, expected [batch] + {list(shape)}"
            )
        if batch < 0:
            batch = a.shape[0]
        elif a.shape[0] != batch:
            raise InvalidArgumentError(
                f"component {j}: batch size {a.shape[0]}, component 0 has {batch}"
            )
        if a.dtype != lay.dtypes[j]:
            code = _CODE_BY_DTYPE.get(a.dtype)
            if code is None and a.dtype.kind in "biuf":
                code = _CODE_BY_DTYPE.get(a.dtype.newbyteorder("<"))
            if code != lay.codes[j]:
                raise InvalidArgumentError(
                    f"component {j}: dtype {a.dtype}, the spec says {lay.dtypes[j]}"
                )
        srcs.append(a)
    return EncodedRows(lay, srcs, max(batch, 0))


def decode_rows(
    blobs: Sequence[bytes | bytearray | memoryview],
    dtypes: Sequence[npt.DTypeLike],
    shapes: Sequence[Sequence[int]],
    joined: bytes | bytearray | memoryview | None = None,
) -> list[npt.NDArray[Any]] | None:
    """Decode a batch of element messages of one fixed-shape spec into batch arrays.

    Returns one C-contiguous, writable array of shape ``[B] + shapes[j]`` per component,
    or ``None`` when any blob is not exactly the message :func:`encode_rows` would write
    for the spec (other length, header or padding, or bool bytes other than 0/1); the
    caller then decodes the blobs one by one with :func:`decode`, which names the error.
    ``joined``: the blobs back to back in one buffer, if the caller has it (saves a copy).

    Raises:
        InvalidArgumentError: a bad spec (see :func:`header_bytes`).
    """
    lay = _row_layout(dtypes, shapes)
    batch = len(blobs)
    if batch == 0:
        return [np.empty((0, *s), dt) for dt, s in zip(lay.dtypes, lay.shapes, strict=True)]
    length = lay.length
    if set(map(len, blobs)) != {length}:
        return None
    if joined is not None and len(joined) == batch * length:
        data: Any = joined
    elif length >= _ROWWISE_MIN_BYTES:  # large elements: no joined copy of the batch
        return _decode_rowwise(lay, blobs)
    else:
        data = b"".join(blobs)
    rows = np.frombuffer(data, np.uint8).reshape(batch, length)
    hlen = len(lay.header)
    if not (rows[:, :hlen] == lay.header).all():
        return None
    for p0, p1 in lay.inner_pads:
        if rows[:, p0:p1].any():
            return None
    result: list[npt.NDArray[Any]] = []
    for dt, shape, off, nb in zip(lay.dtypes, lay.shapes, lay.offsets, lay.nbytes, strict=True):
        arr = np.empty((batch, *shape), dt)
        if nb:
            arr.reshape(batch, -1).view(np.uint8)[...] = rows[:, off : off + nb]
            if dt.kind == "b" and arr.view(np.uint8).max() > 1:
                return None
        result.append(arr)
    return result


#: decode_rows copies elements of at least this many bytes one at a time into the batch
#: arrays rather than join them first (a copy of the whole batch more).
_ROWWISE_MIN_BYTES = 64 << 10


def _decode_rowwise(
    lay: _RowLayout, blobs: Sequence[bytes | bytearray | memoryview]
) -> list[npt.NDArray[Any]] | None:
    """:func:`decode_rows` of blobs of the right length, one element at a time."""
    batch = len(blobs)
    hlen = len(lay.header)
    result = [np.empty((batch, *s), dt) for dt, s in zip(lay.dtypes, lay.shapes, strict=True)]
    flats = [a.reshape(batch, -1).view(np.uint8) for a in result]
    for i, blob in enumerate(blobs):
        row = np.frombuffer(blob, np.uint8)
        if not (row[:hlen] == lay.header).all():
            return None
        for p0, p1 in lay.inner_pads:
            if row[p0:p1].any():
                return None
        for flat, off, nb in zip(flats, lay.offsets, lay.nbytes, strict=True):
            if nb:
                flat[i] = row[off : off + nb]
    for arr, dt, nb in zip(result, lay.dtypes, lay.nbytes, strict=True):
        if nb and dt.kind == "b" and arr.view(np.uint8).max() > 1:
            return None
    return result


# --------------------------------------------------------------------------- helpers


def split_chunks(data: bytes | bytearray | memoryview, chunk_bytes: int) -> list[memoryview]:
    """Split ``data`` into zero-copy slices of ``chunk_bytes`` bytes (the last may be
    shorter). Empty ``data`` gives an empty list.

    Raises:
        InvalidArgumentError: ``chunk_bytes`` is not a positive int, or ``data`` is not a
            C-contiguous bytes-like object.
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise InvalidArgumentError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    buf = _byte_buffer(data)
    mv = buf if type(buf) is memoryview else memoryview(buf)
    return [mv[i : i + chunk_bytes] for i in range(0, len(mv), chunk_bytes)]

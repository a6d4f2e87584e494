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
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from qps.errors import DataLossError, InvalidArgumentError
from qps.wire_rows import (
    _ROWWISE_MIN_BYTES,
    EncodedRows,
    decode_rows,
    encode_rows,
    encode_rows_lazily,
)
from qps.wire_spec import (
    _ALIGN,
    _CACHED_HEADER_MAX,
    _CODE_BY_DTYPE,
    _DTYPE_BY_CODE,
    _FLAG_NAMES,
    _INTP_MAX,
    _PADS,
    _PREFIX,
    _PREFIX_LEN,
    _ZEROS,
    FORMAT_VERSION,
    MAGIC,
    MAX_MESSAGE_BYTES,
    MAX_NDIM,
    MAX_STRING_ITEMSIZE,
    Shape,
    _align,
    _check_names,
    _code_slow,
    _header,
    _to_numpy,
    dtype_code,
    dtype_from_code,
    header_bytes,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MAX_NDIM",
    "MAX_STRING_ITEMSIZE",
    "_ROWWISE_MIN_BYTES",
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


class Message(NamedTuple):
    """A decoded message: its arrays, in order, and their names if it carried any."""

    arrays: list[npt.NDArray[Any]]
    names: list[str] | None


# --------------------------------------------------------------------------- encoding


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

"""The qps wire format for batches of fixed-shape elements: one message per element,
encoded (:func:`encode_rows`) and decoded (:func:`decode_rows`) a batch at a time by a
few vectorized copies, byte for byte what :func:`qps.wire.encode` writes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qps.errors import InvalidArgumentError
from qps.wire_spec import (
    _CODE_BY_DTYPE,
    Shape,
    _align,
    _header,
    _normalize_spec,
    _to_numpy,
    dtype_from_code,
)


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

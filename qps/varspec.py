"""A variable's immutable spec and how its bytes are laid out in Redis. Pure: no I/O.

:class:`VariableSpec` (dtype, shape, trainable, initializer, partition) is stored as JSON
in the variable's ``meta`` hash by its first creator. :class:`Layout` cuts the value
(row-major, little-endian bytes) into **segments** of whole rows, one Redis string each,
of at most :data:`SEGMENT_BYTES`: just under jemalloc's 4 MiB size class, so a segment
costs its own size in memory (one string of exactly 2**k bytes would take a 25 % larger
allocation: Redis adds a header and jemalloc rounds up to the next class). A row never
straddles two segments, so a run of rows is one ``GETRANGE``.
"""

from __future__ import annotations

import functools
import json
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qps import wire
from qps.errors import DataLossError, InvalidArgumentError

__all__ = [
    "CHUNK_BYTES",
    "MAX_BYTES",
    "MAX_COUNTER",
    "SEGMENT_BYTES",
    "Layout",
    "PartitionInfo",
    "RowRuns",
    "VariableSpec",
    "check_counter",
    "check_dtype",
    "check_indices",
    "check_shape",
    "dtype_name",
    "format_shape",
    "ranges_arg",
    "row_runs",
    "split_runs",
]

#: Large values move in chunks of this size (docs/variables.md, "Storage").
CHUNK_BYTES = 1 << 20
#: Most bytes in one segment key: 4 MiB less Redis's string header and some slack, so
#: that the allocation is exactly jemalloc's 4 MiB class.
SEGMENT_BYTES = (4 << 20) - 64
#: Largest variable qps accepts (a sanity bound; partition big tables over shards).
MAX_BYTES = 16 << 30
#: Versions and tokens are ints in [0, 2**53) (exact in Lua's doubles).
MAX_COUNTER = 2**53 - 1
SPEC_FORMAT = 1


# -- spec ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionInfo:
    """Where a partition sits in its partitioned variable (TF's save-slice info).

    Attributes:
        full_name: the partitioned variable's name (parts are ``<full_name>/part_<i>``).
        full_shape: the whole variable's shape.
        axis: the partitioned axis.
        index: this part's index; ``count`` parts in all.
        offset: this part's first index along every axis.
    """

    full_name: str
    full_shape: tuple[int, ...]
    axis: int
    index: int
    count: int
    offset: tuple[int, ...]

    def save_slice_info(self, shape: Sequence[int]) -> str:
        """TF's spelling ``"<full shape> <offset>,<length>:..."``, e.g. ``'10 1 4,3:0,1'``."""
        full = " ".join(str(d) for d in self.full_shape)
        spans = ":".join(f"{o},{n}" for o, n in zip(self.offset, shape, strict=True))
        return f"{full} {spans}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "full_name": self.full_name,
            "full_shape": list(self.full_shape),
            "axis": self.axis,
            "index": self.index,
            "count": self.count,
            "offset": list(self.offset),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartitionInfo:
        """Raises: ValueError, KeyError, TypeError: not a partition's place."""
        p = cls(
            full_name=str(d["full_name"]),
            full_shape=tuple(int(x) for x in d["full_shape"]),
            axis=int(d["axis"]),
            index=int(d["index"]),
            count=int(d["count"]),
            offset=tuple(int(x) for x in d["offset"]),
        )
        rank = len(p.full_shape)
        if not (0 <= p.axis < rank and 0 <= p.index < p.count and len(p.offset) == rank):
            raise ValueError(f"partition {d!r} is not a place in a partitioned variable")
        return p


@dataclass(frozen=True)
class VariableSpec:
    """What a variable is: stored as JSON in ``meta.spec`` by its first creator.

    Only ``dtype`` and ``shape`` must match for a later opener; ``trainable``,
    ``initializer`` and ``partition`` are the creator's (TF: the first creator wins).
    """

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    trainable: bool = True
    initializer: dict[str, Any] | None = None
    partition: PartitionInfo | None = None

    @property
    def code(self) -> str:
        return wire.dtype_code(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:  # read on every commit and pull: computed once
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one index along axis 0)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": SPEC_FORMAT,
                "dtype": self.code,
                "shape": list(self.shape),
                "trainable": self.trainable,
                "initializer": self.initializer,
                "partition": None if self.partition is None else self.partition.as_dict(),
                "layout": "C-order little-endian",
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> VariableSpec:
        """Raises:
        DataLossError: not a variable spec this version of qps reads.
        """
        try:
            d = json.loads(text)
            if d.get("format") != SPEC_FORMAT:
                raise DataLossError(f"variable spec format {d.get('format')!r} is not known")
            part, init = d.get("partition"), d.get("initializer")
            trainable = d.get("trainable", True)
            if not isinstance(init, (dict, type(None))) or not isinstance(trainable, bool):
                raise TypeError("'initializer' must be an object or null, 'trainable' a bool")
            spec = cls(
                dtype=wire.dtype_from_code(d["dtype"]),
                shape=check_shape(d["shape"]),
                trainable=trainable,
                initializer=init,
                partition=None if part is None else PartitionInfo.from_dict(part),
            )
            if spec.nbytes > MAX_BYTES:
                raise ValueError(f"{spec.nbytes} bytes, over the {MAX_BYTES}-byte limit")
            return spec
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataLossError(f"bad variable spec {text!r}: {exc}") from exc

    def check_same(self, existing: VariableSpec, name: str) -> None:
        """Compare a requested spec (self) with the stored one.

        Raises:
            InvalidArgumentError: a different dtype, shape or place in a partitioned
                variable (texts like the shared queues' ones).
        """
        if existing.code != self.code:
            raise InvalidArgumentError(
                f"Shared variable '{name}' has dtype {dtype_name(existing.dtype)} but "
                f"requested dtype was {dtype_name(self.dtype)}"
            )
        if existing.shape != self.shape:
            raise InvalidArgumentError(
                f"Shared variable '{name}' has shape {format_shape(existing.shape)} but "
                f"requested shape was {format_shape(self.shape)}"
            )
        if existing.partition != self.partition:
            raise InvalidArgumentError(
                f"Shared variable '{name}' is {_part_text(existing.partition)} but was "
                f"requested as {_part_text(self.partition)}"
            )


def _part_text(p: PartitionInfo | None) -> str:
    if p is None:
        return "not a partition"
    return (
        f"partition {p.index} of {p.count} of '{p.full_name}' {format_shape(p.full_shape)} "
        f"(axis {p.axis}, offset {list(p.offset)})"
    )


def format_shape(shape: Sequence[int]) -> str:
    """TF's spelling of a shape: ``[10,4]``, ``[]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def dtype_name(dt: np.dtype[Any]) -> str:
    """``float32``, ``bool``, ``bytes8`` ..."""
    return str(dt.name)


def check_dtype(dtype: Any) -> np.dtype[Any]:
    """The little-endian dtype a variable of ``dtype`` stores.

    Raises:
        InvalidArgumentError: not a dtype the wire format carries, or bytes without a
            fixed width.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidArgumentError(f"not a dtype: {dtype!r}") from exc
    if dt.kind == "S" and dt.itemsize == 0:
        raise InvalidArgumentError("a variable of bytes needs a fixed width, e.g. 'S16'")
    return wire.dtype_from_code(wire.dtype_code(dt))  # little-endian, whitelisted


def check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` (a sequence of ints >= 0, or one int) as a tuple.

    Raises:
        InvalidArgumentError: anything else, or more than ``wire.MAX_NDIM`` dimensions.
    """
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise InvalidArgumentError(f"shape must be a sequence of ints, got {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise InvalidArgumentError(
                f"shape {list(shape)!r}: every dimension must be an int >= 0 (fully defined)"
            )
        out.append(int(d))
    if len(out) > wire.MAX_NDIM:
        raise InvalidArgumentError(f"shape has {len(out)} dimensions, most is {wire.MAX_NDIM}")
    return tuple(out)


def check_counter(value: Any, what: str) -> int:
    """``value`` as a version or token: an int in ``[0, 2**53)``.

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {value!r}") from None
    if not 0 <= v <= MAX_COUNTER:
        raise InvalidArgumentError(f"{what} {v} is not in [0, 2**53)")
    return v


def check_indices(indices: Any, dim0: int, what: str = "indices") -> npt.NDArray[np.int64]:
    """``indices`` as an int64 array (any shape), every one in ``[0, dim0)``.

    Raises:
        InvalidArgumentError: not integers, or one out of range (TF's text
            ``indices[3] = 12 is not in [0, 10)``).
    """
    try:
        a = np.asarray(indices)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} must be integers: {exc}") from exc
    if a.size == 0:
        return np.zeros(a.shape, np.int64)
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must be integers, got dtype {a.dtype}")
    flat = a.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat >= dim0))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(f"{what}[{i}] = {int(flat[i])} is not in [0, {dim0})")
    return a.astype(np.int64, copy=False)


# -- layout ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a value is cut into segment keys ``d:<gen>:<i>`` of whole rows.

    A scalar is one row. ``seg_rows`` is fixed when the variable is created and stored
    in its meta (``segb`` = ``seg_rows * row_bytes``), so that a later qps with another
    :data:`SEGMENT_BYTES` still reads old variables right.
    """

    nbytes: int
    rows: int
    row_bytes: int
    seg_rows: int

    @classmethod
    def of(cls, spec: VariableSpec, seg_bytes: int | None = None) -> Layout:
        """The layout of ``spec`` (with the stored segment size, if known)."""
        rows = spec.shape[0] if spec.shape else 1
        rb = spec.row_bytes
        target = SEGMENT_BYTES if seg_bytes is None else seg_bytes
        seg_rows = max(1, target // rb) if rb else 1
        return cls(spec.nbytes, rows, rb, seg_rows)

    @property
    def seg_bytes(self) -> int:
        """Bytes of a full segment."""
        return self.seg_rows * self.row_bytes

    @property
    def nseg(self) -> int:
        """Number of segments (0 for an empty value)."""
        return 0 if self.nbytes == 0 else -(-self.rows // self.seg_rows)

    def segment_size(self, i: int) -> int:
        return min(self.seg_bytes, self.nbytes - i * self.seg_bytes)

    def chunks(self, chunk: int | None = None) -> list[tuple[int, int, int]]:
        """``(segment, first byte, last byte)`` of every piece of at most ``chunk``
        (default :data:`CHUNK_BYTES`) bytes, in order: the ``GETRANGE`` calls of a full
        read."""
        chunk = chunk or CHUNK_BYTES
        out = []
        for i in range(self.nseg):
            size = self.segment_size(i)
            out += [(i, lo, min(lo + chunk, size) - 1) for lo in range(0, size, chunk)]
        return out


class RowRuns(NamedTuple):
    """Runs of consecutive rows: ``starts[k]`` .. ``starts[k] + counts[k] - 1``."""

    starts: npt.NDArray[np.int64]
    counts: npt.NDArray[np.int64]
    #: for each wanted row (sorted, unique), its position among the runs' rows
    pos: npt.NDArray[np.int64]


def row_runs(rows: npt.NDArray[np.int64], seg_rows: int, gap: int = 0) -> RowRuns:
    """Runs of consecutive rows covering the sorted unique ``rows``; two runs are joined
    when at most ``gap`` rows lie between them, never across a segment boundary (every
    ``seg_rows`` rows)."""
    if rows.size == 0:
        e = np.zeros(0, np.int64)
        return RowRuns(e, e, e)
    seg = rows // seg_rows
    brk = np.flatnonzero((np.diff(rows) > gap + 1) | (np.diff(seg) != 0)) + 1
    first = np.concatenate(([0], brk))
    last = np.concatenate((brk - 1, [rows.size - 1]))
    starts = rows[first]
    counts = rows[last] - starts + 1
    run_of = np.repeat(np.arange(first.size), np.diff(np.concatenate((first, [rows.size]))))
    base = np.cumsum(counts) - counts
    pos = base[run_of] + (rows - starts[run_of])
    return RowRuns(starts, counts, pos)


def split_runs(
    runs: RowRuns, max_rows: int
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """``(starts, counts)`` batches of about ``max_rows`` rows at most (each under
    ``2 * max_rows``); a longer run is cut into pieces. The rows keep their order."""
    starts, counts = runs.starts, runs.counts
    if counts.size and int(counts.max()) > max_rows:
        s_out: list[int] = []
        c_out: list[int] = []
        for s, c in zip(starts.tolist(), counts.tolist()):
            while c > max_rows:
                s_out.append(s)
                c_out.append(max_rows)
                s, c = s + max_rows, c - max_rows
            s_out.append(s)
            c_out.append(c)
        starts, counts = np.array(s_out, np.int64), np.array(c_out, np.int64)
    before = np.cumsum(counts) - counts
    cuts = np.flatnonzero(np.diff(before // max_rows)) + 1
    return list(zip(np.split(starts, cuts), np.split(counts, cuts)))


def ranges_arg(
    lay: Layout, starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64], last: int
) -> str:
    """The script argument naming runs of rows as ``"segment offset x,..."`` (byte
    offset in the segment; ``x`` the last byte for ``last=-1``, the length for 0)."""
    seg = starts // lay.seg_rows
    lo = (starts - seg * lay.seg_rows) * lay.row_bytes
    x = counts * lay.row_bytes + (lo + last if last else 0)
    return ",".join(f"{a} {b} {c}" for a, b, c in zip(seg.tolist(), lo.tolist(), x.tolist()))

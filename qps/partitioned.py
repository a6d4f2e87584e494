"""Partitioned variables and ``embedding_lookup``.

A :class:`PartitionedVariable` stores contiguous slices (TF's layout: the first
``dim % k`` parts get one more row) as variables ``<name>/part_<i>``.
:func:`embedding_lookup` takes ``partition_strategy="mod"`` (TF's default) or ``"div"``;
:func:`lookup_plan` is its pure arithmetic.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qps import keys
from qps.errors import InvalidArgumentError, NotFoundError
from qps.partitioners import Partitioner, partition_offsets, partition_sizes
from qps.transport import Client
from qps.variables import Variable, VariableValue, list_variables, open_variable
from qps.varspec import PartitionInfo, check_dtype, check_shape, format_shape


class PartitionedValue(NamedTuple):
    """A read of a partitioned variable: the value and each part's version."""

    value: npt.NDArray[Any]
    versions: tuple[int, ...]


class LookupResult(NamedTuple):
    """Rows looked up and the version of each partition read (None: not read)."""

    values: npt.NDArray[Any]
    versions: tuple[int | None, ...]


def _part_name(name: str, i: int) -> str:
    return f"{name}/part_{i}"


class PartitionedVariable:
    """A variable stored as ``k`` contiguous slices along one axis, each a
    :class:`~qps.variables.Variable` named ``<name>/part_<i>`` (TF's
    ``get_variable(..., partitioner=...)``). Each part records its place (TF's save-slice
    info) and is placed on a shard like a separate variable.

    Args:
        name: the variable's name; the parts are ``<name>/part_<i>``.
        shape, dtype, initializer, trainable: as :class:`~qps.variables.Variable`; an
            array initializer is the whole value (each part takes its slice), random
            initializers use the whole shape for their fans.
        partitioner: a callable ``(shape, dtype) -> partitions per dimension`` (one of
            this module's partitioners), or the list itself.
        container, client: as :class:`~qps.variables.Variable`.

    Raises:
        InvalidArgumentError: bad arguments, or partitions along more than one axis, or
            more partitions than rows.
    """

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        dtype: npt.DTypeLike = np.float32,
        partitioner: Partitioner | Sequence[int] | None = None,
        initializer: Any = None,
        trainable: bool = True,
        *,
        container: str | None = None,
        client: Client | None = None,
    ) -> None:
        self._name = keys.check_name(name)
        shp = check_shape(shape)
        dt = check_dtype(dtype)
        if partitioner is None:
            partitions = [1] * len(shp)
        elif callable(partitioner):
            partitions = list(partitioner(shp, dt))
        else:
            partitions = list(partitioner)
        if len(partitions) != len(shp) or not shp:
            raise InvalidArgumentError(
                f"partitions {partitions} do not match the rank of shape {format_shape(shp)}"
            )
        if any(not isinstance(p, int) or p < 1 for p in partitions):
            raise InvalidArgumentError(f"partitions must be ints >= 1, got {partitions}")
        split = [i for i, p in enumerate(partitions) if p > 1]
        if len(split) > 1:
            raise InvalidArgumentError(
                f"partitions {partitions}: qps (like TF) partitions along one axis only"
            )
        axis = split[0] if split else 0
        k = partitions[axis]
        if k > max(1, shp[axis]):
            raise InvalidArgumentError(
                f"cannot make {k} partitions of axis {axis} of size {shp[axis]}"
            )
        self._shape, self._dtype, self._axis = shp, dt, axis
        self._partitions = partitions
        self._parts: list[Variable] = []
        sizes = partition_sizes(shp[axis], k)
        offsets = partition_offsets(shp[axis], k)
        for i in range(k):
            pshape = list(shp)
            pshape[axis] = sizes[i]
            offset = [0] * len(shp)
            offset[axis] = offsets[i]
            info = PartitionInfo(name, shp, axis, i, k, tuple(offset))
            self._parts.append(
                Variable(
                    _part_name(name, i),
                    pshape,
                    dt,
                    initializer,
                    trainable,
                    container=container,
                    client=client,
                    partition=info,
                )
            )

    @classmethod
    def _of_parts(
        cls, name: str, parts: list[Variable], info: PartitionInfo
    ) -> PartitionedVariable:
        pv = cls.__new__(cls)
        pv._name, pv._shape, pv._dtype, pv._axis = name, info.full_shape, parts[0].dtype, info.axis
        pv._partitions = [info.count if d == info.axis else 1 for d in range(len(info.full_shape))]
        pv._parts = parts
        return pv

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def axis(self) -> int:
        """The partitioned axis."""
        return self._axis

    @property
    def partitions(self) -> list[int]:
        """Partitions per dimension (what the partitioner returned)."""
        return list(self._partitions)

    @property
    def parts(self) -> list[Variable]:
        return list(self._parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def __iter__(self) -> Any:
        return iter(self._parts)

    def __getitem__(self, i: int) -> Variable:
        return self._parts[i]

    def __repr__(self) -> str:
        return (
            f"<qps.PartitionedVariable {self._name} shape={format_shape(self._shape)} "
            f"parts={len(self._parts)} axis={self._axis}>"
        )

    async def create(self) -> PartitionedVariable:
        """Create (or attach to) every part; see :meth:`Variable.create`. Every other
        method does this on first use, so the parts exist together (a lookup of a few
        ids does not leave the parts it does not touch uncreated).

        Raises:
            InvalidArgumentError: a part exists with another dtype, shape or place.
        """
        done = await asyncio.gather(*(p.create() for p in self._parts), return_exceptions=True)
        for outcome in done:  # the first failing part in order, whichever failed first
            if isinstance(outcome, BaseException):
                raise outcome
        return self

    async def read(self) -> PartitionedValue:
        """The whole value (the parts concatenated) and each part's version. Each part
        is an exact snapshot; the parts are read concurrently, not as one snapshot.

        Raises:
            NotFoundError: a part was deleted.
        """
        await self.create()  # every part, as TF creates them together
        reads = await asyncio.gather(*(p.read() for p in self._parts))
        value = np.concatenate([r.value for r in reads], axis=self._axis)
        return PartitionedValue(value, tuple(r.version for r in reads))

    async def read_rows(self, ids: Any, partition_strategy: str = "div") -> LookupResult:
        """Rows ``ids`` of the whole variable (axis-0 partitioning), by
        :func:`embedding_lookup` arithmetic. The default ``"div"`` is the storage layout:
        row ``i`` of the result is row ``ids[i]`` of :meth:`read`'s value.

        Raises:
            InvalidArgumentError: as :func:`embedding_lookup`.
        """
        await self.create()  # every part, not only those the ids touch
        return await _lookup(self._parts, ids, partition_strategy)


async def open_partitioned_variable(
    client: Client, name: str, container: str = keys.DEFAULT_CONTAINER
) -> PartitionedVariable:
    """The existing partitioned variable ``name`` (its parts ``<name>/part_<i>``),
    opened from the parts' stored specs.

    Raises:
        NotFoundError: no part of that name, or parts missing.
    """
    keys.check_name(name)
    first = await open_variable(client, _part_name(name, 0), container)
    info = first.partition
    if info is None or info.full_name != name:
        raise NotFoundError(f"'{name}/part_0' in container '{container}' is not a partition")
    parts = [first] + [
        await open_variable(client, _part_name(name, i), container) for i in range(1, info.count)
    ]
    return PartitionedVariable._of_parts(name, parts, info)


_PART_RE = re.compile(r"^(.*)/part_(\d+)$")


async def list_partitioned(client: Client, container: str = keys.DEFAULT_CONTAINER) -> list[str]:
    """Names of the partitioned variables of ``container`` (those with a ``part_0``)."""
    names = set()
    for n in await list_variables(client, container):
        m = _PART_RE.match(n)
        if m and m.group(2) == "0":
            names.add(m.group(1))
    return sorted(names)


# -- embedding_lookup ---------------------------------------------------------------------------


def lookup_plan(
    ids: Any, sizes: Sequence[int], partition_strategy: str = "mod"
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """TF ``embedding_lookup``'s arithmetic: for every id (flattened), its partition and
    its row within that partition, for partitions of ``sizes`` rows.

    * one partition: a plain gather;
    * ``"mod"``: partition ``id % P``, row ``id // P``;
    * ``"div"``: with ``N = sum(sizes)``, ``q, r = divmod(N, P)``: partition
      ``max(id // (q + 1), (id - r) // q)``, row ``id % (q + 1)`` in the first ``r``
      partitions, else ``(id - r) % q``.

    Raises:
        InvalidArgumentError: ids that are not integers, an unknown strategy, a
            partition out of range (``partitions[i] = p is not in [0, P)``) or a row
            out of its partition (``indices[k] = x is not in [0, n)``, ``k`` counting
            that partition's ids), as TF reports them.
    """
    if partition_strategy not in ("mod", "div"):
        raise InvalidArgumentError(
            f"Unrecognized partition strategy: {partition_strategy} (use 'mod' or 'div')"
        )
    a = np.asarray(ids)
    if a.size and a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"ids must be integers, got dtype {a.dtype}")
    flat = a.reshape(-1).astype(np.int64)
    nparts = len(sizes)
    if nparts == 0:
        raise InvalidArgumentError("embedding_lookup needs at least one partition")
    size_arr = np.asarray(sizes, np.int64)
    if nparts == 1:
        part = np.zeros_like(flat)
        row = flat
    elif partition_strategy == "mod":
        part = flat % nparts
        row = flat // nparts
    else:
        total = int(size_arr.sum())
        q, r = divmod(total, nparts)
        if q == 0:  # fewer rows than partitions: one row in each of the first r
            part, row = flat.copy(), np.zeros_like(flat)
        else:
            part = np.maximum(flat // (q + 1), (flat - r) // q)
            row = np.where(part < r, flat % (q + 1), (flat - r) % q)
        bad = np.flatnonzero((part < 0) | (part >= nparts))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(f"partitions[{i}] = {int(part[i])} is not in [0, {nparts})")
    for p in range(nparts):
        mine = np.flatnonzero(part == p)
        rows = row[mine]
        bad = np.flatnonzero((rows < 0) | (rows >= size_arr[p]))
        if bad.size:
            k = int(bad[0])
            raise InvalidArgumentError(
                f"indices[{k}] = {int(rows[k])} is not in [0, {int(size_arr[p])})"
                + (f" (partition {p}, id {int(flat[mine[k]])})" if nparts > 1 else "")
            )
    return part, row


Params = Variable | PartitionedVariable | npt.NDArray[Any] | Sequence[Any]


def _params_list(params: Params) -> list[Any]:
    if isinstance(params, PartitionedVariable):
        if params.axis != 0 and len(params) > 1:
            raise InvalidArgumentError(
                f"embedding_lookup needs partitions along axis 0; '{params.name}' is "
                f"partitioned along axis {params.axis}"
            )
        return params.parts
    if isinstance(params, (Variable, np.ndarray)):
        return [params]
    out = list(params)
    if not out:
        raise InvalidArgumentError("embedding_lookup needs at least one partition")
    return [np.asarray(p) if not isinstance(p, Variable) else p for p in out]


async def _lookup(parts: list[Any], ids: Any, strategy: str) -> LookupResult:
    for p in parts:
        if not p.shape:
            raise InvalidArgumentError("embedding_lookup params must have at least 1 dimension")
    row_shape, dtype = tuple(parts[0].shape[1:]), parts[0].dtype
    for p in parts[1:]:
        if tuple(p.shape[1:]) != row_shape or p.dtype != dtype:
            raise InvalidArgumentError(
                f"partitions differ: rows {format_shape(row_shape)} {dtype} vs "
                f"{format_shape(p.shape[1:])} {p.dtype}"
            )
    a = np.asarray(ids)
    part, row = lookup_plan(a, [int(p.shape[0]) for p in parts], strategy)
    out = np.empty((part.size, *row_shape), dtype)
    versions: list[int | None] = [None] * len(parts)

    async def fetch(i: int, p: Any, where: npt.NDArray[np.int64]) -> None:
        if isinstance(p, Variable):
            got: VariableValue = await p.read_rows(row[where])
            out[where] = got.value
            versions[i] = got.version
        else:
            out[where] = p[row[where]]

    await asyncio.gather(
        *(
            fetch(i, p, where)
            for i, p in enumerate(parts)
            if (where := np.flatnonzero(part == i)).size
        )
    )
    return LookupResult(out.reshape(a.shape + row_shape), tuple(versions))


async def embedding_lookup(
    params: Params, ids: Any, partition_strategy: str = "mod"
) -> npt.NDArray[Any]:
    """TF's ``embedding_lookup``: the rows of ``params`` named by ``ids``, shape
    ``ids.shape + row shape``, in the order of ``ids`` (repeats allowed).

    ``params`` is a :class:`~qps.variables.Variable`, a :class:`PartitionedVariable`
    (axis 0), a NumPy array, or a list of those (the partitions). With several
    partitions, ``partition_strategy`` maps ids to them: ``"mod"`` (TF's default) or
    ``"div"`` (the layout partitioners store: with ``"div"`` id ``i`` is row ``i`` of
    the concatenated parts; with ``"mod"`` it is not). See :func:`lookup_plan`. Rows are
    read from Redis with :meth:`Variable.read_rows`, one partition's rows at a time,
    partitions concurrently; use :meth:`PartitionedVariable.read_rows` for the versions.

    Raises:
        InvalidArgumentError: as :func:`lookup_plan`, or partitions whose rows differ in
            shape or dtype.
        NotFoundError: a partition variable was deleted.
    """
    if isinstance(params, PartitionedVariable):
        await params.create()  # every part, not only those the ids touch
    return (await _lookup(_params_list(params), ids, partition_strategy)).values

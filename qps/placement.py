"""Placing variables over PS shards, partitioned variables, and ``embedding_lookup``.

* **Placement** maps variable names to shard indices ``0..num_shards-1``:
  :func:`round_robin` (TF ``replica_device_setter``'s default, by creation order) and
  :func:`greedy_by_bytes` (a function of the *set* of ``(name, nbytes)`` only, unlike
  TF's ``GreedyLoadBalancingStrategy``, which :func:`tf_greedy_load_balancing` keeps for
  comparison). A :class:`PartitionedVariable` is placed part by part, as TF does.
* **Partitioners** (TF's, with TF's arithmetic): :func:`fixed_size_partitioner`,
  :func:`min_max_variable_partitioner`, :func:`variable_axis_size_partitioner`. Each is
  a callable ``(shape, dtype) -> partitions per dimension``.
* :class:`PartitionedVariable` stores contiguous slices (TF's layout: the first
  ``dim % k`` parts get one more row) as variables ``<name>/part_<i>``.
* :func:`embedding_lookup` with ``partition_strategy="mod"`` (TF's default) or
  ``"div"``; :func:`lookup_plan` is its pure arithmetic.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qps import keys
from qps.errors import InvalidArgumentError, NotFoundError
from qps.transport import Client
from qps.variables import Variable, VariableValue, list_variables, open_variable
from qps.varspec import PartitionInfo, check_dtype, check_shape, format_shape

__all__ = [
    "LookupResult",
    "PartitionedValue",
    "PartitionedVariable",
    "Partitioner",
    "embedding_lookup",
    "fixed_size_partitioner",
    "greedy_by_bytes",
    "list_partitioned",
    "lookup_plan",
    "min_max_variable_partitioner",
    "open_partitioned_variable",
    "partition_offsets",
    "partition_sizes",
    "place",
    "round_robin",
    "tf_greedy_load_balancing",
    "variable_axis_size_partitioner",
]

Partitioner = Callable[[Sequence[int], Any], list[int]]
Placeable = Any  # a name, a Variable, a PartitionedVariable, or a (name, nbytes) pair


def _check_shards(num_shards: Any) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise InvalidArgumentError(f"num_shards must be an int >= 1, got {num_shards!r}")
    return num_shards


def _expand(items: Iterable[Placeable]) -> list[tuple[str, int | None]]:
    """``(name, nbytes or None)`` for each item, partitioned variables part by part."""
    out: list[tuple[str, int | None]] = []
    if isinstance(items, Mapping):
        items = list(items.items())
    for item in items:
        if isinstance(item, PartitionedVariable):
            out += [(p.name, p.nbytes) for p in item.parts]
        elif isinstance(item, Variable):
            out.append((item.name, item.nbytes))
        elif isinstance(item, str):
            out.append((item, None))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append((item[0], _nbytes(item[1], item[0])))
        else:
            raise InvalidArgumentError(
                f"cannot place {item!r}: give names, Variables, PartitionedVariables or "
                "(name, nbytes) pairs"
            )
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidArgumentError(f"variable '{dup}' is listed twice")
    return out


def _nbytes(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(f"nbytes of '{name}' must be an int >= 0, got {value!r}")
    return int(value)


def round_robin(
    variables: Iterable[Placeable], num_shards: int, *, pinned: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Shard ``i % num_shards`` for the ``i``-th variable in creation (list) order: TF's
    ``replica_device_setter`` default (v1, v2, v3, global_step on 2 PS -> 0, 1, 0, 1).

    A name in ``pinned`` keeps its shard but still takes its turn, as a variable with an
    explicit ``/job:ps/task:k`` does in TF (``merge_devices=True``).

    Raises:
        InvalidArgumentError: ``num_shards < 1``, a name listed twice, or a pinned shard
            out of range.
    """
    n = _check_shards(num_shards)
    pins = dict(pinned or {})
    for name, shard in pins.items():
        if not isinstance(shard, int) or not 0 <= shard < n:
            raise InvalidArgumentError(f"pinned shard of '{name}' must be in [0, {n})")
    return {name: pins.get(name, i % n) for i, (name, _) in enumerate(_expand(variables))}


def greedy_by_bytes(variables: Iterable[Placeable], num_shards: int) -> dict[str, int]:
    """Balance bytes over shards, independently of creation order: take the variables by
    size, largest first (ties by name), and give each to the least-loaded shard (ties to
    the lowest index). The result depends only on the set of ``(name, nbytes)``.

    Raises:
        InvalidArgumentError: ``num_shards < 1``, a name without a size, or listed twice.
    """
    n = _check_shards(num_shards)
    sized = []
    for name, nbytes in _expand(variables):
        if nbytes is None:
            raise InvalidArgumentError(f"greedy_by_bytes needs the size of '{name}'")
        sized.append((name, nbytes))
    load = [0] * n
    out: dict[str, int] = {}
    for name, nbytes in sorted(sized, key=lambda x: (-x[1], x[0])):
        shard = min(range(n), key=lambda s: (load[s], s))
        out[name] = shard
        load[shard] += nbytes
    return out


def tf_greedy_load_balancing(sizes: Sequence[int], num_shards: int) -> list[int]:
    """TF's ``GreedyLoadBalancingStrategy`` with ``byte_size_load_fn``, for comparison:
    in creation order, each variable goes to ``argmin(load)`` (lowest index on ties).
    Sizes [4000, 40, 40, 8000, 20] on 2 PS -> [0, 1, 1, 1, 0]; it depends on the order.

    Raises:
        InvalidArgumentError: ``num_shards < 1`` or a negative size.
    """
    n = _check_shards(num_shards)
    load = [0] * n
    out = []
    for i, size in enumerate(sizes):
        shard = min(range(n), key=lambda s: (load[s], s))
        out.append(shard)
        load[shard] += _nbytes(size, f"#{i}")
    return out


def place(
    variables: Iterable[Placeable], num_shards: int, strategy: str = "round_robin"
) -> dict[str, int]:
    """``round_robin`` or ``greedy_by_bytes`` by name.

    Raises:
        InvalidArgumentError: an unknown strategy, or as the strategy does.
    """
    if strategy == "round_robin":
        return round_robin(variables, num_shards)
    if strategy == "greedy_by_bytes":
        return greedy_by_bytes(variables, num_shards)
    raise InvalidArgumentError(
        f"unknown placement strategy {strategy!r}: use 'round_robin' or 'greedy_by_bytes'"
    )


# -- partitioners -------------------------------------------------------------------------------


def _axis_of(shape: Sequence[int], axis: int) -> tuple[tuple[int, ...], int]:
    shp = check_shape(shape)
    if not 0 <= axis < len(shp):
        raise InvalidArgumentError(f"axis {axis} is out of range for shape {format_shape(shp)}")
    return shp, axis


def _element_bytes(dtype: Any, bytes_per_string_element: int) -> int:
    dt = check_dtype(dtype)
    return bytes_per_string_element if dt.kind == "S" else dt.itemsize


def fixed_size_partitioner(num_shards: int, axis: int = 0) -> Partitioner:
    """TF's ``fixed_size_partitioner``: ``min(num_shards, shape[axis])`` partitions.
    [10, 4] with 3 -> [3, 1] (parts of 4, 3, 3 rows); [2, 4] with 3 -> [2, 1].

    Raises:
        InvalidArgumentError: ``num_shards < 1`` (when built); a bad axis (when called).
    """
    _check_shards(num_shards)

    def _partitioner(shape: Sequence[int], dtype: Any = None) -> list[int]:
        shp, ax = _axis_of(shape, axis)
        parts = [1] * len(shp)
        parts[ax] = max(1, min(num_shards, shp[ax]))
        return parts

    return _partitioner


def min_max_variable_partitioner(
    max_partitions: int = 1,
    axis: int = 0,
    min_slice_size: int = 256 << 10,
    bytes_per_string_element: int = 16,
) -> Partitioner:
    """TF's ``min_max_variable_partitioner``: as many partitions as keep every slice at
    least ``min_slice_size`` bytes, at most ``max_partitions``:
    ``max(1, min(shape[axis], max_partitions, ceil(total_bytes / min_slice_size)))``
    (TF's float arithmetic). [1000, 4] float32 with 1 KiB slices and max 3 -> 3 parts of
    334, 333, 333 rows.

    Raises:
        InvalidArgumentError: ``max_partitions < 1`` or ``min_slice_size < 1`` (when
            built); a bad axis or dtype (when called).
    """
    _check_shards(max_partitions)
    if min_slice_size < 1 or bytes_per_string_element < 1:
        raise InvalidArgumentError("min_slice_size and bytes_per_string_element must be >= 1")

    def _partitioner(shape: Sequence[int], dtype: Any) -> list[int]:
        shp, ax = _axis_of(shape, axis)
        total = math.prod(shp) * _element_bytes(dtype, bytes_per_string_element)
        parts = [1] * len(shp)
        parts[ax] = max(1, min(shp[ax], max_partitions, math.ceil(total / min_slice_size)))
        return parts

    return _partitioner


def variable_axis_size_partitioner(
    max_shard_bytes: int,
    axis: int = 0,
    bytes_per_string_element: int = 16,
    max_shards: int | None = None,
) -> Partitioner:
    """TF's ``variable_axis_size_partitioner``: shards of at most ``max_shard_bytes``
    (at least one slice each): ``ceil(shape[axis] / max(1, floor(max_shard_bytes /
    bytes_per_slice)))``, capped at ``max_shards``. 4000 B on [1000, 4] f32 -> 4 x 250.

    Raises:
        InvalidArgumentError: non-positive byte sizes or ``max_shards < 1`` (when
            built); a bad axis or dtype (when called).
    """
    if max_shard_bytes < 1 or bytes_per_string_element < 1:
        raise InvalidArgumentError("max_shard_bytes and bytes_per_string_element must be >= 1")
    if max_shards is not None and max_shards < 1:
        raise InvalidArgumentError(f"max_shards must be >= 1, got {max_shards}")

    def _partitioner(shape: Sequence[int], dtype: Any) -> list[int]:
        shp, ax = _axis_of(shape, axis)
        parts = [1] * len(shp)
        if shp[ax] == 0:
            return parts
        slice_bytes = (
            1.0 * (math.prod(shp) / shp[ax]) * _element_bytes(dtype, bytes_per_string_element)
        )
        per_shard = max(1, math.floor(max_shard_bytes / slice_bytes)) if slice_bytes else shp[ax]
        k = math.ceil(1.0 * shp[ax] / per_shard)
        parts[ax] = max(1, min(max_shards, k) if max_shards else k)
        return parts

    return _partitioner


def partition_sizes(dim: int, k: int) -> list[int]:
    """Sizes of ``k`` contiguous parts of ``dim`` rows: the first ``dim % k`` get
    ``ceil(dim / k)``, the rest ``floor(dim / k)`` (TF's layout)."""
    q, r = divmod(dim, k)
    return [q + 1] * r + [q] * (k - r)


def partition_offsets(dim: int, k: int) -> list[int]:
    """First row of each of the ``k`` parts of :func:`partition_sizes`."""
    sizes = partition_sizes(dim, k)
    return [sum(sizes[:i]) for i in range(k)]


# -- partitioned variables ------------------------------------------------------------------------


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

"""TF's variable partitioners, with TF's arithmetic: :func:`fixed_size_partitioner`,
:func:`min_max_variable_partitioner`, :func:`variable_axis_size_partitioner`. Each is a
callable ``(shape, dtype) -> partitions per dimension``; :func:`partition_sizes` is the
layout of the parts (TF's: the first ``dim % k`` parts get one more row).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from qps.errors import InvalidArgumentError
from qps.varspec import check_dtype, check_shape, format_shape

Partitioner = Callable[[Sequence[int], Any], list[int]]


def _check_shards(num_shards: Any) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise InvalidArgumentError(f"num_shards must be an int >= 1, got {num_shards!r}")
    return num_shards


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

"""Placing variables over PS shards, partitioned variables, and ``embedding_lookup``.

* **Placement** maps variable names to shard indices ``0..num_shards-1``:
  :func:`round_robin` (TF ``replica_device_setter``'s default, by creation order) and
  :func:`greedy_by_bytes` (a function of the *set* of ``(name, nbytes)`` only, unlike
  TF's ``GreedyLoadBalancingStrategy``, which :func:`tf_greedy_load_balancing` keeps for
  comparison). A :class:`PartitionedVariable` is placed part by part, as TF does.
* **Partitioners** (TF's, with TF's arithmetic): :func:`fixed_size_partitioner`,
  :func:`min_max_variable_partitioner`, :func:`variable_axis_size_partitioner`
  (:mod:`qps.partitioners`). Each is a callable ``(shape, dtype) -> partitions per
  dimension``.
* :class:`PartitionedVariable` stores contiguous slices (TF's layout: the first
  ``dim % k`` parts get one more row) as variables ``<name>/part_<i>``;
  :func:`embedding_lookup` with ``partition_strategy="mod"`` (TF's default) or
  ``"div"``; :func:`lookup_plan` is its pure arithmetic (:mod:`qps.partitioned`).

This module places; it re-exports the other two's public names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from qps.errors import InvalidArgumentError
from qps.partitioned import (
    LookupResult,
    PartitionedValue,
    PartitionedVariable,
    embedding_lookup,
    list_partitioned,
    lookup_plan,
    open_partitioned_variable,
)
from qps.partitioners import (
    Partitioner,
    _check_shards,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    partition_offsets,
    partition_sizes,
    variable_axis_size_partitioner,
)
from qps.variables import Variable

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

Placeable = Any  # a name, a Variable, a PartitionedVariable, or a (name, nbytes) pair


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

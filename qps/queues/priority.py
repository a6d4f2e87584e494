"""PriorityQueue: elements leave in ascending order of an int64 priority."""

from __future__ import annotations

from typing import Any

import numpy as np

from qps.queues.base import QueueBase
from qps.queues.inspect import PRIORITY_KEY_BYTES
from qps.queues.spec import (
    QueueSpec,
    check_capacity,
    normalize_dtypes,
    normalize_names,
    normalize_shapes,
)
from qps.transport import Client

#: the sequence part of a key before the queue stamps it (qps/lua/queue_common.lua)
_UNSTAMPED = b"-" * 16
#: the sequence part of an element given back: first among its equal priorities
_FRONT = b"0" * 16
_SIGN = np.uint64(1 << 63)


def priority_keys(priorities: np.ndarray, seq: bytes = _UNSTAMPED) -> list[bytes]:
    """Sort keys whose byte order is the numeric order of int64 ``priorities``: the
    value with its sign bit flipped, big-endian, then the 16-byte sequence part."""
    flipped = (np.asarray(priorities, dtype=np.int64).view(np.uint64) ^ _SIGN).astype(">u8")
    raw = flipped.tobytes()
    return [raw[i : i + 8] + seq for i in range(0, len(raw), 8)]


class PriorityQueue(QueueBase):
    """A queue that dequeues the element with the smallest priority first (TF:
    ``tf.queue.PriorityQueue``).

    Every element carries an extra leading component, its priority: an int64 scalar
    for ``enqueue`` (a vector for ``enqueue_many``), returned by the dequeues as
    component 0. Negative priorities are allowed. Elements with equal priorities leave
    in the order they were inserted (TensorFlow leaves that order unspecified).

    Args:
        capacity, names, shared_name, name, container, client: as :class:`FIFOQueue`;
            ``names``, when given, names every component including the priority.
        types: the dtypes of the components after the priority.
        shapes: required; fully defined shapes of those components.

    Raises:
        TypeError: ``shapes`` is None.
        InvalidArgumentError: a shape is not fully defined, or
            bad dtypes/names. Enqueueing a priority that is not int64 (a NumPy int32
            array, say) raises it too; Python ints are accepted.
    """

    KIND = "priority"

    def __init__(
        self,
        capacity: int,
        types: Any,
        shapes: Any,
        names: Any = None,
        shared_name: str | None = None,
        name: str = "priority_queue",
        *,
        container: str | None = None,
        client: Client | None = None,
    ) -> None:
        if shapes is None:
            # TF: "Expected list for 'shapes'"
            raise TypeError("PriorityQueue needs shapes: one fully defined shape per type")
        dts = normalize_dtypes(types)
        user_shapes = normalize_shapes(shapes, len(dts), allow_unknown_dims=False)
        assert user_shapes is not None
        all_dtypes = (np.dtype(np.int64), *dts)
        spec = QueueSpec(
            kind=self.KIND,
            dtypes=all_dtypes,
            shapes=((), *user_shapes),
            names=normalize_names(names, len(all_dtypes)),
            capacity=check_capacity(capacity),
        )
        super().__init__(
            spec, shared_name=shared_name, name=name, container=container, client=client
        )

    def _order_keys(self, arrays: list[np.ndarray], batch: int | None) -> list[bytes]:
        return priority_keys(arrays[0].reshape(-1))

    def _strip_keys(self, blobs: list[bytes]) -> list[bytes]:
        return [b[PRIORITY_KEY_BYTES:] for b in blobs]

    def _give_back_keys(self, elements: list[list[np.ndarray]]) -> list[bytes]:
        prios = np.array([e[0] for e in elements], dtype=np.int64)
        return priority_keys(prios, _FRONT)

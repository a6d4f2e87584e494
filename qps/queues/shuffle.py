"""RandomShuffleQueue: elements leave in random order."""

from __future__ import annotations

from typing import Any

from qps.errors import InvalidArgumentError
from qps.queues.base import QueueBase
from qps.queues.spec import (
    QueueSpec,
    check_capacity,
    normalize_dtypes,
    normalize_names,
    normalize_shapes,
)
from qps.transport import Client


class RandomShuffleQueue(QueueBase):
    """A queue that dequeues a uniformly random stored element (TF:
    ``tf.queue.RandomShuffleQueue``).

    While the queue is open a dequeue may only take an element when more than
    ``min_after_dequeue`` are stored, which keeps the mix good; closing lifts that
    limit so the queue drains. Each removal costs O(1) in Redis.

    With ``seed`` the random choices come from a generator stored with the queue and
    seeded from it, so the same sequence of operations gives the same dequeue order in
    every run and from every process. Without one the generator is seeded at random.

    Args:
        capacity, dtypes, shapes, names, shared_name, name, container, client: as
            :class:`FIFOQueue`.
        min_after_dequeue: elements kept back while the queue is open; must be
            below ``capacity``.
        seed: an int for a reproducible order.

    Raises:
        InvalidArgumentError: ``min_after_dequeue >= capacity``, or bad dtypes/shapes/names.
    """

    KIND = "shuffle"

    def __init__(
        self,
        capacity: int,
        min_after_dequeue: int,
        dtypes: Any,
        shapes: Any = None,
        names: Any = None,
        seed: int | None = None,
        shared_name: str | None = None,
        name: str = "random_shuffle_queue",
        *,
        container: str | None = None,
        client: Client | None = None,
    ) -> None:
        dts = normalize_dtypes(dtypes)
        capacity = check_capacity(capacity)
        min_after_dequeue = int(min_after_dequeue)
        if min_after_dequeue < 0:
            raise InvalidArgumentError(f"min_after_dequeue {min_after_dequeue} must be >= 0")
        if capacity >= 0 and min_after_dequeue >= capacity:
            raise InvalidArgumentError(
                f"min_after_dequeue {min_after_dequeue} must be < capacity {capacity}"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidArgumentError(f"seed must be an int or None, got {seed!r}")
        spec = QueueSpec(
            kind=self.KIND,
            dtypes=dts,
            shapes=normalize_shapes(shapes, len(dts), allow_unknown_dims=False),
            names=normalize_names(names, len(dts)),
            capacity=capacity,
            min_after_dequeue=min_after_dequeue,
            seed=seed,
        )
        super().__init__(
            spec, shared_name=shared_name, name=name, container=container, client=client
        )

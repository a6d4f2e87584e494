"""FIFOQueue: elements leave in the order they arrived."""

from __future__ import annotations

from typing import Any

from qps.queues.base import QueueBase
from qps.queues.spec import (
    QueueSpec,
    check_capacity,
    normalize_dtypes,
    normalize_names,
    normalize_shapes,
)
from qps.transport import Client


class FIFOQueue(QueueBase):
    """A first-in first-out queue shared through Redis (TF: ``tf.queue.FIFOQueue``).

    Args:
        capacity: the most elements it stores; negative means unbounded.
        dtypes: one dtype per component (a single dtype means one component);
            :data:`qps.string` (or ``str``, ``bytes``, ``"string"``) for strings.
        shapes: optional fully defined shape per component; needed by
            ``dequeue_many``/``dequeue_up_to``.
        names: optional component names; enqueue then takes, and dequeue returns, dicts.
        shared_name: every process that opens this name in the same container gets
            the same queue; without it the queue is private to this object.
        name: a label for the generated private name.
        container: the resource container (default ``"default"``).
        client: a :class:`qps.Client`; defaults to the process-wide one.

    Raises:
        InvalidArgumentError: bad dtypes, shapes (a ``None`` dimension) or names.
    """

    KIND = "fifo"

    def __init__(
        self,
        capacity: int,
        dtypes: Any,
        shapes: Any = None,
        names: Any = None,
        shared_name: str | None = None,
        name: str = "fifo_queue",
        *,
        container: str | None = None,
        client: Client | None = None,
    ) -> None:
        dts = normalize_dtypes(dtypes)
        spec = QueueSpec(
            kind=self.KIND,
            dtypes=dts,
            shapes=normalize_shapes(shapes, len(dts), allow_unknown_dims=False),
            names=normalize_names(names, len(dts)),
            capacity=check_capacity(capacity),
        )
        super().__init__(
            spec, shared_name=shared_name, name=name, container=container, client=client
        )

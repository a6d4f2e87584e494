"""PaddingFIFOQueue: a FIFO queue whose batches are zero-padded to a common shape."""

from __future__ import annotations

from typing import Any

import numpy as np

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


class PaddingFIFOQueue(QueueBase):
    """A FIFO queue for components with ``None`` (variable) dimensions (TF:
    ``tf.queue.PaddingFIFOQueue``).

    Each component has a fixed rank; a ``None`` dimension accepts any size. A single
    ``dequeue`` returns the element as it was enqueued; ``dequeue_many`` and
    ``dequeue_up_to`` pad every ``None`` dimension at its end, with zeros (``False``
    for bool, ``b""`` for strings), to the largest size in that batch.

    Args:
        capacity, dtypes, names, shared_name, name, container, client: as :class:`FIFOQueue`.
        shapes: required; one shape per component, ``None`` for a variable dimension.

    Raises:
        InvalidArgumentError: ``shapes`` is None or a shape has no known rank.
    """

    KIND = "padding"

    def __init__(
        self,
        capacity: int,
        dtypes: Any,
        shapes: Any,
        names: Any = None,
        shared_name: str | None = None,
        name: str = "padding_fifo_queue",
        *,
        container: str | None = None,
        client: Client | None = None,
    ) -> None:
        dts = normalize_dtypes(dtypes)
        if shapes is None:
            raise InvalidArgumentError(
                "When providing partial shapes, a list of shapes must be provided."
            )
        spec = QueueSpec(
            kind=self.KIND,
            dtypes=dts,
            shapes=normalize_shapes(shapes, len(dts), allow_unknown_dims=True),
            names=normalize_names(names, len(dts)),
            capacity=check_capacity(capacity),
        )
        super().__init__(
            spec, shared_name=shared_name, name=name, container=container, client=client
        )

    def _batch(self, elements: list[list[np.ndarray]]) -> list[np.ndarray]:
        assert self._spec.shapes is not None
        out = []
        for j, (shape, dt) in enumerate(zip(self._spec.shapes, self._spec.dtypes)):
            parts = [e[j] for e in elements]
            dims = [
                d if d is not None else max((p.shape[i] for p in parts), default=0)
                for i, d in enumerate(shape)
            ]
            if dt.kind == "S":  # strings: as wide as the widest, padded with b""
                dt = np.dtype(f"S{max((p.itemsize for p in parts), default=1)}")
            batch = np.zeros((len(parts), *dims), dtype=dt)
            for k, p in enumerate(parts):
                region: tuple[int | slice, ...] = (k, *[slice(0, s) for s in p.shape])
                batch[region] = p
            out.append(batch)
        return out

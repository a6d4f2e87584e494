"""Elements as callers give and get them: values checked against a queue's spec and
turned into arrays, stored values decoded back, arrays formatted and stacked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qps import wire
from qps.errors import InvalidArgumentError
from qps.queues.convert import to_component
from qps.queues.decode import Quick, check_element
from qps.queues.large import encode_batch
from qps.queues.spec import QueueSpec, format_shape

Element = Any  # an array, a list of arrays, or a dict of arrays


class Elements:
    """The element codec of :class:`~qps.queues.base.QueueBase` (a mixin)."""

    _spec: QueueSpec
    _fixed: bool  # one fixed element length: the batch fast paths apply
    _quick: Quick | None  # one-element codec for elements all alike

    def _components(self, vals: Any) -> list[Any]:
        names = self._spec.names
        if names is not None:
            if not isinstance(vals, Mapping):
                raise InvalidArgumentError("You must enqueue a dictionary in a Queue with names")
            if set(vals) != set(names):
                raise InvalidArgumentError(
                    f"Keys in dictionary to enqueue do not match names of Queue. "
                    f"Dictionary: {sorted(vals)}, Queue: {sorted(names)}"
                )
            return [vals[n] for n in names]
        if isinstance(vals, Mapping):
            raise InvalidArgumentError("Queue must have names to enqueue a dictionary")
        if not isinstance(vals, (list, tuple)):
            vals = [vals]
        if len(vals) != len(self._spec.dtypes):
            # TF silently drops extra components (issue #13580); qps refuses both ways.
            raise InvalidArgumentError(
                f"Signature mismatch: the queue has {len(self._spec.dtypes)} components, "
                f"got {len(vals)} values"
            )
        return list(vals)

    def _check_shape(self, arr: np.ndarray, index: int, batch: int | None) -> None:
        shapes = self._spec.shapes
        if shapes is None:
            return
        want = shapes[index]
        got = arr.shape if batch is None else arr.shape[1:]
        ok = len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got))
        if not ok:
            full = want if batch is None else (None if batch < 0 else batch, *want)
            raise InvalidArgumentError(
                f"Shape mismatch in tuple component {index}. Expected {format_shape(full)}, "
                f"got {format_shape(arr.shape)}"
            )

    def _prepare_one(self, vals: Any) -> list[np.ndarray]:
        comps = self._components(vals)
        arrays = []
        for i, (v, dt) in enumerate(zip(comps, self._spec.dtypes)):
            arr = to_component(v, dt, i)
            self._check_shape(arr, i, None)
            arrays.append(arr)
        return arrays

    def _prepare_many(self, vals: Any) -> tuple[list[np.ndarray], int]:
        comps = self._components(vals)
        arrays = []
        batch = -1
        for i, (v, dt) in enumerate(zip(comps, self._spec.dtypes)):
            arr = to_component(v, dt, i)
            if arr.ndim == 0:
                raise InvalidArgumentError(
                    f"enqueue_many needs a batch dimension; component {i} is a scalar"
                )
            if batch < 0:
                batch = arr.shape[0]
            elif arr.shape[0] != batch:
                raise InvalidArgumentError(
                    "All input tensors must have the same size in the 0th dimension. "
                    f"Component {i} has {arr.shape[0]}, and should have {batch}"
                )
            self._check_shape(arr, i, batch)
            arrays.append(arr)
        return arrays, batch

    def _encode_rows(self, arrays: list[np.ndarray], batch: int) -> Any:
        shapes = self._spec.shapes if self._fixed else None
        return encode_batch(arrays, batch, self._spec.dtypes, shapes)

    # -- output -------------------------------------------------------------------
    def _format(self, arrays: list[np.ndarray]) -> Element:
        names = self._spec.names
        if names is not None:
            return dict(zip(names, arrays))
        if len(arrays) == 1:
            return arrays[0]
        return arrays

    def _decode_one(self, blob: bytes) -> list[np.ndarray]:
        quick = self._quick
        if (
            quick is not None
            and type(blob) is bytes
            and len(blob) == quick.total
            and blob.startswith(quick.header)
        ):  # exactly the bytes wire.encode gives for an element of the spec
            flat = np.frombuffer(blob, quick.dtype, offset=len(quick.header))
            return [flat.reshape(quick.shape)]
        arrays = wire.decode(blob).arrays
        check_element(self._spec, arrays)
        return arrays

    def _batch(self, elements: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Stack decoded elements into batch arrays (PaddingFIFOQueue overrides).

        String components of different widths stack into the widest (``np.stack``
        promotes ``S<n>``); an empty batch of strings is ``S1``."""
        ncomp = len(self._spec.dtypes)
        if not elements:
            assert self._spec.shapes is not None
            return [
                np.empty((0, *(int(d) for d in s if d is not None)), dtype=dt)
                for s, dt in zip(self._spec.shapes, self._spec.dtypes)
            ]
        return [np.stack([e[j] for e in elements]) for j in range(ncomp)]

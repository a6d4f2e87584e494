"""Where a batcher's examples come from (see :mod:`workers.input`): a queue, an async
iterable, a callable or an iterable, taken from by several tasks at once; and
:func:`slice_input_producer`, the rows of arrays as a source."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any

import numpy as np

from qps.errors import InvalidArgumentError, OutOfRangeError
from qps.queues import QueueBase
from qps.queues.spec import STRING

__all__ = ["SharedSource", "Source", "components", "dtype_of", "slice_input_producer"]


Source = Any  # a QueueBase, an async iterable, a callable or an iterable of examples


class SharedSource:
    """One source of examples, shared by the tasks of a runner: :meth:`next` returns the
    next example and raises OutOfRangeError once the source is exhausted."""

    def __init__(self, src: Source) -> None:
        self.queue: QueueBase | None = None
        self._call: Callable[[], Any] | None = None
        self._ait: AsyncIterator[Any] | None = None
        self._it: Iterator[Any] | None = None
        self._lock = asyncio.Lock()
        self._done = False
        if isinstance(src, QueueBase):
            self.queue = src
            self._call = src.dequeue
        elif isinstance(src, AsyncIterable):
            self._ait = src.__aiter__()
        elif callable(src):
            self._call = src
        elif isinstance(src, Iterable) and not isinstance(src, (str, bytes, Mapping)):
            self._it = iter(src)
        else:
            raise TypeError(
                "a source must be a queue, an async iterable, a callable or an iterable of "
                f"examples, got {type(src).__name__}"
            )

    def _exhausted(self) -> OutOfRangeError:
        self._done = True
        return OutOfRangeError("the input source is exhausted")

    async def next(self) -> Any:
        if self._done:
            raise OutOfRangeError("the input source is exhausted")
        if self._call is not None:
            value = self._call()
            if inspect.isawaitable(value):
                value = await value
            return value
        if self._ait is not None:
            async with self._lock:
                if self._done:
                    raise OutOfRangeError("the input source is exhausted")
                try:
                    return await self._ait.__anext__()
                except StopAsyncIteration:
                    raise self._exhausted() from None
        assert self._it is not None
        try:
            return next(self._it)
        except StopIteration:
            raise self._exhausted() from None


def components(example: Any) -> tuple[list[Any], list[str] | None]:
    if isinstance(example, Mapping):
        names = [str(k) for k in example]
        return [example[k] for k in example], names
    if isinstance(example, (list, tuple)):
        return list(example), None
    return [example], None


def dtype_of(value: Any) -> np.dtype[Any]:
    arr = np.asarray(value)
    if arr.dtype.kind in "SU":
        return STRING
    if arr.dtype.kind == "O" and arr.size and isinstance(arr.flat[0], (str, bytes)):
        return STRING
    return arr.dtype


def slice_input_producer(
    tensor_list: Sequence[Any],
    num_epochs: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
) -> AsyncIterator[list[np.ndarray]]:
    """A source of examples: the rows of equally long arrays, as ``[a[i], b[i], ...]``,
    for ``num_epochs`` epochs (None: forever), each epoch in a fresh random order when
    ``shuffle`` (TF: ``tf.train.slice_input_producer``, which adds a queue of its own;
    here give the result to :func:`batch` or :func:`shuffle_batch`).

    Raises:
        InvalidArgumentError: ``num_epochs <= 0`` ("num_epochs must be > 0 not 0."), no
            arrays, or arrays of different lengths.
    """
    if num_epochs is not None and num_epochs <= 0:
        raise InvalidArgumentError(f"num_epochs must be > 0 not {num_epochs}.")
    arrays = [np.asarray(a) for a in tensor_list]
    if not arrays:
        raise InvalidArgumentError("Expected at least one tensor in slice_input_producer().")
    n = arrays[0].shape[0] if arrays[0].ndim else 0
    if any(a.ndim == 0 or a.shape[0] != n for a in arrays):
        raise InvalidArgumentError("the tensors of slice_input_producer need the same dim 0")
    return _slices(arrays, num_epochs, shuffle, seed)


async def _slices(
    arrays: list[np.ndarray], num_epochs: int | None, shuffle: bool, seed: int | None
) -> AsyncIterator[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    n = arrays[0].shape[0]
    epoch = 0
    while num_epochs is None or epoch < num_epochs:
        order = rng.permutation(n) if shuffle else np.arange(n)
        for i in order:
            yield [a[i] for a in arrays]
        epoch += 1
        await asyncio.sleep(0)

"""Input pipelines on qps queues: TF 1.x's ``Coordinator``, ``QueueRunner``,
``batch``, ``shuffle_batch``, ``batch_join`` and ``shuffle_batch_join`` for asyncio.

TF runs an enqueue op in a loop on threads; here a runner is a set of asyncio tasks,
each awaiting an *enqueue op* (a zero-argument coroutine function) in a loop. TF's
``tensors`` argument is a graph node evaluated once per enqueue; here it is a
**source**, something that produces one example (or one chunk of examples with
``enqueue_many=True``) each time it is asked:

* a :class:`qps.queues.QueueBase` (its ``dequeue`` is the source, as when TF batches the
  output of an upstream queue), its spec gives dtypes, shapes and names;
* an async iterable (an async generator, say), shared by all tasks of a runner under a
  lock: each example is taken once;
* a zero-argument callable returning an example or an awaitable of one;
* a plain iterable of examples (a list, a generator, a NumPy array's rows).

The end of a source (``StopIteration``, ``StopAsyncIteration``, or an
:class:`~qps.errors.OutOfRangeError` raised by the callable) is TF's end of input: the
task stops, and the last task of the runner closes the queue, so consumers get the
stored batches and then ``OutOfRangeError`` (docs/input.md).

An example is what the queue's ``enqueue`` takes: one array, a list or tuple of
components, or a dict (then the queue has ``names``). Dtypes and shapes not given are
read from the first example. The consumer awaits :meth:`Batcher.get` (or iterates the
batcher with ``async for``) for one batch, as TF's ``sess.run(batch)``::

    coord = Coordinator()
    batches = shuffle_batch(examples(), 32, capacity=1000, min_after_dequeue=500, seed=1)
    tasks = batches.start(coord)
    try:
        async for x, y in batches:
            ...
    finally:
        coord.request_stop()
        await coord.join(tasks)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import (
    AsyncIterator,
    Iterable,
    Sequence,
)
from typing import Any

import numpy as np

from qps.aio import wait_event
from qps.errors import DeadlineExceededError, InvalidArgumentError, OutOfRangeError
from qps.queues import FIFOQueue, PaddingFIFOQueue, QueueBase, RandomShuffleQueue
from qps.transport import Client
from workers.runners import Coordinator, EnqueueOp, QueueRunner
from workers.sources import SharedSource, Source, components, dtype_of, slice_input_producer

__all__ = [
    "Batcher",
    "Coordinator",
    "EnqueueOp",
    "QueueRunner",
    "batch",
    "batch_join",
    "shuffle_batch",
    "shuffle_batch_join",
    "slice_input_producer",
    "start_queue_runners",
]

log = logging.getLogger("qps.input")


def start_queue_runners(
    coord: Coordinator | None, runners: Iterable[QueueRunner | Batcher]
) -> list[asyncio.Task[None]]:
    """Start every runner (a :class:`QueueRunner`, or a :class:`Batcher`'s) with
    ``coord``; return all their tasks (TF: ``tf.train.start_queue_runners``)."""
    tasks: list[asyncio.Task[None]] = []
    for r in runners:
        runner = r.queue_runner if isinstance(r, Batcher) else r
        tasks.extend(runner.start(coord))
    return tasks


# -- batching -------------------------------------------------------------------------------------


class Batcher:
    """The output of :func:`batch` and friends: a queue of examples, the
    :class:`QueueRunner` that fills it from the sources, and the dequeue that makes
    batches.

    ``await get()`` returns one batch: ``dequeue_many(batch_size)``, or
    ``dequeue_up_to(batch_size)`` with ``allow_smaller_final_batch`` (the final batch
    may then be short). The batch has the queue's output format: one array for one
    component, a list of arrays for several, a dict with names. ``async for b in
    batcher`` yields batches until the end of input.

    The queue is created when the dtypes and shapes are known: at once when they were
    given (or the source is a queue), else from the first example.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        batch_size: int,
        *,
        kind: str,
        tasks_per_source: int,
        capacity: int,
        min_after_dequeue: int = 0,
        enqueue_many: bool = False,
        dtypes: Any = None,
        shapes: Any = None,
        names: Any = None,
        dynamic_pad: bool = False,
        allow_smaller_final_batch: bool = False,
        seed: int | None = None,
        shared_name: str | None = None,
        name: str = "batch",
        container: str | None = None,
        client: Client | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise InvalidArgumentError(f"batch_size must be an int, got {batch_size!r}")
        if batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
        if tasks_per_source < 1:
            raise InvalidArgumentError(f"num_threads must be >= 1, got {tasks_per_source}")
        if not sources:
            raise InvalidArgumentError("no sources to batch")
        self._batch_size = int(batch_size)
        self._kind = kind
        self._capacity = int(capacity)
        self._min_after_dequeue = int(min_after_dequeue)
        self._enqueue_many = enqueue_many
        self._dynamic_pad = dynamic_pad
        self._allow_smaller = allow_smaller_final_batch
        self._seed = seed
        self._shared_name = shared_name
        self._name = name
        self._container = container
        self._client = client
        self._dtypes = dtypes
        self._shapes = shapes
        self._names = names
        self._queue: QueueBase | None = None
        self._ready = asyncio.Event()
        self._sources = [SharedSource(s) for s in sources]
        upstream = self._sources[0].queue
        if upstream is not None and not enqueue_many:
            spec = upstream.spec
            if self._dtypes is None:
                self._dtypes = list(spec.dtypes)
                if self._names is None and spec.names is not None:
                    self._names = list(spec.names)
            if self._shapes is None and spec.shapes is not None:
                self._shapes = [list(s) for s in spec.shapes]
        if self._dtypes is not None and (self._shapes is not None or dynamic_pad):
            self._make_queue(None)
        ops: list[EnqueueOp] = []
        for src in self._sources:
            ops.extend(self._enqueue_op(src) for _ in range(tasks_per_source))
        self._runner = QueueRunner(self._queue, ops, close_op=self._close, cancel_op=self._cancel)
        self._runner._set_label(shared_name or name)

    # -- the queue -------------------------------------------------------------------------
    def _make_queue(self, example: Any) -> QueueBase:
        if self._queue is not None:
            return self._queue
        dtypes, shapes, names = self._dtypes, self._shapes, self._names
        if example is not None:
            comps, found_names = components(example)
            if names is None:
                names = found_names
            if dtypes is None:
                dtypes = [dtype_of(c) for c in comps]
            if shapes is None:
                shapes = []
                for c in comps:
                    shape = list(np.shape(c))
                    if self._enqueue_many:
                        shape = shape[1:]
                    shapes.append([None] * len(shape) if self._dynamic_pad else shape)
        common: dict[str, Any] = {
            "names": names,
            "shared_name": self._shared_name,
            "name": self._name,
            "container": self._container,
            "client": self._client,
        }
        q: QueueBase
        if self._kind == "shuffle":
            q = RandomShuffleQueue(
                self._capacity, self._min_after_dequeue, dtypes, shapes, seed=self._seed, **common
            )
        elif self._dynamic_pad:
            if shapes is None:
                raise InvalidArgumentError("dynamic_pad needs shapes (a known rank per component)")
            q = PaddingFIFOQueue(self._capacity, dtypes, shapes, **common)
        else:
            q = FIFOQueue(self._capacity, dtypes, shapes, **common)
        self._queue = q
        self._ready.set()
        return q

    def _enqueue_op(self, src: SharedSource) -> EnqueueOp:
        async def op() -> None:
            example = await src.next()
            q = self._make_queue(example)
            if self._enqueue_many:
                await q.enqueue_many(example)
            else:
                await q.enqueue(example)

        return op

    async def _close(self) -> None:
        if self._queue is None:  # ended before its first example: nothing to close
            self._ready.set()
            return
        await self._queue.close()

    async def _cancel(self) -> None:
        if self._queue is None:  # ended before its first example: nothing to close
            self._ready.set()
            return
        await self._queue.close(cancel_pending_enqueues=True)

    # -- public ----------------------------------------------------------------------------
    @property
    def queue(self) -> QueueBase | None:
        """The batch queue; None until its spec is known (see the class doc)."""
        return self._queue

    @property
    def queue_runner(self) -> QueueRunner:
        return self._runner

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def capacity(self) -> int:
        return self._capacity

    def start(self, coord: Coordinator | None = None) -> list[asyncio.Task[None]]:
        """Start the runner's tasks (see :meth:`QueueRunner.start`)."""
        return self._runner.start(coord)

    async def _wait_queue(self, timeout: float | None) -> QueueBase:
        if self._queue is None and not await wait_event(self._ready, timeout):
            raise DeadlineExceededError(
                f"no example arrived to create the batch queue within {timeout} s"
            ) from None
        if self._queue is None:
            raise OutOfRangeError(
                f"'{self._shared_name or self._name}' is closed and has insufficient "
                f"elements (requested {self._batch_size}, current size 0)"
            )
        return self._queue

    async def get(self, *, timeout: float | None = None) -> Any:
        """One batch of ``batch_size`` examples (fewer for the final batch with
        ``allow_smaller_final_batch``).

        Raises:
            OutOfRangeError: the input has ended and no (full) batch is left.
            DeadlineExceededError: ``timeout`` seconds passed; nothing was taken.
            CancelledError: the queue's client was closed.
        """
        q = await self._wait_queue(timeout)
        if self._allow_smaller:
            return await q.dequeue_up_to(self._batch_size, timeout=timeout)
        return await q.dequeue_many(self._batch_size, timeout=timeout)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            try:
                b = await self.get()
            except OutOfRangeError:
                return
            yield b

    async def size(self) -> int:
        """Examples stored in the queue (0 before it exists)."""
        return 0 if self._queue is None else await self._queue.size()

    async def fraction_full(self) -> float:
        """TF's summary: ``size / capacity``; for a shuffle batch the fill above
        ``min_after_dequeue``: ``max(0, size - min) / (capacity - min)``."""
        size = await self.size()
        if self._capacity <= 0:
            return 0.0
        if self._kind == "shuffle":
            span = self._capacity - self._min_after_dequeue
            return max(0, size - self._min_after_dequeue) / span
        return size / self._capacity


def batch(
    tensors: Source,
    batch_size: int,
    num_threads: int = 1,
    capacity: int = 32,
    enqueue_many: bool = False,
    shapes: Any = None,
    dynamic_pad: bool = False,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str = "batch",
    *,
    dtypes: Any = None,
    names: Any = None,
    container: str | None = None,
    client: Client | None = None,
) -> Batcher:
    """Batch the examples of ``tensors`` in a FIFOQueue (a PaddingFIFOQueue with
    ``dynamic_pad``) of ``capacity``, filled by ``num_threads`` tasks (TF:
    ``tf.train.batch``). See the module doc for sources.

    Args:
        tensors: the source of examples (or of chunks, with ``enqueue_many``).
        batch_size: examples per batch.
        num_threads: tasks taking from the source and enqueuing.
        capacity: the queue's capacity.
        enqueue_many: each source item is a chunk of examples along dimension 0.
        shapes: one shape per component (of one example); default from the first one.
        dynamic_pad: pad variable dimensions (``None`` in ``shapes``) to the longest in
            each batch; inferred shapes then have every dimension variable.
        allow_smaller_final_batch: ``get`` uses ``dequeue_up_to``: the last batch may be
            short.
        shared_name: share the batch queue through Redis under this name.
        name: a label for a private queue's name.
        dtypes, names: the components' dtypes and names (default: from the first
            example, or from the source queue).
        container, client: where the queue lives (see :class:`qps.FIFOQueue`).
    """
    return Batcher(
        [tensors],
        batch_size,
        kind="fifo",
        tasks_per_source=num_threads,
        capacity=capacity,
        enqueue_many=enqueue_many,
        dtypes=dtypes,
        shapes=shapes,
        names=names,
        dynamic_pad=dynamic_pad,
        allow_smaller_final_batch=allow_smaller_final_batch,
        shared_name=shared_name,
        name=name,
        container=container,
        client=client,
    )


def _check_shuffle(capacity: int, min_after_dequeue: int) -> None:
    if capacity <= min_after_dequeue:
        raise InvalidArgumentError(
            f"capacity {capacity} must be bigger than min_after_dequeue {min_after_dequeue}."
        )


def shuffle_batch(
    tensors: Source,
    batch_size: int,
    capacity: int,
    min_after_dequeue: int,
    num_threads: int = 1,
    seed: int | None = None,
    enqueue_many: bool = False,
    shapes: Any = None,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str = "shuffle_batch",
    *,
    dtypes: Any = None,
    names: Any = None,
    container: str | None = None,
    client: Client | None = None,
) -> Batcher:
    """Batch the examples of ``tensors`` in random order through a RandomShuffleQueue
    that keeps ``min_after_dequeue`` examples back while the input lasts (TF:
    ``tf.train.shuffle_batch``). Arguments as :func:`batch`, plus ``seed``.

    Raises:
        InvalidArgumentError: ``capacity <= min_after_dequeue`` ("capacity 5 must be
            bigger than min_after_dequeue 5.", a ValueError as in TF).
    """
    _check_shuffle(capacity, min_after_dequeue)
    return Batcher(
        [tensors],
        batch_size,
        kind="shuffle",
        tasks_per_source=num_threads,
        capacity=capacity,
        min_after_dequeue=min_after_dequeue,
        enqueue_many=enqueue_many,
        dtypes=dtypes,
        shapes=shapes,
        names=names,
        allow_smaller_final_batch=allow_smaller_final_batch,
        seed=seed,
        shared_name=shared_name,
        name=name,
        container=container,
        client=client,
    )


def batch_join(
    tensors_list: Sequence[Source],
    batch_size: int,
    capacity: int = 32,
    enqueue_many: bool = False,
    shapes: Any = None,
    dynamic_pad: bool = False,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str = "batch_join",
    *,
    dtypes: Any = None,
    names: Any = None,
    container: str | None = None,
    client: Client | None = None,
) -> Batcher:
    """Batch the examples of several sources into one queue: one enqueue task per
    source (TF: ``tf.train.batch_join``). The batches mix the sources; each example
    comes out once. The queue closes when every source has ended. Arguments as
    :func:`batch`."""
    return Batcher(
        list(tensors_list),
        batch_size,
        kind="fifo",
        tasks_per_source=1,
        capacity=capacity,
        enqueue_many=enqueue_many,
        dtypes=dtypes,
        shapes=shapes,
        names=names,
        dynamic_pad=dynamic_pad,
        allow_smaller_final_batch=allow_smaller_final_batch,
        shared_name=shared_name,
        name=name,
        container=container,
        client=client,
    )


def shuffle_batch_join(
    tensors_list: Sequence[Source],
    batch_size: int,
    capacity: int,
    min_after_dequeue: int,
    seed: int | None = None,
    enqueue_many: bool = False,
    shapes: Any = None,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str = "shuffle_batch_join",
    *,
    dtypes: Any = None,
    names: Any = None,
    container: str | None = None,
    client: Client | None = None,
) -> Batcher:
    """:func:`batch_join` through a RandomShuffleQueue (TF:
    ``tf.train.shuffle_batch_join``).

    Raises:
        InvalidArgumentError: ``capacity <= min_after_dequeue``.
    """
    _check_shuffle(capacity, min_after_dequeue)
    return Batcher(
        list(tensors_list),
        batch_size,
        kind="shuffle",
        tasks_per_source=1,
        capacity=capacity,
        min_after_dequeue=min_after_dequeue,
        enqueue_many=enqueue_many,
        dtypes=dtypes,
        shapes=shapes,
        names=names,
        allow_smaller_final_batch=allow_smaller_final_batch,
        seed=seed,
        shared_name=shared_name,
        name=name,
        container=container,
        client=client,
    )

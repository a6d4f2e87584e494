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
import contextlib
import inspect
import logging
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any

import numpy as np

from qps.aio import wait_event
from qps.errors import DeadlineExceededError, InvalidArgumentError, OutOfRangeError
from qps.queues import FIFOQueue, PaddingFIFOQueue, QueueBase, RandomShuffleQueue
from qps.queues.spec import STRING
from qps.transport import Client

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

#: One enqueue op: a zero-argument coroutine function that a runner task awaits in a loop.
EnqueueOp = Callable[[], Awaitable[Any]]


# -- Coordinator ---------------------------------------------------------------------------


class Coordinator:
    """Stops a set of tasks together and reports the first error (TF:
    ``tf.train.Coordinator``), for tasks of one event loop.

    * :meth:`request_stop` asks every task to stop. The first exception passed to it is
      recorded, unless it is a *clean stop* type (``OutOfRangeError`` by default, as in
      TF: the end of the input is a normal stop). Exceptions passed once the stop was
      requested are ignored (logged), as in TF.
    * Tasks registered with the coordinator (:meth:`register_task`; the tasks of a
      :class:`QueueRunner` started with a coordinator, and those given to :meth:`join`)
      report an exception they end with as ``request_stop(exc)``: an error in any task
      stops them all.
    * :meth:`join` waits for the tasks and re-raises the recorded exception.

    Args:
        clean_stop_exception_types: exception types that stop without being an error
            (default ``(OutOfRangeError,)``).
    """

    def __init__(
        self, clean_stop_exception_types: Sequence[type[BaseException]] | None = None
    ) -> None:
        if clean_stop_exception_types is None:
            clean_stop_exception_types = (OutOfRangeError,)
        self._clean = tuple(clean_stop_exception_types)
        self._stop = asyncio.Event()
        self._exc: BaseException | None = None
        self._joined = False
        self._registered: set[asyncio.Task[Any]] = set()
        self._seen: set[asyncio.Task[Any]] = set()

    def _filter(self, ex: BaseException | None) -> BaseException | None:
        if ex is None or isinstance(ex, self._clean):
            return None
        return ex

    def _record(self, ex: BaseException | None) -> None:
        ex = self._filter(ex)
        if self._stop.is_set():
            if ex is not None and ex is not self._exc:
                log.info("Coordinator: exception after the stop was ignored: %r", ex)
            return
        if ex is not None and self._exc is None:
            log.info("Error reported to Coordinator: %r", ex)
            self._exc = ex
        self._stop.set()

    def request_stop(self, ex: BaseException | None = None) -> None:
        """Ask the tasks to stop, recording ``ex`` if it is the first error.

        Raises:
            ex itself, when the coordinator was already joined (TF: the error would
            otherwise go unreported).
        """
        if self._joined and self._filter(ex) is not None:
            assert ex is not None
            raise ex
        self._record(ex)

    def should_stop(self) -> bool:
        """Whether a stop was requested."""
        return self._stop.is_set()

    async def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Wait until a stop is requested or ``timeout`` seconds pass; return
        :meth:`should_stop`."""
        if self._stop.is_set():
            return True
        return await wait_event(self._stop, timeout)

    def clear_stop(self) -> None:
        """Forget the stop and the recorded exception (and the join), so the coordinator
        can be used again."""
        self._stop.clear()
        self._exc = None
        self._joined = False

    @property
    def joined(self) -> bool:
        """Whether :meth:`join` has finished."""
        return self._joined

    def raise_requested_exception(self) -> None:
        """Raise the recorded exception, if there is one."""
        if self._exc is not None:
            raise self._exc

    @contextlib.contextmanager
    def stop_on_exception(self) -> Iterator[None]:
        """``with coord.stop_on_exception(): ...``: an exception raised in the block is
        passed to :meth:`request_stop` and not propagated (TF). Task cancellation
        (``asyncio.CancelledError``) and ``KeyboardInterrupt`` propagate."""
        try:
            yield
        except Exception as exc:
            self.request_stop(exc)

    def register_task(self, task: asyncio.Task[Any]) -> None:
        """Have :meth:`join` wait for ``task``; an exception it ends with is reported
        as ``request_stop(exc)`` (TF: ``register_thread``)."""
        if task not in self._registered:
            self._registered.add(task)
            task.add_done_callback(self._task_done)

    register_thread = register_task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task in self._seen:
            return
        self._seen.add(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._record(exc)

    async def join(
        self,
        tasks: Iterable[asyncio.Task[Any]] | None = None,
        stop_grace_period_secs: float = 120.0,
        ignore_live_threads: bool = False,
    ) -> None:
        """Wait for the registered tasks and ``tasks``, then raise the recorded exception.

        It waits until every task is done or a stop is requested, then gives the tasks
        still running ``stop_grace_period_secs`` to finish. Tasks still running after
        that are cancelled (a thread cannot be, a task can) and awaited.

        Raises:
            the first exception passed to :meth:`request_stop` (or that a task ended
            with), if any.
            RuntimeError: no exception was recorded, but tasks were still running after
                the grace period ("Coordinator stopped with threads still running:
                <names>"), unless ``ignore_live_threads``.
        """
        given = list(tasks or [])
        for t in given:
            if t not in self._registered:
                t.add_done_callback(self._task_done)
        everything = set(self._registered) | set(given)
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                live = {t for t in everything if not t.done()}
                if not live:
                    break
                await asyncio.wait(live | {stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopper
        live = {t for t in everything if not t.done()}
        if live:
            await asyncio.wait(live, timeout=max(0.0, stop_grace_period_secs))
        stragglers = sorted(t.get_name() for t in everything if not t.done())
        for t in everything:
            if not t.done():
                t.cancel()
        if stragglers:
            await asyncio.gather(*everything, return_exceptions=True)
        for t in everything:
            self._task_done(t)
        self._joined = True
        self._registered = set()
        self._seen = set()
        if self._exc is not None:
            raise self._exc
        if stragglers:
            text = "Coordinator stopped with threads still running: " + " ".join(stragglers)
            if not ignore_live_threads:
                raise RuntimeError(text)
            log.info("%s (cancelled)", text)


# -- QueueRunner -------------------------------------------------------------------------------


class QueueRunner:
    """Runs enqueue ops in asyncio tasks (TF: ``tf.train.QueueRunner``).

    Each enqueue op gets one task that awaits it in a loop until the coordinator asks
    to stop. When an op raises one of ``queue_closed_exception_types``
    (``OutOfRangeError``: its upstream is exhausted) its task ends, and the **last**
    task to end runs ``close_op`` (a plain close, so consumers drain what is stored). Any
    other exception is passed to the coordinator (``request_stop(exc)``); without a
    coordinator it is logged, appended to :attr:`exceptions_raised` and ends the task.
    With a coordinator an extra task waits for the stop, runs ``cancel_op``
    (``close(cancel_pending_enqueues=True)``: enqueues blocked on a full queue fail) and
    cancels the enqueue tasks still running, e.g. those waiting on their input.
    Errors of ``close_op`` and ``cancel_op`` are ignored (logged at DEBUG), as in TF.

    Args:
        queue: the queue the ops fill (``None`` only with both ``close_op`` and
            ``cancel_op`` given).
        enqueue_ops: the zero-argument coroutine functions, one task each.
        close_op: default ``queue.close()``.
        cancel_op: default ``queue.close(cancel_pending_enqueues=True)``.
        queue_closed_exception_types: default ``(OutOfRangeError,)``.

    Raises:
        TypeError: ``queue_closed_exception_types`` is not a non-empty tuple of
            exception classes, or no queue and no close/cancel ops.
    """

    def __init__(
        self,
        queue: QueueBase | None,
        enqueue_ops: Sequence[EnqueueOp],
        close_op: EnqueueOp | None = None,
        cancel_op: EnqueueOp | None = None,
        queue_closed_exception_types: tuple[type[BaseException], ...] | None = None,
    ) -> None:
        if queue_closed_exception_types is None:
            queue_closed_exception_types = (OutOfRangeError,)
        elif not isinstance(queue_closed_exception_types, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException)
            for t in queue_closed_exception_types
        ):
            raise TypeError(
                "queue_closed_exception_types, when provided, must be a tuple of exception "
                f"classes, got {queue_closed_exception_types!r}"
            )
        if not queue_closed_exception_types:
            raise TypeError("queue_closed_exception_types must not be empty")
        if queue is None and (close_op is None or cancel_op is None):
            raise TypeError("a QueueRunner without a queue needs close_op and cancel_op")
        self._queue = queue
        self._ops = list(enqueue_ops)
        if queue is not None:
            q = queue
            self._close_op: EnqueueOp = close_op or (lambda: q.close())
            self._cancel_op: EnqueueOp = cancel_op or (lambda: q.close(True))
        else:
            assert close_op is not None and cancel_op is not None
            self._close_op, self._cancel_op = close_op, cancel_op
        self._closed_types = queue_closed_exception_types
        self._exceptions: list[BaseException] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._live = 0
        self._label = "queue_runner" if queue is None else queue.name

    @property
    def queue(self) -> QueueBase | None:
        return self._queue

    @property
    def enqueue_ops(self) -> list[EnqueueOp]:
        return list(self._ops)

    @property
    def close_op(self) -> EnqueueOp:
        return self._close_op

    @property
    def cancel_op(self) -> EnqueueOp:
        return self._cancel_op

    @property
    def queue_closed_exception_types(self) -> tuple[type[BaseException], ...]:
        return self._closed_types

    @property
    def exceptions_raised(self) -> list[BaseException]:
        """Exceptions of the enqueue tasks of a run without a coordinator."""
        return list(self._exceptions)

    @property
    def name(self) -> str:
        return self._label

    def _set_label(self, label: str) -> None:
        self._label = label

    def running(self) -> bool:
        """Whether tasks of the last :meth:`start` are still running."""
        return any(not t.done() for t in self._tasks)

    def start(self, coord: Coordinator | None = None) -> list[asyncio.Task[None]]:
        """Start one task per enqueue op (plus, with ``coord``, the task that cancels
        them on stop) and return them; they are registered with ``coord``. Returns
        ``[]`` while tasks of an earlier start are still running (TF:
        ``create_threads(sess, coord, start=True)``). Needs a running event loop."""
        if self.running():
            return []
        self._exceptions = []
        self._live = len(self._ops)
        enq = [
            asyncio.create_task(self._run(op, coord), name=f"QueueRunner:{self._label}:{i}")
            for i, op in enumerate(self._ops)
        ]
        tasks = list(enq)
        if coord is not None:
            tasks.append(
                asyncio.create_task(
                    self._close_on_stop(coord, enq),
                    name=f"QueueRunner:{self._label}:close_on_stop",
                )
            )
            for t in tasks:
                coord.register_task(t)
        self._tasks = tasks
        return tasks

    create_tasks = start

    async def _run(self, op: EnqueueOp, coord: Coordinator | None) -> None:
        decremented = False
        try:
            while coord is None or not coord.should_stop():
                try:
                    await op()
                except self._closed_types:
                    self._live -= 1
                    decremented = True
                    if self._live == 0:
                        await self._ignoring_errors(self._close_op, "close")
                    return
        except Exception as exc:
            if coord is not None:
                coord.request_stop(exc)
            else:
                log.error("Exception in QueueRunner %s: %r", self._label, exc)
                self._exceptions.append(exc)
                raise
        finally:
            if not decremented:
                self._live -= 1

    async def _close_on_stop(self, coord: Coordinator, tasks: list[asyncio.Task[None]]) -> None:
        await coord.wait_for_stop()
        await self._ignoring_errors(self._cancel_op, "cancel")
        for t in tasks:
            if not t.done():
                t.cancel()

    async def _ignoring_errors(self, op: EnqueueOp, what: str) -> None:
        try:
            await op()
        except Exception as exc:
            log.debug("QueueRunner %s: ignored exception of the %s op: %r", self._label, what, exc)


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


# -- sources ------------------------------------------------------------------------------------

Source = Any  # a QueueBase, an async iterable, a callable or an iterable of examples


class _Source:
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


def _components(example: Any) -> tuple[list[Any], list[str] | None]:
    if isinstance(example, Mapping):
        names = [str(k) for k in example]
        return [example[k] for k in example], names
    if isinstance(example, (list, tuple)):
        return list(example), None
    return [example], None


def _dtype_of(value: Any) -> np.dtype[Any]:
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
        self._sources = [_Source(s) for s in sources]
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
            comps, found_names = _components(example)
            if names is None:
                names = found_names
            if dtypes is None:
                dtypes = [_dtype_of(c) for c in comps]
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

    def _enqueue_op(self, src: _Source) -> EnqueueOp:
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

"""TF 1.x's ``Coordinator`` and ``QueueRunner`` for asyncio: a set of tasks that stop
together and report their first error, and the tasks that fill a queue from enqueue ops
(see :mod:`workers.input`, which builds its batchers on them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from typing import Any

from qps.aio import wait_event
from qps.errors import OutOfRangeError
from qps.queues import QueueBase

__all__ = ["Coordinator", "EnqueueOp", "QueueRunner"]

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

    @property
    def stop_event(self) -> asyncio.Event:
        """The event set when a stop is requested (to wait on beside other work, e.g.
        with :func:`qps.aio.unless_stopped`; set it only through :meth:`request_stop`)."""
        return self._stop

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

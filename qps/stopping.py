"""How a long-running role stops: one :class:`Stopper` per process.

``qps ps``, ``qps worker`` and ``qps feed`` run their main coroutine through
:meth:`Stopper.run`, which is the one place SIGTERM and SIGINT land. A stop request
(a signal, or :meth:`Stopper.request` for ``qps job stop``) does three things:

1. **Asks the role to stop cleanly**: :attr:`Stopper.event` is set and the callbacks
   given to :meth:`Stopper.on_stop` run (a shard finishes the group of messages in
   hand, a feeder its chunk, a worker its step), so the role ends its own way and
   records what it must (a worker marks itself done, a shard releases its lease).
2. **Cuts every wait short**: a wait that has nothing left to finish (a worker waiting
   for the chief, for a batch of an empty input queue, for a synchronous update's
   token, for slower workers, a connection to Redis being made) runs inside
   ``async with stopper.interruptible("what it waits for")``. A request cancels it at
   once, and :class:`Stopped` is raised in its place; a wait entered after the request
   raises at once. The waits themselves still block in Redis: nothing polls.
3. **Bounds the rest** (signals only): a role still running :data:`GRACE_SECONDS`
   after the signal (a step that does not end, Redis hung in the middle of a call) has
   its main task cancelled; one still running :data:`DEADLINE_SECONDS` after it (its
   clean-up blocked as well) exits at once from a watchdog thread. A second signal
   cancels the main task at once.

Exit status of a role stopped by a signal (see :func:`qps.cli.role.run_role`): 0 when
it stopped as asked (cleanly, or by cutting a wait short); ``128 + the signal``
(143 for SIGTERM, 130 for SIGINT: what a shell reports for a process the signal
killed) when it had to be cancelled or made to exit because it did not stop in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["DEADLINE_SECONDS", "GRACE_SECONDS", "Stopped", "Stopper"]

T = TypeVar("T")

#: how long a role gets after SIGTERM/SIGINT to stop cleanly before its main task is
#: cancelled
GRACE_SECONDS = 1.0
#: how long after the signal a role that is still running exits at once (``os._exit``)
DEADLINE_SECONDS = 1.5
#: the signals :meth:`Stopper.run` handles
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """A role stopped on request before it finished: a wait cut short (``during`` says
    which; empty for a wait the stop came before), or the whole role cancelled because
    it did not stop in time (``clean`` False).

    A ``BaseException``, like ``asyncio.CancelledError``: an ``except Exception`` on the
    way out must not take it for an error of the wait it cut short."""

    def __init__(self, reason: str, during: str = "", clean: bool = True) -> None:
        super().__init__(reason + (f" while {during}" if during else ""))
        self.reason = reason
        self.during = during
        self.clean = clean


class _Wait:
    """``async with stopper.interruptible(what)``: see :meth:`Stopper.interruptible`."""

    __slots__ = ("_cancelling", "_stopper", "_task", "_what")

    def __init__(self, stopper: Stopper, what: str) -> None:
        self._stopper = stopper
        self._what = what
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> None:
        st = self._stopper
        if st.requested:  # not waiting yet: nothing was cut short
            raise Stopped(st.reason)
        task = asyncio.current_task()
        if task is None:  # not in a task: nothing to cancel
            return
        self._task = task
        if sys.version_info >= (3, 11):
            self._cancelling = task.cancelling()
        st._waits.append(self)

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        task, st = self._task, self._stopper
        if task is None:
            return False
        st._waits.remove(self)
        if task not in st._cut or (et is not None and issubclass(et, Stopped)):
            return False  # not cut short (or an inner wait of this task already said so)
        st._cut.discard(task)
        if sys.version_info >= (3, 11) and task.uncancel() > self._cancelling:
            return False  # cancelled by someone else too: that cancellation goes on
        if et is None or issubclass(et, (asyncio.CancelledError, Exception)):
            # the cancellation (or whatever the wait made of it, or nothing if it
            # swallowed it) becomes the stop
            raise Stopped(st.reason, self._what) from None
        return False


class Stopper:
    """A role's stop switch (see the module docstring).

    ``grace`` and ``deadline``: seconds after a signal at which the main task is
    cancelled and at which the process exits (:data:`GRACE_SECONDS`,
    :data:`DEADLINE_SECONDS`).
    """

    def __init__(self, grace: float = GRACE_SECONDS, deadline: float = DEADLINE_SECONDS) -> None:
        self.grace = grace
        self.deadline = deadline
        #: set by the first stop request
        self.event = asyncio.Event()
        #: why the role stops ("SIGTERM", "stop requested (qps job stop)"); "" until then
        self.reason = ""
        #: the signal that asked for the stop, if one did
        self.signum: int | None = None
        #: the main task had to be cancelled: it did not stop within ``grace``
        self.overran = False
        self._callbacks: list[Callable[[], object]] = []
        self._waits: list[_Wait] = []
        self._cut: set[asyncio.Task[Any]] = set()  # tasks cancelled to cut a wait short
        self._main: asyncio.Future[Any] | None = None
        self._log: logging.Logger | logging.LoggerAdapter[Any] = logging.getLogger("qps")
        self._name = "qps"
        self._late: asyncio.TimerHandle | None = None
        self._watchdog: threading.Timer | None = None
        self._ended: int | None = None  # the exit status, once the role has ended

    @property
    def requested(self) -> bool:
        """Whether a stop was requested."""
        return self.event.is_set()

    @property
    def exit_status(self) -> int:
        """The process's exit status after this stop: 0, or ``128 + signal`` when the
        role did not stop in time (see the module docstring)."""
        if self.overran and self.signum is not None:
            return 128 + self.signum
        return 0

    def ended(self, status: int) -> None:
        """The role has ended and the process exits with ``status``: should tearing the
        interpreter down take it past the deadline, the watchdog exits with that status
        (its output flushed) rather than as a role that did not stop."""
        self._ended = status

    def on_stop(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` when a stop is requested (at once if it was already)."""
        if self.requested:
            callback()
        else:
            self._callbacks.append(callback)

    def request(self, reason: str) -> None:
        """Ask the role to stop (only the first request counts): set :attr:`event`,
        run the :meth:`on_stop` callbacks, and cut short the waits in progress (those
        of other tasks than the caller's: a task that asks is not waiting)."""
        if self.requested:
            return
        self.reason = reason
        self.event.set()
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                self._log.exception("%s: a stop callback failed", self._name)
        self._callbacks.clear()
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop
            current = None
        for wait in list(self._waits):
            task = wait._task
            if task is not None and task is not current and task not in self._cut:
                self._cut.add(task)
                task.cancel()

    def interruptible(self, what: str) -> contextlib.AbstractAsyncContextManager[None]:
        """``async with stopper.interruptible("waiting for X"):`` — a wait a stop request
        cuts short: its task is cancelled and :class:`Stopped` raised in place of the
        cancellation (saying what it waited for); :class:`Stopped` at once if the stop
        was requested before. Only for what can be given up at any point (a wait, not
        half of a write that must not be torn)."""
        return _Wait(self, what)

    # -- a role's main coroutine, with the signals -----------------------------------------
    async def run(
        self,
        main: Awaitable[T],
        name: str,
        log: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    ) -> T:
        """Run ``main`` as the role's main task with SIGTERM and SIGINT handled (see the
        module docstring); ``name`` (``qps worker``) and ``log`` name the role in what
        is logged. Returns what ``main`` returns.

        Raises:
            Stopped: the role stopped on request before it finished (a wait cut short),
                or was cancelled because it did not stop in time (``clean`` False).
        """
        loop = asyncio.get_running_loop()
        self._name = name
        if log is not None:
            self._log = log
        task: asyncio.Future[T] = asyncio.ensure_future(main)
        self._main = task
        installed = []
        for sig in SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
        try:
            return await task
        except asyncio.CancelledError:
            if not task.cancelled() or not self.overran:
                raise  # this coroutine was cancelled, not the role
            raise Stopped(self.reason, clean=False) from None
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            if self._late is not None:
                self._late.cancel()

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.requested and self.signum is not None:
            self._log.warning("%s: %s again: stopping at once", self._name, name)
            self._overrun()
            return
        self._log.info("%s: %s received: stopping", self._name, name)
        self.signum = signum
        loop = asyncio.get_running_loop()
        self._late = loop.call_later(self.grace, self._overrun)
        self._watchdog = threading.Timer(self.deadline, self._exit_now)
        self._watchdog.daemon = True
        self._watchdog.start()
        if self.requested:  # stopping already (qps job stop): now within the deadline
            return
        self.request(name)

    def _overrun(self) -> None:
        """The grace period is over (or a second signal came): cancel the main task."""
        task = self._main
        if task is None or task.done() or self.overran:
            return
        self.overran = True
        self._log.warning(
            "%s: not stopped %g s after %s: cancelling it",
            self._name,
            self.grace,
            self.reason,
        )
        task.cancel()

    def _exit_now(self) -> None:
        """The watchdog thread: the process is still running ``deadline`` s after the
        signal (its clean-up blocked too): exit at once."""
        assert self.signum is not None
        if self._ended is not None:  # stopped in time; the interpreter's teardown was not
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(self._ended)
        status = 128 + self.signum
        line = (
            f"qps: ERROR: {self._name}: not stopped {self.deadline:g} s after "
            f"{signal.Signals(self.signum).name}: exiting now (status {status})\n"
        )
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(status)

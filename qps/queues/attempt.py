"""One blocking call's attempt, from its first script call to its outcome.

A call that cannot finish at once is registered as a pending attempt; its caller then
blocks in ``BLPOP`` on the attempt's wake key and runs ``collect`` after each wait,
until the attempt has an outcome or the deadline passes (then ``abort`` withdraws it).

Each script's small arguments are one record below (:class:`Enqueue`, :class:`Dequeue`,
:class:`Close`), written into ``ARGV[1]`` as space-separated tokens after the lease
(``queue_common.lua`` splits them into ``A``; the fast paths match the same line).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from qps.aio import shielded
from qps.errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    QpsError,
)
from qps.queues import waiters
from qps.queues.state import reraise
from qps.transport import BLOCK_SECONDS, Client

if TYPE_CHECKING:
    from qps.queues.core import QueueCore


def line(*tokens: object) -> str:
    """``ARGV[1]`` of a queue script: the lease (read at each call), then ``tokens``."""
    return " ".join([str(waiters.LEASE_MS), *map(str, tokens)])


@dataclass(slots=True)
class Enqueue:
    """``enqueue.lua``: ``A[2]`` id, ``A[3]`` nowait (0/1); the elements follow in ARGV."""

    aid: str
    nowait: bool
    script: ClassVar[str] = "enqueue"

    @property
    def entry(self) -> str:
        return f"e|{self.aid}"

    def argv(self) -> str:
        return f"{waiters.LEASE_MS} {self.aid} {int(self.nowait)}"


@dataclass(slots=True)
class Close:
    """``close.lua``: ``A[2]`` id, ``A[3]`` cancel_pending_enqueues (0/1)."""

    aid: str
    cancel: bool
    script: ClassVar[str] = "close"

    @property
    def entry(self) -> str:
        return f"c|{self.aid}"

    def argv(self) -> str:
        return f"{waiters.LEASE_MS} {self.aid} {int(self.cancel)}"


@dataclass(slots=True)
class Dequeue:
    """``dequeue.lua``: ``A[2]`` id, ``A[3]`` n, ``A[4]`` mode (one|many|upto), ``A[5]``
    nowait, ``A[6]`` the caller's previous delivery record to drop ('-': none), ``A[7]``
    acked (0/1), ``A[8]`` wake: '1' when the caller's first wait follows in the same
    round trip (the script then pushes the wake token unless the attempt waits)."""

    aid: str
    n: int
    mode: str
    nowait: bool
    forget: str
    acked: bool
    script: ClassVar[str] = "dequeue"

    @property
    def entry(self) -> str:
        return f"d|{self.n}|{self.mode}{'A' if self.acked else ''}|{self.aid}"

    def argv(self, wake: bool = False) -> str:
        return (
            f"{waiters.LEASE_MS} {self.aid} {self.n} {self.mode} {int(self.nowait)} "
            f"{self.forget or '-'} {int(self.acked)}{' 1' if wake else ''}"
        )


Args = Enqueue | Close | Dequeue


def collect_argv(entry: str, aid: str, forget: str) -> str:
    """``collect.lua``: ``A[2]`` entry, ``A[3]`` id, ``A[4]`` record to drop ('-')."""
    return f"{waiters.LEASE_MS} {entry} {aid} {forget or '-'}"


def abort_argv(entry: str, aid: str, why: str) -> str:
    """``abort.lua``: ``A[2]`` entry, ``A[3]`` id, ``A[4]`` timeout|cancel|kill."""
    return f"{waiters.LEASE_MS} {entry} {aid} {why}"


@dataclass(slots=True)
class Riders:
    """Plain commands that travel with an attempt's script calls, in their round trips.

    ``before``: sent ahead of the first script call (a batch's buffer). ``after``: sent
    after each script call that may deliver (the first, and the collect after each
    wait); ``sink`` gets the replies of those sent with the final reply (none if that
    came from elsewhere, e.g. a timed-out attempt's abort). ``may_block``: ``after`` may
    block, so it goes once, with the first script call, on a connection of its own, and
    ``sink`` gets its replies whatever the attempt does next."""

    before: Sequence[Sequence[Any]] = ()
    after: Sequence[Sequence[Any]] = ()
    sink: list[Any] | None = None
    may_block: bool = False

    def took(self, replies: list[Any]) -> None:
        if self.sink is not None:
            self.sink[:] = replies


@dataclass(slots=True)
class WaitForecast:
    """Whether a dequeue will probably wait, from whether the last ones did.

    A dequeue after one that had to wait will probably wait too (a consumer that
    outpaces its producers): it goes with its first wait, in one round trip; the script
    wakes the wait itself if it does not leave the attempt waiting. An acknowledged one
    goes so after either of the last two waited: a consumer that takes in pairs, the
    first of which waits (a synchronous PS shard gathering two workers' gradients),
    sends every attempt with its wait."""

    last: bool = False
    before_last: bool = False

    def likely(self, acked: bool) -> bool:
        return self.last or (acked and self.before_last)

    def record(self, waited: bool) -> None:
        self.before_last, self.last = self.last, waited


@dataclass(slots=True)
class Attempt:
    """One attempt of ``queue`` (a :class:`~qps.queues.core.QueueCore`), run by :meth:`run`."""

    queue: QueueCore
    client: Client
    args: Args
    payload: Sequence[Any]
    timeout: float | None
    riders: Riders = field(default_factory=Riders)
    _deadline: float | None = None
    _done: asyncio.Event | None = None
    _waiters: waiters.Waiters | None = None

    async def run(self) -> list[Any]:
        """Run the attempt to completion; returns the final reply."""
        q, client, args = self.queue, self.client, self.args
        skeys, entry, aid = q._skeys, args.entry, args.aid
        if self.timeout is not None:
            self._deadline = asyncio.get_running_loop().time() + max(0.0, self.timeout)
        try:
            if isinstance(args, Dequeue):
                ahead = not args.nowait and q._forecast.likely(args.acked)
                both = None
                if ahead and (self.timeout is None or self.timeout >= BLOCK_SECONDS):
                    both = await self._first_with_wait(args)
                if both is None:
                    reply = await self._first()
                    both = (reply, reply)
                first, reply = both
                q._forget = ""  # the script dropped the record named in its arguments
                q._forecast.record(first[0] == b"wait")
            else:
                reply = await self._first()
            if reply[0] in (b"wait", b"pending"):
                reply = await self._wait()
        except asyncio.CancelledError:
            await shielded(client.run_script("abort", skeys, [abort_argv(entry, aid, "cancel")]))
            raise
        except QpsError as exc:
            # e.g. the wait's connection died: withdraw the attempt now if Redis can be
            # reached, rather than leave it registered until its lease runs out
            with contextlib.suppress(QpsError):
                await shielded(
                    client.run_script("abort", skeys, [abort_argv(entry, aid, "cancel")])
                )
            await reraise(client, q._prefix, exc)  # corrupt state: the key named
        finally:
            if self._done is not None:
                assert self._waiters is not None
                self._waiters.blocked.pop(aid, None)
                self._done.set()
        return self._outcome(reply)

    def _blocked(self) -> None:
        """Register the attempt as blocked (closing the client wakes it)."""
        if self._done is None:
            self._done = asyncio.Event()
            self._waiters = waiters.waiters_of(self.client)
            self._waiters.blocked[self.args.aid] = (self.queue._skeys, self.args.entry, self._done)

    async def _first_with_wait(self, args: Dequeue) -> tuple[list[Any], list[Any]] | None:
        """The script, its first wait and a collect, in one round trip; returns the
        script's reply and the attempt's (the wait's outcome, or 'pending'), or None
        where the transport cannot (nothing was sent)."""
        self._blocked()
        r = self.riders
        triple = await self.client.script_then_wait(
            args.script,
            self.queue._skeys,
            [args.argv(wake=True), *self.payload],
            f"{self.queue._prefix}a:{args.aid}:w",
            BLOCK_SECONDS,
            "collect",
            [collect_argv(args.entry, args.aid, "")],
            r.after,
        )
        if triple is None:
            return None
        reply, waited, extra = triple
        r.took(extra)
        return reply, waited if reply[0] == b"wait" and waited is not None else reply

    async def _first(self) -> list[Any]:
        """The script alone, or with the riders' commands around it."""
        c, s, skeys, r = self.client, self.args.script, self.queue._skeys, self.riders
        argv = [self.args.argv(), *self.payload]
        if r.after:
            reply, extra = await c.run_script_then_commands(
                s, skeys, argv, r.after, before=r.before, blocking=r.may_block
            )
            r.took(extra)
            if r.may_block:  # its replies are in; nothing rides with the waits
                self.riders = Riders()
            return reply  # type: ignore[no-any-return]
        if r.before:
            return (await c.run_commands_then_script(r.before, s, skeys, argv))[1]  # type: ignore[no-any-return]
        return await c.run_script(s, skeys, argv)  # type: ignore[no-any-return]

    async def _wait(self) -> list[Any]:
        """Wait for the attempt's outcome, a collect after each wait; withdraw it when
        the deadline passes."""
        q, c, args = self.queue, self.client, self.args
        loop, deadline = asyncio.get_running_loop(), self._deadline
        wake = f"{q._prefix}a:{args.aid}:w"
        while True:
            block = BLOCK_SECONDS
            if deadline is not None:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return await self._time_out()
                block = min(BLOCK_SECONDS, remaining)
            self._blocked()
            collect = [collect_argv(args.entry, args.aid, q._forget)]
            after = self.riders.after
            if after:
                reply, extra = await c.wait_then_script(
                    wake, block, "collect", q._skeys, collect, after
                )
                self.riders.took(extra)
            else:
                reply = await c.wait_then_script(wake, block, "collect", q._skeys, collect)
            q._forget = ""
            if reply[0] not in (b"wait", b"pending"):
                return reply  # type: ignore[no-any-return]

    async def _time_out(self) -> list[Any]:
        """Withdraw the attempt at its deadline; returns the outcome it had reached
        meanwhile, if any."""
        q, args = self.queue, self.args
        reply = await self.client.run_script(
            "abort", q._skeys, [abort_argv(args.entry, args.aid, "timeout")]
        )
        if self.riders.sink is not None:
            self.riders.sink.clear()
        if reply[0] in (b"aborted", b"cancelled"):
            raise DeadlineExceededError(
                f"Timed out after {self.timeout} s waiting to {args.script} "
                f"{q._spec.class_name} '{q._name}'"
            )
        return reply  # type: ignore[no-any-return]

    def _outcome(self, reply: list[Any]) -> list[Any]:
        """The final reply, or the error it stands for."""
        status, q, what = reply[0], self.queue, self.args.script
        if status in (b"cancelled", b"aborted"):
            verb = "Dequeue" if what == "dequeue" else "Enqueue"
            raise CancelledError(f"{verb} operation was cancelled")
        if status == b"gone":
            raise q._gone()
        if status == b"expired":
            raise AbortedError(
                f"the {what} attempt on '{q._name}' was taken for dead (its lease of "
                f"{waiters.LEASE_MS} ms ran out while the event loop was stalled or Redis was "
                "out of reach) and undone"
            )
        return reply

"""Acknowledged (at-least-once) dequeues: a :class:`Delivery` is held for its caller
until acked, nacked or its lease runs out; and what a restarted sole consumer or
producer takes back from its dead predecessor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qps.errors import AbortedError, InvalidArgumentError
from qps.queues import waiters
from qps.queues.attempt import line
from qps.queues.elements import Element
from qps.queues.state import check_count
from qps.queues.take import Taking, Tokens


@dataclass(frozen=True)
class Delivery:
    """Elements taken by an acknowledged dequeue, held for their caller until
    :meth:`QueueBase.ack` (done with them), :meth:`QueueBase.nack` (put them back) or
    the lease running out (they go back by themselves).

    Attributes:
        value: the element(s), as the matching plain dequeue returns them.
        tokens: ids of the dequeue attempts that delivered them (usually one).
    """

    value: Element
    tokens: tuple[str, ...]
    #: True when none of its stored values referred to bytes kept out of line: its ack
    #: then has nothing to release but the delivery records (the server skips reading
    #: them back)
    plain: bool = False


class AckedDequeues(Taking):
    """The at-least-once half of :class:`~qps.queues.base.QueueBase`."""

    async def _take_acked(
        self,
        n: int,
        mode: str,
        timeout: float | None,
        nowait: bool,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        listed: bool = False,
    ) -> Delivery:
        """An acknowledged :meth:`_take` as its :class:`Delivery` (``listed``: its value
        is the list of the elements, each formatted)."""
        tokens = Tokens()
        got = await self._take(n, mode, timeout, nowait, tokens, then, then_out, listed)
        value = [self._format(e) for e in got] if listed else self._format(got)
        return Delivery(value, tuple(tokens), not tokens.refs)

    async def dequeue_acked(self, *, timeout: float | None = None) -> Delivery:
        """:meth:`dequeue`, at least once: the element stays held for this caller until
        :meth:`ack`. If the caller dies, or does not :meth:`touch` the delivery within
        the lease (``QPS_LEASE_MS``, 10 s by default), the element goes back to the
        front of the queue and is delivered again.

        Raises:
            as :meth:`dequeue`.
        """
        return await self._take_acked(1, "one", timeout, False)

    async def dequeue_acked_then(
        self, commands: Sequence[Sequence[Any]], *, timeout: float | None = None
    ) -> tuple[Delivery, list[Any]]:
        """:meth:`dequeue_acked` with plain ``commands`` run right after the element is
        taken, in the same round trip, as :meth:`dequeue_then` runs them; returns the
        delivery and their replies (an empty list if they did not run with it).

        Raises:
            as :meth:`dequeue`.
        """
        out: list[Any] = []
        return await self._take_acked(1, "one", timeout, False, list(commands), out), out

    async def dequeue_ready_acked(
        self, n: int, *, then: Sequence[Sequence[Any]] = ()
    ) -> tuple[Delivery, list[Any]]:
        """At least once (see :meth:`dequeue_acked`), without waiting: up to ``n`` of the
        elements there now, at least one, in one attempt. The queue needs no shapes:
        the delivery's ``value`` is the list of the elements, each as :meth:`dequeue`
        returns it, and one :meth:`ack` (or :meth:`nack`) settles them all. ``then``:
        as for :meth:`dequeue_acked_then`; returns their replies too.

        A reader that keeps up with its producers takes one element at a time with
        :meth:`dequeue_acked`; one that falls behind takes what piled up with this, in
        one round trip and one script call instead of one per element.

        Raises:
            InvalidArgumentError: ``n < 1``.
            WouldBlockError: nothing can be taken now; nothing changed.
            OutOfRangeError: the queue is closed and empty.
        """
        check_count(n, "dequeue_ready_acked", 1)
        out: list[Any] = []
        return await self._take_acked(int(n), "upto", None, True, list(then), out, True), out

    async def dequeue_many_acked(self, n: int, *, timeout: float | None = None) -> Delivery:
        """:meth:`dequeue_many`, at least once (see :meth:`dequeue_acked`)."""
        if self._many(n, "many") == 0:
            return Delivery(self._format(self._batch([])), ())
        return await self._take_acked(int(n), "many", timeout, False)

    async def dequeue_up_to_acked(self, n: int, *, timeout: float | None = None) -> Delivery:
        """:meth:`dequeue_up_to`, at least once (see :meth:`dequeue_acked`)."""
        if self._many(n, "upto") == 0:
            return Delivery(self._format(self._batch([])), ())
        return await self._take_acked(int(n), "upto", timeout, False)

    async def ack(self, delivery: Delivery, *, after: Sequence[Sequence[Any]] = ()) -> None:
        """Done with a delivery: its elements are gone for good.

        ``after``: plain commands sent in the ack's round trip, run after it whatever it
        answers (a failed one is logged, not raised). On Redis Cluster they must be of
        the queue's slot.

        Raises:
            AbortedError: the lease ran out first; the elements were put back and will be
                (or were) delivered again. Work done on them must be idempotent.
        """
        if not delivery.tokens:
            return
        tokens = ("+p", *delivery.tokens) if delivery.plain else delivery.tokens
        lost = await self._settle("ack", await self._c(), tokens, after)
        if lost:
            raise AbortedError(
                f"ack on '{self._name}' came after the lease ({waiters.LEASE_MS} ms) ran out: the "
                "elements were put back and are delivered again"
            )

    async def nack(self, delivery: Delivery) -> None:
        """Put a delivery's elements back at the front of the queue, in order, now.
        A delivery whose lease had run out is back already; that is not an error."""
        if delivery.tokens:
            await self._settle("nack", await self._c(), delivery.tokens)

    async def touch(self, delivery: Delivery) -> None:
        """Renew a delivery's lease: call it at least every ``QPS_LEASE_MS / 2`` while
        working on the elements.

        Raises:
            AbortedError: the lease had run out; the elements were put back.
        """
        if not delivery.tokens:
            return
        if await self._settle("touch", await self._c(), delivery.tokens):
            raise AbortedError(
                f"the lease of a delivery from '{self._name}' ran out: its elements were put back"
            )

    async def held(self) -> int:
        """How many attempts of consumers hold elements of this queue or wait for some:
        acknowledged dequeues not yet acked or nacked, and waiting dequeues."""
        return int((await self._reclaim("count"))[1])

    async def reclaim(self) -> int:
        """Put back at the front everything this queue's consumers hold (pending
        deliveries of acknowledged dequeues, elements handed to waiting dequeues) and
        cancel their waits, as if their leases had run out now; return how many attempts
        were undone. Enqueues are left alone.

        Only for a queue with one consumer at a time that knows it is the only one: a
        PS shard whose new owner took the shard's lease gets back at once what its dead
        predecessor held (instead of when those leases run out). A live consumer's
        later ack of a reclaimed delivery raises AbortedError, as after its lease ran out.
        """
        return int((await self._reclaim("undo"))[1])

    async def abort_enqueues_of(self, client_id: str) -> int:
        """Undo the enqueues of the client ``client_id`` (a :attr:`Client.client_id`
        <qps.transport.Client.client_id>) that still wait for room, as if their leases
        had run out now: what they had inserted stays, the rest is dropped. Returns how
        many were undone.

        Only for a producer that restarted and knows it is the only one: a feeder
        resuming its dead predecessor's feed stops the dead run's waiting rest from
        slipping in behind its own enqueues.

        Raises:
            InvalidArgumentError: ``client_id`` is not a client id.
        """
        if not client_id or not all(c in "0123456789abcdef" for c in client_id):
            raise InvalidArgumentError(f"not a client id: {client_id!r}")
        return int((await self._reclaim(f"enqueues {client_id}"))[1])

    async def _reclaim(self, op: str) -> list[Any]:
        return list(await self._run(await self._c(), "reclaim", [line(op)]))

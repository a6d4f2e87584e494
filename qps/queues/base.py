"""The queue machinery shared by FIFOQueue, RandomShuffleQueue and PaddingFIFOQueue.

State lives in Redis; every state transition is one Lua script (``qps/lua``). A call
that cannot finish at once is registered as a pending *attempt* in the queue's FIFO
attempt lists (TensorFlow's model: head-of-line blocking, ``close`` queued behind
earlier enqueues) and its caller blocks in ``BLPOP`` on the attempt's wake key; the
script that makes progress for it pushes the wake token. Nothing polls.

Guarantees beyond TensorFlow's (docs/queues.md, "Where qps differs from TensorFlow 1.x"):

* cancellation atomicity: a dequeue that raises (timeout, asyncio cancellation, client
  closed) leaves the queue as if it had never been made: elements it had taken go back
  to the front in order. An enqueue that raises while it waits inserted nothing, except
  that ``enqueue_many`` keeps the prefix it had already inserted (as in TF). One race
  cannot be undone: an enqueue (or close) whose task is cancelled at the very moment it
  completes raises ``asyncio.CancelledError`` although it took effect, exactly once (its
  elements may already have been consumed). A timeout or a closing client never reports
  a completed call as failed;
* attempts of a process that died are undone when their lease (renewed by every wait)
  runs out;
* an element that does not decode is moved to the queue's dead-letter list and the
  dequeue goes on with the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from qps.errors import (
    AbortedError,
    CancelledError,
    DataLossError,
    QpsError,
    WouldBlockError,
)
from qps.queues.acked import AckedDequeues, Delivery
from qps.queues.attempt import Close, Enqueue, Riders
from qps.queues.elements import Element
from qps.queues.inspect import QueueStats, peek_blobs, queue_stats
from qps.queues.large import (
    CHUNK_BYTES,
    ONE_CHUNK_MIN_BYTES,
    encode_element,
    one_chunk,
    rows_buffer,
    stage_batch,
    store_large,
)
from qps.queues.large import nbytes as blob_bytes
from qps.queues.state import corrupt, reraise, size_of_replies, size_reads

__all__ = ["Delivery", "Element", "QueueBase"]


class QueueBase(AckedDequeues):
    """Behaviour common to every queue type; use a subclass."""

    # -- enqueue ------------------------------------------------------------------
    async def _enqueue_blobs(
        self,
        blobs: Sequence[Any],
        timeout: float | None,
        nowait: bool,
        order: list[bytes] | None = None,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        blocking: bool = False,
    ) -> None:
        client = await self._c()
        aid = client.new_id()
        buffer = rows_buffer(blobs)
        before: list[tuple[Any, ...]] = []
        if buffer is not None:
            blobs, before = await stage_batch(
                client, self._prefix, aid, buffer, len(blobs), self._list
            )
        elif (
            len(blobs) == 1
            and not isinstance(blobs[0], list)
            and ONE_CHUNK_MIN_BYTES < blob_bytes(blobs[0]) <= CHUNK_BYTES
            and self._list
        ):  # out of Lua: one chunk, written in the script's round trip
            ref, store = one_chunk(self._prefix, aid, blobs[0])
            blobs, before = [ref], [store]
        else:
            blobs = await store_large(client, self._prefix, aid, blobs)
        if order is not None:
            blobs = [k + bytes(b) for k, b in zip(order, blobs)]
        riders = Riders(before, then, then_out, blocking)
        reply = await self._attempt(client, Enqueue(aid, nowait), blobs, timeout, riders)
        status = reply[0]
        if status == b"ok":
            return
        if status == b"closed":
            raise CancelledError(f"{self._spec.class_name} '{self._name}' is closed.")
        if status == b"wouldblock":
            raise WouldBlockError(
                f"{self._spec.class_name} '{self._name}' has no room for "
                f"{len(blobs)} element(s) now"
            )
        raise AbortedError(f"unexpected enqueue reply {status!r}")

    async def enqueue(self, vals: Any, *, timeout: float | None = None) -> None:
        """Insert one element, blocking while the queue is full.

        ``vals``: one value per component (a list/tuple, a single array for a
        one-component queue, or a dict for a queue with ``names``).

        Raises:
            InvalidArgumentError: wrong dtype, shape or number of components (nothing
                is inserted).
            CancelledError: the queue is closed, or the call was cancelled by
                ``close(cancel_pending_enqueues=True)`` or by closing the client.
            DeadlineExceededError: ``timeout`` seconds passed; nothing was inserted.
        """
        await self._enqueue_one(vals, timeout)

    async def enqueue_then(
        self,
        vals: Any,
        commands: Sequence[Sequence[Any]],
        *,
        timeout: float | None = None,
        blocking: bool = False,
    ) -> list[Any]:
        """:meth:`enqueue`, then plain Redis ``commands`` sent in the same round trip and
        run by the server right after the element is in: a producer that writes and
        then reads something (an asynchronous worker pushing its gradients, then
        pulling the parameters for its next step) saves a round trip.

        Returns the commands' replies (an error reply in its place, not raised), or an
        empty list when they did not run with the attempt that put the element in
        (e.g. a script had to be loaded first): then run them yourself. The commands
        must only read and must not block: an enqueue that waits for room runs them
        after each wait, not only the last. On a Redis Cluster they go to this queue's
        node: keys of its slot only.

        With ``blocking`` the commands may block (a synchronous worker's ``BLPOP`` for
        its token): they run once, right after the first attempt's script whatever it
        answered (an enqueue that must wait for room waits after them), on a connection
        of their own; without lean connections (fakeredis) they do not run ([]). An
        enqueue that fails (a closed queue) raises once they are done.

        Raises:
            as :meth:`enqueue`.
        """
        out: list[Any] = []
        await self._enqueue_one(vals, timeout, commands, out, blocking)
        return out

    async def _enqueue_one(
        self,
        vals: Any,
        timeout: float | None,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        blocking: bool = False,
    ) -> None:
        quick = self._quick
        if (
            quick is not None
            and type(vals) is np.ndarray
            and vals.dtype is quick.dtype
            and vals.shape == quick.shape
        ):  # what _prepare_one and encode_element give for it, without their checks
            blobs = [quick.header + vals.tobytes()]
            await self._enqueue_blobs(blobs, timeout, False, None, then, then_out, blocking)
            return
        arrays = self._prepare_one(vals)
        blobs = [encode_element(arrays)]
        order = self._order_keys(arrays, None)
        await self._enqueue_blobs(blobs, timeout, False, order, then, then_out, blocking)

    async def enqueue_nowait(self, vals: Any) -> None:
        """:meth:`enqueue` that never waits.

        Raises:
            WouldBlockError: the queue is full or other enqueues are waiting; nothing changed.
            InvalidArgumentError, CancelledError: as :meth:`enqueue`.
        """
        arrays = self._prepare_one(vals)
        order = self._order_keys(arrays, None)
        await self._enqueue_blobs([encode_element(arrays)], None, True, order)

    async def enqueue_many(self, vals: Any, *, timeout: float | None = None) -> None:
        """Insert the slices of a batch (dimension 0) as separate elements, in order.

        Inserts what fits and blocks for the rest, so it can move more elements than
        the capacity while consumers run. A batch of 0 does nothing, even on a closed queue.

        Raises:
            InvalidArgumentError: components disagree on dimension 0, or wrong dtype/shape.
            CancelledError: the queue is closed (or gets closed with cancel while this
                call waits: the prefix already inserted stays).
            DeadlineExceededError: ``timeout`` passed; the prefix already inserted stays.
        """
        arrays, batch = self._prepare_many(vals)
        if batch == 0:
            return
        order = self._order_keys(arrays, batch)
        await self._enqueue_blobs(self._encode_rows(arrays, batch), timeout, False, order)

    async def enqueue_many_nowait(self, vals: Any) -> None:
        """:meth:`enqueue_many` that inserts all of the batch at once, or nothing.

        Raises:
            WouldBlockError: not enough room now; nothing changed.
        """
        arrays, batch = self._prepare_many(vals)
        if batch == 0:
            return
        order = self._order_keys(arrays, batch)
        await self._enqueue_blobs(self._encode_rows(arrays, batch), None, True, order)

    # -- dequeue ------------------------------------------------------------------
    async def dequeue(self, *, timeout: float | None = None) -> Element:
        """Remove and return one element, blocking while none may be taken.

        Returns an array (one component), a list (several) or a dict (``names``).

        Raises:
            OutOfRangeError: the queue is closed and empty.
            CancelledError: the client was closed while this call waited.
            DeadlineExceededError: ``timeout`` passed; the queue is unchanged.
        """
        return self._format(await self._take(1, "one", timeout, False))

    async def dequeue_then(
        self, commands: Sequence[Sequence[Any]], *, timeout: float | None = None
    ) -> tuple[Element, list[Any]]:
        """:meth:`dequeue`, then plain Redis ``commands`` sent in the same round trip and
        run by the server right after the element is taken: a caller that blocks for an
        element and then reads something (a worker waiting for its sync token, then
        reading the parameters the token says are ready) saves a round trip.

        Returns the element and the commands' replies (an error reply in its place, not
        raised), or an empty list when they did not run with the attempt that delivered
        (e.g. a script had to be loaded first): then run them yourself. The commands
        must only read (this queue's keys too, as :meth:`size_commands` does) and must
        not block: they run after each wait of a blocked call, not only the last. On a
        Redis Cluster they go to this queue's node: keys of its slot only.

        Raises:
            as :meth:`dequeue`.
        """
        out: list[Any] = []
        value = await self._take(1, "one", timeout, False, then=list(commands), then_out=out)
        return self._format(value), out

    async def dequeue_nowait(self) -> Element:
        """:meth:`dequeue` that never waits.

        Raises:
            WouldBlockError: nothing may be taken now; nothing changed.
            OutOfRangeError: the queue is closed and empty.
        """
        return self._format(await self._take(1, "one", None, True))

    async def dequeue_many(self, n: int, *, timeout: float | None = None) -> Element:
        """Remove exactly ``n`` elements, stacked along a new dimension 0.

        Collects incrementally (``n`` may exceed the capacity). ``n == 0`` returns empty
        arrays at once, even on a closed queue.

        Raises:
            InvalidArgumentError: ``n < 0``, or the queue has no shapes.
            OutOfRangeError: the queue is (or gets) closed with fewer than ``n``; the
                elements this call had collected go back to the front, in order.
            DeadlineExceededError: ``timeout`` passed; collected elements go back too.
        """
        return await self._take_many(n, "many", timeout, False)

    async def dequeue_many_nowait(self, n: int) -> Element:
        """:meth:`dequeue_many` that never waits.

        Raises:
            WouldBlockError: fewer than ``n`` may be taken now; nothing changed.
        """
        return await self._take_many(n, "many", None, True)

    async def dequeue_up_to(self, n: int, *, timeout: float | None = None) -> Element:
        """Like :meth:`dequeue_many` while the queue is open; once it is closed, return
        the remaining ``1..n`` elements (a pending call returns its partial batch).

        Raises:
            InvalidArgumentError: ``n < 0``, or the queue has no shapes.
            OutOfRangeError: the queue is closed and empty.
            DeadlineExceededError: ``timeout`` passed; collected elements go back.
        """
        return await self._take_many(n, "upto", timeout, False)

    async def dequeue_up_to_nowait(self, n: int) -> Element:
        """Return ``1..n`` elements that may be taken now, without waiting.

        Raises:
            WouldBlockError: none may be taken now.
            OutOfRangeError: the queue is closed and empty.
        """
        return await self._take_many(n, "upto", None, True)

    # -- close / state ------------------------------------------------------------
    async def close(
        self, cancel_pending_enqueues: bool = False, *, timeout: float | None = None
    ) -> None:
        """Close the queue: no more enqueues; dequeues drain what is stored.

        Without ``cancel_pending_enqueues`` the close waits behind enqueues that are
        already pending (TF semantics) and returns once it has taken effect. With it,
        the queue closes at once and pending enqueues fail with CancelledError (the
        prefixes they inserted stay).

        Raises:
            CancelledError: a plain close of a queue that is already closed.
            DeadlineExceededError: ``timeout`` passed while the close waited; it is withdrawn.
        """
        client = await self._c()
        aid = client.new_id()
        reply = await self._attempt(client, Close(aid, cancel_pending_enqueues), (), timeout)
        if reply[0] == b"already":
            raise CancelledError(f"Queue '{self._name}' is already closed.")

    async def is_closed(self) -> bool:
        """Whether the close has taken effect."""
        client = await self._c()
        try:
            closed = await client.hget(self._keys[0], "closed")
        except QpsError as exc:
            await reraise(client, self._prefix, exc)
        if closed not in (b"0", b"1", None):  # None: deleted since (a reset container)
            raise corrupt(self._keys[0], f"field 'closed' is {closed!r}, not 0 or 1")
        return closed == b"1"

    async def size(self) -> int:
        """The number of stored elements (not counting those held by pending dequeues).

        Raises:
            DataLossError: the stored counts are corrupt (the key named).
        """
        client = await self._c()
        batch = client.batch(transaction=True)  # read atomically
        for command in self._size_reads():
            batch.command(*command)
        replies = await batch.run(raise_on_error=False)
        return size_of_replies(replies, self._spec.kind, self._prefix)

    def _size_reads(self) -> list[tuple[Any, ...]]:
        """The reads whose replies add up to :meth:`size`."""
        return size_reads(self._spec.kind, self._prefix)

    def size_commands(self) -> list[tuple[Any, ...]]:
        """:meth:`size` as plain commands (one ``MULTI``/``EXEC``) for a round trip of the
        caller's own (:meth:`dequeue_then`); :meth:`size_of` reads their replies."""
        return [("MULTI",), *self._size_reads(), ("EXEC",)]

    def size_of(self, replies: Sequence[Any]) -> int | None:
        """The size from the replies to :meth:`size_commands` (all of them, in order);
        None if they are not usable (an error reply)."""
        done = replies[-1] if replies else None
        if not isinstance(done, list) or not done:
            return None
        try:
            return size_of_replies(done, self._spec.kind, self._prefix)
        except (QpsError, TypeError, ValueError):
            return None

    async def stats(self) -> QueueStats:
        """A snapshot of the queue; changes nothing."""
        client = await self._c()
        return await queue_stats(client, self._name, self._container)

    async def peek(self, k: int = 1) -> list[Element]:
        """Up to ``k`` stored elements, decoded, without removing them (the next ones out
        for a FIFO queue; any ``k`` for a shuffle queue)."""
        client = await self._c()
        out = []
        for i, e in enumerate(await peek_blobs(client, self._name, self._container, k)):
            try:
                out.append(self._format(self._decode_one(e.blob)))
            except (DataLossError, ValueError, TypeError) as exc:
                raise corrupt(self._keys[1], f"stored element {i}: {e.error or exc}") from exc
        return out

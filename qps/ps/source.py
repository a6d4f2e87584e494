"""Where a PS shard's gradient messages come from (:class:`Readers`, a layer of
:class:`~qps.ps.shard.Shard`): a reader task per channel takes deliveries ahead of the
apply, decodes them and puts them in the inbox (:class:`~qps.ps.groups._Inbox`), while
the inbox has room: the gradient queue (``ps/i/grads``, every backend) and, on a single
server, the gradient list (:mod:`qps.ps.gradlist`). Every delivery held is recorded
(the queue's have their leases renewed by :meth:`Readers._touch_loop`) until it is
settled (:mod:`qps.ps.settle`)."""

from __future__ import annotations

import asyncio
from typing import Any

from qps import metrics as _metrics
from qps.errors import (
    AbortedError,
    DataLossError,
    OutOfRangeError,
    QpsError,
    WouldBlockError,
)
from qps.ps import control
from qps.ps.core import ShardCore, ShardOptions
from qps.ps.gradlist import GradientList, is_list_delivery
from qps.ps.groups import (
    _Inbox,
    _Item,
    _joined,
    _nbytes,
)
from qps.ps.messages import (
    decode_message,
)
from qps.queues.base import Delivery, QueueBase
from qps.queues.waiters import LEASE_MS as DELIVERY_LEASE_MS
from qps.transport import BLOCK_SECONDS, Client


class Readers(ShardCore):
    """The shard's readers of its gradient channels (module docstring)."""

    def __init__(
        self, client: Client, options: ShardOptions, metrics: _metrics.Metrics | None = None
    ) -> None:
        super().__init__(client, options, metrics)
        #: asynchronous training: the worker of each delivery taken from the list (by
        #: its tokens), who gets a credit back when it is settled
        self._senders: dict[tuple[str, ...], str] = {}
        self._held: list[Delivery] = []  # deliveries taken and not settled, in order
        self._sizes: dict[tuple[str, ...], int] = {}  # their bytes (by tokens), as read
        self._max_message = control.DEFAULT_MAX_MESSAGE_BYTES  # the job's, set by run()
        #: the reader's take under way was sent while elements waited behind its last
        #: one: they are on their way to the inbox (a group waits for them)
        self._incoming = False
        self._list_incoming = False  # the same, for the gradient list's reader

    async def _fetch(self, q: QueueBase, inbox: _Inbox) -> None:
        """Take deliveries ahead of the apply (while the inbox has room), decode them and
        put them in the inbox; mark it done when the queue is closed and drained."""
        # Each take reads the queue's size in its round trip: while messages wait behind
        # it (the shard fell behind its workers), the next take is one attempt for all
        # that fit in the inbox (a group's worth), not one per message. Synchronous
        # training takes one at a time (an update settles each message on its own).
        size = q.size_commands() if self.sync is None else []
        more, each = False, 0
        try:
            while True:
                if not await self._until_room(inbox):
                    return
                room = inbox.room(each) if more else 1
                self._incoming = more
                try:
                    if room > 1:
                        try:
                            d, replies = await q.dequeue_ready_acked(room, then=size)
                        except WouldBlockError:
                            more = False
                            continue
                        values = list(d.value)
                    else:
                        d, replies = await q.dequeue_acked_then(size)
                        values = [d.value]
                finally:
                    self._incoming = False
                more = bool(size) and bool(q.size_of(replies))
                self._held.append(d)
                items = [self._item(d, v, len(values) > 1) for v in values]
                each = max(it.nbytes for it in items)
                # still counted once their bytes are dropped
                self._sizes[d.tokens] = sum(it.nbytes for it in items)
                for item in items:  # all at once: a group never sees part of a delivery
                    inbox.put(item)
        except OutOfRangeError:
            inbox.finish()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the loop, which raises it
            inbox.fail(exc)

    async def _until_room(self, inbox: _Inbox) -> bool:
        """Wait until the inbox has room for a reader's next take; False once the loop
        stops (the reader returns)."""
        await inbox.until(lambda: not inbox.full() or self._stop.is_set() or inbox.closing)
        return not (self._stop.is_set() or inbox.closing)

    def _item(self, d: Delivery, value: Any, shared: bool) -> _Item:
        """One message of delivery ``d``, decoded (or with the error that it does not)."""
        item = _Item(d, nbytes=_nbytes(value), shared=shared, raw=value)
        self.metrics.received(item.nbytes)
        try:
            item.msg = decode_message(value)
        except DataLossError as exc:
            item.error = str(exc)
        if item.nbytes > self._max_message:  # a worker that ignored the limit
            item.about, item.msg, item.oversize = item.msg, None, True
            item.error = (
                f"message of {item.nbytes} bytes is over the job's maximum message "
                f"size of {self._max_message} bytes (max_message_bytes)"
            )
        return item

    async def _fetch_list(self, gl: GradientList, inbox: _Inbox) -> None:
        """The reader of the gradient list: take messages into the processing list,
        decode them and put them in the inbox; done once the job is finished and the
        list is empty. Synchronous training sends an update's takes in one write
        (:meth:`GradientList.take_each`); asynchronous training takes what waits (up to
        the inbox's room) in one round trip, and records who sent each message, for its
        credit (module docstring of qps.ps.gradlist)."""
        each = 0
        try:
            while True:
                if not await self._until_room(inbox):
                    return
                if self.sync is not None:  # an update's worth of takes, in one write
                    taken = []
                    wanted = max(1, min(self.sync[0], inbox.room(each)))
                    async for one in gl.take_each(wanted, BLOCK_SECONDS):
                        if one is not None:
                            taken.append(one)
                            each = max(each, self._take_in(one, inbox))
                    if taken:
                        # the update they complete runs first: its commit goes out
                        # before the next takes (no gradient comes before its tokens)
                        await asyncio.sleep(0)
                        continue
                else:
                    self._list_incoming = gl.waiting > 0
                    try:
                        taken = await gl.take_many(inbox.room(each), BLOCK_SECONDS)
                    finally:
                        self._list_incoming = False
                if not taken:  # a wake-up, or a while without messages
                    finished = await control.is_finished(self.client, self.container)
                    if finished and not await gl.size():
                        inbox.finish()
                        return
                    continue
                for d in taken:
                    each = max(each, self._take_in(d, inbox))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the loop, which raises it
            inbox.fail(exc)

    def _take_in(self, d: Delivery, inbox: _Inbox) -> int:
        """Hold a delivery of the gradient list, decode it into the inbox; its bytes.
        Asynchronous training records who sent it, for its credit."""
        self._held.append(d)
        self._list_taken += 1
        item = self._item(d, d.value, False)
        self._sizes[d.tokens] = item.nbytes
        if self.sync is None:
            about = item.msg if item.msg is not None else item.about
            if about is not None:
                self._senders[d.tokens] = about.worker
        inbox.put(item)
        return item.nbytes

    async def _touch_loop(self, q: QueueBase) -> None:
        """Renew the leases of every delivery of the queue held (taken ahead or in the
        group; those of the gradient list have no lease: the shard's own covers them)."""
        while True:
            await asyncio.sleep(DELIVERY_LEASE_MS / 3000.0)
            held = [d for d in self._held if not is_list_delivery(d)]
            if not held:
                continue
            try:
                await q.touch(_joined(held))
            except AbortedError as exc:  # its message comes again; the ids stay recorded
                self.log.warning("%s", exc)
            except QpsError as exc:
                self.log.warning("could not renew the deliveries' leases: %s", exc)

"""A PS shard: the single writer of the variables placed on it (docs/ps.md).

Shard ``i`` of a job in container ``C``:

1. **Takes the lease** ``qps:{C/ps/i}:lease`` with a fresh fencing token, waiting as a
   standby (blocked, never polling) while another copy holds it, and renews it every
   third of its length (:mod:`qps.ps.lease`).
2. **Owns its variables**: those the placement map puts on shard ``i``. For each it
   raises the variable's fencing token (:meth:`~qps.variables.Variable.fence`: from now
   on a zombie with an older token cannot write), loads value, version, optimizer slots
   and ``t`` (:meth:`~qps.variables.Variable.read_state`), and stores fresh slots if
   there are none. It keeps them in memory: as the only writer, its copy is the truth.
3. **Applies gradient messages** from its queue ``ps/i/grads`` as they arrive (TF's
   asynchronous training), in order, in **groups**. A reader task takes deliveries
   ahead (:meth:`~qps.queues.base.QueueBase.dequeue_acked`) and decodes them while the
   previous ones are applied and committed. The applier takes every message waiting,
   and the ones that arrive while the queue still holds some, up to
   :attr:`ShardOptions.max_group` messages / ``max_group_bytes`` or until
   ``commit_interval_ms`` passed (at once when the queue is empty). Each message is
   validated (a bad one is dead-lettered and acked, never applied) and, for each of its
   variables that has not recorded its id, applied to the in-memory copy (large batches
   in a worker thread: NumPy releases the GIL). Then each variable the group changed is
   **committed** once: value, slots, ``t`` and the ids of all its messages of the group
   in one script (:meth:`~qps.variables.Variable.publish` / ``publish_rows`` with
   ``slots=``/``applied=[ids]``); shard 0 advances the global step (one per message,
   deduplicated by id); then the group's deliveries are acked in one call; then their
   ids are released. Every delivery held has its lease renewed.
4. Exits 0 on ``SIGTERM`` (after the group in hand; the deliveries read ahead go back
   to the front of the queue) and when the job is finished (its queue closed and
   drained), releasing the lease so a standby takes over at once.

**Exactly once.** A delivery is acknowledged only after each variable of its group
committed it, so a shard killed at any point leaves the messages in the queue (they
return when the deliveries' leases run out). Killed after the apply and before a
commit, Redis is unchanged (the applied copies were in memory); otherwise every variable
either has committed the group's updates with all their ids recorded in the same script,
or has not changed. The next delivery skips the variables that recorded a message's id
and applies the others. Only a message that may have been committed is looked up in the
recorded ids (one round trip): one whose id a variable held when the shard took it over
(committed by an earlier owner, not acked), or one of a group whose ack or commit failed
in this run. Any other is applied without a look-up; should a commit still find one of
its ids recorded (refused as ``dup``, writing nothing), the variable is reloaded and the
group delivered again, looked up this time. A commit that fails drops the in-memory
copies the group had changed (loaded again from their last commit) and gives the
deliveries back. See ``docs/ps.md``.

**Layers.** :class:`Shard` is built in layers, one module each, every one calling only
those below it: :mod:`qps.ps.core` (options, shared state, owning variables),
:mod:`qps.ps.source` (the readers of the gradient queue and list, into the inbox of
:mod:`qps.ps.groups`), :mod:`qps.ps.settle` (acks, releases, stats, dead letters),
:mod:`qps.ps.apply` (checking and applying messages), :mod:`qps.ps.commit` (the commit
plan), :mod:`qps.ps.sync` (synchronous updates and their tokens), and this module (the
lease's life, :mod:`qps.ps.lease`, and the loop that forms groups).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import replace

from qps import metrics as _metrics
from qps.errors import QpsError
from qps.ps import control
from qps.ps.core import (
    DEFAULT_COMMIT_INTERVAL_MS,
    DEFAULT_LEASE_MS,
    DEFAULT_MAX_GROUP,
    DEFAULT_MAX_GROUP_BYTES,
    ShardOptions,
)
from qps.ps.gradlist import GradientList
from qps.ps.groups import _Accum, _deliveries, _each_once, _Group, _Inbox, _Item
from qps.ps.lease import LeaseLostError, dead_holder
from qps.ps.settle import _quietly
from qps.ps.sync import Sync
from qps.queues.base import QueueBase
from qps.transport import Client
from qps.variables import StaleTokenError

__all__ = [
    "DEFAULT_COMMIT_INTERVAL_MS",
    "DEFAULT_LEASE_MS",
    "DEFAULT_MAX_GROUP",
    "DEFAULT_MAX_GROUP_BYTES",
    "LeaseLostError",
    "Shard",
    "ShardOptions",
    "dead_holder",
]

log = logging.getLogger("qps.ps")

#: A group also stays open (while messages are queued) this many times as long as the
#: shard's last commit took: with variables so large that a commit takes longer than
#: commit_interval_ms / COMMIT_SPREAD (a 16 MiB variable with Adam: value and two
#: slots, 48 MiB, about 100 ms), committing stays within about 1 / (1 + COMMIT_SPREAD)
#: of a busy shard's time instead of taking most of it.
COMMIT_SPREAD = 4
#: ... but never longer than this (s): a commit slowed down once (a checkpoint's hold,
#: a stalled server) does not keep the next group open for long.
COMMIT_SPREAD_MAX_S = 2.0
#: The most gradient bytes read ahead of the apply (never less than one message):
#: enough to keep the apply busy, while the buffers of large messages stay few enough
#: to be reused (qps.buffers) rather than mapped afresh.
READ_AHEAD_BYTES = 64 << 20
#: A group's ids are let go with the next ack (its stats go with its own), a round trip
#: less per group; a shard that waits this long for messages sends what waits alone
#: (seconds).
RELEASE_IDLE_S = 0.05


class Shard(Sync):
    """One PS shard process's work (see the module docstring). ``await run()``
    returns ``"finished"`` or ``"stopped"``; :meth:`request_stop` (the ``SIGTERM``
    handler) makes it return after the group of messages in hand.

    Raises (from :meth:`run`):
        LeaseLostError: the lease was lost or the variables fenced by a newer owner.
        InvalidArgumentError: a config or optimizer that disagrees with the stored job.
        FailedPreconditionError: stored slots of another optimizer (without
            ``reset_slots``).
        DataLossError: corrupt job state: its config, placement or lease, or a key of
            a variable it owns (the message names the key; docs/ps.md, "Corrupt state").

    A shard given no optimizer, of a job that has none stored yet, waits until one is
    (another shard starts with one, or :func:`qps.ps.configure` records one).
    """

    def __init__(
        self, client: Client, options: ShardOptions, metrics: _metrics.Metrics | None = None
    ) -> None:
        super().__init__(client, options, metrics)
        self._commit_seconds = 0.0  # how long the last group commit took

    async def run(self) -> str:
        """Take the lease, own the variables, apply messages until the job is finished
        or a stop is requested; return ``"finished"`` or ``"stopped"``."""
        cfg = await control.configure(
            self.client,
            self.container,
            self.options.num_shards,
            self.optimizer,
            max_message_bytes=self.options.max_message_bytes,
        )
        if cfg.optimizer is None:  # another shard, or qps.ps.configure, records it
            self.log.info(
                "waiting for the PS job's optimizer: start a shard of container '%s' with "
                "--optimizer (or call qps.ps.configure)",
                self.container,
            )
            got = await control.wait_for_optimizer(self.client, self.container, self._stop)
            if got is None:
                return "stopped"
            cfg = got
        assert cfg.optimizer is not None  # given, stored, or waited for
        self.optimizer = cfg.optimizer
        self.sync = cfg.sync
        self._max_message = cfg.max_message_bytes
        self._queue = control.gradient_queue(
            self.client, self.container, self.shard, cfg.queue_capacity
        )
        if not self.client.cluster:
            self._list = GradientList(self.client, self.container, self.shard)
        if await self._finished_and_drained():
            self.log.info("the job is finished and my queue is drained: nothing to do")
            return "finished"
        if not await self._acquire():
            return "stopped"
        renew = asyncio.ensure_future(self._renew_loop())
        reason = "stopped"
        try:
            await self._stats(
                {
                    "state": "running",
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started_ms": int(time.time() * 1000),
                    "first_ms": 0,  # set by this run's first applied group
                    "takeover": self.takeover or "",
                },
                {"starts": 1},
            )
            reclaimed = await self._queue.reclaim()  # what dead predecessors held
            if reclaimed:
                self.log.info(
                    "put back %d delivery(ies) a previous owner took and never acknowledged",
                    reclaimed,
                )
            if self._list is not None:
                moved = await self._list.open(self.token, self._prefix + "lease")
                if moved:
                    self.log.info(
                        "put back %d message(s) a previous owner took from the gradient "
                        "list and never committed",
                        moved,
                    )
            await self._own_placed()
            if self.sync is not None:
                self.sync_step = max((o.t for o in self.owned.values()), default=0)
                self._checked_through = self.sync_step
            self.log.info(
                "owning %d variable(s) with token %d, optimizer %s%s",
                len(self.owned),
                self.token,
                self.optimizer.name,
                ""
                if self.sync is None
                else f", synchronous: {self.sync[0]} of {self.sync[1]} replicas per update "
                f"(update {self.sync_step})",
            )
            reason = await self._loop()
        finally:
            renew.cancel()
            await asyncio.gather(renew, return_exceptions=True)
            if self._lost is None:
                await self._release(reason)
        if self._lost is not None:
            raise LeaseLostError(self._lost)
        return reason

    async def _finished_and_drained(self) -> bool:
        if not await control.is_finished(self.client, self.container):
            return False
        assert self._queue is not None
        q = self._queue
        # held: deliveries a dead predecessor took and never acked count as not drained
        drained = await q.is_closed() and await q.size() == 0 and await q.held() == 0
        if drained and self._list is not None:
            drained = await self._list.size() == 0 and await self._list.held() == 0
        return drained

    # -- the lease ---------------------------------------------------------------------------
    async def _acquire(self) -> bool:
        """Take the lease (waiting as a standby while another copy holds it); False if
        a stop was requested first."""
        return await self.lease.acquire(self._stop)

    async def _renew_loop(self) -> None:
        period = self.options.lease_ms / 3000.0
        while True:
            await asyncio.sleep(period)
            try:
                held = await self.lease.renew()
            except QpsError as exc:
                self.log.warning("lease renewal failed: %s", exc)
                continue
            if held is not None:
                self._lost = (
                    f"ps shard {self.shard}: lease lost (now held by {held or 'nobody'}); stopping"
                )
                self.log.error("%s", self._lost)
                self._halt()
                return
            await self._stats(
                {"heartbeat_ms": int(time.time() * 1000), "held_bytes": self._held_bytes()}, {}
            )
            await self._sample()
            if self._list is not None and self._list.proc is not None:
                # a dead owner's take that landed after this owner put its list back
                try:
                    moved = await self._list.reclaim()
                except QpsError as exc:
                    self.log.warning("could not look at earlier owners' lists: %s", exc)
                else:
                    if moved:
                        self.log.warning("put back %d message(s) an earlier owner took", moved)

    async def _release(self, reason: str) -> None:
        try:
            await self.lease.release()
            await self._stats({"state": reason, "held_bytes": 0}, {})
            self.log.info("lease released (%s)", reason)
        except QpsError as exc:
            self.log.warning("could not release the lease (it expires): %s", exc)

    # -- ownership ---------------------------------------------------------------------------
    # -- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> str:
        assert self._queue is not None
        q = self._queue
        o = self.options
        inbox = self._inbox = _Inbox(o.max_group, min(o.max_group_bytes, READ_AHEAD_BYTES))
        self.loop_started = time.monotonic()
        await self._sample()
        fetcher = asyncio.ensure_future(self._fetch(q, inbox))
        toucher = asyncio.ensure_future(self._touch_loop(q))
        lister: asyncio.Future[None] | None = None
        if self._list is not None:
            inbox.sources += 1
            lister = asyncio.ensure_future(self._fetch_list(self._list, inbox))

        def ready() -> bool:
            return bool(inbox.items) or inbox.done or inbox.error is not None or self._stop.is_set()

        try:
            while not self._stop.is_set():
                if self._release_later and not ready():  # idle a while: release now
                    await inbox.until(ready, RELEASE_IDLE_S)
                    if not ready():
                        await self._release_now()
                await inbox.until(ready)
                if self._stop.is_set():
                    break
                if inbox.items:
                    if self.sync is None:
                        await self._group(q, inbox)
                    else:
                        await self._sync_round(q, inbox)
                elif inbox.error is not None:
                    raise inbox.error
                elif inbox.done:
                    if not self._held and await q.held():  # not ours: a dead owner's
                        n = await q.reclaim()
                        self.log.info("put back %d delivery(ies) of a previous owner", n)
                    gl = self._list
                    if gl is not None and await gl.held():  # a dead owner's
                        n = await gl.reclaim()
                        self.log.info("put back %d message(s) of a previous owner", n)
                    again_q = bool(await q.size())  # given back after its reader was done
                    again_l = gl is not None and bool(await gl.size())
                    if again_q or again_l:
                        inbox.done = False
                        inbox.sources = int(again_q) + int(again_l)
                        if again_q:
                            fetcher = asyncio.ensure_future(self._fetch(q, inbox))
                        if again_l and gl is not None:
                            lister = asyncio.ensure_future(self._fetch_list(gl, inbox))
                        continue
                    if self._acc.items:  # an update that can no longer gather its peers
                        await self._drop_unfinished_update(q)
                    self.log.info("the job is finished and my queue is drained: exiting")
                    return "finished"
            return "stopped"
        finally:
            inbox.closing = True
            inbox.wake()
            readers = [fetcher, toucher, *([lister] if lister is not None else [])]
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            if self._settling is not None:  # unacked, its messages come again: applied
                await _quietly(self._settled())
            await _quietly(self._release_now())
            # a failed group's deliveries, then those taken ahead (never applied): back
            # to the front, in order, each once
            taken = [*self._acc.items, *inbox.drain()]
            left = _each_once([*self._give_back, *_deliveries(taken)])
            self._give_back = []
            self._acc = _Accum()
            if left:
                await self._settle(q, left, ack=False)
            if self._list is not None:  # all it holds, a take cut short included
                await _quietly(self._list.close())
            self._senders.clear()  # given back: their next owner gives the credits
            self._inbox = None

    async def _group(self, q: QueueBase, inbox: _Inbox) -> None:
        """Take a group of messages from the inbox, apply them in order to the in-memory
        state, commit each variable once for all of them, advance the global step, ack
        them all, then release their ids (see the module docstring)."""
        o = self.options
        loop = asyncio.get_running_loop()
        spread = min(COMMIT_SPREAD * self._commit_seconds, COMMIT_SPREAD_MAX_S)
        interval = max(o.commit_interval_ms / 1000.0, spread)
        deadline = loop.time() + interval
        g = _Group()

        def more() -> bool:
            return bool(inbox.items) or inbox.done or inbox.error is not None or self._stop.is_set()

        try:
            while True:
                batch: list[_Item] = []
                # whole deliveries only: one that holds several messages is settled once
                while inbox.items and (
                    not g.full(o.max_group, o.max_group_bytes)
                    or (batch and inbox.items[0].delivery is batch[-1].delivery)
                ):
                    item = inbox.take()
                    assert item.delivery is not None
                    g.nbytes += item.nbytes
                    g.messages += 1
                    if not batch or item.delivery is not batch[-1].delivery:
                        g.deliveries.append(item.delivery)
                    batch.append(item)
                await self._absorb(q, g, batch)
                batch.clear()
                self._drop_payloads(g)
                left = deadline - loop.time()
                if self._stop.is_set() or g.full(o.max_group, o.max_group_bytes) or left <= 0:
                    break
                if inbox.items:
                    continue
                if inbox.done or inbox.error is not None:
                    break
                # nothing is coming (none on its way, none queued): commit now
                if not (self._incoming or self._list_incoming) and not await self._queued(q):
                    break
                await inbox.until(more, left)
                if not inbox.items:
                    break
            started = time.perf_counter()
            await self._commit_group(g)
            self._commit_seconds = time.perf_counter() - started
        except StaleTokenError as exc:
            self._lost = f"ps shard {self.shard}: fenced by a newer owner ({exc}); stopping"
            self.log.error("%s", self._lost)
            self._halt()
            self._forget(g)
            self._give_back += g.deliveries  # the loop ends now
            return
        except BaseException:
            # an apply or a commit failed: the copies it touched cannot be trusted, and
            # the messages go back (the variables that committed them skip them)
            self._suspect.update(g.ids)
            self._forget(g)
            self._give_back += g.deliveries
            raise
        if g.redo:  # a variable refused a commit as 'dup' and was reloaded: send it all again
            self._suspect.update(g.ids)  # with what was read ahead of it, in order
            await self._settle(q, [*g.deliveries, *_deliveries(inbox.drain())], ack=False)
            return
        try:
            acked = await self._settle(q, g.deliveries, ack=True, count=g)
        except BaseException:  # given back (they are skipped) if Redis lets us
            self._suspect.update(g.ids)
            self._give_back += g.deliveries
            raise
        if not acked:
            # a lease ran out: the ids stay recorded so that the redelivery is skipped
            self._suspect.update(g.ids)
            return
        self._suspect.difference_update(g.ids)
        await self._released(g)

    async def _queued(self, q: QueueBase) -> int:
        """Messages waiting to be taken: in the queue, and in the gradient list (asked
        in one round trip)."""
        if self._list is None:
            return await q.size()
        commands = [("LLEN", self._list.key), *q.size_commands()]
        replies = await self.client.run_commands(commands)
        size = q.size_of(replies[1:])
        return int(replies[0]) + (await q.size() if size is None else size)

    def _drop_payloads(self, g: _Group) -> None:
        """Let go of the bytes of the group's deliveries, applied or dead-lettered by
        now: until the ack only their tokens are needed, and the buffers of large
        messages are then reused for the next ones (qps.buffers) rather than mapped
        afresh while the group stays open."""
        light = {id(d): replace(d, value=None) for d in g.deliveries if d.value is not None}
        if light:
            g.deliveries = [light.get(id(d), d) for d in g.deliveries]
            self._held = [light.get(id(d), d) for d in self._held]

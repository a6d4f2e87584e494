"""How a PS shard settles what it took (:class:`Settle`, a layer of
:class:`~qps.ps.shard.Shard`): deliveries acknowledged (or given back) in one call, the
gradient list's credits sent with them, the ids of a settled group released, its work
counted in the shard's stats hash, and dead letters recorded. On a single server the
releases and stats of a group ride with the next ack (or commit) instead of a round
trip of their own."""

from __future__ import annotations

import logging
import time
from typing import Any

from qps import keys, varcheck
from qps import metrics as _metrics
from qps.aio import shielded
from qps.errors import (
    AbortedError,
    QpsError,
)
from qps.ps import control
from qps.ps.core import ShardOptions
from qps.ps.gradlist import TAKEN, credit_commands, is_list_delivery
from qps.ps.groups import (
    _Group,
    _joined,
)
from qps.ps.messages import (
    GradientMessage,
)
from qps.ps.source import Readers
from qps.queues.base import Delivery, QueueBase
from qps.transport import Client

log = logging.getLogger("qps.ps")


def _coalesced(commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Releases and stats writes (``_release_later``) in as few commands as do the same:
    one ``ZREM`` per key with all its ids, one ``HINCRBY`` per field with the sum, one
    ``HSET`` per key with each field's last value; anything else as it is, after them."""
    zrem: dict[Any, list[Any]] = {}
    incr: dict[tuple[Any, Any], int] = {}
    hset: dict[Any, dict[Any, Any]] = {}
    other: list[tuple[Any, ...]] = []
    for c in commands:
        name = c[0]
        if name == "ZREM":
            zrem.setdefault(c[1], []).extend(c[2:])
        elif name == "HINCRBY":
            incr[c[1], c[2]] = incr.get((c[1], c[2]), 0) + int(c[3])
        elif name == "HSET" and len(c) % 2 == 0:
            fields = hset.setdefault(c[1], {})
            fields.update(zip(c[2::2], c[3::2]))
        else:
            other.append(c)
    out: list[tuple[Any, ...]] = [("ZREM", k, *dict.fromkeys(ids)) for k, ids in zrem.items()]
    out += [("HINCRBY", k, f, n) for (k, f), n in incr.items() if n]
    out += [("HSET", k, *(x for kv in fs.items() for x in kv)) for k, fs in hset.items()]
    return out + other


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except QpsError as exc:  # never a cancellation of the caller: it must go on
        log.debug("ignored: %r", exc)


class Settle(Readers):
    """The shard's settling and bookkeeping (module docstring)."""

    def __init__(
        self, client: Client, options: ShardOptions, metrics: _metrics.Metrics | None = None
    ) -> None:
        super().__init__(client, options, metrics)
        self._applied_once = False  # stats' first_ms written (this run's first apply)
        #: the last groups' releases (their ids, their stats), acked and not yet sent:
        #: they go with the next ack, or once the shard has waited RELEASE_IDLE_S
        self._release_later: list[tuple[Any, ...]] = []

    async def _settle(
        self, q: QueueBase, ds: list[Delivery], *, ack: bool, count: _Group | None = None
    ) -> bool:
        """Ack (or nack) deliveries in one call and stop holding them. An ack returns
        False if a lease had run out (those messages come again); a nack never raises.

        An ack carries in its round trip (on a single server) the releases of the
        groups acked before, and ``count``'s stats: see :meth:`_released`."""
        self._unhold(ds)
        listed = [d for d in ds if is_list_delivery(d)]
        if listed:  # the gradient list's: given back all at once when the loop ends
            ds = [d for d in ds if not is_list_delivery(d)]
        if not ack:
            if ds:
                await _quietly(shielded(q.nack(_joined(ds))))
            return True
        after: list[tuple[Any, ...]] = []
        if not self.client.cluster:
            if count is not None:
                self._release_later += self._stats_commands(count)
            if listed or any(d.tokens for d in ds):  # what waits for an ack goes with it
                after, self._release_later = _coalesced(self._release_later), []
        popped = True
        if listed:
            assert self._list is not None
            credits: dict[str, int] = {}
            for d in listed:
                sender = self._senders.pop(d.tokens, None)
                if sender is not None:  # asynchronous training: one credit back each
                    credits[sender] = credits.get(sender, 0) + 1
            if credits:
                after = [*after, *credit_commands(self.container, credits, self.shard)]
            popped = await self._list.ack(listed, after=after)
            after = []
            if not popped:  # the lease is another owner's: it gives them back
                self.log.warning("the gradient list's pop was refused: the lease was lost")
        if not ds:
            return popped
        joined = _joined(ds)
        try:
            await q.ack(joined, after=after)
        except AbortedError as exc:
            self.log.warning("%s", exc)
            return False
        return popped

    def _unhold(self, ds: list[Delivery]) -> None:
        """Stop holding deliveries ``ds`` (settled)."""
        gone = {id(d) for d in ds}
        self._held = [d for d in self._held if id(d) not in gone]  # by identity
        for d in ds:
            self._sizes.pop(d.tokens, None)

    def _stats_commands(self, g: _Group) -> list[tuple[Any, ...]]:
        """The writes that count a group's work in the shard's stats hash."""
        incr: dict[str, int] = {}
        if g.fresh:
            incr = {"applied": g.fresh, "rows": g.rows, "bytes": g.bytes}
        if g.skipped:
            incr["skipped"] = g.skipped
        for worker, staleness in g.stale:
            k = f"stale|{worker}|{control.stale_bucket(staleness)}"
            incr[k] = incr.get(k, 0) + 1
        if g.fresh or g.skipped:
            incr["groups"] = 1
        if self._list_taken:  # what the reader took meanwhile (one field, same write)
            incr[TAKEN], self._list_taken = self._list_taken, 0
        stats = self._prefix + "stats"
        writes: list[tuple[Any, ...]] = [("HINCRBY", stats, k, n) for k, n in incr.items()]
        now_ms = int(time.time() * 1000)
        marks: dict[str, int] = {"last_ms": now_ms, "held_bytes": self._held_bytes()}
        if g.fresh and not self._applied_once:  # this run's first applied group
            marks["first_ms"] = now_ms
            self._applied_once = True
        writes.append(("HSET", stats, *(x for kv in marks.items() for x in kv)))
        return writes

    async def _released(self, g: _Group) -> None:
        """After an ack that took: forget the group's ids and count what was done.

        On a single server the group's stats went with its ack (whatever it answered: an
        ack that finds a lease run out still counts messages whose commit took), and its
        ids go with the next ack, or once the shard waits for messages (a round trip
        less per group). On a cluster (other slots than the queue's) both go now."""
        self.applied += g.fresh
        self.skipped += g.skipped
        self.metrics.committed(g.fresh, g.started, g.stale)
        release: dict[str, list[str]] = {}
        for mid, names, step in g.applied:  # applied now or before: every id recorded
            for name in names:
                release.setdefault(keys.variable_applied(self.container, name), []).append(mid)
            if step:
                gs_key = keys.counter_applied(self.container, keys.GLOBAL_STEP)
                release.setdefault(gs_key, []).append(mid)
        self._release_later += [("ZREM", k, *ids) for k, ids in release.items()]
        if self.client.cluster:  # of several slots: not with an ack, now
            self._release_later += self._stats_commands(g)
            await self._release_now()
        self.log.debug(
            "group of %d message(s): %d applied, %d skipped; committed %s",
            g.messages,
            g.fresh,
            g.skipped,
            ", ".join(f"{n} x{len(v.ids)}" for n, v in g.vars.items()) or "-",
        )

    async def _release_now(self) -> None:
        """Run the releases that wait for an ack to go with (the shard is idle, or
        stops)."""
        commands, self._release_later = _coalesced(self._release_later), []
        if commands:
            try:
                await self.client.run_commands(commands)
            except QpsError as exc:  # the ids expire (APPLIED_KEEP_MS)
                self.log.warning("could not release the ids of a group: %s", exc)

    def _release_replies(self, replies: list[Any]) -> None:
        """The replies of releases that rode with a commit: a failure is logged (the
        ids expire, APPLIED_KEEP_MS)."""
        bad = next((r for r in replies if isinstance(r, BaseException)), None)
        if bad is not None:
            self.log.warning("could not release the ids of a group: %s", bad)

    async def _dead_letter(
        self,
        msg: GradientMessage | None,
        reason: str,
        *,
        variable: str | None = None,
        raw: bytes = b"",
        size: int | None = None,
    ) -> None:
        self.dead += 1
        entry: dict[str, Any] = {"reason": reason, "time": time.time(), "shard": self.shard}
        if msg is not None:
            entry.update(msg.provenance())
        if variable is not None:
            entry["variable"] = variable
        if size is not None:  # the message's size, its bytes not kept
            entry["size"] = size
        entry["data"] = raw
        self.log.warning("dead letter%s: %s", f" {msg.id}" if msg is not None else "", reason)
        with varcheck.naming(self._prefix + "dlq"):
            batch = self.client.batch()
            batch.rpush(self._prefix + "dlq", control.encode_dead_letter(entry))
            batch.hincrby(self._prefix + "stats", "dead_letters", 1)
            dlq_length, counted = await batch.run(raise_on_error=False)
            if isinstance(dlq_length, Exception):
                raise dlq_length
        if isinstance(counted, Exception):  # as any stats write (see _stats)
            self.log.warning("could not write stats: %s", counted)
        self.metrics.dead_letters.set(dlq_length)

    def _held_bytes(self) -> int:
        """Bytes of the messages this process holds: read ahead and in the group."""
        return sum(self._sizes.get(d.tokens, 0) for d in self._held)

    async def _sample(self) -> None:
        """Read the queue's size and the dead-letter list's length for the metrics (at
        the start and with every lease renewal)."""
        try:
            assert self._queue is not None
            depth = await self._queue.size()
            dead = await self.client.llen(self._prefix + "dlq")
        except QpsError as exc:
            self.log.debug("could not sample the queue for the metrics: %s", exc)
            return
        self.metrics.sampled(depth, int(dead))

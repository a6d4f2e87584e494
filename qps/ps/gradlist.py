"""The lean gradient channel of training on a single server.

In synchronous training a worker pushes one gradient per update and then blocks on its
token: the token gates it, so its gradients need no queue capacity, no waiting pushes
and no attempt records. What is left of the gradient queue's work is a reliable hand-off
to the shard, and a plain Redis list gives that with one command each way (docs/ps.md,
"Exactly once"):

* a worker ``RPUSH``es its encoded message onto the shard's list ``<S>glist``, in the
  round trip that then blocks on its token and reads the next parameters;
* the shard takes each message with ``BLMOVE`` into a processing list of its own,
  ``<S>glist:proc:<token>`` (its lease's fencing token), where the message stays until
  the update that applies it is committed: the shard then drops it from the front
  (``LTRIM``; one done out of order, e.g. a stale gradient dropped while earlier ones
  wait for their update, is overwritten with a one-byte tombstone in place);
* a shard that stops gives back what its processing list holds, in order, to the front
  of the list; a shard that takes the lease over from a dead one does the same with
  every other processing list (the set ``<S>glist:procs`` names them), at the start
  and with every renewal of its lease: a ``BLMOVE`` a dead owner left blocked in Redis
  may still move a message into its list after that. A name leaves the set only when
  its owner stops cleanly. What comes again and was committed is found in the
  variables' applied ids and skipped, as with the queue;
* the pops and tombstones run in a script that checks the shard's lease still holds
  its token: an owner that lost the lease cannot pop what a successor depends on.

The list's traffic is counted in the shard's stats hash, for the status commands (a
queue counts its own, ``enq``/``deq``): a worker's push adds one to ``list_pushed`` in
its round trip (a ``HINCRBY`` after the ``RPUSH``, same slot), and the shard adds what it
took to ``list_taken`` with the stats it writes after each group's ack (and each lease
renewal). :func:`list_counts` reads them with the list's length.

``mark_finished`` pushes an empty element (never a message) to wake a shard blocked on
the list.

Asynchronous training uses the list too, with flow control in place of the queue's
capacity: a worker may have at most ``window`` (the job's ``queue_capacity``) messages
on a shard that the shard has not settled (applied, skipped as applied before, or
dead-lettered). The shard gives one **credit** back per settled message, an element
``RPUSH``ed onto ``<S>glist:credit:<worker>`` in its ack's round trip; a worker picks
up what credits came back with ``LPOP ... COUNT`` in each push's round trip, and blocks
in ``BLPOP`` on that list (woken the moment the shard settles one of its messages)
before a push that would exceed its window. A shard that falls behind takes what
waits in one round trip of ``LMOVE``s (:meth:`GradientList.take_many`).

Redis Cluster (where the shard's keys and the workers' pipelines would span slots)
goes through the gradient queue (:func:`qps.ps.control.gradient_queue`), which every
shard reads as well, and so do messages over :data:`LIST_MAX_BYTES`, which the queue
moves in chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qps import keys
from qps.queues.base import Delivery
from qps.registry import text_of
from qps.transport import Client

__all__ = [
    "LIST_MAX_BYTES",
    "PUSHED",
    "TAKEN",
    "WAKE",
    "GradientList",
    "ListCounts",
    "credit_key",
    "gradient_list_key",
    "gradient_queue_shard",
    "is_list_delivery",
    "list_bytes",
    "list_counts",
    "queue_list_counts",
    "stats_key",
]

#: the largest message pushed onto the list; a larger one goes through the gradient
#: queue, which moves it in chunks (the queue's own limit for an element kept inline)
LIST_MAX_BYTES = 1 << 20
#: how long each take after the first of :meth:`GradientList.take_each` waits: the
#: messages of one synchronous update come within milliseconds of each other
FOLLOW_SECONDS = 0.1
#: the element ``mark_finished`` pushes to wake a blocked shard (a message never is empty)
WAKE = b""
#: the shard's stats hash fields that count the list's traffic: messages pushed onto it
#: (by the workers, one ``HINCRBY`` in each push's round trip) and taken from it (by the
#: shard, redeliveries after a restart included, with the stats it writes after an ack)
PUSHED = "list_pushed"
TAKEN = "list_taken"
#: what an element acknowledged out of order is overwritten with inside a processing list
TOMBSTONE = b"\x00"
#: a delivery of the list carries one token: this prefix and its sequence number
_TAG = "glist:"


async def list_bytes(client: Client, container: str, shard: int) -> int:
    """The bytes of the messages waiting in shard ``shard``'s gradient list (one script
    that reads them all: for status commands, not hot paths)."""
    return int(await client.run_script("ps/list_bytes", [gradient_list_key(container, shard)], []))


def stats_key(container: str, shard: int) -> str:
    """Shard ``shard``'s stats hash (its counters; the list's are :data:`PUSHED` and
    :data:`TAKEN`)."""
    return keys.ps_prefix(container, shard) + "stats"


@dataclass(frozen=True)
class ListCounts:
    """Shard ``shard``'s gradient list: messages ever ``pushed`` onto it, ``taken`` from
    it by the shard (a message given back by a shard that stopped and taken again counts
    again), and ``waiting`` in it now."""

    shard: int
    key: str
    pushed: int
    taken: int
    waiting: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "key": self.key,
            "pushed": self.pushed,
            "taken": self.taken,
            "waiting": self.waiting,
        }


async def list_counts(client: Client, container: str, shard: int) -> ListCounts:
    """Read shard ``shard``'s :class:`ListCounts` (one round trip)."""
    key = gradient_list_key(container, shard)
    batch = client.batch().hmget(stats_key(container, shard), [PUSHED, TAKEN]).llen(key)
    (pushed, taken), waiting = await batch.run()
    return ListCounts(shard, key, int(pushed or 0), int(taken or 0), int(waiting))


def gradient_queue_shard(name: str) -> int | None:
    """The shard whose gradient queue is named ``name`` (``ps/<i>/grads``), else None."""
    head, _, tail = name.partition("/")
    index, _, rest = tail.partition("/")
    ok = head == "ps" and rest == "grads" and index.isdigit()
    return int(index) if ok and keys.ps_gradient_queue(int(index)) == name else None


async def queue_list_counts(
    client: Client, container: str, names: Sequence[str]
) -> dict[str, ListCounts]:
    """For each gradient queue among queue ``names``, its shard's :class:`ListCounts`
    (none on a cluster: the workers push onto the queue there)."""
    if client.cluster:
        return {}
    shards = {n: i for n in names if (i := gradient_queue_shard(n)) is not None}
    return {n: await list_counts(client, container, i) for n, i in shards.items()}


def gradient_list_key(container: str, shard: int) -> str:
    """The list of shard ``shard``'s pushed gradient messages."""
    return keys.ps_prefix(container, shard) + "glist"


def credit_key(container: str, shard: int, worker: str) -> str:
    """The list of credits shard ``shard`` gives worker ``worker`` back (asynchronous
    training: one element per settled message)."""
    return gradient_list_key(container, shard) + ":credit:" + worker


def credit_commands(
    container: str, credits: Mapping[str, int], shard: int
) -> list[tuple[Any, ...]]:
    """The ``RPUSH``es that give each worker of ``credits`` (worker -> count) its
    credits back on ``shard``."""
    return [
        ("RPUSH", credit_key(container, shard, w), *([b"1"] * n))
        for w, n in sorted(credits.items())
        if n > 0
    ]


def is_list_delivery(d: Delivery) -> bool:
    """Whether ``d`` came from a :class:`GradientList` (else from the gradient queue)."""
    return len(d.tokens) == 1 and d.tokens[0].startswith(_TAG)


class GradientList:
    """Shard ``shard``'s lean gradient channel (see the module docstring): the worker's
    :meth:`push_command`, and the shard's :meth:`open`, :meth:`take`, :meth:`ack` and
    :meth:`give_back`."""

    def __init__(self, client: Client, container: str, shard: int) -> None:
        self.client = client
        self.key = gradient_list_key(container, shard)
        self.stats = stats_key(container, shard)
        self.procs = self.key + ":procs"
        self.proc: str | None = None  # this owner's processing list, once opened
        self._lease = ""  # the shard's lease key, and its token, once opened
        self._token = 0
        self._taken = 0  # elements moved into the processing list by this owner
        self._popped = 0  # of them, popped from its front
        self._acked: set[int] = set()  # acknowledged out of order: tombstones in place
        #: messages waiting in the list after the last :meth:`take_many` (its LLEN)
        self.waiting = 0

    # -- the worker's side ---------------------------------------------------------------
    def push_command(self, payload: Any) -> tuple[Any, ...]:
        """The command that pushes one encoded message (bytes or a buffer)."""
        return ("RPUSH", self.key, payload)

    def count_command(self, n: int = 1) -> tuple[Any, ...]:
        """The command that counts ``n`` messages pushed (sent with the push; -1 for
        one taken back)."""
        return ("HINCRBY", self.stats, PUSHED, n)

    # -- the shard's side ----------------------------------------------------------------
    async def open(self, token: int, lease_key: str) -> int:
        """Consume as the holder of lease ``token`` (the shard's lease, ``lease_key``,
        holds ``"<token> <owner>"``): register the processing list, and put back what
        the other processing lists hold. Returns how many messages were put back."""
        self.proc = f"{self.key}:proc:{int(token)}"
        self._lease, self._token = lease_key, int(token)
        self._taken = self._popped = self.waiting = 0
        self._acked.clear()
        await self.client.sadd(self.procs, self.proc)
        return await self.reclaim()

    async def reclaim(self) -> int:
        """Put back, at the front of the list and in order, what the processing lists of
        other (earlier) owners hold; the oldest owner's messages come first. Their
        names stay registered (a dead owner's blocked take may still fill its list)."""
        others = sorted(await self._others(), key=_token_of, reverse=True)
        moved = 0
        for name in others:  # the newest first: each goes in front of the one before
            moved += await self._give_back(name)
        return moved

    async def held(self) -> int:
        """Messages in the processing lists of other owners (taken, never acknowledged)."""
        others = await self._others()
        if not others:
            return 0
        batch = self.client.batch()
        for n in others:
            batch.llen(n)
        return sum(int(x) for x in await batch.run())

    async def _others(self) -> list[str]:
        """The registered processing lists other than this owner's."""
        names = [text_of(n) for n in await self.client.smembers(self.procs)]
        return [n for n in names if n != self.proc]

    async def size(self) -> int:
        """Messages waiting in the list."""
        return await self.client.llen(self.key)

    async def take(self, timeout: float) -> Delivery | None:
        """Block up to ``timeout`` seconds for the next message and move it into the
        processing list; None if none came (or :data:`WAKE` did). A failure leaves the
        processing list unknown at its end: the caller stops and :meth:`give_back`."""
        assert self.proc is not None, "open() first"
        command = ("BLMOVE", self.key, self.proc, "LEFT", "RIGHT", timeout)
        replies = await self.client.write_commands([command])
        if replies is None:  # no lean connection (fakeredis)
            got = await self._blmove(timeout)
        else:
            got = replies[0]
            if isinstance(got, BaseException):
                raise got
        return None if got is None else await self._message(got)

    async def take_each(
        self, n: int, timeout: float, then: float = FOLLOW_SECONDS
    ) -> AsyncIterator[Delivery | None]:
        """``n`` takes sent in one write, the first blocking up to ``timeout`` seconds and
        each of the others up to ``then`` seconds after the one before it: yields each
        one's message as it comes, or None where none came (or :data:`WAKE` did). The
        shard gets a message while the takes after it still wait in Redis: the next
        message costs no round trip of its own. Leaving early cancels the takes not yet
        answered, and a failure or a cancellation leaves the processing list unknown at
        its end (a cancelled take may still move a message): the caller stops and
        :meth:`give_back`. Never leave early to go on."""
        assert self.proc is not None, "open() first"
        first = ("BLMOVE", self.key, self.proc, "LEFT", "RIGHT", timeout)
        more = ("BLMOVE", self.key, self.proc, "LEFT", "RIGHT", then)
        futures = await self.client.send_each([first, *([more] * (n - 1))])
        if futures is None:  # no lean connection (fakeredis): one at a time
            for _ in range(n):
                yield await self.take(timeout)
            return
        try:
            for fut in futures:
                got = await fut
                if isinstance(got, BaseException):
                    raise got
                yield None if got is None else await self._message(got)
        finally:
            for fut in futures:
                if not fut.done():
                    fut.cancel()

    async def take_many(self, room: int, timeout: float) -> list[Delivery]:
        """Up to ``room`` messages moved into the processing list, in order, with the
        list's length after them read in the same round trip (:attr:`waiting`). With
        none known to wait, block up to ``timeout`` seconds for the first (an empty
        list: none came, or :data:`WAKE` did). A failure leaves the processing list
        unknown at its end: the caller stops and :meth:`give_back`."""
        assert self.proc is not None, "open() first"
        move = ("LMOVE", self.key, self.proc, "LEFT", "RIGHT")
        if self.waiting > 0:
            n = max(1, min(room, self.waiting))
            replies = await self.client.run_commands_replies([*([move] * n), ("LLEN", self.key)])
        else:
            wait = ("BLMOVE", self.key, self.proc, "LEFT", "RIGHT", timeout)
            got = await self.client.write_commands([wait, ("LLEN", self.key)])
            if got is None:  # no lean connection (fakeredis)
                got = [await self._blmove(timeout), await self.size()]
            replies = got
        for r in replies:
            if isinstance(r, BaseException):
                raise r
        self.waiting = int(replies[-1])
        out: list[Delivery] = []
        wakes: list[Delivery] = []
        for got in replies[:-1]:
            if got is None:  # gone meanwhile (given back to another owner): none left
                continue
            d = self._delivery(got)
            (out if len(d.value) else wakes).append(d)
        if wakes:  # done with them
            await self.ack(wakes)
        return out

    async def _blmove(self, timeout: float) -> Any:
        """One take through redis-py (a client without lean connections: fakeredis)."""
        assert self.proc is not None
        return await self.client.blmove(self.key, self.proc, timeout)

    async def _message(self, got: Any) -> Delivery | None:
        """The element a take moved as a delivery; None for :data:`WAKE`, acknowledged
        at once (it is no message)."""
        d = self._delivery(got)
        if not len(d.value):
            await self.ack([d])
            return None
        return d

    def _delivery(self, got: Any) -> Delivery:
        """The next message moved into the processing list, as a delivery of its own."""
        seq = self._taken
        self._taken += 1
        data = got.encode() if isinstance(got, str) else got
        return Delivery(np.frombuffer(data, np.uint8), (f"{_TAG}{seq}",), True)

    async def ack(self, ds: Sequence[Delivery], after: Sequence[Sequence[Any]] = ()) -> bool:
        """Done with deliveries ``ds`` (of :meth:`take`): the processing list's front
        is popped as far as every message of it is done; one done behind a message
        still held is overwritten with a tombstone. False if the lease is another
        owner's: nothing was popped (the next owner gives them back, and their ids must
        stay recorded). ``after``: plain commands sent in the same round trip (their
        failures are not raised)."""
        assert self.proc is not None
        late = []
        for d in ds:
            seq = int(d.tokens[0][len(_TAG) :])
            if seq >= self._popped and seq not in self._acked:
                self._acked.add(seq)
                late.append(seq)
        front = 0
        while self._popped + front in self._acked:
            front += 1
        marks = [seq - self._popped for seq in late if seq >= self._popped + front]
        if not (front or marks) and not after:
            return True
        # the state moves before the round trip: a concurrent ack then counts from it,
        # and its commands follow these on the connection
        for seq in range(self._popped, self._popped + front):
            self._acked.discard(seq)
        self._popped += front
        if not (front or marks):
            await self.client.run_commands_replies(after)
            return True
        args: list[Any] = [self._token, TOMBSTONE, front, *marks]
        reply, _ = await self.client.run_script_then_commands(
            "ps/list_ack", [self.proc, self._lease], args, after, once=True
        )
        return bool(int(reply))

    def front_ack(self, ds: Sequence[Delivery]) -> tuple[list[str], list[Any]] | None:
        """The keys and arguments with which another script acknowledges ``ds`` (a
        synchronous shard's guarded token script, in its commit's round trip) when they
        are exactly the messages at the processing list's front: its lease check and a
        trim of that many (as ``ps/list_ack`` does); None otherwise (use :meth:`ack`). The
        state does not move: call :meth:`acked_front` once that script ran."""
        assert self.proc is not None
        seqs = sorted(int(d.tokens[0][len(_TAG) :]) for d in ds)
        if not seqs or seqs != list(range(self._popped, self._popped + len(seqs))):
            return None
        return [self.proc, self._lease], [self._token, len(seqs)]

    def acked_front(self, n: int) -> None:
        """The ``n`` messages at the processing list's front were acknowledged by a
        script given :meth:`front_ack`'s keys and arguments (whether or not its lease
        check let it pop them: the lease lost, the shard stops)."""
        self._popped += n

    async def give_back(self) -> int:
        """Put everything the processing list holds back at the front of the list, in
        order (the shard stops: what it held was not committed). Returns how many."""
        if self.proc is None:
            return 0
        n = await self._give_back(self.proc)
        self._popped = self._taken
        self._acked.clear()
        self.waiting = 0
        return n

    async def _give_back(self, proc: str) -> int:
        """Move processing list ``proc``'s messages to the list's front; how many."""
        return int(await self.client.run_script("ps/list_give_back", [proc, self.key], [TOMBSTONE]))

    async def close(self) -> None:
        """Stop consuming: :meth:`give_back`, then forget the processing list."""
        if self.proc is None:
            return
        await self.give_back()
        await self.client.srem(self.procs, self.proc)
        self.proc = None


def _token_of(name: str) -> int:
    tail = name.rpartition(":")[2]
    return int(tail) if tail.isdigit() else 0

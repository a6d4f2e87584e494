"""A PS shard: the single writer of the variables placed on it (docs/ps.md).

Shard ``i`` of a job in container ``C``:

1. **Takes the lease** ``qps:{C/ps/i}:lease`` (``SET NX PX``, value ``"<token>
   <owner>"``) with a fresh fencing token from the container counter ``ps/token``
   (``INCR``: every lease gets a larger one). While another copy holds the lease it
   waits as a standby, blocked in ``BLPOP`` on ``qps:{C/ps/i}:wake`` (pushed when a
   holder releases), never polling. It renews the lease every third of its length.
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
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from qps import keys, varcheck, variables
from qps import metrics as _metrics
from qps.aio import shielded
from qps.containers import Counter
from qps.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    QpsError,
    WouldBlockError,
)
from qps.optimizers import Adam, Optimizer
from qps.owners import default_owner, owner_is_dead
from qps.ps import control
from qps.ps.gradlist import (
    POP_FRONT_LUA,
    TAKEN,
    GradientList,
    credit_commands,
    is_list_delivery,
)
from qps.ps.groups import (
    _Accum,
    _deliveries,
    _each_once,
    _Group,
    _Inbox,
    _Item,
    _joined,
    _nbytes,
    _Pending,
)
from qps.ps.messages import (
    GradientMessage,
    SparseGradient,
    check_gradient,
    decode_message,
    is_finite,
    widen,
)
from qps.ps.status import check_lease
from qps.queues.base import Delivery, QueueBase
from qps.queues.waiters import LEASE_MS as DELIVERY_LEASE_MS
from qps.transport import BLOCK_SECONDS, Client, is_noscript, map_errors
from qps.variables import (
    APPLIED_KEEP_MS,
    AlreadyAppliedError,
    StaleTokenError,
    Variable,
    open_variable,
)

__all__ = ["LeaseLostError", "Shard", "ShardOptions"]

log = logging.getLogger("qps.ps")

#: Default length of a shard's lease (ms); it renews every third of it.
DEFAULT_LEASE_MS = 10_000
#: Default bounds of one group commit: messages, and bytes of gradients (a single larger
#: message still makes a group of one). The shard also reads ahead up to these bounds
#: (and READ_AHEAD_BYTES).
DEFAULT_MAX_GROUP = 64
DEFAULT_MAX_GROUP_BYTES = 256 << 20
#: Default longest time (ms) a group stays open, from its first message, to take
#: messages that are in the queue; it never waits when the queue is empty.
DEFAULT_COMMIT_INTERVAL_MS = 100
#: A group also stays open (while messages are queued) this many times as long as the
#: shard's last commit took: with variables so large that a commit takes longer than
#: commit_interval_ms / COMMIT_SPREAD (a 16 MiB variable with Adam: value and two
#: slots, 48 MiB, about 100 ms), committing stays within about 1 / (1 + COMMIT_SPREAD)
#: of a busy shard's time instead of taking most of it.
COMMIT_SPREAD = 4
#: ... but never longer than this (s): a commit slowed down once (a checkpoint's hold,
#: a stalled server) does not keep the next group open for long.
COMMIT_SPREAD_MAX_S = 2.0
#: Gradient bytes of a batch from which the rule runs in a worker thread (NumPy releases
#: the GIL in large ufuncs, so the next messages are read meanwhile); below it, inline.
THREAD_MIN_BYTES = 1 << 20
#: The most gradient bytes read ahead of the apply (never less than one message):
#: enough to keep the apply busy, while the buffers of large messages stay few enough
#: to be reused (qps.buffers) rather than mapped afresh.
READ_AHEAD_BYTES = 64 << 20
#: A group's ids are let go with the next ack (its stats go with its own), a round trip
#: less per group; a shard that waits this long for messages sends what waits alone
#: (seconds).
RELEASE_IDLE_S = 0.05
#: A synchronous shard's acknowledgements go with its tokens: the releases and stats
#: kept meanwhile ride with a commit (after its tokens) once this many commands wait.
RIDE_COMMANDS = 64
#: How long the count of the shards that committed a synchronous update is kept (ms).
DONE_TTL_MS = 3_600_000


class LeaseLostError(FailedPreconditionError):
    """The shard lost its lease (it stalled past it, or another copy took over and
    fenced its variables): it stops writing and exits."""


# KEYS: lease, wake. ARGV: op, value, ttl (ms) [, the holder's value to take over from].
_LEASE = """
local op = ARGV[1]
if op == 'acquire' then
  if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[3]) then return {'ok'} end
  return {'held', redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[1])}
end
if op == 'takeover' then  -- from a holder known to be dead, if it still holds it
  if redis.call('GET', KEYS[1]) ~= ARGV[4] then return {'moved'} end
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return {'ok'}
end
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[2] then return {'lost', cur or ''} end
if op == 'renew' then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'ok'}
end
redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], 60000)
return {'ok'}
"""

# KEYS: counter value, counter applied. ARGV: keep (ms), message id... Advances the
# counter by one per id not recorded yet, and records them. Reply: {advanced, value}.
_COUNT_STEPS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = 0
for i = 2, #ARGV do
  if not redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZADD', KEYS[2], now, ARGV[i])
    n = n + 1
  end
end
local old = '(' .. string.format('%.0f', now - tonumber(ARGV[1]))
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', old)
if n == 0 then return {0, redis.call('GET', KEYS[1]) or '0'} end
return {n, redis.call('INCRBY', KEYS[1], n)}
"""

# Synchronous training on a single server: the workers' tokens, sent in the commit's
# round trip, after its scripts, and given only if the update committed; and, if asked,
# the update's messages acknowledged with them (the gradient list's front trimmed, as
# qps.ps.gradlist's ack script does, if the shard's lease still holds its token).
# KEYS: the updated variables' metas, the workers' token lists, the global step's
# applied ids ('' when another shard counts it: else the update's id 'sync.<step>' is
# among them), the update's done counter ('' with one shard holding variables)[, the
# processing list, the shard's lease].
# ARGV: the number of variables, the shard's fencing token, each variable's version
# once committed, the update's step, the shards that hold variables, the done
# counter's time to live (ms)[, the lease's token, how many messages to trim].
# Reply: {code, acked}: code 1 tokens given; 2 counted, another shard gives them; 0 the
# update is not (all) committed: nothing done. acked: 1 trimmed, 0 the lease is
# another's (nothing trimmed), -1 not asked (or code 0).
_TOKENS_IF_COMMITTED = (
    POP_FRONT_LUA
    + """
local n = tonumber(ARGV[1])
local last = #KEYS
if #ARGV > n + 5 then last = last - 2 end
for i = 1, n do
  local m = redis.call('HMGET', KEYS[i], 'token', 'ver')
  if tonumber(m[1]) ~= tonumber(ARGV[2]) or tonumber(m[2]) ~= tonumber(ARGV[2 + i]) then
    return {0, -1}
  end
end
local step, needed = ARGV[3 + n], tonumber(ARGV[4 + n])
local gs, done = KEYS[last - 1], KEYS[last]
if gs ~= '' and not redis.call('ZSCORE', gs, 'sync.' .. step) then return {0, -1} end
local acked = -1
if last < #KEYS then
  acked = 0
  if holds(KEYS[last + 2], ARGV[n + 6]) then
    pop_front(KEYS[last + 1], ARGV[n + 7])
    acked = 1
  end
end
if needed > 1 then
  local count = redis.call('INCR', done)
  redis.call('PEXPIRE', done, ARGV[5 + n])
  if count ~= needed then return {2, acked} end
end
for i = n + 1, last - 2 do redis.call('RPUSH', KEYS[i], step) end
return {1, acked}
"""
)


def dead_holder(value: str) -> bool:
    """Whether the lease value ``value`` (``<token> <owner>``) names a shard process of
    this host and PID namespace that no longer exists: its lease can be taken over at
    once instead of waiting for it to expire (see :func:`qps.owners.owner_is_dead`)."""
    parts = value.split(" ", 1)
    return len(parts) == 2 and owner_is_dead(parts[1])


@dataclass
class ShardOptions:
    """How to run shard ``shard`` of ``num_shards``.

    Attributes:
        optimizer: the rule to apply; None: the one stored in the job's config.
        lease_ms: the lease length (a dead shard's standby waits at most this long).
        reset_slots: replace stored slots of another optimizer by fresh ones (else
            that is an error).
        owner: names this run in the lease and the logs.
        max_group: the most messages one group commit applies (1: one commit per
            message, as without groups).
        max_group_bytes: the most gradient bytes one group takes (a larger message
            makes a group of its own).
        commit_interval_ms: how long a group stays open after its first message to take
            messages that are in the queue (0: only those already read); it commits at
            once when the queue is empty. Checked after each batch taken (a batch is
            every message read ahead). Bounds the delay a busy shard adds before a
            gradient is visible, and how often it commits under load. A busy shard
            whose commits take longer than a quarter of it keeps groups open for
            :data:`COMMIT_SPREAD` times its last commit's duration instead (at most
            :data:`COMMIT_SPREAD_MAX_S`).
        max_message_bytes: the job's largest gradient message (set once, like the
            number of shards: see :func:`qps.ps.configure`); None: the stored one, or
            :data:`~qps.ps.control.DEFAULT_MAX_MESSAGE_BYTES`. A larger message that
            arrives anyway is dead-lettered (without its bytes), never applied.
    """

    shard: int
    num_shards: int
    container: str = keys.DEFAULT_CONTAINER
    optimizer: Optimizer | None = None
    lease_ms: int = DEFAULT_LEASE_MS
    reset_slots: bool = False
    owner: str = field(default_factory=default_owner)
    max_group: int = DEFAULT_MAX_GROUP
    max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES
    commit_interval_ms: float = DEFAULT_COMMIT_INTERVAL_MS
    max_message_bytes: int | None = None


@dataclass
class _Owned:
    """A variable the shard writes, with its in-memory state (the truth while it owns it)."""

    var: Variable
    value: npt.NDArray[Any]
    slots: dict[str, npt.NDArray[Any]]
    version: int
    t: int


class _Log(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return f"{self.extra['role']}: {msg}", kwargs  # type: ignore[index]


class _Rejected(Exception):
    """A message that must not be applied: dead-letter it with this reason."""

    def __init__(self, reason: str, variable: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.variable = variable


class Shard:
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
        o = options
        if not 0 <= o.shard < o.num_shards:
            raise InvalidArgumentError(f"shard {o.shard} is not in [0, {o.num_shards})")
        if o.max_group < 1 or o.max_group_bytes < 1 or not o.commit_interval_ms >= 0:
            raise InvalidArgumentError(
                "max_group and max_group_bytes must be >= 1 and commit_interval_ms >= 0, "
                f"got {o.max_group}, {o.max_group_bytes}, {o.commit_interval_ms}"
            )
        self.client = client
        self.options = o
        self.container = keys.check_container(o.container)
        self.shard = o.shard
        self.log = _Log(log, {"role": f"ps shard {o.shard}/{o.num_shards} [{self.container}]"})
        self._prefix = keys.ps_prefix(self.container, o.shard)
        self._lease_value = ""
        self.token = 0
        self.optimizer: Optimizer | None = o.optimizer
        self.owned: dict[str, _Owned] = {}
        self._stop = asyncio.Event()
        self._lost: str | None = None
        self._queue: QueueBase | None = None
        #: training on a single server: the lean channel workers push to
        #: (qps.ps.gradlist), read alongside the queue
        self._list: GradientList | None = None
        #: asynchronous training: the worker of each delivery taken from the list (by
        #: its tokens), who gets a credit back when it is settled
        self._senders: dict[tuple[str, ...], str] = {}
        #: messages taken from the list and not yet added to the stats hash's count
        #: (gradlist.TAKEN): they go with the next stats write, after an ack or a renewal
        self._list_taken = 0
        self._lease_script = client.commands.register_script(_LEASE)
        self._step_script = client.commands.register_script(_COUNT_STEPS)
        self._tokens_script = client.commands.register_script(_TOKENS_IF_COMMITTED)
        self.applied = 0
        self.skipped = 0
        self.dead = 0
        self._held: list[Delivery] = []  # deliveries taken and not settled, in order
        self._sizes: dict[tuple[str, ...], int] = {}  # their bytes (by tokens), as read
        self._max_message = control.DEFAULT_MAX_MESSAGE_BYTES  # the job's, set by run()
        #: ``time.monotonic()`` when the apply loop started (after the lease and the
        #: variables' loading), None before.
        self.loop_started: float | None = None
        #: the lease value of a dead holder this run took the lease over from, or None
        self.takeover: str | None = None
        self._applied_once = False  # stats' first_ms written (this run's first apply)
        self._inbox: _Inbox | None = None
        #: synchronous training: (replicas_to_aggregate, total_num_replicas), else None
        self.sync: tuple[int, int] | None = None
        self.sync_step = 0  # aggregated updates this shard has committed
        self.dropped = 0  # stale gradients dropped (synchronous training)
        #: synchronous training: gradients for updates up to this one are looked up in
        #: the applied ids before they count (see _sync_round)
        self._checked_through = 0
        #: asynchronous training: the ids of messages that may have been committed
        #: already (see the module docstring), looked up before they are applied
        self._suspect: set[str] = set()
        #: deliveries of a group (or update) that failed: they go back to the front of
        #: the queue when the loop ends (the failure ends it), in order, ahead of those
        #: read ahead of them
        self._give_back: list[Delivery] = []
        #: the reader's take under way was sent while elements waited behind its last
        #: one: they are on their way to the inbox (a group waits for them)
        self._incoming = False
        self._list_incoming = False  # the same, for the gradient list's reader
        self._acc = _Accum()
        #: synchronous training: the last update's tokens and ack, while under way
        self._settling: asyncio.Future[Any] | None = None
        self._sync_shards: int | None = None  # shards that hold variables (tokens)
        self._tokens: list[control.Tokens] | None = None  # the workers' token lists
        self._gs_opened = False  # the global-step counter created and registered
        self._scripts_loaded = False  # the commit scripts loaded (run by SHA at once)
        self._commit_seconds = 0.0  # how long the last group commit took
        #: the last groups' releases (their ids, their stats), acked and not yet sent:
        #: they go with the next ack, or once the shard has waited RELEASE_IDLE_S
        self._release_later: list[tuple[Any, ...]] = []
        self.metrics = (metrics or _metrics.default()).shard(self.container, o.shard)

    # -- control ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop after the group of messages in hand (``SIGTERM``)."""
        if not self._stop.is_set():
            self.log.info("stop requested: finishing the current group of messages")
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        if self._inbox is not None:
            self._inbox.wake()

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
    def _lease_keys(self) -> list[str]:
        return [self._prefix + "lease", self._prefix + "wake"]

    async def _acquire(self) -> bool:
        """Take the lease (waiting as a standby while another copy holds it); False if
        a stop was requested first."""
        tokens = Counter(keys.PS_TOKEN_COUNTER, container=self.container, client=self.client)
        announced = False
        while not self._stop.is_set():
            token = await tokens.add(1)
            value = f"{token} {self.options.owner}"
            with varcheck.naming(self._prefix + "lease"):
                reply = await self._lease_script(
                    keys=self._lease_keys(), args=["acquire", value, self.options.lease_ms]
                )
            if reply[0] == b"ok":
                self.token, self._lease_value = token, value
                self.log.info(
                    "lease taken with fencing token %d (owner %s)", token, self.options.owner
                )
                return True
            pttl = int(reply[1])
            held = _text(reply[2] or b"")
            check_lease(held, self._prefix + "lease", pttl)  # a corrupt one never runs out
            if dead_holder(held):
                # a crashed copy on this machine (a restart after SIGKILL): do not wait
                # out its lease. Its token is lower than ours, so its variables are
                # fenced against it in any case; the script checks it still holds it.
                with map_errors():
                    took = await self._lease_script(
                        keys=self._lease_keys(),
                        args=["takeover", value, self.options.lease_ms, held],
                    )
                if took[0] == b"ok":
                    self.token, self._lease_value = token, value
                    self.takeover = held
                    self.log.info(
                        "lease taken over from %s, a dead process of this host (%d ms of "
                        "its lease left), with fencing token %d",
                        held, pttl, token,
                    )  # fmt: skip
                    return True
                continue
            if not announced:
                self.log.info("shard is held by %s: waiting as a standby", _text(reply[2] or b"?"))
                announced = True
            wait = min(max(pttl, 10) / 1000.0, BLOCK_SECONDS)
            blpop = asyncio.ensure_future(self.client.blocking.blpop([self._prefix + "wake"], wait))
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({blpop, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not blpop.done():
                blpop.cancel()
            await asyncio.gather(blpop, stop, return_exceptions=True)
        return False

    async def _renew_loop(self) -> None:
        period = self.options.lease_ms / 3000.0
        while True:
            await asyncio.sleep(period)
            try:
                with map_errors():
                    reply = await self._lease_script(
                        keys=self._lease_keys(),
                        args=["renew", self._lease_value, self.options.lease_ms],
                    )
            except QpsError as exc:
                self.log.warning("lease renewal failed: %s", exc)
                continue
            if reply[0] != b"ok":
                self._lost = (
                    f"ps shard {self.shard}: lease lost (now held by "
                    f"{_text(reply[1]) or 'nobody'}); stopping"
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
            with map_errors():
                await self._lease_script(
                    keys=self._lease_keys(), args=["release", self._lease_value, 0]
                )
            await self._stats({"state": reason, "held_bytes": 0}, {})
            self.log.info("lease released (%s)", reason)
        except QpsError as exc:
            self.log.warning("could not release the lease (it expires): %s", exc)

    # -- ownership ---------------------------------------------------------------------------
    async def _own_placed(self) -> None:
        if self.shard == control.GLOBAL_STEP_SHARD:  # ids it counted and did not release
            await self._suspect_held(keys.counter_applied(self.container, keys.GLOBAL_STEP))
        placed = await control.read_placement(self.client, self.container, self.options.num_shards)
        for name in sorted(n for n, s in placed.items() if s == self.shard):
            if name not in self.owned:
                try:
                    await self._own(name)
                except NotFoundError:  # placed, then deleted: its messages dead-letter
                    self.log.warning("variable '%s' is placed here but does not exist", name)
        await self._stats({"variables": len(self.owned)}, {})

    async def _own(self, name: str) -> _Owned:
        var = await open_variable(self.client, name, self.container)
        await var.fence(self.token)
        st = await var.read_state()
        slots = st.slots
        assert self.optimizer is not None
        want = list(self.optimizer.slot_names())
        if var.dtype.kind == "f" and list(slots) != want:
            if slots and not self.options.reset_slots:
                raise FailedPreconditionError(
                    f"variable '{name}' has slots {list(slots)} of another optimizer; this "
                    f"shard applies {self.optimizer.name} (slots {want}): reset them with "
                    "qps ps --reset-slots"
                )
            slots = self.optimizer.init_slots(st.value)
            await var.init_slots(slots, self.token)
            self.log.info("variable '%s': fresh slots %s", name, want)
        o = _Owned(var, st.value, slots, st.version, st.t)
        await self._suspect_held(keys.variable_applied(self.container, name))
        self.owned[name] = o
        self.log.debug("owning '%s' at version %d (t=%d)", name, st.version, st.t)
        return o

    async def _suspect_held(self, applied_key: str) -> None:
        """Take the ids an ``applied`` set holds for messages that may have been
        committed: recorded and not released (by an earlier owner, or by this one before
        a failure), perhaps not acked; they are looked up when they come."""
        with varcheck.naming(applied_key):
            held = await self.client.commands.zrange(applied_key, 0, -1)
        self._suspect.update(_text(x) for x in held)

    async def _resolve(self, name: str) -> _Owned:
        o = self.owned.get(name)
        if o is not None:
            return o
        placed = await control.read_placement(self.client, self.container, self.options.num_shards)
        shard = placed.get(name)
        if shard is None:
            raise _Rejected(f"variable '{name}' is not placed on any shard", name)
        if shard != self.shard:
            raise _Rejected(f"variable '{name}' is placed on shard {shard}, not {self.shard}", name)
        try:
            o = await self._own(name)
        except NotFoundError:
            raise _Rejected(f"no variable '{name}' in container '{self.container}'", name) from None
        await self._stats({"variables": len(self.owned)}, {})
        return o

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

    async def _drop_unfinished_update(self, q: QueueBase) -> None:
        """Synchronous training, the job finished: the gradients gathered for an update
        that fewer than ``replicas_to_aggregate`` workers sent (a backup worker's last
        step) are dropped as TF's accumulators drop them, acknowledged and counted
        (``dropped_stale``), rather than given back to the list for no one."""
        items, self._acc = self._acc.items, _Accum()
        assert self.sync is not None
        self.log.info(
            "dropping %d gradient(s) of update %d: the job finished before %d arrived",
            len(items), self.sync_step + 1, self.sync[0],
        )  # fmt: skip
        await self._settle(q, _deliveries(items), ack=True)
        self.dropped += len(items)
        self.metrics.dropped_stale.inc(len(items))
        await self._stats({}, {"dropped_stale": len(items)})

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

    async def _absorb(self, q: QueueBase | None, g: _Group, batch: list[_Item]) -> None:
        """Add ``batch`` to the group: dead-letter what must not be applied (acked at
        once), skip what was applied before, and apply the rest in order."""
        valid: list[_Item] = []
        for item in batch:
            if item.msg is None:
                await self._reject(q, g, item, item.error, None)
                continue
            try:
                await self._check(item.msg)
            except _Rejected as rej:
                await self._reject(q, g, item, rej.reason, rej.variable)
            else:
                valid.append(item)
        if valid:
            await self._apply_batch(q, g, valid)

    async def _reject(
        self, q: QueueBase | None, g: _Group, item: _Item, reason: str, variable: str | None
    ) -> None:
        """Dead-letter ``item`` (nothing of it was applied) and ack it at once. An
        oversize message is kept without its bytes (its size is recorded)."""
        if item.oversize:
            await self._dead_letter(item.about, reason, size=item.nbytes)
        else:
            await self._dead_letter(item.msg, reason, variable=variable, raw=_raw(item.raw))
        if item.delivery is not None and q is not None and not item.shared:
            g.deliveries = [d for d in g.deliveries if d is not item.delivery]
            await self._settle(q, [item.delivery], ack=True)
        # a message taken with others is acked with its group's (should the group fail,
        # it comes again with them and is dead-lettered again)

    async def _check(self, msg: GradientMessage) -> None:
        """Raise _Rejected if ``msg`` must not be applied (NaN and Inf are checked with
        the apply, see _run_rules)."""
        if msg.shard != self.shard:
            raise _Rejected(f"message for shard {msg.shard} arrived at shard {self.shard}")
        for name, g in msg.grads.items():
            o = await self._resolve(name)
            try:
                check_gradient(name, o.var.spec, g)
            except InvalidArgumentError as exc:
                raise _Rejected(str(exc), name) from None
            msg.grads[name] = widen(g, o.var.spec)  # a compressed one: in the variable's dtype

    async def _applied_flags(
        self, msgs: list[GradientMessage]
    ) -> tuple[list[dict[str, bool]], list[bool]]:
        """Per message: which of its variables (and its global-step increment) recorded
        its id already."""
        gs_key = keys.counter_applied(self.container, keys.GLOBAL_STEP)
        commands: list[tuple[Any, ...]] = []
        for m in msgs:
            for name in m.grads:
                commands.append(("ZSCORE", keys.variable_applied(self.container, name), m.id))
            if m.global_step:
                commands.append(("ZSCORE", gs_key, m.id))
        replies = iter(await self.client.run_commands(commands) if commands else [])
        flags: list[dict[str, bool]] = []
        gs: list[bool] = []
        for m in msgs:
            flags.append({name: next(replies) is not None for name in m.grads})
            gs.append(bool(m.global_step and next(replies) is not None))
        return flags, gs

    async def _apply_batch(self, q: QueueBase | None, g: _Group, items: list[_Item]) -> None:
        """Apply the messages of ``items`` (checked, in order) to the in-memory state,
        recording in ``g`` what each variable must commit."""
        msgs = [it.msg for it in items if it.msg is not None]
        # only those that may have been committed are looked up (module docstring)
        asked = [m for m in msgs if m.id in self._suspect]
        found = await self._applied_flags(asked) if asked else ([], [])
        looked = {m.id: (f, gs) for m, f, gs in zip(asked, *found)}
        flags, gs_done = [], []
        for m in msgs:
            f, gs = looked.get(m.id, (dict.fromkeys(m.grads, False), False))
            flags.append(f)
            gs_done.append(gs)
        plan: list[tuple[_Item, GradientMessage, list[str], bool]] = []
        work: list[list[tuple[_Owned, Any]]] = []
        work_bytes = 0
        for item, m, f, gs in zip(items, msgs, flags, gs_done):
            if m.id in g.ids:  # the same message twice (a lease ran out): applied once
                g.skipped += 1
                continue
            fresh = [n for n, done in f.items() if not done]
            if fresh and len(fresh) < len(f):
                self.log.info(
                    "message %s was partly applied before (redelivery): skipping %s",
                    m.id,
                    ", ".join(n for n, done in f.items() if done),
                )
            plan.append((item, m, fresh, bool(m.global_step and not gs)))
            work.append([(self.owned[n], m.grads[n]) for n in fresh])
            work_bytes += sum(m.grads[n].nbytes for n in fresh)
            g.ids.add(m.id)
        for w in work:
            for o, _ in w:
                g.touched.add(o.var.name)
        counts = {name: len(v.ids) for name, v in g.vars.items()}
        if work_bytes >= THREAD_MIN_BYTES:
            # NumPy releases the GIL in large ufuncs: the next messages are read meanwhile
            poisoned = await asyncio.to_thread(self._run_rules, work, counts)
        else:
            poisoned = self._run_rules(work, counts)
        for k, (item, m, fresh, gs_needed) in enumerate(plan):
            if k in poisoned:
                g.ids.discard(m.id)
                await self._reject(q, g, item, poisoned[k][1], poisoned[k][0])
                continue
            g.applied.append((m.id, list(m.grads), m.global_step))
            staleness = -1
            for name in fresh:
                o = self.owned[name]
                v = g.vars.get(name)
                if v is None:
                    v = g.vars[name] = _Pending()
                read = m.versions.get(name)
                if read is not None:
                    staleness = max(staleness, max(0, o.version + len(v.ids) - read))
                v.ids.append(m.id)
                grad = m.grads[name]
                if isinstance(grad, SparseGradient):
                    v.rows.append(grad.indices)
                    g.rows += int(grad.indices.shape[0])
                else:
                    v.dense = True
                    g.rows += int(grad.shape[0]) if grad.ndim else 1
                g.bytes += grad.nbytes
            if gs_needed:
                g.gs_ids.append(m.id)
            if fresh or gs_needed:
                g.fresh += 1
                if staleness >= 0:
                    g.stale.append((m.worker, staleness))
            elif m.grads or m.global_step:
                g.skipped += 1
                self.log.info("message %s was applied before (redelivery): skipped", m.id)

    def _run_rules(
        self, work: list[list[tuple[_Owned, Any]]], counts: dict[str, int]
    ) -> dict[int, tuple[str, str]]:
        """Apply each message's gradients in order, ``t`` counting on from ``counts``
        (updates already applied in the group, per variable). A message with NaN or Inf
        in any gradient is not applied at all: returns {its index: (variable, reason)}."""
        opt = self.optimizer
        assert opt is not None
        poisoned: dict[int, tuple[str, str]] = {}
        for k, grads in enumerate(work):
            bad = next((o.var.name for o, grad in grads if not is_finite(grad)), None)
            if bad is not None:
                poisoned[k] = (bad, f"gradient of '{bad}' holds NaN or Inf")
                continue
            for o, grad in grads:
                n = counts[o.var.name] = counts.get(o.var.name, 0) + 1
                if isinstance(grad, SparseGradient):
                    opt.apply_sparse(o.value, grad.indices, grad.values, o.slots, o.t + n)
                else:
                    opt.apply_dense(o.value, grad, o.slots, o.t + n)
        return poisoned

    async def _commit_group(self, g: _Group) -> None:
        """Commit every variable the group changed (value, slots, ``t`` and all its
        message ids in one script each, the variables concurrently: each commit is atomic
        on its own) and advance the global step alongside (it records the ids too)."""
        failure: BaseException | None = None
        failed, _, _ = await self._commit_all(g.vars, g.touched, gs_ids=g.gs_ids)
        for name, r in failed:
            if isinstance(r, AlreadyAppliedError) and r.message_id in self._suspect:
                # it was looked up in the applied ids before the apply and not found
                # there: delivering the group again would be refused again, forever
                raise InternalError(
                    f"ps shard {self.shard}: '{name}' refused message {r.message_id} as "
                    "applied before, but the look-up of its applied ids did not find it; "
                    "stopping rather than apply it twice or retry it forever"
                ) from r
        for name, r in failed:
            if isinstance(r, AlreadyAppliedError):
                # a message not looked up had been committed (an earlier owner's, not
                # acked): our copy applied it again, reload it, and have the group
                # delivered again (looked up then: what this variable lacks is applied)
                self.log.info("'%s' had applied a message of the group: reloading it", name)
                g.touched.discard(name)
                del self.owned[name]
                await self._own(name)
                g.redo = True
            elif failure is None:
                failure = r
        if failure is not None:
            raise failure

    async def _commit_all(
        self,
        pending: dict[str, _Pending],
        touched: set[str],
        updates: int | None = None,
        gs_ids: Sequence[str] = (),
        tokens: int | None = None,
        ack: tuple[list[str], list[Any]] | None = None,
    ) -> tuple[list[tuple[str, BaseException]], bool, bool | None]:
        """Commit the variables of ``pending``, then advance the global step by ``gs_ids``
        (each commit is atomic on its own, and records the ids with its state, so each
        is exactly-once on its own: the variables' run concurrently); those committed
        leave ``touched``. Returns the variables' failures, whether synchronous update
        ``tokens`` (if given) had its tokens handled here, and, if ``ack`` was given
        (:meth:`GradientList.front_ack`'s keys and arguments), whether the update's
        messages were acknowledged with its tokens (True), refused for the lease
        (False), or not (None: acknowledge them the usual way); the global step's
        failure raises.

        On a single server, small dense commits go all at once: every variable's writes
        and commit script, the global step's script, and the update's tokens (given
        only if all of it committed), in one round trip."""
        names = list(pending)
        batch = await self._commit_at_once(names, pending, updates, gs_ids, tokens, ack)
        results: list[BaseException | None]
        handed, acked = False, None
        if batch is None:
            results, rest = [None] * len(names), list(range(len(names)))
        else:  # what remains: commits that did not run (script not loaded, or held)
            results, gs_ids, handed, acked = batch
            rest = [k for k, r in enumerate(results) if isinstance(r, _Fallback)]
        got = await asyncio.gather(
            *(self._commit(self.owned[names[k]], pending[names[k]], updates) for k in rest),
            return_exceptions=True,
        )
        if gs_ids:  # after the commits: a snapshot never counts a push ahead of them
            await self._advance_global_step(list(gs_ids))
        for k, r in zip(rest, got):
            results[k] = r
        failed = []
        for name, r in zip(names, results):
            if r is None:
                touched.discard(name)
            else:
                failed.append((name, r))
        return failed, handed, acked

    def _whole(self, v: _Pending) -> bool:
        """Whether a commit writes the whole variable: a dense gradient's, or any under
        TF1's Adam, whose sparse apply moves every row (else only the rows touched)."""
        opt = self.optimizer
        return v.dense or (isinstance(opt, Adam) and not opt.lazy)

    def _next(self, o: _Owned, v: _Pending, updates: int | None) -> tuple[int, int]:
        """``(t, version)`` of ``o`` once ``v`` is committed (``updates`` updates, else one
        per message)."""
        n = len(v.ids) if updates is None else updates
        return o.t + n, o.version + n

    async def _commit_at_once(
        self,
        names: list[str],
        pending: dict[str, _Pending],
        updates: int | None,
        gs_ids: Sequence[str],
        tokens: int | None = None,
        ack: tuple[list[str], list[Any]] | None = None,
    ) -> tuple[list[BaseException | None], Sequence[str], bool, bool | None] | None:
        """The commits of :meth:`_commit_all` in one round trip, if they are all small
        dense ones on a single server; None otherwise. Returns each variable's outcome
        (None: committed; :class:`_Fallback`: its script was not loaded, or a
        checkpoint held the variable, and it did not run: commit it again the usual
        way), the global-step ids still to count (``gs_ids`` unless its script ran
        here), whether the tokens of synchronous update ``tokens`` were handled
        (given, or counted for the shard that gives them) by a last script that runs
        only if every commit of the round trip took, and what became of ``ack`` in that
        script (see :meth:`_commit_all`). The releases and stats that wait
        (``_release_later``) ride along after it once enough of them are kept."""
        if self.client.cluster or not names:
            return None
        plans = []
        total = 0
        for name in names:
            o, v = self.owned[name], pending[name]
            if not self._whole(v):
                return None
            total += o.var.nbytes * (1 + len(o.slots))
            if total > AT_ONCE_BYTES:  # one write of it all would be a fresh large buffer
                return None
            t, version = self._next(o, v, updates)
            plan = o.var.publish_plan(
                o.value, version, self.token, slots=o.slots, applied=v.ids, t=t
            )
            if plan is None:
                return None
            plans.append(plan)
        if not self._scripts_loaded:
            await variables.load_publish_script(self.client)
            with map_errors():
                await self.client.commands.script_load(_COUNT_STEPS)
                await self.client.commands.script_load(_TOKENS_IF_COMMITTED)
            self._scripts_loaded = True
        commands = [c for cmds, _ in plans for c in cmds]
        if gs_ids:
            await self._open_global_step()
            sha, gk = self._step_script.sha, self._step_keys()
            commands.append(("EVALSHA", sha, len(gk), *gk, APPLIED_KEEP_MS, *gs_ids))
        riding = 0
        if tokens is not None:
            commands.append(
                await self._tokens_command(names, pending, updates, tokens, gs_ids, ack)
            )
            if len(self._release_later) >= RIDE_COMMANDS:  # after the tokens: not before
                later, self._release_later = _coalesced(self._release_later), []
                commands += later
                riding = len(later)
        replies = await self.client.run_commands_replies(commands)
        handed, acked = False, None
        if riding:
            self._release_replies(replies[-riding:])
            del replies[-riding:]
        if tokens is not None:
            reply = replies.pop()
            if isinstance(reply, BaseException):
                if is_noscript(reply):
                    self._scripts_loaded = False
            else:
                handed = int(reply[0]) != 0
                acked = None if int(reply[1]) < 0 else bool(int(reply[1]))
        results: list[BaseException | None] = []
        at = 0
        for name, (cmds, check) in zip(names, plans):
            at += len(cmds)
            reply = replies[at - 1]
            for r in replies[at - len(cmds) : at - 1]:  # the writes: a failure is the server's
                if isinstance(r, BaseException):
                    raise r
            if isinstance(reply, BaseException):
                missing = is_noscript(reply)  # then it did not run: load it again
                self._scripts_loaded = self._scripts_loaded and not missing
                results.append(_Fallback() if missing else reply)
                continue
            try:
                check(reply)
            except variables.CheckpointHold:  # it wrote nothing: the usual way waits
                results.append(_Fallback())
                continue
            except QpsError as exc:
                results.append(exc)
                continue
            o, v = self.owned[name], pending[name]
            o.t, o.version = self._next(o, v, updates)
            results.append(None)
        if gs_ids:
            reply = replies[-1]
            if not isinstance(reply, BaseException):
                gs_ids = ()
            elif is_noscript(reply):
                self._scripts_loaded = False
            else:
                raise reply
        return results, gs_ids, handed, acked

    async def _tokens_command(
        self,
        names: list[str],
        pending: dict[str, _Pending],
        updates: int | None,
        step: int,
        gs_ids: Sequence[str],
        ack: tuple[list[str], list[Any]] | None = None,
    ) -> tuple[Any, ...]:
        """The guarded token script (``_TOKENS_IF_COMMITTED``) for update ``step``,
        committed by the round trip's scripts (the variables of ``names``, and the
        global step if ``gs_ids``); with ``ack``, it acknowledges the update's messages
        too."""
        lists, needed = await self._token_lists()
        gs = keys.counter_applied(self.container, keys.GLOBAL_STEP) if gs_ids else ""
        done = self._done_key(step) if needed > 1 else ""
        metas = [keys.variable_meta(self.container, n) for n in names]
        ks = [*metas, *(t.key for t in lists), gs, done, *(ack[0] if ack else ())]
        versions = [self._next(self.owned[n], pending[n], updates)[1] for n in names]
        args = [len(names), self.token, *versions, step, needed, DONE_TTL_MS]
        args += ack[1] if ack else []
        return ("EVALSHA", self._tokens_script.sha, len(ks), *ks, *args)

    async def _commit(self, o: _Owned, v: _Pending, updates: int | None = None) -> None:
        """Commit ``o``'s in-memory state with the ``len(v.ids)`` messages applied to it
        (as ``updates`` updates if given: one aggregated update of several messages)."""
        t, version = self._next(o, v, updates)
        if self._whole(v):
            await o.var.publish(o.value, version, self.token, slots=o.slots, applied=v.ids, t=t)
        else:
            rows = np.unique(np.concatenate(v.rows))
            await o.var.publish_rows(
                rows,
                o.value[rows],
                version,
                self.token,
                slot_rows={name: s[rows] for name, s in o.slots.items()},
                applied=v.ids,
                t=t,
            )
        o.version, o.t = version, t

    def _forget(self, g: _Group) -> None:
        """Drop the in-memory copies the group changed but did not commit (they are
        loaded again from their last commit when next needed)."""
        for name in g.touched:
            self.owned.pop(name, None)
        g.touched.clear()

    async def _apply(self, msg: GradientMessage) -> _Group:
        """Apply and commit one message now, without a delivery (tests: a shard that
        is then "killed" before the ack)."""
        g = _Group()
        try:
            await self._apply_batch(None, g, [_Item(None, msg)])
            await self._commit_group(g)
        except BaseException:
            self._forget(g)
            raise
        return g

    # -- synchronous training ------------------------------------------------------------------
    async def _sync_round(self, q: QueueBase, inbox: _Inbox) -> None:
        """Take what the inbox holds into the accumulator: dead-letter bad messages, ack
        redeliveries of committed ones and stale gradients (computed from an older
        update than the shard's next one: dropped and counted, as TF does), keep the
        rest unacknowledged; once ``replicas_to_aggregate`` are held, apply their mean
        as one update and commit it."""
        assert self.sync is not None
        batch = []
        while inbox.items:
            batch.append(inbox.take())
        acc = self._acc
        valid: list[tuple[_Item, GradientMessage]] = []
        for item in batch:
            m = item.msg
            if m is None:
                await self._reject(q, _Group(), item, item.error, None)
                continue
            try:
                await self._check(m)
            except _Rejected as rej:
                await self._reject(q, _Group(), item, rej.reason, rej.variable)
                continue
            bad = next((n for n, g in m.grads.items() if not is_finite(g)), None)
            if bad is not None:
                await self._reject(q, _Group(), item, f"gradient of '{bad}' holds NaN or Inf", bad)
                continue
            valid.append((item, m))

        # A gradient for the update being gathered (its step s is the shard's update
        # count) cannot have been applied, and is not looked up: one of step s goes
        # into update s + 1, and the shard counts s + 1 once that update is committed.
        # Looked up (one round trip): the others (stale ones, redeliveries of applied
        # ones), those of steps up to the count this run started from (what the last
        # run delivered comes again first), and, once one from an update ahead of the
        # shard (a worker started meanwhile) was taken, those up to its step.
        def unsure(m: GradientMessage) -> bool:
            return m.step != self.sync_step or m.step <= self._checked_through

        asked = [m for _, m in valid if unsure(m)]
        found = iter((await self._applied_flags(asked))[0] if asked else [])
        for item, m in valid:
            done = next(found) if unsure(m) else None
            if done is not None and m.grads and all(done.values()):
                await self._settle(q, [item.delivery] if item.delivery else [], ack=True)
                self.skipped += 1
                continue
            if m.step < self.sync_step:
                await self._settle(q, [item.delivery] if item.delivery else [], ack=True)
                self.dropped += 1
                self.metrics.dropped_stale.inc()
                await self._stats({}, {"dropped_stale": 1, f"dropped|{m.worker}": 1})
                continue
            if m.step > self.sync_step:  # from an update ahead: look those up
                self._checked_through = m.step
            acc.items.append(item)
            acc.add(m)
        if len(acc.items) >= self.sync[0]:
            await self._sync_update(q)

    async def _sync_update(self, q: QueueBase) -> None:
        await self._settled()  # the previous update's tokens and ack (done by now)
        acc, self._acc = self._acc, _Accum()
        opt = self.optimizer
        assert opt is not None
        msgs = [it.msg for it in acc.items if it.msg is not None]
        deliveries = [it.delivery for it in acc.items if it.delivery is not None]
        applied = [(m.id, list(m.grads), m.global_step) for m in msgs]
        g = _Group(deliveries=deliveries, applied=applied, fresh=len(msgs))
        try:
            ids: dict[str, list[str]] = {}
            for m in msgs:
                for name in m.grads:
                    ids.setdefault(name, []).append(m.id)
            pending: dict[str, _Pending] = {}
            for name in ids:
                o = self.owned[name]
                grad = acc.mean(name)
                g.touched.add(name)
                if isinstance(grad, SparseGradient):
                    opt.apply_sparse(o.value, grad.indices, grad.values, o.slots, o.t + 1)
                    pending[name] = _Pending(ids=ids[name], rows=[grad.indices])
                else:
                    opt.apply_dense(o.value, grad, o.slots, o.t + 1)
                    pending[name] = _Pending(ids=ids[name], dense=True)
            gs_ids = (
                [f"sync.{self.sync_step + 1}"] if self.shard == control.GLOBAL_STEP_SHARD else []
            )
            # on a single server, the messages of the gradient list are acknowledged by
            # the token script, once it found the update committed (no round trip of
            # their own)
            gl = self._list
            front = None
            listed = bool(deliveries) and all(is_list_delivery(d) for d in deliveries)
            if gl is not None and listed:  # (no list on a cluster)
                front = gl.front_ack(deliveries)
            failed, handed, acked = await self._commit_all(
                pending, g.touched, 1, gs_ids, tokens=self.sync_step + 1, ack=front
            )
            if acked is not None:
                assert gl is not None
                gl.acked_front(len(deliveries))
            for _, failure in failed:
                raise failure
        except BaseException:
            self._forget(g)
            self._give_back += deliveries  # the loop ends: given back with the rest
            raise
        self.sync_step += 1
        if acked is not None:  # acknowledged with the tokens
            self._unhold(deliveries)
            if acked:  # its stats and its ids' release wait to ride with a later commit
                self._release_later += self._stats_commands(g)
                await self._released(g)
            else:  # the lease is another owner's: it gives them back (found applied)
                self.log.warning("the gradient list's pop was refused: the lease was lost")
            return

        async def settle() -> None:  # the ids are released once the ack is done
            if await self._settle(q, deliveries, ack=True, count=g):
                await self._released(g)
            # else a lease ran out: the ids stay recorded, the messages come again and
            # are found applied

        # The tokens go out first (their writes ahead of the ack's), then the deliveries
        # are acknowledged: a worker may pull and push again at once. Should this
        # process die before the ack, the messages come again and are acked as applied
        # (their ids were committed with the update). Both run while the shard gathers
        # the next update's gradients; the next update (or the loop's end) awaits them.
        tokens = [] if handed else await self._sync_tokens(self.sync_step)
        self._settling = asyncio.ensure_future(asyncio.gather(*tokens, settle()))

    async def _settled(self) -> None:
        """Wait for the last update's tokens and acknowledgement if they are still
        under way; raise their failure."""
        pending, self._settling = self._settling, None
        if pending is not None:
            await pending

    async def _sync_tokens(self, step: int) -> list[Awaitable[Any]]:
        """Once every shard holding variables has committed update ``step``, give each
        worker a token (the new global step): each is blocked on its own token list.
        Returns the writes to run (one round trip for all; none while other shards
        have not committed)."""
        lists, needed = await self._token_lists()
        if needed > 1:  # the last shard to commit the update hands out the tokens
            key = self._done_key(step)
            with map_errors():
                pipe = self.client.commands.pipeline(transaction=True)
                pipe.incr(key)
                pipe.pexpire(key, DONE_TTL_MS)
                done, _ = await pipe.execute()
            if int(done) != needed:
                return []
        return [self.client.run_commands([t.put_command(step) for t in lists])]

    async def _token_lists(self) -> tuple[list[control.Tokens], int]:
        """The workers' token lists, and how many shards hold variables (each counts an
        update done; the last one gives the tokens)."""
        assert self.sync is not None
        if self._sync_shards is None:  # placed once, at the first push of the job
            placed = await control.read_placement(
                self.client, self.container, self.options.num_shards
            )
            self._sync_shards = len(set(placed.values()) | {control.GLOBAL_STEP_SHARD})
        if self._tokens is None:
            self._tokens = [
                control.tokens(self.client, self.container, k) for k in range(self.sync[1])
            ]
        return self._tokens, self._sync_shards

    def _done_key(self, step: int) -> str:
        """The counter of the shards that committed synchronous update ``step``."""
        return keys.container_prefix(self.container) + f"ps:sync:done:{step}"

    async def _advance_global_step(self, ids: list[str]) -> None:
        await self._open_global_step()
        with map_errors():
            await self._step_script(keys=self._step_keys(), args=[APPLIED_KEEP_MS, *ids])

    async def _open_global_step(self) -> None:
        if not self._gs_opened:
            counter = control.global_step_counter(self.client, self.container)
            await counter.get()  # creates and registers it
            self._gs_opened = True

    def _step_keys(self) -> list[str]:
        """The global-step script's keys (its arguments: APPLIED_KEEP_MS, the ids)."""
        return [
            keys.counter_key(self.container, keys.GLOBAL_STEP),
            keys.counter_applied(self.container, keys.GLOBAL_STEP),
        ]

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
        commands: list[tuple[Any, ...]] = [("HINCRBY", stats, k, n) for k, n in incr.items()]
        now_ms = int(time.time() * 1000)
        marks: dict[str, int] = {"last_ms": now_ms, "held_bytes": self._held_bytes()}
        if g.fresh and not self._applied_once:  # this run's first applied group
            marks["first_ms"] = now_ms
            self._applied_once = True
        commands.append(("HSET", stats, *(x for kv in marks.items() for x in kv)))
        return commands

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
        commands: list[tuple[Any, ...]] = [("ZREM", k, *ids) for k, ids in release.items()]
        if self.client.cluster:  # of several slots: not with an ack
            commands += self._stats_commands(g)
            try:
                await self.client.run_commands(commands)
            except QpsError as exc:  # the ids expire (APPLIED_KEEP_MS)
                self.log.warning("could not release the ids of a group: %s", exc)
        else:  # with the next ack, or once the shard waits for messages
            self._release_later += commands
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

    # -- dead letters and stats ----------------------------------------------------------------
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
            pipe = self.client.commands.pipeline(transaction=False)
            pipe.rpush(self._prefix + "dlq", control.encode_dead_letter(entry))
            pipe.hincrby(self._prefix + "stats", "dead_letters", 1)
            dlq_length, counted = await pipe.execute(raise_on_error=False)
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
            with map_errors():
                dead = await self.client.commands.llen(self._prefix + "dlq")
        except QpsError as exc:
            self.log.debug("could not sample the queue for the metrics: %s", exc)
            return
        self.metrics.sampled(depth, int(dead))

    async def _stats(self, fields: dict[str, Any], incr: dict[str, int]) -> None:
        taken, self._list_taken = self._list_taken, 0
        if taken:
            incr = {**incr, TAKEN: taken}
        try:
            with map_errors():
                pipe = self.client.commands.pipeline(transaction=False)
                if fields:
                    pipe.hset(self._prefix + "stats", mapping=cast(Any, fields))
                for k, v in incr.items():
                    pipe.hincrby(self._prefix + "stats", k, v)
                await pipe.execute()
        except QpsError as exc:
            self._list_taken += taken  # counted with the next write
            self.log.warning("could not write stats: %s", exc)


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


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, (bytes, bytearray)) else str(x)


def _raw(value: Any) -> bytes:
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        return value.tobytes()
    return b""


#: At most this many bytes of variables and slots are committed in one round trip
#: (:meth:`Shard._commit_at_once`); larger groups commit variable by variable, each in
#: pipelines of at most WRITE_BATCH_BYTES.
AT_ONCE_BYTES = 16 << 20


class _Fallback(Exception):
    """A commit sent at once whose script was not loaded (it did not run)."""


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except QpsError as exc:  # never a cancellation of the caller: it must go on
        log.debug("ignored: %r", exc)

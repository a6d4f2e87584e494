"""The base layer of a PS shard (:class:`ShardCore`; the layers are listed in
:mod:`qps.ps.shard`): its options, the state every layer shares (the client, the lease,
the variables it owns and their in-memory copies, the gradient channels), the stats
hash, and the ownership of variables: fencing each one with the lease's token and
loading its state."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from qps import keys, varcheck
from qps import metrics as _metrics
from qps.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, QpsError
from qps.optimizers import Optimizer
from qps.owners import default_owner
from qps.ps import control
from qps.ps.gradlist import TAKEN, GradientList
from qps.ps.groups import _Inbox, _Owned, _Rejected
from qps.ps.lease import ShardLease
from qps.queues.base import Delivery, QueueBase
from qps.registry import text_of
from qps.transport import Client
from qps.variables import open_variable

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


class _Log(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return f"{self.extra['role']}: {msg}", kwargs  # type: ignore[index]


class ShardCore:
    """The state every layer of a shard shares, and the ownership of its variables."""

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
        self.lease = ShardLease(client, self.container, o.shard, o.owner, o.lease_ms, self.log)
        self.optimizer: Optimizer | None = o.optimizer
        self.owned: dict[str, _Owned] = {}
        self._stop = asyncio.Event()
        self._lost: str | None = None
        self._queue: QueueBase | None = None
        #: training on a single server: the lean channel workers push to
        #: (qps.ps.gradlist), read alongside the queue
        self._list: GradientList | None = None
        self.applied = 0
        self.skipped = 0
        self.dead = 0
        #: ``time.monotonic()`` when the apply loop started (after the lease and the
        #: variables' loading), None before.
        self.loop_started: float | None = None
        self._inbox: _Inbox | None = None
        #: asynchronous training: the ids of messages that may have been committed
        #: already (see the module docstring), looked up before they are applied
        self._suspect: set[str] = set()
        #: deliveries of a group (or update) that failed: they go back to the front of
        #: the queue when the loop ends (the failure ends it), in order, ahead of those
        #: read ahead of them
        self._give_back: list[Delivery] = []
        #: messages taken from the list and not yet added to the stats hash's count
        #: (gradlist.TAKEN): they go with the next stats write, after an ack or a renewal
        self._list_taken = 0
        self.metrics = (metrics or _metrics.default()).shard(self.container, o.shard)
        #: synchronous training: (replicas_to_aggregate, total_num_replicas), else None
        self.sync: tuple[int, int] | None = None

    @property
    def token(self) -> int:
        """The fencing token of this run's lease (0 before it is taken)."""
        return self.lease.token

    @property
    def takeover(self) -> str | None:
        """The lease value of a dead holder this run took the lease over from, or None."""
        return self.lease.takeover

    @property
    def _lease_value(self) -> str:
        return self.lease.value

    def request_stop(self) -> None:
        """Stop after the group of messages in hand (``SIGTERM``)."""
        if not self._stop.is_set():
            self.log.info("stop requested: finishing the current group of messages")
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        if self._inbox is not None:
            self._inbox.wake()

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
            held = await self.client.zrange(applied_key, 0, -1)
        self._suspect.update(text_of(x) for x in held)

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

    async def _stats(self, fields: dict[str, Any], incr: dict[str, int]) -> None:
        """Write ``fields`` into the shard's stats hash and add ``incr`` to its counts
        (a failure is logged: stats never stop the shard)."""
        taken, self._list_taken = self._list_taken, 0
        if taken:
            incr = {**incr, TAKEN: taken}
        stats = self._prefix + "stats"
        writes: list[tuple[Any, ...]] = [("HINCRBY", stats, k, n) for k, n in incr.items()]
        if fields:
            writes.append(("HSET", stats, *(x for kv in fields.items() for x in kv)))
        if not writes:
            return
        try:
            await self.client.run_commands(writes)
        except QpsError as exc:
            self._list_taken += taken  # counted with the next write
            self.log.warning("could not write stats: %s", exc)

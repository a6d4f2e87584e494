"""What every role of a PS job agrees on, stored in the container: the job's config
(number of shards, optimizer), the placement map (variable -> shard), the gradient
queues, the "finished" mark, the global step, and the shards' published status.

Nothing here runs a shard (:mod:`qps.ps.shard`) or sends gradients
(:mod:`qps.ps.client`); both build on these functions, and so does ``qps ps``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from qps import keys, placement, varcheck, wire
from qps.aio import unless_stopped
from qps.containers import Counter
from qps.errors import (
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from qps.optimizers import Optimizer
from qps.optimizers import from_spec as optimizer_from_spec
from qps.ps.gradlist import WAKE, gradient_list_key
from qps.ps.status import (  # the shards' status, read by the status commands
    EXACT_STALENESS,
    ShardStatus,
    shard_status,
    stale_bucket,
    staleness_percentile,
)
from qps.queues import FIFOQueue
from qps.registry import text_of
from qps.transport import Client
from qps.varspec import MAX_COUNTER

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "EXACT_STALENESS",
    "GLOBAL_STEP_SHARD",
    "GRADIENT_QUEUE_CAPACITY",
    "MAX_SHARDS",
    "PSConfig",
    "ShardStatus",
    "configure",
    "dead_letters",
    "drop_dead_letters",
    "global_step_counter",
    "gradient_queue",
    "is_finished",
    "mark_finished",
    "place_variables",
    "read_config",
    "read_placement",
    "shard_status",
    "stale_bucket",
    "staleness_percentile",
]

#: Messages a shard's gradient queue holds before pushes block (bounds a PS's memory:
#: TF issue #6508, 64 workers OOM one PS).
GRADIENT_QUEUE_CAPACITY = 8
#: The largest gradient message (encoded bytes) a job accepts unless it sets another
#: (``max_message_bytes``): with the default queue capacity it bounds what one gradient
#: queue can hold in Redis to 8 x 512 MiB. At most :data:`qps.wire.MAX_MESSAGE_BYTES`.
DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
#: The shard that advances the global step (TF: the PS that holds ``global_step``).
GLOBAL_STEP_SHARD = 0
#: The most shards a job has (a sanity bound: a stored config over it is corrupt).
MAX_SHARDS = 1 << 16


# -- config -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PSConfig:
    """A container's PS job: ``num_shards`` and the ``optimizer`` every shard applies
    (None until a shard or :func:`configure` sets it)."""

    num_shards: int
    optimizer: Optimizer | None
    queue_capacity: int = 8  # GRADIENT_QUEUE_CAPACITY unless the job set another
    #: synchronous training (SyncReplicasOptimizer): (replicas_to_aggregate,
    #: total_num_replicas), or None for asynchronous training
    sync: tuple[int, int] | None = None
    #: the largest encoded gradient message a worker may push and a shard applies
    #: (DEFAULT_MAX_MESSAGE_BYTES unless the job set another)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


_CONFIG_FIELDS = ("num_shards", "optimizer", "queue_capacity", "sync", "max_message_bytes", "rr")


async def read_config(client: Client, container: str) -> PSConfig | None:
    """The stored PS config of ``container``, or None if no job was configured.

    Raises:
        DataLossError: a config hash qps did not write: a field missing, not an integer
            in its range, an optimizer spec that does not parse, or not a hash (the
            message names the key and field).
    """
    key = keys.ps_config(container)
    with varcheck.naming(key):
        raw = dict(zip(_CONFIG_FIELDS, await client.hmget(key, _CONFIG_FIELDS)))
    if all(v is None for v in raw.values()):  # (its fields are set one by one: HSETNX)
        return None

    def number(field: str, lo: int, hi: int, default: int | None = None) -> int:
        v = varcheck.count(raw[field] if raw[field] is not None else default, key, field)
        if not lo <= v <= hi:
            raise varcheck.field_error(key, field, raw[field], f"an integer in [{lo}, {hi}]")
        return v

    n = number("num_shards", 1, MAX_SHARDS)
    cap = number("queue_capacity", 1, MAX_COUNTER, GRADIENT_QUEUE_CAPACITY)
    most = number("max_message_bytes", 1, wire.MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES)
    number("rr", 0, MAX_COUNTER, 0)  # round robin's count (placement): HINCRBY
    opt = sync = None
    try:
        if raw["optimizer"] is not None:
            opt = optimizer_from_spec(json.loads(raw["optimizer"]))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise varcheck.field_error(key, "optimizer", raw["optimizer"], f"a spec ({exc})") from exc
    if raw["sync"] is not None:
        parts = text_of(raw["sync"]).split("/")
        r, t = (int(x) if x.isdigit() else 0 for x in parts) if len(parts) == 2 else (0, 0)
        if not 1 <= r <= t:
            raise varcheck.field_error(key, "sync", raw["sync"], "'<replicas>/<total>'")
        sync = (r, t)
    return PSConfig(n, opt, cap, sync, most)


async def configure(
    client: Client,
    container: str,
    num_shards: int,
    optimizer: Optimizer | None = None,
    queue_capacity: int | None = None,
    sync: tuple[int, int] | None = None,
    max_message_bytes: int | None = None,
) -> PSConfig:
    """Record the PS job of ``container`` (first caller wins) and return it: every shard
    and worker must agree on ``num_shards``, and every shard applies the one optimizer.
    ``queue_capacity``, ``sync`` and ``max_message_bytes`` (the largest encoded gradient
    message) are set once too; None: keep the stored one. The first call stores
    ``max_message_bytes``, :data:`DEFAULT_MAX_MESSAGE_BYTES` if it is None, so a later
    call with another one disagrees.

    Raises:
        InvalidArgumentError: ``num_shards < 1``, a ``max_message_bytes`` not in
            [1, wire.MAX_MESSAGE_BYTES], or a config already stored with another number
            of shards, optimizer, queue capacity, mode or maximum message size.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int):
        raise InvalidArgumentError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if not 1 <= num_shards <= MAX_SHARDS:
        raise InvalidArgumentError(f"num_shards must be in [1, {MAX_SHARDS}], got {num_shards}")
    key = keys.ps_config(container)
    with varcheck.naming(key, keys.ps_config_wake(container)):
        batch = client.batch().hsetnx(key, "num_shards", num_shards)
        if optimizer is not None:
            batch.hsetnx(key, "optimizer", json.dumps(optimizer.to_spec(), sort_keys=True))
        if queue_capacity is not None:
            if isinstance(queue_capacity, bool) or not isinstance(queue_capacity, int):
                raise InvalidArgumentError(f"queue_capacity must be an int, got {queue_capacity!r}")
            if queue_capacity < 1:
                raise InvalidArgumentError(f"queue_capacity must be >= 1, got {queue_capacity}")
            batch.hsetnx(key, "queue_capacity", queue_capacity)
        if sync is not None:
            r, t = sync
            if not (isinstance(r, int) and isinstance(t, int) and 1 <= r <= t):
                raise InvalidArgumentError(
                    f"sync needs 1 <= replicas_to_aggregate <= total_num_replicas, got {sync}"
                )
            batch.hsetnx(key, "sync", f"{r}/{t}")
        # stored by the first caller, the default included: it is fixed once workers
        # may have pushed under it
        m = DEFAULT_MAX_MESSAGE_BYTES if max_message_bytes is None else max_message_bytes
        if isinstance(m, bool) or not isinstance(m, int):
            raise InvalidArgumentError(f"max_message_bytes must be an int, got {m!r}")
        if not 1 <= m <= wire.MAX_MESSAGE_BYTES:
            raise InvalidArgumentError(
                f"max_message_bytes must be in [1, {wire.MAX_MESSAGE_BYTES}], got {m}"
            )
        batch.hsetnx(key, "max_message_bytes", m).set(keys.registration(container), 1, nx=True)
        if optimizer is not None:  # wake the shards waiting for one (wait_for_optimizer)
            batch.wake(keys.ps_config_wake(container))
        await batch.run()
    cfg = await read_config(client, container)
    assert cfg is not None
    if sync is not None and cfg.sync != tuple(sync):
        raise InvalidArgumentError(
            f"the PS job of container '{container}' is "
            + ("asynchronous" if cfg.sync is None else f"synchronous {cfg.sync[0]}/{cfg.sync[1]}")
            + f", not synchronous {sync[0]}/{sync[1]} (reset the container to change it)"
        )
    if queue_capacity is not None and cfg.queue_capacity != queue_capacity:
        raise InvalidArgumentError(
            f"the PS job of container '{container}' has gradient queues of capacity "
            f"{cfg.queue_capacity}, not {queue_capacity} (reset the container to change it)"
        )
    if max_message_bytes is not None and cfg.max_message_bytes != max_message_bytes:
        raise InvalidArgumentError(
            f"the PS job of container '{container}' has a maximum gradient message size of "
            f"{cfg.max_message_bytes} bytes, not {max_message_bytes} (reset the container "
            "to change it)"
        )
    if cfg.num_shards != num_shards:
        raise InvalidArgumentError(
            f"the PS job of container '{container}' has {cfg.num_shards} shard(s), not "
            f"{num_shards} (reset the container to change it)"
        )
    if optimizer is not None and cfg.optimizer != optimizer:
        raise InvalidArgumentError(
            f"the PS job of container '{container}' applies {_describe(cfg.optimizer)}, not "
            f"{_describe(optimizer)} (every shard applies one optimizer; reset the container "
            "to change it)"
        )
    return cfg


#: the longest a shard waiting for the job's optimizer blocks before it looks again
OPTIMIZER_WAKE_SECONDS = 1.0


async def wait_for_optimizer(
    client: Client, container: str, stop: asyncio.Event
) -> PSConfig | None:
    """Block until the PS job of ``container`` has an optimizer (another shard started
    with one, or :func:`configure` was called with one) and return its config; None if
    ``stop`` is set first. Blocks in ``BLPOP`` on the list :func:`configure` pushes to
    (for at most :data:`OPTIMIZER_WAKE_SECONDS` at a time, so a lost wake-up costs that)."""
    wake = keys.ps_config_wake(container)
    while not stop.is_set():
        cfg = await read_config(client, container)
        if cfg is not None and cfg.optimizer is not None:
            return cfg
        pop = await unless_stopped(client.blpop([wake], OPTIMIZER_WAKE_SECONDS), stop)
        if not pop.cancelled():
            pop.result()  # an error of the connection: raised
    return None


def _describe(opt: Optimizer | None) -> str:
    if opt is None:
        return "no optimizer"
    args = ", ".join(f"{k}={v}" for k, v in opt.hparams().items())
    return f"{opt.name}({args})"


# -- placement --------------------------------------------------------------------------------


async def read_placement(
    client: Client, container: str, num_shards: int | None = None
) -> dict[str, int]:
    """The stored placement map: variable name -> shard (``num_shards``: the job's,
    read from its config when not given).

    Raises:
        DataLossError: an entry that does not name a variable, or a shard of the job
            (the message names the key and entry), or a placement that is not a hash.
    """
    if num_shards is None:
        cfg = await read_config(client, container)
        num_shards = MAX_SHARDS if cfg is None else cfg.num_shards
    key = keys.ps_placement(container)
    with varcheck.naming(key):
        raw = await client.hgetall(key)
    out = {}
    for k, v in raw.items():
        name = text_of(k)
        try:
            keys.check_name(name)
        except InvalidArgumentError:
            raise DataLossError(f"corrupt state: {key} places {name!r}, not a variable") from None
        shard = varcheck.count(v, key, name)
        if shard >= num_shards:
            raise varcheck.field_error(key, name, v, f"a shard in [0, {num_shards})")
        out[name] = shard
    return out


async def place_variables(
    client: Client,
    container: str,
    variables: Iterable[Any],
    strategy: str = "round_robin",
) -> dict[str, int]:
    """Place ``variables`` (names, Variables, PartitionedVariables — part by part) on
    the shards of the container's PS job and return the whole stored map. A variable
    placed before keeps its shard (the first placement wins, so every role agrees).

    ``round_robin``: TF's ``replica_device_setter`` order: each new variable takes the
    next shard, counting every placement ever made in the container. ``greedy_by_bytes``:
    :func:`qps.placement.greedy_by_bytes` over the given variables (sizes needed).

    Raises:
        FailedPreconditionError: no PS job is configured in the container.
        InvalidArgumentError: an unknown strategy, or a variable without a size for
            ``greedy_by_bytes``.
    """
    cfg = await read_config(client, container)
    if cfg is None:
        raise FailedPreconditionError(
            f"no PS job in container '{container}': start `qps ps --num-shards N` or call "
            "qps.ps.configure() first"
        )
    if strategy == "round_robin":
        names = list(placement.round_robin(variables, 1))
        if names:
            with varcheck.naming(keys.ps_placement(container)):
                await client.run_script(
                    "ps/place",
                    [keys.ps_placement(container), keys.ps_config(container)],
                    [cfg.num_shards, *names],
                )
    elif strategy == "greedy_by_bytes":
        wanted = placement.greedy_by_bytes(variables, cfg.num_shards)
        if wanted:
            with varcheck.naming(keys.ps_placement(container)):
                batch = client.batch()
                for name, shard in wanted.items():
                    batch.hsetnx(keys.ps_placement(container), name, shard)
                await batch.run()
    else:
        raise InvalidArgumentError(
            f"unknown placement strategy {strategy!r}: use 'round_robin' or 'greedy_by_bytes'"
        )
    return await read_placement(client, container, cfg.num_shards)


# -- queues, the global step, the end of the job ------------------------------------------------


def gradient_queue(
    client: Client, container: str, shard: int, capacity: int = GRADIENT_QUEUE_CAPACITY
) -> FIFOQueue:
    """The gradient queue of ``shard``: one ``uint8`` component of any length per
    element (an encoded :class:`~qps.ps.messages.GradientMessage`); ``capacity``: the
    job's (:attr:`PSConfig.queue_capacity`)."""
    return FIFOQueue(
        capacity,
        [np.uint8],
        shared_name=keys.ps_gradient_queue(shard),
        container=container,
        client=client,
    )


def global_step_counter(client: Client, container: str) -> Counter:
    """TF's global step: the counter shard :data:`GLOBAL_STEP_SHARD` advances once per
    applied worker step."""
    return Counter(keys.GLOBAL_STEP, container=container, client=client)


async def mark_finished(client: Client, container: str) -> int:
    """Mark the job of ``container`` finished: every shard applies what its queue still
    holds and exits 0 (TF's PS never exits: issue #4713). Later pushes fail with
    :class:`~qps.errors.CancelledError`. Returns the number of gradient queues this call
    closed; callers may race (a chief stopping and ``qps job stop`` at once) and each
    succeeds.

    Raises:
        FailedPreconditionError: no PS job is configured in the container.
    """
    cfg = await read_config(client, container)
    if cfg is None:
        raise FailedPreconditionError(f"no PS job in container '{container}'")
    await client.set(keys.ps_finished(container), "1")
    closed = 0
    for shard in range(cfg.num_shards):
        q = gradient_queue(client, container, shard, cfg.queue_capacity)
        if not await q.is_closed():
            try:
                await q.close()
            except CancelledError:  # closed in between by another caller (the chief, a CLI)
                continue
            closed += 1
    if not client.cluster:  # wake shards blocked on their gradient lists
        await client.run_commands(
            [("RPUSH", gradient_list_key(container, s), WAKE) for s in range(cfg.num_shards)]
        )
    return closed


async def is_finished(client: Client, container: str) -> bool:
    """Whether the job of ``container`` was marked finished."""
    return bool(await client.exists(keys.ps_finished(container)))


# -- dead letters ---------------------------------------------------------------------------------


def encode_dead_letter(entry: Mapping[str, Any]) -> bytes:
    """A dead-letter list entry: a msgpack map (``reason``, ``time``, provenance, and
    ``data``, the message's bytes)."""
    return bytes(msgpack.packb(dict(entry), use_bin_type=True))


def decode_dead_letter(raw: bytes | str) -> dict[str, Any]:
    """A dead-letter entry as a dict (``{"reason": ..., "undecodable": True}`` if it is
    not one qps wrote)."""
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        return {"reason": f"undecodable dead letter: {exc}", "undecodable": True}
    return d if isinstance(d, dict) else {"reason": "undecodable dead letter", "undecodable": True}


async def dead_letters(
    client: Client, container: str, shard: int, start: int = 0, stop: int = -1
) -> list[dict[str, Any]]:
    """Shard ``shard``'s dead letters ``start..stop`` (inclusive, oldest first), each a
    dict with ``index`` added."""
    raw = await client.lrange(keys.ps_prefix(container, shard) + "dlq", start, stop)
    out = []
    first = start if start >= 0 else 0
    if start < 0:
        n = await client.llen(keys.ps_prefix(container, shard) + "dlq")
        first = max(0, n + start)
    for i, r in enumerate(raw):
        d = decode_dead_letter(r)
        d["index"] = first + i
        out.append(d)
    return out


async def drop_dead_letters(client: Client, container: str, shard: int) -> int:
    """Delete shard ``shard``'s dead letters; return how many there were."""
    key = keys.ps_prefix(container, shard) + "dlq"
    n, _ = await client.batch(transaction=True).llen(key).delete(key).run()
    return int(n)


# -- synchronous training: tokens -------------------------------------------------------------


class Tokens:
    """Worker ``worker``'s tokens in synchronous training (TF's ``sync_token_q``, one per
    worker here so that each worker takes exactly its own): after each aggregated
    update the shards put the new global step there, and the worker blocks on it after
    pushing its gradient.

    A plain Redis list (``qps:{C}:ps:sync:tokens:<I>``): ``RPUSH`` by the shard that
    completes an update, ``BLPOP`` by the worker, with the next step's reads sent in the
    same round trip. A token needs none of a queue's guarantees: one taken by a worker
    process that died with it is never needed again (a worker started again begins at
    the global step), and one a worker left behind is stale (it goes on from the
    newest)."""

    def __init__(self, client: Client, container: str, worker: int) -> None:
        self.client = client
        self.key = keys.container_prefix(container) + f"ps:sync:tokens:{int(worker)}"

    def put_command(self, step: int) -> tuple[Any, ...]:
        """The command that gives the worker token ``step``."""
        return ("RPUSH", self.key, int(step))

    async def put(self, step: int) -> None:
        await self.client.run_commands([self.put_command(step)])

    def size_commands(self) -> list[tuple[Any, ...]]:
        return [("LLEN", self.key)]

    @staticmethod
    def size_of(replies: Sequence[Any]) -> int | None:
        """The count from the reply to :meth:`size_commands`; None if it is an error."""
        return int(replies[0]) if replies and isinstance(replies[0], int) else None

    async def size(self) -> int:
        return int((await self.client.run_commands(self.size_commands()))[0])

    def wait_command(self, timeout: float) -> tuple[Any, ...]:
        """The command that blocks up to ``timeout`` seconds for the next token and takes
        it (read its reply with :meth:`taken`)."""
        return ("BLPOP", self.key, timeout)

    @staticmethod
    def taken(replies: Sequence[Any]) -> int | None:
        """The token from the reply to :meth:`wait_command`; None if none came in time
        (or the reply is missing or an error)."""
        got = replies[0] if replies else None
        if not isinstance(got, (list, tuple)) or len(got) != 2:
            return None
        return int(got[1])

    async def take_then(
        self, commands: Sequence[Sequence[Any]], timeout: float
    ) -> tuple[int, list[Any]]:
        """Block for the next token (up to ``timeout`` seconds); plain read ``commands``
        run right after it is taken, in the same round trip (their replies come back
        in order, an error in its place). Without a lean connection (fakeredis) they
        run in a round trip of their own after it; on a cluster they must be of the
        list's slot, and without a lean connection they do not run ([]).

        Raises:
            DeadlineExceededError: no token came within ``timeout``.
        """
        wait = self.wait_command(timeout)
        replies = await self.client.write_commands([wait, *commands])
        if replies is None:  # no lean connection (fakeredis, a cluster node unknown)
            got = await self.client.blpop([self.key], timeout)
            after: list[Any] = []
            if got is not None and commands and not self.client.cluster:
                after = await self.client.run_commands_replies(commands)
        else:
            got, after = replies[0], replies[1:]
            if isinstance(got, BaseException):
                raise got
        if got is None:
            raise DeadlineExceededError(f"no token in {timeout} s ({self.key})")
        return int(got[1]), after

    async def take_all(self) -> list[int]:
        """The tokens waiting now (none taken if none wait)."""
        got = await self.client.lpop(self.key, 1 << 20)
        return [int(v) for v in got or []]


def tokens(client: Client, container: str, worker: int) -> Tokens:
    """Worker ``worker``'s :class:`Tokens`."""
    return Tokens(client, container, worker)

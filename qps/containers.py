"""Resource containers: named namespaces in Redis holding queues, counters, variables
and accumulators (TF 1.x: the containers of a server's ResourceMgr).

A container is nothing but a naming rule (see :mod:`qps.keys`): every key of container
``C`` starts with ``qps:{C}:`` or ``qps:{C/``. Each kind of resource registers its names
in a set ``qps:{C}:<kind>`` (``queues``, ``counters``, ``variables``,
``accumulators``), and ``qps:containers`` lists the containers. Because of the rule,
:func:`reset` can delete a container by pattern (SCAN + UNLINK) without knowing its
resources, and never touches a key of another container.

This module also holds :class:`Counter`, a named int64 counter in a container (TF's
global step builds on it).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from qps import keys
from qps.errors import InternalError, InvalidArgumentError, NotFoundError, OutOfRangeError
from qps.transport import Client, map_errors

log = logging.getLogger("qps.containers")

#: SCAN ``COUNT`` hint: keys the server looks at per SCAN call.
SCAN_COUNT = 1000
#: Keys per ``UNLINK`` (and per ``MEMORY USAGE`` pipeline) call.
BATCH = 500
#: :func:`reset` scans a container again until a pass finds nothing, at most this often
#: (a later pass only finds keys that a live process wrote during the previous one).
MAX_RESET_PASSES = 5

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: Plural kind names, in the order they are reported.
KINDS: tuple[str, ...] = tuple(keys.RESOURCE_KINDS.values())


def _text(x: bytes | str) -> str:
    return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else str(x)


def check_containers(containers: Iterable[str]) -> list[str]:
    """The validated, de-duplicated container names (order kept).

    Raises:
        InvalidArgumentError: an invalid name, or a single string instead of a list.
    """
    if isinstance(containers, (str, bytes)):
        raise InvalidArgumentError(
            f"containers must be a list of names, not the single string {containers!r}: "
            f"write [{containers!r}]"
        )
    out: list[str] = []
    for c in containers:
        keys.check_container(c)
        if c not in out:
            out.append(c)
    return out


# -- registry ---------------------------------------------------------------------------


async def register_container(client: Client, container: str) -> None:
    """Add ``container`` to the list of containers (``qps:containers``).

    Raises:
        InvalidArgumentError: an invalid container name.
    """
    keys.check_container(container)
    with map_errors():
        await client.commands.sadd(keys.CONTAINERS, container)


async def _discover(client: Client) -> set[str]:
    """Containers that own at least one key, found by scanning the whole keyspace."""
    found: set[str] = set()
    with map_errors():
        async for key in client.commands.scan_iter(match=keys.ALL_CONTAINER_KEYS, count=SCAN_COUNT):
            c = keys.container_of(key)
            if c is not None:
                found.add(c)
    return found


async def list_containers(client: Client, *, discover: bool = False) -> list[str]:
    """Names of the containers, sorted.

    Args:
        discover: also scan the whole keyspace for containers that own keys but are not
            registered (left over by a crashed :func:`reset`, or written by hand). This
            costs one full SCAN of the database.
    """
    with map_errors():
        names = {_text(n) for n in await client.commands.smembers(keys.CONTAINERS)}
    if discover:
        names |= await _discover(client)
    return sorted(names)


async def resource_names(client: Client, container: str) -> dict[str, list[str]]:
    """The registered resources of ``container``: kind (``"queues"``, ``"counters"``,
    ``"variables"``, ``"accumulators"``) -> sorted names. Empty lists for a missing one.
    """
    keys.check_container(container)
    with map_errors():
        pipe = client.commands.pipeline(transaction=False)
        for tag in keys.RESOURCE_KINDS:
            pipe.smembers(keys.container_registry(container, tag))
        replies = await pipe.execute()
    return {
        kind: sorted(_text(n) for n in members)
        for kind, members in zip(KINDS, replies, strict=True)
    }


@dataclass(frozen=True)
class ContainerSummary:
    """One row of ``qps container ls``: a container and how many resources of each kind
    it has registered (read from the registry sets; no scan)."""

    name: str
    registered: bool
    resources: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "registered": self.registered, **self.resources}


async def container_summaries(client: Client, *, discover: bool = False) -> list[ContainerSummary]:
    """A :class:`ContainerSummary` for each container (see :func:`list_containers`)."""
    with map_errors():
        registered = {_text(n) for n in await client.commands.smembers(keys.CONTAINERS)}
    names = set(registered)
    if discover:
        names |= await _discover(client)
    ordered = sorted(names)
    if not ordered:
        return []
    with map_errors():
        pipe = client.commands.pipeline(transaction=False)
        for name in ordered:
            for tag in keys.RESOURCE_KINDS:
                pipe.scard(keys.container_registry(name, tag))
        counts = await pipe.execute()
    n = len(KINDS)
    return [
        ContainerSummary(
            name=name,
            registered=name in registered,
            resources={k: int(v) for k, v in zip(KINDS, counts[i * n : (i + 1) * n])},
        )
        for i, name in enumerate(ordered)
    ]


# -- keys of a container --------------------------------------------------------------------


async def scan_container_keys(client: Client, container: str) -> AsyncIterator[bytes]:
    """Every key of ``container`` (SCAN: keys that exist for the whole iteration are
    yielded at least once; a key may be yielded twice). Never a key of another container.
    """
    keys.check_container(container)
    for pattern in keys.container_key_patterns(container):
        with map_errors():
            async for key in client.commands.scan_iter(match=pattern, count=SCAN_COUNT):
                raw = key if isinstance(key, bytes) else str(key).encode()
                # The pattern already guarantees this; a key of another container must
                # never reach UNLINK, whatever a future pattern bug does.
                if keys.container_of(raw) == container:
                    yield raw


def _kind_label(key: bytes) -> str:
    tag = keys.kind_of(key)
    if tag is None:
        return "container"
    return keys.RESOURCE_KINDS.get(tag, tag)


@dataclass(frozen=True)
class ContainerStats:
    """What a container holds, read without changing it.

    Attributes:
        name: the container.
        registered: listed in ``qps:containers``.
        resources: kind -> registered names (``queues``, ``counters``, ``variables``,
            ``accumulators``).
        counters: counter name -> value (counters whose key is missing are left out).
        keys: keys the container owns (found by SCAN).
        keys_by_kind: those keys by the kind of resource they belong to; ``container``
            counts the container's own keys (its registry sets).
        memory_bytes: the sum of ``MEMORY USAGE`` over those keys (an estimate: Redis
            samples large aggregates), or None when not measured.
        memory_by_kind: the same by kind, or None.
        memory_note: why memory is None (the server lacks ``MEMORY USAGE``, e.g.
            fakeredis, or it was not asked for); None when measured.
    """

    name: str
    registered: bool
    resources: dict[str, list[str]]
    counters: dict[str, int]
    keys: int
    keys_by_kind: dict[str, int]
    memory_bytes: int | None
    memory_by_kind: dict[str, int] | None
    memory_note: str | None = None

    @property
    def resource_counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.resources.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "registered": self.registered,
            "resource_counts": self.resource_counts,
            "resources": self.resources,
            "counters": self.counters,
            "keys": self.keys,
            "keys_by_kind": self.keys_by_kind,
            "memory_bytes": self.memory_bytes,
            "memory_by_kind": self.memory_by_kind,
            "memory_note": self.memory_note,
        }


async def _memory(client: Client, found: list[bytes]) -> tuple[dict[str, int] | None, str | None]:
    """MEMORY USAGE of ``found`` by kind, or (None, why) when the server lacks it."""
    by_kind: dict[str, int] = {}
    for i in range(0, len(found), BATCH):
        chunk = found[i : i + BATCH]
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            for key in chunk:
                pipe.memory_usage(key)
            replies = await pipe.execute(raise_on_error=False)
        for key, reply in zip(chunk, replies, strict=True):
            if isinstance(reply, Exception):
                return None, f"not measured: this server does not answer MEMORY USAGE ({reply})"
            label = _kind_label(key)
            by_kind[label] = by_kind.get(label, 0) + int(reply or 0)  # None: deleted since
    return by_kind, None


async def container_stats(client: Client, name: str, *, memory: bool = True) -> ContainerStats:
    """Read what container ``name`` holds: its registered resources, counter values,
    key count and (``memory=True``, where the server supports ``MEMORY USAGE``) a memory
    estimate. Costs a SCAN of the database, plus one ``MEMORY USAGE`` per key.

    Raises:
        InvalidArgumentError: an invalid container name.
        NotFoundError: the container is neither registered nor owns any key.
    """
    keys.check_container(name)
    with map_errors():
        registered = bool(await client.commands.sismember(keys.CONTAINERS, name))
    resources = await resource_names(client, name)
    found = sorted({k async for k in scan_container_keys(client, name)})
    if not registered and not found:
        raise NotFoundError(f"no container '{name}'")
    keys_by_kind: dict[str, int] = {}
    for key in found:
        label = _kind_label(key)
        keys_by_kind[label] = keys_by_kind.get(label, 0) + 1
    counters = await _counter_values(client, name, resources["counters"])
    mem_by_kind: dict[str, int] | None = None
    note: str | None = "not measured (memory=False)"
    if memory:
        mem_by_kind, note = await _memory(client, found)
    return ContainerStats(
        name=name,
        registered=registered,
        resources=resources,
        counters=counters,
        keys=len(found),
        keys_by_kind=dict(sorted(keys_by_kind.items())),
        memory_bytes=None if mem_by_kind is None else sum(mem_by_kind.values()),
        memory_by_kind=None if mem_by_kind is None else dict(sorted(mem_by_kind.items())),
        memory_note=note,
    )


# -- reset ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResetResult:
    """What :func:`reset` deleted from one container.

    Attributes:
        container: the container.
        existed: it was registered or owned keys before the reset.
        keys_deleted: keys removed (UNLINK's count).
        resources: kind -> the names that were registered (what was deleted).
        passes: SCAN passes made; the last one found nothing unless ``clean`` is False.
        clean: the last pass found no key. False means some process kept writing into
            the container during the reset (:data:`MAX_RESET_PASSES` passes).
    """

    container: str
    existed: bool
    keys_deleted: int
    resources: dict[str, list[str]] = field(default_factory=dict)
    passes: int = 0
    clean: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "container": self.container,
            "existed": self.existed,
            "keys_deleted": self.keys_deleted,
            "resources": self.resources,
            "passes": self.passes,
            "clean": self.clean,
        }


async def _unlink(client: Client, batch: list[bytes]) -> int:
    with map_errors():
        return int(await client.commands.unlink(*batch))


async def _reset_one(client: Client, container: str) -> ResetResult:
    with map_errors():
        registered = bool(await client.commands.sismember(keys.CONTAINERS, container))
    resources = await resource_names(client, container)
    deleted = 0
    seen_keys = False
    passes = 0
    found_last = 0
    while passes < MAX_RESET_PASSES:
        passes += 1
        found_last = 0
        batch: list[bytes] = []
        async for key in scan_container_keys(client, container):
            found_last += 1
            batch.append(key)
            if len(batch) >= BATCH:
                deleted += await _unlink(client, batch)
                batch = []
        if batch:
            deleted += await _unlink(client, batch)
        seen_keys = seen_keys or found_last > 0
        if found_last == 0:
            break
    clean = found_last == 0
    if not clean:
        log.warning(
            "container %r: keys still appeared after %d passes; a process is writing into it",
            container,
            passes,
        )
    # Unregistered last: a reset that dies half-way leaves the container listed, so
    # running it again finishes the job.
    with map_errors():
        await client.commands.srem(keys.CONTAINERS, container)
    return ResetResult(
        container=container,
        existed=registered or seen_keys,
        keys_deleted=deleted,
        resources=resources,
        passes=passes,
        clean=clean,
    )


async def reset(client: Client, containers: Iterable[str] | None = None) -> list[ResetResult]:
    """Delete every key of the named containers and unregister them (TF:
    ``tf.Session.reset(target, containers)``).

    ``containers=None`` resets **every** container (the registered ones and any found
    by scanning), as TF does. A container that does not exist is reported with
    ``existed=False``; it is not an error. Keys of other containers are never touched,
    even when one name is a prefix of another ("a" and "ab").

    Processes still using a reset resource get :class:`~qps.errors.NotFoundError` on
    their next call (blocked queue calls within about a second); resources opened
    afterwards are created afresh.

    Raises:
        InvalidArgumentError: an invalid name (checked before anything is deleted), or
            a single string instead of a list.
    """
    if containers is None:
        names = await list_containers(client, discover=True)
    else:
        names = check_containers(containers)
    return [await _reset_one(client, c) for c in names]


# -- counters ------------------------------------------------------------------------------

#: Changes a counter only if it exists (a counter removed by a reset stays removed
#: instead of coming back at 0). Replies are strings: Lua numbers are doubles, and
#: an int64 must come back exact.
_COUNTER_SCRIPT = """
local old = redis.call('GET', KEYS[1])
if not old then return {'gone'} end
if ARGV[1] == 'add' then
  local r = redis.pcall('INCRBY', KEYS[1], ARGV[2])
  if type(r) == 'table' and r.err then return {'err', r.err} end
  return {'ok', redis.call('GET', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[2])
return {'ok', old}
"""


def _int64(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}") from None
    if not INT64_MIN <= v <= INT64_MAX:
        raise InvalidArgumentError(f"{what} {v} does not fit in int64")
    return v


def _parse_int(raw: bytes | str, where: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InternalError(f"{where} holds {raw!r}, not an integer") from None


async def _counter_values(client: Client, container: str, names: list[str]) -> dict[str, int]:
    if not names:
        return {}
    with map_errors():
        counter_keys = [keys.counter_key(container, n) for n in names]
        # each counter has a hash tag of its own: on a cluster, MGET per slot
        mget = cast(Any, client.commands).mget_nonatomic if client.cluster else client.commands.mget
        raw = await mget(counter_keys)
    return {
        n: _parse_int(v, f"counter '{container}/{n}'")
        for n, v in zip(names, raw, strict=True)
        if v is not None
    }


async def list_counters(client: Client, container: str = keys.DEFAULT_CONTAINER) -> list[str]:
    """Names of the counters registered in ``container``, sorted."""
    keys.check_container(container)
    with map_errors():
        names = await client.commands.smembers(keys.container_counters(container))
    return sorted(_text(n) for n in names)


class Counter:
    """A named int64 counter in a container, shared by every process that opens the
    same name (TF's global step builds on it).

    The counter is created with ``initial`` on first use if it does not exist yet; an
    existing one keeps its value (the first creator wins, as with TF's shared
    resources). Every change is one atomic server-side step.

    Args:
        name: the counter's name (``[A-Za-z0-9_.:/-]``, 1-200 characters).
        container: the resource container (default ``"default"``).
        client: a :class:`qps.Client`; defaults to the process-wide one.
        initial: the value a new counter starts from.

    Raises:
        InvalidArgumentError: an invalid name, container or initial value.
    """

    def __init__(
        self,
        name: str,
        *,
        container: str | None = None,
        client: Client | None = None,
        initial: int = 0,
    ) -> None:
        self._name = keys.check_name(name)
        self._container = keys.check_container(container or keys.DEFAULT_CONTAINER)
        self._client = client
        self._initial = _int64(initial, "initial value")
        self._key = keys.counter_key(self._container, self._name)
        self._opened = False
        self._script: Any = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def container(self) -> str:
        return self._container

    def __repr__(self) -> str:
        return f"<qps.Counter {self._container}/{self._name}>"

    async def _c(self) -> Client:
        if self._client is None:
            from qps.queues.waiters import default_client

            self._client = await default_client()
        if not self._opened:
            with map_errors():
                pipe = self._client.commands.pipeline(transaction=False)
                pipe.set(self._key, self._initial, nx=True)
                pipe.sadd(keys.CONTAINERS, self._container)
                pipe.sadd(keys.container_counters(self._container), self._name)
                await pipe.execute()
            self._opened = True
        return self._client

    def _gone(self) -> NotFoundError:
        return NotFoundError(
            f"counter '{self._name}' no longer exists in container '{self._container}' "
            "(was it reset?)"
        )

    async def _run(self, op: str, arg: int) -> int:
        client = await self._c()
        if self._script is None:
            self._script = client.commands.register_script(_COUNTER_SCRIPT)
        with map_errors():
            reply = await self._script(keys=[self._key], args=[op, arg])
        status = _text(reply[0])
        if status == "gone":
            raise self._gone()
        if status == "err":
            text = _text(reply[1])
            if "overflow" in text:
                raise OutOfRangeError(
                    f"counter '{self._container}/{self._name}': adding {arg} would overflow int64"
                )
            raise InternalError(f"counter '{self._container}/{self._name}': {text}")
        return _parse_int(reply[1], f"counter '{self._container}/{self._name}'")

    async def get(self) -> int:
        """The current value.

        Raises:
            NotFoundError: the counter was deleted (its container reset) since this
                object created or found it.
        """
        client = await self._c()
        with map_errors():
            raw = await client.commands.get(self._key)
        if raw is None:
            raise self._gone()
        return _parse_int(raw, f"counter '{self._container}/{self._name}'")

    async def add(self, delta: int = 1) -> int:
        """Add ``delta`` (may be negative) atomically; return the new value.

        Raises:
            InvalidArgumentError: ``delta`` is not an int64.
            OutOfRangeError: the result would not fit in int64 (nothing changes).
            NotFoundError: the counter was deleted (its container reset).
        """
        return await self._run("add", _int64(delta, "delta"))

    async def set(self, value: int) -> int:
        """Set the value atomically; return the previous one.

        Raises:
            InvalidArgumentError: ``value`` is not an int64.
            NotFoundError: the counter was deleted (its container reset).
        """
        return await self._run("set", _int64(value, "value"))

"""Resource containers: named namespaces in Redis holding queues, counters, variables
and accumulators (TF 1.x: the containers of a server's ResourceMgr).

A container is nothing but a naming rule (see :mod:`qps.keys`): every key of container
``C`` starts with ``qps:{C}:`` or ``qps:{C/``. Each kind of resource registers its names
in a set ``qps:{C}:<kind>`` (``queues``, ``counters``, ``variables``,
``accumulators``), and the container registers itself with ``qps:{C}:registered``
(:mod:`qps.registry`, which lists the containers). Because of the rule, :func:`reset`
can delete a container by pattern (SCAN + UNLINK) without knowing its resources, and
never touches a key of another container.

What is read back is not trusted: a registry set of another type, a member that is no
valid name, a counter that holds no int64 are reported (:attr:`ContainerStats.problems`,
:attr:`ResetResult.skipped`) or raised as a :class:`~qps.errors.DataLossError` naming
the key, never a bare Python exception, and they never stop the other containers from
being listed or reset.

This module also holds :class:`Counter`, a named int64 counter in a container (TF's
global step builds on it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from qps import keys, registry
from qps.counters import INT64_MAX, INT64_MIN, Counter, counter_values, list_counters
from qps.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from qps.registry import (
    SCAN_COUNT,
    ContainerSummary,
    Listing,
    container_summaries,
    list_containers,
    register_container,
)
from qps.transport import Client, reply_text

log = logging.getLogger("qps.containers")

#: Keys per ``UNLINK`` (and per ``MEMORY USAGE`` pipeline) call.
BATCH = 500
#: :func:`reset` scans a container again until a pass finds nothing, at most this often
#: (a later pass only finds keys that a live process wrote during the previous one).
MAX_RESET_PASSES = 5

#: Plural kind names, in the order they are reported.
KINDS = registry.KINDS
_text = registry.text_of


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


# -- registry (qps/registry.py) -----------------------------------------------------------

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "SCAN_COUNT",
    "ContainerStats",
    "ContainerSummary",
    "Counter",
    "Listing",
    "ResetResult",
    "check_containers",
    "container_stats",
    "container_summaries",
    "list_containers",
    "list_counters",
    "register_container",
    "reset",
    "resource_names",
    "scan_container_keys",
]


async def _resources(client: Client, container: str) -> tuple[dict[str, list[str]], list[str]]:
    """The valid names in each registry set of ``container``, and what was skipped: a
    set that is another type of key, a member that is not a valid resource name."""
    tags = list(keys.RESOURCE_KINDS)
    batch = client.batch()
    for tag in tags:
        batch.smembers(keys.container_registry(container, tag))
    replies = await batch.run(raise_on_error=False)
    out: dict[str, list[str]] = {}
    problems: list[str] = []
    for tag, kind, members in zip(tags, KINDS, replies, strict=True):
        where = keys.container_registry(container, tag)
        if isinstance(members, PermissionDeniedError):
            raise members
        if isinstance(members, Exception):
            problems.append(f"{where}: {reply_text(members)}")
            out[kind] = []
            continue
        names = []
        for raw in members:
            name = _valid_name(raw)
            if name is None:
                problems.append(f"{where} holds {raw!r}, not a valid resource name: skipped")
            else:
                names.append(name)
        out[kind] = sorted(names)
    return out, sorted(problems)


def _valid_name(raw: bytes | str) -> str | None:
    try:
        return keys.check_name(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, ValueError):  # InvalidArgumentError is a ValueError
        return None


async def resource_names(client: Client, container: str) -> dict[str, list[str]]:
    """The registered resources of ``container``: kind (``"queues"``, ``"counters"``,
    ``"variables"``, ``"accumulators"``) -> sorted names. Empty lists for a missing one;
    a registry set that is another type of key, and members that are not valid names,
    are left out (:func:`container_stats` reports them).
    """
    keys.check_container(container)
    return (await _resources(client, container))[0]


# -- keys of a container --------------------------------------------------------------------


async def scan_container_keys(
    client: Client, container: str, *, registration: bool = False
) -> AsyncIterator[bytes]:
    """Every key of ``container`` (SCAN: keys that exist for the whole iteration are
    yielded at least once; a key may be yielded twice). Never a key of another container.

    Its registration key (:func:`qps.keys.registration`) only with ``registration=True``:
    it is no state of the container's resources (a container that holds only it, as a
    Session that opened and created nothing leaves it, counts as empty).
    """
    keys.check_container(container)
    mark = keys.registration(container).encode()
    for pattern in keys.container_key_patterns(container):
        async for key in registry.scan_keys(client, pattern):
            # The pattern already guarantees this; a key of another container must
            # never reach UNLINK, whatever a future pattern bug does.
            if keys.container_of(key) == container and (registration or key != mark):
                yield key


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
        registered: it has its registration key (or is in the legacy set).
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
        problems: corrupt state met and left out, each naming its key (a registry set
            of another type, an invalid name in one, a counter that holds no int64).
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
    problems: tuple[str, ...] = ()

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
            "problems": list(self.problems),
        }


async def _memory(client: Client, found: list[bytes]) -> tuple[dict[str, int] | None, str | None]:
    """MEMORY USAGE of ``found`` by kind, or (None, why) when the server lacks it."""
    by_kind: dict[str, int] = {}
    for i in range(0, len(found), BATCH):
        chunk = found[i : i + BATCH]
        batch = client.batch()
        for key in chunk:
            batch.memory_usage(key)
        replies = await batch.run(raise_on_error=False)
        for key, reply in zip(chunk, replies, strict=True):
            if isinstance(reply, Exception):
                why = reply_text(reply)
                return None, f"not measured: this server does not answer MEMORY USAGE ({why})"
            label = _kind_label(key)
            by_kind[label] = by_kind.get(label, 0) + int(reply or 0)  # None: deleted since
    return by_kind, None


async def container_stats(client: Client, name: str, *, memory: bool = True) -> ContainerStats:
    """Read what container ``name`` holds: its registered resources, counter values,
    key count and (``memory=True``, where the server supports ``MEMORY USAGE``) a memory
    estimate. Costs a SCAN of the database, plus one ``MEMORY USAGE`` per key. Corrupt
    state is left out and listed in :attr:`ContainerStats.problems`.

    Raises:
        InvalidArgumentError: an invalid container name.
        NotFoundError: the container is neither registered nor owns any key.
        PermissionDeniedError: the credentials do not reach the container.
    """
    keys.check_container(name)
    registered = await registry.is_registered(client, name)
    resources, problems = await _resources(client, name)
    found = sorted({k async for k in scan_container_keys(client, name, registration=True)})
    if not registered and not found:
        raise NotFoundError(f"no container '{name}'")
    keys_by_kind: dict[str, int] = {}
    for key in found:
        label = _kind_label(key)
        keys_by_kind[label] = keys_by_kind.get(label, 0) + 1
    counters, bad = await counter_values(client, name, resources["counters"])
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
        problems=tuple(problems + bad),
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
        skipped: why nothing was done, for an entry of the legacy registry that is no
            valid container name (``container`` then shows it as text; the entry is
            removed from that set where the credentials allow); None otherwise.
    """

    container: str
    existed: bool
    keys_deleted: int
    resources: dict[str, list[str]] = field(default_factory=dict)
    passes: int = 0
    clean: bool = True
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {
            "container": self.container,
            "existed": self.existed,
            "keys_deleted": self.keys_deleted,
            "resources": self.resources,
            "passes": self.passes,
            "clean": self.clean,
        }
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


async def _reset_one(client: Client, container: str) -> ResetResult:
    registered = await registry.is_registered(client, container)
    resources, problems = await _resources(client, container)
    for p in problems:
        log.warning("container %r: %s (deleted with the rest)", container, p)
    mark = keys.registration(container).encode()
    deleted = 0
    seen_keys = False
    passes = 0
    found_last = 0
    while passes < MAX_RESET_PASSES:
        passes += 1
        found_last = 0
        batch: list[bytes] = []
        async for key in scan_container_keys(client, container):  # all but `mark`
            found_last += 1
            batch.append(key)
            if len(batch) >= BATCH:
                deleted += await client.unlink(*batch)
                batch = []
        if batch:
            deleted += await client.unlink(*batch)
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
    deleted += await client.unlink(mark)
    await registry.drop_legacy_entry(client, container.encode())
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
    by scanning), as TF does; an entry of the legacy registry that is no valid name is
    skipped, reported with :attr:`ResetResult.skipped`, and dropped from that set. A
    container that does not exist is reported with
    ``existed=False``; it is not an error. Keys of other containers are never touched,
    even when one name is a prefix of another ("a" and "ab").

    Processes still using a reset resource get :class:`~qps.errors.NotFoundError` on
    their next call (blocked queue calls within about a second); resources opened
    afterwards are created afresh.

    Raises:
        InvalidArgumentError: an invalid name (checked before anything is deleted), or
            a single string instead of a list.
        PermissionDeniedError: the credentials do not reach a container (nothing of it
            is deleted: UNLINK is refused whole).
    """
    if containers is not None:
        return [await _reset_one(client, c) for c in check_containers(containers)]
    found = await registry.listing(client, discover=True)
    results = [await _reset_one(client, c) for c in found.names]
    for raw in found.invalid:
        why = f"{keys.CONTAINERS} holds {raw!r}, not a valid container name"
        dropped = await registry.drop_legacy_entry(client, raw)
        why += "; removed from it" if dropped else "; left in it (cannot write it)"
        log.warning("reset: skipped %s", why)
        results.append(ResetResult(_text(raw), existed=False, keys_deleted=0, skipped=why))
    return results

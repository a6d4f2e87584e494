"""Which containers exist on a server: registration and listing.

A container registers itself with a key of its own, ``qps:{C}:registered``
(:func:`qps.keys.registration`), which whatever opens a resource in it writes once
(``SET NX``): a :class:`qps.Session`, a queue, a counter, a variable, a PS job. The key
lies in the container's own key space, so

- a Redis ACL user limited to one container (``~qps:{C}:* ~qps:{C/*``) registers it
  and can neither register, unregister nor hide any other: no key is shared between
  tenants;
- :func:`qps.containers.reset` deletes it with the rest of the container.

Listing SCANs the keyspace for these keys (on a Redis Cluster, every primary). It costs
one pass over the whole keyspace, whatever the number of containers: about 0.5 s for a
million keys (``COUNT 1000``: a thousand round trips, none blocking the server for more
than a few milliseconds), against one ``SMEMBERS`` for a shared set; the price of a
registry no tenant can write. ``discover=True`` also takes the containers that own keys
but no registration key.

Earlier versions kept a shared set, ``qps:containers`` (:data:`qps.keys.CONTAINERS`),
which any process could write. It is still read as a second source of names (a server
written by those versions, or by processes of both versions at once, keeps listing
every container), never written; :func:`qps.containers.reset` removes a container from
it where the credentials allow. Its entries are not trusted: one that is not a valid
container name is left out and reported in :attr:`Listing.problems`, and a set that
cannot be read (another type, or no permission) is reported the same way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from qps import keys
from qps.errors import InternalError, PermissionDeniedError
from qps.transport import Client, reply_text

log = logging.getLogger("qps.containers")

#: SCAN ``COUNT`` hint: keys the server looks at per SCAN call.
SCAN_COUNT = 1000

#: Plural kind names, in the order they are reported.
KINDS: tuple[str, ...] = tuple(keys.RESOURCE_KINDS.values())


def text_of(raw: bytes | str) -> str:
    """``raw`` as text (undecodable bytes replaced), for names and messages."""
    return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)


def valid_container(raw: bytes | str) -> str | None:
    """``raw`` as a container name, or None if it is not a valid one."""
    try:
        name = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return keys.check_container(name)
    except (UnicodeDecodeError, ValueError):  # InvalidArgumentError is a ValueError
        return None


async def register_container(client: Client, container: str) -> None:
    """Register ``container`` (write its registration key if it is missing).

    Raises:
        InvalidArgumentError: an invalid container name.
        PermissionDeniedError: the credentials do not reach the container.
    """
    keys.check_container(container)
    await client.set(keys.registration(container), 1, nx=True)


async def scan_keys(client: Client, pattern: str) -> AsyncIterator[bytes]:
    """The keys matching ``pattern`` (on a cluster, those of every primary)."""
    async for key in client.scan(pattern, SCAN_COUNT):
        yield key if isinstance(key, bytes) else str(key).encode()


async def _containers_of(
    client: Client, pattern: str, container: Callable[[bytes], str | None]
) -> set[str]:
    """The containers ``container(key)`` names among the keys matching ``pattern``."""
    found: set[str] = set()
    async for key in scan_keys(client, pattern):
        c = container(key)
        if c is not None:
            found.add(c)
    return found


async def _registered_by_key(client: Client) -> set[str]:
    """Containers with a registration key."""
    return await _containers_of(client, keys.ALL_REGISTRATIONS, keys.is_registration)


async def _discover(client: Client) -> set[str]:
    """Containers that own at least one key, found by scanning the whole keyspace."""
    return await _containers_of(client, keys.ALL_CONTAINER_KEYS, keys.container_of)


async def _legacy(client: Client) -> tuple[set[str], list[bytes], list[str]]:
    """The valid names of the legacy set, its invalid entries, and the problems met."""
    where = keys.CONTAINERS
    try:
        kind = await client.type(where)
        if kind == "none":
            return set(), [], []
        if kind != "set":
            return set(), [], [f"{where} is a {kind}, not a set: ignored"]
        members = await client.smembers(where)
    except (PermissionDeniedError, InternalError) as exc:
        return set(), [], [f"{where} (the legacy registry) cannot be read: {exc}"]
    names: set[str] = set()
    invalid: list[bytes] = []
    problems: list[str] = []
    for raw in sorted(members):
        name = valid_container(raw)
        if name is None:
            invalid.append(raw if isinstance(raw, bytes) else str(raw).encode())
            problems.append(f"{where} holds {raw!r}, not a valid container name: skipped")
        else:
            names.add(name)
    return names, invalid, problems


async def in_legacy(client: Client, container: str) -> bool:
    """Whether the legacy set lists ``container`` (False where it cannot be read)."""
    try:
        return await client.sismember(keys.CONTAINERS, container)
    except (PermissionDeniedError, InternalError):
        return False


async def is_registered(client: Client, container: str) -> bool:
    """Whether ``container`` has its registration key or is in the legacy set."""
    if await client.exists(keys.registration(container)):
        return True
    return await in_legacy(client, container)


async def unregister(client: Client, container: str) -> None:
    """Delete the registration key of ``container`` and take it out of the legacy set
    (where the credentials allow: a tenant cannot write that set, and need not)."""
    await client.unlink(keys.registration(container))
    await drop_legacy_entry(client, container.encode())


async def drop_legacy_entry(client: Client, raw: bytes) -> bool:
    """Remove ``raw`` from the legacy set; False where that is not allowed or it is not
    a set."""
    try:
        await client.srem(keys.CONTAINERS, raw)
        return True
    except (PermissionDeniedError, InternalError):
        return False


@dataclass(frozen=True)
class Listing:
    """The containers of a server, as :func:`listing` found them.

    Attributes:
        names: every container, sorted (valid names only).
        registered: those with a registration key or listed in the legacy set; the
            others (with ``discover=True``) only own keys.
        problems: what was skipped and why (invalid legacy entries, a legacy set that
            cannot be read); empty on a healthy server.
        invalid: the invalid entries of the legacy set, as stored.
    """

    names: list[str]
    registered: frozenset[str]
    problems: tuple[str, ...] = ()
    invalid: tuple[bytes, ...] = ()


async def listing(client: Client, *, discover: bool = False) -> Listing:
    """The containers of the server (see :class:`Listing`): one SCAN of the keyspace
    for registration keys (and with ``discover`` one for every container key), plus
    the legacy set."""
    registered = await _registered_by_key(client)
    legacy, invalid, problems = await _legacy(client)
    registered |= legacy
    names = set(registered)
    if discover:
        names |= await _discover(client)
    for p in problems:
        log.warning("container registry: %s", p)
    return Listing(sorted(names), frozenset(registered), tuple(problems), tuple(invalid))


async def list_containers(client: Client, *, discover: bool = False) -> list[str]:
    """Names of the containers, sorted.

    Args:
        discover: also the containers that own keys but are not registered (left over
            by a crashed :func:`qps.containers.reset`, or written by hand). This costs
            a second SCAN of the database.
    """
    return (await listing(client, discover=discover)).names


@dataclass(frozen=True)
class ContainerSummary:
    """One row of ``qps container ls``: a container and how many resources of each kind
    it has registered (read from its registry sets; no scan of its keys).

    ``resources[kind]`` is None when that registry set cannot be read (another type
    of key): ``problems`` says which key."""

    name: str
    registered: bool
    resources: dict[str, int | None]
    problems: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "registered": self.registered, **self.resources}
        if self.problems:
            out["problems"] = list(self.problems)
        return out


async def summaries(client: Client, found: Listing) -> list[ContainerSummary]:
    """A :class:`ContainerSummary` for each container of ``found``.

    Raises:
        PermissionDeniedError: the credentials cannot read a container's registries.
    """
    if not found.names:
        return []
    tags = list(keys.RESOURCE_KINDS)
    batch = client.batch()
    for name in found.names:
        for tag in tags:
            batch.scard(keys.container_registry(name, tag))
    counts = await batch.run(raise_on_error=False)
    out = []
    for i, name in enumerate(found.names):
        resources: dict[str, int | None] = {}
        problems: list[str] = []
        for j, (tag, kind) in enumerate(zip(tags, KINDS, strict=True)):
            reply = counts[i * len(tags) + j]
            if isinstance(reply, PermissionDeniedError):
                raise reply
            if isinstance(reply, Exception):
                resources[kind] = None
                problems.append(f"{keys.container_registry(name, tag)}: {reply_text(reply)}")
            else:
                resources[kind] = int(reply)
        out.append(ContainerSummary(name, name in found.registered, resources, tuple(problems)))
    return out


async def container_summaries(client: Client, *, discover: bool = False) -> list[ContainerSummary]:
    """A :class:`ContainerSummary` for each container (see :func:`list_containers`)."""
    return await summaries(client, await listing(client, discover=discover))

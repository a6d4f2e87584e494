"""Shared by the corruption suite (tests/test_corrupt_*.py) and the isolation tests:
a byte-exact dump of the server's keys, and the check that a neighbour container was
not touched by whatever a test did to another one."""

from __future__ import annotations

from typing import Any

from qps import keys
from qps.transport import Client

Dump = dict[bytes, tuple[Any, ...]]


async def dump_all(client: Client) -> Dump:
    """Every key of the server with its type, full value and TTL."""
    r = client.commands
    out: Dump = {}
    async for key in r.scan_iter(match="*", count=1000):
        kind = await r.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "none":  # expired or deleted since the scan (another test's record)
            continue
        if kind == "string":
            value: Any = await r.get(key)
        elif kind == "list":
            value = tuple(await r.lrange(key, 0, -1))
        elif kind == "hash":
            value = tuple(sorted((await r.hgetall(key)).items()))
        elif kind == "set":
            value = tuple(sorted(await r.smembers(key)))
        elif kind == "zset":
            value = tuple(await r.zrange(key, 0, -1, withscores=True))
        else:
            raise AssertionError(f"unexpected type {kind} of {key!r}")
        out[key] = (kind, value, await r.pttl(key))
    return out


def of_container(dump: Dump, container: str) -> Dump:
    """The keys of ``container`` in a dump."""
    return {k: v for k, v in dump.items() if keys.container_of(k) == container}


async def container_dump(client: Client, container: str) -> Dump:
    """The keys of ``container`` only, with their values and TTLs."""
    return of_container(await dump_all(client), container)


def assert_same(before: Dump, after: Dump, what: str) -> None:
    """``after`` holds exactly ``before``'s keys with the same values (TTLs may count
    down; a key that had none still has none)."""
    assert before.keys() == after.keys(), (
        f"{what}: keys added {sorted(after.keys() - before.keys())}, "
        f"removed {sorted(before.keys() - after.keys())}"
    )
    for k, (kind, value, ttl) in before.items():
        kind2, value2, ttl2 = after[k]
        assert (kind, value) == (kind2, value2), f"{what}: {k!r} changed"
        assert (ttl < 0) == (ttl2 < 0), f"{what}: {k!r} TTL {ttl} -> {ttl2}"

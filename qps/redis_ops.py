"""Plain Redis commands, typed, for the layers above: :class:`PlainCommands` (a base of
:class:`qps.redis_client.Client`) and :class:`Batch`.

Each command goes through the client's redis-py pool (``commands``; a blocking one,
``BLPOP``/``BLMOVE``, through ``blocking``), returns what redis-py returns (bytes, not
text, except :meth:`PlainCommands.type`), and raises its error translated once into
:mod:`qps.errors` (:func:`~qps.redis_errors.map_errors`). On Redis Cluster the pools
are redis-py ``RedisCluster`` clients: each command goes to the primary owning its
key's slot, :meth:`PlainCommands.scan` visits every primary, ``DEL``/``UNLINK``/
``EXISTS`` split their keys by slot and :meth:`PlainCommands.mget` reads slot by slot.

A :class:`Batch` (:meth:`PlainCommands.batch`) queues commands and runs them in one
round trip, a redis-py pipeline: ``transaction=True`` wraps them in ``MULTI``/``EXEC``
(one slot on a cluster), else a cluster splits them by node and keeps their order.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from qps.redis_errors import in_place, map_errors

Key = str | bytes
Value = bytes | str | int | float
Field = str | bytes | int


class PlainCommands:
    """The plain commands of a :class:`~qps.redis_client.Client` (module docstring)."""

    commands: Any  # redis-py clients (a RedisCluster on a cluster); see Client
    blocking: Any
    cluster: bool

    def batch(self, *, transaction: bool = False) -> Batch:
        """A :class:`Batch` of commands run in one round trip (atomically with
        ``transaction``)."""
        return Batch(self.commands.pipeline(transaction=transaction))

    async def get(self, key: Key) -> bytes | None:
        with map_errors():
            return await self.commands.get(key)  # type: ignore[no-any-return]

    async def mget(self, keys: Sequence[Key]) -> list[bytes | None]:
        """``MGET``; on a cluster, slot by slot (not atomic then)."""
        with map_errors():
            if self.cluster:
                return list(await self.commands.mget_nonatomic(keys))
            return list(await self.commands.mget(keys))

    async def set(self, key: Key, value: Value, *, nx: bool = False) -> bool:
        """``SET`` (``NX``: only if absent); whether it was set."""
        with map_errors():
            return bool(await self.commands.set(key, value, nx=nx))

    async def incr(self, key: Key) -> int:
        with map_errors():
            return int(await self.commands.incr(key))

    async def exists(self, *keys: Key) -> int:
        with map_errors():
            return int(await self.commands.exists(*keys))

    async def delete(self, *keys: Key) -> int:
        with map_errors():
            return int(await self.commands.delete(*keys))

    async def unlink(self, *keys: Key) -> int:
        with map_errors():
            return int(await self.commands.unlink(*keys))

    async def type(self, key: Key) -> str:
        """The key's type as text (``none`` when it is missing)."""
        with map_errors():
            got = await self.commands.type(key)
        return got.decode() if isinstance(got, bytes) else str(got)

    async def scan(self, match: str, count: int) -> AsyncIterator[bytes]:
        """The keys matching ``match`` (``SCAN``; on a cluster, every primary's)."""
        keys = self.commands.scan_iter(match=match, count=count)
        while True:
            with map_errors():
                try:
                    key = await keys.__anext__()
                except StopAsyncIteration:
                    return
            yield key

    async def hget(self, key: Key, field: Field) -> bytes | None:
        with map_errors():
            return await self.commands.hget(key, field)  # type: ignore[no-any-return]

    async def hmget(self, key: Key, fields: Sequence[Field]) -> list[bytes | None]:
        with map_errors():
            return list(await self.commands.hmget(key, fields))

    async def hgetall(self, key: Key) -> dict[bytes, bytes]:
        with map_errors():
            return dict(await self.commands.hgetall(key))

    async def hset(
        self, key: Key, field: Field | None = None, value: Value | None = None, *,
        mapping: Mapping[Any, Any] | None = None,
    ) -> int:  # fmt: skip
        """``HSET key field value``, or every pair of ``mapping``."""
        with map_errors():
            return int(await self.commands.hset(key, field, value, mapping))

    async def hsetnx(self, key: Key, field: Field, value: Value) -> bool:
        with map_errors():
            return bool(await self.commands.hsetnx(key, field, value))

    async def hlen(self, key: Key) -> int:
        with map_errors():
            return int(await self.commands.hlen(key))

    async def smembers(self, key: Key) -> builtins.set[bytes]:
        with map_errors():
            return set(await self.commands.smembers(key))

    async def sismember(self, key: Key, member: Value) -> bool:
        with map_errors():
            return bool(await self.commands.sismember(key, member))

    async def sadd(self, key: Key, *members: Value) -> int:
        with map_errors():
            return int(await self.commands.sadd(key, *members))

    async def srem(self, key: Key, *members: Value) -> int:
        with map_errors():
            return int(await self.commands.srem(key, *members))

    async def llen(self, key: Key) -> int:
        with map_errors():
            return int(await self.commands.llen(key))

    async def lrange(self, key: Key, start: int, stop: int) -> list[bytes]:
        with map_errors():
            return list(await self.commands.lrange(key, start, stop))

    async def lpop(self, key: Key, count: int) -> list[bytes] | None:
        """Up to ``count`` elements off the head; None when the list is empty."""
        with map_errors():
            return await self.commands.lpop(key, count)  # type: ignore[no-any-return]

    async def lrem(self, key: Key, count: int, value: Value) -> int:
        with map_errors():
            return int(await self.commands.lrem(key, count, value))

    async def blpop(self, keys: Sequence[Key], timeout: float) -> tuple[bytes, bytes] | None:
        """``BLPOP`` on the blocking pool: (key, element), or None after ``timeout``
        seconds (0: no limit)."""
        with map_errors():
            got = await self.blocking.blpop(keys, timeout)
        return None if got is None else (got[0], got[1])

    async def blmove(self, source: Key, target: Key, timeout: float) -> bytes | None:
        """``BLMOVE source target LEFT RIGHT`` on the blocking pool."""
        with map_errors():
            return await self.blocking.blmove(source, target, timeout, "LEFT", "RIGHT")  # type: ignore[no-any-return]

    async def zrange(
        self, key: Key, start: int, stop: int, *, withscores: bool = False
    ) -> list[Any]:
        with map_errors():
            return list(await self.commands.zrange(key, start, stop, withscores=withscores))

    async def zadd(self, key: Key, mapping: Mapping[Any, float]) -> int:
        with map_errors():
            return int(await self.commands.zadd(key, dict(mapping)))

    async def zmscore(self, key: Key, members: Sequence[Value]) -> list[float | None]:
        with map_errors():
            return list(await self.commands.zmscore(key, members))

    async def script_load(self, source: str) -> str:
        """``SCRIPT LOAD`` (on a cluster: every primary); the script's SHA."""
        with map_errors():
            return str(await self.commands.script_load(source))

    async def time(self) -> tuple[int, int]:
        """The server's clock: (seconds, microseconds)."""
        with map_errors():
            s, us = await self.commands.time()
        return int(s), int(us)


class Batch:
    """Commands queued to run in one round trip (:meth:`PlainCommands.batch`); each
    method queues one and returns the batch. :meth:`run` returns their replies, as
    the single commands of :class:`PlainCommands` would (a reply of ``HGETALL`` a
    dict, of ``SMEMBERS`` a set...)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._n = 0

    def _add(self, name: str, *args: Any, **kw: Any) -> Batch:
        getattr(self._pipe, name)(*args, **kw)
        self._n += 1
        return self

    def command(self, *args: Any) -> Batch:
        """Any command, as its words (e.g. ``EVALSHA``)."""
        return self._add("execute_command", *args)

    def get(self, key: Key) -> Batch:
        return self._add("get", key)

    def getrange(self, key: Key, start: int, end: int) -> Batch:
        return self._add("getrange", key, start, end)

    def strlen(self, key: Key) -> Batch:
        return self._add("strlen", key)

    def set(self, key: Key, value: Value, *, nx: bool = False) -> Batch:
        return self._add("set", key, value, nx=nx)

    def exists(self, *keys: Key) -> Batch:
        return self._add("exists", *keys)

    def delete(self, *keys: Key) -> Batch:
        return self._add("delete", *keys)

    def type(self, key: Key) -> Batch:
        return self._add("type", key)

    def memory_usage(self, key: Key) -> Batch:
        return self._add("memory_usage", key)

    def time(self) -> Batch:
        return self._add("time")

    def hgetall(self, key: Key) -> Batch:
        return self._add("hgetall", key)

    def hmget(self, key: Key, fields: Sequence[Field]) -> Batch:
        return self._add("hmget", key, fields)

    def hset(self, key: Key, mapping: Mapping[Any, Any]) -> Batch:
        return self._add("hset", key, mapping=dict(mapping))

    def hsetnx(self, key: Key, field: Field, value: Value) -> Batch:
        return self._add("hsetnx", key, field, value)

    def hincrby(self, key: Key, field: Field, amount: int) -> Batch:
        return self._add("hincrby", key, field, amount)

    def smembers(self, key: Key) -> Batch:
        return self._add("smembers", key)

    def sadd(self, key: Key, *members: Value) -> Batch:
        return self._add("sadd", key, *members)

    def scard(self, key: Key) -> Batch:
        return self._add("scard", key)

    def llen(self, key: Key) -> Batch:
        return self._add("llen", key)

    def lrange(self, key: Key, start: int, stop: int) -> Batch:
        return self._add("lrange", key, start, stop)

    def rpush(self, key: Key, *values: Value) -> Batch:
        return self._add("rpush", key, *values)

    def wake(self, key: Key) -> Batch:
        """Leave one token on wake list ``key`` (``RPUSH key 1``, ``LTRIM key -1 -1``):
        a waiter blocked on it, or the next to block, wakes once."""
        self._add("rpush", key, 1)
        return self._add("ltrim", key, -1, -1)

    def zadd(self, key: Key, mapping: Mapping[Any, float]) -> Batch:
        return self._add("zadd", key, dict(mapping))

    def zrange(self, key: Key, start: int, stop: int, *, withscores: bool = False) -> Batch:
        return self._add("zrange", key, start, stop, withscores=withscores)

    async def run(self, *, raise_on_error: bool = True) -> list[Any]:
        """Send the queued commands in one round trip; their replies in order (none
        queued: []). An error reply raises as its :mod:`qps.errors` class, or with
        ``raise_on_error=False`` takes its place, translated (the server's own words
        are its ``__cause__``, see :func:`~qps.redis_errors.reply_text`)."""
        if not self._n:
            return []
        with map_errors():
            replies = await self._pipe.execute(raise_on_error=raise_on_error)
        return [in_place(r) for r in replies] if not raise_on_error else list(replies)

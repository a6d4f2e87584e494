"""The lean connections of a :class:`~qps.transport.Client` (:mod:`qps.resp`): how
many there are, who may use which, and what happens to one left in the middle.

* one **shared** connection, opened on the first call and again after it failed: every
  task's script calls and plain round trips pipeline on it and are answered in order;
* **waiter** connections, one per exchange that may block (a ``BLPOP`` in the round
  trip) or writes large values, taken from a small free list and given back after a
  complete exchange; one left in the middle of it (cancelled) is closed, since a reply
  may still come on it;
* up to four **bulk readers** (:class:`qps.resp.BulkReader`) for ``GET`` straight into
  the caller's buffers.

A lean connection that fails fails its pending calls with ``UnavailableError`` and is
dropped; the next call opens a new one. Nothing is retried. ``_endpoint`` None: this
client has none (fakeredis), or :meth:`_close_lean` closed them; the caller then takes
the redis-py path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Sequence
from typing import Any

from qps import resp
from qps.errors import InternalError
from qps.redis_errors import in_place, translate


class LeanConnections:
    """The lean connections of one client (a base class of
    :class:`~qps.redis_client.Client`)."""

    client_id: str

    def __init__(self, endpoint: resp.Endpoint | None) -> None:
        #: Where the lean connections go; None: scripts and waits use redis-py (fakeredis
        #: clients, and any client once close() has closed its lean connections).
        self._endpoint = endpoint
        self._lean: resp.Connection | None = None  # shared by all script calls
        self._lean_lock = asyncio.Lock()
        self._idle: list[resp.Connection] = []  # waiters' connections, free
        self._busy: set[resp.Connection] = set()  # waiters' connections, in a BLPOP
        self._bulk: list[resp.BulkReader] = []  # large reads' connections, free

    async def _lean_now(self) -> resp.Connection | None:
        """The shared lean connection, opened if it is missing or dead; None where there
        is none (fakeredis) or once :meth:`_close_lean` closed them."""
        if self._endpoint is None:
            return None
        conn = self._lean
        if conn is None or conn._failure is not None:
            conn = await self._open_lean()
        return conn

    async def _open_lean(self) -> resp.Connection | None:
        """:meth:`_lean_now`, the slow way: under a lock, so that one connection opens.

        Raises:
            UnavailableError: it cannot be opened.
        """
        async with self._lean_lock:
            conn = self._lean
            if conn is not None and not conn.closed:
                return conn
            self._lean = None
            endpoint = self._endpoint
            if endpoint is None:
                return None
            conn = await resp.open_connection(endpoint, name=f"qps {self.client_id} scripts")
            if self._endpoint is None:  # close() ran meanwhile
                conn.close()
                return None
            self._lean = conn
            return conn

    async def _waiter_connection(self) -> resp.Connection | None:
        """A lean connection for one exchange of its own: a free one, or a new one; None
        where there is none (fakeredis) or once :meth:`_close_lean` closed them."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        endpoint = self._endpoint
        if endpoint is None:
            return None
        conn = await resp.open_connection(endpoint, name=f"qps {self.client_id} waiter")
        if self._endpoint is None:
            conn.close()
            return None
        return conn

    async def _exchange(
        self, conn: resp.Connection, commands: Sequence[Sequence[Any]], stream: bool = False
    ) -> list[Any]:
        """``commands`` on ``conn``, a waiter connection: given back to the free ones
        after a complete exchange, closed if left in the middle of one (cancelled).
        ``stream``: written by :meth:`~qps.resp.Connection.stream_many`."""
        self._busy.add(conn)
        reusable = False
        try:
            replies = await call_many(conn, commands, stream)
            reusable = True
        finally:
            self._done_with(conn, reusable)
        return replies

    def _done_with(self, conn: resp.Connection, reusable: bool) -> None:
        """A waiter connection's exchange is over: back to the free ones if it ended
        complete, else closed (a reply may still come on it)."""
        self._busy.discard(conn)
        if reusable and self._endpoint is not None and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()

    async def read_into(
        self, keys: Sequence[str], targets: Sequence[memoryview]
    ) -> list[int | None] | None:
        """``GET`` each key straight into its target buffer, in one round trip, on a
        lean connection of its own (see :class:`qps.resp.BulkReader`). Returns, per key,
        the value's length, None (no such key) or -1 (a value whose length is not its
        target's); None as a whole when this client has no lean connections (fakeredis,
        or closed): read another way then.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: a GET failed (e.g. the key holds no string).
        """
        endpoint = self._endpoint
        if endpoint is None:
            return None
        free = self._bulk
        reader = None
        while free and reader is None:
            candidate = free.pop()
            if not candidate.closed:
                reader = candidate
        if reader is None:
            reader = await resp.open_bulk_reader(endpoint, name=f"qps {self.client_id} bulk")
        try:
            result = await reader.get_into(keys, targets)
        except resp.ReplyError as exc:
            self._keep_bulk(reader)
            raise translate(exc) from exc
        except BaseException:
            reader.close()
            raise
        self._keep_bulk(reader)
        return result

    def _keep_bulk(self, reader: resp.BulkReader) -> None:
        if self._endpoint is None or reader.closed or len(self._bulk) >= 4:
            reader.close()
        else:
            self._bulk.append(reader)

    async def write_commands(
        self, commands: Sequence[Sequence[Any]], *, stream: bool = False
    ) -> list[Any] | None:
        """Run ``commands`` (writes of large values: their buffers are sent as they are,
        never joined into one) in one round trip on a lean connection of its own, not
        the one shared by scripts; return their replies, a failed command's error in
        its place (see :meth:`~qps.redis_client.Client.run_commands_replies`). None when
        this client has no lean connections (fakeredis, or closed): write another way.

        ``stream``: write them a slice at a time (:meth:`qps.resp.Connection.stream_many`:
        values of any size, :class:`~qps.resp.Pieces` among them, cost the client
        about one slice of memory beyond the caller's buffers); else in one write.

        Python 3.11's asyncio joins the buffers redis-py hands to ``writelines`` into one
        copy: 16 MiB of ``SET``s took 30-35 ms through a redis-py pipeline there, 4-9 ms
        this way.

        Raises:
            UnavailableError: the server cannot be reached.
        """
        conn = await self._waiter_connection()
        if conn is None:
            return None
        return [in_place(r) for r in await self._exchange(conn, commands, stream)]

    async def send_each(
        self, commands: Sequence[Sequence[Any]]
    ) -> list[asyncio.Future[Any]] | None:
        """Send ``commands`` (blocking ones among them) in one write on a lean connection
        of their own and return a future per command, resolved with its reply (an
        error reply as an :class:`InternalError` result, not raised) as it arrives: the
        caller uses each reply while the later commands still wait in Redis. The
        connection is reused once every reply came; cancel the futures not awaited
        (the connection is then closed: a blocked command may still run). None when this
        client has no lean connections (fakeredis, or closed).

        Raises:
            UnavailableError: the server cannot be reached.
        """
        conn = await self._waiter_connection()
        if conn is None:
            return None
        try:
            futures = conn.call_each(commands)
        except TypeError as exc:
            conn.close()
            raise InternalError(f"unexpected Redis error: {exc}") from exc
        self._busy.add(conn)
        out: list[asyncio.Future[Any]] = []
        for fut in futures:
            mapped: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.add_done_callback(functools.partial(_settle_each, mapped))
            mapped.add_done_callback(functools.partial(_abandon, fut))
            out.append(mapped)

        def finished(last: asyncio.Future[Any]) -> None:
            self._done_with(conn, not last.cancelled() and last.exception() is None)

        futures[-1].add_done_callback(finished)
        return out

    async def _close_lean(self) -> None:
        """Close every lean connection (a waiter still in its BLPOP raises
        UnavailableError); later calls use the redis-py pools, as before connect()."""
        self._endpoint = None
        conns = [c for c in (self._lean, *self._idle, *self._busy) if c is not None]
        for reader in self._bulk:
            reader.close()
        self._bulk.clear()
        self._lean = None
        self._idle.clear()
        self._busy.clear()
        for conn in conns:
            conn.close()
        if conns:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(*(c.wait_closed() for c in conns)), timeout=2.0
                )


async def call_many(
    conn: resp.Connection, commands: Sequence[Sequence[Any]], stream: bool = False
) -> list[Any]:
    """``conn.call_many(commands)`` (``stream``: ``conn.stream_many``); an argument it
    cannot send (a TypeError, redis-py's DataError) is an :class:`InternalError`, as on
    redis-py's path."""
    try:
        if stream:
            return await conn.stream_many(commands)
        return await conn.call_many(commands)
    except TypeError as exc:
        raise InternalError(f"unexpected Redis error: {exc}") from exc


def _settle_each(mapped: asyncio.Future[Any], fut: asyncio.Future[Any]) -> None:
    """Pass a :meth:`LeanConnections.send_each` reply on: an error reply as a QpsError
    result."""
    if mapped.done():
        return
    if fut.cancelled():
        mapped.cancel()
    elif (exc := fut.exception()) is not None:
        mapped.set_exception(exc)
    else:
        mapped.set_result(in_place(fut.result()))


def _abandon(fut: asyncio.Future[Any], mapped: asyncio.Future[Any]) -> None:
    """A :meth:`LeanConnections.send_each` future cancelled by its caller: drop the
    reply."""
    if mapped.cancelled() and not fut.done():
        fut.cancel()

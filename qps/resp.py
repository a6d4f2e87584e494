"""A lean RESP2 client connection for the hot path (Lua script calls and blocking waits).

One :class:`Connection` is an :class:`asyncio.Protocol` whose replies are parsed by
``hiredis.Reader``. Commands are written as they are issued and their futures wait in a
FIFO; every reply resolves the oldest future, so any number of coroutines can pipeline on
one connection. A caller whose task is cancelled leaves its future in the FIFO: the reply
is still read (and dropped) in its turn, so the stream never falls out of step.

What it does not do, on purpose:

* no retries: a command is written once. A connection that fails (reset, EOF, protocol
  error, :meth:`Connection.close`) fails every pending call with
  :class:`~qps.errors.UnavailableError` and is never used again; the owner opens a new
  one on its next call (a retried ``EVALSHA`` could apply a state transition twice);
* no per-call timeouts (blocking commands carry their own server-side timeout; TCP
  keepalive finds dead peers), no RESP3, no pub/sub, no response callbacks: replies come
  back as hiredis builds them (bytes, int, None, lists).

Error replies are raised as :class:`ReplyError` (``code`` is the first word, e.g.
``NOSCRIPT``); :mod:`qps.transport` translates them into :mod:`qps.errors`.

This module does not use redis-py: :func:`qps.transport.lean_endpoint` turns a URL into
an :class:`Endpoint` with redis-py's own URL rules (TLS options included).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import sys
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import hiredis

from qps.errors import UnavailableError
from qps.resp_bulk import BulkReader
from qps.resp_codec import (
    LARGE_ARG,
    Arg,
    Pieces,
    ReplyError,
    _hiredis_pack,
    _pack_all,
    pack_command,
)

__all__ = [
    "LARGE_ARG",
    "STREAM_SLICE",
    "Arg",
    "BulkReader",
    "Connection",
    "Endpoint",
    "Pieces",
    "ReplyError",
    "open_bulk_reader",
    "open_connection",
    "pack_command",
]

#: A streamed write (:meth:`Connection.stream_many`) hands large buffers to the
#: transport in slices of this many bytes, and waits for its buffer to drain between them.
STREAM_SLICE = 1 << 20

#: TCP keepalive like redis-py's defaults: probe after 30 s idle, every 5 s, 3 probes.
KEEPALIVE_OPTIONS: dict[int, int] = {
    opt: value
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if (opt := getattr(socket, name, None)) is not None
}

_WRITELINES_GATHERS = sys.version_info >= (3, 12)  # selector transports use sendmsg


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect: a TCP ``host``/``port`` (with ``tls`` for TLS) or a
    unix socket ``path``, then the handshake (AUTH, CLIENT SETNAME, SELECT)."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = None
    db: int = 0
    client_name: str | None = None
    connect_timeout: float | None = 10.0
    keepalive: bool = True
    keepalive_options: Mapping[int, int] = field(default_factory=lambda: dict(KEEPALIVE_OPTIONS))

    def describe(self) -> str:
        where = f"unix://{self.path}" if self.path else f"{self.host}:{self.port}"
        return f"{where} db {self.db}" if self.db else where


class _Batch:
    """The futures' stand-in for a group of commands sent together: collects ``left``
    more replies, then resolves ``future`` with the list of them."""

    __slots__ = ("future", "left", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], count: int) -> None:
        self.future = future
        self.left = count
        self.replies: list[Any] = []


class _EachReply(_Batch):
    """One command of :meth:`Connection.call_each`: a batch of one whose future gets the
    reply itself, an error reply included, rather than a list."""

    __slots__ = ()

    def __init__(self, future: asyncio.Future[Any]) -> None:
        super().__init__(future, 1)


class Connection(asyncio.Protocol):
    """One RESP2 connection; build it with :func:`open_connection`.

    :meth:`call` sends one command and returns its reply; :meth:`call_many` sends
    several in one write and returns all their replies. Both may be awaited by many
    tasks at once.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "") -> None:
        self._loop = loop
        self._new_future = loop.create_future
        self._name = name
        self._transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(replyError=ReplyError)
        self._waiting: collections.deque[Any] = collections.deque()
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._failure: str | None = None  # why it is dead
        self._lost: asyncio.Future[None] = loop.create_future()

    # -- state ------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once the connection failed or was closed; it is never used again."""
        return self._failure is not None

    @property
    def pending(self) -> int:
        """Replies still expected."""
        return len(self._waiting)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"open, {len(self._waiting)} pending"
        return f"<qps.resp.Connection {self._name} {state}>"

    # -- asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # an asyncio.Transport, or one of the same interface (uvloop's is no subclass)
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        try:
            reply = reader.gets()
            while reply is not False:
                entry = waiting.popleft()
                if entry.__class__ is _Batch:
                    entry.replies.append(reply)
                    entry.left -= 1
                    if not entry.left and not entry.future.done():
                        entry.future.set_result(entry.replies)
                elif entry.__class__ is _EachReply:
                    if not entry.future.done():
                        entry.future.set_result(reply)
                elif not entry.done():  # done: its caller was cancelled
                    if reply.__class__ is ReplyError:
                        entry.set_exception(reply)
                    else:
                        entry.set_result(reply)
                reply = reader.gets()
        except (hiredis.ProtocolError, IndexError) as exc:
            why = "a reply nobody asked for" if isinstance(exc, IndexError) else str(exc)
            self._fail(f"Redis protocol error on {self._name}: {why}")
            self._close_transport()

    def eof_received(self) -> bool | None:
        self._fail(f"lost the Redis connection {self._name}: the server closed it")
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc is not None else ""
        self._fail(f"lost the Redis connection {self._name}{reason}")
        self._transport = None
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- failure and closing ----------------------------------------------------------
    def _error(self) -> UnavailableError:
        return UnavailableError(self._failure or "the Redis connection is closed")

    def _fail(self, why: str) -> None:
        """Mark the connection dead and fail every pending call with UnavailableError."""
        if self._failure is not None:
            return
        self._failure = why
        waiting, self._waiting = self._waiting, collections.deque()
        for entry in waiting:
            fut = entry.future if isinstance(entry, _Batch) else entry
            if not fut.done():
                fut.set_exception(UnavailableError(why))
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(UnavailableError(why))

    def _close_transport(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size():
            transport.abort()  # nobody will read the replies: do not wait for a flush
        else:
            transport.close()

    def close(self) -> None:
        """Close now: pending calls raise :class:`UnavailableError`. Idempotent."""
        self._fail(f"the Redis connection {self._name} was closed")
        self._close_transport()

    async def wait_closed(self) -> None:
        """Wait until the transport reported the connection lost (after :meth:`close`)."""
        if self._transport is None and not self._lost.done():
            return  # never connected
        await asyncio.shield(self._lost)

    # -- commands ---------------------------------------------------------------------
    def _write(self, data: bytes | list[bytes | memoryview]) -> None:
        transport = self._transport
        assert transport is not None
        if isinstance(data, bytes):
            transport.write(data)
        elif _WRITELINES_GATHERS:
            transport.writelines(data)
        else:  # writelines joins (copies) its buffers before Python 3.12
            for part in data:
                transport.write(part)

    def _write_parts(self, parts: list[bytes | memoryview]) -> None:
        """Write packed commands: joined into one buffer when all are small bytes, else
        as they are (large buffers are never copied)."""
        if all(type(p) is bytes for p in parts):
            self._write(b"".join(parts))
        else:
            self._write(parts)

    async def _drain(self, pending: asyncio.Future[Any]) -> None:
        """Wait while the transport's write buffer is over its high-water mark."""
        try:
            while self._paused and self._failure is None:
                fut: asyncio.Future[None] = self._new_future()
                self._drain_waiters.append(fut)
                await fut
        except BaseException:
            if not pending.done():
                pending.cancel()  # its reply will be dropped; nobody is left to read it
            elif not pending.cancelled():
                pending.exception()  # failed with the connection: raised here instead
            raise

    def call(self, args: tuple[Any, ...]) -> Awaitable[Any]:
        """Send one command (``args``: name and arguments) now; await the result for
        its reply. (A plain function returning the reply's future: no coroutine.)

        Raises (when awaited):
            ReplyError: the server answered with an error.
            UnavailableError: the connection is, or went, down.
            TypeError: an argument of a type Redis commands cannot carry (raised at once).
        """
        if self._failure is not None:
            return self._failed()
        try:  # _pack() and _write(), inlined: this is the hot path
            data: bytes | list[bytes | memoryview] = _hiredis_pack(args)
        except TypeError:
            data = pack_command(args)
        fut = self._new_future()
        if isinstance(data, bytes):
            self._transport.write(data)  # type: ignore[union-attr]
        else:
            self._write(data)
        self._waiting.append(fut)
        if self._paused:
            return self._drain_then(fut)
        return fut

    async def _failed(self) -> Any:
        raise self._error()

    async def _drain_then(self, fut: asyncio.Future[Any]) -> Any:
        await self._drain(fut)
        return await fut

    def call_each(self, commands: Sequence[Sequence[Any]]) -> list[asyncio.Future[Any]]:
        """Send several commands in one write; return a future per command, each
        resolved with its own reply as it arrives (a blocking command's reply comes when
        it unblocks; the ones before it are usable at once). An error reply is set as
        that future's result, a :class:`ReplyError`, not raised. A future cancelled
        before its reply drops the reply when it comes.

        Raises:
            UnavailableError: the connection is down.
            TypeError: an argument of a type Redis commands cannot carry.
        """
        if self._failure is not None:
            raise self._error()
        parts, _ = _pack_all(commands)
        futures = [_EachReply(self._new_future()) for _ in commands]
        self._write_parts(parts)
        self._waiting.extend(futures)
        return [f.future for f in futures]

    async def call_many(self, commands: Iterable[Sequence[Any]]) -> list[Any]:
        """Send several commands in one write; return their replies in order. An error
        reply is *returned* as a :class:`ReplyError` in its place, not raised.

        Raises:
            UnavailableError: the connection is, or went, down.
            TypeError: an argument of a type Redis commands cannot carry.
        """
        if self._failure is not None:
            raise self._error()
        parts, count = _pack_all(commands)
        if not count:
            return []
        fut: asyncio.Future[list[Any]] = self._new_future()
        batch = _Batch(fut, count)
        self._write_parts(parts)
        self._waiting.extend([batch] * count)
        if self._paused:
            await self._drain(fut)
        return await fut

    async def stream_many(self, commands: Iterable[Sequence[Any]]) -> list[Any]:
        """:meth:`call_many` for commands of large values, on a connection nobody else
        writes to meanwhile: each command is packed once the one before it is written,
        and a large argument (a ``memoryview`` of :data:`LARGE_ARG` bytes or more, or
        :class:`Pieces`, made as they are written) goes in slices of
        :data:`STREAM_SLICE`, waiting for the transport's buffer to drain between them.
        The connection holds about one slice beyond the caller's buffers, never a copy
        of the values (asyncio before Python 3.12 copies into its buffer what the socket
        does not take at once, and then copies that again as it shrinks).

        A write cut in the middle (cancelled, or failed: :class:`Pieces` that do not add
        up, an argument of a type Redis commands cannot carry) closes the connection:
        the server drops the command it got part of.

        Raises:
            UnavailableError: the connection is, or went, down.
            TypeError: an argument of a type Redis commands cannot carry.
        """
        if self._failure is not None:
            raise self._error()
        fut: asyncio.Future[list[Any]] = self._new_future()
        batch = _Batch(fut, 1)  # the 1: the writing, done last
        try:
            for command in commands:
                if self._failure is not None:
                    raise self._error()
                parts = pack_command(command, pieces=True)
                batch.left += 1
                self._waiting.append(batch)
                for part in parts:
                    if isinstance(part, Pieces):
                        sent = 0
                        for piece in part:
                            sent += piece.nbytes
                            if sent > part.nbytes:  # found before a byte too many is sent
                                break
                            await self._write_slices(piece)
                        if sent != part.nbytes:
                            raise TypeError(f"Pieces of {sent} bytes for a value of {part.nbytes}")
                    elif part.__class__ is bytes:
                        self._transport.write(part)  # type: ignore[union-attr]
                    else:
                        await self._write_slices(part)
        except BaseException:
            self.close()  # out of step: a command may be cut short
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # the connection's failure: what is raised is this one
            raise
        batch.left -= 1
        if not batch.left and not fut.done():
            fut.set_result(batch.replies)
        return await fut

    async def _write_slices(self, view: memoryview) -> None:
        """Write ``view`` a slice at a time, waiting while the transport is paused."""
        for at in range(0, view.nbytes, STREAM_SLICE):
            if self._failure is not None:
                raise self._error()
            self._transport.write(view[at : at + STREAM_SLICE])  # type: ignore[union-attr]
            while self._paused and self._failure is None:
                waiter: asyncio.Future[None] = self._new_future()
                self._drain_waiters.append(waiter)
                await waiter
        if self._failure is not None:
            raise self._error()


# -- opening -------------------------------------------------------------------------------


def _set_keepalive(transport: asyncio.BaseTransport, options: Mapping[int, int]) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in options.items():
        sock.setsockopt(socket.IPPROTO_TCP, opt, value)


async def _handshake(conn: Connection, ep: Endpoint) -> None:
    if ep.username or ep.password:
        password = ep.password or ""
        try:
            if ep.username:
                await conn.call((b"AUTH", ep.username, password))
            else:
                await conn.call((b"AUTH", password))
        except ReplyError as exc:
            # a server older than 6.0 knows no users: retry with the password alone
            if not (ep.username and "wrong number of arguments" in str(exc)):
                raise
            await conn.call((b"AUTH", password))
    setup: list[tuple[Any, ...]] = []
    if ep.client_name:
        setup.append((b"CLIENT", b"SETNAME", ep.client_name))
    if ep.db:
        setup.append((b"SELECT", ep.db))
    for reply in await conn.call_many(setup):
        if isinstance(reply, ReplyError):
            raise reply


async def open_connection(ep: Endpoint, *, name: str = "") -> Connection:
    """Connect to ``ep`` and run the handshake.

    Raises:
        UnavailableError: the server cannot be reached in ``ep.connect_timeout``
            seconds, or refused the handshake (wrong password, bad db, ...).
    """
    loop = asyncio.get_running_loop()
    label = name or ep.describe()
    conn: Connection | None = None

    def factory() -> Connection:
        nonlocal conn
        conn = Connection(loop, label)
        return conn

    async def connect() -> Connection:
        if ep.path:
            transport, _ = await loop.create_unix_connection(factory, ep.path)
        else:
            transport, _ = await loop.create_connection(
                factory, ep.host, ep.port, ssl=ep.tls, server_hostname=ep.host if ep.tls else None
            )
        assert conn is not None
        if ep.keepalive:
            _set_keepalive(transport, ep.keepalive_options)
        await _handshake(conn, ep)
        return conn

    # Not asyncio.wait_for: before Python 3.12 it can swallow a cancellation of the
    # caller that arrives as the connection completes (CPython gh-86296), and a
    # cancelled queue call would then go on waiting.
    task = asyncio.ensure_future(connect())
    try:
        done, _ = await asyncio.wait({task}, timeout=ep.connect_timeout)
        if not done:
            raise asyncio.TimeoutError
        return task.result()
    except BaseException as exc:
        task.cancel()
        if conn is not None:
            conn.close()
        if isinstance(exc, ReplyError):
            raise UnavailableError(
                f"Redis at {ep.describe()} refused the connection handshake: {exc}"
            ) from exc
        if isinstance(exc, asyncio.TimeoutError):
            raise UnavailableError(
                f"no connection to Redis at {ep.describe()} within {ep.connect_timeout} s"
            ) from exc
        if isinstance(exc, (OSError, ssl.SSLError)) and not isinstance(exc, UnavailableError):
            raise UnavailableError(f"cannot connect to Redis at {ep.describe()}: {exc}") from exc
        raise


async def open_bulk_reader(ep: Endpoint, *, name: str = "") -> BulkReader:
    """A :class:`BulkReader` connected to ``ep`` (handshake done by a plain
    :class:`Connection`, which then hands its transport over).

    Raises:
        UnavailableError: as :func:`open_connection`.
    """
    conn = await open_connection(ep, name=name)
    transport = conn._transport
    if transport is None or conn.closed or conn.pending:
        conn.close()
        raise UnavailableError(f"lost the Redis connection {name or ep.describe()}")
    reader = BulkReader(asyncio.get_running_loop(), name or ep.describe())
    transport.set_protocol(reader)
    reader.connection_made(transport)
    return reader

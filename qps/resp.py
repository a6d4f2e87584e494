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
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import hiredis

from qps.errors import UnavailableError

#: Arguments of at least this many bytes given as ``memoryview`` or ``bytearray`` are
#: written as they are, after their header, instead of being copied into the command.
LARGE_ARG = 1 << 16

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

Arg = bytes | bytearray | memoryview | str | int | float


class ReplyError(Exception):
    """An error reply from the server (``-ERR ...``, ``-NOSCRIPT ...``, ...)."""

    @property
    def code(self) -> str:
        """The error's first word: ``ERR``, ``NOSCRIPT``, ``WRONGTYPE``, ``LOADING``..."""
        text = str(self)
        return text.split(" ", 1)[0] if text else ""


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


# -- packing -------------------------------------------------------------------------------

_hiredis_pack = hiredis.pack_command


class Pieces:
    """One command argument of ``nbytes`` bytes given as the buffers ``parts`` yields,
    in order: a value that is never joined into one buffer (a chunk that spans an
    element's header and its data, a batch encoded a window at a time).

    :meth:`Connection.stream_many` writes each part as it comes, so ``parts`` may make
    them on demand; other writers take them all at once (or :meth:`join` them, for
    redis-py). ``parts`` is iterated once per write: a write that may be made again (a
    cluster's redirection) needs one that starts over on each ``iter()``, not a
    generator.
    """

    __slots__ = ("_parts", "nbytes")

    def __init__(self, nbytes: int, parts: Iterable[Any]) -> None:
        self.nbytes = nbytes
        self._parts = parts

    def __iter__(self) -> Iterator[memoryview]:
        for part in self._parts:
            view = part if isinstance(part, memoryview) else memoryview(part)
            yield view if view.format == "B" and view.ndim == 1 else view.cast("B")

    def join(self) -> bytes:
        """The value as one bytes object (a copy)."""
        data = b"".join(self)
        if len(data) != self.nbytes:
            raise ValueError(f"pieces of {len(data)} bytes for a value of {self.nbytes}")
        return data


def _as_bytes(arg: Any) -> bytes | memoryview:
    """One argument as a flat byte buffer (a large buffer is not copied)."""
    cls = arg.__class__
    if cls is bytes:
        return arg  # type: ignore[no-any-return]
    if cls is str:
        return arg.encode("utf-8")  # type: ignore[no-any-return]
    if cls is int:
        return b"%d" % arg
    if isinstance(arg, (memoryview, bytearray)):
        view = memoryview(arg)
        if not view.c_contiguous:
            return view.tobytes()
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        return view if view.nbytes >= LARGE_ARG else view.tobytes()
    if isinstance(arg, bytes):  # subclasses, e.g. numpy.bytes_
        return bytes(arg)
    if isinstance(arg, str):
        return str.encode(arg, "utf-8")
    if isinstance(arg, float):
        return repr(float(arg)).encode("ascii")
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % int(arg)
    raise TypeError(
        f"invalid Redis command argument of type {cls.__name__}: "
        "use bytes, bytearray, memoryview, str, int or float"
    )


def pack_command(args: Sequence[Arg], pieces: bool = False) -> list[Any]:
    """The RESP encoding of one command, as a list of buffers to write in order.

    Small arguments are joined into bytes; a ``memoryview``/``bytearray`` of at least
    :data:`LARGE_ARG` bytes is its own item, between its header and the next (no copy);
    so is each buffer of a :class:`Pieces`, or (``pieces``) the :class:`Pieces` itself.
    """
    out: list[Any] = []
    head = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, Pieces):
            head.append(b"$%d\r\n" % arg.nbytes)
            out.append(b"".join(head))
            if pieces:
                out.append(arg)
            else:
                size = len(out)
                out.extend(arg)
                if sum(p.nbytes for p in out[size:]) != arg.nbytes:
                    raise TypeError(f"Pieces do not add up to the {arg.nbytes} bytes declared")
            head = [b"\r\n"]
            continue
        data = _as_bytes(arg)
        if isinstance(data, memoryview):
            head.append(b"$%d\r\n" % data.nbytes)
            out.append(b"".join(head))
            out.append(data)
            head = [b"\r\n"]
        else:
            head.append(b"$%d\r\n%b\r\n" % (len(data), data))
    out.append(b"".join(head))
    return out


def _pack(args: tuple[Any, ...]) -> bytes | list[bytes | memoryview]:
    """One command: bytes from hiredis' C packer when it takes every argument (bytes,
    str, int, float), else :func:`pack_command`'s list of buffers. Memoryviews always go
    to :func:`pack_command`, which writes large ones without copying (hiredis copies
    them, slowly: about 160 µs for 400 KB), and so do bytes of :data:`LARGE_ARG` or more
    (hiredis took 1.25 ms for a 1 MiB value, pack_command 0.13 ms)."""
    for a in args:
        cls = type(a)
        if cls is memoryview or (cls is bytes and len(a) >= LARGE_ARG):
            return pack_command(args)
    try:
        return _hiredis_pack(args)  # type: ignore[no-any-return]
    except TypeError:
        return pack_command(args)


# -- the connection ------------------------------------------------------------------------


def _pack_all(commands: Iterable[Sequence[Any]]) -> tuple[list[bytes | memoryview], int]:
    """Several commands packed for one write, and how many there are."""
    parts: list[bytes | memoryview] = []
    count = 0
    for command in commands:
        data = _pack(tuple(command))
        if isinstance(data, bytes):
            parts.append(data)
        else:
            parts.extend(data)
        count += 1
    return parts, count


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
        self._fail(f"Redis closed the connection {self._name}")
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


# -- bulk reads straight into the caller's buffers ------------------------------------------


class BulkReader(asyncio.BufferedProtocol):
    """A connection that reads ``GET`` replies straight into buffers given by the caller:
    the kernel copies each value's bytes into its place, and nothing else does (no
    hiredis buffer, no bytes objects, no join). Used for the chunks of large elements.

    Build one with :func:`open_bulk_reader`. One :meth:`get_into` at a time; a call that
    fails or is cancelled leaves the connection closed (its reply stream is unknown).
    """

    SCRATCH = 1 << 16

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "") -> None:
        self._loop = loop
        self._name = name
        self._transport: asyncio.Transport | None = None
        self._scratch = bytearray(self.SCRATCH)
        self._view = memoryview(self._scratch)
        self._fill = 0  # bytes of scratch holding unparsed input
        self._skip = 0  # bytes still to drop: the CRLF after a value
        self._targets: Sequence[memoryview] = ()
        self._results: list[int | None] = []
        self._body: memoryview | None = None  # where the current value's rest goes
        self._discard = 0  # bytes of a value that fits no target, still to drop
        self._error: ReplyError | None = None
        self._future: asyncio.Future[list[int | None]] | None = None
        self._failure: str | None = None

    @property
    def closed(self) -> bool:
        return self._failure is not None

    # -- protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # an asyncio.Transport, or one of the same interface (uvloop's is no subclass)
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body
        if self._discard:
            return self._view[: min(self._discard, self.SCRATCH)]
        return self._view[self._fill :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._body is not None:
                self._body = self._body[nbytes:] if nbytes < len(self._body) else None
                if self._body is None:
                    self._skip = 2
            elif self._discard:
                self._discard -= nbytes
                if not self._discard:
                    self._skip = 2
            else:
                self._fill += nbytes
                self._parse()
        except (ValueError, IndexError) as exc:
            self._fail(f"Redis protocol error on {self._name}: {exc}")
            self._close_transport()

    def _parse(self) -> None:
        """Consume what scratch holds: CRLF to skip, reply headers, value bytes that
        came in with a header."""
        data, pos, fill = self._scratch, 0, self._fill
        while pos < fill:
            if self._skip:
                take = min(self._skip, fill - pos)
                self._skip -= take
                pos += take
                continue
            if self._future is None or len(self._results) >= len(self._targets):
                raise ValueError("a reply nobody asked for")
            end = data.find(b"\r\n", pos, fill)
            if end < 0:
                if pos == 0 and fill == len(data):
                    raise ValueError("a reply header longer than 64 KiB")
                break
            kind, line = data[pos], bytes(data[pos + 1 : end])
            pos = end + 2
            if kind == 0x24:  # '$': a bulk string
                n = int(line)
                if n < 0:
                    self._results.append(None)
                    continue
                target = self._targets[len(self._results)]
                fits = len(target) == n
                self._results.append(n if fits else -1)
                take = min(n, fill - pos)
                if fits:
                    target[:take] = data[pos : pos + take]
                pos += take
                if take < n:  # the rest comes straight into the target (or is dropped)
                    if fits:
                        self._body = target[take:]
                    else:
                        self._discard = n - take
                    break
                self._skip = 2
            elif kind == 0x2D:  # '-': an error reply
                self._results.append(-1)
                if self._error is None:
                    self._error = ReplyError(line.decode("utf-8", "replace"))
            elif kind in (0x3A, 0x2B):  # ':' or '+': an integer or status (UNLINK, OK)
                self._results.append(-1)
            else:
                raise ValueError(f"unexpected reply type {chr(kind)!r}")
        rest = fill - pos
        if rest and pos:
            data[:rest] = data[pos:fill]
        self._fill = rest
        self._settle()

    def _settle(self) -> None:
        fut = self._future
        if (
            fut is not None
            and len(self._results) == len(self._targets)
            and self._body is None
            and not self._discard
            and not self._skip
        ):
            self._future = None
            if fut.done():
                return
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._results)

    def eof_received(self) -> bool | None:
        self._fail(f"Redis closed the connection {self._name}")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc is not None else ""
        self._fail(f"lost the Redis connection {self._name}{reason}")
        self._transport = None

    def _fail(self, why: str) -> None:
        if self._failure is not None:
            return
        self._failure = why
        fut, self._future = self._future, None
        if fut is not None and not fut.done():
            fut.set_exception(UnavailableError(why))

    def _close_transport(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.abort()

    def close(self) -> None:
        """Close now; a pending :meth:`get_into` raises UnavailableError. Idempotent."""
        self._fail(f"the Redis connection {self._name} was closed")
        self._close_transport()

    # -- the one call -----------------------------------------------------------------
    async def get_into(
        self, keys: Sequence[Arg], targets: Sequence[memoryview]
    ) -> list[int | None]:
        """``GET`` every key in one round trip, each value read into its target.

        Returns, per key: the value's length (it filled its target), None (no such
        key) or -1 (a value whose length is not its target's: its bytes were dropped).

        Raises:
            ReplyError: the server answered a GET with an error (after every reply).
            UnavailableError: the connection is, or went, down.
        """
        if self._failure is not None:
            raise UnavailableError(self._failure)
        if self._future is not None:
            raise RuntimeError("BulkReader.get_into: a call is already running")
        if len(keys) != len(targets):
            raise ValueError("get_into: one target per key")
        if not keys:
            return []
        fut: asyncio.Future[list[int | None]] = self._loop.create_future()
        self._targets = [t if t.format == "B" and t.ndim == 1 else t.cast("B") for t in targets]
        self._results = []
        self._error = None
        self._future = fut
        assert self._transport is not None
        self._transport.write(b"".join(_hiredis_pack((b"GET", k)) for k in keys))  # type: ignore[arg-type]
        try:
            return await fut
        except BaseException:
            if not fut.done() or self._future is fut:  # cancelled mid-read: stream unknown
                self.close()
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

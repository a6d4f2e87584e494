"""The one module that imports redis-py, and where the queues' Redis traffic is routed.

A :class:`Client` made by :func:`connect` (a real server) talks to it two ways:

* **lean connections** (:mod:`qps.resp`: an asyncio Protocol, hiredis parsing, no
  redis-py) for the hot path, every queue operation's Lua scripts:

  - :meth:`Client.run_script` sends ``EVALSHA`` on one connection shared by every
    task of the client; calls pipeline on it and are answered in order (NOSCRIPT: load
    the script, then send the ``EVALSHA`` again);
  - :meth:`Client.wait_then_script` sends ``[BLPOP wake key, EVALSHA collect]`` in one
    write on a waiter connection of its own, taken from a small pool and given back
    after the exchange; a waiter cancelled in the middle closes its connection;

  They cost about a third of redis-py's user-space CPU per call (docs/embedded.md,
  "Connections"). A lean connection that fails fails its pending calls with
  ``UnavailableError`` and is dropped; the next call opens a new one. Nothing is
  retried;

* **redis-py** pools for everything else (``client.commands``: queue inspection,
  large-element chunks, variables, the CLI...), with **no retries** (a retried
  ``EVALSHA`` could apply a state transition twice). ``client.blocking`` is redis-py's
  pool for blocking waits; with lean connections it is used only after :meth:`close`.
  A pooled connection that was reset while idle (a cut link) is replaced before its
  next use, as a dead lean connection is (see :class:`_Pool`).

A :class:`Client` made by :func:`from_redis` (fakeredis in the tests, or any redis-py
client) has no lean connections: scripts go through ``commands`` and waits through
``blocking``, as ``BLPOP`` then ``EVALSHA`` when the backend cannot block inside a
pipeline. :meth:`Client.close` closes the lean connections too; calls made on the client
after that take the redis-py path.

No connection sets a per-read timeout: redis-py's 5 s default would cut blocking calls,
and on Python 3.11 any timeout costs a Task per call; TCP keepalive finds dead peers
and Redis-side leases undo what a vanished caller left pending.

Every redis-py and lean-connection error is translated here into :mod:`qps.errors`
(``UnavailableError`` for connection trouble, ``InternalError`` for anything
unexpected), so the layers above never see those exception classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from qps import resp
from qps.errors import (
    InternalError,
    InvalidArgumentError,
    PermissionDeniedError,
    QpsError,
    UnavailableError,
)

T = TypeVar("T")

log = logging.getLogger("qps.transport")

URL_ENV = "QPS_REDIS_URL"
#: ``yes``/``no`` (1/0, true/false): whether URLs name a Redis Cluster node, when neither
#: the URL (``?cluster=``) nor the caller says; unset: detected. ``qps ... --cluster``
#: sets it for the command and the roles it starts.
CLUSTER_ENV = "QPS_CLUSTER"

#: Longest server-side block of one wait, in seconds; waits loop on it.
BLOCK_SECONDS = 1.0

Arg = bytes | bytearray | memoryview | str | int | float
ScriptArgs = Sequence[Arg]


#: Error replies that redis-py raises as connection errors (the server is loading, the
#: password is wrong or missing, no more clients allowed): UnavailableError, like there.
_UNAVAILABLE_CODES = frozenset({"LOADING", "NOAUTH", "WRONGPASS"})
_UNAVAILABLE_TEXTS = frozenset({"ERR max number of clients reached", "ERR invalid password"})


#: Error codes that redis-py leaves out of its exception messages (the message of
#: ``-ERR Error running script...`` is ``Error running script...``): the same text on
#: both paths.
_STRIPPED_CODES = frozenset(
    {
        "ERR", "OOM", "WRONGPASS", "EXECABORT", "LOADING", "NOSCRIPT", "READONLY", "NOAUTH",
        "NOPERM", "ASK", "TRYAGAIN", "MOVED", "CLUSTERDOWN", "CROSSSLOT", "MASTERDOWN",
    }
)  # fmt: skip


def translate(exc: RedisError | RedisClusterException | OSError | resp.ReplyError) -> QpsError:
    """The qps error for a redis-py, lean-connection or socket exception."""
    if isinstance(exc, RedisClusterException):  # not a RedisError: redis-py's cluster layer
        if isinstance(exc.__cause__, (RedisConnectionError, RedisTimeoutError, OSError)):
            return UnavailableError(f"Redis Cluster is unreachable: {exc}")
        return InternalError(f"unexpected Redis Cluster error: {exc}")
    if isinstance(exc, resp.ReplyError):
        text, code = str(exc), exc.code
        unavailable = code in _UNAVAILABLE_CODES or text in _UNAVAILABLE_TEXTS
        if code in _STRIPPED_CODES:
            text = text[len(code) + 1 :]
        if unavailable:
            return UnavailableError(f"Redis is unreachable: {text}")
        if code == "NOPERM" or "NOPERM" in text[:80]:
            return PermissionDeniedError(f"Redis refused: {text}")
        return InternalError(f"unexpected Redis error: {text}")
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return UnavailableError(f"Redis is unreachable: {exc}")
    if isinstance(exc, NoPermissionError) or "NOPERM" in str(exc)[:80]:
        return PermissionDeniedError(f"Redis refused: {exc}")
    return InternalError(f"unexpected Redis error: {exc}")


@contextlib.contextmanager
def map_errors() -> Any:
    """Translate redis-py exceptions raised inside the block into qps errors, and give
    back a cancellation that redis-py lost.

    redis-py sends each command under ``asyncio.wait_for`` when its client has a
    ``socket_timeout`` (fakeredis's default is 5 s; qps's own clients set none). Before
    Python 3.12 that can swallow a cancellation landing as the write completes (CPython
    gh-86296): the call returns, and a cancelled blocked dequeue would go on to wait
    forever. A task whose cancellation count (3.11+) rose inside the block and that
    got no CancelledError is cancelled here."""
    task = asyncio.current_task()
    before = _cancelling(task)
    try:
        yield
    except QpsError:  # already ours (UnavailableError is an OSError too)
        raise
    except (RedisError, RedisClusterException, OSError, resp.ReplyError) as exc:
        raise translate(exc) from exc
    if _cancelling(task) > before:
        raise asyncio.CancelledError


def _cancelling(task: asyncio.Task[Any] | None) -> int:
    """How many cancellations ``task`` has been asked for and not withdrawn (0 before
    Python 3.11, which does not count them)."""
    count = getattr(task, "cancelling", None)
    return int(count()) if count is not None else 0


def _lua_source(name: str) -> str:
    """A script's full source.

    A name with a folder (``"ps/commit"``: ``qps/lua/ps/commit.lua``) is a script of its
    own, sent as written. A bare name is a queue script: ``fast_common.lua`` (helpers
    the fast paths share with the library), the shared queue library, then the script
    body as a function whose reply is returned after ``commit()`` wrote back the meta
    fields.

    A script with a fast path (``<name>_fast.lua``) runs that first; the full script is
    then wrapped in a function called only when the fast path falls through, so the
    common case skips the library's set-up (about 7 µs of server time per call)."""
    lua = resources.files("qps") / "lua"
    if "/" in name:
        folder, file = name.split("/", 1)
        return (lua / folder / f"{file}.lua").read_text(encoding="utf-8")
    common = (lua / "queue_common.lua").read_text(encoding="utf-8")
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    full = (
        f"{common}\nlocal function main()\n{body}\nend\n"
        "local reply = main()\ncommit()\nreturn reply\n"
    )
    shared = (lua / "fast_common.lua").read_text(encoding="utf-8")
    fast = lua / f"{name}_fast.lua"
    if not fast.is_file():
        return f"{shared}\n{full}"
    return (
        f"{shared}\n{fast.read_text(encoding='utf-8')}\n"
        f"local function full()\n{full}end\nreturn full()\n"
    )


class _Script:
    """A Lua script run by SHA, loaded on first use and again after NOSCRIPT."""

    __slots__ = ("loaded", "name", "sha", "source")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _lua_source(name)
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()
        #: known to be on the server (set by the round trips that must not meet NOSCRIPT)
        self.loaded = False


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and messages): the one
    in ``user:password@`` and a ``password=`` query parameter (redis-py reads both)."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}" if user else f"{scheme}://***@{host}"


class Client:
    """A connection to one Redis server, shared by every qps object of a process.

    Build one with :func:`connect`. Use ``async with`` or call :meth:`close`.
    """

    def __init__(
        self,
        commands: aioredis.Redis,
        blocking: aioredis.Redis,
        *,
        url: str = "",
        pipelined_blocking: bool = True,
        owned_server: Any = None,
        endpoint: resp.Endpoint | None = None,
    ) -> None:
        self.commands = commands
        self.blocking = blocking
        self.url = url
        #: Real servers run a pipelined ``[BLPOP, EVALSHA]`` in one round trip; fakeredis
        #: cannot block inside a pipeline, so it gets the two calls one after the other.
        self.pipelined_blocking = pipelined_blocking
        self.client_id = secrets.token_hex(4)
        self._counter = 0
        self._scripts: dict[str, _Script] = {}
        self._owned_server = owned_server
        self._closed = False
        #: cleanup callbacks run by close(), e.g. cancelling blocked attempts
        self._on_close: list[Any] = []
        #: Where the lean connections go; None: scripts and waits use redis-py (fakeredis
        #: clients, and any client once close() has closed its lean connections).
        self._endpoint = endpoint
        self._lean: resp.Connection | None = None  # shared by all script calls
        self._lean_lock = asyncio.Lock()
        self._idle: list[resp.Connection] = []  # waiters' connections, free
        self._busy: set[resp.Connection] = set()  # waiters' connections, in a BLPOP
        self._bulk: list[resp.BulkReader] = []  # large reads' connections, free

    #: True for a Redis Cluster client (:func:`connect_cluster`).
    cluster = False

    # -- identity -------------------------------------------------------------
    def new_id(self) -> str:
        """A process-unique attempt id (client id + counter)."""
        self._counter += 1
        return f"{self.client_id}.{self._counter}"

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._closed

    # -- scripts --------------------------------------------------------------
    def _script(self, name: str) -> _Script:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = _Script(name)
        return script

    async def run_script(self, name: str, keys: Sequence[str], args: ScriptArgs) -> Any:
        """Run Lua script ``name`` (from ``qps/lua``) and return its reply.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: the script failed inside Redis.
        """
        script = self._scripts.get(name)
        if script is None:
            script = self._script(name)
        if self._endpoint is not None:  # every queue operation's hot path
            conn = self._lean
            if conn is None or conn._failure is not None:  # missing or dead
                conn = await self._open_lean()
            if conn is not None:
                command = (b"EVALSHA", script.sha, len(keys), *keys, *args)
                try:
                    return await conn.call(command)
                except resp.ReplyError as exc:
                    if exc.code != "NOSCRIPT":
                        raise translate(exc) from exc
                except TypeError as exc:  # redis-py: DataError, i.e. InternalError
                    raise InternalError(f"unexpected Redis error: {exc}") from exc
                return await self._load_then_run(conn, script, command)
        with map_errors():
            try:
                return await self.commands.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                await self.commands.script_load(script.source)
                return await self.commands.evalsha(script.sha, len(keys), *keys, *args)

    @staticmethod
    async def _load_then_run(
        conn: resp.Connection, script: _Script, command: tuple[Any, ...]
    ) -> Any:
        """After NOSCRIPT: load the script, run ``command`` (its EVALSHA) again."""
        try:
            await conn.call((b"SCRIPT", b"LOAD", script.source))
            return await conn.call(command)
        except resp.ReplyError as exc:
            raise translate(exc) from exc

    async def _lean_now(self) -> resp.Connection | None:
        """The lean connection, opened if it is missing or dead; None where there is
        none (fakeredis) or once :meth:`close` closed them."""
        if self._endpoint is None:
            return None
        conn = self._lean
        if conn is None or conn._failure is not None:
            conn = await self._open_lean()
        return conn

    async def _open_lean(self) -> resp.Connection | None:
        """The shared lean connection, opened if it is missing or dead; None once
        :meth:`close` closed the lean connections.

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
        """A lean connection for one blocking wait: a free one, or a new one; None once
        :meth:`close` closed the lean connections."""
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

    async def write_commands(
        self, commands: Sequence[Sequence[Any]], *, stream: bool = False
    ) -> list[Any] | None:
        """Run ``commands`` (writes of large values: their buffers are sent as they are,
        never joined into one) in one round trip on a lean connection of its own, not
        the one shared by scripts; return their replies, a failed command's error in
        its place (see :meth:`run_commands_replies`). None when this client has no lean
        connections (fakeredis, or closed): write another way then.

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
        return [_error_in_place(r) for r in await self._exchange(conn, commands, stream)]

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

    async def _exchange(
        self, conn: resp.Connection, commands: Sequence[Sequence[Any]], stream: bool = False
    ) -> list[Any]:
        """``commands`` on ``conn``, a waiter connection: given back to the free ones
        after a complete exchange, closed if left in the middle of one (cancelled).
        ``stream``: written by :meth:`~qps.resp.Connection.stream_many`."""
        self._busy.add(conn)
        reusable = False
        try:
            replies = await _call_many(conn, commands, stream)
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

    def _keep_bulk(self, reader: resp.BulkReader) -> None:
        if self._endpoint is None or reader.closed or len(self._bulk) >= 4:
            reader.close()
        else:
            self._bulk.append(reader)

    async def run_commands(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Run plain commands in one round trip; return their replies in order.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: a command failed (the others may have run).
        """
        replies, _ = await self.run_commands_then_script(commands, None, (), ())
        return replies

    async def run_transaction(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Run plain ``commands`` in one ``MULTI``/``EXEC`` (atomically, one round trip;
        a single server: a cluster refuses keys of several slots); return their replies.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: a command failed.
        """
        conn = await self._lean_now()
        if conn is None:
            with map_errors():
                pipe = self.commands.pipeline(transaction=True)
                for c in commands:
                    pipe.execute_command(*c)
                return list(await pipe.execute())
        replies = await _call_many(conn, [(b"MULTI",), *commands, (b"EXEC",)])
        for r in replies:
            if isinstance(r, resp.ReplyError):
                raise translate(r) from r
        done = replies[-1]
        if not isinstance(done, list):  # EXEC answered nil: cannot happen without WATCH
            raise InternalError(f"unexpected reply to EXEC: {done!r}")
        for r in done:
            if isinstance(r, resp.ReplyError):
                raise translate(r) from r
        return done

    async def run_commands_replies(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Run ``commands`` (scripts by ``EVALSHA`` among them) in one round trip, in
        order, on one connection; return their replies, a failed command's error in its
        place (a :class:`QpsError`: see :func:`is_noscript`), not raised. Not for Redis
        Cluster (commands of several slots).

        Raises:
            UnavailableError: the server cannot be reached.
        """
        conn = await self._lean_now()
        if conn is not None:
            return [_error_in_place(r) for r in await _call_many(conn, commands)]
        with map_errors():
            pipe = self.commands.pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*c)
            replies = await pipe.execute(raise_on_error=False)
        return [_error_in_place(r) for r in replies]

    async def run_commands_then_script(
        self,
        commands: Sequence[Sequence[Any]],
        name: str | None,
        keys: Sequence[str],
        args: ScriptArgs,
    ) -> tuple[list[Any], Any]:
        """Run plain ``commands`` and then script ``name`` (None: no script) in one
        round trip; return the commands' replies and the script's.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: a command or the script failed (the commands before it ran).
        """
        script = None if name is None else self._script(name)
        command = None if script is None else (b"EVALSHA", script.sha, len(keys), *keys, *args)
        conn = await self._lean_now()
        if conn is not None:
            replies = await _call_many(
                conn, [*commands] if command is None else [*commands, command]
            )
            reply = None
            if command is not None:
                reply = replies.pop()
                if isinstance(reply, resp.ReplyError):
                    if reply.code != "NOSCRIPT":
                        raise translate(reply) from reply
                    assert script is not None
                    reply = await self._load_then_run(conn, script, command)
            for r in replies:
                if isinstance(r, resp.ReplyError):
                    raise translate(r) from r
            return replies, reply
        with map_errors():
            pipe = self.commands.pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*(_str_name(c) if self.cluster else c))
            replies = await pipe.execute() if commands else []
        reply = None if name is None else await self.run_script(name, keys, args)
        return replies, reply

    async def wait_then_script(
        self,
        wake_key: str,
        block_seconds: float,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Sequence[Sequence[Any]] = (),
    ) -> Any:
        """Block up to ``block_seconds`` on ``wake_key``, then run script ``name``.

        On a real server both go in one pipeline: the server holds the script back until
        the BLPOP returns, so a wake-up costs one round trip. ``after``: plain commands
        run after the script, in the same round trip; with them, returns the script's
        reply and theirs.

        Raises:
            UnavailableError: the server cannot be reached.
        """
        # BLPOP takes a timeout in seconds with millisecond resolution; 0 means forever.
        block = max(0.001, round(block_seconds, 3))
        if self._endpoint is not None:
            conn = await self._waiter_connection()
            if conn is not None:
                got = await self._wait_lean(conn, None, wake_key, block, name, keys, args, after)
                return got[1:] if after else got[1]
        if not self.pipelined_blocking:
            # fakeredis wedges a connection whose blocked command is cancelled; let a
            # cancelled wait run out its (short) block in the background instead.
            wait = asyncio.ensure_future(self.blocking.blpop([wake_key], timeout=block))
            wait.add_done_callback(lambda f: f.cancelled() or f.exception())
            with map_errors():
                await asyncio.shield(wait)
            reply = await self.run_script(name, keys, args)
            return (reply, await self.run_commands_replies(after)) if after else reply
        script = self._script(name)
        with map_errors():
            pipe = self.blocking.pipeline(transaction=False)
            pipe.blpop([wake_key], timeout=block)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        reply = replies[1]
        if isinstance(reply, NoScriptError):
            reply = await self.run_script(name, keys, args)
        elif isinstance(reply, Exception):
            with map_errors():
                raise reply
        return (reply, await self.run_commands_replies(after)) if after else reply

    async def run_script_then_commands(
        self,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Sequence[Sequence[Any]],
        *,
        once: bool = False,
        before: Sequence[Sequence[Any]] = (),
        blocking: bool = False,
    ) -> tuple[Any, list[Any]]:
        """Run script ``name`` and then plain commands, in one round trip; return the
        script's reply and the commands' (an error reply in its place, not raised).
        ``before``: plain commands run ahead of the script, in the same round trip
        (idempotent writes the script needs, e.g. an element's chunk); their failure
        raises.

        Should the server lack the script, it is loaded and run, and the commands run
        again after it; with ``once`` they are not (writes that must not run twice:
        they ran then before the script).

        ``blocking``: the commands may block (a ``BLPOP``): the round trip goes on a
        waiter connection of its own, so nothing else waits behind it, and they run at
        most once. The script is loaded in it the first time; should the server lose
        it later (a restart), the commands run (and may block for their timeout) before
        the script is loaded and run again, and their replies are dropped ([]).
        Without lean connections (fakeredis) they do not run: the replies are then [].

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: the script (or a command of ``before``) failed inside Redis.
        """
        script = self._script(name)
        command = (b"EVALSHA", script.sha, len(keys), *keys, *args)
        if blocking and after:
            waiter = await self._waiter_connection() if self._endpoint is not None else None
            if waiter is None:
                after = ()
            else:  # the script loaded first (once): a NOSCRIPT would leave them waiting
                load = [] if script.loaded else [(b"SCRIPT", b"LOAD", script.source)]
                lead = [*load, *before]
                got = await self._exchange(waiter, [*lead, command, *after])
                reply, replies = _after_lead(got, len(lead))
                lost = isinstance(reply, resp.ReplyError) and reply.code == "NOSCRIPT"
                script.loaded = not lost
                if lost:
                    return await self.run_script(name, keys, args), []
                if isinstance(reply, resp.ReplyError):
                    raise translate(reply) from reply
                return reply, replies
        conn = await self._lean_now()
        if conn is not None:
            got = await _call_many(conn, [*before, command, *after])
            reply, replies = _after_lead(got, len(before))
            if isinstance(reply, resp.ReplyError):
                if reply.code != "NOSCRIPT":
                    raise translate(reply) from reply
                reply = await self._load_then_run(conn, script, command)
                if not once:
                    replies = await conn.call_many(after)
            return reply, replies
        if before:
            await self.run_commands_then_script(before, None, (), ())
        reply = await self.run_script(name, keys, args)
        with map_errors():
            pipe = self.commands.pipeline(transaction=False)
            for c in after:
                pipe.execute_command(*(_str_name(c) if self.cluster else c))
            replies = await pipe.execute(raise_on_error=False)
        return reply, replies

    async def script_then_wait(
        self,
        first: str,
        keys: Sequence[str],
        first_args: ScriptArgs,
        wake_key: str,
        block_seconds: float,
        name: str,
        args: ScriptArgs,
        after: Sequence[Sequence[Any]] = (),
    ) -> tuple[Any, Any, list[Any]] | None:
        """Run script ``first``, then :meth:`wait_then_script`, in one round trip on a
        waiter connection: for an attempt that will probably have to wait, this saves
        the round trip between registering it and blocking. ``first`` must wake
        ``wake_key`` itself whenever it does not leave the attempt waiting, or the BLPOP
        blocks for nothing.

        Returns ``first``'s reply, the other script's (None when ``first`` had to be
        loaded and run again: the wait then served nothing) and the replies of the plain
        commands ``after`` (run last, in the same round trip), or None when no waiter
        connection can be had (fakeredis; a closed client): the caller runs the steps
        itself.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: a script failed inside Redis.
        """
        if self._endpoint is None:
            return None
        conn = await self._waiter_connection()
        if conn is None:
            return None
        block = max(0.001, round(block_seconds, 3))
        return await self._wait_lean(
            conn, (first, first_args), wake_key, block, name, keys, args, after
        )

    async def _wait_lean(
        self,
        conn: resp.Connection,
        first: tuple[str, ScriptArgs] | None,
        wake_key: str,
        block: float,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Sequence[Sequence[Any]],
    ) -> tuple[Any, Any, list[Any]]:
        """[script ``first``,] BLPOP, script ``name``, ``after`` commands in one round
        trip on a waiter connection of its own, given back after a complete exchange;
        one left in the middle of it (cancelled) is closed. Returns the replies of
        ``first`` (None without it), of ``name`` and of ``after``."""
        script = self._script(name)
        commands: list[Sequence[Any]] = []
        if first is not None:
            lead = self._script(first[0])
            commands.append((b"EVALSHA", lead.sha, len(keys), *keys, *first[1]))
        commands.append((b"BLPOP", wake_key, block))
        commands.append((b"EVALSHA", script.sha, len(keys), *keys, *args))
        commands.extend(after)
        replies = await self._exchange(conn, commands)
        lead_reply = None
        if first is not None:
            lead_reply = replies.pop(0)
            if isinstance(lead_reply, resp.ReplyError):
                if lead_reply.code == "NOSCRIPT":  # nothing ran: run it now (idle wait)
                    return await self.run_script(first[0], keys, first[1]), None, []
                raise translate(lead_reply) from lead_reply
        reply, rest = replies[1], replies[2:]
        if isinstance(reply, resp.ReplyError):
            if reply.code != "NOSCRIPT":
                raise translate(reply) from reply
            reply = await self.run_script(name, keys, args)
            rest = await self.run_commands(after) if after else []
        return lead_reply, reply, rest

    # -- lifecycle ------------------------------------------------------------
    def on_close(self, callback: Any) -> None:
        """Register an async callable that :meth:`close` awaits before disconnecting."""
        self._on_close.append(callback)

    async def ping(self) -> bool:
        """True if the server answers.

        Raises:
            UnavailableError: it does not.
        """
        with map_errors():
            return bool(await self.commands.ping())

    async def close(self) -> None:
        """Cancel this client's blocked calls, drop private resources, disconnect.

        Blocked calls of this client raise :class:`qps.errors.CancelledError`.
        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for callback in reversed(self._on_close):
            try:
                await callback()
            except Exception:  # a failing cleanup must not stop the others
                log.exception("cleanup on close failed")
        self._on_close.clear()
        await self._close_lean()
        for pool in (self.commands, self.blocking):
            with contextlib.suppress(Exception):
                await pool.aclose()
        if self._owned_server is not None:
            await asyncio.to_thread(self._owned_server.stop)
            self._owned_server = None

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

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<qps.Client {redact_url(self.url)} id={self.client_id}>"


def _pool_options(url: str) -> dict[str, Any]:
    # No per-read socket timeout: on Python 3.11 redis-py wraps every send and read in
    # asyncio.wait_for (a new Task each: ~20 us a call). Dead peers are found by TCP
    # keepalive, and Redis-side leases undo what a vanished caller left pending.
    options: dict[str, Any] = {
        "socket_connect_timeout": 10.0,
        "socket_timeout": None,
        "retry": Retry(NoBackoff(), 0),
    }
    if not url.startswith("unix:"):
        options["socket_keepalive"] = True
    return options


class _Pool(aioredis.ConnectionPool):
    """redis-py's pool, except that a connection reset while it sat idle in the pool
    (an RST: a cut link, a NAT that dropped the flow) is replaced before its next use.

    redis-py checks a pooled connection before handing it out, but with hiredis it sees
    a closed one only at EOF: after an RST the stream holds the error instead, and the
    next command failed ("Connection reset by peer") though nothing had been sent on it
    and the server was reachable. Nothing is retried here: the dead connection is
    dropped before anything is written to it.
    """

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        reader = getattr(connection, "_reader", None)
        if isinstance(reader, asyncio.StreamReader) and reader.exception() is not None:
            await connection.disconnect()
        await super().ensure_connection(connection)


def _redis(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_pool(_Pool.from_url(url, **_pool_options(url)))


def _pools(url: str) -> tuple[aioredis.Redis, aioredis.Redis]:
    return _redis(url), _redis(url)


def _endpoint_of(pool: aioredis.ConnectionPool) -> resp.Endpoint:
    """The lean connections' endpoint for what a redis-py pool connects to: the same
    host/port or socket, TLS context, credentials, db, client name and keepalive."""
    kw = dict(pool.connection_kwargs)
    cls = pool.connection_class
    tls = None
    if issubclass(cls, aioredis.SSLConnection):
        # redis-py's own SSL settings (ssl_cert_reqs, ssl_ca_certs, ssl_check_hostname...)
        tls = cls(**kw).ssl_context.get()
    keepalive_options = kw.get("socket_keepalive_options")
    timeout = kw.get("socket_connect_timeout", kw.get("socket_timeout"))
    return resp.Endpoint(
        host=str(kw.get("host") or "localhost"),
        port=int(kw.get("port") or 6379),
        path=kw.get("path") if issubclass(cls, aioredis.UnixDomainSocketConnection) else None,
        tls=tls,
        username=kw.get("username"),
        password=kw.get("password"),
        db=int(kw.get("db") or 0),
        client_name=kw.get("client_name"),
        connect_timeout=None if timeout is None else float(timeout),
        keepalive=bool(kw.get("socket_keepalive")),
        keepalive_options=(
            dict(keepalive_options) if keepalive_options else dict(resp.KEEPALIVE_OPTIONS)
        ),
    )


def lean_endpoint(url: str) -> resp.Endpoint:
    """The :class:`qps.resp.Endpoint` that :func:`connect` uses for ``url`` (its lean
    connections read the URL the way redis-py does, TLS query parameters included)."""
    return _endpoint_of(aioredis.ConnectionPool.from_url(url, **_pool_options(url)))


async def connect(url: str | None = None, *, cluster: bool | None = None) -> Client:
    """Connect to Redis and return a :class:`Client`.

    ``url`` may be ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) or
    ``unix:///path/to/socket``. Without one, ``$QPS_REDIS_URL`` is used; without that,
    an embedded server is started (or reused, when another process of this local run
    already started one; see :mod:`qps.embedded`).

    A Redis Cluster is detected (``INFO cluster`` says ``cluster_enabled:1``) when the
    URL names any of its nodes; ``cluster=True`` (or ``?cluster=yes`` in the URL, or
    ``$QPS_CLUSTER=yes``) asks for one explicitly and ``cluster=False`` (``?cluster=no``,
    ``$QPS_CLUSTER=no``) skips the detection; the argument wins over the URL, the URL
    over the environment. See :func:`connect_cluster`.

    Raises:
        UnavailableError: the server cannot be reached, or none can be started.
        InvalidArgumentError: a bad ``cluster=`` URL parameter or ``$QPS_CLUSTER``, or a
            cluster reached through a unix socket or with a database other than 0.
    """
    owned = None
    url = url or os.environ.get(URL_ENV) or None
    if url is None:
        from qps import embedded

        url, owned = await asyncio.to_thread(embedded.ensure_local_server)
    assert url is not None
    url, asked = split_cluster_param(url)
    if cluster is None:
        cluster = asked if asked is not None else cluster_from_env()
    if cluster:
        return await connect_cluster(url)
    commands, blocking = _pools(url)
    client = Client(commands, blocking, url=url, owned_server=owned)
    try:
        with map_errors():  # e.g. a TLS option naming a file that is missing
            client._endpoint = _endpoint_of(commands.connection_pool)
        if cluster is None and owned is None:
            if await _cluster_enabled(client):  # instead of a PING: same round trips
                await client.close()
                return await connect_cluster(url)
        else:
            await client.ping()
        await client._open_lean()
    except QpsError as exc:
        await client.close()
        if isinstance(exc, UnavailableError):
            raise UnavailableError(f"cannot reach Redis at {redact_url(url)}: {exc}") from exc
        raise
    return client


# -- Redis Cluster ------------------------------------------------------------------------
#
# A cluster client's ``commands`` and ``blocking`` are redis-py ``RedisCluster`` clients:
# each command goes to the primary owning its key's slot, a non-transactional pipeline
# is split by node (replies in order), SCAN, FLUSHALL and SCRIPT LOAD visit every
# primary, and DEL/UNLINK/EXISTS split their keys by slot. redis-py follows MOVED/ASK/
# TRYAGAIN (the command did not run) and does not retry after a connection error
# (``Retry(NoBackoff(), 0)``), like the single-server path. The hot path (scripts and
# blocking waits) goes over lean connections per primary: see ClusterClient. Every qps
# script touches one hash tag, hence one slot.

_TRUE = frozenset({"1", "yes", "true", "on"})
_FALSE = frozenset({"0", "no", "false", "off"})


def _yes_no(value: str, what: str) -> bool:
    """``value`` (yes/no/true/false/on/off/1/0, any case) as a bool.

    Raises:
        InvalidArgumentError: another value; ``what`` names where it came from.
    """
    v = value.lower()
    if v not in _TRUE and v not in _FALSE:
        raise InvalidArgumentError(f"{what} must be yes or no (1/0, true/false), not {value!r}")
    return v in _TRUE


def cluster_from_env() -> bool | None:
    """``$QPS_CLUSTER`` as True, False, or None when unset or empty.

    Raises:
        InvalidArgumentError: a value other than yes/no/true/false/on/off/1/0.
    """
    value = os.environ.get(CLUSTER_ENV, "").strip()
    return _yes_no(value, CLUSTER_ENV) if value else None


def split_cluster_param(url: str) -> tuple[str, bool | None]:
    """``url`` without its ``cluster=`` query parameter, and that parameter's value
    (True, False, or None when absent). redis-py would refuse the parameter.

    Raises:
        InvalidArgumentError: a value other than yes/no/true/false/on/off/1/0.
    """
    if "cluster=" not in url.lower():
        return url, None
    base, _, query = url.partition("?")
    fragment = ""
    if "#" in query:
        query, fragment = query.split("#", 1)
        fragment = "#" + fragment
    kept: list[str] = []
    found: bool | None = None
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name.lower() != "cluster":
            kept.append(part)
            continue
        found = _yes_no(value, "cluster= in the Redis URL")
    rest = "&".join(p for p in kept if p)
    return (base + ("?" + rest if rest else "") + fragment), found


async def pipeline_script(
    client: Client, pipe: Any, script: Any, keys: Sequence[Any], args: Sequence[Any]
) -> None:
    """Queue redis-py ``Script`` ``script`` on pipeline ``pipe`` of ``client.commands``.

    On a single server this is ``script(keys, args, client=pipe)`` (redis-py loads the
    script before the pipeline runs). redis-py's cluster pipeline cannot run scripts
    that way: there it is queued as ``EVAL`` with the source, which needs no loading
    (the keys of one qps script share one slot, which picks the node)."""
    if client.cluster:
        pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
    else:
        await script(keys=keys, args=args, client=pipe)


def _after_lead(got: list[Any], n: int) -> tuple[Any, list[Any]]:
    """The reply after the first ``n`` of a round trip's replies, and those after it;
    an error among the first ``n`` (writes the rest depends on) raises."""
    for r in got[:n]:
        if isinstance(r, resp.ReplyError):
            raise translate(r) from r
    return got[n], got[n + 1 :]


def _settle_each(mapped: asyncio.Future[Any], fut: asyncio.Future[Any]) -> None:
    """Pass a :meth:`Client.send_each` reply on: an error reply as a QpsError result."""
    if mapped.done():
        return
    if fut.cancelled():
        mapped.cancel()
    elif (exc := fut.exception()) is not None:
        mapped.set_exception(exc)
    else:
        mapped.set_result(_error_in_place(fut.result()))


def _abandon(fut: asyncio.Future[Any], mapped: asyncio.Future[Any]) -> None:
    """A :meth:`Client.send_each` future cancelled by its caller: drop the reply."""
    if mapped.cancelled() and not fut.done():
        fut.cancel()


async def _call_many(
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


async def write_all(client: Client, commands: Sequence[tuple[Any, ...]]) -> None:
    """Run write ``commands`` of large values in one round trip: streamed on a lean
    connection (:meth:`~qps.transport.Client.write_commands`: the buffers are never
    joined, nor copied whole), else as a redis-py pipeline (which joins
    :class:`~qps.resp.Pieces`).

    Raises:
        UnavailableError, InternalError: as the commands do.
    """
    if not commands:
        return
    replies = await client.write_commands(commands, stream=True)
    if replies is None:
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*[_joined(a) for a in command])
            await pipe.execute()
        return
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply


def _joined(arg: Any) -> Any:
    """A command argument as redis-py takes it: :class:`~qps.resp.Pieces` joined."""
    return arg.join() if isinstance(arg, resp.Pieces) else arg


def _error_in_place(reply: Any) -> Any:
    """A reply, or the qps error for an error reply (its cause the original)."""
    if isinstance(reply, (resp.ReplyError, RedisError)):
        err = translate(reply)
        err.__cause__ = reply
        return err
    return reply


def is_noscript(exc: BaseException) -> bool:
    """Whether an error (in place among :meth:`Client.run_commands_replies`' replies)
    says that a script run by SHA is not loaded: it did not run."""
    cause = exc.__cause__ if isinstance(exc, QpsError) else exc
    if isinstance(cause, resp.ReplyError):
        return cause.code == "NOSCRIPT"
    return isinstance(cause, NoScriptError)


def _str_name(command: Sequence[Any]) -> Sequence[Any]:
    """``command`` with its name as a str: redis-py's cluster routing reads the name as
    text (the lean connections' commands name themselves in bytes)."""
    name = command[0]
    return (name.decode(), *command[1:]) if isinstance(name, bytes) else command


async def _cluster_enabled(client: Client) -> bool:
    """Whether the server is a Redis Cluster node (``INFO cluster``), asked in place of
    :meth:`Client.ping`. A user that may not run INFO (a @dangerous command, which ACLs
    often deny) is asked ``CLUSTER INFO`` (@slow) instead: a node answers, a single
    server refuses (cluster support disabled), and so does a server that denies both.

    Raises:
        UnavailableError: the server cannot be reached.
    """
    try:
        info = await client.commands.info("cluster")
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise translate(exc) from exc
    except RedisError:  # e.g. NOPERM
        try:
            await client.commands.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise translate(exc) from exc
        except RedisError:
            return False
        return True
    return bool(int(info.get("cluster_enabled", 0) or 0))


def _cluster_pools(url: str) -> tuple[aioredis.RedisCluster, aioredis.RedisCluster]:
    if url.startswith("unix:"):
        raise InvalidArgumentError(
            f"Redis Cluster needs a redis:// or rediss:// URL, not {redact_url(url)}"
        )
    options = _pool_options(url)
    try:
        commands = aioredis.RedisCluster.from_url(url, **options)
        blocking = aioredis.RedisCluster.from_url(url, **options)
    except (RedisError, RedisClusterException, ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"cannot use {redact_url(url)} for Redis Cluster: {exc}"
        ) from exc
    return commands, blocking


#: Redirections a lean call to a cluster node can get. MOVED: the slot belongs to
#: another node, the command did not run; ASK/TRYAGAIN: the slot is being migrated.
_REDIRECTS = frozenset({"MOVED", "ASK", "TRYAGAIN"})


def _redirect(exc: BaseException) -> str | None:
    """The redirection code of a translated lean-connection error, else None."""
    cause = exc.__cause__
    if isinstance(cause, resp.ReplyError) and cause.code in _REDIRECTS:
        return cause.code
    return None


class ClusterClient(Client):
    """A :class:`Client` of a Redis Cluster (made by :func:`connect_cluster`).

    ``commands`` and ``blocking`` are redis-py ``RedisCluster`` clients. The hot path
    (the script calls of :class:`Client`) goes over lean connections to the primary
    that owns the slot of the call's first key: one plain :class:`Client` per node
    (``self._nodes``), found through redis-py's slot map. Every qps script and the
    commands sent with it touch one hash tag, hence that one slot.

    A ``MOVED`` reply means nothing of the call ran (the node no longer owns the slot,
    so it refused every command of the call): the slot map is read again and the call
    is sent once more to the new owner. Exception: :meth:`script_then_wait`, whose first
    script may have run before a blocked ``BLPOP`` was cut by a move; it raises
    :class:`UnavailableError` after the refresh, as a lost connection would (the
    attempt's lease undoes what it left). ``ASK``/``TRYAGAIN`` (a slot in migration):
    a lone script call goes through redis-py, which follows them; other calls raise
    :class:`UnavailableError`. A call that loses its node (connection refused or cut)
    raises :class:`UnavailableError` as on a single server, and the slot map is read
    again for the next call (after a failover: the promoted replica).
    """

    cluster = True

    def __init__(
        self,
        commands: Any,
        blocking: Any,
        *,
        url: str,
        base: resp.Endpoint | None,
    ) -> None:
        super().__init__(commands, blocking, url=url, pipelined_blocking=True)
        self._slots: aioredis.RedisCluster = commands  # typed: the slot map's owner
        #: the lean connections' settings with host/port left to each node; None: none
        self._base = base
        self._nodes: dict[str, Client] = {}  # node name -> its lean connections
        self._route: dict[str, Client] = {}  # first key -> its node's client

    # -- routing ---------------------------------------------------------------------
    def _node_for(self, key: Any) -> Client | None:
        """The plain client of the node owning ``key``'s slot; None: no lean path."""
        got = self._route.get(key)
        if got is not None:
            return got
        if self._base is None:
            return None
        raw = key.encode() if isinstance(key, str) else bytes(key)
        node = self._slots.nodes_manager.get_node_from_slot(key_slot(raw))
        child = self._nodes.get(node.name)
        if child is None:
            endpoint = dataclasses.replace(self._base, host=node.host, port=int(node.port))
            child = Client(self.commands, self.blocking, url=self.url, endpoint=endpoint)
            child.cluster = True
            child.client_id = self.client_id  # attempt ids come from this client
            child._scripts = self._scripts
            self._nodes[node.name] = child
        if len(self._route) < 100_000:
            self._route[key] = child
        return child

    async def _refresh(self) -> None:
        """Read the slot map again (after a redirection) and forget the routes."""
        self._route.clear()
        with map_errors():
            await self._slots.nodes_manager.initialize()

    async def _routed(self, key: str, child: Client, call: Callable[[Client], Awaitable[T]]) -> T:
        """``call`` on ``child``, the node owning ``key``'s slot; after a ``MOVED``
        (nothing of the call ran) once more on the slot's new owner."""
        for attempt in (0, 1):
            try:
                return await call(child)
            except UnavailableError:
                await self._lost()
                raise
            except InternalError as exc:
                await self._redirected(exc, attempt)
            again = self._node_for(key)
            assert again is not None
            child = again
        raise AssertionError("unreachable")

    # -- the hot path ------------------------------------------------------------------
    async def run_script(self, name: str, keys: Sequence[str], args: ScriptArgs) -> Any:
        child = self._node_for(keys[0]) if keys else None
        if child is None:
            return await super().run_script(name, keys, args)
        try:
            return await child.run_script(name, keys, args)
        except UnavailableError:
            await self._lost()
            raise
        except InternalError as exc:
            code = _redirect(exc)
            if code is None:
                raise
            await self._refresh()
            if code != "MOVED":  # redis-py follows ASK and waits out TRYAGAIN
                return await super().run_script(name, keys, args)
        child = self._node_for(keys[0])
        assert child is not None
        return await child.run_script(name, keys, args)

    async def run_commands_then_script(
        self,
        commands: Sequence[Sequence[Any]],
        name: str | None,
        keys: Sequence[str],
        args: ScriptArgs,
    ) -> tuple[list[Any], Any]:
        child = self._node_for(keys[0]) if name is not None and keys else None
        if child is None:  # plain commands alone may span slots: redis-py splits them
            return await super().run_commands_then_script(commands, name, keys, args)
        # the commands sent with a script are idempotent writes or reads of its slot (a
        # batch buffer, chunk reads): a MOVED call is sent again whole
        return await self._routed(
            keys[0], child, lambda c: c.run_commands_then_script(commands, name, keys, args)
        )

    async def run_script_then_commands(
        self,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Sequence[Sequence[Any]],
        *,
        once: bool = False,
        before: Sequence[Sequence[Any]] = (),
        blocking: bool = False,
    ) -> tuple[Any, list[Any]]:
        child = self._node_for(keys[0]) if keys else None
        if child is None:
            return await super().run_script_then_commands(
                name, keys, args, after, once=once, before=before, blocking=blocking
            )
        return await self._routed(
            keys[0],
            child,
            lambda c: c.run_script_then_commands(
                name, keys, args, after, once=once, before=before, blocking=blocking
            ),
        )

    async def wait_then_script(
        self,
        wake_key: str,
        block_seconds: float,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Sequence[Sequence[Any]] = (),
    ) -> Any:
        child = self._node_for(keys[0]) if keys else None
        if child is None:
            return await super().wait_then_script(wake_key, block_seconds, name, keys, args, after)
        # a wake token popped before a move is lost, which a wait tolerates
        return await self._routed(
            keys[0],
            child,
            lambda c: c.wait_then_script(wake_key, block_seconds, name, keys, args, after),
        )

    async def script_then_wait(
        self,
        first: str,
        keys: Sequence[str],
        first_args: ScriptArgs,
        wake_key: str,
        block_seconds: float,
        name: str,
        args: ScriptArgs,
        after: Sequence[Sequence[Any]] = (),
    ) -> tuple[Any, Any, list[Any]] | None:
        child = self._node_for(keys[0]) if keys else None
        if child is None:
            return None
        try:
            return await child.script_then_wait(
                first, keys, first_args, wake_key, block_seconds, name, args, after
            )
        except UnavailableError:
            await self._lost()
            raise
        except InternalError as exc:
            await self._redirected(exc, 1)  # never sent again: ``first`` may have run
            raise

    async def read_into(
        self, keys: Sequence[str], targets: Sequence[memoryview]
    ) -> list[int | None] | None:
        child = self._node_for(keys[0]) if keys else None
        if child is None:
            return None
        try:
            return await child.read_into(keys, targets)
        except UnavailableError:
            await self._lost()
            raise
        except InternalError as exc:
            if _redirect(exc) is None:
                raise
            await self._refresh()
            return None  # the caller reads through redis-py, which follows redirections

    async def send_each(
        self, commands: Sequence[Sequence[Any]]
    ) -> list[asyncio.Future[Any]] | None:
        """None: a cluster's callers wait another way (see :meth:`Client.send_each`)."""
        return None

    async def write_commands(
        self, commands: Sequence[Sequence[Any]], *, stream: bool = False
    ) -> list[Any] | None:
        """:meth:`Client.write_commands` on the node of the first command's key (every
        key must be in its slot); None (write through redis-py then, which follows
        redirections) when that node is not known or answered a redirection."""
        child = self._node_for(commands[0][1]) if commands else None
        if child is None:
            return None
        try:
            replies = await child.write_commands(commands, stream=stream)
        except UnavailableError:
            await self._lost()
            raise
        if replies is not None and any(
            isinstance(r, InternalError) and _redirect(r) is not None for r in replies
        ):
            await self._refresh()
            return None
        return replies

    async def _lost(self) -> None:
        """After a lean call lost its node (a failover, a node gone): read the slot map
        again so that the next call goes to the slot's owner now; the failed call is
        not sent again (it may have run)."""
        self._route.clear()
        with contextlib.suppress(Exception):
            await self._slots.nodes_manager.initialize()

    async def _redirected(self, exc: InternalError, attempt: int) -> None:
        """After a failed lean call: return if it may be sent again (a first MOVED;
        the slot map is read again), else raise."""
        code = _redirect(exc)
        if code is None:
            raise exc
        await self._refresh()
        if code != "MOVED" or attempt:
            raise UnavailableError(
                f"Redis Cluster redirected a call ({code}): a slot is being moved; try again"
            ) from exc

    async def _close_lean(self) -> None:
        self._base = None
        self._route.clear()
        nodes = list(self._nodes.values())
        self._nodes.clear()
        for child in nodes:
            await child._close_lean()
        await super()._close_lean()


async def connect_cluster(url: str, *, lean: bool = True) -> Client:
    """A :class:`ClusterClient` of the Redis Cluster that ``url`` (any node) belongs to.

    ``lean=False``: scripts go through redis-py's ``RedisCluster`` too (slower; for
    comparison).

    Raises:
        UnavailableError: the cluster cannot be reached.
        InvalidArgumentError: a unix socket URL, or a database other than 0.
    """
    commands, blocking = _cluster_pools(url)
    client = ClusterClient(commands, blocking, url=url, base=None)
    try:
        with map_errors():
            try:
                await commands.initialize()  # reads the slot map (CLUSTER SLOTS)
                await blocking.initialize()
            except RedisClusterException as exc:
                if isinstance(exc.__cause__, (RedisConnectionError, OSError)):
                    raise UnavailableError(str(exc)) from exc
                raise InvalidArgumentError(
                    f"{redact_url(url)} is not a usable Redis Cluster node: {exc}"
                ) from exc
            if lean:  # the URL's settings (TLS, user, password...), any node's address
                client._base = lean_endpoint(url)
        await client.ping()
    except QpsError as exc:
        await client.close()
        if isinstance(exc, UnavailableError):
            raise UnavailableError(
                f"cannot reach Redis Cluster at {redact_url(url)}: {exc}"
            ) from exc
        raise
    return client


def from_redis(
    commands: Any, blocking: Any | None = None, *, pipelined_blocking: bool = False
) -> Client:
    """Wrap existing redis-py (or fakeredis) asyncio clients in a :class:`Client`.

    Used by the tests for fakeredis, which cannot block inside a pipeline. A client
    with a ``socket_timeout`` (fakeredis's default) sends under ``asyncio.wait_for``,
    which can lose a task's cancellation before Python 3.12; 3.11 gets it back (see
    :func:`map_errors`), 3.10 cannot tell: there, give such clients no socket timeout.
    """
    return Client(
        commands,
        blocking if blocking is not None else commands,
        url="(in-process)",
        pipelined_blocking=pipelined_blocking,
    )


@contextlib.asynccontextmanager
async def connected(url: str | None = None) -> AsyncIterator[Client]:
    """``async with connected(url) as client:`` — :func:`connect` plus :meth:`Client.close`."""
    client = await connect(url)
    try:
        yield client
    finally:
        await client.close()

"""The :class:`Client`: every combined operation of the hot path, written once.

A combined operation sends plain commands and Lua scripts (by ``EVALSHA``) in one round
trip and reads their replies in order. Each is written once over :meth:`Client._send`,
which makes one round trip on whichever backend the client has:

* the **lean** shared connection (:mod:`qps.redis_lean`) on a real server;
* else a **redis-py** pipeline (fakeredis in the tests; any client once :meth:`close`
  closed its lean connections; a cluster client without lean connections).

What still differs by backend, and why:

* a lone script (:meth:`Client.run_script`, the busiest call) is one ``EVALSHA``
  without a pipeline around it on either backend: a pipeline of one costs more;
* the exchanges that may block (a ``BLPOP`` among the commands) go on a waiter
  connection of their own on the lean backend, so nothing else waits behind them;
  redis-py sends them on its ``blocking`` pool; fakeredis cannot block inside a
  pipeline, so there the ``BLPOP`` runs alone first (``pipelined_blocking=False``);
* :meth:`Client.script_then_wait`, ``write_commands``, ``send_each`` and ``read_into``
  exist on the lean backend only (else None: the caller takes another way): they
  need a connection of their own, or one that reads into the caller's buffers;
* a transaction is ``MULTI``/``EXEC`` on the lean connection and redis-py's
  transactional pipeline elsewhere (redis-py reads ``EXEC``'s reply itself).

``NOSCRIPT`` (the server lost, or never had, a script: nothing of it ran) is handled in
one place, :meth:`Client._loaded_again`: the script is loaded and sent again, with the
commands that must follow it, in one more round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from qps import resp
from qps.errors import InternalError
from qps.redis_errors import (
    all_raised,
    in_place,
    map_errors,
    noscript,
    raised,
    translate,
)
from qps.redis_lean import LeanConnections, call_many
from qps.redis_ops import PlainCommands
from qps.redis_scripts import Script
from qps.redis_url import redact_url

log = logging.getLogger("qps.transport")

#: Longest server-side block of one wait, in seconds; waits loop on it.
BLOCK_SECONDS = 1.0

Arg = bytes | bytearray | memoryview | str | int | float
ScriptArgs = Sequence[Arg]
Commands = Sequence[Sequence[Any]]


class Client(LeanConnections, PlainCommands):
    """A connection to one Redis server, shared by every qps object of a process: the
    combined operations here, the plain commands of :class:`~qps.redis_ops.PlainCommands`.

    Build one with :func:`qps.transport.connect`. Use ``async with`` or call
    :meth:`close`.
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
        super().__init__(endpoint)
        self.commands = commands
        self.blocking = blocking
        self.url = url
        #: Real servers run a pipelined ``[BLPOP, EVALSHA]`` in one round trip; fakeredis
        #: cannot block inside a pipeline, so it gets the two calls one after the other.
        self.pipelined_blocking = pipelined_blocking
        self.client_id = secrets.token_hex(4)
        self._counter = 0
        self._scripts: dict[str, Script] = {}
        self._owned_server = owned_server
        self._closed = False
        #: cleanup callbacks run by close(), e.g. cancelling blocked attempts
        self._on_close: list[Any] = []

    #: True for a Redis Cluster client (:func:`qps.redis_cluster.connect_cluster`).
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

    # -- the one round trip and the one NOSCRIPT path ---------------------------
    def _script(self, name: str) -> Script:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = Script(name)
        return script

    async def _send(self, commands: Commands, *, pool: Any = None) -> list[Any]:
        """One round trip: ``commands`` in order on the shared lean connection, else as
        a redis-py pipeline on ``pool`` (``self.commands`` by default). Returns their
        replies, an error reply in its place (raw: see :mod:`qps.redis_errors`).

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: an argument Redis commands cannot carry.
        """
        conn = await self._lean_now()
        if conn is not None:
            return await call_many(conn, commands)
        if not commands:
            return []
        with map_errors():
            pipe = (pool or self.commands).pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*(_str_name(c) if self.cluster else c))
            return list(await pipe.execute(raise_on_error=False))

    async def _loaded_again(self, script: Script, commands: Commands) -> list[Any]:
        """After NOSCRIPT (nothing of the script ran): load ``script`` and send
        ``commands`` (its ``EVALSHA`` first, then what must follow it) again, in one
        round trip on the lean connection; their replies, errors in place (raw)."""
        conn = await self._lean_now()
        if conn is not None:
            got = await call_many(conn, [script.load, *commands])
            raised(got[0])
            return got[1:]
        with map_errors():  # redis-py (a cluster: on every primary)
            await self.commands.script_load(script.source)
        return await self._send(commands)

    async def _ran(
        self, script: Script, command: tuple[Any, ...], reply: Any, again: Commands = ()
    ) -> tuple[Any, list[Any] | None]:
        """Script ``command``'s ``reply``, raised if an error; after NOSCRIPT, loaded
        and sent again with ``again`` (see :meth:`_loaded_again`): then also their
        replies (in place), else None."""
        if not noscript(reply):
            return raised(reply), None
        got = await self._loaded_again(script, [command, *again])
        return raised(got[0]), [in_place(r) for r in got[1:]]

    # -- combined operations ------------------------------------------------------
    async def run_script(self, name: str, keys: Sequence[str], args: ScriptArgs) -> Any:
        """Run Lua script ``name`` (from ``qps/lua``) and return its reply.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: the script failed inside Redis.
        """
        script = self._scripts.get(name)
        if script is None:
            script = self._script(name)
        command = (b"EVALSHA", script.sha, len(keys), *keys, *args)
        if self._endpoint is not None:  # every queue operation's hot path
            conn = self._lean
            if conn is None or conn._failure is not None:  # missing or dead
                conn = await self._open_lean()
            if conn is not None:
                try:
                    return await conn.call(command)
                except resp.ReplyError as exc:
                    if exc.code != "NOSCRIPT":
                        raise translate(exc) from exc
                except TypeError as exc:  # redis-py: DataError, i.e. InternalError
                    raise InternalError(f"unexpected Redis error: {exc}") from exc
                return raised((await self._loaded_again(script, [command]))[0])
        with map_errors():
            try:
                return await self.commands.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                pass
        return raised((await self._loaded_again(script, [command]))[0])

    async def run_commands(self, commands: Commands) -> list[Any]:
        """Run plain commands in one round trip; return their replies in order.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: a command failed (the others may have run).
        """
        return all_raised(await self._send(commands))

    async def run_commands_replies(self, commands: Commands) -> list[Any]:
        """Run ``commands`` (scripts by ``EVALSHA`` among them) in one round trip, in
        order, on one connection; return their replies, a failed command's error in its
        place (a :class:`QpsError`: see :func:`~qps.redis_errors.is_noscript`), not
        raised. Not for Redis Cluster (commands of several slots).

        Raises:
            UnavailableError: the server cannot be reached.
        """
        return [in_place(r) for r in await self._send(commands)]

    async def run_transaction(self, commands: Commands) -> list[Any]:
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
        replies = all_raised(await call_many(conn, [(b"MULTI",), *commands, (b"EXEC",)]))
        done = replies[-1]
        if not isinstance(done, list):  # EXEC answered nil: cannot happen without WATCH
            raise InternalError(f"unexpected reply to EXEC: {done!r}")
        return all_raised(done)

    async def run_commands_then_script(
        self, commands: Commands, name: str | None, keys: Sequence[str], args: ScriptArgs
    ) -> tuple[list[Any], Any]:
        """Run plain ``commands`` and then script ``name`` (None: no script) in one
        round trip; return the commands' replies and the script's.

        Raises:
            UnavailableError: the server cannot be reached.
            InternalError: a command or the script failed (the commands before it ran).
        """
        if name is None:
            return await self.run_commands(commands), None
        script = self._script(name)
        command = script.call(keys, args)
        replies = await self._send([*commands, command])
        reply, _ = await self._ran(script, command, replies.pop())
        return all_raised(replies), reply

    async def run_script_then_commands(
        self,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Commands,
        *,
        once: bool = False,
        before: Commands = (),
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
        command = script.call(keys, args)
        if blocking and after:
            waiter = await self._waiter_connection()
            if waiter is None:
                after = ()
            else:  # the script loaded first (once): a NOSCRIPT would leave them waiting
                lead = [*(() if script.loaded else [script.load]), *before]
                got = await self._exchange(waiter, [*lead, command, *after])
                all_raised(got[: len(lead)])
                reply = got[len(lead)]
                script.loaded = not noscript(reply)
                if not script.loaded:
                    return await self.run_script(name, keys, args), []
                return raised(reply), [in_place(r) for r in got[len(lead) + 1 :]]
        got = await self._send([*before, command, *after])
        all_raised(got[: len(before)])
        reply, again = await self._ran(script, command, got[len(before)], () if once else after)
        if again is None or once:  # ran the first time, or ``once``: their first replies
            again = [in_place(r) for r in got[len(before) + 1 :]]
        return reply, again

    async def wait_then_script(
        self,
        wake_key: str,
        block_seconds: float,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Commands = (),
    ) -> Any:
        """Block up to ``block_seconds`` on ``wake_key``, then run script ``name``.

        On a real server both go in one pipeline: the server holds the script back until
        the BLPOP returns, so a wake-up costs one round trip. ``after``: plain commands
        run after the script, in the same round trip; with them, returns the script's
        reply and theirs.

        Raises:
            UnavailableError: the server cannot be reached.
        """
        got = await self._wait(None, wake_key, block_seconds, name, keys, args, after)
        assert got is not None
        return got[1:] if after else got[1]

    async def script_then_wait(
        self,
        first: str,
        keys: Sequence[str],
        first_args: ScriptArgs,
        wake_key: str,
        block_seconds: float,
        name: str,
        args: ScriptArgs,
        after: Commands = (),
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
        return await self._wait(
            (first, first_args), wake_key, block_seconds, name, keys, args, after
        )

    async def _wait(
        self,
        first: tuple[str, ScriptArgs] | None,
        wake_key: str,
        block_seconds: float,
        name: str,
        keys: Sequence[str],
        args: ScriptArgs,
        after: Commands,
    ) -> tuple[Any, Any, list[Any]] | None:
        """[script ``first``,] BLPOP, script ``name``, ``after`` commands in one round
        trip; the replies of ``first`` (None without it), of ``name`` and of ``after``.
        None: ``first`` given and no waiter connection to be had."""
        # BLPOP takes a timeout in seconds with millisecond resolution; 0 means forever.
        wait = (b"BLPOP", wake_key, max(0.001, round(block_seconds, 3)))
        script = self._script(name)
        command = script.call(keys, args)
        lead = [] if first is None else [self._script(first[0]).call(keys, first[1])]
        conn = await self._waiter_connection()
        if conn is not None:
            replies = await self._exchange(conn, [*lead, wait, command, *after])
            del replies[len(lead)]  # the BLPOP's
        elif first is not None:
            return None
        elif self.pipelined_blocking:  # redis-py: the pool for blocking calls
            replies = (await self._send([wait, command, *after], pool=self.blocking))[1:]
        else:
            # fakeredis wedges a connection whose blocked command is cancelled; let a
            # cancelled wait run out its (short) block in the background instead.
            blpop = asyncio.ensure_future(self.blocking.blpop([wake_key], timeout=wait[2]))
            blpop.add_done_callback(lambda f: f.cancelled() or f.exception())
            with map_errors():
                await asyncio.shield(blpop)
            replies = await self._send([command, *after])
        lead_reply = None
        if first is not None:
            lead_reply = replies.pop(0)
            if noscript(lead_reply):  # nothing ran: run it now (idle wait)
                return await self.run_script(first[0], keys, first[1]), None, []
            raised(lead_reply)
        reply, again = await self._ran(script, command, replies[0], after)
        rest = again if again is not None else [in_place(r) for r in replies[1:]]
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

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<qps.Client {redact_url(self.url)} id={self.client_id}>"


def _str_name(command: Sequence[Any]) -> Sequence[Any]:
    """``command`` with its name as a str: redis-py's cluster routing reads the name as
    text (the lean connections' commands name themselves in bytes)."""
    name = command[0]
    return (name.decode(), *command[1:]) if isinstance(name, bytes) else command

"""A Redis Cluster client: :class:`ClusterClient` and :func:`connect_cluster`.

A cluster client's ``commands`` and ``blocking`` are redis-py ``RedisCluster`` clients:
each command goes to the primary owning its key's slot, a non-transactional pipeline
is split by node (replies in order), SCAN, FLUSHALL and SCRIPT LOAD visit every
primary, and DEL/UNLINK/EXISTS split their keys by slot. redis-py follows MOVED/ASK/
TRYAGAIN (the command did not run) and does not retry after a connection error
(``Retry(NoBackoff(), 0)``), like the single-server path. The hot path (scripts and
blocking waits) goes over lean connections per primary. Every qps script touches one
hash tag, hence one slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from qps import resp
from qps.errors import InternalError, InvalidArgumentError, QpsError, UnavailableError
from qps.redis_client import Client, Commands
from qps.redis_errors import map_errors, redirect, translate
from qps.redis_url import lean_endpoint, pool_options, redact_url

T = TypeVar("T")


async def _none() -> None:
    return None


F = TypeVar("F", bound=Callable[..., Any])


def _on_slot(
    op: F,
    keys_at: int,
    *,
    script_at: int | None = None,
    again: bool = True,
    follow: bool = False,
    none: bool = False,
) -> F:
    """:class:`Client`'s ``op`` as a :class:`ClusterClient` runs it: on the node owning
    the slot of its first key (positional argument ``keys_at``; none when the script
    name at ``script_at`` is None), through :meth:`ClusterClient._on_node` with
    ``again`` and ``follow``. Where no lean path leads, ``op`` runs on the cluster
    client itself (redis-py), or (``none``) the answer is None."""

    async def routed(self: ClusterClient, *args: Any, **kw: Any) -> Any:
        keys = args[keys_at]
        key = keys[0] if keys and (script_at is None or args[script_at] is not None) else None
        return await self._on_node(
            key,
            lambda child: op(child, *args, **kw),
            _none if none else functools.partial(op, self, *args, **kw),
            again=again,
            follow=follow,
        )

    return cast(F, functools.wraps(op)(routed))


class ClusterClient(Client):
    """A :class:`Client` of a Redis Cluster (made by :func:`connect_cluster`).

    ``commands`` and ``blocking`` are redis-py ``RedisCluster`` clients. The hot path
    (the combined operations of :class:`Client`) goes over lean connections to the
    primary that owns the slot of the call's first key: one plain :class:`Client` per
    node (``self._nodes``), found through redis-py's slot map, runs it there (see
    :meth:`_on_node`). Every qps script and the commands sent with it touch one hash
    tag, hence that one slot.

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
        self, commands: Any, blocking: Any, *, url: str, base: resp.Endpoint | None
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

    async def _on_node(
        self,
        key: Any,
        call: Callable[[Client], Awaitable[T]],
        fallback: Callable[[], Awaitable[T]],
        *,
        again: bool = True,
        follow: bool = False,
    ) -> T:
        """``call`` on the plain client of the node owning ``key``'s slot; ``fallback``
        (redis-py's way, or the caller's) when no lean path leads there (``key`` None).

        After a redirection (nothing of the call ran) the slot map is read again; then
        a first ``MOVED`` is sent once more to the slot's owner when ``again``; else
        ``fallback`` runs when ``follow`` (redis-py follows redirections), or
        :class:`UnavailableError` is raised. A call that loses its node raises
        :class:`UnavailableError`; the slot map is read again for the next call, the
        failed one is not sent again (it may have run)."""
        for attempt in (0, 1):
            child = None if key is None else self._node_for(key)
            if child is None:
                return await fallback()
            try:
                return await call(child)
            except UnavailableError:
                await self._lost()
                raise
            except InternalError as exc:
                code = redirect(exc)
                if code is None:
                    raise
                await self._refresh()
                if code == "MOVED" and again and not attempt:
                    continue
                if follow:
                    return await fallback()
                raise UnavailableError(
                    f"Redis Cluster redirected a call ({code}): a slot is being moved; try again"
                ) from exc
        raise AssertionError("unreachable")

    async def _refresh(self) -> None:
        """Read the slot map again (after a redirection) and forget the routes."""
        self._route.clear()
        with map_errors():
            await self._slots.nodes_manager.initialize()

    async def _lost(self) -> None:
        """After a lean call lost its node (a failover, a node gone): read the slot map
        again so that the next call goes to the slot's owner now."""
        self._route.clear()
        with contextlib.suppress(Exception):
            await self._slots.nodes_manager.initialize()

    # -- the hot path, on the slot's node ----------------------------------------------
    # Which argument names the slot, and what follows a redirection (see _on_node).
    run_script = _on_slot(Client.run_script, 1, follow=True)  # redis-py follows ASK
    # plain commands alone may span slots: redis-py splits them. The commands sent with
    # a script are idempotent writes or reads of its slot (a batch buffer, chunk
    # reads): a MOVED call is sent again whole
    run_commands_then_script = _on_slot(Client.run_commands_then_script, 2, script_at=1)
    run_script_then_commands = _on_slot(Client.run_script_then_commands, 1)
    # a wake token popped before a move is lost, which a wait tolerates
    wait_then_script = _on_slot(Client.wait_then_script, 3)
    # never sent again: ``first`` may have run; None: the caller runs the steps itself
    script_then_wait = _on_slot(Client.script_then_wait, 1, again=False, none=True)
    # None after a redirection: the caller reads through redis-py, which follows them
    read_into = _on_slot(Client.read_into, 0, again=False, follow=True, none=True)

    async def send_each(self, commands: Commands) -> None:
        """None: a cluster's callers wait another way (see :meth:`Client.send_each`)."""
        return None

    async def write_commands(self, commands: Commands, *, stream: bool = False) -> list[Any] | None:
        """:meth:`Client.write_commands` on the node of the first command's key (every
        key must be in its slot); None (write through redis-py then, which follows
        redirections) when that node is not known or answered a redirection."""

        async def write(child: Client) -> list[Any] | None:
            replies = await child.write_commands(commands, stream=stream)
            for r in replies or ():
                if isinstance(r, InternalError) and redirect(r) is not None:
                    raise r
            return replies

        return await self._on_node(
            commands[0][1] if commands else None, write, _none, again=False, follow=True
        )

    async def _close_lean(self) -> None:
        self._base = None
        self._route.clear()
        nodes = list(self._nodes.values())
        self._nodes.clear()
        for child in nodes:
            await child._close_lean()
        await super()._close_lean()


async def cluster_enabled(client: Client) -> bool:
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
            await client.commands.execute_command("CLUSTER", "INFO")
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise translate(exc) from exc
        except RedisError:
            return False
        return True
    return bool(int(info.get("cluster_enabled", 0) or 0))


async def connect_cluster(url: str, *, lean: bool = True) -> Client:
    """A :class:`ClusterClient` of the Redis Cluster that ``url`` (any node) belongs to.

    ``lean=False``: scripts go through redis-py's ``RedisCluster`` too (slower; for
    comparison).

    Raises:
        UnavailableError: the cluster cannot be reached.
        InvalidArgumentError: a unix socket URL, or a database other than 0.
    """
    if url.startswith("unix:"):
        raise InvalidArgumentError(
            f"Redis Cluster needs a redis:// or rediss:// URL, not {redact_url(url)}"
        )
    options = pool_options(url)
    try:
        commands = aioredis.RedisCluster.from_url(url, **options)
        blocking = aioredis.RedisCluster.from_url(url, **options)
    except (RedisError, RedisClusterException, ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"cannot use {redact_url(url)} for Redis Cluster: {exc}"
        ) from exc
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

"""The Redis layer's front door: :func:`connect`, and every name the layers above use.

The layer is split along its seams; each module is small enough to read in one go:

* :mod:`qps.redis_client` — :class:`Client`: every combined operation of the hot path
  (scripts and the plain commands sent with them in one round trip, blocking waits),
  written once over one round trip on either backend, and the one ``NOSCRIPT`` path;
* :mod:`qps.redis_lean` — the lean connections (:mod:`qps.resp`: an asyncio Protocol,
  hiredis parsing, no redis-py) a client to a real server uses for that hot path: one
  shared by every task's script calls, waiter connections for exchanges that block or
  write large values, bulk readers. They cost about a third of redis-py's user-space
  CPU per call (docs/embedded.md, "Connections");
* :mod:`qps.redis_cluster` — :class:`ClusterClient`: the same operations on the
  cluster node owning the call's slot, with MOVED/ASK handled in one place;
* :mod:`qps.redis_ops` — :class:`~qps.redis_ops.PlainCommands`, the plain commands the
  layers above use (typed methods of :class:`Client`, each translating its errors), and
  :class:`Batch`, commands run in one round trip;
* :mod:`qps.redis_scripts` — the Lua scripts of ``qps/lua`` and their SHAs;
* :mod:`qps.redis_url` — URLs (and their form, :func:`check_form`), the redis-py pools
  and the lean connections' endpoint;
* :mod:`qps.redis_errors` — every Redis error translated into :mod:`qps.errors`.

Everything else (queue inspection, large-element chunks, variables, job state, the
CLI...) is the client's plain commands (:mod:`qps.redis_ops`), which go through two
redis-py clients with **no retries** (a retried ``EVALSHA`` could apply a state
transition twice): ``client.commands``, and ``client.blocking`` for the blocking
commands (``BLPOP``, ``BLMOVE``). No module above this layer calls them, or imports
redis-py, itself. A pooled connection that was reset while idle (a cut link) is
replaced before its next use, as a dead lean connection is (see ``_Pool``).

A :class:`Client` made by :func:`from_redis` (fakeredis in the tests, or any redis-py
client) has no lean connections: its round trips are redis-py pipelines.

No connection sets a per-read timeout: redis-py's 5 s default would cut blocking calls,
and on Python 3.11 any timeout costs a Task per call; TCP keepalive finds dead peers
and Redis-side leases undo what a vanished caller left pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from qps import resp
from qps.errors import QpsError, UnavailableError
from qps.redis_client import BLOCK_SECONDS, Arg, Client, ScriptArgs
from qps.redis_cluster import ClusterClient, cluster_enabled, connect_cluster
from qps.redis_errors import is_noscript, map_errors, reply_text, translate
from qps.redis_ops import Batch
from qps.redis_scripts import Script as _Script
from qps.redis_url import (
    CLUSTER_ENV,
    URL_ENV,
    _Pool,
    check_form,
    cluster_from_env,
    endpoint_of,
    lean_endpoint,
    pools,
    redact_url,
    split_cluster_param,
)

__all__ = [
    "BLOCK_SECONDS",
    "CLUSTER_ENV",
    "URL_ENV",
    "Arg",
    "Batch",
    "Client",
    "ClusterClient",
    "ScriptArgs",
    "_Pool",
    "_Script",
    "check_form",
    "cluster_from_env",
    "connect",
    "connect_cluster",
    "connected",
    "from_redis",
    "is_noscript",
    "lean_endpoint",
    "map_errors",
    "redact_url",
    "reply_text",
    "split_cluster_param",
    "translate",
    "write_all",
]


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
    commands, blocking = pools(url)
    client = Client(commands, blocking, url=url, owned_server=owned)
    try:
        with map_errors():  # e.g. a TLS option naming a file that is missing
            client._endpoint = endpoint_of(commands.connection_pool)
        if cluster is None and owned is None:
            if await cluster_enabled(client):  # instead of a PING: same round trips
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


def from_redis(
    commands: Any, blocking: Any | None = None, *, pipelined_blocking: bool = False
) -> Client:
    """Wrap existing redis-py (or fakeredis) asyncio clients in a :class:`Client`.

    Used by the tests for fakeredis, which cannot block inside a pipeline. A client
    with a ``socket_timeout`` (fakeredis's and redis-py 8's default) sends under
    ``asyncio.wait_for``, which can lose a task's cancellation before Python 3.12; 3.11
    gets it back (see :func:`map_errors`), 3.10 cannot tell: there, give such clients
    no socket timeout.
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
        joined = [[a.join() if isinstance(a, resp.Pieces) else a for a in c] for c in commands]
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            for command in joined:
                pipe.execute_command(*command)
            await pipe.execute()
        return
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply

"""Redis URLs: what ``connect`` reads from one, and the redis-py pools it builds.

A URL is ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) or
``unix:///path/to/socket``, plus qps's own ``cluster=`` query parameter (taken off
here: redis-py would refuse it). The lean connections (:mod:`qps.resp`) read the URL
the way redis-py does, through its pool (:func:`lean_endpoint`).
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from qps import resp
from qps.errors import InvalidArgumentError

URL_ENV = "QPS_REDIS_URL"
#: ``yes``/``no`` (1/0, true/false): whether URLs name a Redis Cluster node, when neither
#: the URL (``?cluster=``) nor the caller says; unset: detected. ``qps ... --cluster``
#: sets it for the command and the roles it starts.
CLUSTER_ENV = "QPS_CLUSTER"


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


def pool_options(url: str) -> dict[str, Any]:
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


def pools(url: str) -> tuple[aioredis.Redis, aioredis.Redis]:
    """Two redis-py clients of ``url`` (``commands`` and ``blocking``), no retries."""
    return tuple(  # type: ignore[return-value]
        aioredis.Redis.from_pool(_Pool.from_url(url, **pool_options(url))) for _ in range(2)
    )


def endpoint_of(pool: aioredis.ConnectionPool) -> resp.Endpoint:
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
    return endpoint_of(aioredis.ConnectionPool.from_url(url, **pool_options(url)))


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


def check_form(url: str) -> None:
    """Build, connecting nothing, the connection redis-py would make of ``url`` (its
    ``cluster=`` parameter taken off): the scheme, host and port and the query options.

    Raises:
        TypeError: an unknown query option (redis-py passes one to its connection as a
            keyword argument).
        InvalidArgumentError: the URL is malformed otherwise (redis-py's words).
    """
    try:
        base, _ = split_cluster_param(url)
        pool = aioredis.ConnectionPool.from_url(base)
        pool.connection_class(**pool.connection_kwargs)  # builds it; connects nothing
    except InvalidArgumentError:
        raise
    except (ValueError, RedisError) as exc:
        raise InvalidArgumentError(str(exc)) from exc

"""Redis errors translated into :mod:`qps.errors`, in one place.

Every redis-py, lean-connection (:class:`qps.resp.ReplyError`) and socket error that
the Redis layer meets is turned into a :class:`~qps.errors.QpsError` here:
``UnavailableError`` for connection trouble, ``PermissionDeniedError`` for an ACL
refusal, ``InternalError`` for anything unexpected. The layers above never see
redis-py's exception classes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from qps import resp
from qps.errors import InternalError, PermissionDeniedError, QpsError, UnavailableError

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

#: Redirections a lean call to a cluster node can get. MOVED: the slot belongs to
#: another node, the command did not run; ASK/TRYAGAIN: the slot is being migrated.
_REDIRECTS = frozenset({"MOVED", "ASK", "TRYAGAIN"})


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


def in_place(reply: Any) -> Any:
    """A reply, or the qps error for an error reply (its cause the original)."""
    if isinstance(reply, (resp.ReplyError, RedisError)):
        err = translate(reply)
        err.__cause__ = reply
        return err
    return reply


def raised(reply: Any) -> Any:
    """A reply; an error reply (of either backend) raised as its qps error."""
    if isinstance(reply, (resp.ReplyError, RedisError)):
        raise translate(reply) from reply
    return reply


def reply_text(exc: BaseException) -> str:
    """The server's own words for an error reply left in place (translated: its
    ``__cause__``), else the error's text."""
    cause = exc.__cause__ if isinstance(exc, QpsError) else None
    return str(cause if cause is not None else exc)


def all_raised(replies: Iterable[Any]) -> list[Any]:
    """Replies as a list; the first error reply among them raised (see :func:`raised`)."""
    return [raised(r) for r in replies]


def noscript(reply: Any) -> bool:
    """Whether a reply (of either backend, raw) says a script run by SHA is not loaded."""
    if isinstance(reply, resp.ReplyError):
        return reply.code == "NOSCRIPT"
    return isinstance(reply, NoScriptError)


def is_noscript(exc: BaseException) -> bool:
    """Whether an error (in place among :meth:`Client.run_commands_replies`' replies)
    says that a script run by SHA is not loaded: it did not run."""
    return noscript(exc.__cause__ if isinstance(exc, QpsError) else exc)


def redirect(exc: BaseException) -> str | None:
    """The redirection code (MOVED, ASK, TRYAGAIN) of a translated lean-connection
    error, else None."""
    cause = exc.__cause__
    if isinstance(cause, resp.ReplyError) and cause.code in _REDIRECTS:
        return cause.code
    return None

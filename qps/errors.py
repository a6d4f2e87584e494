"""The exceptions qps raises, mirroring TensorFlow 1.x's error classes.

Each class says *when* it is raised. Errors from redis-py never leave qps: the
transport translates them at its boundary (see :mod:`qps.transport`).
"""

from __future__ import annotations


class QpsError(Exception):
    """Base class of every error qps raises on purpose."""


class CancelledError(QpsError):
    """An operation was cancelled: enqueue on a closed queue, a pending enqueue cut off by
    ``close(cancel_pending_enqueues=True)``, or a pending call whose client was closed."""


class InvalidArgumentError(QpsError, ValueError):
    """Bad input: wrong dtype, shape or number of components, a negative count, or a
    shared resource requested with a spec different from the one it was created with."""


class DeadlineExceededError(QpsError, TimeoutError):
    """A blocking call's ``timeout=`` ran out; the call is withdrawn (a dequeue's collected
    elements go back, an ``enqueue_many`` keeps its inserted prefix) and the resource
    stays usable."""


class NotFoundError(QpsError, LookupError):
    """A named resource (queue, container, ...) does not exist."""


class FailedPreconditionError(QpsError):
    """The resource is not in the state the operation needs."""


class AbortedError(QpsError):
    """The operation was aborted, e.g. its container was reset underneath it."""


class OutOfRangeError(QpsError):
    """A dequeue on a closed queue that does not hold enough elements."""


class InternalError(QpsError):
    """Something that should not happen did: an unexpected reply or error from Redis."""


class UnavailableError(QpsError, ConnectionError):
    """Redis could not be reached, or no server binary could be found or started."""


class DataLossError(QpsError):
    """Bytes that should hold a qps message are corrupt, truncated, oversized or of an
    unknown format version; the message names what is wrong."""


class WouldBlockError(QpsError):
    """A ``*_nowait`` call could not complete at once; nothing was changed."""


class PermissionDeniedError(QpsError, PermissionError):
    """The Redis user may not run a command or touch a key (an ACL restricts it, e.g.
    to one container's keys: see docs/containers.md)."""


__all__ = [
    "AbortedError",
    "CancelledError",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "QpsError",
    "UnavailableError",
    "WouldBlockError",
]

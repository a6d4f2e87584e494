"""Every Redis key qps uses is spelled here, and nowhere else.

Layout (DESIGN.md §4.1): all keys of one resource share one hash tag, so each Lua
script touches a single slot and the same code runs on Redis Cluster::

    qps:{<container>/q/<name>}:meta      hash: spec, closed flag, counters, RNG state
    qps:{<container>/q/<name>}:items     list (FIFO, padding) or hash slot->element (shuffle)
    qps:{<container>/q/<name>}:ew        list: pending enqueue attempts, oldest first
    qps:{<container>/q/<name>}:dw        list: pending dequeue attempts, oldest first
    qps:{<container>/q/<name>}:lease     zset: attempt id -> lease expiry (ms, server clock)
    qps:{<container>/q/<name>}:dlq       list: elements that failed to decode, with reasons
    qps:{<container>/q/<name>}:a:<id>:p  list: elements a pending enqueue still has to insert
    qps:{<container>/q/<name>}:a:<id>:h  list: elements a dequeue holds (partial or delivered)
    qps:{<container>/q/<name>}:a:<id>:s  string: the outcome of a finished attempt
    qps:{<container>/q/<name>}:a:<id>:w  list: wake token for the attempt's blocked caller
    qps:{<container>/q/<name>}:b:<id>:<k> string: chunk k of a large element
    qps:{<container>}:queues             set: names of the queues of a container
    qps:containers                       set: names of all containers

Per-attempt keys are derived inside the Lua scripts from the queue's prefix; they share
its hash tag and therefore its slot.
"""

from __future__ import annotations

import re

ROOT = "qps"
CONTAINERS = f"{ROOT}:containers"
DEFAULT_CONTAINER = "default"

_CONTAINER_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/\-]{1,200}$")


def check_container(container: str) -> str:
    """Return ``container`` if it is a valid container name.

    Raises:
        InvalidArgumentError: empty, too long, or a character outside ``[A-Za-z0-9_.:-]``.
    """
    from qps.errors import InvalidArgumentError

    if not isinstance(container, str) or not _CONTAINER_RE.match(container):
        raise InvalidArgumentError(
            f"invalid container name {container!r}: use 1-128 characters from [A-Za-z0-9_.:-]"
        )
    return container


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid resource name.

    Raises:
        InvalidArgumentError: empty, too long, or a character outside ``[A-Za-z0-9_.:/-]``.
    """
    from qps.errors import InvalidArgumentError

    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgumentError(
            f"invalid resource name {name!r}: use 1-200 characters from [A-Za-z0-9_.:/-]"
        )
    return name


def queue_prefix(container: str, name: str) -> str:
    """The prefix shared by every key of queue ``name`` in ``container`` (ends with ':')."""
    return f"{ROOT}:{{{container}/q/{name}}}:"


def container_queues(container: str) -> str:
    """The set holding the names of the queues of ``container``."""
    return f"{ROOT}:{{{container}}}:queues"

"""Checks of a queue's stored state, wherever qps reads it (docs/queues.md, "Corrupt
state").

Nothing read back from Redis is trusted: the ``meta`` hash's spec and counters, the
types of the queue's keys and the attempt entries are checked where they are read, and
anything that breaks an invariant raises :class:`~qps.errors.DataLossError` naming the
key, rather than an answer that is wrong or a call that hangs. The Lua scripts check
the meta fields they read the same way (``queue_common.lua``) and refuse with an error
reply ``DATALOSS <key>: <why>``; :func:`explain` turns that, and any other failure of a
script on corrupt state, into the DataLossError naming the key.

The checks cost nothing on the hot paths: the scripts check values they have read
anyway, and the key-by-key diagnosis runs only once a script has failed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from qps.errors import DataLossError, InternalError, InvalidArgumentError, QpsError
from qps.queues.spec import CLASS_NAMES, MAX_COUNT, QueueSpec
from qps.transport import Client, map_errors, reply_text

#: the type each key of a queue must have (items: by kind)
_ITEM_TYPES = {"fifo": "list", "padding": "list", "shuffle": "hash", "priority": "zset"}
_KEY_TYPES = {"meta": "hash", "ew": "list", "dw": "list", "lease": "zset", "dlq": "list"}
#: attempt entries (queue_common.lua): 'e|<id>', 'c|<id>', 'd|<n>|<mode>|<id>', 'r|<id>'
_ID = r"[0-9a-f]+\.[0-9]+"
EW_ENTRY = re.compile(rf"[ec]\|{_ID}".encode())
DW_ENTRY = re.compile(rf"d\|[0-9]{{1,16}}\|(one|many|upto)A?\|{_ID}".encode())
_LEASE_ENTRY = re.compile(rf"([ecr]\|{_ID}|d\|[0-9]{{1,16}}\|(one|many|upto)A?\|{_ID})".encode())
#: a script failure that stored state may explain (a Lua runtime error, a command on a
#: key of the wrong type, arithmetic on a field that is no integer)
_SCRIPT_FAILURE = ("Error running script", "user_script", "WRONGTYPE", "not an integer")


def corrupt(key: str | bytes, why: str) -> DataLossError:
    """The error for a stored value that breaks an invariant."""
    shown = key.decode(errors="backslashreplace") if isinstance(key, bytes) else key
    return DataLossError(f"corrupt queue state: {shown}: {why}")


def failed_read(key: str | bytes, reply: BaseException, why: str = "cannot be read") -> NoReturn:
    """Raise for an error reply to a read of ``key``: a key of the wrong type is corrupt
    state (:func:`corrupt`); any other error (an ACL refusal, ...) is not the key's
    fault and raises as its own qps error."""
    if "WRONGTYPE" not in str(reply):
        with map_errors():
            raise reply
    raise corrupt(key, f"{why} ({reply_text(reply)})")


def stored_spec(raw: Any, key: str) -> QueueSpec:
    """The :class:`QueueSpec` stored in the ``spec`` field of meta hash ``key``.

    Raises:
        DataLossError: the field is missing or does not hold a valid spec.
    """
    if raw is None:
        raise corrupt(key, "the 'spec' field is missing")
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise TypeError("not an object")
        spec = QueueSpec.from_json(raw)
    except (ValueError, TypeError, KeyError, AttributeError, QpsError) as exc:
        text = bytes(raw[:60]) if isinstance(raw, (bytes, bytearray)) else str(raw)[:60]
        raise corrupt(key, f"the 'spec' field {text!r} is not a queue spec ({exc})") from None
    return spec


def count(value: Any, key: str, field: str, low: int = 0, high: int = MAX_COUNT) -> int:
    """An integer field of a hash (missing: 0), checked to lie in ``[low, high]``.

    Raises:
        DataLossError: not an integer, or out of range.
    """
    if value is None:
        return 0
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise corrupt(key, f"field '{field}' holds {value!r}, not an integer") from None
    if not low <= n <= high:
        raise corrupt(key, f"field '{field}' is {n}, outside [{low}, {high}]")
    return n


def check_meta(meta: Mapping[Any, Any], key: str) -> QueueSpec:
    """Check a queue's whole meta hash (as HGETALL gives it); return its spec.

    Raises:
        DataLossError: a field is missing, malformed or out of range, or the fields
            disagree with the spec.
    """
    spec = stored_spec(meta.get(b"spec"), key)
    kind = meta.get(b"kind")
    if kind is None or kind.decode(errors="replace") not in CLASS_NAMES:
        raise corrupt(key, f"field 'kind' is {kind!r}, not a queue type")
    if kind.decode() != spec.kind:
        raise corrupt(key, f"field 'kind' is {kind.decode()!r} but the spec says {spec.kind!r}")
    if meta.get(b"cap") is None:
        raise corrupt(key, "field 'cap' is missing")
    if count(meta.get(b"cap"), key, "cap", -1) != spec.capacity:
        raise corrupt(key, f"field 'cap' disagrees with the spec's capacity {spec.capacity}")
    if meta.get(b"closed") not in (b"0", b"1"):
        raise corrupt(key, f"field 'closed' is {meta.get(b'closed')!r}, not 0 or 1")
    for field in ("min", "w", "n", "enq", "deq", "seq", "x", "bad"):
        count(meta.get(field.encode()), key, field)
    if meta.get(b"rng") is not None:
        count(meta.get(b"rng"), key, "rng", 1, 2147483646)
    return spec


def size_reads(kind: str, prefix: str) -> list[tuple[Any, ...]]:
    """The reads whose replies give a queue's size (:func:`size_of_replies`)."""
    if kind == "shuffle":
        return [("HGET", prefix + "meta", "n"), ("HLEN", prefix + "items")]
    if kind == "priority":
        return [("ZCARD", prefix + "items")]
    # LLEN items + x (batch entries' rows beyond one each)
    return [("LLEN", prefix + "items"), ("HGET", prefix + "meta", "x")]


def size_of_replies(replies: Sequence[Any], kind: str, prefix: str) -> int:
    """A queue's size from the replies to its size reads (see ``QueueBase._size_reads``),
    each checked.

    Raises:
        DataLossError: a reply is an error (a key of the wrong type) or a count is
            malformed, negative, or (shuffle) disagrees with the items hash.
    """
    what = {"shuffle": ("meta", "items"), "priority": ("items",)}.get(kind, ("items", "meta"))
    for r, name in zip(replies, what):
        if isinstance(r, BaseException):
            failed_read(prefix + name, r)
    if kind == "shuffle":
        n = count(replies[0], prefix + "meta", "n")
        if len(replies) > 1 and int(replies[1]) != n:
            raise corrupt(
                prefix + "meta", f"field 'n' is {n} but the items hash holds {replies[1]}"
            )
        return n
    if kind == "priority":
        return int(replies[0])
    return int(replies[0]) + count(replies[1], prefix + "meta", "x")


async def diagnose(client: Client, prefix: str) -> DataLossError | None:
    """Look for the corrupt key of the queue whose keys start with ``prefix``: key types,
    the meta hash's fields, the attempt entries. None if nothing is found."""
    names = ("meta", "items", "ew", "dw", "lease", "dlq")
    batch = client.batch()
    for name in names:
        batch.type(prefix + name)
    types = [t.decode() if isinstance(t, bytes) else str(t) for t in await batch.run()]
    found = dict(zip(names, types))
    if found["meta"] == "none":
        return None
    for name, want in _KEY_TYPES.items():
        if found[name] not in ("none", want):
            return corrupt(prefix + name, f"is a {found[name]}, a queue keeps a {want} there")
    meta = await client.hgetall(prefix + "meta")
    try:
        spec = check_meta(meta, prefix + "meta")
    except DataLossError as exc:
        return exc
    want = _ITEM_TYPES[spec.kind]
    if found["items"] not in ("none", want):
        return corrupt(
            prefix + "items", f"is a {found['items']}, a {spec.class_name} keeps a {want}"
        )
    batch = client.batch().lrange(prefix + "ew", 0, -1).lrange(prefix + "dw", 0, -1)
    ew, dw, lease = await batch.zrange(prefix + "lease", 0, -1, withscores=True).run()
    for name, entries, pattern in (("ew", ew, EW_ENTRY), ("dw", dw, DW_ENTRY)):
        for e in entries:
            if not pattern.fullmatch(e):
                return corrupt(prefix + name, f"holds {bytes(e[:60])!r}, not an attempt entry")
    for e, score in lease:
        if not _LEASE_ENTRY.fullmatch(e) or not math.isfinite(score):
            return corrupt(prefix + "lease", f"holds {bytes(e[:60])!r}, not an attempt's lease")
    ids = [e.rsplit(b"|", 1)[1].decode() for e, _ in lease]
    batch = client.batch()
    for i in ids:
        batch.type(f"{prefix}a:{i}:h").type(f"{prefix}a:{i}:p")
    kinds = await batch.run()
    for j, t in enumerate(kinds):
        t = t.decode() if isinstance(t, bytes) else str(t)
        if t not in ("none", "list"):
            key = f"{prefix}a:{ids[j // 2]}:{'hp'[j % 2]}"
            return corrupt(key, f"is a {t}, an attempt keeps a list there")
    if spec.kind == "shuffle":
        stored = await client.hlen(prefix + "items")
        n = count(meta.get(b"n"), prefix + "meta", "n")
        if stored != n:
            return corrupt(prefix + "meta", f"field 'n' is {n} but the items hash holds {stored}")
    return None


async def explain(client: Client, prefix: str, exc: QpsError) -> QpsError:
    """The error to raise for ``exc``, raised by a script or command on the queue whose
    keys start with ``prefix``: a DataLossError naming the corrupt key when stored state
    explains it (a script's ``DATALOSS`` reply, or a key found corrupt by
    :func:`diagnose`), else ``exc`` itself."""
    if not isinstance(exc, InternalError):
        return exc
    text = str(exc)
    at = text.find("DATALOSS ")
    if at >= 0:
        return DataLossError(f"corrupt queue state: {text[at + 9 :]}")
    if not any(s in text for s in _SCRIPT_FAILURE):
        return exc
    try:
        found = await diagnose(client, prefix)
    except QpsError:
        return exc
    return exc if found is None else found


async def reraise(client: Client, prefix: str, exc: QpsError) -> NoReturn:
    """Raise what :func:`explain` makes of ``exc``."""
    err = await explain(client, prefix, exc)
    if err is exc:
        raise exc
    raise err from exc


def check_count(n: Any, what: str, low: int = 0) -> int:
    """A count argument of the queue API, as an int in ``[low, MAX_COUNT]``.

    Raises:
        InvalidArgumentError: not an integer, or out of range.
    """
    import numpy as np

    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise InvalidArgumentError(f"{what} needs an integer count, got {n!r}")
    if n < low:
        raise InvalidArgumentError(f"{what} requested {n} < {low} elements")
    if n > MAX_COUNT:
        raise InvalidArgumentError(f"{what} requested {n} elements; the most is {MAX_COUNT}")
    return int(n)

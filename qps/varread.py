"""Reads of several small variables at once (a worker's pull): from the copy of its
value that each write of a small variable keeps current (``<V>cur``, ending with its
version), all in one ``MULTI``/``EXEC`` on a single server, with no bytes through Lua.
:func:`read_many` reads the rest one by one (:meth:`qps.variables.Variable.read`);
:class:`ReadPlan` is the same read as commands a caller sends in a round trip of its
own.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qps import buffers, varcheck
from qps.errors import AbortedError, DataLossError, InternalError
from qps.transport import Batch, Client
from qps.varspec import ranges_arg, row_runs, split_runs
from qps.varwrite import text

if TYPE_CHECKING:
    from qps.variables import Variable

#: The script that reads runs of a generation atomically (rows, or a small value whole).
READ_SCRIPT = "vars/read"
#: Lock-free attempts of a large read (or of the batches of a row read) before the
#: ``MULTI``/``EXEC`` fallback.
READ_ATTEMPTS = 4
#: Tries of the fallback (one loses only to two flips within one round trip).
FALLBACK_ATTEMPTS = 100
#: One ``read_rows`` script reads at most about this many bytes of rows.
ROWS_BATCH_BYTES = 4 << 20
#: ``read_rows`` also reads the rows between two wanted ones when they are at most this
#: many bytes apart (one ``GETRANGE`` instead of two).
GAP_BYTES = 1024


class VariableState(NamedTuple):
    """What a PS shard loads: the value at ``version``, the optimizer ``slots`` stored
    with it (name -> array) and ``t``, the number of updates its commits applied."""

    value: npt.NDArray[Any]
    version: int
    slots: dict[str, npt.NDArray[Any]]
    t: int


class VariableValue(NamedTuple):
    """A read: ``value`` is exactly the variable at ``version``."""

    value: npt.NDArray[Any]
    version: int


async def read_many(variables: Sequence[Variable]) -> list[VariableValue]:
    """:meth:`~qps.variables.Variable.read` of several variables. On a single server the
    small ones of one client come from their current copies in one ``MULTI``/``EXEC``
    (one instant for all of them); every other one is read by itself, all concurrently
    (the small ones' scripts share the client's lean connection: one round trip). Each
    value is an exact snapshot of its variable."""
    out: list[VariableValue | None] = [None] * len(variables)
    small = [k for k, v in enumerate(variables) if v._opened and v.small]
    client = variables[small[0]]._client if small else None
    if client is not None and not client.cluster:
        small = [k for k in small if variables[k]._client is client]
        for k, got in zip(small, await _read_current([variables[k] for k in small])):
            out[k] = got
    tried = set(small) if client is not None and not client.cluster else set()
    rest = [k for k, got in enumerate(out) if got is None]
    reads = (variables[k]._read_small() if k in tried else variables[k].read() for k in rest)
    for k, got in zip(rest, await asyncio.gather(*reads)):
        out[k] = got
    return [got for got in out if got is not None]


async def _read_current(variables: Sequence[Variable]) -> list[VariableValue | None]:
    """The values of small variables of one client on a single server, from the copies
    their writes keep current (``<V>cur`` at the meta's ``curver``), all in one
    ``MULTI``/``EXEC``: one instant for all, and no bytes through Lua (a read script
    copies the value into a Lua string and back, about 1 us per KB on the server). None
    for a variable whose copy is missing or not at its version (written by an older
    qps), or whose meta lacks ``ver`` (deleted, or corrupt): read it with the script,
    which tells them apart. All None on an error reply (a key of the wrong type: the
    script's read names it).

    Raises:
        UnavailableError: the server cannot be reached.
    """
    client = variables[0]._client
    assert client is not None
    try:
        replies = await client.run_transaction(_current_commands(variables))
    except InternalError:
        return [None] * len(variables)
    return _current_values(variables, replies)


def _current_commands(variables: Sequence[Variable]) -> list[tuple[Any, ...]]:
    """The commands of :func:`_read_current`, to run inside one ``MULTI``/``EXEC``."""
    reads: list[tuple[Any, ...]] = []
    for v in variables:
        reads.append((b"HMGET", v._meta, b"ver", b"curver"))
        reads.append((b"GET", v._prefix + "cur"))
    return reads


def _current_values(
    variables: Sequence[Variable], replies: Sequence[Any]
) -> list[VariableValue | None]:
    """The values of :func:`_read_current` from the replies to its reads."""
    out: list[VariableValue | None] = []
    for k, v in enumerate(variables):
        (ver, curver), data = replies[2 * k], replies[2 * k + 1]
        if ver is None or data is None or curver != ver or len(data) != v.nbytes + CUR_SUFFIX:
            out.append(None)  # not current: read the segment (read_many)
            continue
        version = v._count(ver)
        if data[-CUR_SUFFIX:] != b"%016x" % version:
            out.append(None)  # not a copy qps wrote: read the segment
            continue
        value = bytearray(memoryview(data)[:-CUR_SUFFIX])
        out.append(VariableValue(v._array(value), version))
    return out


#: the copy ``<V>cur`` of a small value ends with its version, 16 hex digits
CUR_SUFFIX = 16


class ReadPlan:
    """A read of several small variables of one client on a single server, as plain
    commands that a caller sends in a round trip of its own (e.g. after a dequeue, to
    read the parameters the moment a token arrives: :meth:`qps.queues.FIFOQueue.dequeue_then`).

    :attr:`commands` are one ``MULTI``/``EXEC`` (an exact snapshot of all of them);
    :meth:`values` turns their replies into the values, or None when a copy was not
    current (written by an older qps) or a reply was an error: then read them again
    with :func:`read_many`."""

    def __init__(self, variables: Sequence[Variable]) -> None:
        self.variables = list(variables)
        self.commands: list[tuple[Any, ...]] = [
            (b"MULTI",),
            *_current_commands(self.variables),
            (b"EXEC",),
        ]

    def values(self, replies: Sequence[Any]) -> list[VariableValue] | None:
        """The values from the replies to :attr:`commands` (all of them, in order)."""
        done = replies[-1] if len(replies) == len(self.commands) else None
        if not isinstance(done, list) or len(done) != 2 * len(self.variables):
            return None
        if any(isinstance(r, BaseException) for r in (*replies, *done)):
            return None
        try:
            got = _current_values(self.variables, done)
        except (TypeError, ValueError):  # not the replies of these commands
            return None
        return None if any(v is None for v in got) else [v for v in got if v is not None]


def read_plan(variables: Sequence[Variable]) -> ReadPlan | None:
    """A :class:`ReadPlan` for ``variables``, or None where :func:`read_many` must read
    them: one not opened or not small, several clients, or a Redis Cluster."""
    if not variables or not all(v._opened and v.small for v in variables):
        return None
    client = variables[0]._client
    if client is None or client.cluster or not all(v._client is client for v in variables):
        return None
    return ReadPlan(variables)


# -- one variable ---------------------------------------------------------------------


async def read_state(v: Variable, client: Client) -> VariableState:
    """The value, its version, the stored optimizer slots and ``t``, as one snapshot
    (the owning PS shard loads them when it starts; others may call it too).

    Raises:
        NotFoundError: the variable was deleted (its container reset).
        AbortedError: no consistent read (a writer committing faster than a read).
    """
    fields = ("gen", "ver", "sgen", "slots", "t")
    for _ in range(FALLBACK_ATTEMPTS):
        ptr = await client.hmget(v._meta, fields)
        if ptr[0] is None:
            raise await v._missing("gen")
        names = [n for n in text(ptr[3]).split(",") if n]
        if names and not ptr[2]:
            raise varcheck.field_error(v._meta, "sgen", ptr[2], "a generation id")
        batch = queue_chunks(v, client.batch(transaction=True), ptr[0])
        for n in names:
            for seg, lo, hi in v._layout.chunks():
                batch.getrange(v._slot_seg(ptr[2] or "", n, seg), lo, hi)
        replies = await batch.hmget(v._meta, fields).run()
        if replies[-1] != ptr:
            continue
        per = len(v._layout.chunks())
        where = [functools.partial(v._seg, ptr[0])]
        where += [functools.partial(v._slot_seg, ptr[2] or "", n) for n in names]
        arrays = [
            v._array(assembled(v, replies[k * per : (k + 1) * per], key))
            for k, key in enumerate(where)
        ]
        value, slots = arrays[0], dict(zip(names, arrays[1:]))
        return VariableState(value, v._count(ptr[1]), slots, v._count(ptr[4] or 0, "t"))
    raise AbortedError(f"{v._where()}: no consistent read of its state")


def assemble(v: Variable, parts: Sequence[bytes]) -> bytearray | None:
    """The chunks in one buffer; None if one is short (its key expired or was
    deleted meanwhile)."""
    buf = bytearray(v.nbytes)
    view = memoryview(buf)
    at = 0
    for (_, lo, hi), part in zip(v._layout.chunks(), parts, strict=True):
        if len(part) != hi - lo + 1:
            return None
        view[at : at + len(part)] = part
        at += len(part)
    return buf


def assembled(v: Variable, parts: Sequence[bytes], key: Callable[[int], str]) -> bytearray:
    """:meth:`_assemble` of chunks read atomically from a current generation, whose
    segment ``i`` is ``key(i)``: a short one is corrupt."""
    buf = assemble(v, parts)
    if buf is None:
        chunks = zip(v._layout.chunks(), parts, strict=True)
        seg = next(i for (i, lo, hi), part in chunks if len(part) != hi - lo + 1)
        raise varcheck.short(v._where(), key(seg))
    return buf


#: the meta fields of the current and the previous generation
_POINTER = ("gen", "ver", "prev", "pver")


def queue_chunks(v: Variable, batch: Batch, gen: bytes | str) -> Batch:
    for seg, lo, hi in v._layout.chunks():
        batch.getrange(v._seg(gen, seg), lo, hi)
    return batch


async def pointer(v: Variable, client: Client) -> tuple[Any, Any]:
    """The current generation and version."""
    gen, ver = await client.hmget(v._meta, ("gen", "ver"))
    if gen is None:
        raise await v._missing("gen")
    return gen, ver


async def read_lean(
    v: Variable, client: Client, gen: Any, ver: Any
) -> tuple[bool, VariableValue | None]:
    """Generation ``gen`` as it was at version ``ver``, read without locks: every
    segment ``GET`` straight into its place in one buffer from the pool, then the
    pointer read again (a round trip of its own, after the data). ``(False, None)`` if
    the client has no lean connections, ``(True, None)`` if a writer changed or removed
    the generation meanwhile."""
    lay = v._layout
    buf = buffers.take(v.nbytes)
    targets, at = [], 0
    for i in range(lay.nseg):
        size = lay.segment_size(i)
        targets.append(buf[at : at + size])
        at += size
    lengths = await client.read_into([v._seg(gen, i) for i in range(lay.nseg)], targets)
    if lengths is None:
        return False, None
    now = await client.hmget(v._meta, _POINTER)
    if now[0] is None:
        raise await v._missing("gen")
    intact = _unchanged(now, gen, ver)
    if not intact or any(n is None or n < 0 for n in lengths):
        return True, None
    value = np.frombuffer(buf, v.dtype).reshape(v.shape)
    return True, VariableValue(value, v._count(ver))


async def read_atomic(v: Variable, client: Client) -> VariableValue:
    """The fallback: learn the generation, then read it inside MULTI/EXEC."""
    for _ in range(FALLBACK_ATTEMPTS):
        gen = await client.hget(v._meta, "gen")
        if gen is None:
            raise await v._missing("gen")
        batch = client.batch(transaction=True).hmget(v._meta, _POINTER)
        replies = await queue_chunks(v, batch, gen).run()
        now = replies[0]
        buf: bytearray | None
        if now[0] == gen:  # current, read atomically: a short chunk is corrupt
            ver = now[1]
            buf = assembled(v, replies[1:], functools.partial(v._seg, gen))
        elif now[2] == gen:  # flipped once since: kept, untouched, at pver (or expired)
            ver = now[3]
            buf = assemble(v, replies[1:])
        elif now[0] is None:
            raise await v._missing("gen")
        else:
            continue
        if buf is not None:
            return VariableValue(v._array(buf), v._count(ver))
    raise AbortedError(
        f"{v._where()}: no consistent read in {FALLBACK_ATTEMPTS} attempts; its "
        "writer publishes faster than a read completes"
    )


async def read_rows(v: Variable, client: Client, idx: npt.NDArray[Any]) -> VariableValue:
    """Rows ``idx`` of ``v`` (:meth:`~qps.variables.Variable.read_rows`): runs of
    consecutive rows (and rows at most :data:`GAP_BYTES` apart) are one ``GETRANGE``;
    one script reads up to :data:`ROWS_BATCH_BYTES` atomically; the batches must agree
    on the version (READ_ATTEMPTS tries, then all of them inside ``MULTI``/``EXEC``)."""
    row_shape = v.shape[1:]
    lay = v._layout
    rb = lay.row_bytes
    flat = idx.reshape(-1)
    if flat.size == 0 or rb == 0:
        return VariableValue(np.zeros(idx.shape + row_shape, v.dtype), await v.version())
    uniq, inverse = np.unique(flat, return_inverse=True)
    runs = row_runs(uniq, lay.seg_rows, GAP_BYTES // rb)
    batches = split_runs(runs, max(1, ROWS_BATCH_BYTES // rb))
    args: list[list[Any]] = [[ranges_arg(lay, s, c, -1)] for s, c in batches]
    meta = [v._meta]
    replies: list[Any] = []
    for attempt in range(READ_ATTEMPTS + 1):
        if attempt == READ_ATTEMPTS and len(args) > 1:  # one snapshot: MULTI/EXEC
            source = client._script(READ_SCRIPT).source
            replies = await client.run_transaction([("EVAL", source, 1, *meta, *a) for a in args])
        else:  # the scripts of the batches pipeline on one connection
            runs_of = (client.run_script(READ_SCRIPT, meta, a) for a in args)
            replies = list(await asyncio.gather(*runs_of))
        if any(text(r[0]) != "ok" for r in replies):
            raise await v._missing("gen")
        if len({(r[1], r[2]) for r in replies}) == 1:
            break
    data = b"".join(part for r in replies for part in r[3:])
    if len(data) != int(runs.counts.sum()) * rb:  # a run short in its atomic read
        raise short_run(v, args, replies)
    table = np.frombuffer(data, dtype=v.dtype).reshape((-1, *row_shape))
    out = table[runs.pos[inverse.reshape(-1)]].reshape(idx.shape + row_shape)
    return VariableValue(out, v._count(replies[0][1]))


def short_run(v: Variable, args: list[list[Any]], replies: list[Any]) -> DataLossError:
    """The error naming the segment of the first run of ``read_rows`` that came
    back short (``args``: each script's runs, ``replies``: its replies)."""
    for (ranges,), r in zip(args, replies):
        for run, part in zip(ranges.split(","), r[3:]):
            seg, lo, hi = (int(x) for x in run.split())
            if len(part) != hi - lo + 1:
                return varcheck.short(v._where(), v._seg(r[2], seg))
    raise AssertionError("no short run")


async def read_small(v: Variable, client: Client) -> VariableValue:
    """A small value and its version, read by one script (on Redis Cluster, or when
    the copy that :func:`read_many` reads is not current)."""
    whole = "0 0 -1" if v._layout.nseg else ""
    reply = await client.run_script(READ_SCRIPT, [v._meta], [whole])
    if text(reply[0]) != "ok":
        raise await v._missing("gen")
    key = v._seg(reply[2], 0)
    data = reply[3] if len(reply) > 3 else b""
    if not data and v.nbytes:  # a missing segment reads as ""
        raise varcheck.short(v._where(), key)
    return VariableValue(v._array(data, key), v._count(reply[1]))


async def read_large(v: Variable, client: Client, lean: bool) -> VariableValue:
    """A value of several segments, or over 1 MiB: lock-free where ``lean``
    (:func:`read_lean`, :data:`READ_ATTEMPTS` times), then inside ``MULTI``/``EXEC``."""
    if lean:
        for _ in range(READ_ATTEMPTS):
            done, got = await read_lean(v, client, *await pointer(v, client))
            if not done:  # no lean connections (fakeredis): read atomically
                break
            if got is not None:
                return got
    return await read_atomic(v, client)


def _unchanged(now: Sequence[Any], gen: Any, ver: Any) -> bool:
    """Whether generation ``gen``, seen current at version ``ver``, is untouched since:
    still current at ``ver``, or retired (once) at ``ver`` (``now``: the meta's ``gen
    ver prev pver``, read after the data)."""
    return bool((now[0] == gen and now[1] == ver) or (now[2] == gen and now[3] == ver))

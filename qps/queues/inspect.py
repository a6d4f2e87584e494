"""Reading a queue without changing it, by name: stats, stored elements, listing and
deleting (used by the CLI and by the queue objects' ``stats``/``peek``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qps import keys
from qps.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    QpsError,
    UnavailableError,
)
from qps.queues.large import (
    BATCH_ENTRY,
    REF,
    chunk_keys,
    parse_batch_entry,
    parse_ref,
    read_batch_rows,
)
from qps.queues.spec import QueueSpec
from qps.queues.state import (
    DW_ENTRY,
    EW_ENTRY,
    check_meta,
    corrupt,
    count,
    failed_read,
    size_of_replies,
    size_reads,
)
from qps.transport import Client

#: bytes in front of each stored element of a priority queue: an 8-byte order-preserving
#: priority and a 16-byte sequence number (see qps/lua/queue_common.lua)
PRIORITY_KEY_BYTES = 24


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of a queue, read without changing it.

    Attributes:
        name, container: where it lives.
        spec: its :class:`QueueSpec`.
        size: stored elements (elements held by pending dequeues not counted, as in TF).
        closed: whether ``close`` has taken effect.
        enqueued_total / dequeued_total: elements ever inserted / delivered.
        pending_enqueues / pending_dequeues: blocked attempts (callers waiting).
        held: elements taken by pending dequeues that are still collecting a batch.
        pending_close: a ``close()`` waits behind earlier enqueues.
        dead_letters: elements that failed to decode and were set aside.
    """

    name: str
    container: str
    spec: QueueSpec
    size: int
    closed: bool
    enqueued_total: int
    dequeued_total: int
    pending_enqueues: int
    pending_dequeues: int
    held: int
    pending_close: bool
    dead_letters: int

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "spec"}
        d.update(self.spec.describe())
        return d


async def queue_stats(
    client: Client, name: str, container: str = keys.DEFAULT_CONTAINER
) -> QueueStats:
    """Read a queue's :class:`QueueStats` by name.

    Raises:
        NotFoundError: no such queue in ``container``.
    """
    prefix = keys.queue_prefix(container, name)
    batch = client.batch().hgetall(prefix + "meta")
    batch.lrange(prefix + "ew", 0, -1).lrange(prefix + "dw", 0, -1).llen(prefix + "dlq")
    replies = await batch.run(raise_on_error=False)
    for part, r in zip(("meta", "ew", "dw", "dlq"), replies):
        if isinstance(r, BaseException):
            failed_read(prefix + part, r)
    meta, ew, dw, dlq = replies
    if not meta:
        raise NotFoundError(f"no queue '{name}' in container '{container}'")
    spec = check_meta(meta, prefix + "meta")
    for e in ew:
        if not EW_ENTRY.fullmatch(e):
            raise corrupt(prefix + "ew", f"holds {bytes(e[:60])!r}, not an attempt entry")
    ids = []
    for e in dw:
        if not DW_ENTRY.fullmatch(e):
            raise corrupt(prefix + "dw", f"holds {bytes(e[:60])!r}, not an attempt entry")
        ids.append(e.decode().rsplit("|", 1)[1])
    reads = size_reads(spec.kind, prefix)
    batch = client.batch(transaction=True)
    for command in reads:
        batch.command(*command)
    for i in ids:
        batch.lrange(f"{prefix}a:{i}:h", 0, -1)
    got = await batch.run(raise_on_error=False)
    size = size_of_replies(got[: len(reads)], spec.kind, prefix)
    held = 0
    for i, h in zip(ids, got[len(reads) :]):
        if isinstance(h, BaseException):
            failed_read(f"{prefix}a:{i}:h", h)
        held += elements(h)
    return QueueStats(
        name=name,
        container=container,
        spec=spec,
        size=size,
        closed=meta.get(b"closed") == b"1",
        enqueued_total=count(meta.get(b"enq"), prefix + "meta", "enq"),
        dequeued_total=count(meta.get(b"deq"), prefix + "meta", "deq"),
        pending_enqueues=sum(1 for e in ew if e.startswith(b"e|")),
        pending_dequeues=len(dw),
        held=held,
        pending_close=any(e.startswith(b"c|") for e in ew),
        dead_letters=int(dlq),
    )


async def list_queue_bytes(
    client: Client, name: str, container: str = keys.DEFAULT_CONTAINER
) -> tuple[int, int]:
    """``(stored, pending)``: the bytes of the elements a FIFO or padding queue stores
    (an element stored out of line counts the bytes it stands for, not its reference),
    and of the elements its blocked enqueues wait to insert (they are in Redis too).
    One script on the server; it reads the stored values (bounded by the capacity), so
    it is meant for status commands, not hot paths. A queue that does not exist: (0, 0).
    """
    prefix = keys.queue_prefix(container, name)
    got = await client.run_script("queues/list_bytes", [prefix + "items", prefix + "ew"], [])
    return int(got[0]), int(got[1])


@dataclass(frozen=True)
class StoredElement:
    """A stored element's bytes as :func:`peek_blobs` read them.

    Attributes:
        blob: the element's encoded bytes (a large element's chunks joined), or the raw
            reference when its chunks cannot be read.
        chunks: how many chunks a large element was stored in (0: stored inline).
        error: why a large element could not be assembled, else None.
    """

    blob: bytes
    chunks: int = 0
    error: str | None = None


async def _assemble(client: Client, prefix: str, ref: bytes) -> StoredElement:
    """Read a large element's chunks, leaving them in place, and join them."""
    parsed = parse_ref(ref)
    if parsed is None:
        return StoredElement(ref)
    bid, nchunks, nbytes = parsed
    parts = await client.mget(chunk_keys(prefix, bid, nchunks))
    found = [as_bytes(p) for p in parts if p is not None]
    if len(found) != nchunks:
        return StoredElement(ref, nchunks, "a large element whose chunks are missing")
    blob = b"".join(found)
    if len(blob) != nbytes:
        why = f"a large element of {len(blob)} bytes, {nbytes} expected"
        return StoredElement(ref, nchunks, why)
    return StoredElement(blob, nchunks)


async def peek_blobs(client: Client, name: str, container: str, k: int) -> list[StoredElement]:
    """Up to ``k`` stored elements' bytes (large ones assembled), changing nothing.

    FIFO, padding and priority queues give the next ``k`` out (a priority queue's sort
    keys removed); a shuffle queue gives ``k`` of its elements (which one leaves next is
    drawn at dequeue time).

    Raises:
        NotFoundError: no such queue in ``container``.
    """
    prefix = keys.queue_prefix(container, name)
    (meta,) = await client.batch().hgetall(prefix + "meta").run(raise_on_error=False)
    if isinstance(meta, BaseException):
        failed_read(prefix + "meta", meta)
    if not meta:
        raise NotFoundError(f"no queue '{name}' in container '{container}'")
    kind = check_meta(meta, prefix + "meta").kind.encode()
    if k <= 0:
        return []
    try:
        if kind == b"shuffle":
            n = count(meta.get(b"n"), prefix + "meta", "n")
            fields = list(range(min(k, n)))
            got = await client.hmget(prefix + "items", fields) if fields else []
            raw = [as_bytes(b) for b in got if b is not None]
        elif kind == b"priority":
            members = await client.zrange(prefix + "items", 0, k - 1)
            raw = [as_bytes(b)[PRIORITY_KEY_BYTES:] for b in members]
        else:
            raw = [as_bytes(b) for b in await client.lrange(prefix + "items", 0, k - 1)]
        # reads only: nothing released; a batch entry gives all of its rows
        rows = (await read_batch_rows(client, prefix, list(raw)))[:k]
    except InternalError as exc:  # a key of the wrong type
        raise corrupt(prefix + "items", f"its elements cannot be read ({exc})") from exc
    return [
        await _assemble(client, prefix, bytes(r)) if r[:3] == REF else StoredElement(bytes(r))
        for r in rows
    ]


async def list_queues(client: Client, container: str = keys.DEFAULT_CONTAINER) -> list[str]:
    """Names of the queues registered in ``container``, sorted.

    Raises:
        DataLossError: the registry is not a set (the key named).
    """
    key = keys.container_queues(container)
    (names,) = await client.batch().smembers(key).run(raise_on_error=False)
    if isinstance(names, BaseException):
        failed_read(key, names, "cannot be read as a set of queue names")
    return sorted(
        n.decode(errors="backslashreplace") if isinstance(n, bytes) else str(n) for n in names
    )


@dataclass(frozen=True)
class BrokenQueue:
    """A registered queue whose state cannot be read (see :func:`scan_queues`).

    Attributes:
        name, container: where it lives.
        error: what is wrong, naming the key.
    """

    name: str
    container: str
    error: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "container": self.container, "broken": self.error}


async def scan_queues(
    client: Client, container: str = keys.DEFAULT_CONTAINER
) -> list[QueueStats | BrokenQueue]:
    """The :class:`QueueStats` of every queue registered in ``container``, in name
    order; a queue whose state is corrupt (or whose registered name is not a valid
    one) is listed as a :class:`BrokenQueue` instead of failing the whole listing.
    Queues deleted since they were listed are left out."""
    out: list[QueueStats | BrokenQueue] = []
    for name in await list_queues(client, container):
        try:
            keys.check_name(name)
            out.append(await queue_stats(client, name, container))
        except NotFoundError:  # deleted between the listing and now
            continue
        except InvalidArgumentError as exc:
            out.append(BrokenQueue(name, container, f"registered under an invalid name: {exc}"))
        except QpsError as exc:
            if isinstance(exc, UnavailableError):
                raise
            out.append(BrokenQueue(name, container, str(exc)))
    return out


async def delete_queue(client: Client, name: str, container: str = keys.DEFAULT_CONTAINER) -> int:
    """Delete every key of a queue (pending attempts included); returns keys deleted."""
    prefix = keys.queue_prefix(container, name)
    found = [k async for k in client.scan(_glob_escape(prefix) + "*", 500)]
    n = 0
    for i in range(0, len(found), 500):
        n += await client.delete(*found[i : i + 500])
    await client.srem(keys.container_queues(container), name)
    return n


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def elements(values: list[bytes]) -> int:
    """How many elements stored values stand for (a batch entry: its rows)."""
    n = len(values)
    for v in values:
        if v[:3] == BATCH_ENTRY and (entry := parse_batch_entry(bytes(v))) is not None:
            n += entry[2] - 1
    return n


def as_bytes(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()

"""Large elements and large batches out of line (docs/queues.md, "Large elements").

An element larger than CHUNK_BYTES is written as chunk keys ``<prefix>b:<bid>:<k>`` with
plain commands, and the queue holds a small reference ``QR|<bid>|<nchunks>|<bytes>``. The
Lua scripts keep the chunks' TTLs right (stored, pending and held chunks never expire;
delivered ones expire unless the consumer deletes them first, which it does at once).

An ``enqueue_many`` of fixed-shape rows of at least BATCH_MIN_BYTES is written as one
buffer ``<prefix>b:<bid>`` (plain ``SET``): the rows' bytes never pass through Lua. A
list queue (FIFO, padding) holds one *batch entry* ``QB|<bid>|<first row>|<rows>|<row
bytes>`` standing for a run of rows (the scripts split it when only some rows leave); a
shuffle or priority queue, whose elements leave one by one, holds one reference per row,
``QS|<bid>|<row>|<row bytes>``. ``b:<bid>:u`` counts the rows not yet read; a consumer
reads its rows with ``GETRANGE`` (consecutive rows in one range) and then runs the
``release`` script, which deletes the buffer with the last row. Rows that are never
stored are released by the scripts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from qps import buffers, wire
from qps.errors import InternalError, InvalidArgumentError
from qps.resp import STREAM_SLICE, Pieces
from qps.transport import Client, write_all

#: Elements larger than this travel out of line, as chunks of this size (measured:
#: about 2x faster than one large value through redis-py and hiredis).
CHUNK_BYTES = 1 << 20
#: Chunks written by a producer expire unless their element gets into the queue.
CHUNK_TTL_MS = 600_000
REF = b"QR|"
BATCH_REF = b"QS|"
BATCH_ENTRY = b"QB|"
#: enqueue_many batches of fixed-shape rows at least this large travel as one buffer
BATCH_MIN_BYTES = 64 << 10
#: What an enqueue writes ahead of its script, on a connection of its own, a slice at a
#: time (a batch's buffer, or elements out of line) once it comes to this many bytes:
#: the client then holds no copy of it (docs/queues.md, "Sizes and memory"); smaller
#: ones go in the script's round trip. A batch this large travels as one buffer even
#: where the queue's shapes are not all known (its rows are alike all the same).
STREAM_MIN_BYTES = 4 << 20
#: A batch's rows go in buffers of at most this many bytes: Redis refuses values over
#: proto-max-bulk-len (512 MB by default), and a consumer reads a buffer whole (through
#: hiredis, which holds a copy of it while it builds the reply).
BATCH_BUFFER_MAX_BYTES = 32 << 20
#: One element larger than this (up to CHUNK_BYTES) enqueued on a list queue is stored
#: out of line in one chunk, written in the enqueue script's round trip: its bytes never
#: pass through Lua (a Lua string of tens of KB costs about 1.2 µs per KB of server
#: time: a script that only pushes a 38 KB argument took ~50 µs, against 4 µs with 100
#: bytes), and the dequeue that takes it reads it in its own round trip (taken_chunk).
ONE_CHUNK_MIN_BYTES = 16 << 10


def is_ref(blob: Any) -> bool:
    """Whether a stored value is a reference to bytes stored out of line."""
    tag = blob[:3]
    return bool(tag in (REF, BATCH_REF, BATCH_ENTRY))


#: The most bytes one value of Redis holds (its proto-max-bulk-len): a bound on what a
#: reference may claim to stand for.
MAX_VALUE_BYTES = 512 << 20
_DIGITS = rb"([0-9]{1,12})"
_QB = re.compile(rb"QB\|([^|]+)\|" + _DIGITS + rb"\|" + _DIGITS + rb"\|" + _DIGITS)
_QS = re.compile(rb"QS\|([^|]+)\|" + _DIGITS + rb"\|" + _DIGITS)
_QR = re.compile(rb"QR\|([^|]+)\|" + _DIGITS + rb"\|" + _DIGITS)


def parse_batch_entry(entry: bytes) -> tuple[str, int, int, int] | None:
    """``(bid, first row, rows, row bytes)`` of a batch entry, or None if not a
    well-formed one (digits only, as the scripts read it; rows that fit one value)."""
    m = _QB.fullmatch(entry)
    if m is None:
        return None
    first, rows, size = int(m[2]), int(m[3]), int(m[4])
    if rows < 1 or size < 1 or (first + rows) * size > MAX_VALUE_BYTES:
        return None
    return m[1].decode("ascii", "replace"), first, rows, size


def parse_batch_ref(ref: bytes) -> tuple[str, int, int] | None:
    """``(bid, row, row bytes)`` of a batch-row reference, or None if ``ref`` is not a
    well-formed one."""
    m = _QS.fullmatch(ref)
    if m is None:
        return None
    row, size = int(m[2]), int(m[3])
    if size < 1 or (row + 1) * size > MAX_VALUE_BYTES:
        return None
    return m[1].decode("ascii", "replace"), row, size


def batch_key(prefix: str, bid: str) -> str:
    return f"{prefix}b:{bid}"


def batch_commands(
    prefix: str, aid: str, buffer: Any, rows: int, entry: bool = False
) -> tuple[list[bytes], list[tuple[Any, ...]]]:
    """The values that stand for the rows of ``buffer`` (``rows`` equal rows,
    C-contiguous) stored as one value, and the commands that store it (to run before the
    enqueue script, in the same round trip). ``entry``: one batch entry for all rows (a
    list queue), else one reference per row.

    :class:`wire.EncodedRows` over BATCH_BUFFER_MAX_BYTES are stored as several values
    (buffers ``<aid>``, ``<aid>-1``, ...: a value of Redis is 512 MB at most), each with
    its entry (its references), made a window at a time as they are sent."""
    if isinstance(buffer, wire.EncodedRows):
        size = buffer.row_bytes
        per = max(1, BATCH_BUFFER_MAX_BYTES // size)
        groups: list[tuple[str, int, Any]] = [
            (
                f"{aid}-{start // per}" if start else aid,
                min(per, rows - start),
                Pieces(min(per, rows - start) * size, buffer.windows(STREAM_SLICE, start, per)),
            )
            for start in range(0, rows, per)
        ]
    else:
        view = memoryview(buffer).cast("B")
        size = view.nbytes // rows
        groups = [(aid, rows, view)]
    values: list[bytes] = []
    writes: list[tuple[Any, ...]] = []
    for bid, count, value in groups:
        key = batch_key(prefix, bid)
        writes.append((b"SET", key, value, b"PX", CHUNK_TTL_MS))
        writes.append((b"SET", key + ":u", count, b"PX", CHUNK_TTL_MS))
        if entry:
            values.append(f"QB|{bid}|0|{count}|{size}".encode())
        else:
            head, tail = f"QS|{bid}|".encode(), f"|{size}".encode()
            values.extend([b"%s%d%s" % (head, i, tail) for i in range(count)])
    return values, writes


def rows_buffer(blobs: Sequence[Any]) -> Any:
    """The one buffer holding ``blobs`` when they are the rows :func:`wire.encode_rows`
    made of a batch large enough to travel as one value, else None."""
    if isinstance(blobs, wire.EncodedRows):  # a large batch's, encoded as it is sent
        return blobs
    if len(blobs) < 2 or not isinstance(blobs[0], memoryview):
        return None
    size = blobs[0].nbytes
    base = blobs[0].obj
    if (
        size > CHUNK_BYTES
        or size * len(blobs) < BATCH_MIN_BYTES
        or not isinstance(base, np.ndarray)
        or base.nbytes != size * len(blobs)
        or not base.flags.c_contiguous
    ):
        return None
    return base


async def stage_batch(
    client: Client, prefix: str, aid: str, buffer: Any, rows: int, entry: bool = False
) -> tuple[list[bytes], list[tuple[Any, ...]]]:
    """:func:`batch_commands`, but a buffer of STREAM_MIN_BYTES or more is written now,
    streamed (its commands are then done: [])."""
    values, commands = batch_commands(prefix, aid, buffer, rows, entry)
    if nbytes(buffer) < STREAM_MIN_BYTES:
        return values, commands
    await write_all(client, commands)
    return values, []


def encode_batch(arrays: list[np.ndarray], batch: int, dtypes: Any, shapes: Any | None) -> Any:
    """The elements of an enqueue_many's batch (``batch`` rows; ``shapes`` None: not
    all known), as :meth:`QueueBase._enqueue_blobs` takes them: the rows of one
    buffer (:func:`wire.encode_rows`; made as they are sent for STREAM_MIN_BYTES or
    more), or one value per element: its bytes, or its parts (no copy) where it will
    go out of line in chunks (see :func:`store_large`). A sequence, or the
    :class:`wire.EncodedRows` of a large batch (taken by :func:`rows_buffer`)."""
    if shapes is not None:
        rows = wire.encode_rows_lazily(arrays, dtypes, shapes)
        if rows.row_bytes <= CHUNK_BYTES:
            return rows if rows.nbytes >= STREAM_MIN_BYTES else rows.messages()
    else:
        total = sum(a.nbytes for a in arrays)
        if total // batch <= CHUNK_BYTES:
            if total < STREAM_MIN_BYTES:
                return [wire.encode([a[i] for a in arrays]) for i in range(batch)]
            # the rows of a dense batch are alike: their own spec
            spec = [a.dtype for a in arrays], [a.shape[1:] for a in arrays]
            return wire.encode_rows_lazily(arrays, *spec)
    return [_parts([a[i] for a in arrays]) for i in range(batch)]


def one_chunk(prefix: str, aid: str, blob: Any) -> tuple[bytes, tuple[Any, ...]]:
    """The reference that stands for ``blob`` stored in one chunk, and the command that
    stores it (to run before the enqueue script, in the same round trip)."""
    bid = f"{aid}.0"
    ref = f"QR|{bid}|1|{nbytes(blob)}".encode()
    return ref, (b"SET", chunk_keys(prefix, bid, 1)[0], blob, b"PX", CHUNK_TTL_MS)


def chunk_of(prefix: str, aid: str) -> str:
    """The key a one-chunk element takes when attempt ``aid`` takes it (its chunk is
    renamed after the attempt: fast_take_chunk in fast_common.lua)."""
    return chunk_keys(prefix, aid, 1)[0]


def taken_chunk(aid: str, blobs: list[Any], data: Any) -> list[Any] | None:
    """The element of a delivery of one one-chunk reference renamed after attempt
    ``aid``, whose chunk ``data`` was read in the same round trip; None otherwise."""
    if not isinstance(data, bytes) or len(blobs) != 1 or blobs[0][:3] != REF:
        return None
    ref = parse_ref(bytes(blobs[0]))
    if ref is None or ref != (aid, 1, len(data)):
        return None
    return [data]


#: a run of consecutive rows of one buffer (see :func:`batch_runs`)
Run = tuple[str, int, int, int, list[int]]


def _one_run(blobs: Sequence[Any]) -> Run | None:
    """The common case of :func:`batch_runs`: every value is a reference and together
    they are consecutive rows of one buffer (checked exactly, in C-speed comparisons)."""
    first, last = blobs[0], blobs[-1]
    if first[:3] != BATCH_REF or last[:3] != BATCH_REF:
        return None
    a, b = parse_batch_ref(bytes(first)), parse_batch_ref(bytes(last))
    if a is None or b is None or a[0] != b[0] or a[2] != b[2] or b[1] - a[1] + 1 != len(blobs):
        return None
    bid, row, size = a
    head, tail = f"QS|{bid}|".encode(), f"|{size}".encode()
    want = [b"%s%d%s" % (head, i, tail) for i in range(row, row + len(blobs))]
    if [bytes(x) for x in blobs] != want:
        return None
    return bid, row, len(blobs), size, list(range(len(blobs)))


def batch_runs(blobs: Sequence[Any]) -> list[Run]:
    """Group the batch rows among ``blobs`` into runs of consecutive rows of one buffer:
    ``(bid, first row, row count, row bytes, positions in blobs)``. A batch entry is a
    run of its own, at one position (rows 1:1 with positions otherwise)."""
    if len(blobs) == 1 and blobs[0][:3] == BATCH_ENTRY:
        entry = parse_batch_entry(bytes(blobs[0]))
        return [] if entry is None else [(entry[0], entry[1], entry[2], entry[3], [0])]
    if blobs and (one := _one_run(blobs)) is not None:
        return [one]
    runs: list[Run] = []
    for pos, blob in enumerate(blobs):
        tag = blob[:3]
        if tag == BATCH_ENTRY:
            entry = parse_batch_entry(bytes(blob))
            if entry is not None:
                runs.append((entry[0], entry[1], entry[2], entry[3], [pos]))
            continue
        if tag != BATCH_REF:
            continue
        parsed = parse_batch_ref(bytes(blob))
        if parsed is None:
            continue
        bid, row, size = parsed
        if runs:
            rbid, first, count, rsize, where = runs[-1]
            if rbid == bid and rsize == size and first + count == row:
                where.append(pos)
                runs[-1] = (rbid, first, count + 1, rsize, where)
                continue
        runs.append((bid, row, 1, size, [pos]))
    return runs


def read_commands(prefix: str, runs: list[Run]) -> list[Any]:
    """One GETRANGE per run of rows (see :func:`batch_runs`)."""
    return [
        (b"GETRANGE", batch_key(prefix, bid), first * size, (first + count) * size - 1)
        for bid, first, count, size, _ in runs
    ]


def _rows_at(runs: list[Run], datas: list[Any]) -> dict[int, list[Any]]:
    """Position in the blobs -> the rows read for the value there (one row for a
    reference, all its rows for a batch entry); values whose buffer is missing or
    short are left out."""
    at: dict[int, list[Any]] = {}
    for (_, _, count, size, where), data in zip(runs, datas):
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) != count * size:
            continue
        view = memoryview(data)
        if len(where) == count:
            for k, pos in enumerate(where):
                at[pos] = [view[k * size : (k + 1) * size]]
        else:
            at[where[0]] = [view[k * size : (k + 1) * size] for k in range(count)]
    return at


def place_rows(blobs: list[Any], runs: list[Run], datas: list[Any]) -> list[Any]:
    """``blobs`` with the references and batch entries of ``runs`` replaced by slices of
    ``datas`` (the runs' GETRANGE replies), a batch entry by all of its rows; a value
    whose buffer is missing or short stays."""
    at = _rows_at(runs, datas)
    if not at:
        return list(blobs)
    out: list[Any] = []
    for pos, blob in enumerate(blobs):
        rows = at.get(pos)
        if rows is None:
            out.append(blob)
        else:
            out.extend(rows)
    return out


def handed_rows(aid: str, blobs: list[Any], data: Any) -> tuple[list[Any], Any] | None:
    """The rows of a delivery that took its buffer along (``blobs`` is one batch entry
    of buffer ``aid``, the dequeue's own id, and ``data`` that buffer, read in the same
    round trip): zero-copy slices, and the slice holding them all. None otherwise."""
    if data is None or len(blobs) != 1 or blobs[0][:3] != BATCH_ENTRY:
        return None
    entry = parse_batch_entry(bytes(blobs[0]))
    if entry is None or entry[0] != aid:
        return None
    _, first, rows, size = entry
    if len(data) < (first + rows) * size:
        return None
    view = memoryview(data)[first * size : (first + rows) * size]
    return [view[k * size : (k + 1) * size] for k in range(rows)], view


def inline_rows(
    stored: list[Any], blobs: list[Any], runs: list[Run], datas: list[Any]
) -> list[bytes]:
    """The values to give back for ``stored`` (the delivered values, ``blobs`` the same
    without a priority key in front) once their rows were read and released: each row
    as its own element bytes, behind the key its reference had."""
    at = _rows_at(runs, datas)
    out: list[bytes] = []
    for pos, (s, b) in enumerate(zip(stored, blobs)):
        rows = at.get(pos)
        if rows is None:
            out.append(bytes(s))
        else:
            key = bytes(s[: len(s) - len(b)])
            out.extend(key + bytes(r) for r in rows)
    return out


async def read_batch_rows(client: Client, prefix: str, blobs: list[Any]) -> list[Any]:
    """Replace batch-row references by the rows' bytes (zero-copy slices of one read per
    run of consecutive rows); a reference whose buffer is missing or short stays."""
    runs = batch_runs(blobs)
    if not runs:
        return blobs
    return place_rows(blobs, runs, await client.run_commands(read_commands(prefix, runs)))


def release_args(blobs: Sequence[Any]) -> list[str]:
    """The ``release`` script's tokens for the batch rows among ``blobs``."""
    counts: dict[str, int] = {}
    for bid, _, count, _, _ in batch_runs(blobs):
        counts[bid] = counts.get(bid, 0) + count
    return [f"{bid} {n}" for bid, n in counts.items()]


def parse_ref(ref: bytes) -> tuple[str, int, int] | None:
    """``(bid, nchunks, total bytes)`` of a reference, or None if ``ref`` is not a
    well-formed one: digits only, at least one byte, no more than a message holds, in
    as many chunks of CHUNK_BYTES as it takes (the reader puts chunk k at k *
    CHUNK_BYTES)."""
    m = _QR.fullmatch(ref)
    if m is None:
        return None
    count, total = int(m[2]), int(m[3])
    if not 1 <= total <= wire.MAX_MESSAGE_BYTES or count != -(-total // CHUNK_BYTES):
        return None
    return m[1].decode("ascii", "replace"), count, total


def chunk_keys(prefix: str, bid: str, nchunks: int) -> list[str]:
    """The keys holding the chunks of element ``bid`` (same spelling as the Lua)."""
    return [f"{prefix}b:{bid}:{k}" for k in range(nchunks)]


def is_large(blob: Any) -> bool:
    """Whether an encoded element must travel out of line."""
    return isinstance(blob, list) or nbytes(blob) > CHUNK_BYTES


async def store_large(client: Client, prefix: str, aid: str, blobs: Sequence[Any]) -> Sequence[Any]:
    """Write elements over CHUNK_BYTES as chunk keys, streamed; return the blobs with
    those elements replaced by references (``blobs`` itself when none is large)."""
    if not any(is_large(b) for b in blobs):
        return blobs
    out: list[Any] = []
    writes: list[tuple[Any, ...]] = []
    for i, blob in enumerate(blobs):
        parts = blob if isinstance(blob, list) else [blob]
        total = sum(nbytes(p) for p in parts)
        if total <= CHUNK_BYTES:
            out.append(parts[0] if len(parts) == 1 else b"".join(parts))
            continue
        bid = f"{aid}.{i}"
        chunks = chunks_of(parts, CHUNK_BYTES)
        for key, chunk in zip(chunk_keys(prefix, bid, len(chunks)), chunks):
            writes.append((b"SET", key, chunk, b"PX", CHUNK_TTL_MS))
        out.append(f"QR|{bid}|{len(chunks)}|{total}".encode())
    await write_all(client, writes)
    return out


async def fetch_large(
    client: Client, prefix: str, blobs: list[Any], *, delete: bool = True
) -> list[Any]:
    """Replace references by the elements' bytes, read from their chunks.

    The chunks are deleted (unless ``delete`` is false: an acknowledged dequeue's ack
    deletes them) only once every element is assembled: a caller that fails before
    that can put the references back (``requeue``), chunks intact.
    """
    refs = [(i, r) for i, b in enumerate(blobs) if b[:3] == REF and (r := parse_ref(bytes(b)))]
    if not refs:
        return blobs
    names = [chunk_keys(prefix, bid, nchunks) for _, (bid, nchunks, _) in refs]
    out = list(blobs)
    # Straight into one buffer per element (a lean connection: no copy after the
    # kernel's); buffers from the pool, whose pages are mapped already (qps.buffers).
    bufs = [buffers.take(total) for _, (_, _, total) in refs]
    targets = [
        buf[k * CHUNK_BYTES : min((k + 1) * CHUNK_BYTES, len(buf))]
        for buf, ks in zip(bufs, names)
        for k in range(len(ks))
    ]
    try:
        got = await client.read_into([k for ks in names for k in ks], targets)
    except InternalError:  # a chunk key holds no string: read them one by one below
        got = None
    if got is not None:
        pos = 0
        for (i, _), ks, buf in zip(refs, names, bufs):
            lengths = got[pos : pos + len(ks)]
            pos += len(ks)
            if all(n is not None and n >= 0 for n in lengths):
                out[i] = buf
            # else: left as a reference, reported as missing or corrupt by _split_bad
    else:
        batch = client.batch()
        for key in (key for ks in names for key in ks):
            batch.get(key)
        chunks = await batch.run(raise_on_error=False)
        pos = 0
        for (i, (_, _, total)), ks in zip(refs, names):
            parts = chunks[pos : pos + len(ks)]
            pos += len(ks)
            want = [min(CHUNK_BYTES, total - k * CHUNK_BYTES) for k in range(len(ks))]
            if any(not isinstance(c, bytes) or len(c) != w for c, w in zip(parts, want)):
                continue  # left as a reference: reported as missing or corrupt by _split_bad
            joined = bytearray(total)
            view = memoryview(joined)
            for k, c in enumerate(parts):
                view[k * CHUNK_BYTES : k * CHUNK_BYTES + len(c)] = c
            out[i] = joined
    if delete:
        await client.unlink(*[k for ks in names for k in ks])
    return out


def nbytes(blob: Any) -> int:
    return blob.nbytes if isinstance(blob, (memoryview, Pieces, wire.EncodedRows)) else len(blob)


def encode_element(arrays: list[np.ndarray]) -> Any:
    """One element's bytes; a large one as its parts (header, buffers: no copy)."""
    if sum(a.nbytes for a in arrays) <= CHUNK_BYTES:
        return wire.encode(arrays)
    return _parts(arrays)


def _parts(arrays: list[np.ndarray]) -> list[Any]:
    """One element's message as its parts: header, buffers (no copy where they are
    already C-contiguous little-endian).

    Raises:
        InvalidArgumentError: a message larger than a consumer decodes
            (:data:`wire.MAX_MESSAGE_BYTES`).
    """
    parts = [p if isinstance(p, bytes) else p.cast("B") for p in wire.encode_parts(arrays)]
    size = sum(map(nbytes, parts))
    if size > wire.MAX_MESSAGE_BYTES:
        raise InvalidArgumentError(
            f"an element of {size} bytes encoded is over the {wire.MAX_MESSAGE_BYTES} "
            "bytes a consumer decodes"
        )
    return parts


def chunks_of(parts: list[Any], size: int) -> list[Any]:
    """Cut the concatenation of ``parts`` into pieces of ``size`` bytes, never copying:
    a piece that spans several parts is :class:`~qps.resp.Pieces` of them."""
    out: list[Any] = []
    pending: list[Any] = []
    pending_len = 0
    for part in parts:
        view = memoryview(part).cast("B") if not isinstance(part, memoryview) else part
        while len(view):
            take = min(size - pending_len, len(view))
            pending.append(view[:take])
            pending_len += take
            view = view[take:]
            if pending_len == size:
                out.append(pending[0] if len(pending) == 1 else Pieces(size, pending))
                pending, pending_len = [], 0
    if pending:
        out.append(pending[0] if len(pending) == 1 else Pieces(pending_len, pending))
    return out

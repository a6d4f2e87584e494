"""The memory a client needs for large batches and elements (docs/queues.md, "Sizes and
memory"): an enqueue streams its values to Redis (a large batch encoded a window at a
time, chunks never joined, the transport fed a slice at a time), so it holds no copy of
them; a dequeue_many holds its result and at most one copy of it.

The bounds are checked in fresh interpreters (peak RSS growth over the baseline taken
once the batch is built), against the real server; the rest checks that the streamed
paths deliver the same bytes and keep enqueue_many all-or-nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

import qps
from qps import keys, resp, wire
from qps.queues import large

MIB = 1 << 20

#: What a fresh process may grow by beyond the bound (imports done late, connection
#: buffers, allocator slack).
ALLOWANCE = 64 * MIB

# One process: build the batch (or nothing, for a dequeue), take the baseline, run one
# operation, print the peak RSS growth and a checksum of what it moved.
CHILD = r"""
import asyncio, json, resource, sys
import numpy as np
import qps

url, name, op, kind, rows, row = sys.argv[1:7]
rows, row = int(rows), int(row)

def rss():
    # the peak of this process's own memory: VmHWM (ru_maxrss starts from the RSS of
    # the parent that forked it, pytest's)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024

async def main():
    client = await qps.connect(url)
    shapes = {"fixed": [[row]], "unshaped": None, "element": [[rows, row]]}[kind]
    if name.endswith("shuffle"):
        q = qps.RandomShuffleQueue(-1, 0, np.float32, shapes, shared_name=name, client=client)
    else:
        q = qps.FIFOQueue(-1, np.float32, shapes=shapes, shared_name=name, client=client)
    await q.size()  # the queue's keys and the connections exist before the baseline
    batch = None
    if op == "enqueue":
        batch = np.arange(rows * row, dtype=np.float32).reshape(rows, row)
    base = rss()
    if op == "enqueue" and kind == "element":
        await q.enqueue(batch)
    elif op == "enqueue":
        await q.enqueue_many(batch)
    elif kind == "element":
        batch = await q.dequeue()
    elif kind == "unshaped":
        batch = np.stack([await q.dequeue() for _ in range(rows)])
    else:
        batch = await q.dequeue_many(rows)
    grew = rss() - base
    total = float(batch.astype(np.float64).sum())
    print(json.dumps({"grew": grew, "shape": list(batch.shape), "sum": total}))
    await client.close()

asyncio.run(main())
"""


def run_child(url: str, name: str, op: str, kind: str, rows: int, row: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, url, name, op, kind, str(rows), str(row)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = {
    # the batch, scaled down: rows of 1 MiB, each out of line in chunks
    "rows-out-of-line": ("fixed", 256, 262144),
    # rows of 64 KiB: the batch travels as one buffer
    "batch-buffer": ("fixed", 4096, 16384),
    "batch-buffer-shuffle": ("fixed", 4096, 16384),
    # shapes not known: one value per element, out of line
    "unshaped": ("unshaped", 256, 262144),
    "unshaped-batch-buffer": ("unshaped", 4096, 16384),
    # one element of 256 MiB, in chunks
    "element": ("element", 256, 262144),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_large_enqueue_holds_no_copy_of_its_values(redis_url, case):
    kind, rows, row = CASES[case]
    size = rows * row * 4
    name = f"memory-{case}"
    sent = run_child(redis_url, name, "enqueue", kind, rows, row)
    got = run_child(redis_url, name, "dequeue", kind, rows, row)
    shape = [rows, row]
    assert (got["shape"], got["sum"]) == (shape, sent["sum"])
    # the batch itself is in the baseline; before the streamed writes an enqueue grew by
    # 1.5x (an element) to 2.5x (a batch) its size
    assert sent["grew"] <= size // 2 + ALLOWANCE, (case, sent["grew"] / size)
    if case in ("rows-out-of-line", "element", "batch-buffer"):
        # the result itself, and at most one copy of it (before: 3x for the batch)
        assert size * 0.9 <= got["grew"] <= 2 * size + ALLOWANCE, (case, got["grew"] / size)


# -- the streamed paths deliver the same bytes ---------------------------------------------


def big_batch(rows: int, row: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, row), dtype=np.float32)


@pytest.mark.parametrize(
    "make", [qps.FIFOQueue, qps.RandomShuffleQueue, qps.PriorityQueue, qps.PaddingFIFOQueue]
)
async def test_a_streamed_batch_buffer_round_trips(client, make):
    rows, row = 96, 16384  # 6 MiB: over STREAM_MIN_BYTES, rows of 64 KiB
    assert rows * row * 4 >= large.STREAM_MIN_BYTES
    batch = big_batch(rows, row)
    if make is qps.PriorityQueue:
        q = make(-1, [np.float32], shapes=[[row]], shared_name="streamed", client=client)
        await q.enqueue_many([np.arange(rows, dtype=np.int64), batch])
        prio, got = await q.dequeue_many(rows)
        assert np.array_equal(prio, np.arange(rows))
    else:
        args = (0,) if make is qps.RandomShuffleQueue else ()
        q = make(-1, *args, np.float32, shapes=[[row]], shared_name="streamed", client=client)
        await q.enqueue_many(batch)
        got = await q.dequeue_many(rows)
    if make is qps.RandomShuffleQueue:
        got = got[np.argsort(got[:, 0])]
        batch = batch[np.argsort(batch[:, 0])]
    assert np.array_equal(got, batch)
    assert await q.size() == 0


@pytest.mark.parametrize("row", [262144 + 7, 2048])  # over a chunk: chunks; else a buffer
async def test_a_large_unshaped_batch_round_trips(client, row):
    rows = max(3, large.STREAM_MIN_BYTES // (row * 4) + 1)
    batch = big_batch(rows, row, 1)
    q = qps.FIFOQueue(-1, np.float32, shared_name="unshaped", client=client)
    await q.enqueue_many(batch)
    prefix = keys.queue_prefix("default", "unshaped")
    stored = await client.commands.lrange(prefix + "items", 0, -1)
    if row > 262144:
        assert len(stored) == rows and all(v.startswith(b"QR|") for v in stored)
    else:  # one batch entry, its rows in one buffer (never through the script)
        assert len(stored) == 1 and stored[0].startswith(b"QB|")
    for k in range(rows // 2):
        assert np.array_equal(await q.dequeue(), batch[k])
    padded = qps.PaddingFIFOQueue(
        -1, np.float32, [[None]], shared_name="unshaped-pad", client=client
    )
    await padded.enqueue_many(batch)
    assert np.array_equal(await padded.dequeue_many(rows), batch)
    for k in range(rows // 2, rows):
        assert np.array_equal(await q.dequeue(), batch[k])
    assert await q.size() == 0


async def test_a_large_element_round_trips(client):
    element = big_batch(5, 262144 + 3, 2)  # 5 MiB and a bit: chunks across the header
    q = qps.FIFOQueue(-1, np.float32, shapes=[element.shape], shared_name="el", client=client)
    await q.enqueue(element)
    assert np.array_equal(await q.dequeue(), element)


@pytest.mark.parametrize("stop", ["error", "cancel"])
async def test_a_streamed_batch_cut_short_inserts_nothing(client, monkeypatch, stop):
    """enqueue_many stays all or nothing: a batch whose buffer stops half-way (its
    encoding fails, or the call is cancelled) inserts no element, the queue keeps
    working, and nothing it wrote stays for good (a producer's buffer expires)."""
    probe = [(b"EXISTS", keys.queue_prefix("default", "cut") + "probe")]
    if stop == "cancel" and await client.write_commands(probe) is None:
        pytest.skip("without lean connections (fakeredis) the batch goes in one write")
    rows, row = 96, 16384
    q = qps.FIFOQueue(-1, np.float32, shapes=[[row]], shared_name="cut", client=client)
    real = wire.EncodedRows.encode
    calls = []

    def failing(self, start, stop_row):
        calls.append(start)
        if len(calls) == 3:
            if stop == "cancel":
                asyncio.current_task().cancel()
            else:
                raise MemoryError("out of memory half-way")
        return real(self, start, stop_row)

    monkeypatch.setattr(wire.EncodedRows, "encode", failing)
    with pytest.raises(asyncio.CancelledError if stop == "cancel" else MemoryError):
        await q.enqueue_many(big_batch(rows, row))
    if stop == "cancel":
        asyncio.current_task().uncancel()
    monkeypatch.setattr(wire.EncodedRows, "encode", real)
    assert len(calls) >= 3  # all of them where the socket took the windows at once
    assert await q.size() == 0
    prefix = keys.queue_prefix("default", "cut")
    left = [k async for k in client.commands.scan_iter(match=prefix + "b:*")]
    ttls = [await client.commands.pttl(k) for k in left]
    assert all(0 < ttl <= large.CHUNK_TTL_MS for ttl in ttls), ttls
    batch = big_batch(rows, row, 3)
    await q.enqueue_many(batch)
    assert np.array_equal(await q.dequeue_many(rows), batch)


# -- the pieces ----------------------------------------------------------------------------


def test_encoded_rows_windows_are_the_encoded_rows():
    x = np.arange(7 * 5, dtype=">f4").reshape(7, 5)  # other byte order: a copy per window
    y = np.arange(7 * 3, dtype=np.int16).reshape(3, 7).T  # not C-contiguous
    spec = ([np.float32, np.int16], [(5,), (3,)])
    rows = wire.encode_rows_lazily([x, y], *spec)
    whole = b"".join(bytes(r) for r in wire.encode_rows([x, y], *spec))
    assert (len(rows), rows.nbytes) == (7, len(whole))
    for size in (1, rows.row_bytes, 3 * rows.row_bytes + 1, 10**6):
        windows = rows.windows(size)
        assert b"".join(bytes(w) for w in windows) == whole
        assert b"".join(bytes(w) for w in windows) == whole  # starts over
    assert [bytes(m) for m in rows.messages()] == [wire.encode([x[i], y[i]]) for i in range(7)]


def test_decode_rows_of_large_elements_one_at_a_time():
    shapes = [(40000,), (3,)]
    dtypes = [np.float32, np.bool_]
    a = big_batch(4, 40000)
    b = np.array([[1, 0, 1]] * 4, np.bool_)
    blobs = [bytes(r) for r in wire.encode_rows([a, b], dtypes, shapes)]
    assert len(blobs[0]) >= wire._ROWWISE_MIN_BYTES
    out = wire.decode_rows(blobs, dtypes, shapes)
    assert out is not None and np.array_equal(out[0], a) and np.array_equal(out[1], b)
    bad_header = [blobs[0], b"X" + blobs[1][1:], *blobs[2:]]
    assert wire.decode_rows(bad_header, dtypes, shapes) is None
    bad_bool = [*blobs[:3], blobs[3][:-1] + b"\x02"]
    assert wire.decode_rows(bad_bool, dtypes, shapes) is None


def test_chunks_that_span_parts_are_pieces_not_copies():
    data = bytes(range(256)) * 40
    parts = [data[:7], memoryview(data[7:5000]), memoryview(data[5000:])]
    chunks = large.chunks_of(parts, 1024)
    assert b"".join(c.join() if isinstance(c, resp.Pieces) else bytes(c) for c in chunks) == data
    assert isinstance(chunks[0], resp.Pieces) and isinstance(chunks[1], memoryview)
    assert [resp.Pieces(3, [b"ab", b"c"]).join()] == [b"abc"]
    with pytest.raises(ValueError):
        resp.Pieces(4, [b"ab", b"c"]).join()


async def test_stream_many_writes_pieces_and_closes_on_a_short_one(server_url):
    from qps import transport

    conn = await resp.open_connection(transport.lean_endpoint(server_url))
    try:
        value = bytes(range(256)) * (3 * resp.STREAM_SLICE // 256 + 5)
        view = memoryview(value)
        pieces = resp.Pieces(len(value), [view[:10], view[10 : 2 * MIB], view[2 * MIB :]])
        replies = await conn.stream_many(
            [(b"SET", "mem:a", pieces), (b"SET", "mem:b", view), (b"GET", "mem:a")]
        )
        assert replies[:2] == [b"OK", b"OK"] and replies[2] == value
        assert await conn.call((b"STRLEN", "mem:b")) == len(value)
        for wrong in ([view[:10]], [view[:10], view]):  # short; too long
            with pytest.raises(TypeError):
                await conn.stream_many([(b"SET", "mem:c", resp.Pieces(len(value), wrong))])
            assert conn.closed
            conn = await resp.open_connection(transport.lean_endpoint(server_url))
            assert await conn.call((b"EXISTS", "mem:c")) == 0
    finally:
        conn.close()
    other = await resp.open_connection(transport.lean_endpoint(server_url))
    try:
        await other.call((b"DEL", "mem:a", "mem:b"))
    finally:
        other.close()


@pytest.mark.parametrize("make", [qps.FIFOQueue, qps.RandomShuffleQueue, qps.PriorityQueue])
async def test_a_batch_over_the_buffer_limit_goes_in_several_buffers(client, monkeypatch, make):
    """A batch larger than BATCH_BUFFER_MAX_BYTES (Redis takes values of 512 MB at most)
    is stored as several buffers; consumers take its rows across them, in order (FIFO),
    and the last read of each buffer deletes it."""
    rows, row = 96, 16384
    batch = big_batch(rows, row, 4)
    monkeypatch.setattr(large, "BATCH_BUFFER_MAX_BYTES", 16 * len(wire.encode([batch[0]])))
    name = "split"
    if make is qps.PriorityQueue:
        q = make(-1, [np.float32], shapes=[[row]], shared_name=name, client=client)
        await q.enqueue_many([np.zeros(rows, np.int64), batch])
    else:
        args = (0,) if make is qps.RandomShuffleQueue else ()
        q = make(-1, *args, np.float32, shapes=[[row]], shared_name=name, client=client)
        await q.enqueue_many(batch)
    prefix = keys.queue_prefix("default", name)
    buffers = [k async for k in client.commands.scan_iter(match=prefix + "b:*")]
    # six buffers and their counts (seven with a priority queue's wider rows)
    assert len(buffers) == (14 if make is qps.PriorityQueue else 12)
    if make is qps.FIFOQueue:
        stored = await client.commands.lrange(prefix + "items", 0, -1)
        assert [v.split(b"|")[3] for v in stored] == [b"16"] * 6
    assert await q.size() == rows
    got = []
    for n in (5, 30, 61):
        out = await q.dequeue_many(n)
        got.append(out[1] if make is qps.PriorityQueue else out)
    got = np.concatenate(got)
    if make is not qps.FIFOQueue:
        got = got[np.argsort(got[:, 0])]
        batch = batch[np.argsort(batch[:, 0])]
    assert np.array_equal(got, batch)
    left = [k async for k in client.commands.scan_iter(match=prefix + "b:*")]
    ttls = [await client.commands.pttl(k) for k in left]
    assert all(0 < ttl <= large.CHUNK_TTL_MS for ttl in ttls), ttls


async def test_a_split_batch_waits_for_room_a_part_at_a_time(make_client, monkeypatch):
    producer, consumer = await make_client(), await make_client()
    rows, row = 96, 16384
    batch = big_batch(rows, row, 5)
    monkeypatch.setattr(large, "BATCH_BUFFER_MAX_BYTES", 16 * len(wire.encode([batch[0]])))
    qp = qps.FIFOQueue(40, np.float32, shapes=[[row]], shared_name="room", client=producer)
    qc = qps.FIFOQueue(40, np.float32, shapes=[[row]], shared_name="room", client=consumer)
    with pytest.raises(qps.errors.WouldBlockError):
        await qp.enqueue_many_nowait(batch)
    assert await qc.size() == 0
    put = asyncio.ensure_future(qp.enqueue_many(batch))
    got = [await qc.dequeue_many(24) for _ in range(4)]
    await put
    assert np.array_equal(np.concatenate(got), batch)


@pytest.mark.parametrize("many", [False, True])
async def test_an_element_over_what_a_consumer_decodes_is_refused(client, monkeypatch, many):
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 3 * MIB)  # the consumer keeps 2 GiB
    q = qps.FIFOQueue(-1, np.float32, shared_name="huge", client=client)
    big = np.zeros((2, 3 * MIB // 4), np.float32)  # rows of 3 MiB and a header
    with pytest.raises(qps.errors.InvalidArgumentError, match="bytes a consumer decodes"):
        await (q.enqueue_many(big) if many else q.enqueue(big[0]))
    assert await q.size() == 0
    fits = np.ones((2, 2 * MIB // 4), np.float32)
    await (q.enqueue_many(fits) if many else q.enqueue(fits[0]))
    assert np.array_equal(await q.dequeue(), fits[0])


async def test_a_large_batch_of_strings_and_bools_round_trips(client):
    rows = 40000  # 4.6 MiB of strings: over STREAM_MIN_BYTES, in one buffer
    words = np.array([b"%0120d" % i for i in range(rows)])
    flags = np.arange(rows) % 3 == 0
    q = qps.FIFOQueue(
        -1, [qps.string, np.bool_], shapes=[[], []], shared_name="strings", client=client
    )
    assert words.nbytes >= large.STREAM_MIN_BYTES
    await q.enqueue_many([words, flags])
    got_words, got_flags = await q.dequeue_many(rows)
    assert np.array_equal(got_words, words) and np.array_equal(got_flags, flags)

"""qps.resp.BulkReader: GET replies read straight into the caller's buffers. Against a
scripted server that cuts its replies into small pieces (the parser's every state), and
against a real server through transport.Client.read_into."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

import qps
from qps import resp, transport
from qps.errors import InternalError, UnavailableError
from qps.queues.large import CHUNK_BYTES
from tests.conftest import until


def bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%b\r\n" % (len(value), value)


class Scripted:
    """A TCP server that answers each connection's first read with ``reply``, written
    in pieces of the sizes ``pieces`` gives (cycled), then with ``more`` (if any) and
    stays open."""

    def __init__(self, reply: bytes, pieces: list[int], stall: bool = False) -> None:
        self.reply = reply
        self.pieces = pieces
        self.stall = stall
        self.received = b""
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.received = await reader.read(1 << 20)
        data, i = self.reply, 0
        while data:
            n = self.pieces[i % len(self.pieces)]
            i += 1
            writer.write(data[:n])
            data = data[n:]
            await writer.drain()
            await asyncio.sleep(0)
        if self.stall:
            await asyncio.sleep(30)  # a server stalled mid-reply (the read is cancelled)
        with contextlib.suppress(Exception):
            await reader.read()  # until the client closes
        writer.close()

    async def start(self) -> resp.Endpoint:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return resp.Endpoint(host="127.0.0.1", port=port, keepalive=False)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[..., Any]]:
    made: list[Scripted] = []

    async def make(reply: bytes, pieces: list[int], stall: bool = False) -> resp.BulkReader:
        s = Scripted(reply, pieces, stall)
        made.append(s)
        return await resp.open_bulk_reader(await s.start())

    yield make
    for s in made:
        await s.stop()


VALUES = [b"", b"x", os.urandom(70_000), os.urandom(200_001), b"tail\r\n$3\r\nfoo\r\n"]


@pytest.mark.parametrize("pieces", [[1], [3, 7], [65536], [1 << 20], [5, 100_000, 2]])
async def test_values_land_in_their_targets_whatever_the_split(
    scripted: Any, pieces: list[int]
) -> None:
    reader = await scripted(b"".join(bulk(v) for v in VALUES), pieces)
    targets = [memoryview(bytearray(len(v))) for v in VALUES]
    got = await reader.get_into([f"k{i}" for i in range(len(VALUES))], targets)
    assert got == [len(v) for v in VALUES]
    assert [bytes(t) for t in targets] == VALUES
    assert not reader.closed


async def test_missing_and_wrong_sized_values(scripted: Any) -> None:
    values = [b"abc", None, b"toolong!", b"ok", os.urandom(150_000), b"end"]
    sizes = [3, 5, 4, 2, 10, 3]  # None: no key; 'toolong!' and the big one do not fit
    reader = await scripted(b"".join(bulk(v) for v in values), [4096, 1])
    targets = [memoryview(bytearray(n)) for n in sizes]
    got = await reader.get_into([f"k{i}" for i in range(6)], targets)
    assert got == [3, None, -1, 2, -1, 3]
    assert bytes(targets[0]) == b"abc" and bytes(targets[3]) == b"ok"
    assert bytes(targets[5]) == b"end"
    assert bytes(targets[2]) == b"\0" * 4  # a misfit is dropped, not written
    assert not reader.closed


async def test_error_reply_is_raised_after_every_reply(scripted: Any) -> None:
    reply = bulk(b"a") + b"-WRONGTYPE not a string\r\n" + bulk(b"c")
    reader = await scripted(reply, [2])
    targets = [memoryview(bytearray(1)) for _ in range(3)]
    with pytest.raises(resp.ReplyError, match="WRONGTYPE"):
        await reader.get_into(["a", "b", "c"], targets)
    assert bytes(targets[2]) == b"c"  # the stream stayed in step
    assert not reader.closed


async def test_garbage_and_unasked_replies_close_the_connection(scripted: Any) -> None:
    reader = await scripted(b"*1\r\n$1\r\na\r\n", [64])
    with pytest.raises(UnavailableError, match="protocol error"):
        await reader.get_into(["a"], [memoryview(bytearray(1))])
    assert reader.closed
    reader = await scripted(bulk(b"a") + bulk(b"b"), [64])
    target = memoryview(bytearray(1))
    # the second reply nobody asked for arrives with the first: one is fine, then the
    # connection is dead (whichever way the pieces fell)
    with contextlib.suppress(UnavailableError):
        assert await reader.get_into(["a"], [target]) == [1]

    async def closed() -> bool:
        return reader.closed

    await until(closed)
    with pytest.raises(UnavailableError):
        await reader.get_into(["a"], [target])


async def test_cancelled_read_closes_the_connection(scripted: Any) -> None:
    big = os.urandom(100_000)
    reader = await scripted(bulk(big)[:50_000], [10_000], stall=True)
    task = asyncio.ensure_future(reader.get_into(["k"], [memoryview(bytearray(len(big)))]))

    async def parked() -> bool:  # mid-value, the rest to come straight into the target
        return reader._body is not None

    await until(parked)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reader.closed


async def test_bad_calls(scripted: Any) -> None:
    reader = await scripted(b"", [1])
    with pytest.raises(ValueError):
        await reader.get_into(["a", "b"], [memoryview(bytearray(1))])
    assert await reader.get_into([], []) == []


# -- against a real server, through the client ------------------------------------------


async def test_client_read_into_real_server(server_url: str) -> None:
    async with await transport.connect(server_url) as client:
        values = {f"bulk:{i}": os.urandom(n) for i, n in enumerate([0, 10, 1 << 20, 3_000_001])}
        await client.commands.mset(values)
        await client.commands.lpush("bulk:list", b"x")
        keys = [*values, "bulk:none"]
        targets = [memoryview(np.empty(len(v), np.uint8)) for v in values.values()]
        targets.append(memoryview(bytearray(1)))
        got = await client.read_into(keys, targets)
        assert got == [*(len(v) for v in values.values()), None]
        assert [bytes(t) for t in targets[:-1]] == list(values.values())
        with pytest.raises(InternalError, match="WRONGTYPE"):
            await client.read_into(["bulk:list"], [memoryview(bytearray(1))])
        assert len(client._bulk) == 1  # kept after an error reply: still in step
        again = memoryview(bytearray(10))
        assert await client.read_into(["bulk:1"], [again]) == [10]
        assert bytes(again) == values["bulk:1"]
        await client.commands.delete(*values, "bulk:list")
    assert client._bulk == []  # closed with the client
    assert await client.read_into(["bulk:1"], [again]) is None  # closed: no lean path


async def test_fakeredis_client_has_no_bulk_path() -> None:
    import fakeredis

    server = fakeredis.FakeServer()
    r = fakeredis.FakeAsyncRedis(server=server)
    client = transport.from_redis(r, fakeredis.FakeAsyncRedis(server=server))
    assert await client.read_into(["k"], [memoryview(bytearray(1))]) is None


async def test_large_elements_travel_through_bulk_reads(server_url: str) -> None:
    async with await transport.connect(server_url) as client:
        q = qps.FIFOQueue(4, np.float32, shapes=[[CHUNK_BYTES // 4 * 3 + 5]],
                          shared_name="bulkq", client=client)  # fmt: skip
        rows = np.random.default_rng(1).standard_normal((3, CHUNK_BYTES // 4 * 3 + 5))
        rows = rows.astype(np.float32)
        for r in rows:
            await q.enqueue(r)
        for r in rows:
            np.testing.assert_array_equal(await q.dequeue(), r)
        assert client._bulk  # the chunks came through a bulk reader
        assert await q.size() == 0
        await qps.queues.delete_queue(client, "bulkq")

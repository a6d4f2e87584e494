"""Memory bounds of a PS job on both backends: pushes block once a shard's gradient
queue is full (backpressure instead of a PS out of memory, TF issue #6508), so the
bytes waiting in Redis stay bounded; the job's maximum gradient message size, enforced
by the worker (nothing sent) and by the shard (dead-lettered without its bytes); and
the bytes held per shard that `qps ps status` shows."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import fakeredis
import numpy as np
import pytest
from click.testing import CliRunner, Result

import qps
import qps.cli.ps
from qps import keys, transport, wire
from qps.cli.main import cli
from qps.errors import InvalidArgumentError
from qps.optimizers import SGD
from qps.ps import control
from qps.ps.messages import GradientMessage, encode_message
from qps.ps.shard import Shard
from qps.queues.inspect import list_queue_bytes, queue_stats
from tests.conftest import ClientFactory, pending, until
from tests.test_ps_shard import C, Job

BIG = 200_000  # float64s: a 1.6 MB message, stored out of line (in 1 MiB chunks)


@pytest.fixture
async def job(make_client: ClientFactory) -> AsyncIterator[Job]:
    j = Job(make_client)
    try:
        yield j
    finally:
        await j.close()


async def _bytes(client: transport.Client, shard: int = 0) -> tuple[int, int]:
    return await list_queue_bytes(client, keys.ps_gradient_queue(shard), C)


def _message(worker: str, step: int, grads: dict[str, Any]) -> GradientMessage:
    return GradientMessage(
        worker=worker, step=step, shard=0, nonce="x.1", grads=grads, global_step=True
    )


async def _setup(sess: qps.Session, **config: Any) -> None:
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0), **config)
    await sess.variable("big", (BIG,), np.float64, initializer="zeros").create()
    await sess.variable("small", (4,), np.float64, initializer="zeros").create()


# -- backpressure ----------------------------------------------------------------------------


async def test_pushes_block_at_the_queue_capacity_and_redis_stays_bounded(job: Job) -> None:
    sess, other = await job.session("w0"), await job.session("w1")
    await _setup(sess, queue_capacity=2)
    grad = np.ones(BIG)
    size = len(encode_message(_message("w0", 0, {"big": grad})))
    assert await _bytes(sess.client) == (0, 0)
    await sess.push({"big": grad})  # no shard runs: these two fill the queue
    await sess.push({"big": grad})
    queue = control.gradient_queue(sess.client, C, 0, 2)
    stored, blocked = await _bytes(sess.client)
    assert await queue.size() == 2 and blocked == 0
    assert 2 * size <= stored < 2 * (size + 1024)  # the element's own header
    # the third push (and one from another worker) waits for room: nothing more is stored
    third = asyncio.create_task(sess.push({"big": grad}))
    fourth = asyncio.create_task(other.push({"big": grad}))

    async def both_blocked() -> bool:
        return (await queue_stats(sess.client, keys.ps_gradient_queue(0), C)).pending_enqueues == 2

    await until(both_blocked)
    assert pending(third) and pending(fourth)
    assert await queue.size() == 2
    again, blocked = await _bytes(sess.client)
    assert again == stored  # bounded by the capacity
    assert 2 * size <= blocked < 2 * (size + 1024)  # one message per blocked push
    st = await control.shard_status(sess.client, C, 0)
    assert (st.queue_size, st.queue_bytes, st.pending_bytes) == (2, stored, blocked)
    # a shard starts: the blocked pushes get in, everything is applied, nothing is left
    await job.shard()
    await asyncio.wait_for(asyncio.gather(third, fourth), 30)

    async def applied() -> bool:
        return await sess.global_step() == 4

    await until(applied, timeout=30)
    assert await _bytes(sess.client) == (0, 0)
    assert (await sess.pull("big")).value[:2].tolist() == [-4.0, -4.0]


# -- the maximum message size ----------------------------------------------------------------


async def test_the_max_message_size_is_set_once_and_checked(job: Job) -> None:
    sess = await job.session()
    cfg = await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    assert cfg.max_message_bytes == control.DEFAULT_MAX_MESSAGE_BYTES == 512 << 20
    await qps.ps.configure(sess.client, "other", 1, max_message_bytes=wire.MAX_MESSAGE_BYTES)
    for bad in (0, wire.MAX_MESSAGE_BYTES + 1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="max_message_bytes must be"):
            await qps.ps.configure(sess.client, "third", 1, max_message_bytes=bad)  # type: ignore[arg-type]
    # stored once: the default is stored implicitly, another size disagrees
    with pytest.raises(InvalidArgumentError, match="maximum gradient message size of 536870912"):
        await qps.ps.configure(sess.client, C, 1, max_message_bytes=1 << 20)
    await qps.ps.configure(sess.client, "fourth", 1, max_message_bytes=1 << 20)
    assert (await control.read_config(sess.client, "fourth")).max_message_bytes == 1 << 20  # type: ignore[union-attr]
    with pytest.raises(InvalidArgumentError, match="not 2048"):
        await qps.ps.configure(sess.client, "fourth", 1, max_message_bytes=2048)


async def test_the_worker_refuses_an_oversize_message_and_sends_nothing(
    job: Job, queue_path: None
) -> None:
    sess = await job.session()
    await _setup(sess, max_message_bytes=64 << 10)
    assert await control.gradient_queue(sess.client, C, 0).size() == 0  # it exists
    with pytest.raises(InvalidArgumentError) as err:
        await sess.push({"big": np.ones(BIG), "small": np.ones(4)})
    msg = str(err.value)
    assert "the gradient message for shard 0 is 1600" in msg
    assert "over the maximum message size" in msg and "65536 bytes" in msg
    assert "nothing was sent" in msg
    # the gradient alone is at the limit, the encoded message over it
    await sess.variable("edge", ((64 << 10) // 8,), np.float64, initializer="zeros").create()
    with pytest.raises(InvalidArgumentError, match=r"is 65\d\d\d bytes, over"):
        await sess.push({"edge": np.ones((64 << 10) // 8)})
    st = await queue_stats(sess.client, keys.ps_gradient_queue(0), C)
    assert (st.size, st.enqueued_total, st.pending_enqueues) == (0, 0, 0)
    await sess.push({"small": np.ones(4)})  # a small one goes through
    assert (await queue_stats(sess.client, keys.ps_gradient_queue(0), C)).size == 1


async def test_the_shard_dead_letters_an_oversize_message(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    sess = await job.session()
    await _setup(sess, max_message_bytes=64 << 10)
    await qps.ps.place_variables(sess.client, C, ["big", "small"])
    # a worker that ignored the limit: its message is enqueued directly
    m = _message("rogue", 7, {"big": np.ones(BIG)})
    data = encode_message(m)
    queue = control.gradient_queue(sess.client, C, 0)
    await queue.enqueue(np.frombuffer(data, np.uint8))
    await sess.push({"small": np.ones(4)})  # behind it, applied
    await job.shard()

    async def settled() -> bool:  # the stats are written after the apply and the ack
        st = await control.shard_status(sess.client, C, 0)
        done = await sess.global_step() == 1 and await queue.size() == 0
        return done and (st.applied, st.dead_letters) == (1, 1)

    await until(settled, timeout=30)
    st = await control.shard_status(sess.client, C, 0)
    assert (st.applied, st.dead_letters) == (1, 1)
    [dead] = await control.dead_letters(sess.client, C, 0)
    assert dead["reason"] == (
        f"message of {len(data)} bytes is over the job's maximum message size of 65536 "
        "bytes (max_message_bytes)"
    )
    assert (dead["id"], dead["worker"], dead["step"]) == (m.id, "rogue", 7)
    assert dead["size"] == len(data) and dead["data"] == b""  # its bytes are not kept
    assert (await sess.pull("big")).version == 0
    assert (await sess.pull("small")).value.tolist() == [-1.0] * 4
    monkeypatch.setattr(qps.cli.ps, "connected", _cli_connected(sess.client))
    shown = json.loads((await _cli("dlq", "show", "0", "--json")).output)
    assert (shown["size"], shown["bytes"], shown["worker"]) == (len(data), 0, "rogue")
    assert shown["decode_error"] == f"its {len(data)} bytes were not kept"


async def test_a_shard_with_another_max_message_size_does_not_start(job: Job) -> None:
    sess = await job.session()
    await _setup(sess, max_message_bytes=64 << 10)
    _, task = await job.shard(max_message_bytes=1 << 20)
    with pytest.raises(InvalidArgumentError, match="maximum gradient message size of 65536"):
        await asyncio.wait_for(task, 10)


# -- bytes held, and `qps ps status` ---------------------------------------------------------


def _cli_connected(client: transport.Client) -> Callable[[str | None], Any]:
    """``qps.cli.ps.connected`` for a CLI command run in a thread (with its own event
    loop) that reaches the server of ``client``, either backend."""
    pool = getattr(client.commands, "connection_pool", None)  # a cluster client has none
    server = None if pool is None else pool.connection_kwargs.get("server")

    @contextlib.asynccontextmanager
    async def connected(url: str | None) -> AsyncIterator[transport.Client]:
        if isinstance(server, fakeredis.FakeServer):
            c = transport.from_redis(
                fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
            )
        else:
            c = await transport.connect(client.url)
        try:
            yield c
        finally:
            await c.close()

    return connected


async def _cli(*args: str) -> Result:
    """``qps ps ARGS --container C`` (with ``connected`` patched: see _cli_connected)."""

    def run() -> Result:
        return CliRunner().invoke(cli, ["ps", *args, "--container", C], catch_exceptions=False)

    r = await asyncio.to_thread(run)
    assert r.exit_code == 0, r.output
    return r


async def _status(*args: str) -> Result:
    return await _cli("status", *args)


def _row(output: str) -> dict[str, str]:
    lines = output.splitlines()
    header = lines[1].split()
    return dict(zip(header[::-1], lines[2].split()[::-1]))  # STATE may hold a space


async def test_status_shows_the_bytes_held(
    job: Job, monkeypatch: pytest.MonkeyPatch, queue_path: None
) -> None:
    sess = await job.session()
    await _setup(sess)
    monkeypatch.setattr(qps.cli.ps, "connected", _cli_connected(sess.client))
    row = _row((await _status()).output)  # no queue yet
    assert (row["QUEUE"], row["QUEUED"], row["BLOCKED"], row["HELD"]) == ("-", "-", "-", "0B")
    await sess.push({"big": np.ones(BIG)})  # out of line
    await sess.push({"small": np.ones(4)})  # inline
    stored, _ = await _bytes(sess.client)
    assert stored > BIG * 8
    row = _row((await _status()).output)
    assert row["QUEUE"] == "2" and row["QUEUED"] == f"{stored / 2**20:.1f}M"
    data = json.loads((await _status("--json")).output)["shards"][0]
    assert (data["queue_size"], data["queue_bytes"]) == (2, stored)
    assert (data["pending_bytes"], data["held_bytes"]) == (0, 0)
    # a shard takes them and stalls before its commit: it holds them, the queue is empty
    gate = asyncio.Event()
    commit = Shard._commit_group

    async def stalled(self: Shard, g: Any) -> None:
        await gate.wait()
        await commit(self, g)

    monkeypatch.setattr(Shard, "_commit_group", stalled)
    await job.shard()

    async def held() -> bool:
        st = await control.shard_status(sess.client, C, 0)
        return st.queue_size == 0 and st.held_bytes > 0  # published with its lease renewal

    await until(held)
    data = json.loads((await _status("--json")).output)["shards"][0]
    assert data["queue_bytes"] == 0 and 0 < data["held_bytes"] <= stored
    row = _row((await _status()).output)
    assert row["QUEUED"] == "0B" and row["HELD"] != "0B"
    # drained: nothing held anywhere
    gate.set()

    async def drained() -> bool:
        st = await control.shard_status(sess.client, C, 0)
        return await sess.global_step() == 2 and st.held_bytes == 0

    await until(drained, timeout=30)
    row = _row((await _status()).output)
    assert (row["QUEUE"], row["QUEUED"], row["BLOCKED"], row["HELD"]) == ("0", "0B", "0B", "0B")
    await control.mark_finished(sess.client, C)
    st = await control.shard_status(sess.client, C, 0)
    assert st.as_dict()["held_bytes"] == 0

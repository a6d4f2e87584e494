"""Redis Cluster specifics: detection, routing over lean connections per node, and
following a slot that moved to another node.

The tests that need a cluster run only when the cluster backend is on
(``QPS_TEST_CLUSTER=1`` or ``cluster`` in ``QPS_TEST_BACKENDS``; see conftest.py);
the rest of the suite runs on it through the ``client`` fixture.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner

import qps
from qps import checkpoint, keys, transport
from qps.cli.main import cli
from qps.containers import reset
from qps.errors import InvalidArgumentError, UnavailableError
from tests.conftest import BACKENDS, until_blocked

needs_cluster = pytest.mark.skipif(
    "cluster" not in BACKENDS, reason="the cluster backend is off (QPS_TEST_CLUSTER=1)"
)


@pytest.mark.parametrize(
    ("url", "stripped", "flag"),
    [
        ("redis://h:1/0", "redis://h:1/0", None),
        ("redis://h:1?cluster=yes", "redis://h:1", True),
        ("redis://h:1/?cluster=0&ssl_cert_reqs=none", "redis://h:1/?ssl_cert_reqs=none", False),
        ("rediss://h:1/?a=b&CLUSTER=True&c=d", "rediss://h:1/?a=b&c=d", True),
    ],
)
def test_the_cluster_url_parameter_is_read_and_removed(url, stripped, flag) -> None:
    assert transport.split_cluster_param(url) == (stripped, flag)


def test_a_bad_cluster_url_parameter_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="cluster="):
        transport.split_cluster_param("redis://h:1/?cluster=maybe")


async def test_a_cluster_has_only_database_0() -> None:
    with pytest.raises(InvalidArgumentError, match="db"):
        await qps.connect("redis://127.0.0.1:1/3?cluster=yes")


async def test_a_cluster_needs_a_tcp_url(server_url: str) -> None:
    if not server_url.startswith("unix:"):
        pytest.skip("the real backend is not on a unix socket")
    with pytest.raises(InvalidArgumentError, match="redis://"):
        await qps.connect(server_url + "?cluster=yes")


async def test_qps_cluster_in_the_environment_asks_for_a_cluster(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QPS_CLUSTER", "maybe")
    with pytest.raises(InvalidArgumentError, match="QPS_CLUSTER"):
        await qps.connect(server_url)
    monkeypatch.setenv("QPS_CLUSTER", "yes")
    if server_url.startswith("unix:"):  # asked for a cluster, and a socket cannot be one
        with pytest.raises(InvalidArgumentError, match="redis://"):
            await qps.connect(server_url)
    async with await qps.connect(server_url + "?cluster=no") as plain:  # the URL wins
        assert not plain.cluster


def test_the_cluster_flag_holds_for_the_command_only(server_url: str) -> None:
    if not server_url.startswith("unix:"):
        pytest.skip("the real backend is not on a unix socket")
    r = CliRunner().invoke(cli, ["queue", "ls", "--cluster", "--url", server_url])
    assert r.exit_code == 1 and "Redis Cluster needs a redis://" in r.output, r.output
    assert "QPS_CLUSTER" not in os.environ  # restored when the command ended
    r = CliRunner().invoke(cli, ["queue", "ls", "--url", server_url])
    assert r.exit_code == 0, r.output


@needs_cluster
def test_the_cluster_flag_reaches_a_cluster(cluster_url: str) -> None:
    async def make() -> None:
        async with await qps.connect(cluster_url) as client:
            await client.commands.flushall()
            await qps.FIFOQueue(4, np.int64, shared_name="flagged", client=client).enqueue(3)

    asyncio.run(make())
    r = CliRunner().invoke(cli, ["queue", "ls", "--cluster", "--url", cluster_url, "--json"])
    assert r.exit_code == 0, r.output
    assert [(q["name"], q["size"]) for q in json.loads(r.stdout)] == [("flagged", 1)]


def _node(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=10)


def _move_slot(cluster_url: str, key: str) -> tuple[str, str]:
    """Migrate ``key``'s slot (with its keys) to another primary, as a resharding does;
    return the addresses (host:port) of the old and the new owner."""
    with redis.RedisCluster.from_url(cluster_url) as rc:
        slot = rc.keyslot(key)
        src = rc.nodes_manager.get_node_from_slot(slot)
        dst = next(n for n in rc.get_primaries() if n.name != src.name)
        primaries = [(n.host, n.port) for n in rc.get_primaries()]
    with _node(f"redis://{src.host}:{src.port}") as s, _node(f"redis://{dst.host}:{dst.port}") as d:
        src_id, dst_id = s.execute_command("CLUSTER MYID"), d.execute_command("CLUSTER MYID")
        d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        while True:
            names = s.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
            if not names:
                break
            s.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *names)
    for host, port in primaries:
        with _node(f"redis://{host}:{port}") as n:
            n.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    return src.name, dst.name


def _child_of(client: Any, key: str) -> Any:
    return client._node_for(key)


@needs_cluster
async def test_connect_detects_a_cluster_and_spreads_queues_over_its_nodes(
    cluster_url: str,
) -> None:
    async with await qps.connect(cluster_url) as client:
        await client.commands.flushall()
        assert isinstance(client, transport.ClusterClient) and client.cluster
        queues = [
            qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name=f"spread{i}", client=client)
            for i in range(12)
        ]
        for i, q in enumerate(queues):
            await q.enqueue(i)
        assert [int(await q.dequeue()) for q in queues] == list(range(12))
        assert len(client._nodes) == 3  # lean connections to every primary
        await reset(client, ["default"])  # SCAN and UNLINK on every primary
        assert not [k async for k in client.commands.scan_iter(match="qps:{default*")]
    async with await qps.connect(cluster_url + "?cluster=no") as plain:
        assert type(plain) is transport.Client and not plain.cluster


@needs_cluster
async def test_a_checkpoint_spans_the_nodes_and_leaves_no_hold(
    cluster_url: str, tmp_path: Any
) -> None:
    """Variables on every primary are saved (each held and pinned on its own node),
    restored into an emptied container, and no hold or pinned copy stays behind."""
    async with await qps.connect(cluster_url) as client:
        await client.commands.flushall()
        async with qps.Session(client=client, container="ck") as s:
            for i in range(12):
                v = s.variable(f"v{i}", (3,), np.float32, initializer="zeros")
                await v.create()
                await v.publish(np.full(3, i, np.float32), 1, 1)
        metas = [keys.variable_prefix("ck", f"v{i}") + "meta" for i in range(12)]
        assert len({_child_of(client, m) for m in metas}) == 3  # on every primary
        info = await checkpoint.save(client, tmp_path / "ckpt", container="ck")
        assert info.variables == 12
        for m in metas:
            assert await client.commands.hget(m, "hold") is None
        assert not [k async for k in client.commands.scan_iter(match="*ck:*")]
        await reset(client, ["ck"])
        await checkpoint.restore(client, tmp_path / "ckpt")
        for i in range(12):
            got = await qps.variables.open_variable(client, f"v{i}", "ck")
            value = await got.read()
            assert value.version == 1 and value.value.tolist() == [i, i, i]


@needs_cluster
async def test_a_stale_route_is_sent_again_after_moved(cluster_url: str) -> None:
    async with await qps.connect(cluster_url) as client:
        await client.commands.flushall()
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="stale", client=client)
        await q.enqueue(1)
        meta = q._keys[0]
        right = _child_of(client, meta)
        # another node's lean client: the node of some key in another node's slot
        wrong = next(c for i in range(1000) if (c := _child_of(client, f"x{{{i}}}")) is not right)
        client._route[meta] = wrong  # as if the slot had moved away from ``right``
        await q.enqueue(2)  # MOVED from the wrong node: nothing ran, sent again
        assert client._route[meta] is right
        client._route[meta] = wrong
        assert [int(x) for x in await q.dequeue_many(2)] == [1, 2]
        assert await q.size() == 0


@needs_cluster
async def test_a_lost_node_fails_the_call_and_the_next_one_is_routed_again(
    cluster_url: str,
) -> None:
    async with await qps.connect(cluster_url) as client:
        await client.commands.flushall()
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="lost", client=client)
        await q.enqueue(1)
        meta = q._keys[0]
        right = _child_of(client, meta)
        assert right._endpoint is not None
        # a node that is gone (as after a failover): nothing listens on port 1
        gone = transport.Client(
            client.commands,
            client.blocking,
            url=client.url,
            endpoint=dataclasses.replace(right._endpoint, port=1),
        )
        client._route[meta] = gone
        with pytest.raises(UnavailableError):
            await q.enqueue(2)
        await q.enqueue(3)  # the slot map was read again: to the owner
        assert client._route[meta] is right
        assert [int(x) for x in await q.dequeue_many(2)] == [1, 3]


@needs_cluster
async def test_a_queue_whose_slot_moves_keeps_working(cluster_url: str) -> None:
    async with await qps.connect(cluster_url) as client, await qps.connect(cluster_url) as other:
        await client.commands.flushall()
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="moving", client=client)
        p = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="moving", client=other)
        await q.enqueue(1)
        await q.enqueue(2)
        assert int(await q.dequeue()) == 1
        waiting = asyncio.ensure_future(p.dequeue_many(3))  # blocks: one element stored
        await until_blocked(other, task=waiting, what="the dequeue_many blocked in BLPOP")
        old, new = await asyncio.to_thread(_move_slot, cluster_url, q._keys[0])
        assert old != new
        await q.enqueue_many([np.array([3, 4])])  # MOVED, then sent to the new owner
        got = await asyncio.wait_for(waiting, 15)
        assert [int(x) for x in got] == [2, 3, 4]
        assert int(await q.size()) == 0
        stats = await q.stats()
        assert stats.size == 0


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _failover(cluster: Any, key: str) -> tuple[str, str]:
    """Promote the replica of ``key``'s primary (``CLUSTER FAILOVER``: coordinated, no
    write lost) and wait until every node names it the slot's owner; return the
    addresses (host:port) of the old and the new primary."""
    with redis.RedisCluster.from_url(cluster.url) as rc:
        slot = rc.keyslot(key)
        old = rc.nodes_manager.get_node_from_slot(slot)
    with _node(f"redis://{old.host}:{old.port}") as o:
        old_id = o.execute_command("CLUSTER MYID")
        replicas = o.execute_command("CLUSTER REPLICAS", old_id)  # {"host:port": {...}}
    host, port = next(iter(replicas)).rsplit(":", 1)
    with _node(f"redis://{host}:{port}") as r:
        r.execute_command("CLUSTER FAILOVER")
    new = f"{host}:{port}"
    deadline = time.monotonic() + 30
    while True:  # until every node says so
        owners = set()
        for p in cluster.ports:
            with _node(f"redis://127.0.0.1:{p}") as n:
                # [[first, last, [host, port, id], replicas...], ...]
                for first, last, primary, *_ in n.execute_command("CLUSTER SLOTS"):
                    if first <= slot <= last:
                        owners.add(f"{_text(primary[0])}:{primary[1]}")
        if owners == {new}:
            return old.name, new
        assert time.monotonic() < deadline, f"failover not seen everywhere: {owners}"
        time.sleep(0.05)


@needs_cluster
async def test_a_failover_is_followed(local_cluster: Any) -> None:
    if local_cluster is None or not local_cluster.replicas:
        pytest.skip("needs the test cluster's replicas (QPS_TEST_CLUSTER_REPLICAS=1)")
    async with await qps.connect(local_cluster.url) as client:
        await client.commands.flushall()
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="failover", client=client)
        await q.enqueue(1)
        before = _child_of(client, q._keys[0])
        old, new = await asyncio.to_thread(_failover, local_cluster, q._keys[0])
        assert old != new
        await q.enqueue(2)  # the old primary, now a replica, answers MOVED: sent again
        after = _child_of(client, q._keys[0])
        assert after is not before and after._endpoint.port == int(new.rsplit(":", 1)[1])
        assert [int(x) for x in await q.dequeue_many(2)] == [1, 2]

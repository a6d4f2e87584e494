"""Synchronous training on a PS shard (SyncReplicasOptimizer semantics): each update
applies the mean of replicas_to_aggregate fresh gradients, stale ones are dropped and
counted, every worker gets a token per update; on both backends."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from qps import keys
from qps.errors import InvalidArgumentError
from qps.optimizers import SGD
from qps.ps import control
from qps.ps.messages import SparseGradient
from tests.conftest import until
from tests.test_ps_shard import C, Job, job  # noqa: F401  (the fixture)
from workers import monitor


async def test_updates_average_fresh_gradients_and_drop_stale_ones(job: Job) -> None:  # noqa: F811
    a, b = await job.session("w0"), await job.session("w1")
    await control.configure(a.client, C, 1, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    await a.variable("e", (4, 2), np.float32, initializer="zeros").create()
    await job.shard(0, 1)
    tok0, tok1 = (control.tokens(a.client, C, k) for k in (0, 1))

    await a.push({"w": np.array([1, 2], np.float32)}, step=0)
    await b.push({"w": np.array([3, 4], np.float32)}, step=0)
    assert (await tok0.take_then([], 10))[0] == 1 and (await tok1.take_then([], 10))[0] == 1
    assert (await a.pull("w")).value.tolist() == [-2.0, -3.0]  # w -= mean
    assert await a.global_step() == 1  # one update for two pushes

    # a gradient computed from update 0 is stale now: dropped, nothing changes
    await b.push({"w": np.array([100, 100], np.float32)}, step=0)
    # sparse rows are averaged over the gradients that hold them (TF's per-index mean)
    await a.push({"e": SparseGradient(np.array([0, 1]), np.ones((2, 2), np.float32))}, step=1)
    await b.push({"e": SparseGradient(np.array([1]), np.full((1, 2), 3, np.float32))}, step=1)
    assert (await tok0.take_then([], 10))[0] == 2
    e = (await a.pull("e")).value
    assert e[0].tolist() == [-1.0, -1.0] and e[1].tolist() == [-2.0, -2.0]
    assert e[2:].tolist() == [[0, 0], [0, 0]]
    assert (await a.pull("w")).value.tolist() == [-2.0, -3.0]

    async def dropped() -> bool:
        s = await control.shard_status(a.client, C, 0)
        return int(s.fields.get("dropped_stale", 0)) == 1

    await until(dropped)
    assert await a.global_step() == 2
    # what `qps ps status` (and --json) and the job views show of it
    st = await control.shard_status(a.client, C, 0)
    assert st.dropped_stale == 1 and st.as_dict()["dropped_stale"] == 1
    assert (await monitor.snapshot(a.client, C)).shards[0].dropped_stale == 1


async def test_sync_config_is_checked(job: Job) -> None:  # noqa: F811
    s = await job.session()
    with pytest.raises(InvalidArgumentError, match="replicas_to_aggregate"):
        await control.configure(s.client, C, 1, sync=(3, 2))
    await control.configure(s.client, C, 1, sync=(2, 3))
    assert (await control.read_config(s.client, C)).sync == (2, 3)
    with pytest.raises(InvalidArgumentError, match="synchronous 2/3"):
        await control.configure(s.client, C, 1, sync=(3, 3))


@pytest.mark.no_cluster(reason="the parameters ride with the token on a single server only")
async def test_sync_workers_get_the_parameters_with_their_token(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two synchronous workers in one loop: after the first step each reads the
    parameters in its token's round trip (FIFOQueue.dequeue_then), not with a pull of
    its own, and trains exactly as many updates as steps."""
    import asyncio

    import qps
    from qps.ps.client import PSClient
    from workers.worker import Worker, WorkerConfig

    pulls: list[str] = []
    real = PSClient.pull

    async def counted(self: PSClient, variables: object) -> object:
        pulls.append(self.worker)
        return await real(self, variables)

    monkeypatch.setattr(PSClient, "pull", counted)
    client = await job.make_client()
    await control.configure(client, C, 1, SGD(learning_rate=0.05), sync=(2, 2))
    await job.shard(0, 1, lease_ms=5000)
    steps = 12

    async def run(index: int) -> int:
        sess = qps.Session(client=await job.make_client(), container=C, worker=f"worker{index}")
        await sess.open()
        try:
            cfg = WorkerConfig(
                index=index, num_workers=2, num_shards=1, model="mlp:64,16,10", data="digits",
                batch_size=32, steps=steps, container=C, log_every=1000, evaluate=False,
                finish_job=False,
            )  # fmt: skip
            w = Worker(cfg, sess)
            await w.prepare()
            res = await w.train()
            await w.finish()
            return res.steps
        finally:
            await sess.close()

    done = await asyncio.wait_for(asyncio.gather(run(0), run(1)), 120)
    assert done == [steps, steps]
    watcher = await job.session("watcher")
    assert await watcher.global_step() == steps  # one update per pair of gradients
    # one pull each to start (and one more per stale token, which these do not get)
    assert sorted(pulls) == ["worker0", "worker1"], pulls


async def test_only_gradients_that_may_be_applied_are_looked_up(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gradient for the update being gathered cannot have been applied, so its ids
    are not looked up (a round trip less per update). Looked up: those of the updates
    up to the one the shard started from, stale ones, and, once a gradient from an
    update ahead of the shard was taken, those up to its step: a redelivered copy of
    it, whose step the shard has reached since, is found applied and not counted again."""
    from qps.errors import AbortedError
    from qps.ps.messages import GradientMessage, encode_message
    from qps.ps.shard import Shard
    from qps.queues.base import Delivery, QueueBase

    asked: list[tuple[str, int]] = []
    real = Shard._applied_flags

    async def counted(self: Shard, msgs: list[GradientMessage]) -> object:
        asked.extend((m.worker, m.step) for m in msgs)
        return await real(self, msgs)

    monkeypatch.setattr(Shard, "_applied_flags", counted)
    a, b = await job.session("w0"), await job.session("w1")
    await control.configure(a.client, C, 1, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    shard, _ = await job.shard(0, 1)
    tok0 = control.tokens(a.client, C, 0)
    grads = control.gradient_queue(a.client, C, 0)

    def grad(g: float) -> dict[str, np.ndarray]:
        return {"w": np.array([g, g], np.float32)}

    async def update(n: int) -> None:
        assert (await tok0.take_then([], 10))[0] == n

    await a.push(grad(1), step=0)
    await b.push(grad(3), step=0)
    await update(1)  # the shard started at update 0: looked up
    assert sorted(asked) == [("w0", 0), ("w1", 0)]
    await a.push(grad(1), step=1)
    await b.push(grad(3), step=1)
    await update(2)  # fresh: not looked up
    assert len(asked) == 2

    # A gradient from an update ahead (step 3 while the shard gathers update 3, i.e.
    # step 2) counts. The ack of that update fails (its lease ran out, say): both
    # messages come again once the shard gathers update 4 (step 3), and are looked up
    # and found applied (the update-ahead one by its step), then acked.
    ahead = GradientMessage(
        worker="w1", step=3, shard=0, nonce="ahead.1", grads=grad(3), global_step=True
    )
    mine = GradientMessage(
        worker="w0", step=2, shard=0, nonce="mine.1", grads=grad(1), global_step=True
    )

    async def released() -> bool:  # update 2's ack is done: its ids were let go
        return not await a.client.commands.zcard(keys.variable_applied(C, "w"))

    await until(released)
    real_ack = QueueBase.ack
    lost = asyncio.Event()

    async def ack(self: QueueBase, delivery: Delivery, **kw: Any) -> None:
        await real_ack(self, delivery, **kw)
        if not lost.is_set() and self.name == grads.name and len(delivery.tokens) == 2:
            lost.set()
            raise AbortedError("the delivery's lease ran out (test)")

    monkeypatch.setattr(QueueBase, "ack", ack)
    for m in (ahead, mine):
        await grads.enqueue(np.frombuffer(encode_message(m), np.uint8))
    await update(3)
    # ("w0", 2) too if the shard took it after the update-ahead one, in another round
    assert asked[2] == ("w1", 3) and set(asked[3:]) <= {("w0", 2)}
    assert (await a.pull("w")).value.tolist() == [-6.0, -6.0]
    await asyncio.wait_for(lost.wait(), 10)  # the update's ack (after its tokens) failed
    seen = len(asked)
    for m in (ahead, mine):  # redelivered
        await grads.enqueue(np.frombuffer(encode_message(m), np.uint8))
    await a.push(grad(1), step=3)
    await b.push(grad(3), step=3)
    await update(4)
    assert sorted(asked[seen:]) == [("w0", 2), ("w0", 3), ("w1", 3), ("w1", 3)]
    assert shard.skipped == 2
    seen = len(asked)
    await a.push(grad(1), step=4)
    await b.push(grad(3), step=4)
    await update(5)  # past the update-ahead step: fresh ones are not looked up again
    assert len(asked) == seen
    assert (await a.pull("w")).value.tolist() == [-10.0, -10.0]
    assert await a.global_step() == 5


@pytest.mark.no_cluster(reason="the plan reads variables of another slot than the tokens'")
async def test_a_token_brings_the_parameters_read_after_it(make_client) -> None:
    """A worker's token wait (a plain list: BLPOP) carries the next step's reads in its
    round trip: the tokens left and the parameters, read once the token is taken (so
    committed by the update it names)."""
    import asyncio

    import qps
    from qps.errors import DeadlineExceededError
    from qps.ps.client import PSClient

    a, b = await make_client(), await make_client()
    await qps.Variable("w", (4,), np.float32, client=a, container=C).create()
    shard_w = await qps.Variable("w", (4,), np.float32, client=b, container=C).create()
    ps = PSClient(a, C)
    plan = await ps.pull_plan(["w"])
    assert plan is not None
    mine, theirs = control.tokens(a, C, 0), control.tokens(b, C, 0)
    assert mine.key == theirs.key != control.tokens(a, C, 1).key
    with pytest.raises(DeadlineExceededError):
        await mine.take_then([], 0.05)
    waiter = asyncio.ensure_future(mine.take_then([*mine.size_commands(), *plan.commands], 20))
    await shard_w.publish(np.full(4, 3.0, np.float32), 1, 0)
    await theirs.put(1)  # wakes the wait (or is there when it begins)
    token, replies = await asyncio.wait_for(waiter, 20)
    assert token == 1 and mine.size_of(replies[:1]) == 0
    got = ps.pulled(plan, replies[1:])
    assert got is not None and got["w"].value.tolist() == [3.0] * 4
    for step in (2, 3, 4):
        await theirs.put(step)
    token, replies = await mine.take_then(mine.size_commands(), 20)
    assert token == 2 and mine.size_of(replies) == 2 == await mine.size()
    assert await mine.take_all() == [3, 4] and await mine.take_all() == []


async def test_tokens_go_with_the_commit_only_if_it_took(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a single server an update's tokens are given by a last script in the commit's
    round trip, which checks that every commit took (on a cluster they are given after
    the commit, the usual way): a variable a checkpoint holds
    refuses its commit, and then no token is given until the commit has waited for the
    hold and landed (a worker never takes a token ahead of the update it names)."""
    from qps.errors import DeadlineExceededError
    from qps.ps.shard import Shard

    later = []
    real = Shard._sync_tokens

    async def after_the_commit(self: Shard, step: int) -> object:
        later.append(step)
        return await real(self, step)

    monkeypatch.setattr(Shard, "_sync_tokens", after_the_commit)
    a, b = await job.session("w0"), await job.session("w1")
    await control.configure(a.client, C, 1, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    await job.shard(0, 1)
    tok0, tok1 = control.tokens(a.client, C, 0), control.tokens(a.client, C, 1)

    def grad(g: float) -> dict[str, np.ndarray]:
        return {"w": np.array([g, g], np.float32)}

    await a.push(grad(1), step=0)
    await b.push(grad(3), step=0)
    assert (await tok0.take_then([], 10))[0] == 1 and (await tok1.take_then([], 10))[0] == 1
    assert (await a.pull("w")).value.tolist() == [-2.0, -2.0]
    # given in the commit's round trip (on a cluster, of other slots: the usual way)
    given_apart = [1] if a.client.cluster else []
    assert later == given_apart

    meta = keys.variable_meta(C, "w")
    far = int((await a.client.commands.time())[0]) * 1000 + 600_000
    await a.client.commands.hset(meta, mapping={"hold": far, "hold_by": "test"})
    await a.push(grad(1), step=1)
    await b.push(grad(3), step=1)
    with pytest.raises(DeadlineExceededError):  # the commit waits for the hold
        await tok0.take_then([], 0.3)
    assert (await a.pull("w")).value.tolist() == [-2.0, -2.0]
    await a.client.commands.hdel(meta, "hold", "hold_by")  # the checkpoint's release
    await a.client.commands.rpush(keys.variable_prefix(C, "w") + "unheld", 1)
    assert (await tok0.take_then([], 10))[0] == 2 and (await tok1.take_then([], 10))[0] == 2
    assert (await a.pull("w")).value.tolist() == [-4.0, -4.0]
    assert later == [*given_apart, 2]  # given the usual way, once the commit was done
    assert await a.global_step() == 2

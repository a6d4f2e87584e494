"""Synchronous training on a PS shard (SyncReplicasOptimizer semantics): each update
applies the mean of replicas_to_aggregate fresh gradients, stale ones are dropped and
counted, every worker gets a token per update; on both backends."""

from __future__ import annotations

import numpy as np
import pytest

from qps.errors import InvalidArgumentError
from qps.optimizers import SGD
from qps.ps import control
from qps.ps.messages import SparseGradient
from tests.conftest import until
from tests.test_ps_shard import C, Job, job  # noqa: F401  (the fixture)


async def test_updates_average_fresh_gradients_and_drop_stale_ones(job: Job) -> None:  # noqa: F811
    a, b = await job.session("w0"), await job.session("w1")
    await control.configure(a.client, C, 1, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    await a.variable("e", (4, 2), np.float32, initializer="zeros").create()
    await job.shard(0, 1)
    tok0, tok1 = (control.token_queue(a.client, C, k) for k in (0, 1))

    await a.push({"w": np.array([1, 2], np.float32)}, step=0)
    await b.push({"w": np.array([3, 4], np.float32)}, step=0)
    assert int(await tok0.dequeue(timeout=10)) == 1 and int(await tok1.dequeue(timeout=10)) == 1
    assert (await a.pull("w")).value.tolist() == [-2.0, -3.0]  # w -= mean
    assert await a.global_step() == 1  # one update for two pushes

    # a gradient computed from update 0 is stale now: dropped, nothing changes
    await b.push({"w": np.array([100, 100], np.float32)}, step=0)
    # sparse rows are averaged over the gradients that hold them (TF's per-index mean)
    await a.push({"e": SparseGradient(np.array([0, 1]), np.ones((2, 2), np.float32))}, step=1)
    await b.push({"e": SparseGradient(np.array([1]), np.full((1, 2), 3, np.float32))}, step=1)
    assert int(await tok0.dequeue(timeout=10)) == 2
    e = (await a.pull("e")).value
    assert e[0].tolist() == [-1.0, -1.0] and e[1].tolist() == [-2.0, -2.0]
    assert e[2:].tolist() == [[0, 0], [0, 0]]
    assert (await a.pull("w")).value.tolist() == [-2.0, -3.0]

    async def dropped() -> bool:
        s = await control.shard_status(a.client, C, 0)
        return int(s.fields.get("dropped_stale", 0)) == 1

    await until(dropped)
    assert await a.global_step() == 2


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

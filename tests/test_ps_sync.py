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

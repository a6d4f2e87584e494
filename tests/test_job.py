"""workers/job.py: the model-ready mark, worker statuses, finished workers and the
bounded-staleness (SSP) wait, on fakeredis and a real server."""

from __future__ import annotations

import asyncio

import pytest

import qps
from qps.errors import DeadlineExceededError
from tests.conftest import pending, until_blocked
from workers import job

C = "jobtest"


async def test_wait_ready_blocks_until_the_chief_marks_it(make_client):
    chief, other = await make_client(), await make_client()
    assert await job.is_ready(other, C) is None
    waiter = asyncio.create_task(job.wait_ready(other, C, 1, timeout=30))
    await until_blocked(other, task=waiter, what="wait_ready blocked in BLPOP")
    assert pending(waiter)  # it found no mark and waits for one
    await job.mark_ready(chief, C, 2, {"model": "mlp:4,3"})
    assert await asyncio.wait_for(waiter, 10) == {"model": "mlp:4,3", "num_workers": 2}
    # a worker that starts after the mark does not wait at all
    assert await job.wait_ready(other, C, 0, timeout=0.01) == {"model": "mlp:4,3", "num_workers": 2}


async def test_wait_ready_times_out(client):
    with pytest.raises(DeadlineExceededError, match="not mark the model"):
        await job.wait_ready(client, C, 0, timeout=0.05)


async def test_statuses_and_finished_workers(client):
    await job.publish_status(client, C, "worker0", {"step": 3, "loss": 0.5})
    await job.publish_status(client, C, "worker1", {"step": 1, "loss": None})
    got = await job.read_statuses(client, C)
    assert got["worker0"]["step"] == 3 and got["worker1"]["loss"] is None
    assert "time" in got["worker0"]
    assert await job.finish_worker(client, C, "worker1") == 1
    assert await job.finish_worker(client, C, "worker1") == 1  # counted once
    assert await job.finish_worker(client, C, "worker0") == 2
    assert await job.finished_workers(client, C) == {"worker0", "worker1"}


async def test_ssp_waits_for_the_slowest_running_worker(make_client):
    fast, slow = await make_client(), await make_client()
    names = ["worker0", "worker1"]
    await job.ssp_advance(fast, C, "worker0", 3, names)
    # worker0 about to run step 3 with worker1 at 0: 3 ahead, bound 2 -> waits
    waiter = asyncio.create_task(job.ssp_wait(fast, C, "worker0", 3, 2, names))
    await until_blocked(fast, task=waiter, what="ssp_wait blocked in BLPOP (3 ahead)")
    assert pending(waiter)
    await job.ssp_advance(slow, C, "worker1", 1, names)  # now 2 ahead: may go
    await asyncio.wait_for(waiter, 10)
    # within the bound: no wait at all
    assert await job.ssp_wait(fast, C, "worker0", 2, 2, names) >= 0
    # a finished worker no longer holds anyone back
    await job.ssp_advance(fast, C, "worker0", 10, names)
    waiter = asyncio.create_task(job.ssp_wait(fast, C, "worker0", 10, 2, names))
    await until_blocked(fast, task=waiter, what="ssp_wait blocked in BLPOP (9 ahead)")
    assert pending(waiter)
    await job.finish_worker(slow, C, "worker1")
    await job.ssp_advance(slow, C, "worker1", 1, names)  # the wake-up
    await asyncio.wait_for(waiter, 10)


async def test_claim_index_hands_out_1_to_w_minus_1_once_per_host(client):
    assert await job.claim_index(client, C, "host-a", 3) == 1
    assert await job.claim_index(client, C, "host-b", 3) == 2
    assert await job.claim_index(client, C, "host-a", 3) == 1  # a restart: same index
    with pytest.raises(qps.errors.FailedPreconditionError, match="every worker index"):
        await job.claim_index(client, C, "host-c", 3)

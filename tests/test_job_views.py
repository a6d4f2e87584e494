"""What the job views (`qps job status`, `qps top`, `qps queue ls|stat`, `qps ps
status`) show of a job run by the roles' own code, or written as they write it.

* the gradient traffic of a single server goes on the shards' gradient lists, not their
  queues: the shard rows count both channels, and the queue views say so;
* the chief's evaluation is published as {metric: value} (accuracy, or AUC for CTR);
* stale gradients dropped (synchronous training) show in `qps ps status` and the shard
  rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from qps import containers, keys
from qps.optimizers import SGD
from qps.ps import control, gradlist
from tests.conftest import within
from tests.test_job_cli import _run, invoke
from tests.test_ps_shard import C, Job
from tests.test_top import build_job
from workers import monitor
from workers.worker import Worker, WorkerConfig

# -- a job run by the roles' code ------------------------------------------------------------


async def test_a_real_jobs_views_count_the_gradient_list_and_the_chiefs_metric(
    make_client: Any,
) -> None:
    """One shard (a task) and the chief (workers.worker.Worker, as `qps worker` runs it:
    prepare, train, finish) train digits for 30 asynchronous steps on a single server:
    every gradient goes through the shard's gradient list. The shard row counts the 30
    arrived and taken there; the chief's own publication gives the test accuracy."""
    j = Job(make_client)
    client = await make_client()
    if client.cluster:
        pytest.skip("a cluster has no gradient list: the queue's own counters are the traffic")
    await containers.reset(client, [C])
    cfg = WorkerConfig(
        index=0, num_workers=1, num_shards=1, model="mlp:64,16,10", data="digits",
        batch_size=32, steps=30, container=C, log_every=1000, evaluate=True, finish_job=True,
    )  # fmt: skip
    try:
        await control.configure(client, C, 1, SGD(learning_rate=0.05))
        _, shard = await j.shard(0, 1)
        w = Worker(cfg, await j.session("worker0"))
        await w.prepare()
        await within(w.train(), 120, "the chief trains 30 steps", shard)
        await within(w.finish(), 120, "the chief evaluates and finishes the job", shard)
        assert await within(shard, 60, "the shard drains and exits") == "finished"
        res = w.result
        assert res.steps == 30 and res.test_metric == "accuracy"

        snap = await monitor.snapshot(client, C)
        # the chief's metric, as it published it
        assert (snap.test_metric, snap.test_value) == ("accuracy", res.test_value)
        assert snap.test_accuracy == res.test_value
        assert snap.as_dict()["test_accuracy"] == res.test_value
        # the shard's traffic: all 30 on the list, none on the queue
        (s,) = snap.shards
        assert (s.arrived, s.taken, s.applied) == (30, 30, 30)
        assert s.list is not None and (s.list.pushed, s.list.taken, s.list.waiting) == (30, 30, 0)
        assert s.queue is None or s.queue.enqueued_total == 0
        counts = await gradlist.queue_list_counts(client, C, [keys.ps_gradient_queue(0), "x"])
        assert list(counts) == ["ps/0/grads"] and counts["ps/0/grads"].pushed == 30
        st = await control.shard_status(client, C, 0)
        assert st.as_dict()["list"] == {"size": 0, "pushed": 30, "taken": 30}
    finally:
        await j.close()


# -- the commands, on a job written as the roles write it -----------------------------------


@pytest.fixture
def fresh_url(server_url: str) -> str:
    """The test server, emptied: the job commands without --container look at every job
    on it."""
    _run(server_url, lambda c: c.commands.flushall())
    return server_url


@pytest.fixture
def built(fresh_url: str) -> Iterator[str]:
    _run(fresh_url, lambda c: build_job(c, "views"))
    yield "views"


def test_queue_views_say_where_the_gradients_went(fresh_url: str, built: str) -> None:
    """`qps queue ls|stat` of a gradient queue keep the queue's own counters and add its
    shard's gradient list, where the workers of a single server push."""
    r = invoke("queue", "ls", "--url", fresh_url, "--container", built)
    assert r.exit_code == 0, r.output
    row = next(x for x in r.output.splitlines() if x.startswith("ps/0/grads "))
    assert row.split()[-2:] == ["3", "0"]  # enqueued, dequeued: the queue's own
    assert (
        f"ps/0/grads: shard 0's gradients go on its gradient list qps:{{{built}/ps/0}}:glist "
        "(a single server), not this queue: 4 pushed, 3 taken, 1 waiting"
    ) in r.output
    listed = json.loads(
        invoke("queue", "ls", "--json", "--url", fresh_url, "--container", built).output
    )
    by_name = {q["name"]: q for q in listed}
    assert by_name["ps/0/grads"]["gradient_list"] == {
        "shard": 0, "key": f"qps:{{{built}/ps/0}}:glist", "pushed": 4, "taken": 3, "waiting": 1
    }  # fmt: skip
    assert "gradient_list" not in by_name["input"]
    r = invoke("queue", "stat", "ps/0/grads", "--url", fresh_url, "--container", built)
    assert r.exit_code == 0 and "4 pushed, 3 taken, 1 waiting" in r.output
    d = json.loads(invoke("queue", "stat", "ps/0/grads", "--json", "--url", fresh_url,
                          "--container", built).output)  # fmt: skip
    assert d["enqueued_total"] == 3 and d["gradient_list"]["pushed"] == 4
    r = invoke("queue", "stat", "input", "--url", fresh_url, "--container", built)
    assert "gradient list" not in r.output


def test_dropped_stale_gradients_show_in_ps_status_and_the_shard_rows(
    fresh_url: str, built: str
) -> None:
    """A synchronous shard counts the stale gradients it drops in its stats hash
    (`dropped_stale`, tests/test_ps_sync.py): `qps ps status` shows them (text and
    --json), and `qps job status` adds a DROPPED column once a shard has some."""
    stats = keys.ps_prefix(built, 1) + "stats"
    _run(fresh_url, lambda c: c.commands.hincrby(stats, "dropped_stale", 2))
    r = invoke("ps", "status", "--url", fresh_url, "--container", built)
    header, row0, row1 = r.output.splitlines()[1:4]
    col = header.split().index("DROPPED")
    assert header.split()[col - 1] == "SKIPPED" and (row0.split()[col], row1.split()[col]) == (
        "0",
        "2",
    )
    d = json.loads(
        invoke("ps", "status", "--json", "--url", fresh_url, "--container", built).output
    )
    assert [s["dropped_stale"] for s in d["shards"]] == [0, 2]
    r = invoke("job", "status", "--url", fresh_url, "--container", built)
    lines = r.output.splitlines()
    header = next(x for x in lines if x.startswith("SHARD"))
    assert header.split()[-1] == "DROPPED"
    shard1 = next(x for x in lines if x.split()[:2] == ["1", "finished"])
    assert shard1.split()[-2:] == ["2", "2"]  # dead letters, dropped
    d = json.loads(
        invoke("job", "status", "--json", "--url", fresh_url, "--container", built).output
    )
    assert [s["dropped_stale"] for s in d["shards"]] == [0, 2]

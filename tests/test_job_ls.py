"""`qps job ls` (workers/joblist.py) and which job `qps job status|wait|stop` and `qps
top` take without --container: the only one on the server that is not finished, or
none (the candidates listed, exit code 2). The server is emptied first: these commands
look at every job on it."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import qps
from qps import containers
from qps.cli.main import cli
from qps.ps import control
from tests.test_job_views import _run, invoke
from tests.test_top import build_job
from workers import job


@pytest.fixture
def fresh_url(server_url: str) -> str:
    """The test server, emptied: the commands look at every job on it."""
    _run(server_url, lambda c: c.commands.flushall())
    return server_url


@pytest.fixture
def built(fresh_url: str) -> str:
    """A job caught running (tests/test_top.py's build_job) in container 'views'."""
    _run(fresh_url, lambda c: build_job(c, "views"))
    return "views"


def _finished_job(c: qps.Client, name: str) -> Any:
    async def go() -> None:
        await build_job(c, name)
        await control.mark_finished(c, name)
        await job.publish_status(c, name, "eval", {"auc": 0.8125})  # a CTR job's chief

    return go()


def test_job_ls_lists_the_jobs_on_the_server(fresh_url: str, built: str) -> None:
    """Every registered container that holds a job, with its state, the shards running,
    the workers reporting, the global step, its start and the chief's metric; a
    container without a job (a queue alone) is not one."""
    _run(fresh_url, lambda c: _finished_job(c, "old"))
    _run(fresh_url, lambda c: qps.FIFOQueue(4, [np.float32], shared_name="q", container="plain",
                                            client=c).enqueue(np.float32(1)))  # fmt: skip
    assert "plain" in _run(fresh_url, containers.list_containers)
    r = invoke("job", "ls", "--url", fresh_url)
    assert r.exit_code == 0, r.output
    header, *rows = r.output.splitlines()
    assert header.split() == ["CONTAINER", "STATE", "SHARDS", "WORKERS", "DONE", "STEP",
                              "STARTED", "TEST"]  # fmt: skip
    assert [x.split()[0] for x in rows] == ["old", "views"]
    # shard 0 running, shard 1 finished; 2 of the 2 workers reporting, 1 done; step 7
    assert rows[1].split()[1:6] == ["running", "1/2", "2/2", "1", "7"]
    assert rows[1].split()[-2:] == ["accuracy", "0.7500"] and rows[0].split()[-2:] == [
        "AUC",
        "0.8125",
    ]
    assert rows[0].split()[1] == "finished"
    d = json.loads(invoke("job", "ls", "--json", "--url", fresh_url).output)
    views = next(x for x in d if x["container"] == "views")
    assert {k: views[k] for k in ("state", "num_shards", "shards_running", "num_workers",
                                  "workers_reporting", "workers_done", "global_step",
                                  "test_metric", "test_value")} == {
        "state": "running", "num_shards": 2, "shards_running": 1, "num_workers": 2,
        "workers_reporting": 2, "workers_done": 1, "global_step": 7,
        "test_metric": "accuracy", "test_value": 0.75,
    }  # fmt: skip
    assert views["started"] is not None and 0 < views["started"] < d[0]["started"] + 3600
    r = invoke("job", "ls", "--url", _emptied(fresh_url))
    assert r.exit_code == 0 and r.output.strip() == "no training job on the server"


def _emptied(url: str) -> str:
    _run(url, lambda c: c.commands.flushall())
    return url


def test_without_container_the_commands_take_the_only_job_not_finished(
    fresh_url: str, built: str
) -> None:
    url = ("--url", fresh_url)
    _run(fresh_url, lambda c: _finished_job(c, "old"))
    # one job not finished (and one finished): every command takes it
    r = invoke("job", "status", *url)
    assert r.exit_code == 0 and r.output.startswith("container views: job running"), r.output
    r = CliRunner().invoke(cli, ["job", "wait", "--timeout", "0.2", *url])  # shard 1 is done
    assert r.exit_code == 4, r.output
    assert "the job in container 'views' did not come to running" in r.output
    r = invoke("top", "--once", "--json", "--interval", "0.05", *url)
    assert r.exit_code == 0 and json.loads(r.output)["container"] == "views"
    # --container (or QPS_CONTAINER) still names one, finished or not
    r = invoke("job", "status", "--container", "old", *url)
    assert r.output.startswith("container old: job finished")
    r = CliRunner(env={"QPS_CONTAINER": "old"}).invoke(cli, ["job", "status", *url])
    assert r.exit_code == 0 and r.output.startswith("container old: job finished")

    # two jobs not finished: each command lists them and exits 2, changing nothing
    _run(fresh_url, lambda c: control.configure(c, "other", 1))
    for args in (["job", "status"], ["job", "wait", "--timeout", "1"], ["job", "stop", "--yes"],
                 ["top", "--once"]):  # fmt: skip
        r = CliRunner().invoke(cli, [*args, *url])
        assert r.exit_code == 2, (args, r.output)
        assert (
            "2 jobs on the server are not finished: other (starting, global step 0), " in r.output
        )
        assert "views (running, global step 7); name one with --container" in r.output
    assert _run(fresh_url, lambda c: job.stop_requested(c, "views")) is None
    assert _run(fresh_url, lambda c: job.stop_requested(c, "other")) is None

    # one again: `qps job stop` stops it
    _run(fresh_url, lambda c: control.mark_finished(c, "other"))
    r = invoke("job", "stop", "--yes", *url)
    assert r.exit_code == 0 and "stop requested for the job in container 'views'" in r.output
    # none left: exit 2, naming the finished ones
    r = CliRunner().invoke(cli, ["job", "status", *url])
    assert (
        r.exit_code == 2
        and (
            "no job on the server that is not finished (finished: old, other, views); name one "
            "with --container"
        )
        in r.output
    ), r.output

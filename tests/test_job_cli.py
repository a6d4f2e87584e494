"""`qps job status` and `qps job stop`, the stop mark and the wait for done workers
(workers/job.py) on fakeredis and a real server, and a real `qps train` job stopped by
`qps job stop`: every worker stops after its step, every role exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import qps
from qps import keys
from qps.cli.main import cli
from qps.errors import DeadlineExceededError, NotFoundError
from qps.optimizers import make_optimizer
from qps.ps import control
from tests.conftest import on_cluster, pending, until_blocked, within
from tests.test_top import build_job
from workers import job, monitor

REPO = str(Path(__file__).resolve().parents[1])
C = "jobcli"


# -- the stop mark and the wait, on both backends -------------------------------------------


async def test_request_stop_keeps_the_first_request(client):
    assert await job.stop_requested(client, C) is None
    first = await job.request_stop(client, C, "maintenance")
    assert first["reason"] == "maintenance" and first["time"] > 0
    again = await job.request_stop(client, C, "another")
    assert again == first == await job.stop_requested(client, C)


async def test_wait_workers_done_blocks_until_the_last_one_finishes(make_client):
    waiter_client, worker = await make_client(), await make_client()
    assert await job.wait_workers_done(waiter_client, C, timeout=0.01) == []  # none known
    await job.publish_status(worker, C, "worker0", {"state": "training", "step": 3})
    await job.publish_status(worker, C, "worker1", {"state": "done", "step": 5})
    await job.publish_status(worker, C, "eval", {"accuracy": 0.5})  # not a worker
    with pytest.raises(DeadlineExceededError, match="worker0 of container 'jobcli' not done"):
        await job.wait_workers_done(waiter_client, C, timeout=0.05)
    waiter = asyncio.create_task(job.wait_workers_done(waiter_client, C, timeout=30))
    await until_blocked(waiter_client, task=waiter, what="wait_workers_done blocked in BLPOP")
    assert pending(waiter)  # worker0 is not done: it waits
    await job.finish_worker(worker, C, "worker0")  # recorded done: wakes the waiter
    assert await asyncio.wait_for(waiter, 10) == ["worker0", "worker1"]


async def _shard_up(client: qps.Client, container: str, shard: int, state: str) -> None:
    """Shard ``shard`` as a running (or finished) shard leaves its stats and lease."""
    prefix = keys.ps_prefix(container, shard)
    now_ms = int(time.time() * 1000)
    await client.commands.hset(prefix + "stats", mapping={"state": state, "heartbeat_ms": now_ms})
    await client.commands.set(prefix + "lease", "1 host:1:abc")


async def test_wait_for_running_needs_every_shard_and_worker_up(make_client):
    c = _container()
    waiter_client, role = await make_client(), await make_client()
    waiter = asyncio.create_task(monitor.wait_for(waiter_client, c, "running", timeout=60))
    await until_blocked(waiter_client, task=waiter, what="a wait for a job not started yet")
    with pytest.raises(DeadlineExceededError, match=r"to serving .*\(the container holds no job"):
        await monitor.wait_for(role, c, "serving", timeout=0.1)
    await control.configure(role, c, 2, make_optimizer("sgd", learning_rate=0.1))
    # a worker waiting for the chief publishes a status: the job is not running yet
    await job.publish_status(role, c, "worker1", {"state": "waiting", "step": 0})
    with pytest.raises(DeadlineExceededError, match=r"\(the model is not ready, .*0 of 1"):
        await monitor.wait_for(role, c, "running", timeout=0.2)
    await job.mark_ready(role, c, 2, {"model": "mlp:4,3"})
    await _shard_up(role, c, 0, "running")
    with pytest.raises(DeadlineExceededError, match=r"to serving .*\(shard 1 never started\)"):
        await monitor.wait_for(role, c, "serving", timeout=0.1)
    await job.publish_status(role, c, "worker0", {"state": "training", "step": 1})
    # shard 1 never started and worker1 never published: not running yet
    with pytest.raises(DeadlineExceededError, match=r"did not come to running .*\(shard 1 never started, 1 of 2 worker"):
        await monitor.wait_for(role, c, "running", timeout=0.2)
    await job.publish_status(role, c, "worker1", {"state": "training", "step": 1})
    with pytest.raises(DeadlineExceededError, match=r"\(shard 1 never started, 2 of 2 work"):
        await monitor.wait_for(role, c, "running", timeout=0.2)  # shard 1 still down
    assert pending(waiter)
    await _shard_up(role, c, 1, "running")
    snap = await within(waiter, 30, "the wait ends once every role is up")
    assert snap.state == "running" and len(snap.workers) == 2
    assert (await monitor.wait_for(role, c, "serving", timeout=0)).num_shards == 2
    # finished: the PS job marked finished and no shard running any more
    await control.mark_finished(role, c)
    with pytest.raises(DeadlineExceededError, match=r"to finished .*\(shard 0 running, shard 1"):
        await monitor.wait_for(role, c, "finished", timeout=0.2)
    await _shard_up(role, c, 0, "finished")
    await _shard_up(role, c, 1, "finished")
    assert (await monitor.wait_for(role, c, "finished", timeout=30)).finished
    # a finished job has been running: a wait for running ends at once
    assert (await monitor.wait_for(role, c, "running", timeout=0)).state == "finished"


def test_worker_names_in_index_order() -> None:
    statuses: dict[str, dict[str, Any]] = {
        n: {"state": "training"} for n in ["worker10", "worker2", "worker0", "chief"]
    }
    statuses["eval"] = {"accuracy": 1.0}
    assert job.worker_names(statuses) == ["chief", "worker0", "worker2", "worker10"]


# -- the commands ----------------------------------------------------------------------------


def _container() -> str:
    return f"jobcli-{secrets.token_hex(4)}"


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def _run(url: str, fn: Any) -> Any:
    async def go() -> Any:
        async with await qps.connect(url) as c:
            return await fn(c)

    return asyncio.run(go())


@pytest.fixture
def built(redis_url: str) -> str:
    c = _container()
    _run(redis_url, lambda cl: build_job(cl, c))
    return c


def test_status_text_and_json(redis_url: str, built: str) -> None:
    r = invoke("job", "status", "--url", redis_url, "--container", built)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == (
        f"container {built}: job running, global step 7, 2 PS shard(s), sgd(learning_rate=0.1)"
    )
    assert "test accuracy 0.7500" in r.output and "dead letters 2" in r.output
    w0 = next(x for x in lines if x.startswith("worker0"))
    assert w0.split()[:6] == ["worker0", "training", "10", "640", "0.5000", "100"]
    shard0 = next(x for x in lines if x.split()[:2] == ["0", "running"])
    # arrived, taken (the queue's and the gradient list's), applied, queue, lag, p50, p99, dlq
    cluster = on_cluster(redis_url)  # no gradient lists there: the queue alone
    want = ["3", "0", "10", "3/8", "3"] if cluster else ["7", "3", "10", "3/8", "4"]
    assert shard0.split()[2:] == [*want, "2", "3", "0"]
    assert "DROPPED" not in r.output  # no shard dropped a stale gradient
    shard1 = next(x for x in lines if x.split()[:2] == ["1", "finished"])
    assert shard1.split()[-1] == "2"  # dead letters
    assert any(x.split()[:3] == ["input", "FIFOQueue", "5/100"] for x in lines)

    r = invoke("job", "status", "--json", "--url", redis_url, "--container", built)
    d = json.loads(r.output)
    assert d["global_step"] == 7 and d["num_shards"] == 2 and d["state"] == "running"
    assert [w["name"] for w in d["workers"]] == ["worker0", "worker1"]
    assert d["shards"][1]["dead_letters"] == 2
    s0 = d["shards"][0]
    if cluster:
        assert s0["lag"] == 3 and (s0["arrived"], s0["taken"]) == (3, 0) and s0["list"] is None
    else:
        assert s0["lag"] == 4 and (s0["arrived"], s0["taken"]) == (7, 3)
        assert s0["list"] == {"shard": 0, "key": f"qps:{{{built}/ps/0}}:glist", "waiting": 1,
                              "pushed": 4, "taken": 3}  # fmt: skip
    assert s0["dropped_stale"] == 0
    assert (d["test_metric"], d["test_value"], d["test_accuracy"]) == ("accuracy", 0.75, 0.75)


def test_a_ctr_jobs_auc_is_shown_as_its_metric(redis_url: str, built: str) -> None:
    """A CTR model's chief publishes {"auc": v} (workers.worker.evaluate_params): shown
    as the test AUC, and not as an accuracy."""
    _run(redis_url, lambda cl: job.publish_status(cl, built, "eval", {"auc": 0.8125}))
    r = invoke("job", "status", "--url", redis_url, "--container", built)
    assert "test AUC 0.8125" in r.output and "accuracy" not in r.output
    d = json.loads(invoke("job", "status", "--json", "--url", redis_url, "--container", built).output)
    assert (d["test_metric"], d["test_value"], d["test_accuracy"]) == ("auc", 0.8125, None)


def test_status_not_found(redis_url: str) -> None:
    r = invoke("job", "status", "--url", redis_url, "--container", _container())
    assert r.exit_code == 3 and "no training job in container" in r.output


def test_wait_command_prints_the_state_or_times_out(redis_url: str, built: str) -> None:
    where = ["--url", redis_url, "--container", built]
    r = invoke("job", "wait", "--for", "done", "--timeout", "0.1", *where)
    assert r.exit_code == 4, r.output
    assert "did not come to done within 0.1 s (worker0 training)" in r.output
    _run(redis_url, lambda cl: job.finish_worker(cl, built, "worker0"))
    r = invoke("job", "wait", "--for", "done", "--timeout", "30", *where)
    assert r.exit_code == 0, r.output
    assert r.output == (
        f"container {built}: job done, global step 7, 2 worker(s), 2 PS shard(s)\n"
    )


def test_wait_for_serving_before_any_worker_says_serving(redis_url: str) -> None:
    """Shards up, no worker yet: the job's own state is still "starting", but the line
    names the state waited for (it said "job starting" when the shards served)."""
    c = _container()

    async def serving(cl: qps.Client) -> None:
        await control.configure(cl, c, 2, make_optimizer("sgd", learning_rate=0.1))
        for shard in (0, 1):
            await _shard_up(cl, c, shard, "running")

    _run(redis_url, serving)
    r = invoke("job", "wait", "--for", "serving", "--timeout", "30", "--url", redis_url,
               "--container", c)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.output == (
        f"container {c}: job serving (no worker yet), global step 0, 0 worker(s), "
        "2 PS shard(s)\n"
    )


def test_stop_asks_unless_yes(redis_url: str, built: str, monkeypatch: pytest.MonkeyPatch) -> None:
    r = invoke("job", "stop", "--url", redis_url, "--container", built)
    assert r.exit_code == 2 and "pass --yes" in r.output  # stdin is not a terminal
    monkeypatch.setattr("qps.cli.job.interactive", lambda: True)
    r = invoke("job", "stop", "--url", redis_url, "--container", built, input="n\n")
    assert r.exit_code == 1 and "not confirmed" in r.output
    assert "global step 7, 1 worker(s) running, 2 shard(s)" in r.output
    snap = _run(redis_url, lambda cl: monitor.snapshot(cl, built))
    assert snap.stop_requested is None and not snap.finished  # nothing changed
    r = invoke("job", "stop", "--url", redis_url, "--container", built, input="y\n")
    assert r.exit_code == 0 and "stop requested" in r.output


def test_stop_marks_the_job_and_waits_for_the_workers(redis_url: str, built: str) -> None:
    r = invoke("job", "stop", "--yes", "--timeout", "0.2", "--url", redis_url, "--container", built)
    assert r.exit_code == 4, r.output  # worker0 never ends here
    assert "worker0" in r.output and "not done within 0.2 s" in r.output
    snap = _run(redis_url, lambda cl: monitor.snapshot(cl, built))
    assert snap.finished and snap.stop_requested is not None and snap.state == "finished"
    assert snap.shards[0].queue is not None and snap.shards[0].queue.closed
    # a push now fails: this is what ends a worker in the middle of a step
    assert _run(redis_url, lambda cl: control.is_finished(cl, built))

    async def worker0_ends(cl: qps.Client) -> None:
        await job.publish_status(cl, built, "worker0", {"state": "done", "step": 11})
        await job.finish_worker(cl, built, "worker0")

    _run(redis_url, worker0_ends)
    r = invoke("job", "stop", "-y", "--timeout", "10", "--url", redis_url, "--container", built)
    assert r.exit_code == 0, r.output
    # the queues were closed by the first stop (or by the last worker): still said the same way
    assert "PS job marked finished (2 gradient queue(s) closed)" in r.output
    assert "2 worker(s) done at global step 7" in r.output
    assert "worker0: done, 11 step(s)" in r.output and "shard 1: finished" in r.output


def test_stop_not_found(redis_url: str) -> None:
    r = invoke("job", "stop", "--yes", "--url", redis_url, "--container", _container())
    assert r.exit_code == 3 and "no training job" in r.output


# -- a real job ------------------------------------------------------------------------------


def _qps(*args: str) -> list[str]:
    return [sys.executable, "-m", "qps.cli.main", *args]


def _wait_training(url: str, c: str, train: subprocess.Popen[str], workers: int = 2) -> None:
    """Until every worker of the job in container ``c`` (run by ``train``) has trained
    10 steps; fails if ``train`` exits first or after 120 s."""

    async def training(cl: qps.Client) -> bool:
        try:
            snap = await monitor.snapshot(cl, c)
        except NotFoundError:
            return False
        return len(snap.workers) == workers and all(w.step >= 10 for w in snap.workers)

    end = time.monotonic() + 120
    while not _run(url, training):
        assert train.poll() is None, (train.communicate()[1] or "see its log")[-3000:]
        assert time.monotonic() < end, "the job did not start training"
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_job_stop_ends_a_real_training_job(redis_url: str) -> None:
    """`qps train` (1 shard, 2 workers, a million steps each) on the test server; once
    both workers train, `qps top --once --json` sees them move and `qps job stop`
    ends the job: the workers log why they stopped and the whole run exits 0."""
    c = _container()
    env = {**os.environ, "PYTHONPATH": REPO}
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the test process
    train = subprocess.Popen(
        _qps(
            "train",
            "--url",
            redis_url,
            "--container",
            c,
            "--ps",
            "1",
            "--workers",
            "2",
            "--steps",
            "1000000",
            "--log-every",
            "10",
            "--json",
        ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,  # a file: an unread pipe fills up and blocks the job (see below)
        text=True,
        env=env,
    )
    try:
        _wait_training(redis_url, c, train)

        top = subprocess.run(
            _qps(
                "top", "--once", "--json", "--interval", "0.5", "--url", redis_url, "--container", c
            ),
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert top.returncode == 0, top.stderr
        d = json.loads(top.stdout)
        assert [w["state"] for w in d["workers"]] == ["training", "training"]
        assert d["rates"]["global_steps_per_s"] > 0 and d["shards"][0]["state"] == "running"

        stop = subprocess.run(
            _qps("job", "stop", "--yes", "--timeout", "60", "--url", redis_url, "--container", c),
            capture_output=True,
            text=True,
            env=env,
            timeout=90,
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "2 worker(s) done" in stop.stdout
        out, _ = train.communicate(timeout=120)
        log.seek(0)
        err = log.read()
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert train.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert result["stopped"] == "finished" and result["failed"] == {}
    for w in ("worker0", "worker1"):
        assert f"{w}: stopped after" in err and "stop requested (qps job stop)" in err, err[-3000:]
    snap = _run(redis_url, lambda cl: monitor.snapshot(cl, c))
    assert snap.state == "finished" and [w.state for w in snap.workers] == ["done", "done"]
    assert [s.state for s in snap.shards] == ["finished"]
    # every step a worker pushed was applied exactly once before the shard exited
    assert snap.global_step == sum(w.step for w in snap.workers) == result["global_step"]


@pytest.mark.timeout(240)
def test_the_stop_mark_alone_stops_a_worker(redis_url: str) -> None:
    """Without the finished mark (so no push fails), a worker is woken by the stop
    request (it waits for one in Redis beside its training) and stops after the step in
    hand; `qps train` then finishes the job as at a normal end."""
    c = _container()
    env = {**os.environ, "PYTHONPATH": REPO}
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the test process
    train = subprocess.Popen(
        _qps("train", "--url", redis_url, "--container", c, "--ps", "1", "--workers", "1",
             "--steps", "1000000", "--log-every", "10", "--json"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
    )  # fmt: skip
    try:

        async def training(cl: qps.Client) -> bool:
            statuses = await job.read_statuses(cl, c)
            return int(statuses.get("worker0", {}).get("step", 0)) >= 10

        end = time.monotonic() + 120
        while not _run(redis_url, training):
            assert train.poll() is None, (log.seek(0), log.read()[-3000:])
            assert time.monotonic() < end, "the job did not start training"
            time.sleep(0.2)
        assert not _run(redis_url, lambda cl: control.is_finished(cl, c))
        _run(redis_url, lambda cl: job.request_stop(cl, c, "test"))
        out, _ = train.communicate(timeout=120)
        log.seek(0)
        err = log.read()
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert train.returncode == 0, err[-3000:]
    assert json.loads(out)["stopped"] == "finished"
    assert "worker0: stopped after" in err and "stop requested (test)" in err, err[-3000:]
    snap = _run(redis_url, lambda cl: monitor.snapshot(cl, c))
    (w,) = snap.workers
    assert w.state == "done" and w.step >= 10
    assert snap.global_step == w.step


def _children_with(pid: int, needle: str) -> list[int]:
    """Pids of the processes under ``pid`` (any depth) whose command line has ``needle``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for k in kids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if needle in cmd:
                out.append(k)
            todo.append(k)
    return out


@pytest.mark.timeout(240)
def test_one_command_answers_on_a_real_job(redis_url: str) -> None:
    """The operator's questions on a real `qps train` job (2 shards, 2 workers), one
    command each: which worker is slow (worker1, SIGSTOPped: its step stands still and
    its status ages, in `qps job status`), which shard is behind and how stale the
    gradients are (the shard rows' lag and staleness), and what is in a queue
    (`qps queue peek` of a gradient queue)."""
    import signal

    c = _container()
    env = {**os.environ, "PYTHONPATH": REPO}
    args = ("train", "--url", redis_url, "--container", c, "--ps", "2", "--workers", "2",
            "--steps", "1000000", "--log-every", "5", "--json")  # fmt: skip
    # the roles' log goes to a file: a pipe nobody reads until the end fills up (64 KiB,
    # soon with --log-every 5 on a loaded machine) and blocks the launcher and the roles
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the test process
    train = subprocess.Popen(_qps(*args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=log, text=True, env=env)  # fmt: skip
    stopped: list[int] = []

    def logged() -> str:
        log.seek(0)
        return log.read()

    def status() -> dict[str, Any]:
        r = subprocess.run(_qps("job", "status", "--json", "--url", redis_url, "--container", c),
                           capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)  # type: ignore[no-any-return]

    def steps(d: dict[str, Any]) -> dict[str, int]:
        return {w["name"]: w["step"] for w in d["workers"]}

    try:
        _wait_training(redis_url, c, train)
        slow = _children_with(train.pid, "worker --index 1 ")
        assert len(slow) == 1, slow
        os.kill(slow[0], signal.SIGSTOP)
        stopped.append(slow[0])
        before = status()
        end = time.monotonic() + 60
        while True:  # until worker0 has moved on by a few published steps
            after = status()
            if steps(after)["worker0"] >= steps(before)["worker0"] + 10:
                break
            assert time.monotonic() < end, after
            time.sleep(0.2)
        # which worker is slow: worker1's step stood still, its status is the oldest
        assert steps(after)["worker1"] == steps(before)["worker1"]
        ages = {w["name"]: w["age_s"] for w in after["workers"]}
        assert ages["worker1"] > ages["worker0"], ages
        text = subprocess.run(_qps("job", "status", "--url", redis_url, "--container", c),
                              capture_output=True, text=True, env=env, timeout=60).stdout  # fmt: skip
        assert any(line.split()[:2] == ["worker1", "training"] for line in text.splitlines())
        # which shard is behind, how stale: every shard row has its lag and staleness
        assert [s["shard"] for s in after["shards"]] == [0, 1]
        for s in after["shards"]:
            assert s["state"] == "running" and s["lag"] is not None and s["lag"] >= 0
            assert s["applied"] > 0 and s["staleness_p99"] is not None
            assert 0 <= s["staleness_p50"] <= s["staleness_p99"]
        assert after["staleness_p99"] is not None
        # what is in a queue: peek shows the gradient messages waiting (or none)
        peek = subprocess.run(_qps("queue", "peek", "ps/0/grads", "-n", "2", "--url", redis_url,
                                   "--container", c), capture_output=True, text=True, env=env,
                              timeout=60)  # fmt: skip
        assert peek.returncode == 0, peek.stderr
        assert "ps/0/grads" in peek.stdout and "FIFOQueue" in peek.stdout
        os.kill(slow[0], signal.SIGCONT)
        stopped.clear()
        stop = subprocess.run(
            _qps("job", "stop", "--yes", "--timeout", "60", "--url", redis_url, "--container", c),
            capture_output=True, text=True, env=env, timeout=90,
        )  # fmt: skip
        assert stop.returncode == 0, stop.stdout + stop.stderr + logged()[-3000:]
        out, _ = train.communicate(timeout=120)
        err = logged()
    finally:
        for p in stopped:
            os.kill(p, signal.SIGCONT)
        if train.poll() is None:
            train.kill()
            train.wait()
    assert train.returncode == 0, err[-3000:]
    assert json.loads(out)["stopped"] == "finished"

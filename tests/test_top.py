"""workers/monitor.py (the job snapshot and its rates) on fakeredis and a real server,
and `qps top`: --once --json, the rendering, and the live dashboard in a real
pseudo-terminal (its screen shows the workers, shards and queues; Ctrl-C exits 0)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import re
import secrets
import select
import signal
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

import qps
from qps import keys
from qps.cli.job import fmt_depth
from qps.cli.main import cli
from qps.cli.top import bar, render
from qps.errors import NotFoundError
from qps.optimizers import make_optimizer
from qps.ps import control, gradlist
from qps.ps.gradlist import GradientList
from qps.queues import FIFOQueue
from qps.transport import Client
from workers import job, monitor

REPO = str(Path(__file__).resolve().parents[1])
C = "toptest"


async def build_job(client: Client, container: str) -> None:
    """A job caught mid-run, written with the functions the roles use (and a shard's
    stats hash as a shard writes it): 2 shards (SGD 0.1), global step 7; shard 0
    running with 3 messages in its gradient queue, and 4 pushed onto its gradient list
    (the lean channel of a single server) of which it took 3; shard 1 finished with 2
    dead letters;
    worker0 training at step 10, worker1 done at step 12; an input queue holding 5 of
    100; a chief's eval record."""
    await control.configure(client, container, 2, make_optimizer("sgd", learning_rate=0.1))
    await control.global_step_counter(client, container).add(7)
    grads = control.gradient_queue(client, container, 0)
    for _ in range(3):
        await grads.enqueue(np.zeros(4, np.uint8))
    now_ms = int(time.time() * 1000)
    p0, p1 = keys.ps_prefix(container, 0), keys.ps_prefix(container, 1)
    await client.commands.hset(
        p0 + "stats",
        mapping={
            "state": "running",
            "applied": 10,
            "variables": 2,
            "heartbeat_ms": now_ms,
            "stale|worker0|1": 4,
            "stale|worker0|3": 1,
            "stale|worker1|2": 5,
        },
    )
    await client.commands.set(p0 + "lease", "3 host:1:abc")
    if not client.cluster:  # pushed with a worker's commands, counted as a shard counts
        gl = GradientList(client, container, 0)
        for i in range(4):
            await client.run_commands([gl.push_command(b"m%d" % i), gl.count_command()])
        await client.commands.lpop(gl.key, 3)
        await client.commands.hincrby(p0 + "stats", gradlist.TAKEN, 3)
    await client.commands.hset(
        p1 + "stats", mapping={"state": "finished", "applied": 5, "stale|worker1|0": 5}
    )
    for i in range(2):
        await client.commands.rpush(
            p1 + "dlq", control.encode_dead_letter({"reason": f"nan {i}", "worker": "worker0"})
        )
    await job.mark_ready(client, container, 2, {"model": "mlp:4,3"})
    await job.publish_status(
        client,
        container,
        "worker0",
        {
            "state": "training",
            "step": 10,
            "examples": 640,
            "loss": 0.5,
            "examples_per_s": 100.0,
            "started_at": time.time() - 60,
        },
    )
    await job.publish_status(
        client, container, "worker1", {"state": "done", "step": 12, "examples": 768, "loss": 0.25}
    )
    await job.finish_worker(client, container, "worker1")
    # what the chief publishes (workers.worker: {metric: value}, metric "accuracy" or "auc")
    await job.publish_status(client, container, "eval", {"accuracy": 0.75})
    inp = FIFOQueue(100, [np.float32], shared_name="input", container=container, client=client)
    await inp.enqueue_many(np.zeros(5, np.float32))


# -- the snapshot, on both backends ---------------------------------------------------------


async def test_snapshot_reads_config_workers_shards_and_queues(client):
    await build_job(client, C)
    snap = await monitor.snapshot(client, C)
    assert snap.num_shards == 2 and snap.optimizer == {"name": "sgd", "learning_rate": 0.1}
    assert snap.global_step == 7 and not snap.finished and snap.stop_requested is None
    assert snap.state == "running" and snap.test_accuracy == 0.75
    assert (snap.test_metric, snap.test_value) == ("accuracy", 0.75)
    assert snap.ready == {"model": "mlp:4,3", "num_workers": 2}

    w0, w1 = snap.workers  # the eval record is not a worker
    assert (w0.name, w0.state, w0.step, w0.examples, w0.loss) == (
        "worker0",
        "training",
        10,
        640,
        0.5,
    )
    assert w0.examples_per_s == 100.0 and not w0.done and 0 <= w0.age_s < 60
    assert (w1.name, w1.state, w1.done) == ("worker1", "done", True)
    # worker0's staleness: {1: 4, 3: 1}; worker1's over both shards: {2: 5, 0: 5}
    assert (w0.messages, w0.staleness_p50, w0.staleness_p99) == (5, 1, 3)
    assert (w1.messages, w1.staleness_p50, w1.staleness_p99) == (10, 0, 2)

    s0, s1 = snap.shards
    assert (s0.state, s0.owner, s0.token, s0.applied, s0.variables) == (
        "running",
        "host:1:abc",
        3,
        10,
        2,
    )
    assert s0.queue is not None and (s0.queue.size, s0.queue.capacity) == (3, 8)
    assert (s0.staleness_p50, s0.staleness_p99) == (2, 3)  # {1: 4, 2: 5, 3: 1}
    if client.cluster:  # no gradient lists on a cluster: the queue alone
        assert s0.lag == 3 and (s0.arrived, s0.taken) == (3, 0) and s0.list is None
    else:
        # waiting: 3 in the queue and 1 in the list
        assert s0.lag == 4
        # the messages that came and went on both channels: the queue's 3, the list's 4, 3
        assert (s0.arrived, s0.taken) == (7, 3)
        assert s0.list == monitor.ListRow(0, gradlist.gradient_list_key(C, 0), 1, 4, 3)
        assert s0.list.name == "ps/0/glist"
    assert (s1.arrived, s1.taken) == (0, 0) and s0.dropped_stale == 0
    assert s0.heartbeat_age_s is not None and s0.heartbeat_age_s < 60
    assert (s1.state, s1.applied, s1.dead_letters) == ("finished", 5, 2)
    assert s1.queue is None and s1.lag is None  # nothing pushed to shard 1 yet
    assert (snap.staleness_p50, snap.staleness_p99) == (1, 3)

    assert [q.name for q in snap.queues] == ["input"]  # gradient queues are the shards'
    q = snap.queues[0]
    assert (q.type, q.size, q.capacity, q.closed, q.enqueued_total) == (
        "FIFOQueue",
        5,
        100,
        False,
        5,
    )
    assert snap.dead_letters == 2

    d = json.loads(json.dumps(snap.as_dict()))  # JSON-ready
    assert d["state"] == "running" and d["dead_letters"] == 2
    assert d["shards"][0]["queue"]["size"] == 3 and d["workers"][1]["done"] is True


async def test_snapshot_states_and_not_found(client):
    with pytest.raises(NotFoundError, match="no training job in container 'empty'"):
        await monitor.snapshot(client, "empty")
    assert not await monitor.job_exists(client, "empty")
    # a PS config alone is a job that is starting
    await control.configure(client, "cfg", 1)
    snap = await monitor.snapshot(client, "cfg")
    assert snap.state == "starting" and snap.workers == () and snap.global_step == 0
    assert snap.optimizer is None and await monitor.job_exists(client, "cfg")
    await build_job(client, C)
    await job.request_stop(client, C)
    assert (await monitor.snapshot(client, C)).state == "stopping"
    await control.mark_finished(client, C)
    snap = await monitor.snapshot(client, C)
    assert snap.state == "finished" and snap.shards[0].queue is not None
    assert snap.shards[0].queue.closed


async def test_rates_from_two_snapshots(client):
    await build_job(client, C)
    first = await monitor.snapshot(client, C)
    await control.global_step_counter(client, C).add(20)
    await client.commands.hincrby(keys.ps_prefix(C, 0) + "stats", "applied", 20)
    await job.publish_status(client, C, "worker0", {"state": "training", "step": 30})
    grads = control.gradient_queue(client, C, 0)
    await grads.dequeue()
    await grads.dequeue()
    gl = GradientList(client, C, 0)  # 2 more pushed onto the list, 2 taken from it
    for i in range(2 if not client.cluster else 0):
        await client.run_commands([gl.push_command(b"n%d" % i), gl.count_command()])
    await client.commands.hincrby(keys.ps_prefix(C, 0) + "stats", gradlist.TAKEN, 2)
    second = await monitor.snapshot(client, C)
    r = monitor.rates(first, second)
    dt = second.time - first.time
    assert r.seconds == pytest.approx(dt)
    assert r.global_steps_per_s == pytest.approx(20 / dt)
    assert r.shard_applies_per_s == {0: pytest.approx(20 / dt), 1: 0.0}
    w0_before, w0_after = first.workers[0], second.workers[0]
    assert w0_before.status_time is not None and w0_after.status_time is not None
    assert r.worker_steps_per_s["worker0"] == pytest.approx(
        20 / (w0_after.status_time - w0_before.status_time)
    )
    assert r.worker_steps_per_s["worker1"] == 0.0  # done
    assert r.queue_dequeues_per_s["ps/0/grads"] == pytest.approx(2 / dt)
    assert r.queue_dequeues_per_s["input"] == 0.0
    if not client.cluster:  # (a cluster has no gradient lists)
        # the shard's traffic on both channels: 2 arrived (list), 4 taken (2 + 2)
        assert r.shard_arrivals_per_s == {0: pytest.approx(2 / dt), 1: 0.0}
        assert r.shard_takes_per_s == {0: pytest.approx(4 / dt), 1: 0.0}
        assert r.list_takes_per_s == {"ps/0/glist": pytest.approx(2 / dt), "ps/1/glist": 0.0}
    # no new status from worker0: its last known rate is kept
    third = await monitor.snapshot(client, C)
    r2 = monitor.rates(second, third, r)
    assert r2.worker_steps_per_s["worker0"] == r.worker_steps_per_s["worker0"]
    assert r2.global_steps_per_s == 0.0
    assert json.loads(json.dumps(r2.as_dict()))["shard_applies_per_s"]["0"] == 0.0


def _snap(**kw: object) -> monitor.JobSnapshot:
    base = monitor.JobSnapshot(
        container="c", time=100.0, num_shards=None, optimizer=None, ready=None,
        finished=False, stop_requested=None, global_step=50, test_metric=None, test_value=None,
        workers=(), shards=(), queues=(), staleness_p50=None, staleness_p99=None,
    )  # fmt: skip
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def _worker(name: str, step: int, t: float, state: str = "training") -> monitor.WorkerRow:
    return monitor.WorkerRow(
        name=name, state=state, step=step, examples=step * 10, loss=None, examples_per_s=None,
        global_step=None, status_time=t, age_s=0.0, done=state == "done", messages=0,
        staleness_p50=None, staleness_p99=None,
    )  # fmt: skip


def test_rates_edge_cases() -> None:
    a = _snap(workers=(_worker("w0", 10, 90.0), _worker("w1", 5, 90.0)))
    b = _snap(
        time=102.0,
        global_step=70,
        workers=(_worker("w0", 30, 94.0), _worker("w1", 5, 90.0), _worker("w2", 1, 101.0)),
    )
    r = monitor.rates(a, b)
    assert r.global_steps_per_s == 10.0
    assert r.worker_steps_per_s == {"w0": 5.0, "w1": None, "w2": None}  # w1: no news yet
    # a counter that went backwards (the container was reset): unknown, not negative
    assert monitor.rates(b, _snap(time=103.0, global_step=3)).global_steps_per_s is None
    # no time between the two: unknown
    assert monitor.rates(a, a).global_steps_per_s is None


# -- rendering -------------------------------------------------------------------------------


def _text(renderable: object, width: int = 160) -> str:
    console = Console(record=True, width=width, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def test_bar() -> None:
    assert bar(0, 8, 8).plain == "░" * 8
    assert bar(8, 8, 8).plain == "█" * 8
    assert bar(4, 8, 8).plain == "████░░░░"
    assert bar(1, 1000, 10).plain == "█" + "░" * 9  # something waiting always shows
    assert bar(5, -1, 4).plain == "░░░░"  # unbounded
    assert fmt_depth(5, -1) == "5/inf" and fmt_depth(3, 8) == "3/8"


async def test_render_shows_workers_shards_and_queues(client):
    await build_job(client, C)
    first = await monitor.snapshot(client, C)
    second = await monitor.snapshot(client, C)
    text = _text(render(second, monitor.rates(first, second), 1.0))
    for needle in ["container toptest", "job running", "global step 7", "sgd(learning_rate=0.1)",
                   "worker0", "worker1", "training", "0.5000", "ps/0/grads", "input", "3/8",
                   "5/100", "dead letters 2", "test accuracy 0.7500", "finished",
                   "ARRIVED/S", "TAKEN/S", "APPLIES/S"]:  # fmt: skip
        assert needle in text, (needle, text)
    # shard 0's gradient list gets a row of its own under its queue: 1 waiting, unbounded
    glist = [line for line in text.splitlines() if line.startswith("ps/0/glist")]
    if client.cluster:  # no gradient lists on a cluster
        assert glist == [], text
    else:
        assert glist[0].split()[:3] == ["ps/0/glist", "list", "1/inf"], text
    assert not any(line.startswith("ps/1/glist") for line in text.splitlines())  # unused
    assert "█" in text and "░" in text
    assert "waiting for one" in _text(
        render(None, None, 1.0, "x", "no training job; waiting for one")
    )


@pytest.mark.parametrize("width", [80, 200])
async def test_render_fits_the_terminal(client, width):
    """An 80-column terminal gets the compact tables (short bars and headers), every
    line within 80 columns; a wide one the full headers and 20-cell bars."""
    await build_job(client, C)
    first = await monitor.snapshot(client, C)
    second = await monitor.snapshot(client, C)
    text = _text(render(second, monitor.rates(first, second), 1.0, width=width), width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert not any(line.rstrip().endswith("…") for line in lines)  # nothing cut short
    for needle in ["worker0", "ps/0/grads", "3/8", "5/100", "DLQ"]:
        assert needle in text, (needle, text)
    if width == 80:
        assert "DEQ/S" in text and "FIFO " in text and "FIFOQueue" not in text
        assert "IN/S" in text and "OUT/S" in text
        assert ("ps/0/glist" in text) is not client.cluster  # (no lists on a cluster)
        assert len(lines) <= 24 - 1  # a frame of this job fits an 80x24 screen
    else:
        assert "DEQUEUES/S" in text and "FIFOQueue" in text and "█" * 20 not in text
        assert any(("█" + "░" * 19) in line or "░" * 20 in line for line in lines)


# -- the command -----------------------------------------------------------------------------


def _container() -> str:
    return f"top-{secrets.token_hex(4)}"


def _build(url: str, container: str) -> None:
    async def go() -> None:
        async with await qps.connect(url) as c:
            await build_job(c, container)

    asyncio.run(go())


def test_once_json(redis_url: str) -> None:
    c = _container()
    _build(redis_url, c)
    r = CliRunner().invoke(
        cli, ["top", "--once", "--json", "--interval", "0.05", "--url", redis_url, "--container", c]
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["container"] == c and d["global_step"] == 7 and d["state"] == "running"
    assert [w["name"] for w in d["workers"]] == ["worker0", "worker1"]
    assert [s["shard"] for s in d["shards"]] == [0, 1]
    assert [q["name"] for q in d["queues"]] == ["input"]
    assert d["rates"]["global_steps_per_s"] == 0.0 and d["rates"]["seconds"] >= 0.05
    assert d["rates"]["worker_steps_per_s"] == {"worker0": None, "worker1": 0.0}
    # text once: the same frame as the live one
    r = CliRunner().invoke(
        cli, ["top", "--once", "--interval", "0.05", "--url", redis_url, "--container", c]
    )
    assert r.exit_code == 0 and "worker0" in r.output and "ps/0/grads" in r.output
    assert "…" not in r.output  # not squeezed to 80 columns in a pipe


def test_usage_and_not_found(redis_url: str) -> None:
    r = CliRunner().invoke(cli, ["top", "--json", "--url", redis_url])
    assert r.exit_code == 2 and "--json needs --once" in r.output
    r = CliRunner().invoke(cli, ["top", "--once", "--url", redis_url, "--container", _container()])
    assert r.exit_code == 3 and "no training job" in r.output


_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a pty")
def test_live_dashboard_in_a_terminal(redis_url: str) -> None:
    """`qps top` in a real pseudo-terminal (160x60): its screen shows the job; a
    worker's new status appears on a later refresh; Ctrl-C exits 0."""
    import fcntl
    import pty
    import termios

    c = _container()
    _build(redis_url, c)
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes `qps top` on the pty
        env = {**os.environ, "PYTHONPATH": REPO, "TERM": "xterm-256color", "COLUMNS": "160",
               "LINES": "60"}  # fmt: skip
        env.pop("NO_COLOR", None)
        os.execve(sys.executable, [sys.executable, "-m", "qps.cli.main", "top", "--url",
                                   redis_url, "--container", c, "--interval", "0.2"], env)  # fmt: skip
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 160, 0, 0))
    screen = bytearray()

    def read_until(*needles: bytes, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            plain = _ANSI.sub(b"", bytes(screen))
            if all(n in plain for n in needles):
                return
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    screen.extend(os.read(fd, 65536))
                except OSError as exc:  # EIO: the child closed the pty
                    if exc.errno != errno.EIO:
                        raise
                    break
        raise AssertionError(
            f"{needles} not on the screen:\n"
            + _ANSI.sub(b"", bytes(screen)).decode(errors="replace")[-4000:]
        )

    try:
        read_until(b"worker0", b"worker1", b"training", b"ps/0/grads", b"input", b"5/100",
                   b"3/8", "█".encode(), b"dead letters 2")  # fmt: skip
        assert b"\x1b[?1049h" in screen  # the alternate screen, as top uses

        async def news() -> None:
            async with await qps.connect(redis_url) as cl:
                await job.publish_status(cl, c, "worker0", {"state": "training", "step": 4321})

        asyncio.run(news())
        read_until(b"4,321")  # a later refresh shows it
        os.write(fd, b"\x03")  # Ctrl-C, through the terminal's line discipline
        end = time.monotonic() + 30
        status = None
        while time.monotonic() < end:
            with_pid, status = os.waitpid(pid, os.WNOHANG)
            if with_pid:
                break
            select.select([fd], [], [], 0.1)
            with contextlib.suppress(OSError):
                os.read(fd, 65536)
        else:
            raise AssertionError("qps top did not exit after Ctrl-C")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        else:
            os.waitpid(pid, 0)
        os.close(fd)

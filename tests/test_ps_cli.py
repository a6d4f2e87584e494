"""``qps ps`` (qps/cli/ps.py) against a real server: a shard process that logs what it
does, exits 0 on SIGTERM and when the job is finished; ``status``, ``dlq``, ``finish``.

As in tests/test_cli.py, these are plain functions (CliRunner's commands call
``asyncio.run``); state is set up with ``asyncio.run(...)`` helpers.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import qps
from qps.cli.main import cli
from qps.optimizers import SGD
from qps.ps import control

REPO_ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def container() -> str:
    return f"pscli-{secrets.token_hex(4)}"


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def run(coro_fn: Callable[[qps.Client], Any], url: str) -> Any:
    async def go() -> Any:
        async with await qps.connect(url) as c:
            return await coro_fn(c)

    return asyncio.run(go())


def wait_for(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.05)


def setup_job(url: str, container: str) -> None:
    async def go(c: qps.Client) -> None:
        await control.configure(c, container, 1, SGD(learning_rate=1.0))
        async with qps.Session(client=c, container=container, worker="cli-w") as s:
            await s.variable("w", (2,), np.float32, initializer="zeros").create()
            await control.place_variables(c, container, ["w"])

    run(go, url)


def push(url: str, container: str, grad: Any, step: int) -> None:
    async def go(c: qps.Client) -> None:
        async with qps.Session(client=c, container=container, worker="cli-w") as s:
            await s.pull("w")
            await s.push({"w": np.asarray(grad, np.float32)}, step=step)

    run(go, url)


def global_step(url: str, container: str) -> int:
    async def go(c: qps.Client) -> int:
        async with qps.Session(client=c, container=container) as s:
            return await s.global_step()

    return int(run(go, url))


@pytest.fixture
def shard(redis_url: str, container: str) -> Iterator[Callable[[], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": REPO_ROOT}
        env.pop("QPS_LOG_LEVEL", None)
        # a lease that a loaded machine's stalls cannot run out (renewed every third of
        # it); no test here waits for one to expire: a stopped shard releases its lease
        p = subprocess.Popen(
            [sys.executable, "-m", "qps.cli.main", "ps", "--shard", "0", "--num-shards", "1",
             "--url", redis_url, "--container", container, "--optimizer", "sgd", "--lr", "1",
             "--lease-ms", "10000"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_usage_errors() -> None:
    r = CliRunner().invoke(cli, ["ps"])
    assert r.exit_code == 2 and "--shard I and --num-shards N" in r.output
    r = CliRunner().invoke(cli, ["ps", "--shard", "2", "--num-shards", "2"])
    assert r.exit_code == 2 and "not below" in r.output
    r = CliRunner().invoke(cli, ["ps", "--shard", "0", "--num-shards", "1", "-p", "x"])
    assert r.exit_code == 2


def test_shard_process_sigterm_status_dlq_finish(
    redis_url: str, container: str, shard: Callable[[], subprocess.Popen[str]]
) -> None:
    setup_job(redis_url, container)
    p = shard()
    push(redis_url, container, [1.0, 2.0], 0)
    push(redis_url, container, [np.nan, 2.0], 1)  # quarantined
    push(redis_url, container, [1.0, 1.0], 2)
    wait_for(lambda: global_step(redis_url, container) == 2)
    # the shard's stats go with its ack, a round trip after the commit
    wait_for(lambda: run(lambda c: control.shard_status(c, container, 0), redis_url).applied == 2)

    r = invoke("ps", "status", "--url", redis_url, "--container", container)
    assert r.exit_code == 0, r.output
    assert f"container {container}: global step 2, job running" in r.output
    row = next(line for line in r.output.splitlines() if line.startswith("0 "))
    # vars, applied, skipped, dropped (stale: synchronous training only), rows, dead letters
    assert row.split()[:2] == ["0", "running"] and row.split()[3:9] == ["1", "2", "0", "0", "4", "1"]
    assert "cli-w: 2 message(s)" in r.output
    data = json.loads(
        invoke("ps", "status", "--json", "--url", redis_url, "--container", container).output
    )
    s0 = data["shards"][0]
    assert (data["global_step"], s0["applied"], s0["dead_letters"], s0["queue_size"]) == (
        2,
        2,
        1,
        0,
    )
    assert s0["staleness"]["cli-w"]["messages"] == 2 and s0["pid"] == str(p.pid)

    r = invoke("ps", "dlq", "ls", "--url", redis_url, "--container", container)
    assert (
        r.exit_code == 0
        and "worker cli-w step 1 variable w: gradient of 'w' holds NaN or Inf" in r.output
    )
    r = invoke("ps", "dlq", "show", "0", "--json", "--url", redis_url, "--container", container)
    shown = json.loads(r.output)
    assert shown["gradients"] == {"w": {"kind": "dense", "shape": [2], "dtype": "float32"}}
    assert shown["step"] == 1 and shown["bytes"] > 0
    r = CliRunner().invoke(cli, ["ps", "dlq", "drop", "--url", redis_url, "--container", container])
    assert r.exit_code == 2  # no terminal to confirm
    r = invoke("ps", "dlq", "drop", "--yes", "--url", redis_url, "--container", container)
    assert "1 dead letter(s) deleted" in r.output

    # SIGTERM: finishes what it has in hand, releases the lease, exits 0
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert f"qps: INFO: qps.ps: ps shard 0/1 [{container}]: lease taken" in out
    assert "stop requested" in out and "lease released (stopped)" in out
    assert "dead letter" in out  # WARNING lines name the shard too
    st = run(lambda c: control.shard_status(c, container, 0), redis_url)
    assert st.state == "stopped" and st.owner is None

    # a new run picks up where it stopped; `qps ps finish` ends the job: exit 0
    p = shard()
    push(redis_url, container, [1.0, 1.0], 3)
    wait_for(lambda: global_step(redis_url, container) == 3)
    r = invoke("ps", "finish", "--url", redis_url, "--container", container)
    assert r.exit_code == 0 and "1 queue(s) closed" in r.output
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert "exiting" in out and "shard 0/1 finished" in out
    got = run(lambda c: _read(c, container), redis_url)
    assert got == ([-3.0, -4.0], 3)
    # after the end, a new shard exits at once
    p = shard()
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and "nothing to do" in out
    r = invoke("ps", "status", "--url", redis_url, "--container", container)
    assert "job finished" in r.output


async def _read(c: qps.Client, container: str) -> tuple[list[float], int]:
    v = await qps.variables.open_variable(c, "w", container)
    value, version = await v.read()
    return value.tolist(), version


def test_status_without_a_job(redis_url: str, container: str) -> None:
    r = CliRunner().invoke(cli, ["ps", "status", "--url", redis_url, "--container", container])
    assert r.exit_code == 3 and "no PS job" in r.output

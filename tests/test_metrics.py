"""qps/metrics.py and the roles' hooks: the registry and its HTTP endpoint; a feeder, a
PS shard and a worker training in-process (both backends), each serving its own
registry, scraped over HTTP while the shard still runs; ``qps feed`` reading
QPS_METRICS_PORT; ``qps train --metrics-port`` giving each role process its port."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import qps
from qps import metrics
from qps.cli.main import cli
from qps.optimizers import SGD
from qps.ps import control
from qps.ps.messages import SparseGradient
from qps.ps.shard import Shard, ShardOptions
from tests.conftest import ClientFactory, until
from workers.data import load_dataset
from workers.feeder import FeedOptions, feed
from workers.launcher import TrainConfig
from workers.models import Rows
from workers.worker import Worker, WorkerConfig

REPO = str(Path(__file__).resolve().parents[1])

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

WORKER_METRICS = [
    "qps_worker_steps_total",
    "qps_worker_examples_total",
    "qps_worker_loss",
    "qps_worker_pull_bytes_total",
    "qps_worker_push_bytes_total",
    "qps_worker_pull_seconds_count",
    "qps_worker_push_seconds_count",
    "qps_worker_step_seconds_count",
]
PS_METRICS = [
    "qps_ps_messages_total",
    "qps_ps_bytes_total",
    "qps_ps_applies_total",
    "qps_ps_apply_seconds_count",
    "qps_ps_staleness_count",
]
PS_GAUGES = ["qps_ps_queue_depth", "qps_ps_dead_letters", "qps_ps_dropped_stale_total"]
FEED_METRICS = ["qps_feed_examples_total", "qps_feed_epochs_total"]


def scrape(url: str) -> Samples:
    """GET the endpoint and parse the exposition text: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def values(samples: Samples, name: str) -> list[float]:
    return [v for (n, _), v in samples.items() if n == name]


def total(samples: Samples, name: str) -> float:
    got = values(samples, name)
    assert got, f"no sample {name}"
    return sum(got)


@pytest.fixture
def served() -> Iterator[list[metrics.Metrics]]:
    """Registries the test serves: closed at the end."""
    made: list[metrics.Metrics] = []
    yield made
    with ThreadPoolExecutor() as pool:  # each close waits up to a poll interval (0.5 s)
        list(pool.map(lambda m: m.close(), made))


def _serve(made: list[metrics.Metrics]) -> metrics.Metrics:
    m = metrics.Metrics()
    m.serve(0)
    made.append(m)
    return m


# -- the module ------------------------------------------------------------------------------


def test_nbytes_counts_arrays_in_any_container() -> None:
    a = np.zeros((3, 4), np.float32)  # 48 bytes
    idx = np.arange(5, dtype=np.int64)  # 40
    sg = SparseGradient(idx, np.ones((5, 2), np.float32))  # 40 + 40
    assert metrics.nbytes(a) == 48
    assert metrics.nbytes({"w": a, "e": sg}) == 48 + 80
    assert metrics.nbytes([a, (a, a)]) == 3 * 48
    assert metrics.nbytes(Rows(idx, np.ones((5, 2), np.float64))) == 40 + 80
    assert metrics.nbytes("not an array") == 0


def test_a_registry_served_on_a_free_port(served: list[metrics.Metrics]) -> None:
    m = _serve(served)
    host, port = m.address or ("", 0)
    assert host == "127.0.0.1" and port > 0 and m.serving
    assert m.url == f"http://127.0.0.1:{port}/metrics"
    w = m.worker("job", "worker3")
    w.start()
    w.pulled(time.perf_counter(), [np.zeros(10, np.float32), np.zeros(6, np.float64)])
    w.pushed(time.perf_counter(), {"w": np.zeros(4, np.float32)})
    w.step(32, 0.25)
    w.step(16, 0.125)
    got = scrape(m.url)
    lab = frozenset({("container", "job"), ("worker", "worker3")})
    assert got[("qps_worker_steps_total", lab)] == 2
    assert got[("qps_worker_examples_total", lab)] == 48
    assert got[("qps_worker_loss", lab)] == 0.125
    assert got[("qps_worker_pull_bytes_total", lab)] == 40 + 48
    assert got[("qps_worker_push_bytes_total", lab)] == 16
    assert got[("qps_worker_step_seconds_count", lab)] == 2
    assert got[("qps_worker_pull_seconds_count", lab)] == 1
    # only the families of the roles that registered are listed
    assert not values(got, "qps_ps_applies_total") and not values(got, "qps_feed_epochs_total")
    with pytest.raises(RuntimeError, match="already served"):
        m.serve(0)
    m.close()
    assert not m.serving and m.url == ""
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(f"http://127.0.0.1:{port}/metrics")


def test_registries_are_independent_and_not_the_global_one(served: list[metrics.Metrics]) -> None:
    from prometheus_client import REGISTRY

    a, b = _serve(served), _serve(served)
    a.shard("job", 0).committed(3, time.perf_counter(), [("worker0", 1), ("worker1", 0)])
    b.shard("job", 0).committed(1, time.perf_counter(), [])
    sa, sb = scrape(a.url), scrape(b.url)
    assert total(sa, "qps_ps_applies_total") == 3 and total(sb, "qps_ps_applies_total") == 1
    per_worker = {
        dict(k[1])["worker"]: v for k, v in sa.items() if k[0] == "qps_ps_staleness_count"
    }
    assert per_worker == {"worker0": 1, "worker1": 1}
    assert values(sb, "qps_ps_staleness_count") == []
    assert (
        REGISTRY.get_sample_value("qps_ps_applies_total", {"container": "job", "shard": "0"})
        is None
    )
    assert metrics.default() is metrics.default() and metrics.default() not in (a, b)


def test_serving_a_port_in_use_raises() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        m = metrics.Metrics()
        with pytest.raises(OSError):
            m.serve(s.getsockname()[1])
        assert not m.serving


def test_train_gives_each_role_its_port() -> None:
    cfg = TrainConfig(num_shards=2, num_workers=2, metrics_port=9100, metrics_addr="0.0.0.0")
    assert cfg.metrics_ports() == {"ps0": 9100, "ps1": 9101, "worker0": 9102, "worker1": 9103}
    args = cfg.worker_args(1, "redis://x", "c")
    assert args[args.index("--metrics-port") + 1] == "9103"
    assert args[args.index("--metrics-addr") + 1] == "0.0.0.0"
    args = cfg.shard_args(1, "redis://x", "c")
    assert args[args.index("--metrics-port") + 1] == "9101"
    assert set(TrainConfig(metrics_port=0).metrics_ports().values()) == {0}
    assert "--metrics-port" not in TrainConfig().worker_args(0, "redis://x", "c")


# -- the roles, in-process ---------------------------------------------------------------------


async def test_roles_serve_their_metrics_during_training(
    make_client: ClientFactory, served: list[metrics.Metrics]
) -> None:
    """A feeder fills an input queue, a worker trains from it and pushes to one PS shard;
    each serves its own registry. Once the worker is done and the shard applied its
    steps (and dead-lettered a poisoned gradient), while the shard still runs, every
    documented family is on the endpoints with the values the roles report."""
    c = "metricsjob"
    client = await make_client()
    await control.configure(client, c, 1, SGD(learning_rate=0.1))
    m_ps, m_worker, m_feed = _serve(served), _serve(served), _serve(served)
    # every role shares this event loop: a lease long enough for a loaded machine's stalls
    shard = Shard(await make_client(), ShardOptions(0, 1, container=c, lease_ms=5000), m_ps)
    shard_task = asyncio.create_task(shard.run())
    data = load_dataset(dataset="digits")
    options = FeedOptions(queue="input", container=c, batch_size=100, capacity=300, seed=0)
    feed_task = asyncio.create_task(feed(await make_client(), data, options, metrics=m_feed))
    labels = {"container": c, "queue": "input"}

    async def fed() -> bool:
        return (m_feed.registry.get_sample_value("qps_feed_examples_total", labels) or 0) > 0

    await until(fed)  # the queue exists
    sess = qps.Session(client=await make_client(), container=c, worker="worker0")
    await sess.open()
    try:
        cfg = WorkerConfig(
            index=0, num_workers=1, num_shards=1, model="mlp:64,16,10", data="queue:input",
            batch_size=50, steps=None, container=c, log_every=1000, evaluate=False,
            finish_job=False,
        )  # fmt: skip
        w = Worker(cfg, sess, m_worker)
        await w.prepare()
        res = await w.train()
        await w.finish()
        feed_result = await feed_task
        assert res.examples == len(data) == feed_result.examples
        spec = w.model.params_spec()[0]
        await sess.push({spec.name: np.full(spec.shape, np.nan, np.float32)}, step=res.steps)

        ps_labels = {"container": c, "shard": "0"}

        async def drained() -> bool:  # as the shard's registry shows it
            got = m_ps.registry.get_sample_value
            return (got("qps_ps_dead_letters", ps_labels) or 0) >= 1 and (
                got("qps_ps_applies_total", ps_labels) or 0
            ) >= res.steps

        await until(drained, timeout=30)
        assert not shard_task.done()
        got_w, got_ps, got_feed = scrape(m_worker.url), scrape(m_ps.url), scrape(m_feed.url)
    except BaseException:
        shard.request_stop()
        feed_task.cancel()
        await asyncio.gather(shard_task, feed_task, return_exceptions=True)
        raise
    finally:
        await sess.close()
    for name in WORKER_METRICS:
        assert total(got_w, name) > 0, name
    assert total(got_w, "qps_worker_steps_total") == res.steps
    assert total(got_w, "qps_worker_examples_total") == len(data)
    assert total(got_w, "qps_worker_loss") == pytest.approx(res.last_loss)
    for name in PS_METRICS:
        assert total(got_ps, name) > 0, name
    assert total(got_ps, "qps_ps_applies_total") == shard.applied == res.steps
    assert total(got_ps, "qps_ps_messages_total") == res.steps + 1  # and the poisoned one
    assert total(got_ps, "qps_ps_dead_letters") == 1
    for name in PS_GAUGES:
        assert len(values(got_ps, name)) == 1, name
    assert {dict(k[1]).get("worker") for k in got_ps if k[0] == "qps_ps_staleness_count"} == {
        "worker0"
    }
    assert total(got_feed, "qps_feed_examples_total") == len(data)
    assert total(got_feed, "qps_feed_epochs_total") == 1
    assert len(values(got_feed, "qps_queue_depth")) == 1
    await control.mark_finished(client, c)
    assert await asyncio.wait_for(shard_task, 30) == "finished"


async def test_a_sync_shard_counts_updates_and_dropped_stale_gradients(
    make_client: ClientFactory,
) -> None:
    c, m = "metricssync", metrics.Metrics()
    a = qps.Session(client=await make_client(), container=c, worker="w0")
    b = qps.Session(client=await make_client(), container=c, worker="w1")
    await a.open()
    await b.open()
    await control.configure(a.client, c, 1, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    shard = Shard(await make_client(), ShardOptions(0, 1, container=c, lease_ms=900), m)
    task = asyncio.create_task(shard.run())
    labels = {"container": c, "shard": "0"}
    try:
        await a.push({"w": np.ones(2, np.float32)}, step=0)
        await b.push({"w": np.ones(2, np.float32)}, step=0)
        assert (await control.tokens(a.client, c, 0).take_then([], 10))[0] == 1
        await b.push({"w": np.ones(2, np.float32)}, step=0)  # from update 0: stale now

        async def dropped() -> bool:
            return m.registry.get_sample_value("qps_ps_dropped_stale_total", labels) == 1

        await until(dropped)
        get = m.registry.get_sample_value
        assert get("qps_ps_applies_total", labels) == 2  # the gradients of the one update
        assert get("qps_ps_apply_seconds_count", labels) == 1
        assert get("qps_ps_messages_total", labels) == 3
    finally:
        shard.request_stop()
        await asyncio.gather(task, return_exceptions=True)
        await a.close()
        await b.close()


# -- the commands ------------------------------------------------------------------------------


def test_qps_feed_reads_qps_metrics_port(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m = metrics.Metrics()
    monkeypatch.setattr(metrics, "_default", m)  # this process's registry, for the test
    try:
        r = CliRunner().invoke(
            cli,
            ["feed", "--dataset", "digits", "--capacity", "-1", "--url", redis_url,
             "--container", f"m-{secrets.token_hex(3)}"],
            env={"QPS_METRICS_PORT": "0"},
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        assert m.serving and "metrics served at http://127.0.0.1:" in r.output
        got = scrape(m.url)
        assert total(got, "qps_feed_examples_total") == len(load_dataset(dataset="digits"))
        assert total(got, "qps_feed_epochs_total") == 1
        assert total(got, "qps_queue_depth") == len(
            load_dataset(dataset="digits")
        )  # nobody consumed
    finally:
        m.close()


def _free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it (probed; another process may still take
    one before the roles bind it)."""
    for _ in range(50):
        base = 20000 + secrets.randbelow(40000)
        try:
            socks = []
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free ports")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups")
def test_qps_train_serves_every_role_on_its_port() -> None:
    base = _free_ports(2)
    env = {**os.environ, "PYTHONPATH": REPO, "QPS_METRICS_PORT": "1"}  # the flag wins
    env.pop("QPS_REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qps.cli.main", "train", "--ps", "1", "--workers", "1",
         "--steps", "1000000", "--log-every", "20", "--metrics-port", str(base),
         "--container", f"m-{secrets.token_hex(3)}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        end = time.monotonic() + 120
        while time.monotonic() < end and not any("worker0: step 20," in x for x in lines):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        assert "[worker0] " in text and "[ps0] " in text, text[-3000:]  # the roles' prefixes
        assert "worker0: step 20," in text, text[-3000:]
        urls = {"ps0": f"http://127.0.0.1:{base}/metrics",
                "worker0": f"http://127.0.0.1:{base + 1}/metrics"}  # fmt: skip
        assert f"qps train: metrics: ps0 {urls['ps0']}, worker0 {urls['worker0']}" in text
        got_ps = scrape(urls["ps0"])
        deadline = time.monotonic() + 30
        while total(got_ps, "qps_ps_applies_total") == 0:  # the first group is committing
            assert time.monotonic() < deadline, "the shard applied nothing"
            time.sleep(0.05)
            got_ps = scrape(urls["ps0"])
        got_w = scrape(urls["worker0"])
        for name in WORKER_METRICS:
            assert total(got_w, name) > 0, name
        assert total(got_w, "qps_worker_steps_total") >= 20
        for name in PS_METRICS:
            assert total(got_ps, name) > 0, name
        assert not values(got_ps, "qps_worker_steps_total")  # its own process's roles only
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 130

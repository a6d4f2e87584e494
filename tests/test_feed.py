"""workers/feeder.py and ``qps feed``: loading datasets, feeding N epochs (each example
exactly once per epoch, then the queue closes), counters, a stop while blocked, and the
command as a subprocess against a real server (SIGTERM included).

The library tests run on both backends; the command tests are plain functions, as in
tests/test_cli.py, and use a container of their own. Nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter as Multiset
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import qps
from qps.cli.main import cli
from qps.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
)
from qps.queues import queue_stats
from tests.conftest import until
from workers.data import Dataset, load_dataset, load_digits
from workers.feeder import FeedOptions, counter_names, feed
from workers.input import Coordinator, batch

REPO_ROOT = str(Path(__file__).resolve().parents[1])


def small(n: int = 10) -> Dataset:
    """x[i] = [i, i, i] (float32), y[i] = i (int64)."""
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)
    return Dataset([x, np.arange(n, dtype=np.int64)], "small")


# -- loading -------------------------------------------------------------------------------


def test_load_npz_and_npy(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y = np.arange(4, dtype=np.int64)
    np.savez(tmp_path / "d.npz", x=x, y=y, images=x * 2, labels=y + 1)
    d = load_dataset([str(tmp_path / "d.npz")])
    assert len(d) == 4 and d.arrays[0].dtype == np.float32 and (d.arrays[1] == y).all()
    d = load_dataset([str(tmp_path / "d.npz")], x_key="images", y_key="labels")
    assert (d.arrays[0] == x * 2).all() and (d.arrays[1] == y + 1).all()
    d = load_dataset([str(tmp_path / "d.npz")], y_key=None)
    assert len(d.arrays) == 1
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    d = load_dataset([str(tmp_path / "x.npy"), str(tmp_path / "y.npy")])
    assert [a.shape for a in d.arrays] == [(4, 3), (4,)]
    assert "4 examples of (float32[3], int64[])" in d.describe()


def test_load_errors(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros((3, 2)), y=np.zeros(2))
    np.savez(tmp_path / "o.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1))
    with pytest.raises(InvalidArgumentError, match="give --data"):
        load_dataset([])
    with pytest.raises(InvalidArgumentError, match="give --data"):
        load_dataset([str(tmp_path / "d.npz")], "digits")
    with pytest.raises(InvalidArgumentError, match="different lengths"):
        load_dataset([str(tmp_path / "d.npz")])
    with pytest.raises(InvalidArgumentError, match=r"has no array 'nope'.*it has: x, y"):
        load_dataset([str(tmp_path / "d.npz")], x_key="nope")
    with pytest.raises(InvalidArgumentError, match="cannot read"):  # no pickle, ever
        load_dataset([str(tmp_path / "o.npz")])
    with pytest.raises(NotFoundError):
        load_dataset([str(tmp_path / "missing.npz")])
    with pytest.raises(InvalidArgumentError, match=r"one \.npz file or one or two \.npy"):
        load_dataset([str(tmp_path / "d.csv")])
    with pytest.raises(InvalidArgumentError, match="unknown dataset"):
        load_dataset([], "mnist")


def test_digits() -> None:
    pytest.importorskip("sklearn")
    train = load_dataset(dataset="digits", split="train")
    test = load_dataset(dataset="digits", split="test")
    assert len(train) + len(test) == 1797 and len(test) == 360
    x, y = train.arrays
    assert x.dtype == np.float32 and x.shape[1:] == (64,) and y.dtype == np.int64
    assert abs(float(x.mean())) < 1e-3  # standardized on the training part
    assert set(y.tolist()) == set(range(10))


def test_digits_without_scikit_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_sklearn(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "sklearn" or name.startswith("sklearn."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    for mod in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(FailedPreconditionError, match="pip install scikit-learn"):
        load_digits()


# -- feed() ------------------------------------------------------------------------------


async def _consume(q: Any) -> list[int]:
    """Dequeue until OutOfRange; return the labels in order of arrival."""
    out: list[int] = []
    while True:
        try:
            x, y = await q.dequeue()
        except OutOfRangeError:
            return out
        assert float(x[0]) == float(y)  # components stay paired
        out.append(int(y))


@pytest.mark.parametrize("shuffle", [True, False])
async def test_feed_epochs_exactly_once_then_closed(make_client: Any, shuffle: bool) -> None:
    c1, c2 = await make_client(), await make_client()
    data = small(10)
    opts = FeedOptions(queue="input", epochs=3, batch_size=4, capacity=5, seed=7, shuffle=shuffle)
    consumer_q = qps.FIFOQueue(5, [np.float32, np.int64], [[3], []], shared_name="input", client=c2)
    # the consumer may start first: it declares the same queue
    consumer = asyncio.create_task(_consume(consumer_q))
    result = await feed(c1, data, opts)
    got = await consumer
    assert result.examples == 30 and result.epochs == 3 and result.closed
    assert not result.stopped and result.kind == "FIFOQueue"
    assert len(got) == 30
    for e in range(3):  # every example once per epoch
        assert sorted(got[e * 10 : (e + 1) * 10]) == list(range(10))
    if not shuffle:
        assert got == list(range(10)) * 3
    else:
        assert got != list(range(10)) * 3  # a fixed seed
    ex, ep = counter_names("input")
    assert await qps.Counter(ex, client=c2).get() == 30
    assert await qps.Counter(ep, client=c2).get() == 3


async def test_feed_seed_gives_the_same_order(client: qps.Client) -> None:
    orders = []
    for name in ("a", "b"):
        opts = FeedOptions(queue=name, epochs=2, batch_size=3, capacity=-1, seed=11)
        await feed(client, small(8), opts)
        q = qps.FIFOQueue(-1, [np.float32, np.int64], [[3], []], shared_name=name, client=client)
        orders.append(await _consume(q))
    assert orders[0] == orders[1]


async def test_feed_creates_a_shuffle_queue(client: qps.Client) -> None:
    opts = FeedOptions(queue="rsq", epochs=2, capacity=30, min_after_dequeue=4, seed=1)
    result = await feed(client, small(10), opts)
    assert result.kind == "RandomShuffleQueue"
    s = await queue_stats(client, "rsq", "default")
    assert s.spec.min_after_dequeue == 4 and s.size == 20 and s.closed
    q = await qps.Session(client=client).open()
    got = await _consume(await q.queue("rsq"))
    assert Multiset(got) == Multiset(list(range(10)) * 2)


async def test_feed_into_batch_pipeline(client: qps.Client) -> None:
    """The feeder's queue as the source of workers.input.batch: batches until the end."""
    opts = FeedOptions(queue="input", epochs=2, batch_size=5, capacity=-1)
    await feed(client, small(7), opts)
    up = await (await qps.Session(client=client).open()).queue("input")
    b = batch(up, 4, allow_smaller_final_batch=True, client=client)
    coord = Coordinator()
    tasks = b.start(coord)
    try:
        sizes = [len(y) async for _, y in b]
    finally:
        coord.request_stop()
        await coord.join(tasks, stop_grace_period_secs=30)
    assert sizes == [4, 4, 4, 2]


async def test_feed_refuses_a_mismatched_queue(client: qps.Client) -> None:
    q = qps.FIFOQueue(5, [np.float64, np.int64], [[3], []], shared_name="input", client=client)
    await q.size()  # created in Redis
    with pytest.raises(InvalidArgumentError, match=r"holds FIFOQueue elements \(float64\[3\]"):
        await feed(client, small(4), FeedOptions(queue="input"))
    with pytest.raises(InvalidArgumentError):
        await feed(client, small(4), FeedOptions(queue="x", epochs=0))


async def test_feed_stop_while_blocked_leaves_the_queue_open(client: qps.Client) -> None:
    """A stop while the enqueue waits for room: feed returns, the queue stays open and
    consistent (a capacity-4 queue holds the first 4 examples)."""
    coord = Coordinator()
    opts = FeedOptions(queue="input", epochs=5, batch_size=3, capacity=4, shuffle=False)
    task = asyncio.create_task(feed(client, small(10), opts, coord))
    q = qps.FIFOQueue(4, [np.float32, np.int64], [[3], []], shared_name="input", client=client)
    await until(lambda: _blocked(client))
    coord.request_stop()
    result = await task
    assert result.stopped and not result.closed and result.epochs == 0
    assert result.examples == 3  # the first chunk; the second was interrupted
    s = await queue_stats(client, "input", "default")
    assert not s.closed and s.size == 4 and s.pending_enqueues == 0
    assert [int(v) for v in (await q.dequeue_many(4))[1]] == [0, 1, 2, 3]


async def test_feed_stop_with_close_on_stop(client: qps.Client) -> None:
    coord = Coordinator()
    opts = FeedOptions(queue="input", epochs=5, batch_size=3, capacity=4, close_on_stop=True)
    task = asyncio.create_task(feed(client, small(10), opts, coord))
    await until(lambda: _blocked(client))
    coord.request_stop()
    result = await task
    assert result.stopped and result.closed
    s = await queue_stats(client, "input", "default")
    assert s.closed and s.size == 4


def _per_epoch(got: list[int], n: int, epochs: int) -> None:
    assert len(got) == n * epochs, len(got)
    for e in range(epochs):  # every example once per epoch, epochs in order (FIFO)
        assert sorted(got[e * n : (e + 1) * n]) == list(range(n)), e


async def _counters(c: qps.Client, queue: str = "input") -> tuple[int, int]:
    ex, ep = counter_names(queue)
    return await qps.Counter(ex, client=c).get(), await qps.Counter(ep, client=c).get()


async def _stop_blocked(client: qps.Client, opts: FeedOptions, data: Dataset) -> Any:
    """Run a feed until its enqueue waits for room in the full queue, then stop it."""
    coord = Coordinator()
    task = asyncio.create_task(feed(client, data, opts, coord))
    await until(lambda: _blocked(client))
    coord.request_stop()
    return await task


async def test_a_stopped_feed_is_resumed_where_it_stopped(make_client: Any) -> None:
    """A feed stopped while its enqueue waited (a prefix of the chunk stored, the rest
    undone) is resumed by the next feeder given the same data and options, with no seed
    given (the first drew one and recorded it): every example once per epoch, and the
    counters count what the stopped run stored without counting it."""
    c1, c2 = await make_client(), await make_client()
    data = small(10)
    opts = FeedOptions(queue="input", epochs=3, batch_size=3, capacity=4)
    first = await _stop_blocked(c1, opts, data)
    assert first.stopped and not first.closed and first.examples == 3  # + 1 uncounted
    q = qps.FIFOQueue(4, [np.float32, np.int64], [[3], []], shared_name="input", client=c2)
    consumer = asyncio.create_task(_consume(q))
    second = await feed(c1, data, opts)
    got = await consumer
    assert second.closed and not second.stopped
    assert second.examples == 26 and second.epochs == 3
    _per_epoch(got, 10, 3)
    assert got[:10] != list(range(10))  # shuffled, with the seed of the first run
    assert await _counters(c2) == (30, 3)


async def test_a_resumed_feed_must_have_the_same_data_and_options(client: qps.Client) -> None:
    data = small(10)
    opts = FeedOptions(queue="input", epochs=3, batch_size=3, capacity=4, seed=1)
    await _stop_blocked(client, opts, data)
    for other, what in [
        ((small(11), opts), "fingerprint"),
        ((data, FeedOptions(queue="input", epochs=2, capacity=4, seed=1)), "epochs"),
        ((data, FeedOptions(queue="input", epochs=3, capacity=4, seed=2)), "seed"),
        (
            (data, FeedOptions(queue="input", epochs=3, capacity=4, seed=1, shuffle=False)),
            "shuffle",
        ),
    ]:
        with pytest.raises(FailedPreconditionError, match=f"{what}.*--fresh"):
            await feed(client, *other)
    # --fresh starts a new feed after what the stopped one stored
    q = qps.FIFOQueue(4, [np.float32, np.int64], [[3], []], shared_name="input", client=client)
    consumer = asyncio.create_task(_consume(q))
    fresh = FeedOptions(queue="input", epochs=1, batch_size=3, capacity=4, fresh=True)
    r = await feed(client, small(5), fresh)
    got = await consumer
    assert r.closed and r.examples == 5
    assert sorted(got[:4]) == [0, 1, 2, 3] or len(got) == 9  # the stopped run's 4, then 5
    assert len(got) == 9 and sorted(got[4:]) == list(range(5))


async def test_a_complete_feed_is_not_fed_again(make_client: Any) -> None:
    c1, c2 = await make_client(), await make_client()
    opts = FeedOptions(queue="input", epochs=2, batch_size=4, capacity=4)
    q = qps.FIFOQueue(4, [np.float32, np.int64], [[3], []], shared_name="input", client=c2)
    consumer = asyncio.create_task(_consume(q))
    assert (await feed(c1, small(6), opts)).closed
    _per_epoch(await consumer, 6, 2)
    again = await feed(c1, small(6), opts)  # e.g. a feeder restarted after it finished
    assert again.closed and again.examples == 0 and not again.stopped
    s = await queue_stats(c2, "input", "default")
    assert s.enqueued_total == 12 and s.size == 0
    assert await _counters(c2) == (12, 2)


async def test_a_feed_held_by_a_dead_process_is_taken_over_at_once(
    client: qps.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease of a feeder that died on this host is taken at once; one held by a live
    process is waited for (a stop ends the wait, nothing fed)."""
    import socket

    from qps import keys
    from qps.owners import pid_namespace

    owner_key = keys.feed_prefix("default", "input") + "owner"
    host, ns = socket.gethostname(), pid_namespace()
    await client.commands.set(owner_key, f"{host}:{os.getppid()}:live00:{ns}", px=60_000)
    coord = Coordinator()
    opts = FeedOptions(queue="input", epochs=1, batch_size=4, capacity=8)
    task = asyncio.create_task(feed(client, small(6), opts, coord))
    caplog.set_level(logging.INFO, "qps.feed")

    async def waiting() -> bool:
        return "live00" in caplog.text and "waiting until it ends" in caplog.text

    await until(waiting)
    coord.request_stop()
    r = await task
    assert r.stopped and r.examples == 0
    with contextlib.suppress(NotFoundError):  # the queue may not even exist yet
        assert (await queue_stats(client, "input", "default")).enqueued_total == 0
    p = subprocess.Popen(["true"])
    p.wait()
    await client.commands.set(owner_key, f"{host}:{p.pid}:dead00:{ns}", px=60_000)
    r = await feed(client, small(6), opts)
    assert r.closed and r.examples == 6
    assert not await client.commands.exists(owner_key)  # released


async def _blocked(client: qps.Client) -> bool:
    try:
        s = await queue_stats(client, "input", "default")
    except NotFoundError:
        return False
    return s.size == 4 and s.pending_enqueues == 1


# -- qps feed (the command) ---------------------------------------------------------------


@pytest.fixture
def container() -> str:
    return f"feedtest-{secrets.token_hex(4)}"


@pytest.fixture
def npz(tmp_path: Path) -> str:
    path = tmp_path / "small.npz"
    d = small(10)
    np.savez(path, features=d.arrays[0], labels=d.arrays[1])
    return str(path)


@pytest.fixture
def start_feeder() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": REPO_ROOT}
        env.pop("QPS_LOG_LEVEL", None)
        p = subprocess.Popen(
            [sys.executable, "-m", "qps.cli.main", "feed", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def run(url: str, fn: Callable[[qps.Client], Any]) -> Any:
    async def go() -> Any:
        async with await qps.connect(url) as c:
            return await fn(c)

    return asyncio.run(go())


def test_qps_feed_epochs_then_out_of_range(
    redis_url: str, container: str, npz: str, start_feeder: Callable[..., subprocess.Popen[str]]
) -> None:
    """3 epochs of a 10-example .npz through a capacity-4 queue: a consumer dequeues
    exactly 30 examples (each 3 times), then OutOfRange; the feeder exits 0."""
    p = start_feeder(
        "--data", npz, "--x-key", "features", "--y-key", "labels", "--epochs", "3",
        "--batch-size", "4", "--capacity", "4", "--seed", "5", "--queue", "input",
        "--url", redis_url, "--container", container,
    )  # fmt: skip

    async def consume(c: qps.Client) -> list[int]:
        q = qps.FIFOQueue(
            4, [np.float32, np.int64], [[3], []], shared_name="input", container=container,
            client=c,
        )  # fmt: skip
        return await _consume(q)

    got = run(redis_url, consume)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert Multiset(got) == Multiset(list(range(10)) * 3) and len(got) == 30
    assert "epoch 3/3 done" in out and "qps feed: done: 30 example(s), 3 epoch(s)" in out

    async def counters(c: qps.Client) -> tuple[int, int]:
        ex, ep = counter_names("input")
        a = await qps.Counter(ex, container=container, client=c).get()
        b = await qps.Counter(ep, container=container, client=c).get()
        return a, b

    assert run(redis_url, counters) == (30, 3)


def test_qps_feed_sigterm_exits_0(
    redis_url: str, container: str, npz: str, start_feeder: Callable[..., subprocess.Popen[str]]
) -> None:
    """No consumer: the feeder blocks on the full queue; SIGTERM stops it cleanly."""
    p = start_feeder(
        "--data", npz, "--x-key", "features", "--y-key", "labels", "--epochs", "100",
        "--batch-size", "3", "--capacity", "4", "--no-shuffle", "--url", redis_url,
        "--container", container,
    )  # fmt: skip

    async def blocked(c: qps.Client) -> bool:
        try:
            s = await queue_stats(c, "input", container)
        except NotFoundError:
            return False
        return s.size == 4 and s.pending_enqueues == 1

    end = time.monotonic() + 60
    while not run(redis_url, blocked):
        assert p.poll() is None, p.communicate()[0]
        assert time.monotonic() < end, "the feeder never filled the queue"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert "qps feed: stopped: 3 example(s), 0 epoch(s)" in out and "queue left open" in out

    async def state(c: qps.Client) -> tuple[int, bool, int, list[int]]:
        s = await queue_stats(c, "input", container)
        q = await (await qps.Session(client=c, container=container).open()).queue("input")
        _, y = await q.dequeue_many(4)
        return s.size, s.closed, s.pending_enqueues, [int(v) for v in y]

    assert run(redis_url, state) == (4, False, 0, [0, 1, 2, 3])


def test_qps_feed_json_and_digits(redis_url: str, container: str) -> None:
    pytest.importorskip("sklearn")
    r = CliRunner().invoke(
        cli,
        ["feed", "--dataset", "digits", "--split", "test", "--capacity", "-1", "--json",
         "--url", redis_url, "--container", container],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["examples"] == 360 and data["epochs"] == 1 and data["closed"]
    assert data["counters"] == {"examples": "feed/input/examples", "epochs": "feed/input/epochs"}


def test_qps_feed_usage_errors(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["feed"])
    assert r.exit_code == 2 and "give --data" in r.output
    r = CliRunner().invoke(cli, ["feed", "--data", "a.npz", "--dataset", "digits"])
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, ["feed", "--dataset", "digits", "--epochs", "0"])
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, ["feed", "--dataset", "digits", "--queue", "bad name!"])
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, ["feed", "--data", str(tmp_path / "nope.npz")])
    assert r.exit_code == 3 and "no such file" in r.output
    r = CliRunner().invoke(cli, ["feed", "--help"])
    assert r.exit_code == 0 and "once per epoch" in r.output and "SIGTERM" in r.output

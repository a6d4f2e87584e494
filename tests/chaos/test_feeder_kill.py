"""A feeder (``qps feed``) SIGKILLed while its enqueue waits for room, restarted with the
same command (and no seed: the first run drew one and recorded it), several times: the
consumer still gets every input example exactly once per epoch, the last feeder exits 0
and closes the queue, and the container reset leaves no key."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qps
from qps import keys
from qps.errors import NotFoundError, OutOfRangeError
from qps.queues import queue_stats
from tests.conftest import until
from workers.feeder import counter_names

ROOT = Path(__file__).resolve().parents[2]
N, EPOCHS, CAPACITY = 200, 3, 32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_feeder_resumes_and_feeds_each_example_once_per_epoch(
    redis_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "ids.npz"
    np.savez(data, x=np.arange(N, dtype=np.float32)[:, None], y=np.arange(N, dtype=np.int64))
    container = f"feedkill-{secrets.token_hex(3)}"
    cmd = [sys.executable, "-m", "qps.cli.main", "feed", "--data", str(data), "--x-key", "x",
           "--y-key", "y", "--epochs", str(EPOCHS), "--batch-size", "16", "--capacity",
           str(CAPACITY), "--queue", "input", "--url", redis_url, "--container", container]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        p = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        procs.append(p)
        return p

    async def main() -> tuple[list[int], str]:
        c = await qps.connect(redis_url)
        try:
            q = qps.FIFOQueue(
                CAPACITY, [np.float32, np.int64], [[1], []], shared_name="input",
                container=container, client=c,
            )  # fmt: skip
            got: list[int] = []

            async def take(upto: int) -> None:
                while len(got) < upto:
                    x, y = await q.dequeue_up_to(min(8, upto - len(got)))
                    assert [int(v) for v in x[:, 0]] == [int(v) for v in y]
                    got.extend(int(v) for v in y)

            async def waits_for_room() -> bool:
                s = await queue_stats(c, "input", container)
                return s.size >= CAPACITY and s.pending_enqueues == 1

            state = keys.feed_prefix(container, "input") + "state"

            async def feeder() -> bytes | None:
                return await c.commands.hget(state, "client")  # type: ignore[no-any-return]

            p = start()
            for kill_at in (40, 250, 430):  # in epochs 1, 2 and 3
                await take(kill_at)
                await until(waits_for_room, timeout=60)
                dead = await feeder()
                p.kill()
                p.wait()
                p = start()

                async def resumed(dead: bytes | None = dead) -> bool:
                    return await feeder() not in (None, dead)

                # consume nothing until the new feeder has planned its resume: the dead
                # one's waiting rest must not slip in after that (it is undone)
                await until(resumed, timeout=60)
            while True:
                try:
                    await take(len(got) + 8)
                except OutOfRangeError:
                    break
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, out
            s = await queue_stats(c, "input", container)
            assert s.closed and s.size == 0 and s.enqueued_total == N * EPOCHS
            ex, ep = counter_names("input")
            counts = [await qps.Counter(n, container=container, client=c).get() for n in (ex, ep)]
            assert counts == [N * EPOCHS, EPOCHS]
            await qps.reset(client=c, containers=[container])
            left = [k async for k in c.commands.scan_iter(match=f"*{{{container}*")]
            assert left == []
            return got, out
        finally:
            await c.close()

    try:
        got, out = asyncio.run(main())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert "took over the feed" in out and "resuming the feed" in out
    assert len(got) == N * EPOCHS
    for e in range(EPOCHS):  # every example once per epoch, epochs in order
        assert sorted(got[e * N : (e + 1) * N]) == list(range(N)), e
    assert all(p.returncode is not None for p in procs)  # no process left


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_whose_feeder_is_killed_trains_on_every_example_once_per_epoch(
    redis_url: str, tmp_path: Path
) -> None:
    """A real job: a PS shard, two workers training from the input queue, and a feeder.
    The workers are stopped so that the queue fills and the feeder's enqueue waits; the
    feeder is SIGKILLed there and started again; the workers go on. The examples the
    workers trained on add up to every example once per epoch, every push is applied
    once (the global step), and every role exits 0."""
    n, epochs = 1600, 2
    data = tmp_path / "d.npz"
    rng = np.random.default_rng(1)
    np.savez(data, x=rng.standard_normal((n, 64)).astype(np.float32), y=rng.integers(0, 10, n))
    c = f"jobfeed-{secrets.token_hex(3)}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[Path] = []

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"{name}-{len(logs)}.log"
        logs.append(log)
        with open(log, "wb") as out:
            p = subprocess.Popen(
                [sys.executable, "-m", "qps.cli.main", *args, "--url", redis_url,
                 "--container", c], env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        procs[name] = p
        return p

    feed_args = ("feed", "--data", str(data), "--epochs", str(epochs), "--batch-size", "16",
                 "--capacity", "64", "--queue", "input")  # fmt: skip

    async def main() -> None:
        from qps.ps import control
        from workers import job

        client = await qps.connect(redis_url)
        try:
            feeder = start("feed", *feed_args)

            async def queue_exists() -> bool:
                try:
                    await queue_stats(client, "input", c)
                except NotFoundError:
                    return False
                return True

            await until(queue_exists, timeout=60)
            start("ps0", "ps", "--shard", "0", "--num-shards", "1", "--optimizer", "sgd",
                  "--lr", "0.05")  # fmt: skip
            for k in (0, 1):
                start(f"worker{k}", "worker", "--index", str(k), "--num-workers", "2",
                      "--num-shards", "1", "--model", "mlp:64,16,10", "--data", "queue:input",
                      "--steps", "0", "--batch-size", "32", "--log-every", "1",
                      "--no-finish-job")  # fmt: skip

            async def both_trained() -> bool:
                st = await job.read_statuses(client, c)
                return all(int(st.get(f"worker{k}", {}).get("step", 0)) > 0 for k in (0, 1))

            await until(both_trained, timeout=120)
            for k in (0, 1):
                procs[f"worker{k}"].send_signal(signal.SIGSTOP)

            async def feeder_waits() -> bool:
                s = await queue_stats(client, "input", c)
                return s.size >= 64 and s.pending_enqueues == 1

            stopped = await queue_stats(client, "input", c)
            assert stopped.enqueued_total < n * epochs - 64  # still feeding
            await until(feeder_waits, timeout=60)
            feeder.kill()  # while its enqueue waits for room
            feeder.wait()
            feeder = start("feed", *feed_args)
            for k in (0, 1):
                procs[f"worker{k}"].send_signal(signal.SIGCONT)
            assert feeder.wait(timeout=120) == 0
            for k in (0, 1):
                assert procs[f"worker{k}"].wait(timeout=120) == 0
            await control.mark_finished(client, c)
            assert procs["ps0"].wait(timeout=60) == 0
            st = await job.read_statuses(client, c)
            trained = sum(int(s["examples"]) for s in st.values())
            steps = sum(int(s["step"]) for s in st.values())
            assert trained == n * epochs, (trained, st)
            assert await control.global_step_counter(client, c).get() == steps
            s = await queue_stats(client, "input", c)
            assert s.closed and s.size == 0 and s.enqueued_total == n * epochs
            resumed = [g for g in logs if g.name.startswith("feed-")][-1].read_text()
            assert "took over the feed" in resumed and "resuming the feed" in resumed
            print(f"trained {trained} examples in {steps} steps; the feed was resumed")
        finally:
            await client.close()

    try:
        asyncio.run(main())
    except BaseException:
        for log in logs:
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()

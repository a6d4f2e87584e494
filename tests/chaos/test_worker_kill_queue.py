"""A worker training from a shared input queue takes its batches with acknowledged
dequeues and acks each one once its gradients are pushed. A worker SIGKILLed while it
holds a batch it has not trained on does not lose it: the batch goes back to the queue
when its lease runs out and another worker trains on it. Every example enqueued is
trained on by exactly one completed step (the workers publish their examples at every
step), and every push is applied once (the global step)."""

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
from qps.ps import control
from qps.queues import queue_stats
from tests.conftest import until

ROOT = Path(__file__).resolve().parents[2]
BATCH = 32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_workers_batch_goes_to_another_worker(redis_url: str) -> None:
    c = f"wkill-{secrets.token_hex(3)}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QPS_LEASE_MS": "3000"}
    procs: dict[str, subprocess.Popen[str]] = {}

    def start(name: str, *args: str) -> None:
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "qps.cli.main", *args, "--url", redis_url, "--container", c],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    rng = np.random.default_rng(0)

    def examples(n: int) -> list[np.ndarray]:
        return [rng.standard_normal((n, 64)).astype(np.float32), rng.integers(0, 10, n)]

    async def main() -> None:
        client = await qps.connect(redis_url)
        try:
            q = qps.FIFOQueue(
                10_000, [np.float32, np.int64], [[64], []], shared_name="input",
                container=c, client=client,
            )  # fmt: skip
            await q.size()  # created before the workers open it
            start("ps0", "ps", "--shard", "0", "--num-shards", "1", "--optimizer", "sgd",
                  "--lr", "0.05")  # fmt: skip
            for k in (0, 1):
                start(f"worker{k}", "worker", "--index", str(k), "--num-workers", "2",
                      "--num-shards", "1", "--model", "mlp:64,16,10", "--data", "queue:input",
                      "--steps", "0", "--batch-size", str(BATCH), "--log-every", "1",
                      "--no-finish-job")  # fmt: skip
            total = 10 * BATCH
            await q.enqueue_many(examples(total))

            async def all_trained_and_both_wait() -> bool:
                s = await queue_stats(client, "input", c)
                st = await _statuses(client, c)
                trained = sum(int(str(v.get("examples", 0))) for v in st.values())
                return s.size == 0 and s.pending_dequeues == 2 and trained == total

            # both wait for input, no step in hand (every batch trained and published): the
            # stop cannot fall between a push and its ack
            await until(all_trained_and_both_wait, timeout=120)
            victim = procs["worker1"]
            victim.send_signal(signal.SIGSTOP)
            # two batches: one goes to each waiting dequeue, the stopped worker's too
            await q.enqueue_many(examples(2 * BATCH))
            total += 2 * BATCH

            async def delivered() -> bool:
                s = await queue_stats(client, "input", c)
                return s.dequeued_total == total and s.pending_dequeues == 1

            await until(delivered, timeout=60)  # worker0 trained its batch and waits again
            victim.kill()  # holding a batch it never trained on
            victim.wait()
            await q.enqueue_many(examples(3 * BATCH))
            total += 3 * BATCH
            await q.close()
            assert procs["worker0"].wait(timeout=120) == 0  # after the lease, it got the batch
            await control.mark_finished(client, c)
            assert procs["ps0"].wait(timeout=60) == 0
            statuses = await _statuses(client, c)
            trained = sum(int(s["examples"]) for s in statuses.values())
            steps = sum(int(s["step"]) for s in statuses.values())
            assert trained == total, (trained, total, statuses)  # none lost, none twice
            assert await control.global_step_counter(client, c).get() == steps
            s = await queue_stats(client, "input", c)
            assert s.size == 0 and s.closed
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


async def _statuses(client: qps.Client, container: str) -> dict[str, dict[str, object]]:
    from workers import job

    got = await job.read_statuses(client, container)
    return {k: dict(v) for k, v in got.items()}

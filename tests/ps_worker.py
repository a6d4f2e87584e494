"""A worker process for tests/test_ps_exactly_once.py: pushes known SGD gradients.

python tests/ps_worker.py URL CONTAINER WORKER FIRST COUNT

Step ``s`` (FIRST <= s < FIRST + COUNT) of worker ``k`` pushes the dense gradient
:func:`dense_grad` for "w" and the sparse rows :func:`sparse_grad` for "emb", all small
integers in float64, so that the exact expected sum is known.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np

import qps

ROWS = 50


def dense_grad(worker: int, step: int) -> np.ndarray:
    return np.array([1.0, worker + 1.0, step % 5, (step * worker) % 3], np.float64)


def sparse_grad(worker: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([step % ROWS, (step * 7 + worker) % ROWS, step % ROWS], np.int64)
    vals = np.array([[1.0, 2.0], [worker + 1.0, 1.0], [1.0, step % 4]], np.float64)
    return ids, vals


def expected(workers: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The variables after every step of every worker, with SGD lr=1 from zeros."""
    w = np.zeros(4)
    emb = np.zeros((ROWS, 2))
    for k in range(workers):
        for s in range(steps):
            w -= dense_grad(k, s)
            ids, vals = sparse_grad(k, s)
            np.subtract.at(emb, ids, vals)
    return w, emb


async def run(url: str, container: str, worker: int, first: int, count: int) -> None:
    async with qps.Session(url, container=container, worker=f"worker{worker}") as sess:
        for s in range(first, first + count):
            if s % 10 == 0:
                await sess.pull("w")
                await sess.pull_rows("emb", [s % ROWS])
            await sess.push({"w": dense_grad(worker, s), "emb": sparse_grad(worker, s)}, step=s)


async def crash_shard(url: str, container: str, when: str) -> None:
    """For tests/test_ps_group.py and tests/test_ps_exactly_once.py: run shard 0 of 1
    and SIGKILL this process with its first group that holds messages applied in memory
    (``before-commit``) or committed and not acknowledged (``before-ack``)."""
    import os
    import signal

    from qps.ps.shard import Shard, ShardOptions

    client = await qps.connect(url)
    shard = Shard(
        client, ShardOptions(0, 1, container=container, lease_ms=1000, commit_interval_ms=60_000)
    )
    real = shard._commit_group

    async def commit_group(g: Any) -> None:
        if not g.messages:  # an idle shard's empty group: nothing to die holding
            return await real(g)
        if when == "before-ack":
            await real(g)
        print(f"killing myself {when} a group of {g.messages} message(s)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    shard._commit_group = commit_group  # type: ignore[method-assign]
    await shard.run()


if __name__ == "__main__":
    if sys.argv[1] == "--crash-shard":
        asyncio.run(crash_shard(*sys.argv[2:5]))
    else:
        u, c, k, f, n = sys.argv[1:6]
        asyncio.run(run(u, c, int(k), int(f), int(n)))

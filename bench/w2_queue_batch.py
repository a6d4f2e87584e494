"""W2 queue-batch: 500 batches of 128 (float32[784], int64) elements, capacity 1,024.

qps: ``FIFOQueue(1024, [float32, int64], shapes=[[784], []])``; producer 500 x
``enqueue_many((x, y))`` of 128, consumer 500 x ``dequeue_many(128)``.
raw: ``RPUSH`` one encoded batch (x, y) per enqueue_many, ``BLPOP`` per batch; capacity
8 batches (= 1,024 elements) emulated by backing off while the length RPUSH returns is
over 8.
Data: 8 distinct batches from ``default_rng(0)`` (x_k then y_k, k = 0..7); batch i is
batch i mod 8. Placements: one process (two asyncio tasks) and two processes.
Metrics: elements/s = 64,000 / T and MB/s = 64,000 x 3,144 B / T / 1e6.

Without ``--role`` this runs the W2 rows; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import harness
import numpy as np
import rawcodec

BATCH = 128
BATCHES = 500
CAPACITY = 1_024
ELEMENT_BYTES = 784 * 4 + 8  # 3,144


def make_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(8):
        x = rng.standard_normal((BATCH, 784), np.float32)
        y = rng.integers(0, 10, BATCH)
        out.append((x, y.astype(np.int64, copy=False)))
    return out


class QpsSide:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def _queue(self, name: str) -> Any:
        import qps

        return qps.FIFOQueue(
            CAPACITY,
            [np.float32, np.int64],
            shapes=[[784], []],
            shared_name=name,
            client=self.client,
        )

    async def open(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        import qps
        from qps.errors import DeadlineExceededError
        from qps.queues import delete_queue

        a = self.args
        self.client = c = await qps.connect(a.url)
        self.q = self._queue(a.name)
        warm = self._queue(f"{a.name}-warm-{a.role}")
        await warm.enqueue_many(batches[0], timeout=a.timeout)
        await warm.dequeue_many(BATCH, timeout=a.timeout)
        with contextlib.suppress(DeadlineExceededError):
            await warm.dequeue(timeout=0.05)  # one blocking wait
        await delete_queue(c, warm.name)
        await self.q.size()  # opens (creates) the run's queue
        await asyncio.gather(c.ping(), c.ping())

    async def produce(self, batches: list[tuple[np.ndarray, np.ndarray]], count: int) -> float:
        q, t = self.q, self.args.timeout
        for i in range(count):
            await q.enqueue_many(batches[i % 8], timeout=t)
        return time.monotonic()

    async def consume(self, got: list[Any], count: int) -> float:
        q, t = self.q, self.args.timeout
        for _ in range(count):
            got.append(await q.dequeue_many(BATCH, timeout=t))
        return time.monotonic()

    async def close(self) -> None:
        await self.client.close()


class RawSide:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    async def open(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        import redis.asyncio as aioredis

        a = self.args
        self.r = r = aioredis.Redis.from_url(
            a.url, socket_timeout=a.timeout + 30, socket_connect_timeout=10
        )
        warm = f"{a.name}-warm-{a.role}"
        await r.rpush(warm, rawcodec.encode(batches[0]))
        await r.blpop([warm], timeout=a.timeout)
        await r.delete(warm)
        await asyncio.gather(r.ping(), r.ping())

    async def produce(self, batches: list[tuple[np.ndarray, np.ndarray]], count: int) -> float:
        r, key, t = self.r, self.args.name, self.args.timeout
        cap = CAPACITY // BATCH

        def llen() -> Any:
            return r.llen(key)

        for i in range(count):
            length = await r.rpush(key, rawcodec.encode(batches[i % 8]))
            if length > cap:
                await harness.backoff_while_full(length, cap, llen, time.monotonic() + t)
        return time.monotonic()

    async def consume(self, got: list[Any], count: int) -> float:
        r, key, t = self.r, self.args.name, self.args.timeout
        for i in range(count):
            item = await r.blpop([key], timeout=t)
            if item is None:
                raise TimeoutError(f"BLPOP: nothing in {t} s (batch {i})")
            got.append(rawcodec.decode(item[1]))
        return time.monotonic()

    async def close(self) -> None:
        await self.r.aclose()


def check(got: list[Any], batches: list[tuple[np.ndarray, np.ndarray]], count: int) -> str | None:
    if len(got) != count:
        return f"received {len(got)} batches, want {count}"
    for i, (x, y) in enumerate(got):
        want_x, want_y = batches[i % 8]
        error = harness.check_equal(f"batch {i} x", x, want_x) or harness.check_equal(
            f"batch {i} y", y, want_y
        )
        if error:
            return error
    return None


async def participant(args: argparse.Namespace, barrier: harness.Barrier) -> dict[str, Any]:
    batches = make_batches()
    side = QpsSide(args) if args.impl == "qps" else RawSide(args)
    await side.open(batches)
    got: list[Any] = []  # kept as received; checked after the clock stops
    start = await barrier()
    if args.role == "producer":
        end = await side.produce(batches, args.count)
    elif args.role == "consumer":
        end = await side.consume(got, args.count)
    else:
        end = max(
            await asyncio.gather(side.produce(batches, args.count), side.consume(got, args.count))
        )
    error = None if args.role == "producer" else check(got, batches, args.count)
    await side.close()
    return {"start": start, "end": end, "ok": error is None, "error": error}


def rows(quick: bool) -> list[harness.Row]:
    count = 50 if quick else BATCHES
    n = count * BATCH
    me = "w2_queue_batch.py"

    def run(impl: str, procs: int) -> harness.Run:
        common = ("--impl", impl, "--count", str(count))
        roles = ("both",) if procs == 1 else ("producer", "consumer")
        return harness.Run(
            me, tuple(("--role", role, *common) for role in roles), lambda t, _r: n / t
        )

    def fmt(v: float) -> str:
        return f"{v:,.0f} ({v * ELEMENT_BYTES / 1e6:,.0f} MB/s)"

    return [
        harness.Row(
            f"W2{'a' if procs == 1 else 'b'}",
            f"W2 batches of 128, {place}",
            "el/s (MB/s)",
            qps=run("qps", procs),
            raw=run("raw", procs),
            fmt=fmt,
            fmt_range="{:,.0f}".format,
        )
        for procs, place in ((1, "1 process"), (2, "2 processes"))
    ]


def main() -> None:
    harness.script_main(
        __doc__ or "",
        participant,
        rows,
        "W2 queue-batch: qps against raw redis-py",
        count=BATCHES,
    )


if __name__ == "__main__":
    main()

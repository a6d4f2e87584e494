"""W1 queue-small: 50,000 float32[4] elements through a queue of capacity 1,000.

qps: ``FIFOQueue(1000, float32, shapes=[[4]])``, ``enqueue``/``dequeue`` one element
per call (or ``enqueue_many``/``dequeue_many(100)`` for the batched rows).
raw: ``LPUSH`` one encoded element per call, capacity emulated by backing off while the
length LPUSH returns is over 1,000; ``BRPOP`` per element (batched: one ``LPUSH`` of
100 values / ``BLMPOP ... RIGHT COUNT 100``).
Placements: (a) producer and consumer as two asyncio tasks of one process; (b) two
processes. Metric: elements/s = 50,000 / T.

Without ``--role`` this runs the W1 rows; see ``bench/README.md``.
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

CAPACITY = 1_000
ELEMENTS = 50_000


def make_data(n: int) -> np.ndarray:
    """Element i is row i (float32[4])."""
    return np.random.default_rng(0).standard_normal((ELEMENTS, 4), dtype=np.float32)[:n]


class QpsSide:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    async def open(self, data: np.ndarray) -> None:
        import qps
        from qps.errors import DeadlineExceededError
        from qps.queues import delete_queue

        a = self.args
        self.client = c = await qps.connect(a.url)
        self.q = qps.FIFOQueue(CAPACITY, np.float32, shapes=[[4]], shared_name=a.name, client=c)
        # warm-up on a private queue of the same spec: load the scripts, fill both pools
        warm = qps.FIFOQueue(
            CAPACITY, np.float32, shapes=[[4]], shared_name=f"{a.name}-warm-{a.role}", client=c
        )
        if a.batch == 1:
            await warm.enqueue(data[0], timeout=a.timeout)
            await warm.dequeue(timeout=a.timeout)
        else:
            await warm.enqueue_many(data[: a.batch], timeout=a.timeout)
            await warm.dequeue_many(a.batch, timeout=a.timeout)
        with contextlib.suppress(DeadlineExceededError):
            await warm.dequeue(timeout=0.05)  # one blocking wait
        await delete_queue(c, warm.name)
        await self.q.size()  # opens (creates) the run's queue
        await asyncio.gather(c.ping(), c.ping())

    async def produce(self, data: np.ndarray) -> float:
        q, b, t = self.q, self.args.batch, self.args.timeout
        if b == 1:
            for row in data:
                await q.enqueue(row, timeout=t)
        else:
            for i in range(0, len(data), b):
                await q.enqueue_many(data[i : i + b], timeout=t)
        return time.monotonic()

    async def consume(self, out: np.ndarray) -> float:
        q, b, t = self.q, self.args.batch, self.args.timeout
        if b == 1:
            for i in range(len(out)):
                out[i] = await q.dequeue(timeout=t)
        else:
            for i in range(0, len(out), b):
                out[i : i + b] = await q.dequeue_many(b, timeout=t)
        return time.monotonic()

    async def close(self) -> None:
        await self.client.close()


class RawSide:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    async def open(self, data: np.ndarray) -> None:
        import redis.asyncio as aioredis

        a = self.args
        self.r = r = aioredis.Redis.from_url(
            a.url, socket_timeout=a.timeout + 30, socket_connect_timeout=10
        )
        warm = f"{a.name}-warm-{a.role}"
        await r.lpush(warm, *[rawcodec.encode([row]) for row in data[: a.batch]])
        if a.batch == 1:
            await r.brpop([warm], timeout=a.timeout)
        else:
            await r.blmpop(a.timeout, 1, warm, direction="RIGHT", count=a.batch)
        await r.delete(warm)
        await asyncio.gather(r.ping(), r.ping())

    async def produce(self, data: np.ndarray) -> float:
        r, key, b, t = self.r, self.args.name, self.args.batch, self.args.timeout
        encode = rawcodec.encode

        def llen() -> Any:
            return r.llen(key)

        if b == 1:
            for row in data:
                length = await r.lpush(key, encode([row]))
                if length > CAPACITY:
                    await harness.backoff_while_full(length, CAPACITY, llen, time.monotonic() + t)
        else:
            for i in range(0, len(data), b):
                length = await r.lpush(key, *[encode([row]) for row in data[i : i + b]])
                if length > CAPACITY:
                    await harness.backoff_while_full(length, CAPACITY, llen, time.monotonic() + t)
        return time.monotonic()

    async def consume(self, out: np.ndarray) -> float:
        r, key, b, t = self.r, self.args.name, self.args.batch, self.args.timeout
        decode = rawcodec.decode
        n = len(out)
        if b == 1:
            for i in range(n):
                item = await r.brpop([key], timeout=t)
                if item is None:
                    raise TimeoutError(f"BRPOP: nothing in {t} s (element {i})")
                out[i] = decode(item[1])[0]
        else:
            i = 0
            for _ in range(n):  # each call returns at least one element
                if i >= n:
                    break
                item = await r.blmpop(t, 1, key, direction="RIGHT", count=min(b, n - i))
                if item is None:
                    raise TimeoutError(f"BLMPOP: nothing in {t} s (element {i})")
                for v in item[1]:
                    out[i] = decode(v)[0]
                    i += 1
        return time.monotonic()

    async def close(self) -> None:
        await self.r.aclose()


async def participant(args: argparse.Namespace, barrier: harness.Barrier) -> dict[str, Any]:
    data = make_data(args.n)
    side = QpsSide(args) if args.impl == "qps" else RawSide(args)
    await side.open(data)
    out = np.zeros_like(data)
    start = await barrier()
    if args.role == "producer":
        end = await side.produce(data)
    elif args.role == "consumer":
        end = await side.consume(out)
    else:
        end = max(await asyncio.gather(side.produce(data), side.consume(out)))
    error = None
    if args.role != "producer":
        error = harness.check_equal("received elements (FIFO order)", out, data)
    await side.close()
    return {"start": start, "end": end, "ok": error is None, "error": error}


def rows(quick: bool) -> list[harness.Row]:
    n = 5_000 if quick else ELEMENTS
    me = "w1_queue_small.py"

    def run(impl: str, batch: int, procs: int) -> harness.Run:
        common = ("--impl", impl, "--batch", str(batch), "--n", str(n))
        roles = ("both",) if procs == 1 else ("producer", "consumer")
        return harness.Run(
            me, tuple(("--role", role, *common) for role in roles), lambda t, _r: n / t
        )

    out = []
    for batch, what in ((1, "one element per call"), (100, "batches of 100")):
        for procs, place in ((1, "1 process"), (2, "2 processes")):
            key = f"W1{'' if batch == 1 else 'x100'}{'a' if procs == 1 else 'b'}"
            out.append(
                harness.Row(
                    key,
                    f"W1 {what}, {place}",
                    "el/s",
                    qps=run("qps", batch, procs),
                    raw=run("raw", batch, procs),
                )
            )
    return out


def main() -> None:
    harness.script_main(
        __doc__ or "",
        participant,
        rows,
        "W1 queue-small: qps against raw redis-py",
        n=ELEMENTS,
        batch=1,
    )


if __name__ == "__main__":
    main()

"""Wake latency: how soon a dequeue blocked on an empty queue returns after an enqueue
in another process.

The consumer process loops on ``dequeue()`` of an empty queue. The producer process
sends 200 elements, each a float64[1] holding its ``time.monotonic()`` taken just before
the enqueue call, spaced 5-10 ms apart (seeded uniform) so the consumer is blocked again
when the next one arrives. The consumer records receive time - stamp (CLOCK_MONOTONIC
is comparable across processes on one Linux host). Reported: median, p90, p99 in ms.
Reference: the same with raw redis-py ``RPUSH`` / ``BLPOP``.

Without ``--role`` this runs the wake-latency row; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import time
from typing import Any

import harness
import numpy as np
import rawcodec

SAMPLES = 200


async def participant(args: argparse.Namespace, barrier: harness.Barrier) -> dict[str, Any]:
    t = args.timeout
    warm_name = f"{args.name}-warm-{args.role}"
    one = np.zeros(1, np.float64)
    if args.impl == "qps":
        import qps
        from qps.errors import DeadlineExceededError
        from qps.queues import delete_queue

        client = await qps.connect(args.url)

        def queue(name: str) -> Any:
            return qps.FIFOQueue(16, np.float64, shapes=[[1]], shared_name=name, client=client)

        q, warm = queue(args.name), queue(warm_name)
        await warm.enqueue(one, timeout=t)
        await warm.dequeue(timeout=t)
        with contextlib.suppress(DeadlineExceededError):
            await warm.dequeue(timeout=0.05)  # one blocking wait
        await delete_queue(client, warm.name)
        await q.size()  # opens (creates) the run's queue

        async def put(stamp: float) -> None:
            await q.enqueue(np.array([stamp]), timeout=t)

        async def get() -> float:
            return float((await q.dequeue(timeout=t))[0])

        close = client.close
    else:
        import redis.asyncio as aioredis

        r = aioredis.Redis.from_url(args.url, socket_timeout=t + 30, socket_connect_timeout=10)
        key = args.name
        await r.rpush(warm_name, rawcodec.encode([one]))
        await r.blpop([warm_name], timeout=t)
        await r.blpop([warm_name], timeout=0.05)
        await r.delete(warm_name)

        async def put(stamp: float) -> None:
            await r.rpush(key, rawcodec.encode([np.array([stamp])]))

        async def get() -> float:
            item = await r.blpop([key], timeout=t)
            if item is None:
                raise TimeoutError(f"BLPOP: nothing in {t} s")
            return float(rawcodec.decode(item[1])[0][0])

        close = r.aclose

    result: dict[str, Any] = {"ok": True, "error": None}
    start = await barrier()
    if args.role == "producer":
        gaps = random.Random(1)
        for _ in range(args.count):
            await asyncio.sleep(gaps.uniform(0.005, 0.010))
            await put(time.monotonic())
    else:
        stamps, lat = [], []
        for _ in range(args.count):
            stamp = await get()
            lat.append((time.monotonic() - stamp) * 1e3)
            stamps.append(stamp)
        if len(stamps) != args.count or any(b <= a for a, b in itertools.pairwise(stamps)):
            result = {"ok": False, "error": "stamps missing or out of order"}
        result["latency_ms"] = lat
        result["median_ms"] = statistics.median(lat)
    end = time.monotonic()
    await close()
    return {"start": start, "end": end, **result}


def _latencies(results: list[dict[str, Any]]) -> list[float]:
    return [x for r in results for x in r.get("latency_ms", [])]


def rows(quick: bool) -> list[harness.Row]:
    count = 50 if quick else SAMPLES

    def run(impl: str) -> harness.Run:
        common = ("--impl", impl, "--count", str(count))
        return harness.Run(
            "wake_latency.py",
            (("--role", "consumer", *common), ("--role", "producer", *common)),
            lambda _t, res: statistics.median(_latencies(res)),
        )

    return [
        harness.Row(
            "wake",
            "wake latency, blocked dequeue in another process (median of the run)",
            "ms",
            qps=run("qps"),
            raw=run("raw"),
            lower_is_better=True,
            fmt="{:.3f}".format,
            samples=_latencies,
        )
    ]


def main() -> None:
    harness.script_main(
        __doc__ or "",
        participant,
        rows,
        "wake latency: qps dequeue against raw BLPOP",
        count=SAMPLES,
    )


if __name__ == "__main__":
    main()

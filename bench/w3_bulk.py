"""W3 bulk: a 16 MiB float32 array pushed into the transport and read back, 20 times.

qps: ``FIFOQueue(1, float32, shapes=[[4194304]])``, ``enqueue`` then ``dequeue``, in one
process (the only tensor put/get path qps has so far).
raw: ``SET`` the encoded array, ``GET`` it back (redis-py asyncio client), decoded with
``np.frombuffer``.
Data: ``default_rng(0).standard_normal(4_194_304, dtype=float32)``. The last read is
compared with the input after the clock stops. Metric: GiB/s = 2 x 16 MiB x 20 / T / 2^30.

Without ``--role`` this runs the W3 row; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import harness
import numpy as np
import rawcodec

SIZE = 4_194_304
ROUNDS = 20


async def run_qps(args: argparse.Namespace, data: np.ndarray, barrier: harness.Barrier) -> Any:
    import qps
    from qps.queues import delete_queue

    t = args.timeout
    async with await qps.connect(args.url) as c:

        def queue(name: str) -> Any:
            return qps.FIFOQueue(1, np.float32, shapes=[[SIZE]], shared_name=name, client=c)

        warm = queue(f"{args.name}-warm")
        await warm.enqueue(data, timeout=t)
        await warm.dequeue(timeout=t)
        await delete_queue(c, warm.name)
        q = queue(args.name)
        await q.size()  # opens (creates) the run's queue
        start = await barrier()
        for _ in range(args.count):
            await q.enqueue(data, timeout=t)
            out = await q.dequeue(timeout=t)
        end = time.monotonic()
    return start, end, out


async def run_raw(args: argparse.Namespace, data: np.ndarray, barrier: harness.Barrier) -> Any:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(args.url, socket_timeout=args.timeout, socket_connect_timeout=10)
    key = args.name
    await r.set(f"{key}-warm", rawcodec.encode([data]))
    rawcodec.decode(await r.get(f"{key}-warm"))
    await r.delete(f"{key}-warm")
    start = await barrier()
    for _ in range(args.count):
        await r.set(key, rawcodec.encode([data]))
        out = rawcodec.decode(await r.get(key))[0]
    end = time.monotonic()
    await r.aclose()
    return start, end, out


async def participant(args: argparse.Namespace, barrier: harness.Barrier) -> dict[str, Any]:
    data = np.random.default_rng(0).standard_normal(SIZE, dtype=np.float32)
    run = run_qps if args.impl == "qps" else run_raw
    start, end, out = await run(args, data, barrier)
    error = harness.check_equal("last read", out, data)
    return {"start": start, "end": end, "ok": error is None, "error": error}


def rows(quick: bool) -> list[harness.Row]:
    count = 5 if quick else ROUNDS
    gib = 2 * SIZE * 4 * count / 2**30

    def run(impl: str) -> harness.Run:
        args = ("--role", "single", "--impl", impl, "--count", str(count))
        return harness.Run("w3_bulk.py", (args,), lambda t, _r: gib / t)

    return [
        harness.Row(
            "W3",
            "W3 16 MiB put + get, 1 process",
            "GiB/s",
            qps=run("qps"),
            raw=run("raw"),
            fmt="{:.3f}".format,
        )
    ]


def main() -> None:
    harness.script_main(
        __doc__ or "", participant, rows, "W3 bulk: qps against raw redis-py", count=ROUNDS
    )


if __name__ == "__main__":
    main()

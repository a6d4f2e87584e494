"""A producer or consumer process for tests/test_queue_multiprocess.py.

python tests/mp_queue_worker.py produce URL KIND NAME START COUNT SEED
python tests/mp_queue_worker.py consume URL KIND NAME OUTFILE SEED
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

import qps
from qps.errors import OutOfRangeError


def make_queue(kind: str, name: str, client: qps.Client) -> qps.queues.QueueBase:
    # element = (id int64, producer-local sequence int32, payload float32[3])
    dtypes = [np.int64, np.int32, np.float32]
    shapes = [[], [], [3]]
    if kind == "fifo":
        return qps.FIFOQueue(100, dtypes, shapes=shapes, shared_name=name, client=client)
    return qps.RandomShuffleQueue(
        100, 10, dtypes, shapes=shapes, seed=5, shared_name=name, client=client
    )


async def produce(url: str, kind: str, name: str, start: int, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    async with await qps.connect(url) as client:
        q = make_queue(kind, name, client)
        i = 0
        while i < count:
            k = int(min(count - i, rng.integers(1, 40)))
            ids = np.arange(start + i, start + i + k, dtype=np.int64)
            payload = np.repeat(ids.astype(np.float32)[:, None], 3, axis=1)
            if k == 1:
                await q.enqueue([ids[0], np.int32(i), payload[0]], timeout=60)
            else:
                await q.enqueue_many(
                    [ids, np.arange(i, i + k, dtype=np.int32), payload], timeout=60
                )
            i += k


async def consume(url: str, kind: str, name: str, out: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    got: list[np.ndarray] = []
    async with await qps.connect(url) as client:
        q = make_queue(kind, name, client)
        while True:
            try:
                if rng.random() < 0.3:
                    ids, _, payload = await q.dequeue(timeout=60)
                    ids, payload = ids[None], payload[None]
                else:
                    ids, _, payload = await q.dequeue_up_to(int(rng.integers(2, 40)), timeout=60)
            except OutOfRangeError:
                break
            assert np.array_equal(payload, np.repeat(ids.astype(np.float32)[:, None], 3, axis=1))
            got.append(ids)
    np.save(out, np.concatenate(got) if got else np.zeros(0, np.int64))


def main() -> None:
    role, url, kind, name = sys.argv[1:5]
    if role == "produce":
        asyncio.run(produce(url, kind, name, int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])))
    else:
        asyncio.run(consume(url, kind, name, sys.argv[5], int(sys.argv[6])))


if __name__ == "__main__":
    main()

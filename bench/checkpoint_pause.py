"""How long a checkpoint pauses training: ``snapshot_pause_ms`` of ``qps.checkpoint.save``
on a single server (one MULTI/EXEC) and on a Redis Cluster (every variable held while
all are pinned), for a model of one large variable with two Adam slots plus small ones.

    python bench/checkpoint_pause.py                      # a server of its own
    python bench/checkpoint_pause.py --url redis://127.0.0.1:7000      # any cluster node

Prints one line per save and the median; figures in docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import numpy as np

import qps
from qps import checkpoint
from qps.containers import reset


async def main(url: str | None, mib: int, small: int, reps: int) -> None:
    async with await qps.connect(url) as client:
        kind = "cluster" if client.cluster else "single server"
        c = "ckpause"
        await reset(client, [c])
        rows = (mib << 20) // (4 * 256)
        async with qps.Session(client=client, container=c) as s:
            big = s.variable("big", (rows, 256), np.float32, initializer="zeros")
            await big.create()
            await big.init_slots({"m": np.zeros((rows, 256), np.float32),
                                  "v": np.zeros((rows, 256), np.float32)}, 1)  # fmt: skip
            for i in range(small):
                await s.variable(f"s{i}", (64, 64), np.float32, initializer="zeros").create()
        pauses = []
        with tempfile.TemporaryDirectory() as d:
            for r in range(reps):
                info = await checkpoint.save(client, Path(d) / f"c{r}", container=c)
                pauses.append(float(info.manifest["snapshot_pause_ms"]))
                print(f"{kind}: save {r + 1}: pause {pauses[-1]:.1f} ms")
        print(
            f"{kind}: {mib} MiB variable + 2 slots + {small} small variables: "
            f"median pause {statistics.median(pauses):.1f} ms "
            f"[{min(pauses):.1f}-{max(pauses):.1f}] over {reps} saves"
        )
        await reset(client, [c])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="server or cluster node (default: embedded)")
    ap.add_argument("--mib", type=int, default=64, help="size of the large variable")
    ap.add_argument("--small", type=int, default=16, help="number of small variables")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    asyncio.run(main(a.url, a.mib, a.small, a.reps))

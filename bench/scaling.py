"""Scaling study: W5 (bench/README.md, "The workloads": the teacher data, MLP 784-1024-1024-10,
batch 128, SGD 0.01, asynchronous) with 1, 2 and 4 PS shards and 1 to 4 workers, on
this machine, and the per-step costs a model of a real cluster needs.

Each configuration runs ``workers.launcher.run_job`` (``qps train --ps S --workers W``)
against a dedicated redis-server. Measured per configuration:

* **examples/s**: steps x workers x batch / T, T from the first worker's first step to
  the last worker's last step (published by the workers);
* **CPU per step**, from ``/proc`` (user + system, every process of the run): the
  workers', the shards' and Redis's, in ms per global step (one gradient push);
* **Redis per step**: commands processed and bytes in and out (``INFO stats``), so
  the load one Redis node takes per step is known without a second machine.

With the costs, ``docs/scaling.md`` models a cluster: a worker is bound by
its own compute and round trips, a shard by its apply CPU for its share of the
parameters, one Redis node by its CPU (about one core) and its NIC. Redis Cluster
multiplies the last bound by the number of primaries the shards' variables hash to.

    python bench/scaling.py [--shards 1,2,4] [--workers 1,2,3,4] [--steps 100] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

from qps.aio import wait_event


def _redis_stats(url: str) -> dict[str, float]:
    r = harness._sync_client(url)
    s = r.info("stats")
    c = r.info("cpu")
    return {
        "commands": float(s["total_commands_processed"]),
        "bytes_in": float(s["total_net_input_bytes"]),
        "bytes_out": float(s["total_net_output_bytes"]),
        "cpu_s": float(c["used_cpu_sys"]) + float(c["used_cpu_user"]),
    }


class _Watch:
    """Samples, every 0.2 s until stopped, the CPU time of the role processes (children
    of this process) and Redis's counters, so that the training window (first worker
    step to last) can be cut out of the run: start-up and data loading not counted."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[float, dict[int, tuple[str, float]], dict[str, float]]] = []
        self._stop = asyncio.Event()

    def _children(self) -> list[int]:
        me = os.getpid()
        try:
            with open(f"/proc/{me}/task/{me}/children", encoding="ascii") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def sample(self) -> None:
        procs: dict[int, tuple[str, float]] = {}
        for pid in self._children():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            role = "worker" if b"worker" in cmd else "ps" if b"ps" in cmd else "other"
            # a role's own time and that of the children it waited for
            procs[pid] = (role, harness.proc_cpu_seconds(pid, children=True) or 0.0)
        self.samples.append((time.time(), procs, _redis_stats(self.url)))

    async def run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            await wait_event(self._stop, 0.2)

    def stop(self) -> None:
        self._stop.set()

    def window(self, t0: float, t1: float) -> tuple[dict[str, float], dict[str, float]]:
        """CPU seconds per role and Redis counter deltas between the samples around
        ``t0`` (the last one before it) and ``t1`` (the first one after it). A process
        that exited before ``t1`` counts up to its last sample."""
        before = [x for x in self.samples if x[0] <= t0] or self.samples[:1]
        after = [x for x in self.samples if x[0] >= t1] or self.samples[-1:]
        s0, s1 = before[-1], after[0]
        last: dict[int, tuple[str, float]] = {}
        for t, procs, _ in self.samples:
            if t <= s1[0]:
                last.update(procs)
        cpu: dict[str, float] = {}
        for pid, (role, c1) in last.items():
            c0 = s0[1].get(pid, (role, 0.0))[1]
            cpu[role] = cpu.get(role, 0.0) + c1 - c0
        return cpu, {k: s1[2][k] - s0[2][k] for k in s1[2]}


def run_one(url: str, shards: int, workers: int, steps: int, tag: str) -> dict[str, Any]:
    from workers import job
    from workers.launcher import TrainConfig, run_job

    harness._sync_client(url).flushall()
    container = f"scaling-{tag}"
    cfg = TrainConfig(
        num_shards=shards, num_workers=workers, steps=steps, url=url, container=container,
        model="mlp:784,1024,1024,10", data="teacher", batch_size=128, learning_rate=0.01,
        log_every=max(steps // 4, 1),
    )  # fmt: skip
    watch = _Watch(url)

    async def main() -> tuple[Any, dict[str, Any]]:
        import qps

        watcher = asyncio.ensure_future(watch.run())
        try:
            result = await run_job(cfg, lambda line: None)
        finally:
            watch.stop()
            await watcher
        async with await qps.connect(url) as client:
            statuses = await job.read_statuses(client, container)
        return result, statuses

    result, statuses = asyncio.run(main())
    if result.exit_code != 0:
        raise RuntimeError(f"run failed: {result.as_dict()}")
    ws = [s for n, s in statuses.items() if n.startswith("worker")]
    t0, t1 = min(s["started_at"] for s in ws), max(s["ended_at"] for s in ws)
    t = t1 - t0
    cpu, d = watch.window(t0, t1)
    n = steps * workers  # global steps in the window: every push, once
    return {
        "shards": shards,
        "workers": workers,
        "global_step": result.global_step,
        "seconds": round(t, 3),
        "examples_per_s": round(steps * workers * 128 / t, 1),
        "steps_per_s": round(steps * workers / t, 2),
        "accuracy": result.test_value,
        "cpu_ms_per_step": {
            "workers": round(cpu.get("worker", 0.0) / n * 1e3, 2),
            "shards": round(cpu.get("ps", 0.0) / n * 1e3, 2),
            "redis": round(d["cpu_s"] / n * 1e3, 2),
        },
        "redis_per_step": {
            "commands": round(d["commands"] / n, 1),
            "mib_in": round(d["bytes_in"] / n / 2**20, 2),
            "mib_out": round(d["bytes_out"] / n / 2**20, 2),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--workers", default="1,2,3,4")
    ap.add_argument("--steps", type=int, default=100, help="steps per worker")
    ap.add_argument("--threads", choices=["1", "default"], default="1",
                    help="OPENBLAS_NUM_THREADS for every process (default 1)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.threads == "1":
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    server = harness.BenchServer().start()
    where = server.describe()
    rows = []
    try:
        for s in (int(x) for x in a.shards.split(",")):
            for w in (int(x) for x in a.workers.split(",")):
                row = run_one(server.url, s, w, a.steps, f"{s}-{w}")
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        server.stop()
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"OPENBLAS_NUM_THREADS {os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
          f"{a.steps} steps per worker, {where['server']}, {where['transport']}\n")  # fmt: skip
    print(
        "| shards | workers | examples/s | steps/s | CPU ms/step: workers / shards / "
        "Redis | Redis commands/step | MiB in / out per step |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c, q = r["cpu_ms_per_step"], r["redis_per_step"]
        print(f"| {r['shards']} | {r['workers']} | {r['examples_per_s']:,.0f} | "
              f"{r['steps_per_s']:.1f} | {c['workers']} / {c['shards']} / {c['redis']} | "
              f"{q['commands']} | {q['mib_in']} / {q['mib_out']} |")  # fmt: skip
    if a.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()

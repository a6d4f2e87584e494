"""Soak runs: long, steady load, watched for drift, growth and loss.

``queues``: P producer and C consumer processes on one FIFOQueue (capacity 1,000) of a
dedicated ``redis-server`` for ``--minutes``. Producer p enqueues ``[p, seq]`` int64
pairs in batches of ``--batch`` until the time is up; then the queue is closed and the
consumers (``dequeue_up_to``) drain it. Each consumer keeps, per producer, the count,
sum and sum of squares of the sequence numbers it got: the totals must be those of
0..n_p-1 for every producer (nothing lost, nothing twice).

``train``: ``qps train`` (S shards, W asynchronous workers, digits MLP) against a
dedicated server for ``--minutes``, then ``qps job stop``: every role must exit 0 and
the global step must equal the workers' steps.

Every ``--every`` seconds it samples throughput (elements dequeued, or global steps),
the resident memory of every process (from ``/proc``) and Redis's ``used_memory``.
Reported: throughput per interval and its drift (mean of the last third against the
first third; the goal is no fall of more than 10 %), and each memory series' first and
last values and its largest rise after the warm-up (the first fifth of the run). The CPU
time of every process of the run and of Redis is sampled too: CPU ms per unit of work
(element or global step) in the first and last thirds tells a slowdown of the code (more
CPU per unit) from a busier machine (the same CPU per unit, less of it to go round).

    python bench/soak.py queues --minutes 10 --producers 8 --consumers 8
    python bench/soak.py train --minutes 10 --workers 4 --shards 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "soak"


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children", encoding="ascii") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


# -- queue roles ----------------------------------------------------------------------------


async def producer(url: str, p: int, batch: int, until: float) -> None:
    import qps

    async with await qps.connect(url) as c:
        q = qps.FIFOQueue(1000, np.int64, shapes=[[2]], shared_name=QUEUE, client=c)
        seq = 0
        while time.time() < until:
            rows = np.empty((batch, 2), np.int64)
            rows[:, 0] = p
            rows[:, 1] = np.arange(seq, seq + batch)
            await q.enqueue_many(rows, timeout=60)
            seq += batch
    print(json.dumps({"producer": p, "produced": seq}), flush=True)


async def consumer(url: str, batch: int) -> None:
    import qps
    from qps.errors import OutOfRangeError

    sums: dict[int, list[int]] = {}
    async with await qps.connect(url) as c:
        q = qps.FIFOQueue(1000, np.int64, shapes=[[2]], shared_name=QUEUE, client=c)
        while True:
            try:
                got = await q.dequeue_up_to(batch, timeout=120)
            except OutOfRangeError:
                break
            for p in np.unique(got[:, 0]):
                seqs = got[got[:, 0] == p, 1]
                s = sums.setdefault(int(p), [0, 0, 0])
                s[0] += len(seqs)
                s[1] += int(seqs.sum())
                s[2] += int((seqs * seqs).sum())
    print(json.dumps({"consumed": {str(k): v for k, v in sums.items()}}), flush=True)


# -- the runs ---------------------------------------------------------------------------------


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
    env.pop("QPS_REDIS_URL", None)
    return subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


async def _redis_used(client: Any) -> float:
    info = await client.commands.info("memory")
    return float(info["used_memory"]) / (1 << 20)


def _summary(samples: list[dict[str, Any]], rate_key: str, warm: float) -> dict[str, Any]:
    """Rates and memory after the warm-up (the first ``warm`` seconds: start-up)."""
    t0 = samples[0]["t"]
    rates = [s[rate_key] for s in samples[1:] if s["t"] - t0 >= warm] or [
        s[rate_key] for s in samples[1:]
    ]
    third = max(1, len(rates) // 3)
    first, last = statistics.mean(rates[:third]), statistics.mean(rates[-third:])
    after = [s for s in samples if s["t"] - t0 >= warm]
    mem: dict[str, Any] = {}
    for name in samples[-1]["rss_mib"]:
        series = [s["rss_mib"][name] for s in after if name in s["rss_mib"]]
        if series:
            mem[name] = {
                "first": round(series[0], 1),
                "last": round(series[-1], 1),
                "max_rise": round(max(series) - series[0], 1),
            }
    redis = [s["redis_mib"] for s in after]
    # CPU seconds per unit of work (all the run's processes and Redis), per interval: a
    # fall in throughput with the same CPU per unit is the machine, not the code
    pairs = [(a, b) for a, b in itertools.pairwise(after) if "cpu_s" in a and "cpu_s" in b]
    per_unit = [
        (b["cpu_s"] - a["cpu_s"]) / (b["work"] - a["work"]) * 1e3
        for a, b in pairs
        if b["work"] > a["work"]
    ]
    busy = [(b["cpu_s"] - a["cpu_s"]) / (b["t"] - a["t"]) for a, b in pairs]
    cpu: dict[str, Any] = {}
    if per_unit:
        k = max(1, len(per_unit) // 3)
        c1, c2 = statistics.mean(per_unit[:k]), statistics.mean(per_unit[-k:])
        cpu = {
            "cpu_ms_per_unit_first_third": round(c1, 3),
            "cpu_ms_per_unit_last_third": round(c2, 3),
            "cpu_drift": round(c2 / c1 - 1.0, 3),
            "cpu_busy_first_third": round(statistics.mean(busy[:k]), 2),
            "cpu_busy_last_third": round(statistics.mean(busy[-k:]), 2),
        }
    return {
        **cpu,
        "rates": [round(r, 1) for r in rates],
        "intervals": len(rates),
        "rate_first_third": round(first, 1),
        "rate_last_third": round(last, 1),
        "drift": round(last / first - 1.0, 3) if first else None,
        "rate_min": round(min(rates), 1),
        "rate_max": round(max(rates), 1),
        "rss_mib": mem,
        "redis_used_mib": {
            "first": round(redis[0], 1),
            "last": round(redis[-1], 1),
            "max_rise": round(max(redis) - redis[0], 1),
        },
    }


async def soak_queues(a: argparse.Namespace, server: harness.BenchServer) -> dict[str, Any]:
    import qps

    client = await qps.connect(server.url)
    q = qps.FIFOQueue(1000, np.int64, shapes=[[2]], shared_name=QUEUE, client=client)
    await q.size()  # created before the roles open it
    until = time.time() + a.minutes * 60
    me = [sys.executable, __file__]
    prods = [
        _spawn(
            [
                *me,
                "--role",
                "producer",
                "--url",
                server.url,
                "--index",
                str(p),
                "--batch",
                str(a.batch),
                "--until",
                str(until),
            ]
        )
        for p in range(a.producers)
    ]
    cons = [
        _spawn([*me, "--role", "consumer", "--url", server.url, "--batch", str(a.batch)])
        for _ in range(a.consumers)
    ]
    procs = {f"producer{i}": p for i, p in enumerate(prods)}
    procs.update({f"consumer{i}": p for i, p in enumerate(cons)})
    samples: list[dict[str, Any]] = []
    last = None
    while time.time() < until:
        st = await q.stats()
        now = time.time()
        s = {
            "t": now,
            "dequeued": st.dequeued_total,
            "size": st.size,
            "rss_mib": {n: r for n, p in procs.items() if (r := rss_mib(p.pid)) is not None},
            "redis_mib": await _redis_used(client),
        }
        s["work"] = st.dequeued_total
        pids = [p.pid for p in procs.values()] + server.pids()
        s["cpu_s"] = sum(c for k in pids if (c := harness.proc_cpu_seconds(k)))
        if last is not None:
            s["el_per_s"] = (s["dequeued"] - last["dequeued"]) / (now - last["t"])
        samples.append(s)
        last = s
        await asyncio.sleep(min(a.every, max(0.1, until - time.time())))
    produced: dict[int, int] = {}
    for p in prods:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        d = json.loads(out.strip().splitlines()[-1])
        produced[d["producer"]] = d["produced"]
    await q.close()
    got: dict[int, list[int]] = {}
    for c in cons:
        out, err = c.communicate(timeout=300)
        assert c.returncode == 0, err[-2000:]
        for k, v in json.loads(out.strip().splitlines()[-1])["consumed"].items():
            g = got.setdefault(int(k), [0, 0, 0])
            for i in range(3):
                g[i] += v[i]
    problems = []
    for p, n in produced.items():
        want = [n, n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6]
        if got.get(p, [0, 0, 0]) != want:
            problems.append(
                f"producer {p}: produced {n}, consumed count/sum/sumsq {got.get(p)} != {want}"
            )
    await client.close()
    total = sum(produced.values())
    return {
        "kind": "queues",
        "producers": a.producers,
        "consumers": a.consumers,
        "batch": a.batch,
        "minutes": a.minutes,
        "elements": total,
        "lost_or_duplicated": problems,
        "ok": not problems,
        **_summary(samples, "el_per_s", a.minutes * 60 / 5),
    }


async def soak_train(a: argparse.Namespace, server: harness.BenchServer) -> dict[str, Any]:
    import qps
    from qps.ps import control

    container = "soak"
    train = _spawn(
        [
            sys.executable,
            "-m",
            "qps.cli.main",
            "train",
            "--url",
            server.url,
            "--container",
            container,
            "--ps",
            str(a.shards),
            "--workers",
            str(a.workers),
            "--steps",
            "100000000",
            "--log-every",
            "50",
            "--json",
            "-q",
        ]
    )
    client = await qps.connect(server.url)
    start = time.time()
    until = start + a.minutes * 60
    samples: list[dict[str, Any]] = []
    last = None
    while time.time() < until:
        try:
            gs = int(await control.global_step_counter(client, container).get())
        except Exception:
            gs = 0
        now = time.time()
        kids = descendants(train.pid)
        s = {
            "t": now,
            "global_step": gs,
            "rss_mib": {f"pid{k}": r for k in kids if (r := rss_mib(k)) is not None},
            "redis_mib": await _redis_used(client),
        }
        s["rss_mib"]["qps train"] = rss_mib(train.pid) or 0.0
        s["work"] = gs
        s["cpu_s"] = sum(
            c for k in [train.pid, *kids, *server.pids()] if (c := harness.proc_cpu_seconds(k))
        )
        if last is not None:
            s["steps_per_s"] = (gs - last["global_step"]) / (now - last["t"])
        samples.append(s)
        last = s
        await asyncio.sleep(min(a.every, max(0.1, until - time.time())))
    stop = subprocess.run(
        [
            sys.executable,
            "-m",
            "qps.cli.main",
            "job",
            "stop",
            "--yes",
            "--timeout",
            "120",
            "--url",
            server.url,
            "--container",
            container,
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = train.communicate(timeout=300)
    problems = []
    if stop.returncode != 0:
        problems.append(f"qps job stop exited {stop.returncode}: {stop.stderr[-500:]}")
    if train.returncode != 0:
        problems.append(f"qps train exited {train.returncode}: {err[-1000:]}")
    result = json.loads(out) if out.strip() else {}
    gs = int(await control.global_step_counter(client, container).get())
    from workers import monitor

    snap = await monitor.snapshot(client, container)
    steps = sum(w.step for w in snap.workers)
    if gs != steps:
        problems.append(f"global step {gs} != the workers' steps {steps}")
    await client.close()
    return {
        "kind": "train",
        "workers": a.workers,
        "shards": a.shards,
        "minutes": a.minutes,
        "global_step": gs,
        "test_value": result.get("test_value"),
        "ok": not problems,
        "problems": problems,
        **_summary(samples, "steps_per_s", a.minutes * 60 / 5),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("kind", nargs="?", choices=["queues", "train"])
    p.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, help=argparse.SUPPRESS)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--producers", type=int, default=8)
    p.add_argument("--consumers", type=int, default=8)
    p.add_argument("--batch", type=int, default=10, help="elements per queue call")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    a = p.parse_args()
    if a.role == "producer":
        asyncio.run(producer(a.url, a.index, a.batch, a.until))
        return
    if a.role == "consumer":
        asyncio.run(consumer(a.url, a.batch))
        return
    if a.kind is None:
        p.error("say which soak: queues or train")
    server = harness.BenchServer().start()
    try:
        run = soak_queues if a.kind == "queues" else soak_train
        result = asyncio.run(run(a, server))
    finally:
        server.stop()
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()

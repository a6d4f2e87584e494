"""W4 train-async-small, W5 train-async-large and W6 train-sync-small
(bench/README.md, "The workloads"): qps against a minimal raw-Redis PS and single-process NumPy,
measured in one run (W6: qps --mode sync against a raw PS that averages one gradient
per worker per update).

* W4: the digits MLP 64-128-10, batch 64, SGD 0.05, 2 workers x 1,500 steps.
  W5: the teacher data, MLP 784-1024-1024-10, batch 128, SGD 0.01, 2 workers x 300.
* **qps**: ``workers.launcher.run_job`` with 1 PS shard and 2 workers (``qps train --ps
  1 --workers 2``). T is from the first worker's first step to the last worker's last
  step (wall clock, published by the workers), so process start-up is not counted.
  A small dense model is packed by the workers themselves (``qps worker --pack``, the
  default: the MLP's four parameters stored as one flat variable per shard, the same
  arithmetic; docs/models.md), as for W4 and W6; W5's model is too large for it.
* **qps unpacked** (W4, W6; ``--unpacked``): the same with ``--no-pack``: one variable
  per parameter.
* **raw**: one PS process and two worker processes with synchronous redis-py clients,
  no qps code. Worker step: ``GET params`` -> NumPy gradient -> ``RPUSH grads`` (worker
  id + gradient) -> ``BLPOP ack:<worker>``. PS: ``BLPOP grads`` -> apply -> ``SET
  params`` -> ``RPUSH ack:<worker>``. T as for qps.
* **numpy**: the same model, init and SGD in one process, 3,000 steps of the seed-1
  minibatch stream.

Metric: examples/s = steps x workers x batch / T, and the test accuracy of the final
parameters. A dedicated redis-server (TCP loopback, no persistence) serves qps and raw.
Also printed: the payload bytes per worker step through Redis (P = the parameters'
bytes; both designs relay through Redis: pull P, push P, the PS reads P and writes P)
and the loopback bytes per worker step measured from ``/proc/net/dev`` (``lo``, received
bytes) over the whole run of each side (set-up and the final reads included): what W5
moves through Redis per step, checked against the wire.

    python bench/train_async.py [--workload w4|w5|w6] [--reps 3] [--threads 1|default]
                                [--unpacked both|only|no] [--backend auto|numpy|cupy]
                                [--grad-dtype float16] [--unix]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS: dict[str, dict[str, Any]] = {
    "w4": {"steps": 1500, "batch": 64, "lr": 0.05, "sizes": [(64, 128), (128, 10)],
           "data": "digits", "model": "mlp:64,128,10"},
    # W6: W4 synchronous: each update is the mean of one gradient per worker
    "w6": {"steps": 1500, "batch": 64, "lr": 0.05, "sizes": [(64, 128), (128, 10)],
           "data": "digits", "model": "mlp:64,128,10", "sync": True},
    "w5": {"steps": 300, "batch": 128, "lr": 0.01,
           "sizes": [(784, 1024), (1024, 1024), (1024, 10)],
           "data": "teacher", "model": "mlp:784,1024,1024,10"},
}  # fmt: skip
WORKERS = 2
# set by configure() from the workload
STEPS = BATCH = 0
LR = np.float32(0)
SIZES: list[tuple[int, int]] = []
DATA = MODEL = ""
SYNC = False


def configure(name: str, steps: int | None = None) -> None:
    """Set the globals to workload ``name``'s (``steps``: another number of steps per
    worker, as bench/cpu_per_update.py runs)."""
    global STEPS, BATCH, LR, SIZES, DATA, MODEL, SYNC
    w = WORKLOADS[name]
    STEPS, BATCH, LR, SIZES = w["steps"], w["batch"], np.float32(w["lr"]), w["sizes"]
    STEPS = steps or STEPS
    DATA, MODEL, SYNC = w["data"], w["model"], bool(w.get("sync"))


# -- data and model, no qps code (the raw and numpy variants) ---------------------------------


def dataset() -> tuple[np.ndarray, ...]:
    if DATA == "teacher":  # W5's draw order
        rng = np.random.default_rng(0)
        x = rng.standard_normal((60000, 784), np.float32)
        t = rng.standard_normal((784, 10), np.float32)
        xte = rng.standard_normal((10000, 784), np.float32)
        return x, (x @ t).argmax(1), xte, (xte @ t).argmax(1)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0)
    sc = StandardScaler().fit(xtr)
    return (
        sc.transform(xtr).astype(np.float32),
        ytr.astype(np.int64),
        sc.transform(xte).astype(np.float32),
        yte.astype(np.int64),
    )


def init() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for fi, fo in SIZES:
        w = (rng.standard_normal((fi, fo), np.float32) * np.sqrt(2 / fi)).astype(np.float32)
        out += [w, np.zeros(fo, np.float32)]
    return out


def grads(p: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    hs = [x]
    for i in range(0, len(p) - 2, 2):
        hs.append(np.maximum(hs[-1] @ p[i] + p[i + 1], 0))
    z = hs[-1] @ p[-2] + p[-1]
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    pr = e / e.sum(axis=1, keepdims=True)
    pr[np.arange(len(y)), y] -= 1
    d = pr / len(y)
    out: list[np.ndarray] = []
    for i in range(len(p) - 2, -1, -2):
        out = [hs[i // 2].T @ d, d.sum(0), *out]
        if i:
            d = (d @ p[i].T) * (hs[i // 2] > 0)
    return out


def accuracy(p: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    h = x
    for i in range(0, len(p) - 2, 2):
        h = np.maximum(h @ p[i] + p[i + 1], 0)
    return float(((h @ p[-2] + p[-1]).argmax(1) == y).mean())


def batches(n: int, rng: np.random.Generator) -> Any:
    while True:
        perm = rng.permutation(n)
        for i in range(n // BATCH):
            yield perm[i * BATCH : (i + 1) * BATCH]


def flat(ps: list[np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(a, np.float32).tobytes() for a in ps)


def unflat(buf: bytes) -> list[np.ndarray]:
    out, off = [], 0
    for fi, fo in SIZES:
        for shape in ((fi, fo), (fo,)):
            n = int(np.prod(shape))
            out.append(np.frombuffer(buf, np.float32, n, off).reshape(shape))
            off += n * 4
    return out


# -- numpy ----------------------------------------------------------------------------------


def run_numpy() -> dict[str, Any]:
    xtr, ytr, xte, yte = dataset()
    p = init()
    order = batches(len(ytr), np.random.default_rng(1))
    t0 = time.perf_counter()
    for _ in range(STEPS * WORKERS):
        idx = next(order)
        for a, g in zip(p, grads(p, xtr[idx], ytr[idx])):
            a -= LR * g
    t = time.perf_counter() - t0
    return {"seconds": t, "accuracy": accuracy(p, xte, yte)}


def lo_bytes() -> int | None:
    """Bytes received on the loopback interface so far (None where unreadable)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def measured(run: Any, *args: Any) -> dict[str, Any]:
    """``run(*args)``'s result with ``lo_bytes``: the loopback bytes during the run."""
    before = lo_bytes()
    out = run(*args)
    after = lo_bytes()
    out["lo_bytes"] = None if before is None or after is None else after - before
    return out


# -- raw Redis PS ---------------------------------------------------------------------------


def _raw_ps(workload: str, url: str, ready: Any, steps: int) -> None:
    import redis

    configure(workload, steps)
    r = redis.Redis.from_url(url)
    p = init()
    r.set("params", flat(p))
    ready.set()
    if SYNC:  # W6: average one gradient from each worker, then ack both
        for _ in range(STEPS):
            msgs = [r.blpop(["grads"])[1] for _ in range(WORKERS)]
            gs = [unflat(m[1:]) for m in msgs]
            for i, a in enumerate(p):
                a -= LR * (sum(g[i] for g in gs) / WORKERS)
            r.set("params", flat(p))
            for m in msgs:
                r.rpush(b"ack:" + m[:1], 1)
        return
    for _ in range(STEPS * WORKERS):
        _, msg = r.blpop(["grads"])
        wid, g = msg[:1], unflat(msg[1:])
        for a, d in zip(p, g):
            a -= LR * d
        r.set("params", flat(p))
        r.rpush(b"ack:" + wid, 1)


def _raw_worker(workload: str, url: str, k: int, ready: Any, out: Any, steps: int) -> None:
    import redis

    configure(workload, steps)
    r = redis.Redis.from_url(url)
    xtr, ytr, _, _ = dataset()
    order = batches(len(ytr), np.random.default_rng(1 + k))
    wid = str(k).encode()
    ready.wait()
    start = time.time()
    for _ in range(STEPS):
        p = unflat(r.get("params"))
        idx = next(order)
        r.rpush("grads", wid + flat(grads(p, xtr[idx], ytr[idx])))
        r.blpop([b"ack:" + wid])
    out.put((start, time.time()))


def run_raw(workload: str, url: str) -> dict[str, Any]:
    import redis

    redis.Redis.from_url(url).flushall()
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    ps = ctx.Process(target=_raw_ps, args=(workload, url, ready, STEPS))
    ws = [
        ctx.Process(target=_raw_worker, args=(workload, url, k, ready, out, STEPS))
        for k in range(WORKERS)
    ]
    for proc in (ps, *ws):
        proc.start()
    spans = [out.get(timeout=600) for _ in ws]
    for proc in (ps, *ws):
        proc.join(60)
    _, _, xte, yte = dataset()
    p = unflat(redis.Redis.from_url(url).get("params"))
    t = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"seconds": t, "accuracy": accuracy(p, xte, yte)}


# -- qps ------------------------------------------------------------------------------------


def run_qps(
    url: str, rep: int, pack: bool = True, backend: str = "", grad_dtype: str = ""
) -> dict[str, Any]:
    import redis

    from workers import job
    from workers.launcher import TrainConfig, run_job

    redis.Redis.from_url(url).flushall()
    container = f"bench-{rep}"
    cfg = TrainConfig(
        num_shards=1, num_workers=WORKERS, steps=STEPS, url=url, container=container,
        model=MODEL, data=DATA, batch_size=BATCH, learning_rate=float(LR),
        sync_replicas=WORKERS if SYNC else None, backend=backend, grad_dtype=grad_dtype, pack=pack,
    )  # fmt: skip

    async def main() -> tuple[Any, dict[str, Any]]:
        import qps

        result = await run_job(cfg, lambda line: None)
        async with await qps.connect(url) as client:
            statuses = await job.read_statuses(client, container)
        return result, statuses

    result, statuses = asyncio.run(main())
    if result.exit_code != 0:
        raise RuntimeError(f"qps run failed: {result.as_dict()}")
    ws = [s for n, s in statuses.items() if n.startswith("worker")]
    t = max(s["ended_at"] for s in ws) - min(s["started_at"] for s in ws)
    return {
        "seconds": t,
        "accuracy": result.test_value,
        "staleness_p50": result.staleness_p50,
        "staleness_p99": result.staleness_p99,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="w4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", choices=["1", "default"], default="1",
                    help="OPENBLAS_NUM_THREADS for every process (default 1)")  # fmt: skip
    ap.add_argument("--unpacked", choices=["both", "only", "no"], default=None,
                    help="qps with --no-pack (one variable per parameter) too, instead, or "
                    "not (default: both for W4 and W6, no for W5)")  # fmt: skip
    ap.add_argument("--backend", choices=["auto", "numpy", "cupy"], default="",
                    help="where the qps workers' math runs (qps worker --backend; default: "
                    "$QPS_BACKEND, else auto: CuPy on a CUDA device); raw and numpy always "
                    "use NumPy")  # fmt: skip
    ap.add_argument("--grad-dtype", choices=["float16", "float32"], default="",
                    help="the qps workers send gradients in this dtype (qps worker "
                    "--grad-dtype: an optional fp16 transfer); default: "
                    "the variables' float32")  # fmt: skip
    ap.add_argument("--unix", action="store_true",
                    help="the dedicated server listens on a unix socket, for qps and raw "
                    "alike (default: TCP loopback)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    unpacked = args.unpacked or ("no" if args.workload == "w5" else "both")
    impls = {"both": ["qps", "qps unpacked"], "only": ["qps unpacked"], "no": ["qps"]}[unpacked]
    if args.threads == "1":
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    configure(args.workload)
    import harness

    server = harness.BenchServer(unix=args.unix).start()
    where = server.describe()
    try:
        got: dict[str, list[dict[str, Any]]] = {k: [] for k in (*impls, "raw", "numpy")}
        for rep in range(args.reps):
            got["numpy"].append(run_numpy())
            got["raw"].append(measured(run_raw, args.workload, server.url))
            for k in impls:
                got[k].append(
                    measured(run_qps, server.url, rep, k == "qps", args.backend,
                             args.grad_dtype)
                )  # fmt: skip
            print(f"rep {rep}: " + ", ".join(
                f"{k} {STEPS * WORKERS * BATCH / v[-1]['seconds']:,.0f} ex/s "
                f"(acc {v[-1]['accuracy']:.3f})" for k, v in got.items()
            ), flush=True)  # fmt: skip
    finally:
        server.stop()
    rates = {k: [STEPS * WORKERS * BATCH / r["seconds"] for r in v] for k, v in got.items()}
    rate = {k: statistics.median(v) for k, v in rates.items()}
    # each repetition's qps against the raw run next to it (repetition-major order)
    ratios = {k: [q / r for q, r in zip(rates[k], rates["raw"])] for k in impls}
    acc = {k: statistics.median(r["accuracy"] for r in v) for k, v in got.items()}
    print(f"\n- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"- OPENBLAS_NUM_THREADS: {os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    print(f"- qps workers' backend: {args.backend or os.environ.get('QPS_BACKEND') or 'auto'}")
    print(f"- qps gradients sent as: {args.grad_dtype or 'float32, the variables dtype'}")
    print(f"- repetitions: {args.reps}, medians; {where['server']}, {where['transport']}\n")
    steps = STEPS * WORKERS
    p_bytes = sum(4 * (i * o + o) for i, o in SIZES)  # float32 weights and biases
    print(f"| {args.workload.upper()} | examples/s, median [min-max] | test accuracy | "
          "loopback bytes per worker step |")  # fmt: skip
    print("|---|---|---|---|")
    for k in got:
        lo = [r["lo_bytes"] for r in got[k] if r.get("lo_bytes") is not None]
        per = f"{statistics.median(lo) / steps / 1e6:.1f} MB" if lo else "—"
        spread = f"{rate[k]:,.0f} [{min(rates[k]):,.0f}-{max(rates[k]):,.0f}]"
        print(f"| {k} | {spread} | {acc[k]:.3f} | {per} |")
    print(
        f"\nP = {p_bytes:,} bytes; payload through Redis per worker step: 4P = "
        f"{4 * p_bytes / 1e6:.1f} MB for both (pull, push, the PS's read and write)"
    )
    goal = {"w4": 1.2, "w5": 2.0, "w6": 1.0}[args.workload]
    print()
    for k in impls:
        each = ", ".join(f"{x:.2f}" for x in ratios[k])
        stale = got[k][-1]
        print(f"{k} / raw = {rate[k] / rate['raw']:.2f} (goal >= {goal}; per repetition "
              f"{each}); staleness p50 {stale['staleness_p50']} / p99 "
              f"{stale['staleness_p99']}")  # fmt: skip
    if args.json:
        print(json.dumps({"rate": rate, "rates": rates, "ratios": ratios, "accuracy": acc}))


if __name__ == "__main__":
    main()

"""CPU per update of W4/W5/W6 (bench/train_async.py's runs), by role, for qps and the
raw-Redis PS: where the time of one update goes, in a figure the VM's noise hardly moves.

Examples/s on the 2-vCPU VM swing by ±25 % between runs; the CPU each process spends
per update moves much less, so it is the figure to judge a change by (and the one that
says whether a run was CPU-bound: total CPU / wall time near 2 means both vCPUs were
busy). Each variant runs twice, at ``--steps A`` and ``B`` steps per worker, in fresh
processes on one Redis server; the difference between the two runs divided by the
difference in updates cancels what does not grow with the run (imports, set-up, data,
the start and the end). An update is one applied gradient message (W4, W5) or one
synchronous update of two gradients (W6).

Each role's CPU is its process's own (user + system, all threads), written when it
exits by ``bench/cpuprobe/sitecustomize.py`` (put on ``PYTHONPATH`` for the runs);
Redis's from ``INFO cpu``. ``--scripts`` adds Redis's time per update in each Lua
script and plain command of qps's second run (``SLOWLOG`` with a threshold of 0, which
itself costs the server a little).

Usage::

    OPENBLAS_NUM_THREADS=1 python bench/cpu_per_update.py --workload w4 [--steps 500 2500]
        [--impl qps|raw|both] [--scripts]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import train_async as ta  # noqa: E402


def _redis_cpu(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _role(argv: list[str]) -> str:
    """The role of a process of a run, from its command line."""
    line = " ".join(argv)
    if "qps.cli.main" in line or "qps/cli/main.py" in line:
        for word in ("worker", "ps", "feed"):
            if word in argv:
                return "shard" if word == "ps" else word
        return "qps (other)"
    return "raw roles"  # the raw PS and workers: spawned children, told apart by nothing


def run_once(
    impl: str, workload: str, url: str, steps: int, pack: bool = True
) -> dict[str, Any]:
    """One run of ``impl`` at ``steps`` steps per worker: wall seconds and the CPU
    seconds of each role and of Redis."""
    import redis

    ta.configure(workload, steps)
    r = redis.Redis.from_url(url)
    with tempfile.TemporaryDirectory(prefix="qps-cpu-") as d:
        os.environ["QPS_BENCH_CPU_DIR"] = d
        try:
            before = _redis_cpu(r)
            out = ta.run_qps(url, 0, pack) if impl == "qps" else ta.run_raw(workload, url)
            redis_cpu = _redis_cpu(r) - before
        finally:
            os.environ.pop("QPS_BENCH_CPU_DIR", None)
        cpu: dict[str, float] = collections.defaultdict(float)
        for f in Path(d).glob("*.json"):
            got = json.loads(f.read_text(encoding="utf-8"))
            cpu[_role(got["argv"])] += got["cpu"]
    cpu["redis"] = redis_cpu
    updates = ta.STEPS * (1 if ta.SYNC else ta.WORKERS)
    return {"seconds": out["seconds"], "cpu": dict(cpu), "updates": updates}


def slope(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Milliseconds per update between runs ``a`` and ``b`` (wall and each role's CPU)."""
    du = b["updates"] - a["updates"]
    roles = sorted(set(a["cpu"]) | set(b["cpu"]))
    cpu = {k: (b["cpu"].get(k, 0.0) - a["cpu"].get(k, 0.0)) / du * 1e3 for k in roles}
    return {"wall": (b["seconds"] - a["seconds"]) / du * 1e3, "cpu": cpu}


def _script_names() -> dict[str, str]:
    """SHA1 -> name of the Lua scripts qps runs: the queue scripts in ``qps/lua/`` and
    the scripts of their own in its folders (``vars/write``, ``ps/...``)."""
    from qps import transport

    lua = Path(transport.__file__).parent / "lua"
    names = {}
    for path in sorted(lua.glob("*.lua")):
        if not path.stem.endswith(("_fast", "_common")):
            names[transport._Script(path.stem).sha] = f"queue {path.stem}"
    for path in sorted(lua.glob("*/*.lua")):
        name = f"{path.parent.name}/{path.stem}"
        names[transport._Script(name).sha] = name
    return names


def script_costs(r: Any, updates: int) -> list[tuple[str, float, float]]:
    """(script or command, calls per update, µs per update) from the slow log, costliest
    first (commands run by scripts are in their script's time)."""
    names = _script_names()
    calls: dict[str, int] = collections.Counter()
    usec: dict[str, float] = collections.Counter()
    for e in r.slowlog_get(10_000_000):
        cmd = e["command"]
        cmd = cmd.decode("latin-1") if isinstance(cmd, bytes) else str(cmd)
        parts = cmd.split(" ")
        if parts[0].upper() == "EVALSHA" and len(parts) > 1:
            key = names.get(parts[1], f"script {parts[1][:8]}")
        else:
            key = parts[0].upper()
        calls[key] += 1
        usec[key] += e["duration"]
    rows = [(k, calls[k] / updates, usec[k] / updates) for k in usec]
    return sorted(rows, key=lambda row: -row[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(ta.WORKLOADS), default="w4")
    ap.add_argument("--steps", type=int, nargs=2, default=(500, 2500), metavar=("A", "B"),
                    help="steps per worker of the two runs (default 500 2500)")  # fmt: skip
    ap.add_argument("--impl", choices=("qps", "raw", "both"), default="both")
    ap.add_argument("--scripts", action="store_true",
                    help="also Redis's time per update in each script/command (qps)")  # fmt: skip
    ap.add_argument("--no-pack", action="store_true",
                    help="qps trains with --no-pack: one variable per parameter (by "
                    "default the workers pack a small dense model)")  # fmt: skip
    args = ap.parse_args()
    a, b = args.steps
    if not 0 < a < b:
        ap.error("--steps A B needs 0 < A < B")
    probe = str(BENCH / "cpuprobe")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [probe, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    import redis

    server = harness.BenchServer().start()
    where = server.describe()
    impls = ["qps", "raw"] if args.impl == "both" else [args.impl]
    results: dict[str, dict[str, Any]] = {}
    costs: list[tuple[str, float, float]] = []
    try:
        r = redis.Redis.from_url(server.url)
        for impl in impls:
            first = run_once(impl, args.workload, server.url, a, not args.no_pack)
            if impl == "qps" and args.scripts:
                r.config_set("slowlog-log-slower-than", 0)
                r.config_set("slowlog-max-len", 10_000_000)
                r.slowlog_reset()
            second = run_once(impl, args.workload, server.url, b, not args.no_pack)
            if impl == "qps" and args.scripts:
                costs = script_costs(r, second["updates"])
                r.config_set("slowlog-log-slower-than", 10_000)
                r.slowlog_reset()
            results[impl] = slope(first, second)
    finally:
        server.stop()
    what = "message" if args.workload != "w6" else "synchronous update (2 gradients)"
    print(f"\n{args.workload.upper()}: milliseconds per update (one {what}), from runs of "
          f"{a} and {b} steps per worker; {where['server']}, {where['transport']}; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}\n")  # fmt: skip
    print("| variant | wall | CPU, all processes | busy vCPUs | CPU by process |")
    print("|---|---|---|---|---|")
    for impl, res in results.items():
        total = sum(res["cpu"].values())
        parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(res["cpu"].items(), key=lambda kv: -kv[1]))
        busy = total / res["wall"] if res["wall"] > 0 else float("nan")
        print(f"| {impl} | {res['wall']:.3f} | {total:.3f} | {busy:.2f} | {parts} |")
    if costs:
        print("\nRedis, qps's second run: per update (scripts include the commands they run)\n")
        print("| script or command | calls | µs |")
        print("|---|---|---|")
        for key, n, us in costs[:20]:
            print(f"| {key} | {n:.2f} | {us:.1f} |")
        print(f"| all | | {math.fsum(u for _, _, u in costs):.1f} |")


if __name__ == "__main__":
    main()

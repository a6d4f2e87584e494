"""Every long-running role stops promptly on SIGTERM and SIGINT, whatever it is doing
(qps/stopping.py): `qps worker` waiting for the chief, for a batch of an empty input
queue, for a synchronous update's token, training, or connecting to a Redis that does
not answer; `qps ps` idle; `qps feed` blocked on a full queue; any of them while Redis
is hung (its server stopped with SIGSTOP); and a worker waiting for the chief also
stops on `qps job stop`.

Each role is a real process (``python -m qps.cli.main``) against a redis-server of the
test's own (a private :class:`qps.embedded.EmbeddedServer`, which a test may pause). The
test waits until the state is observable (a log line, and the role's connections
blocked in Redis), sends the signal and measures the time until the process has exited.
The product's bound is 2 s (:data:`BOUND`); each message reports the time measured.

Exit status (see qps/stopping.py): 0 when the role stopped as asked, cleanly or by
cutting a wait short; 128 + the signal (143, 130) when it could not stop in time (Redis
hung under it) and was cancelled or made to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner

import qps
from qps.cli.main import cli
from qps.embedded import EmbeddedServer
from qps.optimizers import SGD
from qps.ps import control
from qps.queues.inspect import queue_stats
from qps.stopping import Stopped, Stopper
from workers import job

REPO = str(Path(__file__).resolve().parents[1])

#: the product's bound: a role exits within this many seconds of SIGTERM/SIGINT
BOUND = 2.0
#: how long a test waits for a role to exit before it fails (and kills it)
EXIT_WAIT = 10.0
#: how long a test waits for a role to reach the state under test
STATE_WAIT = 60.0

SIGNALS = [signal.SIGTERM, signal.SIGINT]


def _signame(sig: int) -> str:
    return signal.Signals(sig).name


class Role:
    """A role process whose output (stdout and stderr together) a thread collects, so
    that a test can wait for a line without blocking on the pipe."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": REPO}
        env.pop("QPS_LOG_LEVEL", None)  # the role's own level: INFO
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qps.cli.main", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_line(self, needle: str, timeout: float = STATE_WAIT) -> None:
        """Wait until a line of the output contains ``needle``."""

        def seen() -> bool:
            return self._eof or any(needle in line for line in self.lines)

        with self._changed:
            self._changed.wait_for(seen, timeout)
            found = any(needle in line for line in self.lines)
        assert found, f"no line with {needle!r} (exit {self.proc.poll()}):\n{self.output[-3000:]}"

    def stop(self, sig: int) -> float:
        """Send ``sig``; return the seconds until the process exited (fails past
        :data:`EXIT_WAIT`)."""
        assert self.proc.poll() is None, f"exited before the signal:\n{self.output[-3000:]}"
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=EXIT_WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"still running {EXIT_WAIT:g} s after {_signame(sig)}:\n{self.output[-3000:]}"
            ) from None
        took = time.monotonic() - start
        self._reader.join(timeout=EXIT_WAIT)
        return took

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def assert_stopped(role: Role, sig: int, took: float, status: int | tuple[int, ...] = 0) -> None:
    """``role`` exited within :data:`BOUND` of ``sig`` with ``status`` (one of them) and
    said it stopped."""
    out = role.output[-3000:]
    print(f"exited {took:.3f} s after {_signame(sig)}, status {role.proc.returncode}")
    allowed = status if isinstance(status, tuple) else (status,)
    assert role.proc.returncode in allowed, (
        f"exit status {role.proc.returncode}, not {allowed}, {took:.3f} s after {_signame(sig)}:\n"
        f"{out}"
    )
    assert took <= BOUND, f"exited {took:.3f} s after {_signame(sig)} (bound {BOUND:g} s):\n{out}"
    assert f"{_signame(sig)} received: stopping" in out, out
    assert f"stopped ({_signame(sig)}" in out or "exiting now" in out, out


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A redis-server of this test's own (a test may pause it with SIGSTOP)."""
    run_dir = tempfile.mkdtemp(prefix="qpss", dir="/tmp")
    binary = shutil.which("redis-server")
    srv = EmbeddedServer(run_dir, binary=binary, appendonly=False, stop_at_exit=False)
    srv.start()
    try:
        yield srv
    finally:
        if srv.pid is not None:
            os.kill(srv.pid, signal.SIGCONT)  # paused by the test: let it shut down
        srv.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def roles() -> Iterator[Callable[..., Role]]:
    """``roles(*args)`` starts ``qps *args`` as a process; killed at the end if alive."""
    started: list[Role] = []

    def start(*args: str) -> Role:
        role = Role(*args)
        started.append(role)
        return role

    yield start
    for role in started:
        role.kill()


@pytest.fixture
def container() -> str:
    return f"sig-{secrets.token_hex(4)}"


class Monitor:
    """The commands the server runs (``MONITOR``), collected by a thread: to see a role
    send the blocking command of the state under test."""

    def __init__(self, server: EmbeddedServer) -> None:
        # no read timeout (redis-py 8's default is 5 s): the roles may be quiet longer
        self._redis = redis.Redis(unix_socket_path=server.socket_path, socket_timeout=None)
        self._monitor = self._redis.monitor()
        self._monitor.__enter__()
        self.commands: list[str] = []
        self.ended: BaseException | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for got in self._monitor.listen():
                with self._changed:
                    self.commands.append(str(got["command"]))
                    self._changed.notify_all()
        except (redis.RedisError, OSError, ValueError, AttributeError) as exc:
            with self._changed:  # closed; or failed, which a wait must say
                self.ended = exc
                self._changed.notify_all()

    def wait_for(self, *words: str, timeout: float = STATE_WAIT) -> None:
        """Wait until the server ran a command containing every one of ``words``."""

        def seen() -> bool:
            return self.ended is not None or any(all(w in c for w in words) for c in self.commands)

        with self._changed:
            assert self._changed.wait_for(seen, timeout), f"no command with {words} run"
            assert any(all(w in c for w in words) for c in self.commands), (
                f"no command with {words} run; MONITOR ended: {self.ended!r}"
            )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._monitor.connection.disconnect()
        self._redis.close()


@pytest.fixture
def monitor(server: EmbeddedServer) -> Iterator[Monitor]:
    m = Monitor(server)
    yield m
    m.close()


def blocked_clients(server: EmbeddedServer) -> int:
    """How many clients the server holds blocked in a blocking command (BLPOP...)."""
    with redis.Redis(unix_socket_path=server.socket_path) as r:
        return sum("b" in c["flags"] for c in r.client_list())


def until(pred: Callable[[], bool], what: str, timeout: float = STATE_WAIT) -> None:
    """Wait until ``pred()`` (asked every 20 ms: the state of another process)."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"not reached in {timeout:g} s: {what}"
        time.sleep(0.02)


def until_blocked(server: EmbeddedServer, n: int, role: Role, what: str) -> None:
    """Wait until the server holds ``n`` clients blocked (the role's waits)."""

    def blocked() -> bool:
        assert role.proc.poll() is None, f"exited:\n{role.output[-3000:]}"
        return blocked_clients(server) >= n

    until(blocked, what)


def run(server: EmbeddedServer, fn: Callable[[qps.Client], Any]) -> Any:
    async def go() -> Any:
        async with await qps.connect(server.url) as c:
            return await fn(c)

    return asyncio.run(go())


def worker_args(server: EmbeddedServer, container: str, *more: str) -> list[str]:
    return ["worker", "--url", server.url, "--container", container, *more]


def ps_args(server: EmbeddedServer, container: str) -> list[str]:
    # a lease a loaded machine cannot let run out (a stopped shard releases it)
    return ["ps", "--shard", "0", "--num-shards", "1", "--url", server.url,
            "--container", container, "--optimizer", "sgd", "--lr", "0.1",
            "--lease-ms", "10000"]  # fmt: skip


# -- qps worker ---------------------------------------------------------------------------


def start_waiting_worker(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], monitor: Monitor
) -> Role:
    """Worker 1 of 2, whose chief never starts: blocked in Redis (``BLPOP`` on its wake
    list), waiting for the model."""
    w = roles(*worker_args(server, container, "--index", "1", "--num-workers", "2"))
    w.wait_line("waiting for the chief to make the model ready")
    monitor.wait_for("BLPOP", "job:ready:wake:1")
    until_blocked(server, 1, w, "the worker blocks for the ready mark")
    return w


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_worker_waiting_for_the_chief(
    server: EmbeddedServer,
    container: str,
    roles: Callable[..., Role],
    monitor: Monitor,
    sig: int,
) -> None:
    w = start_waiting_worker(server, container, roles, monitor)
    took = w.stop(sig)
    assert_stopped(w, sig, took)
    assert "while waiting for the chief to make the model ready" in w.output


def test_worker_waiting_for_the_chief_stops_on_job_stop(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], monitor: Monitor
) -> None:
    """`qps job stop` sees the waiting worker (its status says so) and wakes it: it
    exits 0 at once, its status done."""
    w = start_waiting_worker(server, container, roles, monitor)
    r = CliRunner().invoke(
        cli, ["job", "stop", "--yes", "--url", server.url, "--container", container]
    )
    assert r.exit_code == 0, r.output
    start = time.monotonic()
    try:
        w.proc.wait(timeout=EXIT_WAIT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after `qps job stop`:\n{w.output[-3000:]}") from None
    took = time.monotonic() - start
    print(f"exited {took:.3f} s after `qps job stop`, status {w.proc.returncode}")
    out = w.output
    assert w.proc.returncode == 0, out
    assert took <= BOUND, f"exited {took:.3f} s after `qps job stop` (bound {BOUND:g} s):\n{out}"
    assert "stopped (stop requested (qps job stop) while waiting for the chief" in out, out
    statuses = run(server, lambda c: job.read_statuses(c, container))
    assert statuses["worker1"]["state"] == "done"


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_worker_blocked_on_an_empty_input_queue(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], sig: int
) -> None:
    async def make_queue(c: qps.Client) -> None:
        q = qps.FIFOQueue(
            100, [np.float32, np.int64], [[64], []], shared_name="input",
            container=container, client=c,
        )  # fmt: skip
        await q.size()  # created

    run(server, make_queue)
    w = roles(*worker_args(server, container, "--index", "0", "--num-workers", "1",
                           "--num-shards", "1", "--model", "softmax:64,10",
                           "--data", "queue:input", "--steps", "0"))  # fmt: skip
    w.wait_line("computing with numpy")

    def dequeue_waits() -> bool:
        assert w.proc.poll() is None, f"exited:\n{w.output[-3000:]}"
        stats = run(server, lambda c: queue_stats(c, "input", container))
        return bool(stats.pending_dequeues >= 1)

    until(dequeue_waits, "the worker's dequeue waits in the queue")
    until_blocked(server, 1, w, "the worker blocks for a batch")
    took = w.stop(sig)
    assert_stopped(w, sig, took)
    assert "while waiting for a batch of the input queue" in w.output


def test_worker_waiting_for_a_synchronous_update(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], monitor: Monitor
) -> None:
    """Synchronous training, 2 of 2 replicas per update, worker 1 missing: the chief
    pushes its first gradient and waits for a token that cannot come."""
    run(server, lambda c: control.configure(c, container, 1, SGD(learning_rate=0.1), sync=(2, 2)))
    w = roles(*worker_args(server, container, "--index", "0", "--num-workers", "2",
                           "--num-shards", "1", "--model", "softmax:64,10"))  # fmt: skip
    w.wait_line("computing with numpy")
    monitor.wait_for("BLPOP", "ps:sync:tokens:0")
    until_blocked(server, 1, w, "the worker blocks for a token")
    took = w.stop(signal.SIGTERM)
    assert_stopped(w, signal.SIGTERM, took)
    assert "while waiting for a synchronous update" in w.output


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_worker_training(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], sig: int
) -> None:
    """Training normally (a shard applying its gradients): it stops after the step in
    hand and records itself done."""
    roles(*ps_args(server, container))
    w = roles(*worker_args(server, container, "--index", "0", "--num-workers", "1",
                           "--num-shards", "1", "--model", "softmax:64,10", "--steps", "0",
                           "--log-every", "20"))  # fmt: skip
    w.wait_line("step 20,")
    took = w.stop(sig)
    assert_stopped(w, sig, took)
    assert "step(s) (global step" in w.output and f": {_signame(sig)}\n" in w.output


def test_worker_connecting_to_a_redis_that_does_not_answer(
    container: str, roles: Callable[..., Role]
) -> None:
    """Its connection is accepted and its first command never answered (a hung
    server): it stops at once, while connecting."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        w = roles("worker", "--url", f"redis://127.0.0.1:{port}", "--container", container,
                  "--index", "1", "--num-workers", "2")  # fmt: skip
        listener.settimeout(STATE_WAIT)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(STATE_WAIT)
            assert conn.recv(4096)  # its first command: it waits for the reply
            took = w.stop(signal.SIGTERM)
    assert_stopped(w, signal.SIGTERM, took)
    assert "while connecting to Redis" in w.output


# -- qps ps, qps feed -------------------------------------------------------------------


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_ps_shard_idle(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], sig: int
) -> None:
    """A shard with no gradient to apply, blocked in Redis for one."""
    p = roles(*ps_args(server, container))
    p.wait_line("owning 0 variable(s)")
    until_blocked(server, 1, p, "the shard blocks for gradients")
    took = p.stop(sig)
    assert_stopped(p, sig, took)
    assert "lease released (stopped)" in p.output


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_feed_blocked_on_a_full_queue(
    server: EmbeddedServer,
    container: str,
    roles: Callable[..., Role],
    sig: int,
    tmp_path: Path,
) -> None:
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((8, 3), np.float32), y=np.arange(8, dtype=np.int64))
    f = roles("feed", "--data", str(data), "--epochs", "100", "--batch-size", "3",
              "--capacity", "4", "--no-shuffle", "--url", server.url,
              "--container", container)  # fmt: skip
    f.wait_line("feeding")

    def full() -> bool:
        assert f.proc.poll() is None, f"exited:\n{f.output[-3000:]}"
        stats = run(server, lambda c: queue_stats(c, "input", container))
        return bool(stats.size == 4 and stats.pending_enqueues == 1)

    until(full, "the feeder's enqueue waits for room in the full queue")
    took = f.stop(sig)
    assert_stopped(f, sig, took)
    assert "qps feed: stopped:" in f.output


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_feed_loading_its_data(
    server: EmbeddedServer,
    container: str,
    roles: Callable[..., Role],
    sig: int,
    tmp_path: Path,
) -> None:
    """Still reading its data (a load of scikit-learn's digits takes seconds on a busy
    machine): a named pipe that never delivers holds the read for as long as needed. The
    load ran on the loop's executor, which the exit joined: a forced exit (143) 1.5 s
    after the signal, never a clean one."""
    fifo = tmp_path / "x.npy"
    os.mkfifo(fifo)
    f = roles("feed", "--data", str(fifo), "--url", server.url, "--container", container)
    writer = -1

    def reading() -> bool:  # a writer can open the pipe once the feeder has it open
        nonlocal writer
        assert f.proc.poll() is None, f"exited:\n{f.output[-3000:]}"
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False
        return True

    until(reading, "the feeder opens its data")
    try:
        took = f.stop(sig)
    finally:
        os.close(writer)
    assert_stopped(f, sig, took)
    assert "exiting now" not in f.output, f.output[-3000:]


# -- qps train ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_train(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], sig: int
) -> None:
    """`qps train` stops every role (SIGTERM) and exits 130 (workers/launcher.py)."""
    t = roles("train", "--url", server.url, "--container", container, "--ps", "1",
              "--workers", "2", "--steps", "1000000", "--log-every", "20")  # fmt: skip
    t.wait_line("worker1: step 20,")
    took = t.stop(sig)
    out = t.output[-3000:]
    print(f"exited {took:.3f} s after {_signame(sig)}, status {t.proc.returncode}")
    assert t.proc.returncode == 130, out
    # the launcher stops its roles, then evaluates the parameters (at most 1.5 s): 0.4 to
    # 0.6 s here when idle, 2.3 s once beside two busy loops and another test session
    assert took <= TRAIN_BOUND, f"exited {took:.3f} s after {_signame(sig)}:\n{out}"
    assert "qps train: stopping every role" in out, out
    for role in ("ps0", "worker0", "worker1"):  # each stopped at once on the launcher's SIGTERM
        said = [ln for ln in t.lines if ln.startswith(f"[{role}]") and "stopped (SIGTERM)" in ln]
        assert said, out
    # the summary counts every step the workers made (their final statuses, published as
    # they stopped), not the last status read while they ran (every 20 steps)
    steps = [re.search(r"stopped after (\d+) step", ln) for ln in t.lines]
    made = sum(int(m.group(1)) for m in steps if m)
    summary = [ln for ln in t.lines if "interrupted: test accuracy" in ln]
    assert summary and f", {made * 64:,} examples in " in summary[-1], (made, out)


#: `qps train`'s bound under a loaded machine (CI beside the tests): its own target is
#: BOUND, and each message reports the time measured
TRAIN_BOUND = 5.0


@pytest.mark.parametrize("sig", SIGNALS, ids=_signame)
def test_train_connecting_to_a_redis_that_does_not_answer(
    container: str, roles: Callable[..., Role], sig: int
) -> None:
    """`qps train` in its set-up: its connection is accepted and its first command
    never answered (a hung server). It stops at once, says where it was, prints its
    summary and exits 130 (it waited forever for the reply before)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        t = roles("train", "--url", f"redis://127.0.0.1:{port}", "--container", container)
        listener.settimeout(STATE_WAIT)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(STATE_WAIT)
            assert conn.recv(4096)  # its first command: it waits for the reply
            took = t.stop(sig)
    out = t.output[-3000:]
    print(f"exited {took:.3f} s after {_signame(sig)}, status {t.proc.returncode}")
    assert t.proc.returncode == 130, out
    assert took <= TRAIN_BOUND, f"exited {took:.3f} s after {_signame(sig)}:\n{out}"
    assert f"qps train: stopped ({_signame(sig)} while connecting to Redis)" in out, out
    assert "interrupted: test accuracy -, global step 0, 0 examples in" in out, out


# -- Redis hung: its server stopped ---------------------------------------------------------


def pause(server: EmbeddedServer) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)


def test_ps_shard_while_redis_is_stopped(
    server: EmbeddedServer, container: str, roles: Callable[..., Role]
) -> None:
    """Its calls hang: it cannot release its lease, and is made to exit (143)."""
    p = roles(*ps_args(server, container))
    p.wait_line("owning 0 variable(s)")
    until_blocked(server, 1, p, "the shard blocks for gradients")
    pause(server)
    took = p.stop(signal.SIGTERM)
    assert_stopped(p, signal.SIGTERM, took, status=(0, 143))


def test_worker_waiting_for_the_chief_while_redis_is_stopped(
    server: EmbeddedServer, container: str, roles: Callable[..., Role], monitor: Monitor
) -> None:
    w = start_waiting_worker(server, container, roles, monitor)
    pause(server)
    took = w.stop(signal.SIGTERM)
    assert_stopped(w, signal.SIGTERM, took, status=(0, 143))


def test_worker_training_while_redis_is_stopped(
    server: EmbeddedServer, container: str, roles: Callable[..., Role]
) -> None:
    roles(*ps_args(server, container))
    w = roles(*worker_args(server, container, "--index", "0", "--num-workers", "1",
                           "--num-shards", "1", "--model", "softmax:64,10", "--steps", "0",
                           "--log-every", "20"))  # fmt: skip
    w.wait_line("step 20,")
    pause(server)
    took = w.stop(signal.SIGTERM)
    assert_stopped(w, signal.SIGTERM, took, status=(0, 143))


# -- qps.stopping.Stopper, in process ------------------------------------------------------


async def test_a_request_cuts_a_wait_short() -> None:
    stopper, never = Stopper(), asyncio.Event()

    async def wait() -> None:
        async with stopper.interruptible("waiting for nothing"):
            await never.wait()

    task = asyncio.ensure_future(wait())
    await asyncio.sleep(0)  # it waits
    stopper.request("test")
    with pytest.raises(Stopped, match="test while waiting for nothing") as got:
        await task
    assert got.value.clean and got.value.reason == "test"
    with pytest.raises(Stopped) as got:  # a wait entered after the request: at once
        await wait()
    assert got.value.during == ""


async def test_a_cut_wait_leaves_the_task_uncancelled() -> None:
    stopper, never = Stopper(), asyncio.Event()

    async def wait_then_go_on() -> str:
        with contextlib.suppress(Stopped):
            async with (
                stopper.interruptible("waiting"),
                stopper.interruptible("waiting inside"),  # nested: one Stopped
            ):
                await never.wait()
        await asyncio.sleep(0)  # not cancelled again
        task = asyncio.current_task()
        assert task is not None
        return "went on" if sys.version_info < (3, 11) else f"cancelling {task.cancelling()}"

    task = asyncio.ensure_future(wait_then_go_on())
    await asyncio.sleep(0)
    stopper.request("test")
    assert await task in ("went on", "cancelling 0")


async def test_another_cancellation_goes_through() -> None:
    stopper, never = Stopper(), asyncio.Event()

    async def wait() -> None:
        async with stopper.interruptible("waiting"):
            await never.wait()

    task = asyncio.ensure_future(wait())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_requesting_task_is_not_cancelled_and_callbacks_run() -> None:
    stopper = Stopper()
    called: list[str] = []
    stopper.on_stop(lambda: called.append("first"))
    async with stopper.interruptible("waiting"):
        stopper.request("from inside")  # its own task: nothing to cut
        await asyncio.sleep(0)
    stopper.on_stop(lambda: called.append("late"))  # after the request: at once
    stopper.request("again")  # only the first counts
    assert called == ["first", "late"] and stopper.reason == "from inside"

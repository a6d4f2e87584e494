"""``qps demo``: move real tensors between two processes through a shared queue.

The parent (:func:`demo`) finds a server (``--url``, or a fresh private embedded server
that it stops at the end), creates a uniquely named FIFOQueue of MNIST-shaped elements
(``float32[28,28]`` image, ``int64`` label) in container ``demo`` and starts two child
processes, ``python -m qps.cli.demo producer|consumer``:

* the producer generates the data from a seeded RNG, enqueues it with ``enqueue_many``
  in batches, then closes the queue;
* the consumer takes batches with ``dequeue_many`` and, once the closed queue holds
  fewer than a batch, the rest with ``dequeue_up_to``, until ``OutOfRangeError``. It
  regenerates the same data from the seed and checks every element: count, values and
  FIFO order.

Each child prints a human line and a ``RESULT {json}`` line; the parent reads both,
prints a summary and exits 0 only if both children exited 0 and the check passed.
Children that run past ``--timeout`` are killed (exit 1). Ctrl-C or SIGTERM stops the
children and the server. The queue's keys are deleted at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

import click
import numpy as np

from qps.cli import (
    EXIT_FAILURE,
    EXIT_OK,
    LOG_LEVELS,
    CliError,
    configure_logging,
    connected,
    exit_code_for,
    remember_url,
    run_async,
    url_option,
)
from qps.embedded import EmbeddedServer
from qps.errors import OutOfRangeError, QpsError
from qps.queues import FIFOQueue, delete_queue
from qps.transport import Client, redact_url

log = logging.getLogger("qps.cli.demo")

CONTAINER = "demo"
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10
#: Bytes of tensor data in one element (image + label).
ELEMENT_BYTES = int(np.prod(IMAGE_SHAPE)) * 4 + 8
#: The data is generated in chunks of this many elements, chunk k from RNG (seed, k),
#: so any range of it can be regenerated without the elements before it.
CHUNK = 1024
#: Exit status after SIGTERM (128 + 15), as shells report it.
EXIT_TERMINATED = 143

URL_HELP = (
    "Redis URL of the server to use (redis://..., rediss://... or unix:///path). "
    "Default: a fresh private embedded server, started for the demo and stopped after it."
)


# -- the data ----------------------------------------------------------------------------


class DemoData:
    """The demo's deterministic dataset: element ``i`` is an image of uniform floats in
    [0, 1) and a label in [0, 10), the same in every process for the same seed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _chunk(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        chunk = self._chunks.get(k)
        if chunk is None:
            rng = np.random.default_rng([self.seed, k])
            images = rng.random((CHUNK, *IMAGE_SHAPE), dtype=np.float32)
            labels = rng.integers(0, NUM_CLASSES, size=CHUNK, dtype=np.int64)
            chunk = self._chunks[k] = (images, labels)
            for old in [c for c in self._chunks if c < k - 1]:  # keep memory bounded
                del self._chunks[old]
        return chunk

    def slice(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Elements ``start..stop-1``: images ``float32[n,28,28]`` and labels ``int64[n]``."""
        images, labels = [], []
        i = start
        while i < stop:
            k, off = divmod(i, CHUNK)
            n = min(stop - i, CHUNK - off)
            ci, cl = self._chunk(k)
            images.append(ci[off : off + n])
            labels.append(cl[off : off + n])
            i += n
        if not images:
            return np.empty((0, *IMAGE_SHAPE), np.float32), np.empty((0,), np.int64)
        return np.concatenate(images), np.concatenate(labels)


def demo_queue(client: Client, name: str, capacity: int) -> FIFOQueue:
    """The demo's shared queue (every process opens it with this same spec)."""
    return FIFOQueue(
        capacity,
        [np.float32, np.int64],
        shapes=[list(IMAGE_SHAPE), []],
        shared_name=name,
        container=CONTAINER,
        client=client,
    )


# -- the children --------------------------------------------------------------------------


async def produce(
    url: str | None, name: str, capacity: int, elements: int, batch: int, seed: int
) -> dict[str, Any]:
    """Enqueue the dataset in batches, then close the queue; return the figures."""
    data = DemoData(seed)
    async with connected(url) as client:
        q = demo_queue(client, name, capacity)
        calls = 0
        start_wall, t0 = time.time(), time.perf_counter()
        for start in range(0, elements, batch):
            images, labels = data.slice(start, min(start + batch, elements))
            await q.enqueue_many([images, labels])
            calls += 1
        await q.close()
        seconds = time.perf_counter() - t0
    return {
        "role": "producer",
        "elements": elements,
        "enqueue_many_calls": calls,
        "seconds": seconds,
        "start_wall": start_wall,
        "end_wall": start_wall + seconds,
    }


@dataclass
class _Check:
    """The consumer's running verification."""

    data: DemoData
    count: int = 0
    bad: int = 0
    first_bad: int | None = None
    problems: list[str] = field(default_factory=list)

    def add(self, images: np.ndarray, labels: np.ndarray) -> None:
        n = len(labels)
        if images.dtype != np.float32 or images.shape != (n, *IMAGE_SHAPE):
            self._fail(self.count, f"images are {images.dtype}{list(images.shape)}")
        elif labels.dtype != np.int64 or labels.shape != (n,):
            self._fail(self.count, f"labels are {labels.dtype}{list(labels.shape)}")
        else:
            # element i must be the dataset's element i: values and FIFO order at once
            want_x, want_y = self.data.slice(self.count, self.count + n)
            rows_ok = (images == want_x).all(axis=(1, 2)) & (labels == want_y)
            for j in np.flatnonzero(~rows_ok):
                self._fail(self.count + int(j), "wrong values or out of FIFO order")
        self.count += n

    def _fail(self, index: int, what: str) -> None:
        self.bad += 1
        if self.first_bad is None:
            self.first_bad = index
        if len(self.problems) < 5:
            self.problems.append(f"element {index}: {what}")


async def consume(
    url: str | None, name: str, capacity: int, elements: int, batch: int, seed: int
) -> dict[str, Any]:
    """Dequeue until the closed queue is empty, checking every element; return the figures."""
    check = _Check(DemoData(seed))
    async with connected(url) as client:
        q = demo_queue(client, name, capacity)
        calls = [0, 0]
        start_wall, t0 = time.time(), time.perf_counter()
        # full batches while the queue is open or holds enough, then the closed queue's rest
        for i, take in enumerate((q.dequeue_many, q.dequeue_up_to)):
            while True:
                try:
                    images, labels = await take(batch)
                except OutOfRangeError:
                    break
                calls[i] += 1
                check.add(images, labels)
        seconds = time.perf_counter() - t0
    if check.count != elements:
        check.problems.insert(0, f"received {check.count} elements, expected {elements}")
    return {
        "role": "consumer",
        "elements": check.count,
        "expected": elements,
        "dequeue_many_calls": calls[0],
        "dequeue_up_to_calls": calls[1],
        "bad_elements": check.bad,
        "first_bad": check.first_bad,
        "problems": check.problems,
        "verified": check.bad == 0 and check.count == elements,
        "seconds": seconds,
        "start_wall": start_wall,
        "end_wall": start_wall + seconds,
    }


def _watch_parent(parent_pid: int) -> None:
    """Exit at once if the parent dies (the queue is never closed then: no point waiting)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(EXIT_FAILURE)

    if parent_pid > 0:
        threading.Thread(target=watch, name="qps-demo-parent-watch", daemon=True).start()


@click.group(name="worker", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="WARNING")
def workers(log_level: str) -> None:
    """The child processes of `qps demo` (not meant to be run by hand)."""
    configure_logging(log_level)


def _worker_options(f: Any) -> Any:
    for opt in reversed(
        [
            url_option(URL_HELP),
            click.option("--queue", "name", required=True, help="The queue's shared_name."),
            click.option("--capacity", type=click.IntRange(min=1), required=True),
            click.option("--elements", type=click.IntRange(min=1), required=True),
            click.option("--batch", type=click.IntRange(min=1), required=True),
            click.option("--seed", type=int, required=True),
            click.option("--parent-pid", type=int, default=0, help="Exit if this process dies."),
        ]
    ):
        f = opt(f)
    return f


def _report(role: str, line: str, result: dict[str, Any]) -> None:
    click.echo(f"{role}: {line}")
    click.echo("RESULT " + json.dumps(result), nl=True)


def _child_run(role: str, coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    try:
        return run_async(coro)
    except CliError as exc:
        raise CliError(f"demo {role}: {exc.message}", exc.exit_code) from exc


@workers.command(name="producer")
@_worker_options
def producer_command(
    url: str | None, name: str, capacity: int, elements: int, batch: int, seed: int, parent_pid: int
) -> None:
    """Enqueue the demo data, then close the queue."""
    _watch_parent(parent_pid)
    r = _child_run("producer", produce(url, name, capacity, elements, batch, seed))
    _report(
        "producer",
        f"enqueued {r['elements']} elements in {r['enqueue_many_calls']} enqueue_many calls "
        f"and closed the queue ({r['seconds']:.2f} s)",
        r,
    )


@workers.command(name="consumer")
@_worker_options
def consumer_command(
    url: str | None, name: str, capacity: int, elements: int, batch: int, seed: int, parent_pid: int
) -> None:
    """Dequeue and verify the demo data until the queue is closed and empty."""
    _watch_parent(parent_pid)
    r = _child_run("consumer", consume(url, name, capacity, elements, batch, seed))
    verdict = "all verified" if r["verified"] else f"{r['bad_elements']} BAD"
    _report(
        "consumer",
        f"dequeued {r['elements']} elements with {r['dequeue_many_calls']} dequeue_many + "
        f"{r['dequeue_up_to_calls']} dequeue_up_to calls, {verdict} ({r['seconds']:.2f} s)",
        r,
    )


def worker_main(argv: list[str] | None = None) -> None:
    """``python -m qps.cli.demo producer|consumer ...``: run one child and exit."""
    try:
        workers.main(args=argv, prog_name="python -m qps.cli.demo", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except QpsError as exc:
        CliError(str(exc)).show()
        sys.exit(exit_code_for(exc))
    sys.exit(EXIT_OK)


# -- the parent ----------------------------------------------------------------------------


@dataclass
class _Child:
    role: str
    proc: subprocess.Popen[bytes]
    out: IO[bytes]

    def output(self) -> tuple[list[str], dict[str, Any] | None]:
        """The child's human lines and its RESULT record (None if it printed none)."""
        self.out.seek(0)
        lines, result = [], None
        for raw in self.out.read().decode("utf-8", "replace").splitlines():
            if raw.startswith("RESULT "):
                with contextlib.suppress(ValueError):
                    result = json.loads(raw[len("RESULT ") :])
            elif raw.strip():
                lines.append(raw)
        return lines, result


def _spawn(role: str, url: str, args: list[str], log_level: str) -> _Child:
    out = tempfile.TemporaryFile()  # noqa: SIM115 (kept open until the child is done)
    env = dict(os.environ)
    env["QPS_REDIS_URL"] = url  # not on the command line, where `ps` would show a password
    cmd = [sys.executable, "-m", "qps.cli.demo", "--log-level", log_level, role, *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, env=env)
    return _Child(role, proc, out)


def _stop_children(children: list[_Child], grace: float = 5.0) -> None:
    for c in children:
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                c.proc.terminate()
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def _wait(children: list[_Child], timeout: float) -> str | None:
    """Wait until every child exits; return None, or what went wrong (a child failed,
    or they ran past ``timeout``: the others are left to :func:`_stop_children`)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [c.proc.poll() for c in children]
        for c, code in zip(children, codes, strict=True):
            if code is not None and code != 0:
                return f"the {c.role} failed (exit status {code})"
        if all(code is not None for code in codes):
            return None
        if time.monotonic() >= deadline:
            stuck = [c.role for c, code in zip(children, codes, strict=True) if code is None]
            return f"timed out after {timeout:g} s; killed the {' and the '.join(stuck)}"
        time.sleep(0.02)


class _Signals:
    """While the demo runs, SIGTERM raises (so that the cleanup runs, as after Ctrl-C);
    during the cleanup a second Ctrl-C or SIGTERM is ignored so that it completes."""

    def __init__(self) -> None:
        self._old: tuple[Any, Any] | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set in the main thread
        self._old = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
        signal.signal(signal.SIGTERM, self._on_term)

    @staticmethod
    def _on_term(signum: int, frame: FrameType | None) -> None:
        raise CliError("terminated by SIGTERM; stopped the demo", EXIT_TERMINATED)

    def ignore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old[0])
            signal.signal(signal.SIGINT, self._old[1])
            self._old = None


async def _create_queue(url: str, name: str, capacity: int) -> None:
    async with connected(url) as client:
        await demo_queue(client, name, capacity).size()  # creates it


async def _delete_queue(url: str, name: str) -> None:
    async with connected(url) as client:
        await delete_queue(client, name, CONTAINER)


def _summary(
    elements: int, producer: dict[str, Any], consumer: dict[str, Any]
) -> tuple[list[str], bool]:
    moved = int(consumer["elements"])
    start = max(float(producer["start_wall"]), float(consumer["start_wall"]))
    seconds = max(float(consumer["end_wall"]) - start, 1e-9)
    mb = moved * ELEMENT_BYTES / 1e6
    lines = [
        f"moved {moved} elements ({mb:.2f} MB of tensors) in {seconds:.2f} s: "
        f"{moved / seconds:,.0f} elements/s, {mb / seconds:.1f} MB/s"
    ]
    ok = bool(consumer.get("verified")) and moved == elements
    if ok:
        lines.append(
            f"verified OK: all {moved} elements arrived once, bit-identical and in FIFO order"
        )
    else:
        lines.append("verification FAILED:")
        lines.extend(f"  {p}" for p in consumer.get("problems") or ["(no details)"])
    return lines, ok


def _cleanup(
    children: list[_Child],
    url: str | None,
    name: str,
    server: EmbeddedServer | None,
    run_dir: str | None,
) -> tuple[dict[str, tuple[list[str], dict[str, Any] | None]], list[str]]:
    """Stop the children, delete the queue, stop our server and remove its directory.
    Returns each child's output by role, and notes on what was cleaned up."""
    _stop_children(children)
    outputs = {c.role: c.output() for c in children}
    for c in children:
        c.out.close()
    notes = []
    if url:
        try:
            run_async(_delete_queue(url, name))
        except CliError as exc:
            log.warning("could not delete the demo queue %s/%s: %s", CONTAINER, name, exc)
    if server is not None:
        pid = server.pid
        server.stop()
        notes.append(f"stopped the embedded server (pid {pid})")
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return outputs, notes


def _child_lines(outputs: dict[str, tuple[list[str], dict[str, Any] | None]]) -> list[str]:
    return [line for role in ("producer", "consumer") for line in outputs.get(role, ([], None))[0]]


@click.command(name="demo")
@url_option(URL_HELP)
@click.option(
    "--elements",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    help="How many (image, label) elements to move.",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Elements per enqueue_many / dequeue_many call.",
)
@click.option(
    "--capacity",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="The queue's capacity (the producer blocks while it is full).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated data.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=120.0,
    show_default=True,
    metavar="SECONDS",
    help="Kill the producer and consumer (exit 1) if they have not finished by then.",
)
def demo(
    url: str | None, elements: int, batch: int, capacity: int, seed: int, timeout: float
) -> None:
    """Move real tensors between two processes through a shared queue, and check them.

    A producer process enqueues ELEMENTS MNIST-shaped elements (a float32[28,28] image
    and an int64 label, generated from a seeded RNG) in batches into a FIFOQueue and
    closes it; a consumer process dequeues them in batches until the queue is closed
    and empty, and checks every element against the same generated data (count,
    values, FIFO order). Prints the throughput; exits 0 only if the check passed.

    Without --url (or QPS_REDIS_URL) the demo starts a private embedded server in a new
    directory and stops it at the end.
    """
    log_level = logging.getLevelName(logging.getLogger("qps").getEffectiveLevel())
    if log_level not in LOG_LEVELS:
        log_level = "WARNING"
    server: EmbeddedServer | None = None
    run_dir: str | None = None
    children: list[_Child] = []
    name = f"demo-{secrets.token_hex(4)}"
    created = finished = False
    problem: str | None = None
    signals = _Signals()
    signals.install()
    try:
        try:
            if url:
                remember_url(url)
                where = f"Redis at {redact_url(url)}"
            else:
                run_dir = tempfile.mkdtemp(
                    prefix="qps-demo-", dir="/tmp" if os.path.isdir("/tmp") else None
                )
                server = EmbeddedServer(run_dir=run_dir, appendonly=False)
                server.start()
                url = server.url
                where = f"embedded {os.path.basename(server.binary)} at {url} (pid {server.pid})"
        except QpsError as exc:
            raise CliError(str(exc), exit_code_for(exc)) from exc
        click.echo(
            f"qps demo: {elements} x (float32[28,28] image, int64 label), "
            "producer process -> consumer process"
        )
        click.echo(f"server:   {where}")
        run_async(_create_queue(url, name, capacity))
        created = True
        click.echo(f"queue:    {CONTAINER}/{name}, FIFOQueue capacity {capacity}, batch {batch}")
        args = [
            "--queue", name, "--capacity", str(capacity), "--elements", str(elements),
            "--batch", str(batch), "--seed", str(seed), "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        children.append(_spawn("consumer", url, args, log_level))
        children.append(_spawn("producer", url, args, log_level))
        problem = _wait(children, timeout)
        finished = True
    finally:
        signals.ignore()
        try:
            outputs, notes = _cleanup(children, url if created else None, name, server, run_dir)
        finally:
            signals.restore()
        if not finished:  # interrupted or failed: still say what happened and was undone
            for line in _child_lines(outputs) + notes:
                click.echo(line)

    lines = _child_lines(outputs)
    ok = False
    if problem is None:
        producer, consumer = outputs["producer"][1], outputs["consumer"][1]
        if producer is None or consumer is None:
            problem = "a child printed no result"
        else:
            summary, ok = _summary(elements, producer, consumer)
            lines += summary
            if not ok:
                problem = "the consumer's verification failed"
    for line in lines + notes:
        click.echo(line)
    if problem is not None or not ok:
        raise CliError(f"demo failed: {problem}", EXIT_FAILURE)


if __name__ == "__main__":
    worker_main()

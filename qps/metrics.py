"""Prometheus metrics of the long-running roles (``--metrics-port``; ``docs/metrics.md``).

A :class:`Metrics` holds one :class:`prometheus_client.CollectorRegistry` of its own
(never the library's global one, so that several roles, or several tests, can live in
one process) and the metric families of the roles that registered in it: a PS shard
(:meth:`Metrics.shard`), a worker (:meth:`Metrics.worker`), a feeder
(:meth:`Metrics.feed`). Each returns a small recorder whose label values are bound once,
so a hook in a hot loop costs one lock and an add. :meth:`Metrics.serve` exposes the
registry over HTTP (``/metrics``, the text exposition format) on a thread.

A role records whether or not anything serves its registry: the cost without a port is
those few increments. The commands use the process's :func:`default` instance and serve
it when given ``--metrics-port``.

Every name starts with ``qps_``; the families and their labels are listed in
``docs/metrics.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = [
    "LATENCY_BUCKETS",
    "STALENESS_BUCKETS",
    "FeedMetrics",
    "Metrics",
    "ShardMetrics",
    "WorkerMetrics",
    "default",
    "nbytes",
]

log = logging.getLogger("qps.metrics")

#: Seconds: Redis round trips are sub-millisecond on a local server, a large pull or a
#: group commit takes up to seconds.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Updates a gradient missed between the read of its parameters and its apply.
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


def nbytes(value: Any) -> int:
    """Bytes of the arrays in ``value``: an array, a mapping or sequence of them, or an
    object with ``indices``/``values`` arrays (sparse gradients, pulled rows)."""
    n = getattr(value, "nbytes", None)
    if isinstance(n, int):
        return n
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if hasattr(value, "indices") and hasattr(value, "values"):
        return nbytes(value.indices) + nbytes(value.values)
    return 0


class WorkerMetrics:
    """What a worker records: a step, a pull and a push (see :meth:`Metrics.worker`)."""

    def __init__(self, m: Metrics, labels: dict[str, str]) -> None:
        self.steps = m.worker_steps.labels(**labels)
        self.examples = m.worker_examples.labels(**labels)
        self.loss = m.worker_loss.labels(**labels)
        self.step_seconds = m.worker_step_seconds.labels(**labels)
        self.pull_bytes = m.worker_pull_bytes.labels(**labels)
        self.push_bytes = m.worker_push_bytes.labels(**labels)
        self.pull_seconds = m.worker_pull_seconds.labels(**labels)
        self.push_seconds = m.worker_push_seconds.labels(**labels)
        self._last: float | None = None

    def start(self) -> None:
        """Training starts: the first step's time counts from now."""
        self._last = time.perf_counter()

    def step(self, examples: int, loss: float) -> None:
        """A step ended (its push sent): ``examples`` in its batch, its loss."""
        now = time.perf_counter()
        if self._last is not None:
            self.step_seconds.observe(now - self._last)
        self._last = now
        self.steps.inc()
        self.examples.inc(examples)
        self.loss.set(loss)

    def pulled(self, started: float, params: Iterable[Any]) -> None:
        """A pull that began at ``time.perf_counter()`` ``started`` returned ``params``."""
        self.pull_seconds.observe(time.perf_counter() - started)
        self.pull_bytes.inc(sum(nbytes(p) for p in params))

    def pushed(self, started: float, grads: Mapping[Any, Any]) -> None:
        """A push of ``grads`` that began at ``started`` returned."""
        self.push_seconds.observe(time.perf_counter() - started)
        self.push_bytes.inc(nbytes(grads))


class ShardMetrics:
    """What a PS shard records (see :meth:`Metrics.shard`)."""

    def __init__(self, m: Metrics, labels: dict[str, str]) -> None:
        self._m, self._labels = m, labels
        self.messages = m.ps_messages.labels(**labels)
        self.bytes = m.ps_bytes.labels(**labels)
        self.applies = m.ps_applies.labels(**labels)
        self.apply_seconds = m.ps_apply_seconds.labels(**labels)
        self.dropped_stale = m.ps_dropped_stale.labels(**labels)
        self.dead_letters = m.ps_dead_letters.labels(**labels)
        self.queue_depth = m.ps_queue_depth.labels(**labels)
        self._stale: dict[str, Any] = {}

    def received(self, nbytes: int) -> None:
        """A message (delivery) was taken from the shard's queue."""
        self.messages.inc()
        self.bytes.inc(nbytes)

    def committed(self, applied: int, started: float, stale: Iterable[tuple[str, int]]) -> None:
        """A group (or a synchronous update) that began at ``started`` was committed and
        acknowledged: ``applied`` messages applied, ``(worker, staleness)`` of each."""
        self.applies.inc(applied)
        self.apply_seconds.observe(time.perf_counter() - started)
        for worker, s in stale:
            h = self._stale.get(worker)
            if h is None:
                h = self._stale[worker] = self._m.ps_staleness.labels(**self._labels, worker=worker)
            h.observe(s)

    def sampled(self, queue_depth: int, dead_letters: int) -> None:
        """The shard read its queue's size and its dead-letter list's length."""
        self.queue_depth.set(queue_depth)
        self.dead_letters.set(dead_letters)


class FeedMetrics:
    """What a feeder records (see :meth:`Metrics.feed`)."""

    def __init__(self, m: Metrics, labels: dict[str, str]) -> None:
        self.examples = m.feed_examples.labels(**labels)
        self.epochs = m.feed_epochs.labels(**labels)
        self.queue_depth = m.queue_depth.labels(**labels)


class Metrics:
    """A registry of the ``qps_*`` metric families and, once :meth:`serve` was called, the
    HTTP server that exposes it. Families are created when a role of their kind first
    registers (an endpoint lists only the roles of its process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.address: tuple[str, int] | None = None  # where serve() listens
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._kinds: set[str] = set()

    # -- the roles -----------------------------------------------------------------------------
    def worker(self, container: str, worker: str) -> WorkerMetrics:
        """The recorder of worker ``worker`` (e.g. ``worker0``) of ``container``."""
        self._families("worker")
        return WorkerMetrics(self, {"container": container, "worker": worker})

    def shard(self, container: str, shard: int) -> ShardMetrics:
        """The recorder of PS shard ``shard`` of ``container``."""
        self._families("ps")
        return ShardMetrics(self, {"container": container, "shard": str(shard)})

    def feed(self, container: str, queue: str) -> FeedMetrics:
        """The recorder of a feeder of queue ``queue`` of ``container``."""
        self._families("feed")
        return FeedMetrics(self, {"container": container, "queue": queue})

    def _families(self, kind: str) -> None:
        with self._lock:
            if kind in self._kinds:
                return
            self._kinds.add(kind)
            r = self.registry
            if kind == "worker":
                w = ["container", "worker"]
                self.worker_steps = Counter(
                    "qps_worker_steps", "Training steps this worker completed.", w, registry=r
                )
                self.worker_examples = Counter(
                    "qps_worker_examples", "Examples in the steps' batches.", w, registry=r
                )
                self.worker_loss = Gauge(
                    "qps_worker_loss", "Loss of the worker's last step.", w, registry=r
                )
                self.worker_step_seconds = Histogram(
                    "qps_worker_step_seconds", "Seconds from the end of one step to the end "
                    "of the next (batch, pull, compute, push).", w,
                    buckets=LATENCY_BUCKETS, registry=r,
                )  # fmt: skip
                self.worker_pull_bytes = Counter(
                    "qps_worker_pull_bytes", "Bytes of parameters pulled.", w, registry=r
                )
                self.worker_push_bytes = Counter(
                    "qps_worker_push_bytes", "Bytes of gradients pushed.", w, registry=r
                )
                self.worker_pull_seconds = Histogram(
                    "qps_worker_pull_seconds", "Seconds one pull of the step's parameters "
                    "took.", w, buckets=LATENCY_BUCKETS, registry=r,
                )  # fmt: skip
                self.worker_push_seconds = Histogram(
                    "qps_worker_push_seconds", "Seconds one push of a step's gradients took "
                    "(enqueued to every shard).", w, buckets=LATENCY_BUCKETS, registry=r,
                )  # fmt: skip
            elif kind == "ps":
                s = ["container", "shard"]
                self.ps_messages = Counter(
                    "qps_ps_messages", "Gradient messages taken from the shard's queue "
                    "(redeliveries and refused ones included).", s, registry=r,
                )  # fmt: skip
                self.ps_bytes = Counter(
                    "qps_ps_bytes", "Bytes of the messages taken.", s, registry=r
                )
                self.ps_applies = Counter(
                    "qps_ps_applies", "Messages applied and committed (redeliveries of "
                    "committed ones are not counted).", s, registry=r,
                )  # fmt: skip
                self.ps_apply_seconds = Histogram(
                    "qps_ps_apply_seconds", "Seconds from a group's first message taken "
                    "to its commit and ack (synchronous training: one update).", s,
                    buckets=LATENCY_BUCKETS, registry=r,
                )  # fmt: skip
                self.ps_dropped_stale = Counter(
                    "qps_ps_dropped_stale", "Stale gradients dropped (synchronous "
                    "training).", s, registry=r,
                )  # fmt: skip
                self.ps_dead_letters = Gauge(
                    "qps_ps_dead_letters", "Length of the shard's dead-letter list.", s,
                    registry=r,
                )  # fmt: skip
                self.ps_queue_depth = Gauge(
                    "qps_ps_queue_depth", "Messages waiting in the shard's gradient "
                    "queue.", s, registry=r,
                )  # fmt: skip
                self.ps_staleness = Histogram(
                    "qps_ps_staleness", "Updates a gradient missed between the read of "
                    "its parameters and its apply, per worker.", [*s, "worker"],
                    buckets=STALENESS_BUCKETS, registry=r,
                )  # fmt: skip
            else:
                q = ["container", "queue"]
                self.feed_examples = Counter(
                    "qps_feed_examples", "Examples the feeder enqueued.", q, registry=r
                )
                self.feed_epochs = Counter(
                    "qps_feed_epochs", "Epochs the feeder completed.", q, registry=r
                )
                self.queue_depth = Gauge(
                    "qps_queue_depth", "Elements in the input queue after the feeder's "
                    "last enqueue.", q, registry=r,
                )  # fmt: skip

    # -- the endpoint --------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[str, int]:
        """Expose the registry at ``http://addr:port/metrics`` on a daemon thread (port
        0: a free one); return the bound address. Serving twice is an error.

        Raises:
            OSError: the address cannot be bound (in use, not this host's).
            RuntimeError: already serving.
        """
        if self._server is not None:
            raise RuntimeError(f"metrics already served on {self.url}")
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        self.address = (addr, int(self._server.server_port))
        log.info("metrics served at %s", self.url)
        return self.address

    @property
    def serving(self) -> bool:
        """Whether :meth:`serve` exposes the registry now."""
        return self._server is not None

    @property
    def url(self) -> str:
        """The URL of the endpoint ("" while not serving)."""
        if self.address is None:
            return ""
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def close(self) -> None:
        """Stop serving (a no-op if not serving)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.address = None


_default: Metrics | None = None
_default_lock = threading.Lock()


def default() -> Metrics:
    """The process's :class:`Metrics` (created on first use): what a role records into
    when not given another, and what ``--metrics-port`` serves."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Metrics()
        return _default

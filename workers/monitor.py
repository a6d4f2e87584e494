"""One read-only snapshot of a training job, and rates from two of them: what ``qps job
status`` prints and ``qps top`` refreshes.

:func:`snapshot` reads everything from Redis (works from any machine that reaches it):
the PS config (:mod:`qps.ps.control`), the finished and stop marks, the global step,
each worker's published status (:mod:`workers.job`), each shard's status with its
gradient queue, and every other queue of the container. Nothing is written.

:func:`rates` turns two successive snapshots into per-second rates: global steps,
each worker's steps, each shard's applied messages, each queue's dequeues. Workers
publish their status every ``log_every`` steps, so a worker's rate is its step
difference over the difference of its *status* times; while its status has not
changed, the previous rate (``last``) is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from qps import keys
from qps.errors import DeadlineExceededError, NotFoundError
from qps.ps import control
from qps.ps.gradlist import gradient_list_key
from qps.queues.inspect import QueueStats, list_queues, queue_stats
from qps.transport import Client
from workers import job

__all__ = [
    "JobSnapshot",
    "ListRow",
    "QueueRow",
    "Rates",
    "ShardRow",
    "WorkerRow",
    "eval_metric",
    "job_exists",
    "job_state",
    "rates",
    "read_global_step",
    "snapshot",
]


@dataclass(frozen=True)
class QueueRow:
    """One queue: ``size`` elements stored of ``capacity``; ``pending_enqueues``:
    callers blocked on a full queue; ``dead_letters``: elements set aside."""

    name: str
    type: str
    size: int
    capacity: int
    closed: bool
    enqueued_total: int
    dequeued_total: int
    pending_enqueues: int
    pending_dequeues: int
    dead_letters: int

    @classmethod
    def of(cls, st: QueueStats) -> QueueRow:
        return cls(
            name=st.name,
            type=st.spec.class_name,
            size=st.size,
            capacity=st.spec.capacity,
            closed=st.closed,
            enqueued_total=st.enqueued_total,
            dequeued_total=st.dequeued_total,
            pending_enqueues=st.pending_enqueues,
            pending_dequeues=st.pending_dequeues,
            dead_letters=st.dead_letters,
        )


@dataclass(frozen=True)
class WorkerRow:
    """A worker's last published status.

    ``age_s``: seconds since it was published (by the snapshot's clock: mind clock skew
    between machines); ``done``: its status says ``done`` or it recorded itself done;
    ``staleness_*``: its gradients' staleness over every shard (``messages`` counted).
    """

    name: str
    state: str
    step: int
    examples: int
    loss: float | None
    examples_per_s: float | None
    global_step: int | None
    status_time: float | None
    age_s: float | None
    done: bool
    messages: int
    staleness_p50: int | None
    staleness_p99: int | None


@dataclass(frozen=True)
class ListRow:
    """A shard's gradient list (qps.ps.gradlist: on a single server the workers push
    their gradients there, not onto the gradient queue): messages ``waiting`` in it,
    ever ``pushed`` onto it and ``taken`` from it by the shard."""

    shard: int
    key: str
    waiting: int
    pushed: int
    taken: int

    @property
    def name(self) -> str:
        """How the views name it, beside its shard's queue ``ps/<i>/grads``."""
        return f"ps/{self.shard}/glist"


@dataclass(frozen=True)
class ShardRow:
    """A PS shard: its state and counters (see :class:`qps.ps.control.ShardStatus`),
    its gradient ``queue`` (None if it does not exist yet) and gradient ``list`` (None
    on a cluster, which has none), ``lag``: messages waiting for it (stored in the
    queue and the list, plus pushes blocked on the full queue), and the staleness
    percentiles of what it applied (all workers).

    ``arrived`` / ``taken``: gradient messages pushed to the shard / taken by it, on
    either channel (the queue's ``enq``/``deq`` plus the list's counters);
    ``dropped_stale``: stale gradients it dropped (synchronous training)."""

    shard: int
    state: str
    owner: str | None
    token: int | None
    applied: int
    skipped: int
    variables: int
    dead_letters: int
    queue: QueueRow | None
    lag: int | None
    arrived: int
    taken: int
    dropped_stale: int
    list: ListRow | None
    messages: int
    staleness_p50: int | None
    staleness_p99: int | None
    heartbeat_age_s: float | None


@dataclass(frozen=True)
class JobSnapshot:
    """Everything :func:`snapshot` read, at wall-clock ``time``."""

    container: str
    time: float
    num_shards: int | None
    optimizer: dict[str, Any] | None
    ready: dict[str, Any] | None
    finished: bool
    stop_requested: dict[str, Any] | None
    global_step: int
    test_metric: str | None
    test_value: float | None
    workers: tuple[WorkerRow, ...]
    shards: tuple[ShardRow, ...]
    queues: tuple[QueueRow, ...]
    staleness_p50: int | None
    staleness_p99: int | None

    @property
    def dead_letters(self) -> int:
        """Messages refused by the shards plus elements set aside by any queue."""
        shards = sum(s.dead_letters for s in self.shards)
        queues = sum(q.dead_letters for q in self.queues)
        grads = sum(s.queue.dead_letters for s in self.shards if s.queue is not None)
        return shards + queues + grads

    @property
    def test_accuracy(self) -> float | None:
        """The chief's test accuracy (None before its evaluation, or when its metric is
        another one: the AUC of a CTR model)."""
        return self.test_value if self.test_metric == "accuracy" else None

    @property
    def state(self) -> str:
        """``finished`` (the PS job was marked finished), ``stopping`` (a stop was
        requested), ``done`` (every worker done), ``running`` or ``starting`` (no worker
        status yet)."""
        return job_state(
            self.finished, self.stop_requested is not None, [w.done for w in self.workers]
        )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state
        d["dead_letters"] = self.dead_letters
        d["test_accuracy"] = self.test_accuracy
        return d


def job_state(finished: bool, stopping: bool, workers_done: Sequence[bool]) -> str:
    """A job's state (see :attr:`JobSnapshot.state`) from its finished mark, whether a
    stop was requested, and whether each worker that published a status is done."""
    if finished:
        return "finished"
    if stopping:
        return "stopping"
    if workers_done and all(workers_done):
        return "done"
    return "running" if workers_done else "starting"


async def read_global_step(client: Client, container: str) -> int:
    """The global step (0 before shard 0 advanced it), read without creating the
    counter (a :class:`qps.Counter` would: reading a job writes nothing)."""
    raw = await client.get(keys.counter_key(container, keys.GLOBAL_STEP))
    return _int(raw.decode() if isinstance(raw, bytes) else raw)


#: what ``qps job wait --for`` waits for
WAIT_STATES = ("serving", "running", "done", "finished")


def reached(snap: JobSnapshot, state: str) -> bool:
    """Whether the job of ``snap`` has come to ``state`` (:data:`WAIT_STATES`) or past it:

    * ``serving``: the PS job is configured and every one of its shards holds its lease
      and runs (workers may push), or the job is past that;
    * ``running``: the chief made the model ready, every PS shard holds its lease and
      runs, and every worker (as many as the ready mark says) has published a status
      other than ``waiting`` (for the chief), or the job is past running;
    * ``done``: every worker is done;
    * ``finished``: the PS job is marked finished and no shard runs any more.
    """
    workers_done = bool(snap.workers) and all(w.done for w in snap.workers)
    shards_running = all(s.state == "running" for s in snap.shards)
    past = snap.finished or snap.stop_requested is not None or workers_done
    if state == "serving":
        return past or (snap.num_shards is not None and shards_running)
    if state == "running":
        if past:
            return True
        if snap.ready is None:  # the chief has not made the model ready yet
            return False
        wanted = _int(snap.ready.get("num_workers"), 1)
        active = [w for w in snap.workers if w.state != "waiting"]  # (for the chief)
        return shards_running and len(active) >= max(1, wanted)
    if state == "done":
        return workers_done
    if state == "finished":
        return snap.finished and not any(s.state == "running" for s in snap.shards)
    raise ValueError(f"state must be one of {', '.join(WAIT_STATES)}, not {state!r}")


async def wait_for(
    client: Client, container: str, state: str, timeout: float | None = None
) -> JobSnapshot:
    """Block until the job of ``container`` has come to ``state`` (see :func:`reached`);
    return the snapshot that showed it. Waits in ``BLPOP`` on the list a worker's status
    publication pushes to (a shard's change is seen within
    :data:`workers.job.WAKE_SECONDS`).

    Raises:
        NotFoundError: the container holds no job (it may not have started yet: such a
            container is waited for too, until ``timeout``).
        DeadlineExceededError: ``timeout`` seconds passed first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            snap: JobSnapshot | None = await snapshot(client, container)
        except NotFoundError:
            snap = None
        if snap is not None and reached(snap, state):
            return snap
        if not await job.wait_status_change(client, container, deadline):
            now = "the container holds no job" if snap is None else _short_of(snap, state)
            raise DeadlineExceededError(
                f"the job in container '{container}' did not come to {state} within "
                f"{timeout} s ({now})"
            )


def _short_of(snap: JobSnapshot, state: str) -> str:
    """What keeps the job of ``snap`` from ``state``, in words."""
    shards = [f"shard {s.shard} {s.state}" for s in snap.shards if s.state != "running"]
    if state == "serving":
        return ", ".join(shards) if snap.num_shards is not None else "no PS job configured"
    if state == "running":
        wanted = max(1, _int((snap.ready or {}).get("num_workers"), 1))
        active = sum(w.state != "waiting" for w in snap.workers)
        ready = [] if snap.ready is not None else ["the model is not ready"]
        return ", ".join([*ready, *shards, f"{active} of {wanted} worker(s) reported"])
    if state == "done":
        busy = [f"{w.name} {w.state}" for w in snap.workers if not w.done]
        return ", ".join(busy) or "no worker reported"
    running = [f"shard {s.shard} running" for s in snap.shards if s.state == "running"]
    return ", ".join(([] if snap.finished else ["not marked finished"]) + running)


async def job_exists(client: Client, container: str) -> bool:
    """Whether ``container`` holds a training job: a PS config, a ready mark or a
    worker status."""
    if await control.read_config(client, container) is not None:
        return True
    if await job.is_ready(client, container) is not None:
        return True
    return bool(await job.read_statuses(client, container))


def _hist_add(total: dict[int, int], hist: Mapping[int, int]) -> None:
    for b, n in hist.items():
        total[b] = total.get(b, 0) + n


def _int(x: Any, default: int = 0) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


def _float(x: Any) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


#: the test metrics the chief publishes (``workers.worker.evaluate_params``), in the
#: eval record's order of preference
TEST_METRICS = ("accuracy", "auc")


def eval_metric(statuses: Mapping[str, Mapping[str, Any]]) -> tuple[str | None, float | None]:
    """``(name, value)`` of the chief's test metric from the published statuses: its
    ``eval`` record, ``{"accuracy": v}`` or ``{"auc": v}`` (a CTR model), as
    ``workers.worker`` publishes it; ``(None, None)`` before it evaluated."""
    record = statuses.get("eval") or {}
    for name in TEST_METRICS:
        value = _float(record.get(name))
        if value is not None:
            return name, value
    return None, None


async def _queue_row(client: Client, name: str, container: str) -> QueueRow | None:
    try:
        return QueueRow.of(await queue_stats(client, name, container))
    except NotFoundError:
        return None


async def snapshot(client: Client, container: str) -> JobSnapshot:
    """Read the job of ``container`` (see the module docstring).

    Raises:
        NotFoundError: the container holds no training job (no PS config, no ready
            mark, no worker status).
    """
    now = time.time()
    cfg = await control.read_config(client, container)
    ready = await job.is_ready(client, container)
    statuses = await job.read_statuses(client, container)
    if cfg is None and ready is None and not statuses:
        raise NotFoundError(
            f"no training job in container '{container}' (no PS config, no worker status)"
        )
    finished = await control.is_finished(client, container)
    stop = await job.stop_requested(client, container)
    global_step = await read_global_step(client, container)
    done = await job.finished_workers(client, container)

    n = 0 if cfg is None else cfg.num_shards
    # one round trip's latency for all shards, not one per shard
    shard_statuses = await asyncio.gather(
        *(control.shard_status(client, container, i) for i in range(n))
    )
    grad_rows = await asyncio.gather(
        *(_queue_row(client, keys.ps_gradient_queue(i), container) for i in range(n))
    )
    per_worker: dict[str, dict[int, int]] = {}
    overall: dict[int, int] = {}
    shards = []
    for st, q in zip(shard_statuses, grad_rows):
        total: dict[int, int] = {}
        for w, hist in st.staleness.items():
            _hist_add(total, hist)
            _hist_add(per_worker.setdefault(w, {}), hist)
        _hist_add(overall, total)
        beat = _int(st.fields.get("heartbeat_ms"), -1)
        shards.append(
            ShardRow(
                shard=st.shard,
                state=st.state,
                owner=st.owner,
                token=st.token,
                applied=st.applied,
                skipped=st.skipped,
                variables=st.variables,
                dead_letters=st.dead_letters,
                queue=q,
                # queue_size counts the gradient list too
                lag=None if q is None else max(q.size, st.queue_size or 0) + q.pending_enqueues,
                arrived=(0 if q is None else q.enqueued_total) + st.list_pushed,
                taken=(0 if q is None else q.dequeued_total) + st.list_taken,
                dropped_stale=st.dropped_stale,
                list=None
                if st.list_size is None
                else ListRow(
                    shard=st.shard,
                    key=gradient_list_key(container, st.shard),
                    waiting=st.list_size,
                    pushed=st.list_pushed,
                    taken=st.list_taken,
                ),
                messages=sum(total.values()),
                staleness_p50=control.staleness_percentile(total, 0.5),
                staleness_p99=control.staleness_percentile(total, 0.99),
                heartbeat_age_s=None if beat < 0 else max(0.0, now - beat / 1000),
            )
        )

    workers = []
    for name in job.worker_names(statuses):
        s = statuses[name]
        t = _float(s.get("time"))
        hist = per_worker.get(name, {})
        gs = s.get("global_step")
        workers.append(
            WorkerRow(
                name=name,
                state=str(s.get("state")),
                step=_int(s.get("step")),
                examples=_int(s.get("examples")),
                loss=_float(s.get("loss")),
                examples_per_s=_float(s.get("examples_per_s")),
                global_step=None if gs is None else _int(gs),
                status_time=t,
                age_s=None if t is None else max(0.0, now - t),
                done=name in done or s.get("state") == "done",
                messages=sum(hist.values()),
                staleness_p50=control.staleness_percentile(hist, 0.5),
                staleness_p99=control.staleness_percentile(hist, 0.99),
            )
        )

    grad_queues = {keys.ps_gradient_queue(i) for i in range(n)}
    names = [q for q in await list_queues(client, container) if q not in grad_queues]
    rows = await asyncio.gather(*(_queue_row(client, q, container) for q in names))
    queues = [row for row in rows if row is not None]

    metric, value = eval_metric(statuses)
    optimizer = None
    if cfg is not None and cfg.optimizer is not None:
        optimizer = {"name": cfg.optimizer.name, **cfg.optimizer.hparams()}
    return JobSnapshot(
        container=container,
        time=now,
        num_shards=None if cfg is None else cfg.num_shards,
        optimizer=optimizer,
        ready=ready,
        finished=finished,
        stop_requested=stop,
        global_step=global_step,
        test_metric=metric,
        test_value=value,
        workers=tuple(workers),
        shards=tuple(shards),
        queues=tuple(queues),
        staleness_p50=control.staleness_percentile(overall, 0.5),
        staleness_p99=control.staleness_percentile(overall, 0.99),
    )


# -- rates -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """Per-second rates between two snapshots ``seconds`` apart (None: unknown, e.g.
    a counter that went backwards after a reset, or a row missing from one snapshot)."""

    seconds: float
    global_steps_per_s: float | None
    worker_steps_per_s: dict[str, float | None] = field(default_factory=dict)
    shard_applies_per_s: dict[int, float | None] = field(default_factory=dict)
    queue_dequeues_per_s: dict[str, float | None] = field(default_factory=dict)
    #: gradient messages pushed to / taken by each shard, on either channel
    shard_arrivals_per_s: dict[int, float | None] = field(default_factory=dict)
    shard_takes_per_s: dict[int, float | None] = field(default_factory=dict)
    #: messages taken from each shard's gradient list (its ``ListRow.name``)
    list_takes_per_s: dict[str, float | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("shard_applies_per_s", "shard_arrivals_per_s", "shard_takes_per_s"):
            d[k] = {str(i): v for i, v in getattr(self, k).items()}
        return d


def _per_s(before: int, after: int, seconds: float) -> float | None:
    if seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def rates(prev: JobSnapshot, cur: JobSnapshot, last: Rates | None = None) -> Rates:
    """The rates between ``prev`` and ``cur`` (see the module docstring); ``last``: the
    rates of the previous pair, whose worker rates are kept while a worker's status has
    not changed."""
    dt = cur.time - prev.time
    before_w = {w.name: w for w in prev.workers}
    workers: dict[str, float | None] = {}
    for w in cur.workers:
        old = before_w.get(w.name)
        if w.done:
            workers[w.name] = 0.0
        elif old is None or old.status_time is None or w.status_time is None:
            workers[w.name] = None
        elif w.status_time > old.status_time:
            workers[w.name] = _per_s(old.step, w.step, w.status_time - old.status_time)
        else:  # no new status since: keep what we knew
            workers[w.name] = None if last is None else last.worker_steps_per_s.get(w.name)
    before_s = {s.shard: s for s in prev.shards}

    def per_shard(count: Callable[[ShardRow], int]) -> dict[int, float | None]:
        return {
            s.shard: _per_s(count(before_s[s.shard]), count(s), dt) if s.shard in before_s else None
            for s in cur.shards
        }

    lists: dict[str, float | None] = {}
    for s in cur.shards:
        old_l = before_s[s.shard].list if s.shard in before_s else None
        if s.list is not None:
            lists[s.list.name] = None if old_l is None else _per_s(old_l.taken, s.list.taken, dt)
    all_q = {q.name: q for q in prev.queues}
    all_q.update({s.queue.name: s.queue for s in prev.shards if s.queue is not None})
    queues: dict[str, float | None] = {}
    for q in [*cur.queues, *(s.queue for s in cur.shards if s.queue is not None)]:
        old_q = all_q.get(q.name)
        queues[q.name] = (
            None if old_q is None else _per_s(old_q.dequeued_total, q.dequeued_total, dt)
        )
    return Rates(
        seconds=dt,
        global_steps_per_s=_per_s(prev.global_step, cur.global_step, dt),
        worker_steps_per_s=workers,
        shard_applies_per_s=per_shard(lambda s: s.applied),
        queue_dequeues_per_s=queues,
        shard_arrivals_per_s=per_shard(lambda s: s.arrived),
        shard_takes_per_s=per_shard(lambda s: s.taken),
        list_takes_per_s=lists,
    )

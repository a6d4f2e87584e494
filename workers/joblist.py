"""The training jobs on a server, for ``qps job ls`` and for the job commands run
without ``--container``: one :class:`JobSummary` per container that holds a job (a PS
config, a ready mark or a worker status, as :func:`workers.monitor.job_exists` says),
found through the container registry (:func:`qps.containers.list_containers`, what
``qps container ls`` lists). Only reads, a few round trips per container: never the
queues' contents.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from qps import containers, keys
from qps.errors import DataLossError
from qps.ps import control
from qps.transport import Client
from workers import job
from workers.monitor import eval_metric, job_state, read_global_step

__all__ = ["JobSummary", "job_summary", "list_jobs", "unfinished"]


@dataclass(frozen=True)
class JobSummary:
    """A job at a glance.

    Attributes:
        container: where it lives.
        state: as :attr:`workers.monitor.JobSnapshot.state` (``starting``, ``running``,
            ``done``, ``stopping``, ``finished``).
        num_shards: its PS shards (None: no PS config yet); ``shards_running``: those
            holding their lease and running.
        num_workers: the workers the chief's ready mark counts (None before it);
            ``workers_reporting``: those that published a status; ``workers_done``: of
            them, those done.
        global_step: the global step.
        started: wall-clock time of its earliest start (a worker's start of training or
            a shard's start), None if nothing started yet.
        test_metric, test_value: the chief's evaluation (``accuracy`` or ``auc``).
    """

    container: str
    state: str
    num_shards: int | None
    shards_running: int
    num_workers: int | None
    workers_reporting: int
    workers_done: int
    global_step: int
    started: float | None
    test_metric: str | None
    test_value: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(x: Any) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


async def job_summary(client: Client, container: str) -> JobSummary | None:
    """The :class:`JobSummary` of ``container``, or None if it holds no job (or a PS
    config qps did not write)."""
    try:
        cfg = await control.read_config(client, container)
    except DataLossError:
        return None
    ready = await job.is_ready(client, container)
    statuses = await job.read_statuses(client, container)
    if cfg is None and ready is None and not statuses:
        return None
    finished = await control.is_finished(client, container)
    stopping = await job.stop_requested(client, container) is not None
    done = await job.finished_workers(client, container)
    n = 0 if cfg is None else cfg.num_shards
    batch = client.batch()
    for i in range(n):
        prefix = keys.ps_prefix(container, i)
        batch.hmget(prefix + "stats", ["state", "started_ms"]).exists(prefix + "lease")
    got = await batch.run()
    running = 0
    starts: list[float] = []
    for (state, started_ms), lease in zip(got[::2], got[1::2], strict=True):
        running += state in (b"running", "running") and bool(lease)
        if (ms := _num(started_ms)) is not None:
            starts.append(ms / 1000)
    names = job.worker_names(statuses)
    flags = [name in done or statuses[name].get("state") == "done" for name in names]
    starts += [t for name in names if (t := _num(statuses[name].get("started_at")))]
    metric, value = eval_metric(statuses)
    wanted = (ready or {}).get("num_workers")
    return JobSummary(
        container=container,
        state=job_state(finished, stopping, flags),
        num_shards=None if cfg is None else cfg.num_shards,
        shards_running=running,
        num_workers=None if wanted is None else int(wanted),
        workers_reporting=len(names),
        workers_done=sum(flags),
        global_step=await read_global_step(client, container),
        started=min(starts) if starts else None,
        test_metric=metric,
        test_value=value,
    )


async def list_jobs(client: Client) -> list[JobSummary]:
    """Every job on the server, by container name (containers in the registry)."""
    out = []
    for name in await containers.list_containers(client):
        summary = await job_summary(client, name)
        if summary is not None:
            out.append(summary)
    return out


def unfinished(jobs: list[JobSummary]) -> list[JobSummary]:
    """The jobs that are not finished: those a command without ``--container`` may
    mean."""
    return [j for j in jobs if j.state != "finished"]

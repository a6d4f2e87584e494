"""``qps job``: look at a whole training job, and stop it.

* ``qps job ls``: the jobs on the server (:mod:`workers.joblist`): state, shards running,
  workers reporting, global step, start, test metric.
* ``qps job status``: one snapshot (:func:`workers.monitor.snapshot`): the PS config,
  finished or not, the global step, a row per worker, per shard and per other queue.
* ``qps job stop``: ask every worker to stop after the step in hand
  (:func:`workers.job.request_stop`) and mark the PS job finished
  (:func:`qps.ps.control.mark_finished`: the shards drain their queues and exit 0);
  with ``--timeout``, wait until every worker is done.

``qps top`` (:mod:`qps.cli.top`) shows the same snapshot live. Without ``--container``
(and ``QPS_CONTAINER``), these commands take the only job on the server that is not
finished (:func:`job_container`), or list the candidates and exit 2.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

from qps import keys
from qps.cli import (
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CliError,
    connected,
    echo_json,
    interactive,
    json_option,
    run_async,
    table,
    url_option,
    yes_option,
)
from qps.errors import NotFoundError, QpsError
from qps.ps import control
from qps.transport import Client
from workers import job as job_marks
from workers.joblist import JobSummary, list_jobs, unfinished
from workers.monitor import WAIT_STATES, JobSnapshot, snapshot, wait_for

__all__ = [
    "fmt_age",
    "fmt_depth",
    "fmt_loss",
    "fmt_metric",
    "fmt_opt",
    "fmt_rate",
    "job",
    "job_container",
    "job_container_option",
]

F = TypeVar("F", bound=Callable[..., Any])


# -- which job -------------------------------------------------------------------------------


def _check_job_container(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    try:
        return None if value is None else keys.check_container(value)
    except QpsError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def job_container_option(f: F) -> F:
    """``--container`` (env ``QPS_CONTAINER``) of the job commands: without it, the only
    job on the server that is not finished (:func:`job_container`)."""
    return click.option(
        "--container",
        envvar="QPS_CONTAINER",
        show_envvar=True,
        default=None,
        callback=_check_job_container,
        help="The job's resource container. Default: the only job on the server that is "
        "not finished (see `qps job ls`); with several, or none, exit code 2.",
    )(f)


def _brief(j: JobSummary) -> str:
    return f"{j.container} ({j.state}, global step {j.global_step:,})"


async def job_container(client: Client, container: str | None) -> str:
    """``container`` itself if given; else the container of the only job on the server
    that is not finished.

    Raises:
        CliError: (exit code 2) no such job, or several: the message lists them.
    """
    if container is not None:
        return container
    jobs = await list_jobs(client)
    live = unfinished(jobs)
    if len(live) == 1:
        return live[0].container
    hint = "name one with --container (or QPS_CONTAINER)"
    if live:
        listed = ", ".join(_brief(j) for j in live)
        raise CliError(
            f"{len(live)} jobs on the server are not finished: {listed}; {hint}", EXIT_USAGE
        )
    done = f" (finished: {', '.join(j.container for j in jobs)})" if jobs else ""
    raise CliError(f"no job on the server that is not finished{done}; {hint}", EXIT_USAGE)


def fmt_loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def fmt_age(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 60:
        return f"{v:.1f}s"
    if v < 3600:
        return f"{v / 60:.0f}m"
    return f"{v / 3600:.1f}h"


def fmt_depth(size: int, capacity: int) -> str:
    """``size/capacity`` (``inf`` for an unbounded queue, as ``qps queue ls``)."""
    return f"{size}/{'inf' if capacity < 0 else capacity}"


def fmt_metric(name: str | None) -> str:
    """The chief's test metric as the commands print it: ``accuracy``, ``AUC``."""
    return "AUC" if name == "auc" else str(name)


def fmt_opt(opt: dict[str, Any] | None) -> str:
    if opt is None:
        return "no optimizer recorded"
    args = ", ".join(f"{k}={v}" for k, v in opt.items() if k != "name")
    return f"{opt['name']}({args})"


def _p(v: int | None) -> str:
    return "-" if v is None else str(v)


async def _snapshot(url: str | None, container: str | None) -> JobSnapshot:
    async with connected(url) as client:
        return await snapshot(client, await job_container(client, container))


@click.group(name="job")
def job() -> None:
    """Look at a whole training job (PS shards, workers, queues) or stop it.

    \b
    Subcommands: ls, status, wait, stop (see `qps job COMMAND --help`); `qps top`
    shows the status live. Without --container, a command takes the only job on the
    server that is not finished.
    """


async def _ls(url: str | None) -> list[JobSummary]:
    async with connected(url) as client:
        return await list_jobs(client)


def _started(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def ls_lines(jobs: list[JobSummary]) -> list[str]:
    """The text of ``qps job ls``."""
    if not jobs:
        return ["no training job on the server"]
    header = ["CONTAINER", "STATE", "SHARDS", "WORKERS", "DONE", "STEP", "STARTED", "TEST"]
    rows = [
        [
            j.container,
            j.state,
            "-" if j.num_shards is None else f"{j.shards_running}/{j.num_shards}",
            f"{j.workers_reporting}" + ("" if j.num_workers is None else f"/{j.num_workers}"),
            str(j.workers_done),
            f"{j.global_step:,}",
            _started(j.started),
            "-" if j.test_value is None else f"{fmt_metric(j.test_metric)} {j.test_value:.4f}",
        ]
        for j in jobs
    ]
    return table(header, rows, {2, 3, 4, 5})


@job.command(name="ls")
@url_option()
@json_option
def ls_command(url: str | None, json: bool) -> None:
    """The training jobs on the server (every registered container that holds a PS
    config, a ready mark or a worker status; see `qps container ls`): container, state,
    PS shards running / configured, workers reporting a status / expected and those
    done, the global step, when it started (local time) and the chief's test metric.

    With --json: a list of {"container", "state", "num_shards", "shards_running",
    "num_workers", "workers_reporting", "workers_done", "global_step", "started"
    (Unix seconds), "test_metric", "test_value"}.
    """
    jobs = run_async(_ls(url))
    if json:
        echo_json([j.as_dict() for j in jobs])
        return
    for line in ls_lines(jobs):
        click.echo(line)


@job.command(name="status")
@url_option()
@job_container_option
@json_option
def status_command(url: str | None, container: str | None, json: bool) -> None:
    """One snapshot of the job in the container: the PS config (shards, optimizer),
    its state (starting, running, done, stopping, finished), the global step; per
    worker: state, steps, examples, last loss, examples/s and the age of its status;
    per shard: state, gradient messages arrived and taken (on its gradient queue and,
    on a single server, its gradient list), applied, its gradient queue
    (depth/capacity), lag (messages waiting), staleness p50/p99, dead letters and, in
    synchronous training, stale gradients dropped; every other queue's depth/capacity.
    Exit code 3 when the container holds no job.

    With --json: the snapshot as one object (see docs/operations.md).
    """
    snap = run_async(_snapshot(url, container))
    if json:
        echo_json(snap.as_dict())
        return
    for line in status_lines(snap):
        click.echo(line)


async def _wait(
    url: str | None, container: str | None, state: str, timeout: float | None
) -> JobSnapshot:
    async with connected(url) as client:
        return await wait_for(client, await job_container(client, container), state, timeout)


@job.command(name="wait")
@url_option()
@job_container_option
@click.option(
    "--for",
    "state",
    type=click.Choice(WAIT_STATES),
    default="running",
    show_default=True,
    help="serving: the PS job is configured and every shard runs (workers may push); "
    "running: that, and every worker has published its status; done: every worker is "
    "done; finished: the PS job is finished and no shard runs.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Give up after this long (exit code 4). Default: wait as long as it takes.",
)
def wait_command(url: str | None, container: str | None, state: str, timeout: float | None) -> None:
    """Wait until the job in the container comes to a state (or past it: a job that
    finished has been running), then print one line: its state and global step. A
    container with no job yet is waited for too. For scripts: start the roles, `qps
    job wait`, then look at the job.
    """
    snap = run_async(_wait(url, container, state, timeout))
    # the job's own state says "starting" until a worker publishes; serving is reached
    shown = "serving (no worker yet)" if snap.state == "starting" else snap.state
    click.echo(
        f"container {snap.container}: job {shown}, global step {snap.global_step:,}, "
        f"{len(snap.workers)} worker(s), {len(snap.shards)} PS shard(s)"
    )


def status_lines(snap: JobSnapshot) -> list[str]:
    """The text of ``qps job status`` for a :class:`workers.monitor.JobSnapshot`."""
    shards = "no PS config" if snap.num_shards is None else f"{snap.num_shards} PS shard(s)"
    out = [
        f"container {snap.container}: job {snap.state}, global step {snap.global_step:,}, "
        f"{shards}, {fmt_opt(snap.optimizer)}"
    ]
    if snap.stop_requested is not None:
        out.append(f"stop requested: {snap.stop_requested.get('reason', '')}")
    if snap.test_value is not None:
        out.append(f"test {fmt_metric(snap.test_metric)} {snap.test_value:.4f}")
    stale = f"staleness p50 {_p(snap.staleness_p50)} / p99 {_p(snap.staleness_p99)}"
    out.append(f"{stale}; dead letters {snap.dead_letters}")
    out.append("")
    if snap.workers:
        header = ["WORKER", "STATE", "STEP", "EXAMPLES", "LOSS", "EXAMPLES/S", "P50", "P99", "AGE"]
        rows = [
            [
                w.name,
                w.state,
                f"{w.step:,}",
                f"{w.examples:,}",
                fmt_loss(w.loss),
                fmt_rate(w.examples_per_s),
                _p(w.staleness_p50),
                _p(w.staleness_p99),
                fmt_age(w.age_s),
            ]
            for w in snap.workers
        ]
        out += table(header, rows, {2, 3, 4, 5, 6, 7, 8})
    else:
        out.append("no worker has published a status yet")
    if snap.shards:
        out.append("")
        header = ["SHARD", "STATE", "ARRIVED", "TAKEN", "APPLIED", "QUEUE", "LAG", "P50", "P99"]
        header.append("DLQ")
        dropped = any(s.dropped_stale for s in snap.shards)  # synchronous training
        if dropped:
            header.append("DROPPED")
        rows = [
            [
                str(s.shard),
                s.state,
                f"{s.arrived:,}",
                f"{s.taken:,}",
                f"{s.applied:,}",
                "-" if s.queue is None else fmt_depth(s.queue.size, s.queue.capacity),
                _p(s.lag),
                _p(s.staleness_p50),
                _p(s.staleness_p99),
                str(s.dead_letters),
                *([f"{s.dropped_stale:,}"] if dropped else []),
            ]
            for s in snap.shards
        ]
        out += table(header, rows, {0, *range(2, len(header))})
    if snap.queues:
        out.append("")
        header = ["QUEUE", "TYPE", "DEPTH", "CLOSED", "ENQUEUED", "DEQUEUED", "DLQ"]
        rows = [
            [
                q.name,
                q.type,
                fmt_depth(q.size, q.capacity),
                "yes" if q.closed else "no",
                f"{q.enqueued_total:,}",
                f"{q.dequeued_total:,}",
                str(q.dead_letters),
            ]
            for q in snap.queues
        ]
        out += table(header, rows, {2, 4, 5, 6})
    return out


# -- stop ------------------------------------------------------------------------------------


async def _stop(
    client: Client, container: str, yes: bool, timeout: float | None
) -> tuple[int, list[str]]:
    try:
        snap = await snapshot(client, container)
    except NotFoundError as exc:
        raise CliError(str(exc), EXIT_NOT_FOUND) from exc
    if not yes:
        if not interactive():
            raise CliError(
                f"stopping the job in container '{container}' ends every worker and shard "
                "and stdin is not a terminal to confirm it: pass --yes to stop it",
                EXIT_USAGE,
            )
        busy = sum(not w.done for w in snap.workers)
        question = (
            f"Stop the job in container '{container}' (global step {snap.global_step:,}, "
            f"{busy} worker(s) running, {len(snap.shards)} shard(s))?"
        )
        if not click.confirm(question, default=False, err=True):
            raise CliError("not confirmed; the job goes on", EXIT_FAILURE)
    await job_marks.request_stop(client, container)
    closed = 0
    if snap.num_shards is not None:
        await control.mark_finished(client, container)
        closed = snap.num_shards  # all closed now, whether by this call or by the last worker
    done: list[str] = []
    if timeout is not None:
        done = await job_marks.wait_workers_done(client, container, timeout)
    return closed, done


async def _stop_main(
    url: str | None, container: str | None, yes: bool, timeout: float | None
) -> tuple[int, list[str], JobSnapshot]:
    async with connected(url) as client:
        container = await job_container(client, container)
        closed, done = await _stop(client, container, yes, timeout)
        return closed, done, await snapshot(client, container)


@job.command(name="stop")
@url_option()
@job_container_option
@yes_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Wait up to this long until every worker is done (exit code 4 if not).",
)
def stop_command(url: str | None, container: str | None, yes: bool, timeout: float | None) -> None:
    """Stop the job in the container: every worker stops after the step in hand,
    records itself done and exits 0; the PS job is marked finished, so the shards apply
    what their queues hold and exit 0 (a push after that fails, which ends a worker at
    once). The stop mark stays until the container is reset: a restarted worker stops
    at once.

    Asks for confirmation unless --yes. With --timeout, waits until every worker that
    published a status is done, then prints each role's state.
    """
    closed, done, snap = run_async(_stop_main(url, container, yes, timeout))
    click.echo(
        f"stop requested for the job in container '{snap.container}'"
        + (f"; PS job marked finished ({closed} gradient queue(s) closed)" if closed else "")
    )
    if timeout is None:
        return
    click.echo(f"{len(done)} worker(s) done at global step {snap.global_step:,}")
    for w in snap.workers:
        click.echo(f"  {w.name}: {w.state}, {w.step:,} step(s)")
    for s in snap.shards:
        draining = s.state == "running" and snap.finished
        click.echo(
            f"  shard {s.shard}: {s.state}"
            + (f", draining its queue ({_p(s.lag)} message(s) left)" if draining else "")
        )

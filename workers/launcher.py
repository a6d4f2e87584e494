"""``qps train``: a whole training job on this machine, every role its own process.

:func:`run_job` starts (or reuses, with ``url``) a Redis server, records the PS job
(shards, optimizer) in a fresh container, then starts ``num_shards`` ``qps ps``
processes and ``num_workers`` ``qps worker`` processes, and watches them:

* each child's output is streamed with a role prefix (``[worker1] ...``);
* progress (the workers' steps of their total, the global step, examples/s and the
  chief's last loss, read from the job's published status in Redis) goes to a
  ``progress`` callback: ``qps train`` draws it as a bar on a terminal;
* when every worker has exited (a crashed worker does not stop an asynchronous job:
  the others carry on), the job is marked finished; the shards drain their queues and
  exit 0; the final metrics are printed (test accuracy, global step, examples/s,
  staleness p50/p99 from the shards' statistics);
* a role that dies (a crash, a SIGKILL) is started again, up to ``restarts`` times
  each, as a process manager would (never one that exits with status 2, a usage error:
  it would refuse its settings again): a restarted shard takes its lease over at once and
  puts back what the dead one held, so every gradient is still applied exactly once; a
  restarted worker goes on after the last step it published;
* a shard that fails for good, or Ctrl-C/SIGTERM, stops every process (SIGTERM, then SIGKILL
  after a grace period): nothing is left running; a server started here is stopped. A
  stop request (the :class:`qps.stopping.Stopper` of ``qps train``) cuts every wait of
  the set-up short (starting the server, connecting, taking the container's lease,
  resuming, restoring a checkpoint: a restore cut short is undone), and the report
  after it (the final parameters' metric) gets :data:`REPORT_SECONDS`;
* Redis lost while the job runs (the launcher's own calls fail, or a role exits with
  status 5 and Redis does not answer a PING): every role is stopped, none is started
  again, and the result says so (``stopped`` "Redis unreachable", exit code 5) with
  the last global step seen;
* with ``metrics_port`` BASE, shard ``i`` serves its Prometheus metrics on BASE + i and
  worker ``k`` on BASE + num_shards + k (:meth:`TrainConfig.metrics_ports`; BASE 0:
  each picks a free port and logs it).

:meth:`TrainConfig.check` refuses, before anything starts, the settings a role would
refuse (an unknown model, optimizer or data set...).

Exit status: 0 when the job ran to its end, 1 when a shard failed or no worker
finished, 5 when Redis became unreachable, 130 after Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import qps
from qps import wire
from qps.aio import bounded, in_daemon_thread
from qps.errors import QpsError, UnavailableError
from qps.optimizers import make_optimizer
from qps.ps import control
from qps.stopping import Stopped, Stopper
from qps.transport import redact_url
from workers import job, lifecycle, roles
from workers.data import BUILTIN, builtin_split
from workers.models import build_model
from workers.trainconfig import BUILTIN_TRAIN_SIZES, TrainConfig, check_data, check_model
from workers.worker import evaluate_params

__all__ = [
    "BUILTIN_TRAIN_SIZES",
    "JobResult",
    "TrainConfig",
    "check_data",
    "check_model",
    "evaluate",
    "run_job",
]

T = TypeVar("T")

#: the exit status of a role that refused its settings (qps.cli.EXIT_USAGE): it is never
#: started again, as it would refuse them again
EXIT_USAGE = 2
#: the exit status of a role that cannot reach Redis (qps.cli.EXIT_UNAVAILABLE), and of
#: a job whose Redis became unreachable
EXIT_UNAVAILABLE = 5
#: the exit status of a job stopped by a signal (Ctrl-C, SIGTERM)
EXIT_INTERRUPTED = 130

#: after a stop request: how long the report (the final parameters' metric, the
#: staleness) may take, counted from the request, before the result goes without it
REPORT_SECONDS = 1.5
#: after an interrupt: how long the launcher waits for the workers' final statuses
FINAL_READ_SECONDS = 0.5


@dataclass
class JobResult:
    """What a finished job reports."""

    container: str = ""
    exit_code: int = 0
    seconds: float = 0.0
    global_step: int = 0
    examples: int = 0
    test_metric: str = ""  # "accuracy", or "auc" for a CTR model
    test_value: float | None = None
    last_loss: float | None = None
    staleness_p50: int | None = None
    staleness_p99: int | None = None
    failed: dict[str, int] = field(default_factory=dict)  # role -> exit code
    restarts: dict[str, int] = field(default_factory=dict)  # role -> times restarted
    stopped: str = ""
    #: what went wrong, in words, when the job could not go on (Redis unreachable)
    error: str = ""
    restored_from: str | None = None  # the checkpoint the job started from
    restored_step: int | None = None
    resumed_from: str | None = None  # "redis" or "checkpoint": a rerun went on from it
    resumed_step: int | None = None
    #: the workers' examples when this run started (a resumed job's earlier runs)
    examples_before: int = 0

    def saw(self, progress: tuple[int, int, float | None, int]) -> None:
        """Take a reading of :func:`workers.roles.progress`: the global step, the
        examples of this run (not those of the runs it resumed), the chief's loss."""
        step, examples, self.last_loss, _ = progress
        self.global_step, self.examples = step, max(0, examples - self.examples_before)

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "container": self.container,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "global_step": self.global_step,
            "examples": self.examples,
            "examples_per_s": round(self.examples_per_second, 1),
            "test_metric": self.test_metric,
            "test_value": self.test_value,
            "last_loss": self.last_loss,
            "staleness_p50": self.staleness_p50,
            "staleness_p99": self.staleness_p99,
            "failed": self.failed,
            "restarts": self.restarts,
            "stopped": self.stopped,
            "error": self.error,
            "restored_from": self.restored_from,
            "restored_step": self.restored_step,
            "resumed_from": self.resumed_from,
            "resumed_step": self.resumed_step,
        }


async def run_job(
    cfg: TrainConfig,
    emit: Callable[[str], None],
    progress: roles.ProgressFn | None = None,
    stop: Stopper | None = None,
) -> JobResult:
    """Run the whole job (see the module docstring). ``emit`` prints one line of role
    output or news; ``progress`` is called about twice a second with the workers' steps
    so far, their total (``steps`` times the workers; None when the input is a queue,
    whose end is not known) and a line of text (None: no progress);
    ``stop``: the process's stopper (``qps train`` runs this under it, with SIGTERM and
    SIGINT): a stop request cuts the set-up short, or stops every role, and the job
    returns with exit code 130 (after a report of at most :data:`REPORT_SECONDS`).

    Raises:
        UnavailableError: Redis cannot be reached as the job starts.
    """
    stopper = stop or Stopper()
    stopped_at: list[float] = []  # when the stop was requested
    stopper.on_stop(lambda: stopped_at.append(time.monotonic()))
    container = cfg.container or f"train-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    result = JobResult(container=container)
    shards: list[roles.Role] = []
    workers: list[roles.Role] = []  # restarted roles replace theirs in place
    server = None
    url = cfg.url or ""
    start, started_at = time.monotonic(), time.time()
    try:
        if not url:
            server = qps.embedded.EmbeddedServer()
            async with stopper.interruptible("starting a Redis server"):
                await asyncio.to_thread(server.start)
            url = server.url
        async with contextlib.AsyncExitStack() as stack:
            async with stopper.interruptible("connecting to Redis"):
                client = await qps.connect(url)
            stack.push_async_callback(client.close)
            async with stopper.interruptible("taking the container's lease"):
                lease = await stack.enter_async_context(lifecycle.LauncherLease(client, container))
            plan = await lifecycle.resume(lease, cfg.checkpoint_dir, emit, stopper)
            if plan.source != "fresh":
                result.resumed_from, result.resumed_step = plan.source, plan.global_step
            if plan.checkpoint is not None:
                result.restored_from, result.restored_step = str(plan.checkpoint), plan.global_step
            await _configure(client, container, cfg, stopper)
            async with stopper.interruptible("reading the job's progress"):
                result.examples_before = (await roles.progress(client, container))[1]
            _announce(cfg, container, url, emit)
            test_split = _preload_test_split(cfg)
            for i in range(cfg.num_shards):
                args = cfg.shard_args(i, url, container)
                shards.append(await roles.start(f"ps{i}", args, emit, cfg.role_env))
            for k in range(cfg.num_workers):
                args = cfg.worker_args(k, url, container)
                workers.append(await roles.start(f"worker{k}", args, emit, cfg.role_env))
            steps_total = None if cfg.data.startswith("queue:") else cfg.steps * cfg.num_workers
            result.exit_code = await _watch(
                client, container, shards, workers, result, progress, stopper, emit,
                cfg.sync_replicas, steps_total, cfg.restarts,
            )  # fmt: skip
            result.seconds = time.monotonic() - start
            # interrupted: the roles stop at once (no eval) while the report is read, so
            # that stopping them does not eat the report's time
            stopping = (
                asyncio.ensure_future(roles.stop_all(shards + workers))
                if result.exit_code == EXIT_INTERRUPTED
                else None
            )
            try:
                if result.exit_code != EXIT_UNAVAILABLE:
                    report = _report(client, container, cfg, result, started_at, test_split)
                    if not await _within_stop_budget(report, stopper, stopped_at):
                        emit(
                            f"qps train: no final metrics: not read within {REPORT_SECONDS:g} s "
                            "of the stop"
                        )
            except UnavailableError:
                result.exit_code, result.stopped = EXIT_UNAVAILABLE, "Redis unreachable"
            finally:
                if stopping is not None:
                    await stopping
                    await _final_progress(client, container, result)
            if result.exit_code == EXIT_UNAVAILABLE:
                result.error = (
                    f"Redis at {redact_url(url)} became unreachable after "
                    f"{time.monotonic() - start:.1f} s"
                )
                emit(f"qps train: {result.error}: stopping every role")
                await roles.stop_all(shards + workers)
    except Stopped as exc:  # a stop request cut the set-up short
        result.exit_code, result.stopped = EXIT_INTERRUPTED, "interrupted"
        result.seconds = time.monotonic() - start
        emit(f"qps train: stopped ({exc})")
    except asyncio.CancelledError:
        if not stopper.overran:
            raise
        # not stopped in time after the signal (a wait that was not cut short): the
        # stopper cancelled us; what is known is reported
        result.exit_code, result.stopped = EXIT_INTERRUPTED, "interrupted"
    finally:
        await roles.stop_all(shards + workers)
        if server is not None:
            await asyncio.to_thread(server.stop)
    return result


async def _configure(
    client: qps.Client, container: str, cfg: TrainConfig, stopper: Stopper
) -> None:
    """Record the PS job (shards, optimizer, synchronous updates, message size)."""
    optimizer = make_optimizer(cfg.optimizer, learning_rate=cfg.learning_rate)
    sync = None if cfg.sync_replicas is None else (cfg.sync_replicas, cfg.num_workers)
    most = None
    if cfg.max_message_mib is not None:
        most = min(cfg.max_message_mib << 20, wire.MAX_MESSAGE_BYTES)
    async with stopper.interruptible("recording the PS job"):
        await control.configure(
            client, container, cfg.num_shards, optimizer, sync=sync, max_message_bytes=most
        )


def _announce(cfg: TrainConfig, container: str, url: str, emit: Callable[[str], None]) -> None:
    """Say what runs, how to watch it, and where the metrics are."""
    emit(
        f"qps train: container {container}: {cfg.num_shards} PS shard(s), "
        f"{cfg.num_workers} worker(s), model {cfg.model}, {cfg.optimizer} "
        f"lr {cfg.learning_rate}, {cfg.steps} steps per worker"
        + (f", max staleness {cfg.max_staleness}" if cfg.max_staleness is not None else "")
        + (
            f", synchronous ({cfg.sync_replicas} of {cfg.num_workers} per update)"
            if cfg.sync_replicas is not None
            else ""
        )
    )
    emit(f"qps train: watch it: qps top --url {shlex.quote(redact_url(url))} "
         f"--container {container}")  # fmt: skip
    ports = cfg.metrics_ports()
    if ports:
        emit(
            "qps train: metrics: "
            + ", ".join(
                f"{role} {_metrics_url(cfg.metrics_addr, port)}"
                if port
                else f"{role} (a free port, see its log)"
                for role, port in ports.items()
            )
        )


async def _report(
    client: qps.Client,
    container: str,
    cfg: TrainConfig,
    result: JobResult,
    started_at: float,
    test_split: asyncio.Future[Any] | None,
) -> None:
    """Fill ``result`` in: the job's progress, the metric of its final parameters (or
    the chief's last), the staleness percentiles."""
    result.saw(await roles.progress(client, container))
    got = None
    if result.exit_code in (0, EXIT_INTERRUPTED):  # the parameters the job ended with
        got = await evaluate(client, container, cfg, test_split)
    got = got or await lifecycle.chief_metric(client, container, started_at)
    if got is not None:
        result.test_metric, result.test_value = got
    total: dict[int, int] = {}
    for i in range(cfg.num_shards):
        st = await control.shard_status(client, container, i)
        for hist in st.staleness.values():
            for b, n in hist.items():
                total[b] = total.get(b, 0) + n
    result.staleness_p50 = control.staleness_percentile(total, 0.5)
    result.staleness_p99 = control.staleness_percentile(total, 0.99)


async def _final_progress(client: qps.Client, container: str, result: JobResult) -> None:
    """After an interrupt, once the roles have stopped: the workers' last statuses,
    which they publish as they stop (what was read while they ran lags by up to
    ``--log-every`` steps). Skipped when Redis does not answer within
    :data:`FINAL_READ_SECONDS`."""
    read = await bounded(roles.progress(client, container), FINAL_READ_SECONDS)
    if not read.cancelled() and read.exception() is None:
        result.saw(read.result())


async def _within_stop_budget(aw: Awaitable[None], stopper: Stopper, since: list[float]) -> bool:
    """Run ``aw`` to its end, or, once a stop is requested (at ``since[0]``), until
    :data:`REPORT_SECONDS` after the request. Returns whether it ended."""
    task = asyncio.ensure_future(aw)
    stopping = asyncio.ensure_future(stopper.event.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            left = (since[0] if since else time.monotonic()) + REPORT_SECONDS - time.monotonic()
            await asyncio.wait({task}, timeout=max(0.0, left))
        if task.done():
            task.result()  # its failure, if any
            return True
        return False
    finally:
        for t in (task, stopping):
            t.cancel()
        await asyncio.gather(task, stopping, return_exceptions=True)


def _preload_test_split(cfg: TrainConfig) -> asyncio.Future[Any] | None:
    """The test split :func:`evaluate` scores on, read on a thread of its own while the
    job trains (loading scikit-learn's digits takes seconds on a busy machine: an
    interrupted job's report would wait for it). A daemon thread, not
    ``asyncio.to_thread``: the event loop's end does not wait for it. None when the
    data is not built in."""
    if cfg.data not in BUILTIN:
        return None
    return in_daemon_thread(lambda: builtin_split(cfg.data, build_model(cfg.model))[1])


def _metrics_url(addr: str, port: int) -> str:
    return f"http://{f'[{addr}]' if ':' in addr else addr}:{port}/metrics"


async def evaluate(
    client: qps.Client,
    container: str,
    cfg: TrainConfig,
    test_split: asyncio.Future[Any] | None = None,
) -> tuple[str, float] | None:
    """The test metric of the job's final parameters (built-in data sets only), on
    ``test_split`` when given (:func:`_preload_test_split`; the split of ``cfg.model``)."""
    if cfg.data not in BUILTIN:
        return None
    ready = await job.is_ready(client, container)  # the model the chief trained
    spec = str(ready["model"]) if ready else cfg.model
    model = build_model(spec)
    if test_split is not None and (spec == cfg.model or cfg.data != "ctr"):
        test = await asyncio.shield(test_split)  # only ctr's split depends on the model
    else:
        _, test = await asyncio.to_thread(builtin_split, cfg.data, model)
    async with qps.Session(client=client, container=container) as sess:
        return await evaluate_params(sess, model, test)


async def _watch(
    client: qps.Client,
    container: str,
    shards: list[roles.Role],
    workers: list[roles.Role],
    result: JobResult,
    progress: roles.ProgressFn | None,
    stopper: Stopper,
    emit: Callable[[str], None],
    sync_replicas: int | None = None,
    total_steps: int | None = None,
    restarts: int = 0,
) -> int:
    """Wait for the workers, then finish the job and wait for the shards. Synchronous
    training ends once fewer than ``sync_replicas`` workers run: no update can form. A
    role that dies is started again (in place, in ``shards``/``workers``) up to
    ``restarts`` times; after that its failure counts. One that exits with
    :data:`EXIT_USAGE` refused its settings: its failure counts at once. Redis lost
    (a call of ours fails, or a role exits with :data:`EXIT_UNAVAILABLE`, and Redis
    does not answer a PING) ends the watch at once: nothing is started again.
    ``result`` gets the progress as it is read. Returns the job's exit code."""
    stopping = asyncio.ensure_future(stopper.event.wait())
    try:
        return await _watch_roles(
            client, container, shards, workers, result, progress, stopping, stopper, emit,
            sync_replicas, total_steps, restarts,
        )  # fmt: skip
    except Stopped:
        result.stopped = "interrupted"
        emit("qps train: stopping every role")
        return EXIT_INTERRUPTED
    except _RedisLost:
        result.stopped = "Redis unreachable"
        return EXIT_UNAVAILABLE
    finally:
        stopping.cancel()


class _RedisLost(Exception):
    """Redis does not answer: the job cannot go on."""


async def _watch_roles(
    client: qps.Client,
    container: str,
    shards: list[roles.Role],
    workers: list[roles.Role],
    result: JobResult,
    progress: roles.ProgressFn | None,
    stopping: asyncio.Future[Any],
    stopper: Stopper,
    emit: Callable[[str], None],
    sync_replicas: int | None,
    total_steps: int | None,
    restarts: int,
) -> int:
    waits = {asyncio.ensure_future(r.proc.wait()): r for r in shards + workers}
    running_workers = set(workers)
    finished = False
    t0 = time.monotonic()
    while waits:
        done, _ = await asyncio.wait(
            [*waits, stopping], timeout=0.5, return_when=asyncio.FIRST_COMPLETED
        )
        if stopping in done:
            raise Stopped(stopper.reason)
        for fut in done:
            role = waits.pop(fut)
            code = role.proc.returncode
            if code == EXIT_UNAVAILABLE:
                async with stopper.interruptible("asking whether Redis answers"):
                    if not await roles.answers(client):
                        emit(f"qps train: {role.name} exited with status {code}: Redis "
                             "does not answer: not started again")  # fmt: skip
                        result.failed[role.name] = code
                        raise _RedisLost
            again_ok = code not in (0, EXIT_USAGE)
            if again_ok and result.restarts.get(role.name, 0) < restarts:
                n = result.restarts[role.name] = result.restarts.get(role.name, 0) + 1
                emit(
                    f"qps train: {role.name} exited with status {code}: starting it again "
                    f"({n} of {restarts})"
                )
                if role.pump is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(role.pump, 5)
                again = await roles.start(role.name, role.args, emit, role.env)
                for group in (shards, workers):
                    if role in group:
                        group[group.index(role)] = again
                if role in running_workers:
                    running_workers.discard(role)
                    running_workers.add(again)
                waits[asyncio.ensure_future(again.proc.wait())] = again
                continue
            if code != 0:
                result.failed[role.name] = int(code if code is not None else -1)
                why = " (a usage error: not started again)" if code == EXIT_USAGE else ""
                emit(f"qps train: {role.name} exited with status {code}{why}")
            if role in running_workers:
                running_workers.discard(role)
            elif code != 0 and not finished:  # a shard failed: the job cannot go on
                result.stopped = f"{role.name} failed"
                return 1
        try:
            async with stopper.interruptible("reading the job's progress"):
                if (
                    not finished
                    and sync_replicas is not None
                    and 0 < len(running_workers) < sync_replicas
                ):
                    gone = len(workers) - len(running_workers)
                    failed = any(w.name in result.failed for w in workers)
                    why = "failed or done" if failed else "done with their steps"
                    emit(
                        f"qps train: {gone} worker(s) {why}; a synchronous update needs "
                        f"{sync_replicas}, and {len(running_workers)} are left: finishing the job"
                    )
                    finished = True
                    await control.mark_finished(client, container)
                if not running_workers and not finished:
                    finished = True
                    if len(result.failed) >= len(workers):
                        result.stopped = "every worker failed"
                        return 1
                    await control.mark_finished(client, container)
                reading = await roles.progress(client, container)
        except QpsError as exc:
            if await roles.answers(client):  # a moment's trouble: go on
                emit(f"qps train: could not read the job's progress: {exc}")
                continue
            raise _RedisLost from exc
        result.saw(reading)
        if progress is not None:
            rate = result.examples / max(time.monotonic() - t0, 1e-9)
            loss = result.last_loss
            loss_text = "-" if loss is None else f"{loss:.4f}"
            progress(
                reading[3],
                total_steps,
                f"global step {result.global_step:,}, {rate:,.0f} examples/s, loss {loss_text}",
            )
    if any(r.name in result.failed for r in shards):
        result.stopped = "a shard failed"
        return 1
    result.stopped = "finished"
    return 0

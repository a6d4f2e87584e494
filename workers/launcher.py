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
  after a grace period): nothing is left running; a server started here is stopped;
* with ``metrics_port`` BASE, shard ``i`` serves its Prometheus metrics on BASE + i and
  worker ``k`` on BASE + num_shards + k (:meth:`TrainConfig.metrics_ports`; BASE 0:
  each picks a free port and logs it).

:meth:`TrainConfig.check` refuses, before anything starts, the settings a role would
refuse (an unknown model, optimizer or data set...).

Exit status: 0 when the job ran to its end, 1 when a shard failed or no worker
finished, 130 after Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import qps
from qps import owners, wire
from qps.optimizers import make_optimizer
from qps.ps import control
from qps.transport import redact_url
from workers import job, lifecycle
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
    "run_job",
]

#: how long roles get to exit after SIGTERM before SIGKILL
GRACE_SECONDS = 10.0

#: the exit status of a role that refused its settings (qps.cli.EXIT_USAGE): it is never
#: started again, as it would refuse them again
EXIT_USAGE = 2


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
    restored_from: str | None = None  # the checkpoint the job started from
    restored_step: int | None = None
    resumed_from: str | None = None  # "redis" or "checkpoint": a rerun went on from it
    resumed_step: int | None = None

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
            "restored_from": self.restored_from,
            "restored_step": self.restored_step,
            "resumed_from": self.resumed_from,
            "resumed_step": self.resumed_step,
        }


class _Role:
    def __init__(
        self, name: str, proc: asyncio.subprocess.Process, args: list[str], env: dict[str, str]
    ) -> None:
        self.name = name
        self.proc = proc
        self.args = args
        self.env = env
        self.pump: asyncio.Task[None] | None = None


async def _pump(role: _Role, emit: Callable[[str], None]) -> None:
    stream = role.proc.stdout
    assert stream is not None
    while line := await stream.readline():
        emit(f"[{role.name}] {line.decode(errors='replace').rstrip()}")


async def _start(
    name: str, args: list[str], emit: Callable[[str], None], extra: dict[str, str] | None = None
) -> _Role:
    """Start role ``name``: ``qps ARGS`` with this environment, less the metrics
    variables, plus ``extra``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("QPS_METRICS_PORT", "QPS_METRICS_ADDR"):  # each role's port is in its args
        env.pop(var, None)
    env.update(extra or {})
    env[owners.PARENT_ENV] = str(os.getpid())  # it stops if we die (owners.die_with_parent)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "qps.cli.main",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        start_new_session=True,  # our signals only: Ctrl-C reaches us, we stop them
    )
    role = _Role(name, proc, args, dict(extra or {}))
    role.pump = asyncio.create_task(_pump(role, emit))
    return role


async def _stop_all(roles: list[_Role], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every role still running, SIGKILL what is left after ``grace``."""
    live = [r for r in roles if r.proc.returncode is None]
    for r in live:
        with contextlib.suppress(ProcessLookupError):
            r.proc.send_signal(signal.SIGTERM)
    if live:
        await asyncio.wait([asyncio.ensure_future(r.proc.wait()) for r in live], timeout=grace)
        for r in live:
            if r.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.kill()
        await asyncio.gather(*(r.proc.wait() for r in live))
    for r in roles:
        if r.pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(r.pump, 5)


#: ``progress(worker steps done, their total or None, text)``: see :func:`run_job`
ProgressFn = Callable[[int, "int | None", str], None]


async def _progress(client: qps.Client, container: str) -> tuple[int, int, float | None, int]:
    """(global step, examples so far, chief's last loss, the workers' steps so far)
    from the job's status."""
    statuses = await job.read_statuses(client, container)
    workers = [s for n, s in statuses.items() if n.startswith("worker")]
    examples = sum(int(s.get("examples", 0)) for s in workers)
    steps = sum(int(s.get("step", 0)) for s in workers)
    loss = statuses.get("worker0", {}).get("loss")
    step = await control.global_step_counter(client, container).get() if statuses else 0
    return step, examples, loss, steps


async def run_job(
    cfg: TrainConfig,
    emit: Callable[[str], None],
    progress: ProgressFn | None = None,
    stop: asyncio.Event | None = None,
) -> JobResult:
    """Run the whole job (see the module docstring). ``emit`` prints one line of role
    output or news; ``progress`` is called about twice a second with the workers' steps
    so far, their total (``steps`` times the workers; None when the input is a queue,
    whose end is not known) and a line of text (None: no progress);
    ``stop`` set (Ctrl-C): stop every role and return with exit code 130."""
    server = None
    url = cfg.url
    if url is None:
        server = qps.embedded.EmbeddedServer()
        await asyncio.to_thread(server.start)
        url = server.url
    container = cfg.container or f"train-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    result = JobResult(container=container)
    shards: list[_Role] = []
    workers: list[_Role] = []  # restarted roles replace theirs in place
    stop = stop or asyncio.Event()
    start, started_at = time.monotonic(), time.time()
    try:
        async with (
            await qps.connect(url) as client,
            lifecycle.LauncherLease(client, container) as lease,
        ):
            optimizer = make_optimizer(cfg.optimizer, learning_rate=cfg.learning_rate)
            plan = await lifecycle.resume(lease, cfg.checkpoint_dir, emit)  # before any role
            if plan.source != "fresh":
                result.resumed_from, result.resumed_step = plan.source, plan.global_step
            if plan.checkpoint is not None:
                result.restored_from, result.restored_step = str(plan.checkpoint), plan.global_step
            sync = None if cfg.sync_replicas is None else (cfg.sync_replicas, cfg.num_workers)
            most = None
            if cfg.max_message_mib is not None:
                most = min(cfg.max_message_mib << 20, wire.MAX_MESSAGE_BYTES)
            await control.configure(
                client, container, cfg.num_shards, optimizer, sync=sync, max_message_bytes=most
            )
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
            for i in range(cfg.num_shards):
                shards.append(
                    await _start(f"ps{i}", cfg.shard_args(i, url, container), emit, cfg.role_env)
                )
            for k in range(cfg.num_workers):
                args = cfg.worker_args(k, url, container)
                workers.append(await _start(f"worker{k}", args, emit, cfg.role_env))
            steps_total = None if cfg.data.startswith("queue:") else cfg.steps * cfg.num_workers
            result.exit_code = await _watch(
                client, container, shards, workers, result, progress, stop, emit,
                cfg.sync_replicas, steps_total, cfg.restarts,
            )  # fmt: skip
            result.seconds = time.monotonic() - start
            if result.exit_code == 130:  # interrupted: the roles stop at once (no eval)
                await _stop_all(shards + workers)
            result.global_step, result.examples, result.last_loss, _ = await _progress(
                client, container
            )
            got = None
            if result.exit_code in (0, 130):  # the parameters the job ended with
                got = await evaluate(client, container, cfg)
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
    finally:
        await _stop_all(shards + workers)
        if server is not None:
            await asyncio.to_thread(server.stop)
    return result


def _metrics_url(addr: str, port: int) -> str:
    return f"http://{f'[{addr}]' if ':' in addr else addr}:{port}/metrics"


async def evaluate(
    client: qps.Client, container: str, cfg: TrainConfig
) -> tuple[str, float] | None:
    """The test metric of the job's final parameters (built-in data sets only)."""
    if cfg.data not in BUILTIN:
        return None
    ready = await job.is_ready(client, container)  # the model the chief trained
    model = build_model(str(ready["model"]) if ready else cfg.model)
    _, test = await asyncio.to_thread(builtin_split, cfg.data, model)
    async with qps.Session(client=client, container=container) as sess:
        return await evaluate_params(sess, model, test)


async def _watch(
    client: qps.Client,
    container: str,
    shards: list[_Role],
    workers: list[_Role],
    result: JobResult,
    progress: ProgressFn | None,
    stop: asyncio.Event,
    emit: Callable[[str], None],
    sync_replicas: int | None = None,
    total_steps: int | None = None,
    restarts: int = 0,
) -> int:
    """Wait for the workers, then finish the job and wait for the shards. Synchronous
    training ends once fewer than ``sync_replicas`` workers run: no update can form. A
    role that dies is started again (in place, in ``shards``/``workers``) up to
    ``restarts`` times; after that its failure counts. One that exits with
    :data:`EXIT_USAGE` refused its settings: its failure counts at once."""
    waits = {asyncio.ensure_future(r.proc.wait()): r for r in shards + workers}
    stopping = asyncio.ensure_future(stop.wait())
    running_workers = set(workers)
    finished = False
    t0 = time.monotonic()
    while waits:
        done, _ = await asyncio.wait(
            [*waits, stopping], timeout=0.5, return_when=asyncio.FIRST_COMPLETED
        )
        if stopping in done:
            result.stopped = "interrupted"
            emit("qps train: stopping every role")
            return 130
        for fut in done:
            role = waits.pop(fut)
            code = role.proc.returncode
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
                again = await _start(role.name, role.args, emit, role.env)
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
        if not finished and sync_replicas is not None and 0 < len(running_workers) < sync_replicas:
            emit(
                f"qps train: {len(running_workers)} worker(s) left, fewer than the "
                f"{sync_replicas} an update needs: finishing the job"
            )
            finished = True
            await control.mark_finished(client, container)
        if not running_workers and not finished:
            finished = True
            if len(result.failed) >= len(workers):
                result.stopped = "every worker failed"
                return 1
            await control.mark_finished(client, container)
        if progress is not None:
            step, examples, loss, steps = await _progress(client, container)
            rate = examples / max(time.monotonic() - t0, 1e-9)
            loss_text = "-" if loss is None else f"{loss:.4f}"
            progress(
                steps,
                total_steps,
                f"global step {step:,}, {rate:,.0f} examples/s, loss {loss_text}",
            )
    stopping.cancel()
    if any(r.name in result.failed for r in shards):
        result.stopped = "a shard failed"
        return 1
    result.stopped = "finished"
    return 0

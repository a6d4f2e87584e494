"""The role processes of ``qps train`` (:mod:`workers.launcher`): starting one with its
output streamed (``[worker1] ...``), stopping them all (SIGTERM, then SIGKILL), and
what the launcher reads of the job while they run (its progress; whether Redis still
answers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable

import qps
from qps import owners
from qps.aio import bounded
from qps.ps import control
from workers import job

__all__ = ["GRACE_SECONDS", "PING_SECONDS", "ProgressFn", "Role", "answers", "progress",
           "start", "stop_all"]  # fmt: skip

#: how long roles get to exit after SIGTERM before SIGKILL
GRACE_SECONDS = 10.0
#: how long a PING may take before Redis is taken for unreachable (:func:`answers`)
PING_SECONDS = 2.0


class Role:
    """A running role: its name (``ps0``, ``worker1``), process, command line and
    extra environment (to start it again), and the task streaming its output."""

    def __init__(
        self, name: str, proc: asyncio.subprocess.Process, args: list[str], env: dict[str, str]
    ) -> None:
        self.name = name
        self.proc = proc
        self.args = args
        self.env = env
        self.pump: asyncio.Task[None] | None = None


async def _pump(role: Role, emit: Callable[[str], None]) -> None:
    stream = role.proc.stdout
    assert stream is not None
    while line := await stream.readline():
        emit(f"[{role.name}] {line.decode(errors='replace').rstrip()}")


async def start(
    name: str, args: list[str], emit: Callable[[str], None], extra: dict[str, str] | None = None
) -> Role:
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
    role = Role(name, proc, args, dict(extra or {}))
    role.pump = asyncio.create_task(_pump(role, emit))
    return role


async def stop_all(roles: list[Role], grace: float = GRACE_SECONDS) -> None:
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


#: ``progress(worker steps done, their total or None, text)``: see :func:`workers.launcher.run_job`
ProgressFn = Callable[[int, "int | None", str], None]


async def progress(client: qps.Client, container: str) -> tuple[int, int, float | None, int]:
    """(global step, examples so far, chief's last loss, the workers' steps so far)
    from the job's status."""
    statuses = await job.read_statuses(client, container)
    workers = [s for n, s in statuses.items() if n.startswith("worker")]
    examples = sum(int(s.get("examples", 0)) for s in workers)
    steps = sum(int(s.get("step", 0)) for s in workers)
    loss = statuses.get("worker0", {}).get("loss")
    step = await control.global_step_counter(client, container).get() if statuses else 0
    return step, examples, loss, steps


async def answers(client: qps.Client) -> bool:
    """Whether Redis answers a PING within :data:`PING_SECONDS`."""
    ping = await bounded(client.ping(), PING_SECONDS)
    return not ping.cancelled() and ping.exception() is None

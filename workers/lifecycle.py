"""A ``qps train`` job across runs of its launcher: who runs it, where a rerun resumes
from, which checkpoints are kept, and what the chief last measured.

* **The launcher's lease** (:class:`LauncherLease`): a launcher owns its container
  through ``qps:{C}:job:launcher``, a JSON record (owner, host, pid, start time) set
  with ``SET NX PX`` and renewed every :data:`RENEW_SECONDS`. A second launcher for the
  same container is refused with the holder's host and pid, unless the holder is gone:
  a process of this host (and PID namespace) that no longer exists
  (:func:`qps.owners.owner_is_dead`) is taken over at once; one elsewhere once its
  lease has run out (:data:`LEASE_MS`) without renewal.
* **Resuming** (:func:`plan_resume`): a container that holds a PS job that was never
  marked finished (its launcher crashed, was killed, or was interrupted) is resumed
  from whichever is newer, the state Redis kept or the newest checkpoint of the job's
  directory; a finished one is refused, so that a rerun never silently adds a second
  run to it.
* **Retention** (:func:`prune_checkpoints`): the chief keeps the newest ``keep``
  checkpoints it wrote (``model-<step>`` of its container) and deletes the older ones,
  as TF's ``Saver(max_to_keep=...)``.
* **Stopping near a global step** (:func:`steps_before_check`): how many steps a
  worker with ``--until-global-step`` may run before it reads the global step again.
* **The chief's metric** (:func:`chief_metric`): the test metric the chief published
  last (its ``eval`` status), for the launcher's summary when it did not evaluate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qps import checkpoint, keys, owners
from qps.aio import bounded
from qps.containers import reset, scan_container_keys
from qps.errors import FailedPreconditionError, NotFoundError
from qps.lease import Lease
from qps.ps import control
from qps.stopping import Stopped, Stopper
from qps.transport import Client
from workers import job

__all__ = [
    "LEASE_MS",
    "RENEW_SECONDS",
    "LauncherLease",
    "ResumePlan",
    "chief_metric",
    "plan_resume",
    "prune_checkpoints",
    "resume",
    "steps_before_check",
]

log = logging.getLogger("qps.train")

#: how long a launcher's lease lasts without renewal
LEASE_MS = 15_000
#: how often a launcher renews it
RENEW_SECONDS = LEASE_MS / 3000.0

#: how long a launcher waits for Redis to delete its lease as it ends
RELEASE_SECONDS = 0.5
#: how long a launcher stopped while it restored a checkpoint waits to undo the restore
UNDO_SECONDS = 1.0

#: the names the chief gives its checkpoints (``<dir>/model-<step>``)
CHECKPOINT_NAME = re.compile(r"model-\d+")


def lease_key(container: str) -> str:
    """``qps:{C}:job:launcher``: the record of the launcher that runs the job."""
    return keys.container_prefix(keys.check_container(container)) + "job:launcher"


def _record(value: str) -> dict[str, Any]:
    """A launcher's lease record (its JSON); ``{"owner": value}`` if it is not one."""
    try:
        record = json.loads(value)
    except ValueError:
        return {"owner": value}
    return record if isinstance(record, dict) else {"owner": value}


def _owner_in_record(value: str) -> str:
    return str(_record(value).get("owner", ""))


def describe_holder(record: dict[str, Any], ttl_ms: int | None = None) -> str:
    """``qps train on host H, pid P, since 06:21:03 UTC`` for a lease record."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record.get("since", 0))))
    what = f"{record.get('command', 'qps train')} on host {record.get('host')}, "
    what += f"pid {record.get('pid')}, since {since}"
    if ttl_ms is not None and ttl_ms > 0:
        what += f"; its lease runs out {ttl_ms / 1000:.0f} s after its last renewal"
    return what


class LauncherLease:
    """The lease of one launcher on ``container`` (see the module docstring)."""

    def __init__(self, client: Client, container: str, command: str = "qps train") -> None:
        self.client = client
        self.container = container
        self.key = lease_key(container)
        owner = owners.default_owner()
        self.record = {
            "owner": owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": round(time.time(), 3),
            "command": command,
        }
        self.value = json.dumps(self.record, sort_keys=True)
        self._lease = Lease(client, self.key, self.value, LEASE_MS, owner_of=_owner_in_record)
        self._renewer: asyncio.Task[None] | None = None
        self.lost: str | None = None  # why the lease was lost while held

    async def acquire(self) -> str | None:
        """Take the lease: free, expired, ours, or held by a launcher of this host that
        is gone. Returns the record of the gone launcher it took over from (None: the
        lease was free).

        Raises:
            FailedPreconditionError: a live launcher (or one elsewhere whose lease has
                not run out) runs a job in the container; the message names it.
        """
        held = await self._lease.take()
        if held is None:
            return None
        if self._lease.dead(held):
            gone, held = held.value, await self._lease.take(replace=held.value)
            if held is None:
                log.info("took over the lease of a gone launcher: %s", gone)
                return gone
        theirs = _record(held.value)
        here = theirs.get("host") == socket.gethostname()  # and alive: no lease to wait out
        holder = describe_holder(theirs, None if here else LEASE_MS)
        raise FailedPreconditionError(
            f"container '{self.container}' is in use by a running job: {holder}. Stop it "
            f"first (Ctrl-C, or `qps job stop --container {self.container}`), or choose "
            "another --container"
        )

    async def reassert(self) -> None:
        """Set the lease again if it is gone (the container was reset: a checkpoint
        restored over it) or still ours.

        Raises:
            FailedPreconditionError: another launcher took it meanwhile.
        """
        held = await self._lease.take()
        if held is not None:
            raise FailedPreconditionError(
                f"container '{self.container}': another launcher took it over: {held.value}"
            )

    def start_renewing(self) -> None:
        """Renew the lease every :data:`RENEW_SECONDS` until :meth:`release`."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(RENEW_SECONDS)
                try:
                    if await self._lease.renew() is None:
                        continue
                    await self.reassert()  # gone (a reset): set it again
                except FailedPreconditionError as exc:
                    self.lost = str(exc)
                    log.warning("%s", exc)
                    return
                except Exception as exc:  # Redis away for a moment: try again
                    log.warning("could not renew the launcher's lease: %s", exc)

        self._renewer = asyncio.ensure_future(renew())

    async def __aenter__(self) -> LauncherLease:
        await self.acquire()
        self.start_renewing()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    async def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours, waiting at most
        :data:`RELEASE_SECONDS` for Redis (gone or hung, the lease runs out instead)."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        await _bounded(self._lease.release(), RELEASE_SECONDS)


@dataclass
class ResumePlan:
    """Where a launcher's job starts from."""

    source: str  # "fresh", "redis" or "checkpoint"
    line: str = ""  # what to print ("" for a fresh job without a checkpoint)
    global_step: int = 0
    checkpoint: Path | None = None  # the checkpoint to restore ("checkpoint")
    overwrite: bool = False  # restore over the container's state (reset it first)


def _newest(directory: str | None) -> checkpoint.CheckpointInfo | None:
    if not directory or not os.path.isdir(directory):
        return None
    found = checkpoint.list_checkpoints(directory)
    return found[-1] if found else None


async def _holds_only_the_lease(client: Client, container: str) -> bool:
    mine = lease_key(container).encode()
    async for key in scan_container_keys(client, container):
        if key != mine:
            return False
    return True


async def plan_resume(client: Client, container: str, checkpoint_dir: str | None) -> ResumePlan:
    """Where the job of ``container`` starts: fresh; from the state Redis holds (a PS
    job there that was never marked finished) when it is at least as new as the newest
    checkpoint of ``checkpoint_dir``; else from that checkpoint.

    Raises:
        FailedPreconditionError: the container holds a job that finished.
    """
    newest = _newest(checkpoint_dir)
    if await control.read_config(client, container) is None:  # no job here yet
        if newest is None:
            return ResumePlan("fresh")
        return ResumePlan(
            "checkpoint",
            f"qps train: resuming container {container} from checkpoint {newest.path} "
            f"(global step {newest.global_step:,})",
            newest.global_step,
            newest.path,
            # the launcher's own lease is no job: restore over it (it is set again);
            # anything else (an input queue, say) makes the restore refuse
            overwrite=await _holds_only_the_lease(client, container),
        )
    step = 0
    with contextlib.suppress(NotFoundError):
        step = await control.global_step_counter(client, container).get()
    if await control.is_finished(client, container):
        raise FailedPreconditionError(
            f"container '{container}' holds a job that finished (global step {step:,}): "
            "qps train does not add a run to it. Choose another --container, or reset it "
            f"(`qps container reset {container}`) to start over"
            + (f" from the newest checkpoint of {checkpoint_dir}" if newest else "")
        )
    if newest is not None and newest.global_step > step:
        return ResumePlan(
            "checkpoint",
            f"qps train: resuming container {container} from checkpoint {newest.path} "
            f"(global step {newest.global_step:,}; Redis held global step {step:,})",
            newest.global_step,
            newest.path,
            overwrite=True,
        )
    if newest is not None:
        older = "is older" if newest.global_step < step else "is no newer"
        why = f"; newest checkpoint {newest.path} {older}"
    elif checkpoint_dir:
        why = f"; no checkpoint in {checkpoint_dir}"
    else:
        why = ""
    await job.clear_done(client, container)  # its workers run again
    return ResumePlan(
        "redis",
        f"qps train: resuming container {container} from Redis (global step {step:,}{why})",
        step,
    )


async def resume(
    lease: LauncherLease,
    checkpoint_dir: str | None,
    emit: Callable[[str], None],
    stopper: Stopper | None = None,
) -> ResumePlan:
    """Before any role of the launcher holding ``lease`` starts: plan where its job
    starts (:func:`plan_resume`), print it, and restore the checkpoint it names (over
    the container's state if need be; the lease is then set again).

    A stop request of ``stopper`` cuts the planning and the restore short; a restore
    cut short is undone (the container reset, within :data:`UNDO_SECONDS`), so that the
    rerun restores the checkpoint again rather than find a container it must refuse.

    Raises:
        FailedPreconditionError: the container holds a job that finished, or another
            launcher took the container over while the checkpoint was restored.
        Stopped: the stop request came first.
    """
    stopper = stopper or Stopper()
    async with stopper.interruptible("planning where the job resumes"):
        plan = await plan_resume(lease.client, lease.container, checkpoint_dir)
    if plan.line:
        emit(plan.line)
    if plan.checkpoint is not None:
        try:
            async with stopper.interruptible(f"restoring checkpoint {plan.checkpoint}"):
                await checkpoint.restore(
                    lease.client,
                    plan.checkpoint,
                    container=lease.container,
                    overwrite=plan.overwrite,
                )
        except Stopped:
            emit(f"qps train: stopped while restoring {plan.checkpoint}: undoing it")
            await _bounded(reset(lease.client, [lease.container]), UNDO_SECONDS, "undo the restore")
            raise
        await lease.reassert()  # a restore over the container reset it
    return plan


async def _bounded(aw: Awaitable[Any], seconds: float, what: str = "") -> None:
    """Run ``aw`` for at most ``seconds``; its failure is logged (a warning that it
    could not ``what``; at DEBUG without), not raised."""
    run = await bounded(aw, seconds)
    got = None if run.cancelled() else run.exception()
    if isinstance(got, Exception):
        if what:
            log.warning("could not %s: %s", what, got)
        else:
            log.debug("ignored: %r", got)


def prune_checkpoints(
    directory: str | os.PathLike[str], container: str, keep: int, newest: Path | None = None
) -> list[Path]:
    """Delete the checkpoints the chief of ``container`` wrote in ``directory``
    (``model-<step>`` directories whose manifest names ``container``) beyond the newest
    ``keep`` (0: keep all); never ``newest`` (the one just written) nor one being
    written (a hidden temporary directory, never listed). Each goes in two steps: a
    rename to a hidden name (atomic: a reader lists it whole or not at all), then its
    removal. Returns the paths deleted, oldest first."""
    if keep <= 0 or not os.path.isdir(directory):
        return []
    base = Path(directory).resolve()
    mine = [
        info
        for info in checkpoint.list_checkpoints(base)
        if info.container == container
        and CHECKPOINT_NAME.fullmatch(info.path.name)
        and info.path.parent == base
    ]
    keep_too = None if newest is None else Path(newest).resolve()
    deleted = []
    for info in mine[: max(0, len(mine) - keep)]:
        if info.path.resolve() == keep_too:
            continue
        hidden = base / f".{info.path.name}.del-{secrets.token_hex(4)}"
        try:
            os.rename(info.path, hidden)
        except OSError as exc:  # gone already (another pruner), or not ours to move
            log.warning("could not delete old checkpoint %s: %s", info.path, exc)
            continue
        shutil.rmtree(hidden, ignore_errors=True)
        deleted.append(info.path)
    return deleted


def steps_before_check(left: int, num_workers: int, log_every: int) -> int:
    """With ``--until-global-step``: how many steps a worker runs before it reads the
    global step again, ``left`` steps short of the target with ``num_workers`` workers
    sharing them: a fair share of what is left, at most ``log_every``, at least one (so
    near the target it reads it every step)."""
    return max(1, min(log_every, left // max(1, num_workers)))


async def chief_metric(
    client: Client, container: str, since: float = 0.0
) -> tuple[str, float] | None:
    """The test metric the chief published last (its ``eval`` status: ``{metric:
    value}``) at or after ``since`` (``time.time()``), or None."""
    record = (await job.read_statuses(client, container)).get("eval")
    if not record or float(record.get("time", 0)) < since:
        return None
    for name, value in record.items():
        if name != "time" and isinstance(value, (int, float)):
            return str(name), float(value)
    return None

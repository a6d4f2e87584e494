"""What the roles of a training job agree on beyond the PS (see :mod:`qps.ps.control`):
the model-ready mark, each worker's published status, who has finished, and the step
table of bounded-staleness training. All of it lives in the job's container, under
``qps:{<container>}:job:...`` (one hash tag: one Redis Cluster slot), so ``qps
container reset`` removes it with the rest of the job.

Waiting never polls: a waiter blocks in ``BLPOP`` on a wake list of its own that the
event it waits for pushes to; the block is bounded (:data:`WAKE_SECONDS`) only so that a
waiter re-checks its condition if a wake-up was lost (a waiter that started blocking
after the push: the condition is always checked before blocking). The wait for a stop
request (:func:`wait_stop_request`) is not bounded: its waiters register their wake
lists before they check, and :func:`request_stop` pushes to every registered one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from qps import keys
from qps.errors import DeadlineExceededError, FailedPreconditionError
from qps.registry import text_of
from qps.transport import Client

__all__ = [
    "WAKE_SECONDS",
    "claim_index",
    "clear_done",
    "finish_worker",
    "finished_workers",
    "is_ready",
    "mark_ready",
    "publish_status",
    "read_statuses",
    "request_stop",
    "ssp_advance",
    "ssp_min_step",
    "ssp_wait",
    "stop_requested",
    "wait_ready",
    "wait_status_change",
    "wait_stop_request",
    "wait_workers_done",
    "worker_names",
]

#: the longest a waiter blocks before it checks its condition again
WAKE_SECONDS = 1.0


def _key(container: str, what: str) -> str:
    return keys.container_prefix(keys.check_container(container)) + "job:" + what


async def _block(client: Client, wake: str, deadline: float | None) -> bool:
    """Wait for a token on list ``wake``, at most WAKE_SECONDS and not past ``deadline``
    (``time.monotonic()``); False, without waiting, once the deadline has passed."""
    block = WAKE_SECONDS
    if deadline is not None:
        block = min(block, deadline - time.monotonic())
        if block <= 0:
            return False
    await client.blpop([wake], max(0.01, round(block, 3)))
    return True


# -- the model is ready ---------------------------------------------------------------


async def mark_ready(
    client: Client, container: str, num_workers: int, info: Mapping[str, Any]
) -> None:
    """The chief has initialised (or restored) every variable: record it with ``info``
    (JSON: e.g. the model spec and where the values came from) and wake the other
    workers (one token each on their wake lists)."""
    ready = _key(container, "ready")
    record = {"num_workers": num_workers, **info}
    batch = client.batch(transaction=True).set(ready, json.dumps(record, sort_keys=True))
    for k in range(num_workers):
        batch.wake(_key(container, f"ready:wake:{k}"))
    await batch.run()


async def is_ready(client: Client, container: str) -> dict[str, Any] | None:
    """The chief's ready record, or None while the model is not ready."""
    raw = await client.get(_key(container, "ready"))
    return None if raw is None else dict(json.loads(raw))


async def wait_ready(
    client: Client, container: str, index: int, timeout: float | None = None
) -> dict[str, Any]:
    """Block until the chief marked the model ready; return its record.

    Raises:
        DeadlineExceededError: ``timeout`` seconds passed first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    wake = _key(container, f"ready:wake:{index}")
    while (info := await is_ready(client, container)) is None:
        if not await _block(client, wake, deadline):
            raise DeadlineExceededError(
                f"the chief did not mark the model of container '{container}' ready "
                f"within {timeout} s"
            )
    return info


# -- worker indexes ---------------------------------------------------------------------


async def claim_index(client: Client, container: str, who: str, num_workers: int) -> int:
    """A worker index in ``1 .. num_workers - 1`` for a worker started without one
    (``qps worker --index auto``: replicas of one compose service). ``who`` names the
    claimant (``<host>:<pid>``, see :func:`workers.worker.claimant`): the same name gets
    the same index again, so a restarted replica resumes its place. Index 0, the chief,
    is never handed out.

    Raises:
        FailedPreconditionError: every index is taken.
    """
    table, counter = _key(container, "indexes"), _key(container, "next-index")
    got = await client.hget(table, who)
    if got is None:
        candidate = await client.incr(counter)
        if candidate < num_workers:
            await client.hsetnx(table, who, candidate)
        got = await client.hget(table, who)
    if got is None:
        raise FailedPreconditionError(
            f"every worker index of container '{container}' is taken ({num_workers} workers: "
            "raise --num-workers, or reset the container)"
        )
    return int(got)


# -- worker status ----------------------------------------------------------------------


async def publish_status(
    client: Client, container: str, worker: str, status: Mapping[str, Any]
) -> None:
    """Publish ``worker``'s status (JSON; ``time`` is added) for ``qps job status``/``top``."""
    record = {**status, "time": time.time()}
    batch = client.batch().hset(_key(container, "workers"), {worker: json.dumps(record)})
    await batch.wake(_key(container, "status:wake")).run()  # a `qps job wait` re-reads it


async def wait_status_change(client: Client, container: str, deadline: float | None) -> bool:
    """Block until a worker publishes a status (or WAKE_SECONDS pass: the caller checks
    what it waits for again either way); False, without waiting, past ``deadline``."""
    return await _block(client, _key(container, "status:wake"), deadline)


async def read_statuses(client: Client, container: str) -> dict[str, dict[str, Any]]:
    """Every worker's last published status, by worker name."""
    raw = await client.hgetall(_key(container, "workers"))
    return {text_of(k): json.loads(v) for k, v in raw.items()}


async def finish_worker(client: Client, container: str, worker: str) -> int:
    """Record that ``worker`` is done; return how many workers are done (each counted
    once, whatever its restarts). Wakes a :func:`wait_workers_done` waiter."""
    done = _key(container, "done")
    wake = _key(container, "done:wake")
    n = (await client.batch(transaction=True).sadd(done, worker).scard(done).wake(wake).run())[1]
    return int(n)


async def finished_workers(client: Client, container: str) -> set[str]:
    """The workers that have recorded they are done."""
    got = await client.smembers(_key(container, "done"))
    return {text_of(m) for m in got}


async def clear_done(client: Client, container: str) -> None:
    """Forget which workers finished: a job resumed by a new launcher runs them all
    again (an earlier run stopped by Ctrl-C had recorded them done)."""
    await client.delete(_key(container, "done"))


def worker_names(statuses: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The workers among published statuses (those with a ``state``: the chief's
    ``eval`` record is not one), in index order (``worker2`` before ``worker10``)."""

    def order(name: str) -> tuple[str, int, str]:
        stem = name.rstrip("0123456789")
        digits = name[len(stem) :]
        return (stem, int(digits) if digits else -1, name)

    return sorted((n for n, s in statuses.items() if "state" in s), key=order)


async def wait_workers_done(
    client: Client, container: str, timeout: float | None = None
) -> list[str]:
    """Block until every worker that has published a status is done (its status says
    ``done``, or it is in the done set); return their names. Blocks in ``BLPOP`` on the
    wake list :func:`finish_worker` pushes to.

    Raises:
        DeadlineExceededError: ``timeout`` seconds passed first (the message names the
            workers not done).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    wake = _key(container, "done:wake")
    while True:
        statuses = await read_statuses(client, container)
        finished = await finished_workers(client, container)
        names = worker_names(statuses)
        running = [n for n in names if n not in finished and statuses[n].get("state") != "done"]
        if not running:
            return names
        if not await _block(client, wake, deadline):
            raise DeadlineExceededError(
                f"worker(s) {', '.join(running)} of container '{container}' not done "
                f"within {timeout} s"
            )


# -- stopping the job -------------------------------------------------------------------


async def request_stop(
    client: Client, container: str, reason: str = "qps job stop"
) -> dict[str, Any]:
    """Ask every worker of the job to stop after the step in hand (``qps job stop``):
    record the request (JSON: ``reason``, ``time``), wake the workers waiting for one
    (:func:`wait_stop_request`) and return it. The first request is kept; the mark
    lasts until the container is reset, so a restarted worker stops at once too.
    Marking the PS job finished as well (:func:`qps.ps.control.mark_finished`) makes
    a push that is under way fail, which ends its worker sooner."""
    record = {"reason": reason, "time": time.time()}
    key = _key(container, "stop")
    # in order, not in a transaction (redis-py's cluster pipelines fail on one): a
    # waiter registered after the SMEMBERS looks for the mark after it, and finds it
    batch = client.batch().set(key, json.dumps(record), nx=True).get(key)
    _, raw, wakes = await batch.smembers(_key(container, "stop:waiters")).run()
    batch = client.batch()  # each registered before it looked for the mark: none is missed
    for wake in sorted(wakes):
        batch.wake(wake)
    await batch.run()
    return dict(json.loads(raw))


async def stop_requested(client: Client, container: str) -> dict[str, Any] | None:
    """The stop request of the job (see :func:`request_stop`), or None."""
    raw = await client.get(_key(container, "stop"))
    return None if raw is None else dict(json.loads(raw))


async def wait_stop_request(client: Client, container: str, worker: str) -> dict[str, Any]:
    """Block until the job's stop is requested (:func:`request_stop`); return the
    request. ``worker`` blocks in ``BLPOP`` on a wake list of its own, with no time
    limit: it registers the list in the job's set of stop waiters before it looks for
    the request, and :func:`request_stop` pushes to every registered list after it
    records one, so a request is never missed."""
    wake = _key(container, f"stop:wake:{worker}")
    await client.sadd(_key(container, "stop:waiters"), wake)
    while (got := await stop_requested(client, container)) is None:
        await client.blpop([wake], 0)
    return got


# -- bounded staleness (SSP) ------------------------------------------------------------------


async def ssp_advance(
    client: Client, container: str, worker: str, step: int, workers: list[str]
) -> None:
    """Record that ``worker`` has completed ``step`` steps, and wake the other workers
    (``workers``: every worker's name) so that one waiting on the slowest re-checks."""
    table = _key(container, "ssp")
    batch = client.batch(transaction=True).zadd(table, {worker: step})
    for other in workers:
        if other != worker:
            batch.wake(_key(container, f"ssp:wake:{other}"))
    await batch.run()


async def ssp_min_step(client: Client, container: str, workers: list[str]) -> int:
    """The smallest step recorded by any of ``workers`` (0 for one with no record)."""
    scores = await client.zmscore(_key(container, "ssp"), workers)
    return int(min((s or 0) for s in scores)) if scores else 0


async def ssp_wait(
    client: Client,
    container: str,
    worker: str,
    step: int,
    max_staleness: int,
    workers: list[str],
    done: set[str] | None = None,
) -> int:
    """Block while ``worker``, about to run ``step``, is more than ``max_staleness``
    steps ahead of the slowest worker still running (SSP: a worker at most k steps ahead
    of the slowest). Workers in ``done`` (refreshed from the job's record while
    waiting) no longer hold anyone back. Returns how long it waited, in ms."""
    start = time.monotonic()
    wake = _key(container, f"ssp:wake:{worker}")
    while True:
        finished = await finished_workers(client, container)
        if done is not None:
            finished |= done
        others = [w for w in workers if w not in finished and w != worker]
        if not others or step - await ssp_min_step(client, container, others) <= max_staleness:
            return int((time.monotonic() - start) * 1000)
        await _block(client, wake, None)

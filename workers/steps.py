"""How a worker's step exchanges with the parameter servers: one strategy per kind of job.

Every step takes its parameters (:meth:`Steps.params`), computes the loss and the
gradients, and pushes them (:meth:`Steps.step`); the strategies differ in how the push
and the next step's parameters travel:

* :class:`SyncSteps` — synchronous training: push for the update the worker is on, then
  block for its token (the global step after that update); the wait and, for a dense
  model, the next pull ride in the push's round trip.
* :class:`SparseSteps` — a model with embedding tables: the next batch decides which
  rows to pull, so each step pulls after the batch is known.
* :class:`InlineSteps` — a small dense model computed on the event loop's thread: the
  push and the next pull travel together (in one round trip where the variables allow).
* :class:`OverlapSteps` — a model computed on a thread: the next pull runs while the
  step computes.

:func:`steps_for` picks the strategy of a worker and its job once, before the first step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from qps.errors import DeadlineExceededError
from qps.ps import control
from qps.variables import ReadPlan, VariableValue
from workers import job
from workers.models import Rows

if TYPE_CHECKING:
    from workers.worker import Worker

__all__ = [
    "InlineSteps",
    "OverlapSteps",
    "SparseSteps",
    "Steps",
    "SyncSteps",
    "steps_for",
]

#: a step's parameters and their versions
Pulled = tuple[dict[str, Any], dict[str, int]]
Batch = tuple[np.ndarray, ...]


def _split(got: Mapping[str, VariableValue]) -> Pulled:
    """A pull's name -> (value, version) as a step's parameters and their versions."""
    return {n: v.value for n, v in got.items()}, {n: v.version for n, v in got.items()}


class Steps:
    """What every strategy shares: the pull (when no parameters came with the step
    before), the push, and the parameters that rode in another call's round trip.

    ``next`` holds the parameters of the next step when they came with this one."""

    def __init__(self, w: Worker) -> None:
        self.w = w
        self.next: Pulled | None = None

    async def params(self, batch: Batch) -> Pulled:
        """The parameters (and versions) of the step on ``batch``."""
        if self.next is None:
            self.next = await self.pull(batch)
        return self.next

    async def step(
        self, step: int, params: dict[str, Any], versions: dict[str, int], batch: Batch
    ) -> tuple[float, str]:
        """Compute and push step ``step``; returns its loss and why to stop after it
        ("" to go on)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Cancel what still runs for a next step."""

    async def pull(self, batch: Batch) -> Pulled:
        w = self.w
        started = time.perf_counter()
        params: dict[str, Any] = {}
        versions: dict[str, int] = {}
        if w.dense:
            params, versions = _split(await w.sess.pull(w.dense))
        if w.sparse:
            needed = w.model.rows_needed(batch)
            rows = await asyncio.gather(*(w.sess.pull_rows(t, needed[t]) for t in w.sparse))
            for t, val in zip(w.sparse, rows):
                params[t] = Rows(needed[t], val.value)
                versions[t] = val.version
        w.metrics.pulled(started, params.values())
        return params, versions

    async def push(self, grads: Mapping[str, Any], step: int, versions: dict[str, int]) -> None:
        started = time.perf_counter()
        await self.w.sess.push(grads, step=step, versions=versions)
        self.w.metrics.pushed(started, grads)

    def rode(self, plan: ReadPlan, replies: list[Any]) -> Pulled | None:
        """The parameters read by ``plan`` in another call's round trip (a push's, a
        token's), counted as a pull of no time of its own; None if they cannot be
        used (the step pulls them itself)."""
        got = self.w.sess.ps.pulled(plan, replies)
        if got is None:
            return None
        pulled = _split(got)
        self.w.metrics.pulled(time.perf_counter(), pulled[0].values())
        return pulled


class SparseSteps(Steps):
    """Embedding tables: the rows a step needs are known once its batch is, so every
    step pulls for itself, after the push of the one before."""

    async def step(
        self, step: int, params: dict[str, Any], versions: dict[str, int], batch: Batch
    ) -> tuple[float, str]:
        loss, grads = await self.w._compute(params, batch)
        await self.push(grads, step, versions)
        self.next = None
        return loss, ""


class InlineSteps(Steps):
    """A small dense model computed on the event loop's thread: the push and the next
    step's pull travel together, in one round trip with a ``plan``."""

    def __init__(self, w: Worker, plan: ReadPlan | None) -> None:
        super().__init__(w)
        self.plan = plan

    async def step(
        self, step: int, params: dict[str, Any], versions: dict[str, int], batch: Batch
    ) -> tuple[float, str]:
        loss, grads = await self.w._compute(params, batch)
        if self.plan is not None:  # in one round trip: the pull rides with the push
            self.next = await self._push_then_pull(grads, step, versions, self.plan)
        else:
            push = self.push(grads, step, versions)
            _, self.next = await asyncio.gather(push, self.pull(batch))
        return loss, ""

    async def _push_then_pull(
        self, grads: Mapping[str, Any], step: int, versions: dict[str, int], plan: ReadPlan
    ) -> Pulled | None:
        """Push, with the next step's parameters read by ``plan`` right after it, in the
        same round trip; None if that read cannot be used (the step pulls them itself)."""
        started = time.perf_counter()
        _, replies = await self.w.sess.ps.push_then(
            grads, plan.commands, step=step, versions=versions
        )
        self.w.metrics.pushed(started, grads)
        return self.rode(plan, replies)  # [] (they did not run) gives None


class OverlapSteps(Steps):
    """A model computed on a thread: the next step's pull runs while this one computes."""

    async def step(
        self, step: int, params: dict[str, Any], versions: dict[str, int], batch: Batch
    ) -> tuple[float, str]:
        ahead = asyncio.ensure_future(self.pull(batch))
        try:
            loss, grads = await self.w._compute(params, batch)
            await self.push(grads, step, versions)
        except BaseException:
            ahead.cancel()
            raise
        self.next = await ahead
        return loss, ""


class SyncSteps(Steps):
    """Synchronous training: push for update ``local_step``, then block for this
    worker's next token (the global step after the update its gradient went to, or a
    later one if it was dropped as stale), which the next step is for. Tokens that
    piled up after it (updates made without us) are taken while the next batch comes;
    the worker goes on from the newest, with parameters read after it."""

    def __init__(
        self,
        w: Worker,
        tokens: control.Tokens,
        replicas: int,
        plan: ReadPlan | None,
        local_step: int,
    ) -> None:
        super().__init__(w)
        self.tokens, self.replicas, self.plan = tokens, replicas, plan
        self.local_step = local_step  # the update our gradients are for
        self.newer: asyncio.Future[int] | None = None  # the newest token waiting, sought

    async def params(self, batch: Batch) -> Pulled:
        if self.newer is not None:  # tokens that piled up, sought meanwhile
            if self.next is None:
                self.next, latest = await asyncio.gather(self.pull(batch), self.newer)
            else:
                latest = await self.newer
            self.newer = None
            if latest > self.local_step:  # our gradient was stale: go on from the newest
                self.local_step = latest  # update, with parameters read after it
                self.next = await self.pull(batch)
        return await super().params(batch)

    async def step(
        self, step: int, params: dict[str, Any], versions: dict[str, int], batch: Batch
    ) -> tuple[float, str]:
        loss, grads = await self.w._compute(params, batch)
        async with self.w.stopper.interruptible("waiting for a synchronous update"):
            got = None
            if self.plan is not None:  # the token wait and the pull ride with the push
                got = await self._push_then_token(grads, versions, self.plan)
            else:
                await self.push(grads, self.local_step, versions)
            token, more, self.next = got or await self._token()
        if token is None:
            return loss, "too few workers left to make an update"
        self.local_step = token
        if more != 0:  # tokens wait after it (or their count is unknown)
            self.newer = asyncio.ensure_future(self._newest_token(token))
        return loss, ""

    async def close(self) -> None:
        if self.newer is not None:
            self.newer.cancel()
            await asyncio.gather(self.newer, return_exceptions=True)

    async def _push_then_token(
        self, grads: Mapping[str, Any], versions: dict[str, int], plan: ReadPlan
    ) -> tuple[int, int | None, Pulled | None] | None:
        """Push, then, in the same round trip, block for the next token and read the
        token queue's size and the parameters (``plan``) the moment it is taken (see
        :meth:`_token`). None when no token came with it (the wait ran out, or did not
        run): wait with :meth:`_token` then."""
        tokens = self.tokens
        started = time.perf_counter()
        size = tokens.size_commands()
        wait = tokens.wait_command(job.WAKE_SECONDS)
        _, replies = await self.w.sess.ps.push_then(
            grads,
            [wait, *size, *plan.commands],
            step=self.local_step,
            versions=versions,
            blocking=True,
        )
        self.w.metrics.pushed(started, grads)
        token = tokens.taken(replies[:1])
        if token is None:
            return None
        more = tokens.size_of(replies[1 : 1 + len(size)])
        return token, more, self.rode(plan, replies[1 + len(size) :])

    async def _token(self) -> tuple[int | None, int | None, Pulled | None]:
        """Block for this worker's next token. None when it cannot come: fewer than
        ``replicas`` workers are still running (the others are done), or the job is
        finished.

        With the token come, in the same round trip (:meth:`control.Tokens.take_then`),
        the number of tokens still waiting (None if unknown) and the parameters read
        the moment it was taken (the update it names is committed by then) by the
        plan, or None without one (sparse models, large variables, a cluster) or when
        they cannot be used: the step pulls them itself."""
        cfg, client, tokens, plan = self.w.cfg, self.w.sess.client, self.tokens, self.plan
        size = tokens.size_commands()
        then = [*size, *(plan.commands if plan is not None else ())]
        while True:
            try:
                value, replies = await tokens.take_then(then, job.WAKE_SECONDS)
            except DeadlineExceededError:
                done = await job.finished_workers(client, cfg.container)
                if cfg.num_workers - len(done - {cfg.name}) < self.replicas:
                    return None, None, None
                if await control.is_finished(client, cfg.container):
                    return None, None, None
                continue
            if not replies:
                return int(value), None, None
            more = tokens.size_of(replies[: len(size)])
            pulled = None if plan is None else self.rode(plan, replies[len(size) :])
            return int(value), more, pulled

    async def _newest_token(self, got: int) -> int:
        """Tokens of updates made without us (our gradient was stale, or we were slow)
        that wait after token ``got``: take them all; return the newest token."""
        return max([got, *await self.tokens.take_all()])


async def steps_for(w: Worker, ps_cfg: control.PSConfig | None, global_step: int) -> Steps:
    """The strategy of worker ``w`` in a job whose PS configuration is ``ps_cfg``, at
    global step ``global_step``. The dense pull is sent with each token wait
    (synchronous) or push (asynchronous, a model computed inline) where the variables
    can be read that way; else it goes in a round trip of its own."""
    sess, cfg = w.sess, w.cfg
    sync = None if ps_cfg is None else ps_cfg.sync
    plan = (
        await sess.ps.pull_plan(w.dense)
        if w.dense and not w.sparse and (sync is not None or w.inline)
        else None
    )
    if sync is not None:
        tokens = control.tokens(sess.client, cfg.container, cfg.index)
        return SyncSteps(w, tokens, sync[0], plan, global_step)
    if w.sparse:
        return SparseSteps(w)
    if w.inline:
        return InlineSteps(w, plan)
    return OverlapSteps(w)

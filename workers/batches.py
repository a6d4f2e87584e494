"""Where a worker's batches come from (:class:`Input`): local minibatches of a data set
the worker holds, or a shared input queue (``--data queue:NAME``) filled by ``qps feed``,
taken with acknowledged dequeues so that a batch of a worker that dies goes back to the
queue for another worker."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import numpy as np

import qps
from qps.errors import AbortedError, OutOfRangeError, QpsError
from qps.queues.base import Delivery
from qps.queues.waiters import LEASE_MS
from qps.stopping import Stopper
from workers.data import BUILTIN, builtin_split, load_xy, minibatches, take
from workers.models import Model

if TYPE_CHECKING:
    from workers.workerconfig import WorkerConfig

__all__ = ["Input"]

log = logging.getLogger("qps.worker")


class Input:
    """Batches for one worker: local minibatches, or a shared input queue."""

    def __init__(self, cfg: WorkerConfig, sess: qps.Session, model: Model) -> None:
        self.cfg = cfg
        self.sess = sess
        self.model = model
        self.test: tuple[np.ndarray, ...] | None = None
        self.queue: Any = None
        self._local: Any = None
        #: batches taken from the queue (acknowledged dequeues) and not acked yet, oldest
        #: first: the one being trained on, and the one fetched ahead
        self._held: collections.deque[Delivery] = collections.deque()

    async def open(self) -> None:
        data = self.cfg.data
        if data.startswith("queue:"):
            self.queue = await self.sess.queue(data[len("queue:") :])
            return
        if data in BUILTIN:
            train, self.test = await asyncio.to_thread(builtin_split, data, self.model)
        else:
            train = load_xy(data)
        rng = np.random.default_rng(self.cfg.seed + self.cfg.index)
        order = minibatches(len(train[-1]), self.cfg.batch_size, rng)
        self._local = (train, order)

    async def next(self) -> tuple[np.ndarray, ...] | None:
        """The next batch, or None at the end of the input."""
        if self._local is not None:
            train, order = self._local
            return take(train, next(order))
        try:
            d = await self.queue.dequeue_up_to_acked(self.cfg.batch_size)
        except OutOfRangeError:
            return None
        self._held.append(d)
        got = d.value
        return tuple(got) if isinstance(got, (list, tuple)) else (got,)

    async def used(self) -> None:
        """The oldest batch handed out was trained on (its gradients pushed): ack it, so
        its examples leave the queue for good. A batch of a worker that dies first goes
        back to the queue when its lease runs out, for another worker."""
        if not self._held:
            return
        d = self._held.popleft()
        try:
            await self.queue.ack(d)
        except AbortedError as exc:  # stalled past the lease: another worker got them too
            log.warning("%s: %s", self.cfg.name, exc)

    async def give_back(self) -> None:
        """Put back, at the front of the queue, the batches handed out and not trained on
        (the one fetched ahead when the worker stops)."""
        while self._held:
            d = self._held.pop()  # newest first: the oldest ends up in front
            with contextlib.suppress(QpsError):
                await self.queue.nack(d)

    async def keep_alive(self) -> None:
        """Renew the leases of the batches held, while a step (or a wait for a token or
        for slower workers) takes longer than a lease."""
        while True:
            await asyncio.sleep(LEASE_MS / 3000.0)
            for d in list(self._held):
                try:
                    await self.queue.touch(d)
                except AbortedError as exc:
                    log.warning("%s: %s", self.cfg.name, exc)
                except QpsError as exc:
                    log.warning("%s: could not renew a batch's lease: %s", self.cfg.name, exc)

    async def batches(self, stopper: Stopper) -> AsyncGenerator[tuple[np.ndarray, ...], None]:
        """Batches with the next one fetched while the current one is used (local
        minibatches are cut when needed: nothing to wait for, no task per step). A
        stop request cuts the wait for a queue's batch short (:class:`Stopped`)."""
        if self.queue is None:
            while (batch := await self.next()) is not None:
                yield batch
            return
        ahead = asyncio.ensure_future(self.next())
        try:
            while True:
                async with stopper.interruptible("waiting for a batch of the input queue"):
                    batch = await ahead
                if batch is None:
                    return
                ahead = asyncio.ensure_future(self.next())
                yield batch
        finally:
            if not ahead.done():
                ahead.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await ahead

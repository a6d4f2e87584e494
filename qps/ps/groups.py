"""A PS shard's read-ahead and group bookkeeping (qps.ps.shard): the deliveries taken
ahead of the apply (:class:`_Item` in an :class:`_Inbox`, the memory stream between the
readers and the applier), a variable the shard owns (:class:`_Owned`), a message it must
not apply (:class:`_Rejected`), what a group of messages must commit per variable
(:class:`_Group`, :class:`_Pending`), a synchronous update's accumulated gradients
(:class:`_Accum`), and helpers over deliveries. Nothing here talks to Redis."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from qps.aio import wait_event
from qps.ps.messages import GradientMessage, SparseGradient
from qps.queues.base import Delivery
from qps.variables import Variable


@dataclass
class _Item:
    """A delivery taken ahead of the apply, decoded (``msg``) or not (``error``)."""

    delivery: Delivery | None  # None: a message applied without one (tests)
    msg: GradientMessage | None = None
    error: str = ""
    nbytes: int = 0
    oversize: bool = False  # over the job's max_message_bytes (error says so)
    shared: bool = False  # its delivery holds other messages too (settled with them)
    raw: Any = None  # the message as delivered (a dead letter keeps its bytes)
    about: GradientMessage | None = None  # an oversize message's provenance, if it decodes


class _Inbox:
    """Deliveries read ahead of the apply, in order, bounded by count and bytes: a
    memory stream between the readers (the producers: :meth:`put`, :meth:`finish`,
    :meth:`fail`) and the applier (the consumer: :meth:`take`, :meth:`drain`).

    Each side waits for the other with :meth:`until`. A change sets the current change
    event and replaces it with a fresh one (only if a waiter picked it up: most changes
    find no one waiting and cost nothing); a waiter checks its condition and picks up
    the current event with no await in between, so a change after the check sets the
    very event it waits on: no wake-up is lost, and none is left set for a waiter that
    comes later (the bug of one shared event that each waiter cleared).
    (An ``asyncio.Condition`` would need its lock held to notify: the producers here
    are plain calls, not coroutines.)"""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.items: deque[_Item] = deque()
        self.nbytes = 0
        self.done = False  # the queue is closed and drained (and the list, if read)
        self.sources = 1  # readers that have not finished
        #: the loop is ending: the reader stops taking (a take under way when it was
        #: cancelled may still complete: its messages are put here, then given back)
        self.closing = False
        self.error: BaseException | None = None
        self._max_items, self._max_bytes = max_items, max_bytes
        self._change = asyncio.Event()
        self._watched = False  # a waiter picked up _change since it was last replaced

    def full(self) -> bool:
        return len(self.items) >= self._max_items or self.nbytes >= self._max_bytes

    def room(self, each: int) -> int:
        """How many more items of about ``each`` bytes fit (at least one unless full)."""
        by_bytes = (self._max_bytes - self.nbytes) // max(each, 1)
        return max(0, min(self._max_items - len(self.items), max(by_bytes, 1)))

    def put(self, item: _Item) -> None:
        self.items.append(item)
        self.nbytes += item.nbytes
        self.wake()

    def drain(self) -> list[_Item]:
        """Every item, oldest first, taken out."""
        out = []
        while self.items:
            out.append(self.take())
        return out

    def take(self) -> _Item:
        item = self.items.popleft()
        self.nbytes -= item.nbytes
        self.wake()
        return item

    def finish(self) -> None:
        """One reader is done (its source is closed and drained); the inbox is done
        once every reader is."""
        self.sources -= 1
        if self.sources <= 0:
            self.done = True
        self.wake()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.wake()

    def wake(self) -> None:
        """Have every waiter of :meth:`until` check its condition again."""
        if self._watched:  # else no one waits: nothing to set, nothing to replace
            self._watched = False
            self._change.set()
            self._change = asyncio.Event()

    async def until(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        """Return once ``ready()`` (checked at every change) or after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while not ready():
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                return
            self._watched = True
            if left is None:
                await self._change.wait()
            else:
                await wait_event(self._change, left)


@dataclass
class _Owned:
    """A variable the shard writes, with its in-memory state (the truth while it owns it)."""

    var: Variable
    value: npt.NDArray[Any]
    slots: dict[str, npt.NDArray[Any]]
    version: int
    t: int


class _Rejected(Exception):
    """A message that must not be applied: dead-letter it with this reason."""

    def __init__(self, reason: str, variable: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.variable = variable


@dataclass
class _Pending:
    """What one variable must commit for a group: the ids of the messages applied to
    its in-memory copy, in order, and the rows they touched (sparse) or that it is dense."""

    ids: list[str] = field(default_factory=list)
    rows: list[npt.NDArray[Any]] = field(default_factory=list)
    dense: bool = False


@dataclass
class _Group:
    """Messages applied together and committed once per variable."""

    deliveries: list[Delivery] = field(default_factory=list)
    messages: int = 0  # taken into the group (a delivery may hold several)
    nbytes: int = 0  # bytes of the deliveries
    ids: set[str] = field(default_factory=set)
    vars: dict[str, _Pending] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)  # applied, not committed yet
    gs_ids: list[str] = field(default_factory=list)  # advance the global step for these
    fresh: int = 0
    skipped: int = 0
    rows: int = 0
    bytes: int = 0
    stale: list[tuple[str, int]] = field(default_factory=list)
    redo: bool = False
    # valid messages: (id, its variables, advances the global step), the ids to release
    applied: list[tuple[str, list[str], bool]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)  # qps_ps_apply_seconds

    def full(self, max_items: int, max_bytes: int) -> bool:
        return self.messages >= max_items or self.nbytes >= max_bytes


@dataclass
class _Accum:
    """Synchronous training: the fresh gradients taken for the shard's next update
    (TF's ConditionalAccumulators, one per variable), held unacknowledged until the
    update commits."""

    items: list[_Item] = field(default_factory=list)
    dense: dict[str, npt.NDArray[Any]] = field(default_factory=dict)  # running sums
    count: dict[str, int] = field(default_factory=dict)  # gradients per variable
    sparse: dict[str, list[SparseGradient]] = field(default_factory=dict)

    def add(self, msg: GradientMessage) -> None:
        for name, grad in msg.grads.items():
            self.count[name] = self.count.get(name, 0) + 1
            if isinstance(grad, SparseGradient):
                self.sparse.setdefault(name, []).append(grad)
            elif name in self.dense:
                self.dense[name] += grad
            else:
                self.dense[name] = np.array(grad, copy=True)

    def mean(self, name: str) -> Any:
        """The aggregated gradient of ``name``: dense, the mean over the gradients taken;
        sparse, each row averaged over the gradients that hold it (TF's
        SparseConditionalAccumulator)."""
        if name in self.dense:
            return self.dense[name] / self.count[name]
        parts = self.sparse[name]
        idx = np.concatenate([p.indices for p in parts])
        vals = np.concatenate([p.values for p in parts])
        rows, inverse = np.unique(idx, return_inverse=True)
        sums = np.zeros((len(rows), *vals.shape[1:]), dtype=vals.dtype)
        np.add.at(sums, inverse, vals)
        hits = np.bincount(inverse, minlength=len(rows)).astype(vals.dtype)
        return SparseGradient(rows, sums / hits.reshape(-1, *([1] * (vals.ndim - 1))))


def _deliveries(items: Sequence[_Item]) -> list[Delivery]:
    """The deliveries of ``items``, each once, in order."""
    return _each_once([it.delivery for it in items if it.delivery is not None])


def _each_once(ds: Sequence[Delivery]) -> list[Delivery]:
    """``ds`` with each delivery once (by identity), in order."""
    out: list[Delivery] = []
    for d in ds:
        if not any(d is x for x in out):
            out.append(d)
    return out


def _joined(ds: list[Delivery]) -> Delivery:
    """Several deliveries as one (one ack, nack or touch call for all, in order)."""
    if len(ds) == 1:
        return ds[0]
    return Delivery(None, tuple(t for d in ds for t in d.tokens), all(d.plain for d in ds))


def _nbytes(value: Any) -> int:
    return int(getattr(value, "nbytes", 0) or len(value))

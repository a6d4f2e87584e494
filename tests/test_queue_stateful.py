"""Stateful fuzzing of the queues: hypothesis ``RuleBasedStateMachine`` s, one per queue type.

Each machine drives one shared queue from 2-3 clients (separate :class:`qps.transport.Client`
objects on one fakeredis server) through random interleavings of enqueue, enqueue_many,
dequeue, dequeue_many, dequeue_up_to (``_nowait``, blocking, and ``timeout=0``), plain and
cancelling close, and asyncio cancellation of calls that are waiting. An in-memory model of
TF's queue semantics (docs/queues.md: two strict FIFO attempt lines, head-of-line blocking, partial progress,
close joining the enqueue line) decides the outcome of every call, including which waiting
call an enqueue serves.

The same machines also run, with fewer examples, against a real server. Every call runs
as a task. After each rule:

* the calls the model says have finished are awaited and their outcome compared (which
  error; which elements, in order for FIFO, padding and priority queues; for a shuffle
  queue, elements that are stored or held and were never delivered before);
* the queue's snapshot in Redis (size, closed, waiting enqueues/closes/dequeues, elements
  held by waiting dequeues, totals) must equal the model's: this is also how the test
  knows that a new waiting call has registered (no sleeps);
* after a few more event-loop turns, every call the model says waits is still pending.

A rule may also cancel, in the same step, the tasks an operation has just completed
(before they read their reply): TF's cancellation race. The task then either returns its
result or raises ``asyncio.CancelledError``; in the second case a dequeue's elements must
be back at the front of the queue, and an enqueue or close has still taken effect. Nothing
is ever lost or delivered twice: teardown cancels what waits, closes the queue, drains it
and compares the delivered elements with the stored ones.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import io
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

import qps
from qps import transport
from qps.errors import (
    CancelledError,
    DeadlineExceededError,
    OutOfRangeError,
    WouldBlockError,
)
from qps.queues import delete_queue
from tests.conftest import within
from tests.corruption import dump_all

I64 = np.int64
I32 = np.int32
BASE = 2**33  # scalar values start above the int32 range so that a narrowing would show
HANG = 10.0  # a call the model says has finished must report within this (a hang guard)
TURNS = 5  # event-loop turns given to calls that must stay pending before checking them

# A failing run reports its first failing example, whose log lists every call: shrinking
# replays a failure many times (each up to HANG seconds where a call hangs), which turned
# a defect into a quarter of an hour of silence. QPS_STATEFUL_SHRINK=1 shrinks.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("QPS_STATEFUL_SHRINK") == "1":
    PHASES.append(Phase.shrink)

STATEFUL = settings(
    phases=PHASES,
    max_examples=int(os.environ.get("QPS_STATEFUL_EXAMPLES", "200")),
    stateful_step_count=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

Elem = Any  # int (fifo, shuffle), tuple[int, ...] (padding), (priority, value) (priority)
Result = tuple[str, Any]  # ('ok', value) or ('err', exception type)
OK: Result = ("ok", None)


# -- the model -------------------------------------------------------------------------------


@dataclass(eq=False)
class Att:
    """One call, as the model sees it: waiting in a line, or finished with ``result``."""

    kind: str  # enq | close | deq
    label: str
    client: int
    rest: list[Elem] = field(default_factory=list)  # enq: elements not stored yet
    n: int = 0  # deq: how many
    mode: str = ""  # deq: one | many | upto
    held: list[Elem] = field(default_factory=list)  # deq: taken so far
    result: Result | None = None
    task: asyncio.Task[Any] | None = None
    race: bool = False  # cancel the task right after the model says it finished


class Model:
    """TF's queue semantics with pending attempts (docs/queues.md).

    A shuffle queue's model knows how many elements are stored and held, not which: its
    ``items`` and ``held`` lists hold ``None`` placeholders and ``pool`` counts the
    elements that are stored or held by waiting dequeues."""

    def __init__(self, kind: str, cap: int, min_after: int) -> None:
        self.kind, self.cap, self.min_after = kind, cap, min_after
        self.items: list[Elem] = []
        self.closed = False
        self.ew: list[Att] = []  # waiting enqueues and closes
        self.dw: list[Att] = []  # waiting dequeues
        self.enq_total = 0
        self.deq_total = 0
        self.seq: dict[Elem, int] = {}  # priority: insertion stamp (ties leave in order)
        self.stamp = 0
        self.pool: Counter[Elem] = Counter()  # shuffle: stored or held, not delivered
        self.finished: list[Att] = []  # finished since the harness last looked
        self.stored: list[Elem] = []  # every element ever stored, in order
        self.reordered = False  # a cancelled finished dequeue put elements back

    # storage
    def key(self, e: Elem) -> tuple[int, int]:
        return (e[0], self.seq[e])

    def room(self) -> float:
        return math.inf if self.cap < 0 else max(0, self.cap - len(self.items))

    def takeable(self) -> int:
        if self.kind == "shuffle" and not self.closed:
            return max(0, len(self.items) - self.min_after)
        return len(self.items)

    def store(self, es: list[Elem]) -> None:
        self.enq_total += len(es)
        self.stored += es
        for e in es:
            if self.kind == "priority":
                self.stamp += 1
                self.seq[e] = self.stamp
                bisect.insort(self.items, e, key=self.key)
            elif self.kind == "shuffle":
                self.pool[e] += 1
                self.items.append(None)
            else:
                self.items.append(e)

    def take(self, k: int) -> list[Elem]:
        out = self.items[:k]
        del self.items[:k]
        return out

    def push_front(self, vals: list[Elem]) -> None:
        """Elements given back: at the front in order (a priority queue's go back to their
        place, a shuffle queue has no front)."""
        if self.kind == "priority":
            for e in vals:
                bisect.insort(self.items, e, key=self.key)
        else:
            self.items[:0] = vals

    def finish(self, a: Att, result: Result) -> None:
        a.result = result
        self.finished.append(a)

    def flush(self) -> None:
        """Serve the lines until nothing moves: enqueues at the head of ``ew`` store what
        fits, a close at the head closes; then the dequeue at the head of ``dw`` takes."""
        progress = True
        while progress:
            progress = False
            while self.ew:
                a = self.ew[0]
                if a.kind == "close":
                    self.ew.pop(0)
                    self.closed = True
                    self.finish(a, OK)
                    for b in self.ew:  # enqueues: "is closed"; closes: "already closed"
                        b.rest = []
                        self.finish(b, ("err", CancelledError))
                    self.ew.clear()
                    progress = True
                    break
                k = min(self.room(), len(a.rest))
                if k <= 0:
                    break
                self.store(a.rest[: int(k)])
                del a.rest[: int(k)]
                progress = True
                if a.rest:
                    break
                self.ew.pop(0)
                self.finish(a, OK)
            while self.dw:
                a = self.dw[0]
                k = min(a.n - len(a.held), self.takeable())
                if k > 0:
                    a.held += self.take(k)
                    progress = True
                if len(a.held) >= a.n:
                    self.dw.pop(0)
                    self.deq_total += len(a.held)
                    self.finish(a, ("ok", a.held))
                    progress = True
                elif self.closed:
                    self.dw.pop(0)
                    progress = True
                    if a.mode == "upto" and a.held:
                        self.deq_total += len(a.held)
                        self.finish(a, ("ok", a.held))
                    else:
                        self.push_front(a.held)
                        a.held = []
                        self.finish(a, ("err", OutOfRangeError))
                else:
                    break

    # calls
    def enqueue(self, a: Att, how: str) -> None:
        es = a.rest
        if not es:
            return self.finish(a, OK)  # a batch of 0 does nothing, even when closed
        if self.closed:
            return self.finish(a, ("err", CancelledError))
        if not self.ew:
            k = int(min(self.room(), len(es)))
            if how == "nowait" and k < len(es):
                return self.finish(a, ("err", WouldBlockError))
            self.store(es[:k])
            del es[:k]
            if not es:
                self.flush()
                return self.finish(a, OK)
        elif how == "nowait":
            return self.finish(a, ("err", WouldBlockError))
        self.ew.append(a)
        self.flush()
        if a.result is None and how == "timeout0":
            self.ew.remove(a)
            a.rest = []
            self.flush()
            self.finish(a, ("err", DeadlineExceededError))

    def dequeue(self, a: Att, how: str) -> None:
        n = a.n
        if n == 0:
            return self.finish(a, ("ok", []))  # an empty batch at once, even when closed
        if not self.dw:
            avail = self.takeable()
            if avail >= n or (a.mode == "upto" and avail > 0 and (self.closed or how == "nowait")):
                got = self.take(min(n, avail))
                self.deq_total += len(got)
                self.flush()
                return self.finish(a, ("ok", got))
            if self.closed:
                return self.finish(a, ("err", OutOfRangeError))
            if how == "nowait":
                return self.finish(a, ("err", WouldBlockError))
            a.held = self.take(avail)
        elif how == "nowait":
            return self.finish(a, ("err", WouldBlockError))
        self.dw.append(a)
        self.flush()
        if a.result is None and how == "timeout0":
            self.cancel(a)
            a.result = ("err", DeadlineExceededError)

    def close(self, a: Att, cancel: bool) -> None:
        if self.closed:
            return self.finish(a, OK if cancel else ("err", CancelledError))
        if cancel:
            self.closed = True
            for b in self.ew:  # enqueues: "Enqueue operation was cancelled"
                b.rest = []
                self.finish(b, ("err", CancelledError))
            self.ew.clear()
            self.flush()
            return self.finish(a, OK)
        if not self.ew:
            self.closed = True
            self.flush()
            return self.finish(a, OK)
        self.ew.append(a)

    def cancel(self, a: Att) -> None:
        """Withdraw a waiting call (its task was cancelled, or its timeout ran out): a
        dequeue's elements go back to the front, an enqueue keeps its stored prefix."""
        if a.kind == "deq":
            self.dw.remove(a)
            self.push_front(a.held)
            a.held = []
        else:
            self.ew.remove(a)
            a.rest = []
        self.flush()
        a.result = ("err", asyncio.CancelledError)

    def undo_finished(self, a: Att) -> None:
        """A finished call's task was cancelled before it read its reply: a dequeue's
        elements go back to the front (an enqueue or close took effect for good)."""
        assert a.result is not None
        if a.kind == "deq" and a.result[0] == "ok" and a.result[1]:
            self.deq_total -= len(a.result[1])
            self.push_front(a.result[1])
            self.reordered = True
            self.flush()

    def snapshot(self) -> dict[str, Any]:
        return {
            "size": len(self.items),
            "closed": self.closed,
            "enqueued_total": self.enq_total,
            "dequeued_total": self.deq_total,
            "pending_enqueues": sum(1 for a in self.ew if a.kind == "enq"),
            "pending_close": any(a.kind == "close" for a in self.ew),
            "ew": len(self.ew),
            "pending_dequeues": len(self.dw),
            "held": sum(len(a.held) for a in self.dw),
        }


# -- the machines ----------------------------------------------------------------------------

# weights by repetition: a close is rare (a closed queue only drains), blocking calls common
OPS = ["enq"] * 5 + ["enq_many", "deq", "deq_many", "deq_up_to"] * 4 + ["close"]
HOWS = ["block"] * 3 + ["nowait", "timeout0"]
CAPACITIES = [0, 1, 2, 3, -1]  # 0: every enqueue waits; a shuffle queue gets at least 1


def fake_clients(k: int) -> list[transport.Client]:
    server = fakeredis.FakeServer()
    return [
        transport.from_redis(
            fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
        )
        for _ in range(k)
    ]


class QueueMachine(RuleBasedStateMachine):
    KIND = ""
    URL: str | None = None  # a real server's URL; None: a fresh fakeredis server per example

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clients: list[transport.Client] = []
        self.queues: list[qps.QueueBase] = []
        self.model: Model | None = None
        self.next = 0
        self.delivered: list[Elem] = []
        self.log: list[str] = []
        self.broken = False  # a rule failed: the queue is not in the model's state

    # setup and teardown
    @initialize(
        cap=st.sampled_from(CAPACITIES),
        min_after=st.integers(0, 3),
        nclients=st.integers(2, 3),
        seed=st.integers(0, 2**31 - 1),
    )
    def setup(self, cap: int, min_after: int, nclients: int, seed: int) -> None:
        if self.KIND == "shuffle":
            cap = max(cap, 1) if cap >= 0 else cap
            min_after = min(min_after, cap - 1) if cap > 0 else min_after
        else:
            min_after = 0
        self.model = Model(self.KIND, cap, min_after)
        if self.URL is None:
            self.clients = fake_clients(nclients)
        else:
            url = self.URL
            self.clients = [self.run(transport.connect(url)) for _ in range(nclients)]
        self.queues = [self.make_queue(c, cap, min_after, seed) for c in self.clients]
        self.log.append(f"queue {self.KIND} cap={cap} min_after={min_after} clients={nclients}")
        self.run(self.check_snapshot())

    def make_queue(self, c: transport.Client, cap: int, min_after: int, seed: int) -> qps.QueueBase:
        name = "sm" if self.URL is None else f"sm-{id(self):x}-{self.KIND}"  # fresh per example
        if self.KIND == "fifo":
            return qps.FIFOQueue(cap, I64, shapes=[[]], shared_name=name, client=c)
        if self.KIND == "shuffle":
            return qps.RandomShuffleQueue(
                cap, min_after, I64, shapes=[[]], seed=seed, shared_name=name, client=c
            )
        if self.KIND == "priority":
            return qps.PriorityQueue(cap, [I64], [[]], shared_name=name, client=c)
        return qps.PaddingFIFOQueue(cap, I32, shapes=[[None]], shared_name=name, client=c)

    def teardown(self) -> None:
        try:
            if self.model is not None and not self.loop.is_closed() and not self.broken:
                self.run(self.drain())
        finally:
            self.loop.run_until_complete(self.shutdown())
            self.loop.close()

    async def shutdown(self) -> None:
        for a in self.waiting():
            assert a.task is not None
            a.task.cancel()
        if self.URL is not None and self.queues:
            with contextlib.suppress(Exception):
                await delete_queue(self.clients[0], self.queues[0].name)
        for c in self.clients:
            await c.close()
        # fakeredis keeps a cancelled BLPOP running until its block ends: stop them all
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    async def drain(self) -> None:
        """Cancel what waits, close, take everything: each stored element exactly once."""
        m = self.m
        while self.waiting():
            await self.cancel_waiting(self.waiting()[0])
        await self.call("close", 0, how="block", count=1)
        while m.items:
            await self.call("deq_up_to", 0, how="nowait", count=3)
        await self.call("deq", 0, how="nowait", count=1)  # OutOfRange: closed and empty
        assert Counter(self.delivered) == Counter(m.stored), "lost or duplicated"
        assert len(set(self.delivered)) == len(self.delivered), "delivered twice"
        if self.KIND in ("fifo", "padding") and not m.reordered:
            assert self.delivered == m.stored, "FIFO order"

    # helpers
    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    def run(self, coro: Any) -> Any:
        what = "a rule's calls report and the queue settles in the model's state"
        try:
            return self.loop.run_until_complete(within(coro, 60, what))
        except BaseException:
            self.broken = True
            raise

    def waiting(self) -> list[Att]:
        return list(self.m.ew) + list(self.m.dw) if self.model is not None else []

    def fresh(self, length: int) -> Elem:
        self.next += 1
        if self.KIND == "padding":
            start = self.next * 10
            return tuple(range(start, start + length))
        if self.KIND == "priority":  # few distinct priorities: ties are common
            return (self.next * 5 % 4 - 1, BASE + self.next)
        return BASE + self.next

    def one(self, e: Elem) -> Any:
        if self.KIND == "priority":
            return (e[0], I64(e[1]))
        return np.array(e, I32) if self.KIND == "padding" else I64(e)

    def many(self, es: list[Elem], length: int) -> Any:
        if self.KIND == "priority":
            return (np.array([e[0] for e in es], I64), np.array([e[1] for e in es], I64))
        if self.KIND == "padding":
            return np.array(es, I32).reshape(len(es), length)
        return np.array(es, I64)

    def decode(self, a: Att, out: Any) -> list[Elem]:
        """The elements a dequeue returned, checked against the model's expectation."""
        assert a.result is not None
        want: list[Elem] = a.result[1]
        if self.KIND == "priority":
            if a.mode == "one":
                prio, val = out
                assert prio.shape == val.shape == () and prio.dtype == val.dtype == I64
                return [(int(prio), int(val))]
            prios, vals = out
            assert prios.shape == vals.shape == (len(want),), (prios.shape, vals.shape, want)
            return [(int(p), int(v)) for p, v in zip(prios, vals)]
        assert isinstance(out, np.ndarray), type(out)
        if self.KIND == "padding":
            if a.mode == "one":
                assert out.dtype == I32 and out.ndim == 1, (out.dtype, out.shape)
                return [tuple(int(x) for x in out)]
            width = max((len(e) for e in want), default=0)
            padded = np.zeros((len(want), width), I32)
            for i, e in enumerate(want):
                padded[i, : len(e)] = e
            assert out.dtype == I32 and np.array_equal(out, padded), (out.tolist(), want)
            return list(want)
        if a.mode == "one":
            assert out.dtype == I64 and out.shape == (), (out.dtype, out.shape)
            return [int(out)]
        assert out.dtype == I64 and out.shape == (len(want),), (out.dtype, out.shape, want)
        return [int(x) for x in out]

    def delivered_ok(self, a: Att, got: list[Elem]) -> None:
        assert a.result is not None
        want = a.result[1]
        assert len(got) == len(want), f"{a.label}: got {got}, model {want}"
        if self.KIND == "shuffle":
            short = Counter(got) - self.m.pool
            assert not short, f"{a.label}: {got} were not stored (or came out before)"
            self.m.pool -= Counter(got)
        else:
            assert got == want, f"{a.label}: got {got}, model {want}"
        self.delivered += got

    def real_call(self, a: Att, how: str, length: int) -> Any:
        q = self.queues[a.client]
        t: dict[str, Any] = {"timeout": 0} if how == "timeout0" else {}
        if a.kind == "close":
            return q.close(cancel_pending_enqueues=a.mode == "cancel", **t)
        if a.kind == "enq":
            es = list(a.rest)
            if a.mode == "one":
                v = self.one(es[0])
                return q.enqueue_nowait(v) if how == "nowait" else q.enqueue(v, **t)
            v = self.many(es, length)
            return q.enqueue_many_nowait(v) if how == "nowait" else q.enqueue_many(v, **t)
        if a.mode == "one":
            return q.dequeue_nowait() if how == "nowait" else q.dequeue(**t)
        if a.mode == "many":
            if how == "nowait":
                return q.dequeue_many_nowait(a.n)
            return q.dequeue_many(a.n, **t)
        return q.dequeue_up_to_nowait(a.n) if how == "nowait" else q.dequeue_up_to(a.n, **t)

    # the harness
    async def call(self, op: str, client: int, how: str, count: int, length: int = 1) -> None:
        m = self.m
        n = 1 if op in ("enq", "deq") else count
        label = f"#{len(self.log)} c{client} {op}({n}) {how}"
        if op in ("enq", "enq_many"):
            k = 1 if op == "enq" else count
            es = [self.fresh(length) for _ in range(k)]
            a = Att("enq", label, client, rest=es, mode="one" if op == "enq" else "many")
            label += f" {es}"
        elif op == "close":
            a = Att("close", label, client, mode="cancel" if count % 2 else "plain")
            label += f" cancel={count % 2 == 1}"
        else:
            mode = {"deq": "one", "deq_many": "many", "deq_up_to": "upto"}[op]
            a = Att("deq", label, client, n=1 if op == "deq" else count, mode=mode)
        a.label = label
        self.log.append(label)
        a.task = asyncio.ensure_future(self.real_call(a, how, length))
        if a.kind == "enq":
            m.enqueue(a, how)
        elif a.kind == "close":
            m.close(a, a.mode == "cancel")
        else:
            m.dequeue(a, how)
        if a.result is not None:
            if a in m.finished:
                m.finished.remove(a)
            await self.report(a)
        elif m.finished:
            await self.settled()  # this call has run: now the calls it finished report
        await self.serve_finished()
        await self.settled()
        await self.still_waiting()

    async def report(self, a: Att) -> None:
        """Await a finished call's task and compare its outcome with the model's."""
        assert a.task is not None and a.result is not None
        m = self.m
        if a.race:
            a.task.cancel()
        await asyncio.wait([a.task], timeout=HANG)
        if not a.task.done():
            where = io.StringIO()
            a.task.print_stack(file=where)
            raise AssertionError(
                f"{a.label}: still running; model says {a.result}\n{where.getvalue()}"
                + "\n".join(self.log)
                + await self.keys()
            )
        try:
            got: Result = ("ok", a.task.result())
        except asyncio.CancelledError:
            got = ("err", asyncio.CancelledError)
        except (CancelledError, OutOfRangeError, WouldBlockError, DeadlineExceededError) as exc:
            got = ("err", type(exc))
        self.log.append(f"  -> {a.label}: {got[0]} {got[1] if got[0] == 'err' else ''}")
        if a.race and got == ("err", asyncio.CancelledError):
            m.undo_finished(a)
            return
        want = a.result
        if want[0] == "err":
            assert got == want, f"{a.label}: got {got}, model {want}"
            return
        assert got[0] == "ok", f"{a.label}: got {got}, model {want}"
        if a.kind == "deq":
            self.delivered_ok(a, self.decode(a, got[1]))
        else:
            assert got[1] is None

    async def serve_finished(self) -> None:
        m = self.m
        while m.finished:
            await self.report(m.finished.pop(0))

    async def real_snapshot(self) -> dict[str, Any]:
        q = self.queues[0]
        s = await q.stats()
        ew = await q._client.commands.llen(q._keys[2])  # type: ignore[union-attr]
        return {
            "size": s.size,
            "closed": s.closed,
            "enqueued_total": s.enqueued_total,
            "dequeued_total": s.dequeued_total,
            "pending_enqueues": s.pending_enqueues,
            "pending_close": s.pending_close,
            "ew": int(ew),
            "pending_dequeues": s.pending_dequeues,
            "held": s.held,
        }

    async def keys(self) -> str:
        """The queue's keys and values, for a failure's message."""
        dump = await dump_all(self.clients[0])
        name = self.queues[0].name.encode()
        lines = [f"{k!r}: {v[:2]}" for k, v in sorted(dump.items()) if b"/q/" + name + b"}" in k]
        return "\nkeys:\n" + "\n".join(lines)

    async def check_snapshot(self) -> None:
        got, want = await self.real_snapshot(), self.m.snapshot()
        if got != want:
            raise AssertionError(
                f"Redis {got} != model {want}\n" + "\n".join(self.log) + await self.keys()
            )

    async def settled(self) -> None:
        """Wait until the queue in Redis is in the model's state (a new waiting call has
        registered; a cancelled one has been withdrawn). Fails after HANG seconds."""
        want = self.m.snapshot()
        end = self.loop.time() + HANG
        turns = 0
        while True:
            got = await self.real_snapshot()
            if got == want:
                return
            if self.loop.time() > end:
                raise AssertionError(
                    f"Redis {got} != model {want}\n" + "\n".join(self.log) + await self.keys()
                )
            turns += 1
            await asyncio.sleep(0 if turns < 20 else 0.001)

    async def still_waiting(self) -> None:
        # loop turns, not time: a call the model says waits must not have finished; the
        # snapshot compared next (the waiting calls Redis holds) is the check on state
        for _ in range(TURNS):
            await asyncio.sleep(0)
        for a in self.waiting():
            assert a.task is not None
            assert not a.task.done(), (
                f"{a.label} finished ({a.task}) but the model says it waits\n" + "\n".join(self.log)
            )
        await self.check_snapshot()

    async def cancel_waiting(self, a: Att) -> None:
        assert a.task is not None
        self.log.append(f"cancel {a.label}")
        a.task.cancel()
        self.m.cancel(a)
        await self.report(a)
        await self.serve_finished()
        await self.settled()
        await self.still_waiting()

    # rules
    @rule(
        op=st.sampled_from(OPS),
        client=st.integers(0, 2),
        how=st.sampled_from(HOWS),
        count=st.integers(0, 5),
        length=st.integers(1, 3),
        race=st.booleans(),
    )
    def call_rule(
        self, op: str, client: int, how: str, count: int, length: int, race: bool
    ) -> None:
        if op == "close" and how == "timeout0":
            how = "block"  # a close with timeout=0 is a withdrawn close: not modelled
        waiting = self.waiting()
        for a in waiting:
            a.race = race
        try:
            self.run(self.call(op, client % len(self.queues), how, count, length))
        finally:
            for a in waiting:
                a.race = False

    @precondition(lambda self: bool(self.waiting()))
    @rule(i=st.integers(0, 10))
    def cancel_rule(self, i: int) -> None:
        waiting = self.waiting()
        self.run(self.cancel_waiting(waiting[i % len(waiting)]))

    @precondition(lambda self: self.model is not None and self.m.cap >= 0 and not self.m.closed)
    @rule(client=st.integers(0, 2), length=st.integers(1, 3))
    def cancelling_close_rule(self, client: int, length: int) -> None:
        """Enqueues wait for room, then a close cancels them: the model (and so the
        snapshot the harness compares) has the pending enqueues fail with CancelledError
        and the queue closed at once; a close that waited behind them would not settle.
        Random rules reach this state rarely: this rule makes every run cover it."""
        self.run(self.cancel_pending(client % len(self.queues), length))

    async def cancel_pending(self, client: int, length: int) -> None:
        m = self.m
        # waiting dequeues may take what the first enqueues bring: each round brings at
        # least one element more than the room, so their demand bounds the rounds
        for _ in range(2 + sum(a.n for a in m.dw if a.kind == "deq")):
            if any(a.kind == "enq" for a in m.ew):
                break
            room = max(m.cap - len(m.items), 0)
            await self.call("enq_many", client, "block", room + 1, length)
        assert any(a.kind == "enq" for a in m.ew), "no enqueue waits for room\n" + "\n".join(
            self.log
        )
        await self.call("close", (client + 1) % len(self.queues), "block", count=1)


class FIFOMachine(QueueMachine):
    KIND = "fifo"


class ShuffleMachine(QueueMachine):
    KIND = "shuffle"


class PaddingMachine(QueueMachine):
    KIND = "padding"


class PriorityMachine(QueueMachine):
    KIND = "priority"


# A whole machine's run (200 examples) takes ~30 s on an idle 2-core machine and several
# times that beside a CPU hog; each call has its own hang guard (HANG, and 60 s a rule),
# so the run as a whole gets a limit that scales with the examples asked for.
RUN_LIMIT = pytest.mark.timeout(max(600, 3 * int(os.environ.get("QPS_STATEFUL_EXAMPLES", "200"))))

TestFIFOStateful = FIFOMachine.TestCase
TestShuffleStateful = ShuffleMachine.TestCase
TestPaddingStateful = PaddingMachine.TestCase
TestPriorityStateful = PriorityMachine.TestCase
for _case in (TestFIFOStateful, TestShuffleStateful, TestPaddingStateful, TestPriorityStateful):
    _case.settings = STATEFUL
    _case.pytestmark = [RUN_LIMIT]
del _case  # not a test of its own


@pytest.mark.parametrize(
    "machine", [FIFOMachine, ShuffleMachine, PaddingMachine, PriorityMachine], ids=lambda m: m.KIND
)
@RUN_LIMIT
def test_stateful_real_server(redis_url: str, machine: type[QueueMachine]) -> None:
    """The same machines against a real server (its lean connections and pipelined
    waits, which fakeredis does not have), fewer examples."""
    real = type(f"Real{machine.__name__}", (machine,), {"URL": redis_url})
    n = max(1, int(os.environ.get("QPS_STATEFUL_EXAMPLES", "200")) // 8)
    run_state_machine_as_test(real, settings=settings(STATEFUL, max_examples=n))

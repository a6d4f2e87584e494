"""Property tests: random operation sequences checked against an in-memory model.

The model covers the non-blocking subset of TF's queue semantics (docs/queues.md; the ``*_nowait`` calls,
``close``, ``size``, ``is_closed``, ``peek``) driven by one client, one call at a time, so
every outcome is exact: which error, how many elements, and (FIFO, padding) which ones.

* fakeredis: hypothesis (``st.data()``, derandomized) on sync tests, each example on a
  fresh in-process server under ``asyncio.run``;
* real server: the same scenarios from a seeded ``random.Random`` loop;
* both: concurrent producers and consumers on the blocking API, checked for
  exactly-once delivery and, for FIFO, per-producer order in every consumer's stream.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qps
from qps import transport
from qps.errors import CancelledError, DeadlineExceededError, OutOfRangeError, WouldBlockError
from qps.queues import delete_queue
from tests.conftest import until

I64 = np.int64
I32 = np.int32
CAPACITIES = [1, 2, 3, 5, 10, -1]
#: scalar values start above the int32 range so that a narrowing would show
BASE = 2**33
#: bound on one operation of the model tests (all are non-blocking)
OP_TIMEOUT = 5.0

Draw = Callable[[int, int], int]  # an integer in [lo, hi], both included

HYP = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- parameters and operations -------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    kind: str  # fifo | shuffle | padding | priority
    capacity: int
    min_after: int = 0
    seed: int | None = None


def draw_params(draw: Draw, kind: str) -> Params:
    cap = CAPACITIES[draw(0, len(CAPACITIES) - 1)]
    if kind != "shuffle":
        return Params(kind, cap)
    min_after = draw(0, cap - 1 if cap > 0 else 4)
    return Params(kind, cap, min_after, seed=draw(0, 2**31 - 1))


def draw_op(draw: Draw, p: Params) -> tuple[Any, ...]:
    """One operation; counts reach a little past the capacity so that every branch
    (fits, does not fit, partial up_to) is drawn."""
    hi = (p.capacity if p.capacity >= 0 else 6) + 2
    r = draw(0, 99)
    length = draw(0, 4) if p.kind == "padding" else 0  # vector length of new elements
    if r < 22:
        return ("enq", length)
    if r < 38:
        return ("enq_many", draw(0, hi), length)
    if r < 52:
        return ("deq",)
    if r < 68:
        return ("deq_many", draw(0, hi))
    if r < 84:
        return ("deq_up_to", draw(0, hi))
    if r < 97:
        return ("peek", draw(0, hi))
    if r < 99:  # rare: a closed queue only drains, and finish() closes anyway
        return ("close", False)
    return ("close", True)


def draw_ops(draw: Draw, p: Params, most: int = 40) -> list[tuple[Any, ...]]:
    return [draw_op(draw, p) for _ in range(draw(1, most))]


def rng_draw(rng: random.Random) -> Draw:
    return rng.randint


def hyp_draw(data: st.DataObject) -> Draw:
    return lambda lo, hi: data.draw(st.integers(lo, hi))


def make_queue(client: transport.Client, p: Params, name: str | None = None) -> qps.QueueBase:
    if p.kind == "fifo":
        return qps.FIFOQueue(p.capacity, I64, shapes=[[]], shared_name=name, client=client)
    if p.kind == "shuffle":
        return qps.RandomShuffleQueue(
            p.capacity, p.min_after, I64, shapes=[[]], seed=p.seed, shared_name=name, client=client
        )
    if p.kind == "priority":
        return qps.PriorityQueue(p.capacity, [I64], [[]], shared_name=name, client=client)
    return qps.PaddingFIFOQueue(p.capacity, I32, shapes=[[None]], shared_name=name, client=client)


# -- the model ----------------------------------------------------------------------------

Elem = Any  # int (fifo, shuffle), tuple[int, ...] (padding) or (priority, int) (priority)


@dataclass
class Model:
    """TF semantics of the non-blocking calls, single client, nothing pending."""

    p: Params
    items: list[Elem] = field(default_factory=list)
    closed: bool = False
    enqueued: list[Elem] = field(default_factory=list)
    dequeued: list[Elem] = field(default_factory=list)

    def add(self, es: list[Elem]) -> None:
        """Store new elements: at the end, or for a priority queue after every stored
        element of a priority not above theirs."""
        self.enqueued.extend(es)
        if self.p.kind != "priority":
            self.items.extend(es)
            return
        for e in es:
            at = len(self.items)
            while at > 0 and self.items[at - 1][0] > e[0]:
                at -= 1
            self.items.insert(at, e)

    def room(self) -> float:
        return math.inf if self.p.capacity < 0 else self.p.capacity - len(self.items)

    def takeable(self) -> int:
        if self.p.kind == "shuffle" and not self.closed:
            return max(0, len(self.items) - self.p.min_after)
        return len(self.items)

    def enqueue(self, k: int) -> type[Exception] | None:
        """The error an all-or-nothing enqueue of ``k`` elements raises, if any."""
        if k == 0:
            return None  # a batch of 0 does nothing, even on a closed queue
        if self.closed:
            return CancelledError
        if k > self.room():
            return WouldBlockError
        return None

    def dequeue(self, n: int, mode: str) -> int | type[Exception]:
        """How many elements a nowait dequeue returns, or the error it raises."""
        if n == 0:
            return 0  # empty batch at once, even when closed
        avail = self.takeable()
        if avail >= n:
            return n
        if mode == "upto" and avail > 0:
            return avail
        return OutOfRangeError if self.closed else WouldBlockError

    def close(self, cancel: bool) -> type[Exception] | None:
        if self.closed and not cancel:
            return CancelledError
        self.closed = True
        return None


# -- running a sequence -------------------------------------------------------------------


async def outcome(aw: Awaitable[Any]) -> tuple[str, Any]:
    try:
        return ("ok", await aw)
    except (CancelledError, OutOfRangeError, WouldBlockError) as exc:
        return ("err", type(exc))


def check_err(got: tuple[str, Any], want: type[Exception] | None, what: str) -> bool:
    """True if the call succeeded (and should have)."""
    if want is None:
        assert got[0] == "ok", f"{what}: expected success, got {got[1].__name__}"
        return True
    assert got == ("err", want), f"{what}: expected {want.__name__}, got {got}"
    return False


class Runner:
    """Applies operations to a real queue and to the model, and compares them."""

    def __init__(self, q: qps.QueueBase, p: Params) -> None:
        self.q = q
        self.p = p
        self.m = Model(p)
        self.next = 0
        self.log: list[tuple[Any, ...]] = []  # (op, outcome) for the report and replays

    # elements
    def fresh(self, length: int) -> Elem:
        self.next += 1
        if self.p.kind == "padding":
            start = self.next * 10
            return tuple(range(start, start + length))
        if self.p.kind == "priority":  # few distinct priorities: ties are common
            return (self.next * 5 % 4 - 1, BASE + self.next)
        return BASE + self.next

    def one(self, e: Elem) -> Any:
        if self.p.kind == "priority":
            return (e[0], I64(e[1]))
        return np.array(e, I32) if self.p.kind == "padding" else I64(e)

    def many(self, es: list[Elem], length: int) -> Any:
        if self.p.kind == "priority":
            return (np.array([e[0] for e in es], I64), np.array([e[1] for e in es], I64))
        if self.p.kind == "padding":
            return np.array(es, I32).reshape(len(es), length)
        return np.array(es, I64)

    # outputs
    def decode_one(self, out: Any) -> Elem:
        if self.p.kind == "priority":
            prio, val = out
            assert prio.dtype == I64 and val.dtype == I64 and prio.shape == val.shape == ()
            return (int(prio), int(val))
        assert isinstance(out, np.ndarray), type(out)
        if self.p.kind == "padding":
            assert out.dtype == I32 and out.ndim == 1, (out.dtype, out.shape)
            return tuple(int(x) for x in out)
        assert out.dtype == I64 and out.shape == (), (out.dtype, out.shape)
        return int(out)

    def decode_batch(self, out: Any, k: int) -> list[Elem]:
        if self.p.kind == "priority":
            prios, vals = out
            assert prios.shape == vals.shape == (k,), (prios.shape, vals.shape, k)
            return [(int(p), int(v)) for p, v in zip(prios, vals)]
        assert isinstance(out, np.ndarray), type(out)
        if self.p.kind != "padding":
            assert out.dtype == I64 and out.shape == (k,), (out.dtype, out.shape, k)
            return [int(x) for x in out]
        # FIFO: the elements are the model's next k; the batch must be them, zero-padded
        # to the longest one.
        want = self.m.items[:k]
        width = max((len(e) for e in want), default=0)
        padded = np.zeros((k, width), I32)
        for i, e in enumerate(want):
            padded[i, : len(e)] = e
        assert out.dtype == I32 and out.shape == padded.shape, (out.dtype, out.shape, want)
        assert np.array_equal(out, padded), (out.tolist(), want)
        return list(want)

    def take(self, got: list[Elem]) -> None:
        """Remove delivered elements from the model after checking them."""
        m = self.m
        if self.p.kind == "shuffle":
            pool = Counter(m.items)
            assert not Counter(got) - pool, f"delivered {got}, stored {m.items}"
            for e in got:
                m.items.remove(e)
        else:
            assert got == m.items[: len(got)], f"FIFO order: got {got}, stored {m.items}"
            del m.items[: len(got)]
        m.dequeued.extend(got)

    # operations
    async def apply(self, op: tuple[Any, ...]) -> tuple[Any, ...]:
        q, m, name = self.q, self.m, op[0]
        res: tuple[Any, ...]
        if name == "enq":
            e = self.fresh(op[1])
            got = await outcome(q.enqueue_nowait(self.one(e)))
            if check_err(got, m.enqueue(1), f"enqueue({e})"):
                m.add([e])
            res = (got[0], e if got[0] == "ok" else got[1].__name__)
        elif name == "enq_many":
            es = [self.fresh(op[2]) for _ in range(op[1])]
            got = await outcome(q.enqueue_many_nowait(self.many(es, op[2])))
            if check_err(got, m.enqueue(len(es)), f"enqueue_many({es})"):
                m.add(es)
            res = (got[0], es if got[0] == "ok" else got[1].__name__)
        elif name in ("deq", "deq_many", "deq_up_to"):
            n = 1 if name == "deq" else op[1]
            mode = {"deq": "one", "deq_many": "many", "deq_up_to": "upto"}[name]
            call = {
                "deq": lambda: q.dequeue_nowait(),
                "deq_many": lambda: q.dequeue_many_nowait(n),
                "deq_up_to": lambda: q.dequeue_up_to_nowait(n),
            }[name]
            want = m.dequeue(n, mode)
            got = await outcome(call())
            if isinstance(want, int):
                check_err(got, None, f"{name}({n})")
                if mode == "one":
                    elems = [self.decode_one(got[1])]
                else:
                    elems = self.decode_batch(got[1], want)
                assert len(elems) == want, f"{name}({n}): {len(elems)} elements, want {want}"
                self.take(elems)
                res = ("ok", elems)
            else:
                check_err(got, want, f"{name}({n}) with {m.items} closed={m.closed}")
                res = ("err", want.__name__)
        elif name == "peek":
            k = op[1]
            seen = [self.decode_one(x) for x in await q.peek(k)]
            if self.p.kind == "shuffle":
                assert len(seen) == min(k, len(m.items)), (seen, m.items)
                assert not Counter(seen) - Counter(m.items), (seen, m.items)
            else:
                assert seen == m.items[:k], (seen, m.items)
            res = ("ok", len(seen))
        elif name == "close":
            got = await outcome(q.close(cancel_pending_enqueues=op[1]))
            check_err(got, m.close(op[1]), f"close(cancel={op[1]})")
            res = (got[0],)
        else:  # pragma: no cover
            raise AssertionError(op)
        size, closed = await q.size(), await q.is_closed()
        assert (size, closed) == (len(m.items), m.closed), (
            f"after {op}: size/closed {(size, closed)}, model {(len(m.items), m.closed)}"
        )
        self.log.append((op, res))
        return res

    async def finish(self) -> None:
        """Check the counters, then drain: everything enqueued comes out exactly once."""
        q, m = self.q, self.m
        s = await q.stats()
        assert (s.size, s.closed) == (len(m.items), m.closed)
        assert (s.enqueued_total, s.dequeued_total) == (len(m.enqueued), len(m.dequeued))
        assert (s.pending_enqueues, s.pending_dequeues, s.held, s.dead_letters) == (0, 0, 0, 0)
        assert not s.pending_close
        await self.apply(("close", True))
        while m.items:
            await self.apply(("deq_up_to", 3) if len(m.items) % 2 else ("deq",))
        await self.apply(("deq",))  # OutOfRange on the closed, empty queue
        assert Counter(m.dequeued) == Counter(m.enqueued)
        if self.p.kind in ("shuffle", "priority"):  # (priority order: checked by take())
            assert len(set(m.dequeued)) == len(m.dequeued)
        else:  # order too (padding elements of length 0 all look alike: order says more)
            assert m.dequeued == m.enqueued


async def run_ops(q: qps.QueueBase, p: Params, ops: list[tuple[Any, ...]]) -> Runner:
    r = Runner(q, p)
    try:
        for op in ops:
            # a nowait call must never block: a hang is a failure, not a stuck suite
            await asyncio.wait_for(r.apply(op), OP_TIMEOUT)
        await asyncio.wait_for(r.finish(), OP_TIMEOUT)
    except (AssertionError, asyncio.TimeoutError) as exc:
        raise AssertionError(
            f"{exc!r}\n  params: {p}\n  log (op, outcome): {r.log}\n  next ops: {ops[len(r.log) :]}"
        ) from exc
    return r


async def scenario(client: transport.Client, p: Params, ops: list[tuple[Any, ...]]) -> None:
    """Run ``ops`` on a fresh private queue; for a seeded shuffle queue, run them again
    on a second fresh queue and require identical outcomes."""
    q = make_queue(client, p)
    first = await run_ops(q, p, ops)
    await delete_queue(client, q.name)
    if p.kind == "shuffle":
        q2 = make_queue(client, p)
        second = await run_ops(q2, p, ops)
        await delete_queue(client, q2.name)
        assert second.log == first.log, f"same seed, same ops, different outcome: {p} {ops}"


def fake_client() -> transport.Client:
    server = fakeredis.FakeServer()
    return transport.from_redis(
        fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
    )


def run_on_fresh_fakeredis(p: Params, ops: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        client = fake_client()
        try:
            await scenario(client, p, ops)
        finally:
            await client.close()

    asyncio.run(main())


# -- fakeredis: hypothesis ----------------------------------------------------------------


@settings(HYP, max_examples=200)
@given(st.data())
def test_fifo_model_fakeredis(data: st.DataObject) -> None:
    draw = hyp_draw(data)
    p = draw_params(draw, "fifo")
    run_on_fresh_fakeredis(p, draw_ops(draw, p))


@settings(HYP, max_examples=100)
@given(st.data())
def test_shuffle_model_fakeredis(data: st.DataObject) -> None:
    draw = hyp_draw(data)
    p = draw_params(draw, "shuffle")
    run_on_fresh_fakeredis(p, draw_ops(draw, p, most=30))


@settings(HYP, max_examples=100)
@given(st.data())
def test_padding_model_fakeredis(data: st.DataObject) -> None:
    draw = hyp_draw(data)
    p = draw_params(draw, "padding")
    run_on_fresh_fakeredis(p, draw_ops(draw, p, most=30))


@settings(HYP, max_examples=100)
@given(st.data())
def test_priority_model_fakeredis(data: st.DataObject) -> None:
    draw = hyp_draw(data)
    p = draw_params(draw, "priority")
    run_on_fresh_fakeredis(p, draw_ops(draw, p, most=30))


# -- real server: seeded loops ------------------------------------------------------------


@pytest.mark.parametrize("make_client", ["redis"], indirect=True)
@pytest.mark.parametrize("kind", ["fifo", "shuffle", "padding", "priority"])
async def test_model_real_server(client: transport.Client, kind: str) -> None:
    for i in range(50):
        draw = rng_draw(random.Random(f"{kind}-{i}"))
        p = draw_params(draw, kind)
        await scenario(client, p, draw_ops(draw, p))
        assert await client.commands.dbsize() <= 2  # the registry sets (deleted queues gone)


# -- concurrent producers and consumers (both backends) -----------------------------------

CALL_TIMEOUT = 20.0
ROUND_TIMEOUT = 60.0
SHORT_TIMEOUTS = [0.0, 0.001, 0.01]
PER_PRODUCER = 1_000_000  # value = producer id * PER_PRODUCER + sequence number


async def produce(q: qps.QueueBase, values: list[int], rng: random.Random) -> None:
    """Send ``values`` in order: single enqueues, some with a timeout that may fire (a
    timed-out enqueue inserts nothing, so it is retried), and enqueue_many batches of
    1..6, which may exceed the capacity (no timeout: a timed-out batch keeps a prefix)."""
    i = 0
    while i < len(values):
        if rng.random() < 0.4:
            timeout = rng.choice(SHORT_TIMEOUTS) if rng.random() < 0.5 else CALL_TIMEOUT
            try:
                await q.enqueue(I64(values[i]), timeout=timeout)
            except DeadlineExceededError:
                continue
            i += 1
        else:
            chunk = values[i : i + rng.randint(1, 6)]
            await q.enqueue_many(np.array(chunk, I64), timeout=CALL_TIMEOUT)
            i += len(chunk)
        if rng.random() < 0.3:
            await asyncio.sleep(0)


async def consume(q: qps.QueueBase, rng: random.Random) -> list[int]:
    """Take until the queue is closed and empty; returns the stream in arrival order.
    Some calls time out on purpose: what they had collected must go back in order."""
    stream: list[int] = []
    draining = False  # a dequeue_many hit OutOfRange: take the rest with dequeue_up_to
    while True:
        choice = "upto" if draining else rng.choice(["one", "many", "upto"])
        n = rng.randint(1, 7)
        timeout = rng.choice(SHORT_TIMEOUTS) if rng.random() < 0.25 else CALL_TIMEOUT
        try:
            if choice == "one":
                stream.append(int(await q.dequeue(timeout=timeout)))
            elif choice == "many":
                out = await q.dequeue_many(n, timeout=timeout)
                assert len(out) == n
                stream += [int(x) for x in out]
            else:
                out = await q.dequeue_up_to(n, timeout=timeout)
                assert 1 <= len(out) <= n
                stream += [int(x) for x in out]
        except DeadlineExceededError:
            if timeout == CALL_TIMEOUT:
                raise
            continue
        except OutOfRangeError:
            if choice == "many":
                draining = True
                continue
            return stream


async def concurrent_round(
    make_client: Callable[[], Awaitable[transport.Client]], kind: str, seed: int
) -> None:
    rng = random.Random(f"{kind}-{seed}")
    k = rng.randint(2, 3)
    cap = rng.randint(1, 5)
    min_after = rng.randint(0, cap - 1)
    name = f"conc-{kind}-{seed}"
    where = f"kind={kind} seed={seed} k={k} cap={cap} min_after={min_after}"

    async def open_queue() -> qps.QueueBase:
        c = await make_client()
        if kind == "fifo":
            return qps.FIFOQueue(cap, I64, shapes=[[]], shared_name=name, client=c)
        return qps.RandomShuffleQueue(
            cap, min_after, I64, shapes=[[]], seed=seed, shared_name=name, client=c
        )

    producers = [await open_queue() for _ in range(k)]
    consumers = [await open_queue() for _ in range(k)]
    sent = {pid: [pid * PER_PRODUCER + j for j in range(rng.randint(10, 50))] for pid in range(k)}
    seeds = [rng.random() for _ in range(2 * k)]

    async def body() -> list[list[int]]:
        tasks = [
            asyncio.create_task(consume(q, random.Random(seeds[i])))
            for i, q in enumerate(consumers)
        ]
        try:
            await asyncio.gather(
                *(produce(q, sent[i], random.Random(seeds[k + i])) for i, q in enumerate(producers))
            )
            await producers[0].close(timeout=CALL_TIMEOUT)
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    streams = await asyncio.wait_for(body(), ROUND_TIMEOUT)
    got = Counter(v for s in streams for v in s)
    want = Counter(v for vs in sent.values() for v in vs)
    assert got == want, f"{where}: lost {want - got}, extra {got - want}"
    if kind == "fifo":
        for c, stream in enumerate(streams):
            for pid in sent:
                mine = [v for v in stream if v // PER_PRODUCER == pid]
                assert mine == sorted(mine), f"{where}: consumer {c}, producer {pid}: {mine}"
    s = await consumers[0].stats()
    assert (s.size, s.closed, s.pending_enqueues, s.pending_dequeues, s.held) == (
        0,
        True,
        0,
        0,
        0,
    ), f"{where}: {s}"
    assert s.enqueued_total == s.dequeued_total == sum(want.values()), f"{where}: {s}"
    q0 = consumers[0]
    waiting = await q0._client.commands.hget(q0._keys[0], "w")
    assert int(waiting or 0) == await q0._client.commands.zcard(q0._keys[4]), where


@pytest.mark.parametrize("kind", ["fifo", "shuffle"])
async def test_concurrent_exactly_once(make_client, kind: str) -> None:
    for seed in range(8):
        await concurrent_round(make_client, kind, seed)


# -- cancellation atomicity (base.py module docstring) ---------------------------------------


class _NeverWoken:
    """A blocking connection whose BLPOP never returns: its caller sleeps until cancelled,
    like a waiter the event loop has not resumed yet when its attempt completes."""

    async def blpop(self, keys: Any, timeout: float = 0) -> None:
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        return None


async def _stat(q: qps.QueueBase, **want: Any) -> bool:
    s = await q.stats()
    return all(getattr(s, k) == v for k, v in want.items())


@pytest.mark.parametrize("op", ["dequeue", "enqueue"])
async def test_cancelled_blocked_call_leaves_no_trace(make_client, op: str) -> None:
    b = await make_client()
    a = transport.from_redis(b.commands, _NeverWoken())  # not closed: it borrows b's pool
    qa = qps.FIFOQueue(1, I64, shapes=[[]], shared_name="cx", client=a)
    qb = qps.FIFOQueue(1, I64, shapes=[[]], shared_name="cx", client=b)
    if op == "dequeue":
        task = asyncio.create_task(qa.dequeue())
        await until(lambda: _stat(qb, pending_dequeues=1))
        await qb.enqueue(I64(7))  # completes the pending dequeue in Redis
        await until(lambda: _stat(qb, pending_dequeues=0, size=0))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await qb.size() == 1, "a cancelled dequeue lost its element"
        assert int(await qb.dequeue_nowait()) == 7
    else:
        await qb.enqueue(I64(1))
        task = asyncio.create_task(qa.enqueue(I64(2)))
        await until(lambda: _stat(qb, pending_enqueues=1))
        assert int(await qb.dequeue()) == 1  # makes room: the pending enqueue completes
        await until(lambda: _stat(qb, pending_enqueues=0, size=1))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # It completed before the cancellation reached it: its element is in the queue
        # exactly once (an insertion that others may consume cannot be undone).
        assert await qb.size() == 1
        assert int(await qb.dequeue_nowait()) == 2
        assert await qb.size() == 0

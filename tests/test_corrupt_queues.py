"""The queue part of the corruption suite: every key kind of a queue, corrupted with raw
Redis commands, then every public operation and the listings on it, on a healthy
neighbour in the same container and on a neighbour container.

Each case sets up three queues of one kind and layout (the target ``cq/t``, its
neighbour ``cq/n`` and ``cn/n`` in another container), holds one acknowledged delivery
of the target (so that its held list and lease exist), applies one corruption, and then
runs the operations. Every operation must either behave correctly (the elements it
returns are ones that were enqueued, none twice) or raise a qps error naming a key of
the target queue; never another exception, never a wait that times out. The
expectation of a case says more: ``quarantine`` (the corrupt element goes to the dead
letters and every dequeue still gets good elements), ``error`` (some operation raises
a qps error naming the corrupted key), ``any`` (either). The neighbour container's keys
must be byte-identical afterwards, and the neighbour queue must work as if nothing
happened. ``qps queue ls``/``stat`` run through the library calls the CLI uses on every
backend, and through the CLI itself on the real server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import qps
from qps import keys, wire
from qps.cli.main import cli
from qps.errors import OutOfRangeError, QpsError
from qps.queues.inspect import BrokenQueue, QueueStats, scan_queues
from tests.corruption import assert_same, container_dump

CAP = 20
SHAPES = {"plain": [2], "large": [300_000], "batch": [2048]}  # large: 1.2 MB, in 2 chunks
KINDS = ("fifo", "shuffle", "priority")
WAIT = 5.0  # a dequeue that waits this long has hung: the case fails


def make(client: qps.Client, kind: str, layout: str, container: str, name: str) -> Any:
    shape = SHAPES[layout]
    common: dict[str, Any] = {"shared_name": name, "container": container, "client": client}
    if kind == "fifo":
        return qps.FIFOQueue(CAP, np.float32, shapes=[shape], **common)
    if kind == "shuffle":
        return qps.RandomShuffleQueue(CAP, 0, np.float32, shapes=[shape], seed=1, **common)
    return qps.PriorityQueue(CAP, np.float32, shapes=[shape], **common)


def one(kind: str, layout: str, i: int) -> Any:
    arr = np.full(SHAPES[layout], i, np.float32)
    return [np.int64(i), arr] if kind == "priority" else arr


def many(kind: str, layout: str, ids: list[int]) -> Any:
    arr = np.stack([np.full(SHAPES[layout], i, np.float32) for i in ids])
    return [np.array(ids, np.int64), arr] if kind == "priority" else arr


def ids_of(kind: str, value: Any, batched: bool) -> list[int]:
    """The ids of the elements a dequeue returned (each element is filled with its id)."""
    arr = np.asarray(value[1] if kind == "priority" else value)
    rows = arr if batched else arr[None]
    out = []
    for row in rows:
        assert (row == row.flat[0]).all(), "an element mixes the bytes of several"
        out.append(int(row.flat[0]))
    return out


async def fill(q: Any, kind: str, layout: str) -> list[int]:
    if layout == "batch":  # one buffer of 10 rows
        await q.enqueue_many(many(kind, layout, list(range(10))))
        return list(range(10))
    for i in range(4):
        await q.enqueue(one(kind, layout, i))
    return list(range(4))


# -- the corruptions ---------------------------------------------------------------------


@dataclass
class Ctx:
    r: Any  # redis-py commands
    prefix: str  # the target's key prefix
    kind: str
    held: str  # the id of the target's held acknowledged delivery

    async def call(self, *args: Any) -> Any:
        return await self.r.execute_command(*args)

    async def first(self) -> bytes:
        """The first stored value (a priority queue's with its 24-byte key)."""
        items = self.prefix + "items"
        if self.kind == "shuffle":
            return bytes(await self.call("HGET", items, 0))
        if self.kind == "priority":
            return bytes((await self.call("ZRANGE", items, 0, 0))[0])
        return bytes(await self.call("LINDEX", items, 0))

    async def replace_first(self, value: bytes) -> None:
        """Replace the first stored value by ``value`` (a priority queue keeps its key)."""
        items = self.prefix + "items"
        if self.kind == "shuffle":
            await self.call("HSET", items, 0, value)
        elif self.kind == "priority":
            old = await self.first()
            await self.call("ZREM", items, old)
            await self.call("ZADD", items, 0, old[:24] + value)
        else:
            await self.call("LSET", items, 0, value)

    async def stored_ref(self) -> bytes:
        v = await self.first()
        return v[24:] if self.kind == "priority" else v

    async def wrong_type(self, key: str) -> None:
        """A value of another type at ``key``: a string, or a hash where a string belongs."""
        string = (await self.call("TYPE", key)) in (b"string", "string")
        await self.call("DEL", key)
        if string:
            await self.call("HSET", key, "f", "v")
        else:
            await self.call("SET", key, "not a hash, list or zset")


Corrupt = Callable[[Ctx], Awaitable[str]]  # returns the key it corrupted


@dataclass(frozen=True)
class Case:
    id: str
    fn: Corrupt
    expect: str  # quarantine | error | any
    layouts: tuple[str, ...] = ("plain",)
    kinds: tuple[str, ...] = KINDS


def hset(field: str, value: Any) -> Corrupt:
    async def fn(c: Ctx) -> str:
        await c.call("HSET", c.prefix + "meta", field, value)
        return c.prefix + "meta"

    return fn


def hdel(field: str) -> Corrupt:
    async def fn(c: Ctx) -> str:
        await c.call("HDEL", c.prefix + "meta", field)
        return c.prefix + "meta"

    return fn


def wrong_type(name: str) -> Corrupt:
    async def fn(c: Ctx) -> str:
        await c.wrong_type(c.prefix + name)
        return c.prefix + name

    return fn


def element(value: bytes) -> Corrupt:
    async def fn(c: Ctx) -> str:
        await c.replace_first(value)
        return c.prefix + "items"

    return fn


async def _truncated(c: Ctx) -> str:
    await c.replace_first(wire.encode([np.zeros(2, np.float32)])[:20])
    return c.prefix + "items"


async def _wrong_dtype(c: Ctx) -> str:
    await c.replace_first(wire.encode([np.zeros(2, np.float64)]))
    return c.prefix + "items"


async def _wrong_shape(c: Ctx) -> str:
    await c.replace_first(wire.encode([np.zeros(3, np.float32)]))
    return c.prefix + "items"


async def _priority_short_member(c: Ctx) -> str:
    await c.call("ZADD", c.prefix + "items", 0, b"\x00" * 10)
    return c.prefix + "items"


def push(name: str, value: bytes) -> Corrupt:
    async def fn(c: Ctx) -> str:
        await c.call("RPUSH", c.prefix + name, value)
        return c.prefix + name

    return fn


async def _lease_garbage(c: Ctx) -> str:
    await c.call("ZADD", c.prefix + "lease", 0, b"garbage")
    return c.prefix + "lease"


async def _held_garbage(c: Ctx) -> str:
    await c.call("LSET", f"{c.prefix}a:{c.held}:h", 0, b"\x00garbage")
    return f"{c.prefix}a:{c.held}:h"


async def _held_wrong_type(c: Ctx) -> str:
    await c.wrong_type(f"{c.prefix}a:{c.held}:h")
    return f"{c.prefix}a:{c.held}:h"


async def _chunk_key(c: Ctx) -> str:
    ref = await c.stored_ref()
    bid = ref.split(b"|")[1].decode()
    return f"{c.prefix}b:{bid}:0"


async def _spoil_string(c: Ctx, key: str, how: str) -> None:
    """Spoil string ``key`` (a chunk, a buffer): of the wrong type, missing, cut to 100
    bytes, or (``garbage``) the same length of other bytes."""
    if how == "wrongtype":
        await c.wrong_type(key)
    elif how == "missing":
        await c.call("DEL", key)
    elif how == "truncated":
        await c.call("SET", key, (await c.call("GET", key))[:100])
    else:
        assert how == "garbage", how
        await c.call("SET", key, b"\xee" * len(await c.call("GET", key)))


def chunk(how: str) -> Corrupt:
    async def fn(c: Ctx) -> str:
        key = await _chunk_key(c)
        await _spoil_string(c, key, how)
        return key

    return fn


def buffer(how: str) -> Corrupt:
    async def fn(c: Ctx) -> str:
        ref = await c.stored_ref()
        key = f"{c.prefix}b:{ref.split(b'|')[1].decode()}"
        if how == "count":  # the count of unread rows
            await c.call("SET", key + ":u", b"abc")
            return key + ":u"
        await _spoil_string(c, key, how)
        return key

    return fn


async def _entry_rows_huge(c: Ctx) -> str:
    ref = await c.stored_ref()
    parts = ref.split(b"|")
    if c.kind in ("fifo",):
        parts[3] = b"1000000"  # a QB entry: a million rows of a buffer of 9
    else:
        parts[2] = b"1000000"  # a QS row far beyond its buffer
    await c.replace_first(b"|".join(parts))
    return c.prefix + "items"


BIG = str(2**63)
CASES = [
    # meta: the hash itself, the spec, every field the scripts read
    Case("meta-wrongtype", wrong_type("meta"), "error"),
    Case("meta-no-spec", hdel("spec"), "error"),
    Case("meta-spec-not-json", hset("spec", "{not json"), "error"),
    Case("meta-spec-incomplete", hset("spec", '{"kind":"fifo"}'), "error"),
    Case("meta-no-kind", hdel("kind"), "error"),
    Case("meta-kind-garbage", hset("kind", "zzz"), "error"),
    Case("meta-no-cap", hdel("cap"), "error"),
    Case("meta-cap-garbage", hset("cap", "abc"), "error"),
    Case("meta-cap-2**63", hset("cap", BIG), "error"),
    Case("meta-closed-garbage", hset("closed", "7"), "error"),
    Case("meta-x-negative", hset("x", -100), "error"),
    Case("meta-x-fraction", hset("x", "0.5"), "error"),
    Case("meta-n-100", hset("n", 100), "any"),  # shuffle: refused; others: unused
    Case("meta-n-negative", hset("n", -1), "error"),
    Case("meta-w-negative", hset("w", -1), "error"),
    Case("meta-w-garbage", hset("w", "abc"), "error"),
    Case("meta-enq-negative", hset("enq", -5), "error"),
    Case("meta-deq-2**63", hset("deq", BIG), "error"),
    Case("meta-rng-zero", hset("rng", 0), "error"),
    Case("meta-rng-garbage", hset("rng", "\xff\xfe"), "error"),
    Case("meta-seq-negative", hset("seq", -3), "error"),
    # items: the key, and its elements (any value a stored element can be)
    Case("items-wrongtype", wrong_type("items"), "error"),
    Case("items-garbage", element(b"\x00garbage not a qps message"), "quarantine"),
    Case("items-empty", element(b""), "quarantine"),
    Case("items-truncated-header", _truncated, "quarantine"),
    Case("items-wrong-dtype", _wrong_dtype, "quarantine"),
    Case("items-wrong-shape", _wrong_shape, "quarantine"),
    Case("items-ref-negative", element(b"QR|zz.1.0|-3|-5"), "quarantine"),
    Case("items-ref-huge-count", element(b"QR|zz.1.0|99999999999|5"), "quarantine"),
    Case("items-ref-missing", element(b"QR|zz.1.0|1|100"), "quarantine"),
    Case("items-ref-bytes-mismatch", element(b"QR|zz.1.0|1|99999999"), "quarantine"),
    Case("items-entry-missing", element(b"QB|zz|0|1000|8"), "quarantine", kinds=("fifo",)),
    Case("items-entry-zero-rows", element(b"QB|zz|0|0|8"), "quarantine", kinds=("fifo",)),
    Case("items-entry-negative", element(b"QB|zz|-1|-5|8"), "quarantine", kinds=("fifo",)),
    Case("items-row-missing", element(b"QS|zz|0|8"), "quarantine"),
    Case("items-row-garbage", element(b"QS|zz|x|y"), "quarantine"),
    Case("items-short-member", _priority_short_member, "quarantine", kinds=("priority",)),
    # the attempt lists, the lease, the dead letters, the held delivery
    Case("ew-wrongtype", wrong_type("ew"), "error"),
    Case("ew-garbage", push("ew", b"zzz"), "any"),
    Case("dw-wrongtype", wrong_type("dw"), "error"),
    Case("dw-garbage", push("dw", b"d|abc"), "error"),
    Case("lease-wrongtype", wrong_type("lease"), "error"),
    Case("lease-garbage", _lease_garbage, "any"),
    Case("dlq-wrongtype", wrong_type("dlq"), "error"),
    Case("held-wrongtype", _held_wrong_type, "error"),
    Case("held-garbage", _held_garbage, "quarantine"),
    # a large element's chunks
    *(
        Case(f"chunk-{h}", chunk(h), "quarantine", layouts=("large",))
        for h in ("wrongtype", "missing", "truncated", "garbage")
    ),
    # a batch's buffer and its count of unread rows
    *(
        Case(f"buffer-{h}", buffer(h), "quarantine", layouts=("batch",))
        for h in ("wrongtype", "missing", "truncated", "garbage")
    ),
    Case("buffer-count-garbage", buffer("count"), "any", layouts=("batch",)),
    # more rows than the buffer holds: set aside, or (a list queue's count of rows
    # goes negative as the phantom rows leave) refused naming the meta hash
    Case("batch-rows-huge", _entry_rows_huge, "any", layouts=("batch",)),
]

PARAMS = [
    pytest.param(kind, layout, case, id=f"{kind}-{layout}-{case.id}")
    for case in CASES
    for layout in case.layouts
    for kind in case.kinds
]


# -- running a case ------------------------------------------------------------------------


@dataclass
class Outcome:
    what: str
    value: Any = None
    error: BaseException | None = None


async def attempt(what: str, aw: Awaitable[Any]) -> Outcome:
    try:
        return Outcome(what, await asyncio.wait_for(aw, 4 * WAIT))
    except QpsError as exc:
        return Outcome(what, error=exc)
    except asyncio.TimeoutError:  # hung past every timeout it was given
        return Outcome(what, error=AssertionError(f"{what} hung"))


async def operations(q: Any, kind: str, layout: str, held: qps.Delivery) -> list[Outcome]:
    """Every public operation on ``q``: enqueues first (4 new elements, ids 100-103),
    then 4 elements' worth of dequeues, the close, a dequeue_up_to on the closed queue,
    and the reads."""
    out = [
        await attempt("size", q.size()),
        await attempt("stats", q.stats()),
        await attempt("peek", q.peek(2)),
        await attempt("is_closed", q.is_closed()),
        await attempt("nack", q.nack(held)),
        await attempt("enqueue", q.enqueue(one(kind, layout, 100), timeout=WAIT)),
        await attempt("enqueue_many", q.enqueue_many(many(kind, layout, [101, 102, 103]))),
        await attempt("dequeue", q.dequeue(timeout=WAIT)),
        await attempt("dequeue_many", q.dequeue_many(2, timeout=WAIT)),
    ]
    acked = await attempt("dequeue_acked", q.dequeue_acked(timeout=WAIT))
    out.append(acked)
    if acked.error is None:
        out.append(await attempt("ack", q.ack(acked.value)))
        acked.value = acked.value.value
    reopened = make(q._client, kind, layout, q.container, q.name)
    out += [
        await attempt("reopen", reopened.size()),
        await attempt("close", q.close(cancel_pending_enqueues=True)),
        await attempt("dequeue_up_to", q.dequeue_up_to(CAP, timeout=WAIT)),  # the rest
        await attempt("size", q.size()),
        await attempt("stats", q.stats()),
    ]
    return out


def delivered(kind: str, outcomes: list[Outcome]) -> list[int]:
    ids: list[int] = []
    for o in outcomes:
        if o.error is None and o.what.startswith("dequeue"):
            ids += ids_of(kind, o.value, o.what in ("dequeue_many", "dequeue_up_to"))
    return ids


async def cli_views(url: str | None, prefix: str) -> list[str]:
    """``qps queue ls`` and ``stat`` on the target's container (real servers only);
    returns problems found."""
    if url is None:
        return []
    problems = []
    runner = CliRunner()
    ls = await asyncio.to_thread(
        runner.invoke, cli, ["queue", "ls", "--url", url, "--container", "cq"]
    )
    lines = ls.output.splitlines()
    if ls.exit_code not in (0, 1) or not any(line.split()[:1] == ["n"] for line in lines):
        problems.append(f"queue ls: exit {ls.exit_code}: {ls.output}")
    if ls.exit_code == 1 and not any(line.startswith("t: BROKEN: ") for line in lines):
        problems.append(f"queue ls exits 1 without a BROKEN line: {ls.output}")
    st = await asyncio.to_thread(
        runner.invoke, cli, ["queue", "stat", "t", "--url", url, "--container", "cq"]
    )
    if st.exit_code not in (0, 1) or (st.exit_code == 1 and prefix not in st.output):
        problems.append(f"queue stat: exit {st.exit_code}: {st.output}")
    return problems


@pytest.fixture
def cli_url(request: pytest.FixtureRequest, backend: str) -> str | None:
    if backend == "redis":
        return str(request.getfixturevalue("server_url"))
    if backend == "cluster":
        return str(request.getfixturevalue("cluster_url"))
    return None


@pytest.mark.parametrize(("kind", "layout", "case"), PARAMS)
async def test_corrupt_queue(client, cli_url, kind: str, layout: str, case: Case) -> None:
    target = make(client, kind, layout, "cq", "t")
    neighbour = make(client, kind, layout, "cq", "n")
    other = make(client, kind, layout, "cn", "n")
    stored = await fill(target, kind, layout)
    for q in (neighbour, other):
        await fill(q, kind, layout)
    held = await target.dequeue_acked(timeout=WAIT)
    prefix = keys.queue_prefix("cq", "t")
    ctx = Ctx(client.commands, prefix, kind, held.tokens[0])
    before = await container_dump(client, "cn")

    key = await case.fn(ctx)
    outcomes = await operations(target, kind, layout, held)
    listed = await attempt("scan_queues", scan_queues(client, "cq"))
    problems = await cli_views(cli_url, prefix)

    # every outcome: correct, or a qps error naming a key of the target
    for o in outcomes:
        if o.error is None:
            continue
        if o.what == "dequeue_up_to" and isinstance(o.error, OutOfRangeError):
            continue  # closed and empty: what it answers then
        if not isinstance(o.error, QpsError) or prefix not in str(o.error):
            problems.append(f"{o.what}: {type(o.error).__name__}: {o.error}")
    ids = delivered(kind, outcomes)
    if len(set(ids)) != len(ids) or not set(ids) <= {*stored, 100, 101, 102, 103}:
        problems.append(f"delivered {ids}")
    named = [o for o in outcomes if o.error is not None and key in str(o.error)]
    if case.expect == "error" and not named:
        problems.append(f"no operation names {key}")
    if case.expect == "quarantine":
        # peek only reads: it reports a corrupt element (naming the key), moving nothing
        skip = ("peek", "dequeue_up_to")
        failed = [o.what for o in outcomes if o.error is not None and o.what not in skip]
        if failed:
            problems.append(f"failed: {failed}")
        dlq = await client.commands.llen(prefix + "dlq")
        if dlq < 1:
            problems.append("nothing was set aside")
    # the listing: the neighbour as it is, the target listed or marked broken
    if listed.error is not None:
        problems.append(f"scan_queues: {listed.error!r}")
    else:
        by_name = {s.name: s for s in listed.value}
        n = by_name.get("n")
        if not isinstance(n, QueueStats) or n.size != len(stored):
            problems.append(f"the neighbour is listed as {n!r}")
        t = by_name.get("t")
        if isinstance(t, BrokenQueue) and prefix not in t.error:
            problems.append(f"the target is broken without a key: {t.error}")
    assert_same(before, await container_dump(client, "cn"), "the neighbour container")
    assert not problems, "\n".join(problems)

    # the neighbours work as if nothing happened
    for q in (neighbour, other):
        assert await q.size() == len(stored)
        await q.enqueue(one(kind, layout, 100))
        got = await q.dequeue_many(len(stored) + 1, timeout=WAIT)
        assert sorted(ids_of(kind, got, True)) == [*stored, 100]
        assert (await q.stats()).dead_letters == 0

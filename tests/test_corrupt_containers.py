"""Corruption suite: the container registry and the container-level keys.

Each case corrupts one key with raw Redis commands: the legacy registry
``qps:containers``, a container's registration ``qps:{C}:registered``, its registry sets
``qps:{C}:queues`` / ``:counters`` / ``:variables``, or a counter's value
``qps:{C/c/<name>}:value`` (wrong type of key, garbage members, invalid names,
values that are no int64). Then every listing and inspection runs on the corrupt
container and on a healthy neighbour, through the library (every backend) and the CLI
(real server, and cluster): each either behaves correctly or reports what is wrong
naming the key (``problems``, ``note:`` lines, a ``DataLossError``), never a bare Python
exception, never hiding the neighbour; the neighbour's keys stay byte-identical until
it is reset itself, and resetting the corrupt container deletes all of it.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import qps
from qps import keys, registry
from qps.cli.main import cli
from qps.containers import Counter, container_stats, list_counters, reset
from qps.errors import DataLossError
from tests.corruption import assert_same, dump_all, of_container

Commands = Any
Corrupt = Callable[[Commands, str], Awaitable[None]]


@dataclass(frozen=True)
class Case:
    """One corruption: ``target`` names the key (given the container), ``corrupt``
    damages it; ``kind`` says what is expected (see :func:`check_library`)."""

    id: str
    target: str  # "legacy", "registration", "queues", "counters", "variables", "value"
    corrupt: Corrupt
    kind: str  # "reported": the key is named in problems; "fine": nothing to report;
    # "unregistered": the container lists only when discovered


def key_of(target: str, container: str) -> str:
    if target == "legacy":
        return keys.CONTAINERS
    if target == "registration":
        return keys.registration(container)
    if target == "value":
        return keys.counter_key(container, "global_step")
    tag = {"queues": "q", "counters": "c", "variables": "v"}[target]
    return keys.container_registry(container, tag)


def as_type(kind: str) -> Corrupt:
    """Replace the key by one of type ``kind``."""

    async def go(r: Commands, key: str) -> None:
        await r.delete(key)
        if kind == "string":
            await r.set(key, "x")
        elif kind == "hash":
            await r.hset(key, "f", "v")
        elif kind == "list":
            await r.rpush(key, "v")
        elif kind == "set":
            await r.sadd(key, "v")
        else:
            await r.zadd(key, {"v": 1})

    return go


def member(value: bytes | str) -> Corrupt:
    async def go(r: Commands, key: str) -> None:
        await r.sadd(key, value)

    return go


def value(raw: bytes) -> Corrupt:
    async def go(r: Commands, key: str) -> None:
        await r.set(key, raw)

    return go


async def _delete(r: Commands, key: str) -> None:
    await r.delete(key)


TYPES = ["string", "hash", "list", "set", "zset"]
BAD_CONTAINER_NAMES: list[bytes | str] = ["*", "a\nb", b"\xff\xfe", "", "x" * 129, "a/b", "{a}"]
BAD_RESOURCE_NAMES: list[bytes | str] = [b"\xff", "a\nb", "", "x" * 201, "a b", "{x}"]
BAD_INT64: list[bytes] = [b"abc", b"1.5", b"", b" 12", b"\xff", b"9223372036854775808",
                          b"99999999999999999999", b"0x10"]  # fmt: skip


def _cases() -> list[Case]:
    out: list[Case] = []
    for t in TYPES:
        if t != "set":
            out.append(Case(f"legacy-{t}", "legacy", as_type(t), "reported"))
    for i, m in enumerate(BAD_CONTAINER_NAMES):
        out.append(Case(f"legacy-member{i}", "legacy", member(m), "reported"))
    for t in TYPES:
        if t != "string":
            out.append(Case(f"registration-{t}", "registration", as_type(t), "fine"))
    out.append(Case("registration-garbage", "registration", value(b"\xff\x00"), "fine"))
    out.append(Case("registration-missing", "registration", _delete, "unregistered"))
    for target in ("queues", "counters", "variables"):
        for t in TYPES:
            if t != "set":
                out.append(Case(f"{target}-{t}", target, as_type(t), "reported"))
        for i, m in enumerate(BAD_RESOURCE_NAMES):
            out.append(Case(f"{target}-member{i}", target, member(m), "reported"))
        out.append(Case(f"{target}-ghost", target, member("ghost"), "fine"))
    for i, raw in enumerate(BAD_INT64):
        out.append(Case(f"value-{i}", "value", value(raw), "reported"))
    for t in TYPES:
        if t != "string":
            out.append(Case(f"value-{t}", "value", as_type(t), "reported"))
    return out


CASES = _cases()


async def populate(client: qps.Client, container: str) -> None:
    """A queue holding one element, a counter at 41 and a variable."""
    async with qps.Session(container=container, client=client) as s:
        await s.fifo_queue(5, np.int64, shapes=[[]], shared_name="q").enqueue(np.int64(7))
        await s.counter("global_step").add(41)
        await s.variable("w", (3,), np.float32, initializer="ones").create()


def _stats_view(s: Any) -> dict[str, Any]:
    d = s.as_dict()
    for k in ("memory_bytes", "memory_by_kind", "memory_note"):
        d.pop(k)
    return d


def _names(problems: Any) -> str:
    return "\n".join(problems)


# -- library, every backend ---------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_library_on_a_corrupt_container(client: qps.Client, case: Case) -> None:
    bad, good = "bad", "bad.n"  # the neighbour's name starts with the corrupt one's
    await populate(client, bad)
    await populate(client, good)
    good_stats = _stats_view(await container_stats(client, good, memory=False))
    good_row = next(r for r in await registry.container_summaries(client) if r.name == good)
    key = key_of(case.target, bad)
    if case.target == "legacy":  # as an earlier version wrote it, then damaged
        await client.commands.sadd(keys.CONTAINERS, good)
    await case.corrupt(client.commands, key)
    before = await dump_all(client)

    # listing: never raises; the neighbour is there, as it was
    found = await registry.listing(client)
    assert good in found.names
    assert (bad in found.names) == (case.kind != "unregistered")
    assert bad in (await registry.listing(client, discover=True)).names
    if case.target == "legacy":
        assert any(key in p for p in found.problems), found.problems
        assert all(registry.valid_container(n) for n in found.names)
    else:
        assert found.problems == ()
    rows = {r.name: r for r in await registry.container_summaries(client, discover=True)}
    assert rows[good] == good_row
    if case.target in ("queues", "counters", "variables") and case.id.endswith(tuple(TYPES)):
        assert rows[bad].resources[case.target] is None
        assert any(key in p for p in rows[bad].problems)

    # stats: the neighbour unchanged; the corrupt one reports the key, or is right
    assert _stats_view(await container_stats(client, good, memory=False)) == good_stats
    s = await container_stats(client, bad)
    assert s.registered == (case.kind != "unregistered")
    if case.kind == "reported" and case.target != "legacy":
        assert any(key in p for p in s.problems), s.problems
    else:
        assert s.problems == ()
    if case.target == "value":
        assert "global_step" not in s.counters
    elif case.target != "counters" or case.id.endswith("ghost") or "member" in case.id:
        assert s.counters == {"global_step": 41}
    if case.id.endswith("ghost"):
        assert "ghost" in s.resources[case.target]
    for names in s.resources.values():
        for n in names:
            keys.check_name(n)  # only valid names are reported as resources

    # a counter on a corrupt value (or registry): DataLossError naming the key, no change
    if case.target == "value" or (case.target == "counters" and case.id.endswith(tuple(TYPES))):
        for op in ("get", "add", "set"):
            c = Counter("global_step", container=bad, client=client)
            with pytest.raises(DataLossError, match=re.escape(key)):
                await (c.get() if op == "get" else getattr(c, op)(1))
        if case.target == "counters":
            with pytest.raises(DataLossError, match="counters"):
                await list_counters(client, bad)
    elif case.target != "legacy":
        assert await Counter("global_step", container=bad, client=client).get() == 41
        await Counter("global_step", container=bad, client=client).set(41)

    after = await dump_all(client)
    assert_same(of_container(before, good), of_container(after, good), good)
    if case.target != "registration" or case.kind == "fine":
        assert_same(of_container(before, bad), of_container(after, bad), bad)

    # resetting the neighbour leaves the corrupt one as it is, and the other way round
    [r] = await reset(client, [good])
    assert r.existed and r.skipped is None
    assert_same(of_container(after, bad), of_container(await dump_all(client), bad), bad)
    await populate(client, good)
    good_keys = of_container(await dump_all(client), good)
    if case.target == "legacy":
        results = await reset(client, None)  # every container; invalid entries skipped
        done = {r.container for r in results if r.skipped is None}
        assert {bad, good} <= done
        skipped = [r for r in results if r.skipped is not None]
        assert all(keys.CONTAINERS in r.skipped for r in skipped)  # type: ignore[operator]
        assert len(skipped) == ("member" in case.id)
        assert await registry.list_containers(client) == []
    else:
        [r] = await reset(client, [bad])
        assert r.existed and r.clean
        assert of_container(await dump_all(client), bad) == {}
        assert_same(good_keys, of_container(await dump_all(client), good), good)
        assert await registry.list_containers(client) == [good]


# -- CLI, real server (and cluster) -------------------------------------------------------------


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def run(coro: Awaitable[Any]) -> Any:
    async def go() -> Any:
        return await coro

    return asyncio.run(go())


async def _dump(url: str, *containers: str) -> dict[str, Any]:
    async with await qps.connect(url) as c:
        d = await dump_all(c)
    return {n: of_container(d, n) for n in containers}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_on_a_corrupt_container(redis_url: str, case: Case) -> None:
    tag = secrets.token_hex(3)
    bad, good = f"cc{tag}", f"cc{tag}x"

    async def setup() -> None:
        async with await qps.connect(redis_url) as c:
            await populate(c, bad)
            await populate(c, good)

    run(setup())
    good_stat = invoke("container", "stat", good, "--no-memory", "--url", redis_url)
    assert good_stat.exit_code == 0, good_stat.output
    key = key_of(case.target, bad)

    async def corrupt() -> None:
        async with await qps.connect(redis_url) as c:
            if case.target == "legacy":
                await c.commands.sadd(keys.CONTAINERS, bad)  # restored below
            await case.corrupt(c.commands, key)

    run(corrupt())
    try:
        before = run(_dump(redis_url, bad, good))
        r = invoke("container", "ls", "--url", redis_url)
        assert r.exit_code == 0, r.output
        assert "Traceback" not in r.output
        rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[1:]}
        assert rows[good] == ["1", "1", "1", "0"]
        assert (bad in rows) == (case.kind != "unregistered")
        if case.target == "legacy" or (
            case.target in ("queues", "counters", "variables") and case.id.endswith(tuple(TYPES))
        ):
            assert "note: " in r.stderr and key in r.stderr, r.stderr
        r = invoke("container", "ls", "--url", redis_url, "--json", "--scan")
        assert r.exit_code == 0 and {good, bad} <= {x["name"] for x in json.loads(r.stdout)}

        r = invoke("container", "stat", bad, "--no-memory", "--url", redis_url)
        assert r.exit_code == 0, r.output
        if case.kind == "reported" and case.target != "legacy":
            assert any(
                line.startswith("problem") and key in line for line in r.stdout.splitlines()
            ), r.stdout
        r = invoke("container", "stat", good, "--no-memory", "--url", redis_url)
        assert r.exit_code == 0 and r.stdout == good_stat.stdout

        after = run(_dump(redis_url, bad, good))
        assert_same(before[good], after[good], good)
        assert_same(before[bad], after[bad], bad)
        r = invoke("container", "reset", bad, "--yes", "--url", redis_url)
        assert r.exit_code == 0, r.output
        after = run(_dump(redis_url, bad, good))
        assert after[bad] == {}
        assert_same(before[good], after[good], good)
    finally:

        async def clean() -> None:
            async with await qps.connect(redis_url) as c:
                if case.target == "legacy":
                    await c.commands.delete(keys.CONTAINERS)
                await reset(c, [bad, good])

        run(clean())

"""Resource containers, counters, ``qps.Session``, ``qps.reset`` and ``qps container``.

The library tests run on both backends (``client``/``make_client``); the CLI tests run
through click's CliRunner against the real server (``redis_url``), each in containers
of its own, as tests/test_cli.py does.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import qps
from qps import containers, keys
from qps.cli import container as cli_container
from qps.cli.main import cli
from qps.containers import Counter, container_stats, list_containers, reset
from qps.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
)
from tests.conftest import until
from tests.corruption import dump_all, of_container

# -- helpers -------------------------------------------------------------------------------


async def populate(client: qps.Client, container: str, big: bool = False) -> None:
    """Queues of each type (one with a chunked large element) and two counters."""
    async with qps.Session(container=container, client=client) as s:
        q = s.fifo_queue(10, [np.float32, np.int64], shapes=[[3], []], shared_name="q")
        await q.enqueue_many([np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2])])
        sq = s.random_shuffle_queue(10, 0, np.int32, shapes=[[]], seed=3, shared_name="shuf")
        await sq.enqueue_many(np.arange(5, dtype=np.int32))
        pq = s.padding_fifo_queue(10, [np.int32], shapes=[[None]], shared_name="pad")
        await pq.enqueue([np.arange(3, dtype=np.int32)])
        prq = s.priority_queue(10, [np.int32], shapes=[[]], shared_name="prio")
        await prq.enqueue([5, np.int32(7)])
        # names that look like other containers' names must stay in this container
        await s.fifo_queue(3, np.int32, shapes=[[]], shared_name="b").enqueue(1)
        if big:
            lq = s.fifo_queue(2, np.float32, shapes=[[400_000]], shared_name="large")
            await lq.enqueue(np.ones(400_000, np.float32))  # 1.6 MB: stored in chunks
        await s.counter("global_step").add(41)
        await s.counter("epochs", initial=3).get()


# -- key layout (pure) ---------------------------------------------------------------------


def test_key_patterns_and_parsing() -> None:
    assert keys.counter_key("job", "global_step") == "qps:{job/c/global_step}:value"
    assert keys.container_counters("job") == "qps:{job}:counters"
    assert keys.container_queues("job") == keys.container_registry("job", "q")
    assert keys.variable_prefix("job", "w") == "qps:{job/v/w}:"
    assert keys.container_key_patterns("a") == ("qps:{a}:*", "qps:{a/*")
    assert keys.container_of(b"qps:{a/q/x}:meta") == "a"
    assert keys.container_of("qps:{ab}:queues") == "ab"
    assert keys.container_of("qps:{a:b/c/n}:value") == "a:b"
    assert keys.container_of("qps:containers") is None
    assert keys.container_of("other") is None
    assert keys.kind_of("qps:{a/q/x/y}:a:1:p") == "q"
    assert keys.kind_of("qps:{a}:queues") is None
    assert keys.glob_escape("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"


@pytest.mark.parametrize("bad", ["a\n", "job\n", "", "a b", "a{b", "x" * 129])
def test_names_with_a_final_newline_are_refused(bad: str) -> None:
    """ "$" matched before a final newline: "a\n" passed and split the CLI's output."""
    with pytest.raises(InvalidArgumentError, match="invalid container name"):
        keys.check_container(bad)
    with pytest.raises(InvalidArgumentError, match="invalid resource name"):
        keys.check_name(bad if len(bad) < 129 else "x" * 201)
    assert keys.container_of(f"qps:{{{bad}/q/x}}:meta") is None


# -- isolation and reset ---------------------------------------------------------------------


async def test_reset_leaves_other_containers_byte_identical(client: qps.Client) -> None:
    names = ["a", "ab", "a.b", "a:b", "a-", "b"]
    for c in names:
        await populate(client, c, big=c in ("a", "ab"))
    before = await dump_all(client)
    a_keys = of_container(before, "a")
    assert any(b"/q/large}:b:" in k for k in a_keys)  # chunk keys exist
    assert any(b"/q/large}:b:" in k for k in of_container(before, "ab"))
    for c in names:  # every key of the server belongs to one container: none is shared
        assert of_container(before, c)
    assert {keys.container_of(k) for k in before} == set(names)

    results = await reset(client, ["a"])

    assert len(results) == 1
    r = results[0]
    assert r.container == "a" and r.existed and r.clean
    assert r.keys_deleted == len(a_keys)
    assert r.resources["queues"] == ["b", "large", "pad", "prio", "q", "shuf"]
    assert r.resources["counters"] == ["epochs", "global_step"]
    after = await dump_all(client)
    assert of_container(after, "a") == {}
    for c in names[1:]:
        assert of_container(after, c) == of_container(before, c), c
    assert await list_containers(client) == sorted(names[1:])


async def test_two_jobs_never_see_each_others_resources(make_client: Any) -> None:
    c1, c2 = await make_client(), await make_client()
    async with (
        qps.Session(container="job1", client=c1) as s1,
        qps.Session(container="job2", client=c2) as s2,
    ):
        q1 = s1.fifo_queue(5, np.int32, shapes=[[]], shared_name="input")
        q2 = s2.fifo_queue(5, np.int32, shapes=[[]], shared_name="input")
        await q1.enqueue(1)
        await q2.enqueue_many(np.array([7, 8], np.int32))
        assert await q1.size() == 1 and await q2.size() == 2
        step1 = s1.counter("global_step")
        await step1.add(10)
        assert await s2.counter("global_step").get() == 0
        assert await s1.list_queues() == ["input"] == await s2.list_queues()
        await qps.reset(containers=["job1"], client=c1)
        assert await q2.size() == 2
        assert int(await q2.dequeue()) == 7
        assert await s2.counter("global_step").get() == 0
        with pytest.raises(NotFoundError, match="reset"):
            await q1.enqueue(2)
        with pytest.raises(NotFoundError, match="reset"):
            await step1.get()
        assert await s1.counter("global_step").get() == 0  # a new object creates it anew


async def test_reset_missing_container_is_reported_not_an_error(client: qps.Client) -> None:
    await populate(client, "x")
    before = await dump_all(client)
    [r] = await reset(client, ["nothing-here"])
    assert not r.existed and r.keys_deleted == 0 and r.clean
    assert r.resources == {k: [] for k in containers.KINDS}
    assert await dump_all(client) == before
    assert await reset(client, []) == []


async def test_reset_validates_every_name_before_deleting(client: qps.Client) -> None:
    await populate(client, "x")
    before = await dump_all(client)
    for bad in (["x", "bad name"], ["x", ""], ["x", "a/b"], ["x", "a{b}"], ["x", "é"]):
        with pytest.raises(InvalidArgumentError, match="invalid container name"):
            await reset(client, bad)
    with pytest.raises(InvalidArgumentError, match="list of names"):
        await reset(client, "x")
    with pytest.raises(InvalidArgumentError, match="invalid container name"):
        await qps.reset(containers=["x", "no way"], client=client)
    assert await dump_all(client) == before


async def test_reset_all_containers(client: qps.Client) -> None:
    await populate(client, "one")
    await populate(client, "two")
    await client.commands.set("unrelated", "kept")
    # a container that owns keys but is not registered is found by scanning
    await client.commands.set(keys.counter_key("stray", "n"), 1)
    assert await list_containers(client) == ["one", "two"]
    assert await list_containers(client, discover=True) == ["one", "stray", "two"]
    results = await reset(client, None)
    assert sorted(r.container for r in results) == ["one", "stray", "two"]
    assert all(r.existed and r.keys_deleted > 0 for r in results)
    left = await dump_all(client)
    assert set(left) == {b"unrelated"}


async def test_reset_wakes_blocked_dequeue_with_not_found(make_client: Any) -> None:
    c1, c2 = await make_client(), await make_client()
    async with qps.Session(container="blocked", client=c1) as s:
        q = s.fifo_queue(5, np.int32, shapes=[[]], shared_name="q")
        task = asyncio.create_task(q.dequeue())

        async def waiting() -> bool:
            return (await q.stats()).pending_dequeues == 1

        await until(waiting)
        [r] = await reset(c2, ["blocked"])
        assert r.existed
        with pytest.raises(NotFoundError, match="reset"):
            await asyncio.wait_for(task, timeout=30)
    assert await list_containers(c2) == []
    # keys the dying call might have left behind would show here
    assert of_container(await dump_all(c2), "blocked") == {}


async def test_a_server_of_the_old_layout_keeps_listing_its_containers(client: qps.Client) -> None:
    """Earlier versions registered containers in the shared set ``qps:containers`` only:
    such a container (no registration key) is still listed and counts as registered,
    next to the new ones; a reset takes it out of the set; nothing writes the set."""
    await populate(client, "old")
    await client.commands.unlink(keys.registration("old"))  # as an earlier version left it
    await client.commands.sadd(keys.CONTAINERS, "old")
    await populate(client, "new")
    assert await client.commands.smembers(keys.CONTAINERS) == {b"old"}  # not written
    assert await list_containers(client) == ["new", "old"]
    rows = await containers.container_summaries(client)
    assert [(r.name, r.registered, r.resources["queues"]) for r in rows] == [
        ("new", True, 5),
        ("old", True, 5),
    ]
    assert (await container_stats(client, "old", memory=False)).registered
    [r] = await reset(client, ["old"])
    assert r.existed and r.keys_deleted == len(of_container(await dump_all(client), "new")) - 1
    assert await client.commands.exists(keys.CONTAINERS) == 0
    assert await list_containers(client) == ["new"]


# -- persistence -----------------------------------------------------------------------------


async def test_state_outlives_sessions_and_clients(make_client: Any) -> None:
    first = await make_client()
    async with qps.Session(container="persist", client=first) as s:
        q = s.fifo_queue(10, [np.float32, np.int64], shapes=[[2], []], shared_name="batches")
        await q.enqueue_many([np.array([[1, 2], [3, 4]], np.float32), np.array([5, 6])])
        step = s.counter("global_step")
        assert await step.add(7) == 7
    await first.close()  # the process "restarts"

    second = await make_client()
    async with qps.Session(container="persist", client=second) as s:
        assert await s.list_queues() == ["batches"]
        assert await s.list_counters() == ["global_step"]
        step = s.counter("global_step", initial=100)  # exists: keeps its value
        assert await step.get() == 7
        q = await s.queue("batches")  # found by name, spec read from Redis
        assert isinstance(q, qps.FIFOQueue)
        img, label = await q.dequeue()
        assert img.tolist() == [1.0, 2.0] and int(label) == 5
        q2 = s.fifo_queue(10, [np.float32, np.int64], shapes=[[2], []], shared_name="batches")
        assert await q2.size() == 1
        with pytest.raises(NotFoundError, match="no queue 'nope'"):
            await s.queue("nope")
    assert not second.closed  # a given client is not closed by the session


async def test_session_by_url_owns_its_client(redis_url: str) -> None:
    container = f"url-{secrets.token_hex(4)}"
    async with qps.Session(redis_url, container=container) as s:
        await s.counter("n").add(2)
        client = s.client
        assert repr(s).endswith("open>")
    assert client.closed and s.closed
    async with qps.Session(url=redis_url, container=container) as s:
        assert await s.counter("n").get() == 2
    [r] = await qps.reset(redis_url, [container])
    assert r.existed and r.keys_deleted == 3  # the counter, the counters set, the registration
    async with qps.Session(url=redis_url, container=container) as s:
        assert await s.list_counters() == []


async def test_session_misuse(client: qps.Client) -> None:
    with pytest.raises(InvalidArgumentError, match="invalid container name"):
        qps.Session(container="bad name", client=client)
    with pytest.raises(InvalidArgumentError, match="not both"):
        qps.Session("redis://localhost", client=client)
    s = qps.Session(container="c", client=client)
    with pytest.raises(FailedPreconditionError, match="not open"):
        s.fifo_queue(1, np.int32)
    async with s:
        assert s.client is client
        assert await list_containers(client) == ["c"]  # registered on open
    with pytest.raises(FailedPreconditionError, match="closed"):
        s.counter("n")
    with pytest.raises(FailedPreconditionError, match="closed"):
        await s.open()


# -- counters --------------------------------------------------------------------------------


async def test_counter_get_add_set(client: qps.Client) -> None:
    c = Counter("global_step", container="cnt", client=client, initial=5)
    assert (c.name, c.container) == ("global_step", "cnt")
    assert await c.get() == 5
    assert await c.add() == 6
    assert await c.add(-10) == -4
    assert await c.set(2**63 - 1) == -4
    assert await c.get() == 2**63 - 1  # exact: never through a Lua double
    with pytest.raises(OutOfRangeError, match="overflow"):
        await c.add(1)
    assert await c.get() == 2**63 - 1
    assert await c.set(np.int64(-(2**63))) == 2**63 - 1
    assert await c.get() == -(2**63)
    for bad in (1.5, "3", True, 2**63, None):
        with pytest.raises(InvalidArgumentError):
            await c.add(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        Counter("x", client=client, initial=2**64)
    with pytest.raises(InvalidArgumentError, match="invalid resource name"):
        Counter("bad name", client=client)
    with pytest.raises(InvalidArgumentError, match="invalid container name"):
        Counter("ok", container="a/b", client=client)
    assert await containers.list_counters(client, "cnt") == ["global_step"]
    assert await list_containers(client) == ["cnt"]


async def test_counter_concurrent_adds_are_atomic(make_client: Any) -> None:
    clients = [await make_client() for _ in range(3)]
    counters = [Counter("n", container="atomic", client=c) for c in clients]

    async def bump(c: Counter) -> list[int]:
        return [await c.add(1) for _ in range(50)]

    seen = await asyncio.gather(*(bump(c) for c in counters))
    values = sorted(v for s in seen for v in s)
    assert values == list(range(1, 151))  # every add saw a distinct value
    assert await counters[0].get() == 150


async def test_counter_after_reset_stays_gone(make_client: Any) -> None:
    c1, c2 = await make_client(), await make_client()
    old = Counter("n", container="r", client=c1)
    assert await old.add(3) == 3
    await reset(c2, ["r"])
    for call in (old.get(), old.add(1), old.set(9)):
        with pytest.raises(NotFoundError, match="was it reset"):
            await call
    assert await c2.commands.exists(keys.counter_key("r", "n")) == 0  # not resurrected
    fresh = Counter("n", container="r", client=c2, initial=1)
    assert await fresh.get() == 1


# -- stats and listing -------------------------------------------------------------------------


async def test_container_stats(client: qps.Client, backend: str) -> None:
    await populate(client, "st", big=True)
    await populate(client, "stx")
    s = await container_stats(client, "st")
    assert s.registered
    assert s.resource_counts == {"queues": 6, "counters": 2, "variables": 0, "accumulators": 0}
    assert s.counters == {"epochs": 3, "global_step": 41}
    dump = of_container(await dump_all(client), "st")
    assert s.keys == len(dump)
    assert s.keys_by_kind["counters"] == 2
    assert s.keys_by_kind["container"] == 3  # its registration, queues and counters sets
    assert sum(s.keys_by_kind.values()) == s.keys
    if backend == "fakeredis":
        assert s.memory_bytes is None and s.memory_by_kind is None
        assert s.memory_note is not None and "MEMORY USAGE" in s.memory_note
    else:
        assert s.memory_bytes is not None and s.memory_bytes > 1_600_000  # the large element
        assert s.memory_by_kind is not None and sum(s.memory_by_kind.values()) == s.memory_bytes
        assert s.memory_note is None
    quick = await container_stats(client, "st", memory=False)
    assert quick.memory_bytes is None and quick.keys == s.keys
    assert json.loads(json.dumps(s.as_dict()))["resource_counts"]["queues"] == 6
    with pytest.raises(NotFoundError, match="no container 'nope'"):
        await container_stats(client, "nope")
    with pytest.raises(InvalidArgumentError):
        await container_stats(client, "no pe")
    summaries = await containers.container_summaries(client)
    assert [(x.name, x.resources["queues"], x.resources["counters"]) for x in summaries] == [
        ("st", 6, 2),
        ("stx", 5, 2),
    ]


# -- CLI -------------------------------------------------------------------------------------


@pytest.fixture
def cname() -> str:
    return f"ctest-{secrets.token_hex(4)}"


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def setup(url: str, *names: str) -> None:
    async def go() -> None:
        async with await qps.connect(url) as c:
            for n in names:
                await populate(c, n)

    asyncio.run(go())


def key_dump(url: str, *names: str) -> dict[str, dict[bytes, Any]]:
    async def go() -> dict[str, dict[bytes, Any]]:
        async with await qps.connect(url) as c:
            d = await dump_all(c)
            return {n: of_container(d, n) for n in names}

    return asyncio.run(go())


def test_cli_help() -> None:
    r = invoke("--help")
    assert "container" in r.output.split("Commands:")[1]
    r = invoke("container", "--help")
    assert r.exit_code == 0
    for sub in ("ls", "stat", "reset"):
        assert f"  {sub} " in r.output
    r = invoke("container", "reset", "--help")
    text = " ".join(r.output.split())
    assert "--yes" in text and "cannot be undone" in text and "--missing-ok" in text


def test_cli_ls(redis_url: str, cname: str) -> None:
    setup(redis_url, cname)
    r = invoke("container", "ls", "--url", redis_url, "--json")
    assert r.exit_code == 0, r.output
    row = next(x for x in json.loads(r.stdout) if x["name"] == cname)
    assert row == {
        "name": cname,
        "registered": True,
        "queues": 5,
        "counters": 2,
        "variables": 0,
        "accumulators": 0,
    }
    r = invoke("container", "ls", "--url", redis_url)
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0].split() == [
        "NAME",
        "QUEUES",
        "COUNTERS",
        "VARIABLES",
        "ACCUMULATORS",
    ]
    line = next(x for x in r.stdout.splitlines() if x.startswith(cname))
    assert line.split() == [cname, "5", "2", "0", "0"]
    r = invoke("container", "ls", "--url", redis_url, "--scan", "--json")
    assert r.exit_code == 0 and cname in r.stdout


def test_cli_stat(redis_url: str, cname: str) -> None:
    setup(redis_url, cname)
    r = invoke("container", "stat", cname, "--url", redis_url)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert f"container     {cname}" in out
    assert "queues        5: b, pad, prio, q, shuf" in out
    assert "counters      2: epochs=3, global_step=41" in out
    assert "estimated by MEMORY USAGE" in out
    r = invoke("container", "stat", cname, "--url", redis_url, "--json", "--no-memory")
    d = json.loads(r.stdout)
    assert d["counters"] == {"epochs": 3, "global_step": 41}
    assert d["memory_bytes"] is None and d["keys"] > 0
    r = CliRunner().invoke(cli, ["container", "stat", cname + "-nope", "--url", redis_url])
    assert r.exit_code == 3 and "no container" in r.stderr
    r = CliRunner().invoke(cli, ["container", "stat", "bad name", "--url", redis_url])
    assert r.exit_code == 2 and "invalid container name" in r.stderr


def test_cli_reset_needs_yes_without_tty(redis_url: str, cname: str) -> None:
    setup(redis_url, cname)
    before = key_dump(redis_url, cname)
    r = CliRunner().invoke(cli, ["container", "reset", cname, "--url", redis_url])
    assert r.exit_code == 2
    assert "--yes" in r.stderr and "not a terminal" in r.stderr
    assert key_dump(redis_url, cname) == before
    r = CliRunner().invoke(cli, ["container", "reset", "--url", redis_url, "--yes"])
    assert r.exit_code == 2 and "or --all" in r.stderr  # NAME (or --all) is required
    r = CliRunner().invoke(cli, ["container", "reset", cname, "--all", "--url", redis_url])
    assert r.exit_code == 2 and "not both" in r.stderr
    r = CliRunner().invoke(cli, ["container", "reset", "--all", "--url", redis_url])
    assert r.exit_code == 2 and "not a terminal" in r.stderr and "all " in r.stderr
    r = CliRunner().invoke(cli, ["container", "reset", "a/b", "--url", redis_url, "--yes"])
    assert r.exit_code == 2 and "invalid container name" in r.stderr


def test_cli_reset_asks_when_interactive(
    redis_url: str, cname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = cname + "x"  # a longer name starting with the reset one
    setup(redis_url, cname, other)
    before = key_dump(redis_url, cname, other)
    monkeypatch.setattr(cli_container, "_interactive", lambda: True)
    r = CliRunner().invoke(cli, ["container", "reset", cname, "--url", redis_url], input="n\n")
    assert r.exit_code == 1
    assert "cannot be undone" in r.stderr and "left as it was" in r.stderr
    assert "5 queues, 2 counters, 0 variables, 0 accumulators" in r.stderr
    assert key_dump(redis_url, cname, other) == before
    r = CliRunner().invoke(cli, ["container", "reset", cname, "--url", redis_url], input="y\n")
    assert r.exit_code == 0, r.output
    n = len(before[cname])
    assert f"reset container '{cname}': deleted {n} key(s) (5 queues, 2 counters" in r.stdout
    after = key_dump(redis_url, cname, other)
    assert after[cname] == {} and after[other] == before[other]


def test_cli_reset_yes_json_and_missing(redis_url: str, cname: str) -> None:
    a, b = cname + "-a", cname + "-b"
    setup(redis_url, a, b)
    before = key_dump(redis_url, a, b)
    missing = cname + "-missing"
    r = CliRunner().invoke(cli, ["container", "reset", a, missing, "--url", redis_url, "--yes"])
    assert r.exit_code == 3
    assert f"no container '{missing}'" in r.stderr and "nothing was reset" in r.stderr
    assert key_dump(redis_url, a, b) == before
    r = invoke("container", "reset", a, missing, "--url", redis_url, "-y", "--missing-ok", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [(x["container"], x["existed"]) for x in out] == [(a, True), (missing, False)]
    assert out[0]["keys_deleted"] == len(before[a])
    assert out[0]["resources"]["counters"] == ["epochs", "global_step"]
    after = key_dump(redis_url, a, b)
    assert after[a] == {} and after[b] == before[b]
    r = invoke("container", "reset", missing, "--url", redis_url, "-y", "--missing-ok")
    assert r.exit_code == 0 and "does not exist" in r.stdout
    r = invoke("container", "reset", b, "--url", redis_url, "--yes")
    assert r.exit_code == 0
    assert key_dump(redis_url, b)[b] == {}

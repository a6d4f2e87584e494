"""Tenants: the Redis ACL recipe of docs/containers.md, end to end, against a real server
(and every node of a cluster), and the registry no tenant can write.

The recipe is read from the page itself (the ``ACL SETUSER job-a ...`` line), with
``job-a`` and ``secret`` replaced by names of the test's own; each user is deleted after
its test. A recommended user works in its own container through qps (Session, Counter,
Variable, the CLI with its credentials in the URL), and every read, write,
registration, unregistration and reset it tries against a neighbour container or the
legacy registry ``qps:containers`` is refused, the neighbour's keys staying byte for
byte the same (tests/corruption.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import shlex
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import redis.cluster
from click.testing import CliRunner, Result

import qps
from qps import keys
from qps.cli.main import cli
from qps.containers import (
    Counter,
    container_stats,
    list_containers,
    register_container,
    reset,
)
from qps.errors import PermissionDeniedError
from qps.transport import map_errors
from tests.conftest import on_cluster
from tests.corruption import assert_same, dump_all, of_container

PAGE = Path(__file__).resolve().parents[1] / "docs" / "containers.md"


def recipe() -> list[str]:
    """The arguments of the page's ``ACL SETUSER job-a ...`` command (after ``ACL``)."""
    found = re.findall(r"^\$ redis-cli .*?\b(ACL SETUSER job-a .*)$", PAGE.read_text(), re.M)
    assert len(found) == 1, "docs/containers.md: one `redis-cli ... ACL SETUSER job-a` line"
    return shlex.split(found[0])[1:]


#: The recipe that docs/containers.md recommended before: it also let the user write the
#: shared registry, and so hide other containers and break a reset of all of them.
OLD_EXTRA = "%W~qps:containers"


def test_the_recipe_grants_nothing_outside_the_container() -> None:
    args = recipe()
    assert args[:2] == ["SETUSER", "job-a"]
    patterns = [a for a in args if a.startswith(("~", "%"))]
    assert patterns == ["~qps:{job-a}:*", "~qps:{job-a/*"]
    assert "allkeys" not in args and "-@dangerous" in args and "-@admin" in args
    # the registration key lies inside them; no key of another container does
    assert keys.registration("job-a").startswith("qps:{job-a}:")
    for other in ("job-ab", "job-a.b", "job-a:b", "job", "default"):
        for key in (keys.registration(other), keys.counter_key(other, "n")):
            assert not key.startswith(("qps:{job-a}:", "qps:{job-a/")), key


def user_url(redis_url: str, user: str, password: str) -> str:
    scheme, rest = redis_url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


@contextmanager
def acl_user(redis_url: str, container: str, *, old: bool = False) -> Iterator[str]:
    """A user made by the page's recipe for ``container`` (named after it; on every
    node of a cluster: ACL users are per node), deleted on exit; yields its URL.
    ``old``: the former recipe."""
    password = secrets.token_hex(8)
    args = [a.replace("job-a", container) for a in recipe()]
    args = [f">{password}" if a == ">secret" else a for a in args]
    if old:
        args.append(OLD_EXTRA)
    admin: Any
    every: dict[str, Any] = {}
    if on_cluster(redis_url):
        admin = redis.cluster.RedisCluster.from_url(redis_url)
        every["target_nodes"] = redis.cluster.RedisCluster.ALL_NODES
    else:
        admin = redis.Redis.from_url(redis_url)
    with admin:
        admin.execute_command("ACL", *args, **every)
        try:
            yield user_url(redis_url, container, password)
        finally:
            admin.execute_command("ACL", "DELUSER", container, **every)


def run(coro: Awaitable[Any]) -> Any:
    async def go() -> Any:
        return await coro

    return asyncio.run(go())


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


async def populate(client: qps.Client, container: str) -> None:
    """A queue with two elements, a counter at 41 and a variable, through a Session."""
    async with qps.Session(container=container, client=client) as s:
        q = s.fifo_queue(10, np.int64, shapes=[[]], shared_name="q")
        await q.enqueue_many(np.array([1, 2]))
        await s.counter("global_step").add(41)
        await s.variable("w", (3,), np.float32, initializer="ones").create()


async def dump_of(url: str, container: str) -> dict[bytes, Any]:
    async with await qps.connect(url) as c:
        return of_container(await dump_all(c), container)


@pytest.fixture
def names() -> Iterator[tuple[str, str]]:
    tag = secrets.token_hex(3)
    yield f"tn{tag}-a", f"tn{tag}-b"


# -- what the recommended user can do ------------------------------------------------------


def test_the_user_works_in_its_own_container(redis_url: str, names: tuple[str, str]) -> None:
    mine, _ = names
    with acl_user(redis_url, mine) as url:

        async def work() -> None:
            async with qps.Session(url, container=mine) as s:  # registration works
                q = s.fifo_queue(5, np.int64, shapes=[[]], shared_name="q")
                await q.enqueue_many(np.array([1, 2, 3]))
                assert int(await q.dequeue()) == 1
                step = s.counter("global_step")
                assert await step.add(2) == 2 and await step.set(5) == 2
                v = s.variable("w", (3,), np.float32, initializer="ones")
                assert (await v.read()).value.tolist() == [1.0, 1.0, 1.0]
                assert await s.list_queues() == ["q"]
                assert await s.list_counters() == ["global_step"]
                assert await s.list_variables() == ["w"]
                st = await s.stats(memory=False)
                assert st.registered and st.counters == {"global_step": 5}
                assert st.problems == ()
                assert mine in await list_containers(s.client)  # names: SCAN is allowed

        run(work())
        r = invoke("container", "stat", mine, "--url", url, "--no-memory")
        assert r.exit_code == 0, r.output
        assert "registered    yes" in r.stdout and "global_step=5" in r.stdout
        r = invoke("queue", "ls", "--container", mine, "--url", url)
        assert r.exit_code == 0 and "q" in r.stdout, r.output
        r = invoke("container", "reset", mine, "--yes", "--url", url)
        assert r.exit_code == 0, r.output
        assert f"reset container '{mine}'" in r.stdout
        assert run(dump_of(redis_url, mine)) == {}  # all of it, the registration too

        async def again() -> None:  # and it starts afresh in the same container
            async with qps.Session(url, container=mine) as s:
                assert await s.counter("global_step").add(1) == 1

        run(again())
        assert mine in run(_names(redis_url))
        run(_reset(redis_url, mine))


async def _names(url: str) -> list[str]:
    async with await qps.connect(url) as c:
        return await list_containers(c)


async def _reset(url: str, *containers: str) -> None:
    async with await qps.connect(url) as c:
        await reset(c, list(containers))


# -- what it cannot do to a neighbour --------------------------------------------------------


async def _attempts(client: qps.Client, theirs: str) -> list[tuple[str, Callable[[], Any]]]:
    """Everything a tenant might try on container ``theirs`` and on the registry."""
    c = client.commands

    def r(name: str, *args: Any) -> Callable[[], Awaitable[Any]]:
        """A raw Redis command, its errors translated as qps does."""

        async def call() -> Any:
            with map_errors():
                return await getattr(c, name)(*args)

        return call

    q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="q", container=theirs, client=client)
    return [
        # read
        ("queue size", q.size),
        ("queue dequeue", q.dequeue_nowait),
        ("counter get", Counter("global_step", container=theirs, client=client).get),
        ("variable read", qps.Variable("w", (3,), container=theirs, client=client).read),
        ("container stats", lambda: container_stats(client, theirs, memory=False)),
        ("GET its counter", r("get", keys.counter_key(theirs, "global_step"))),
        ("SMEMBERS its queues", r("smembers", keys.container_queues(theirs))),
        ("SMEMBERS legacy registry", r("smembers", keys.CONTAINERS)),
        # write
        ("queue enqueue", lambda: q.enqueue(np.int64(9))),
        ("counter add", Counter("global_step", container=theirs, client=client).add),
        ("counter create", Counter("new", container=theirs, client=client).get),
        (
            "variable create",
            qps.Variable(
                "v2", (2,), np.float32, initializer="zeros", container=theirs, client=client
            ).create,
        ),
        ("SET its counter", r("set", keys.counter_key(theirs, "global_step"), "x")),
        # register, unregister, hide
        ("register it", lambda: register_container(client, theirs)),
        ("Session on it", qps.Session(container=theirs, client=client).open),
        ("DEL its registration", r("delete", keys.registration(theirs))),
        ("SET its registration", r("set", keys.registration(theirs), "x")),
        ("SREM legacy registry", r("srem", keys.CONTAINERS, theirs)),
        ("SADD legacy registry", r("sadd", keys.CONTAINERS, "*", "a\nb")),
        ("DEL legacy registry", r("delete", keys.CONTAINERS)),
        # reset
        ("reset it", lambda: reset(client, [theirs])),
        ("qps.reset it", lambda: qps.reset(containers=[theirs], client=client)),
        ("reset all", lambda: reset(client, None)),
    ]


def test_the_user_cannot_touch_a_neighbour(redis_url: str, names: tuple[str, str]) -> None:
    """Every attempt is refused with PermissionDeniedError (Redis's NOPERM, whatever
    layer it goes through), and the neighbour's keys, its registration included, are
    byte-identical afterwards; so is the legacy registry."""
    mine, theirs = names

    async def go() -> None:
        async with await qps.connect(redis_url) as admin:
            await populate(admin, theirs)
            await admin.commands.sadd(keys.CONTAINERS, theirs)  # as an earlier version did
            before = await dump_all(admin)
        with acl_user(redis_url, mine) as url:
            async with await qps.connect(url) as client:
                await populate(client, mine)  # its own container works
                refused = []
                for what, attempt in await _attempts(client, theirs):
                    try:
                        await attempt()
                    except PermissionDeniedError:
                        refused.append(what)
                    except Exception as exc:  # reported by the assertion below
                        refused.append(f"{what}: {type(exc).__name__}: {exc}")
                    else:
                        refused.append(f"{what}: allowed")
                assert refused == [w for w, _ in await _attempts(client, theirs)]
        async with await qps.connect(redis_url) as admin:
            after = await dump_all(admin)
            assert_same(of_container(before, theirs), of_container(after, theirs), theirs)
            legacy = keys.CONTAINERS.encode()
            assert after.get(legacy) == before.get(legacy)
            # ("reset all" may have reset its own container before it was refused)
            assert theirs in await list_containers(admin)
            await reset(admin, [mine, theirs])

    run(go())


def test_the_cli_with_the_user_url_cannot_touch_a_neighbour(
    redis_url: str, names: tuple[str, str]
) -> None:
    mine, theirs = names

    async def setup() -> dict[bytes, Any]:
        async with await qps.connect(redis_url) as admin:
            await populate(admin, theirs)
            return of_container(await dump_all(admin), theirs)

    before = run(setup())
    with acl_user(redis_url, mine) as url:
        for args in (
            ["container", "stat", theirs],
            ["container", "reset", theirs, "--yes"],
            ["container", "reset", "--all", "--yes"],
            ["queue", "ls", "--container", theirs],
            ["var", "get", "w", "--container", theirs],
        ):
            r = invoke(*args, "--url", url)
            assert r.exit_code != 0, (args, r.output)
            # PermissionDeniedError (Redis: "no permissions to access...", Valkey: "No ...")
            assert "Redis refused" in r.stderr and "permissions" in r.stderr.lower(), r.stderr
            assert "Traceback" not in r.output
    assert_same(before, run(dump_of(redis_url, theirs)), theirs)
    r = invoke("container", "ls", "--url", redis_url, "--json")
    assert r.exit_code == 0 and theirs in r.stdout
    run(_reset(redis_url, theirs))


# -- what the former recipe let a tenant do, and what it does now ------------------------------


def test_a_tenant_of_the_old_recipe_no_longer_hides_others_or_breaks_reset_all(
    redis_url: str, names: tuple[str, str]
) -> None:
    """With the former recipe (write access to ``qps:containers``), a tenant emptied that
    set and filled it with names that are no container names: the admin's listing then
    showed nothing and resetting every container failed on the first bad name. The
    registry is no longer that set: both go on."""
    mine, theirs = names

    async def go() -> None:
        async with await qps.connect(redis_url) as admin:
            await populate(admin, theirs)
        with acl_user(redis_url, mine, old=True) as url:
            async with await qps.connect(url) as c:
                await populate(c, mine)
                await c.commands.srem(keys.CONTAINERS, theirs, mine)
                await c.commands.sadd(keys.CONTAINERS, "*", "a\nb", b"\xff")
        async with await qps.connect(redis_url) as admin:
            assert {mine, theirs} <= set(await list_containers(admin))
            results = {r.container: r for r in await reset(admin, None)}  # no raise
            assert results[theirs].existed and results[mine].existed
            assert await list_containers(admin) == []
            assert of_container(await dump_all(admin), theirs) == {}
            await c_populate_again(admin)

    async def c_populate_again(admin: qps.Client) -> None:
        await populate(admin, theirs)
        await populate(admin, mine)
        await admin.commands.sadd(keys.CONTAINERS, "*", "a\nb", b"\xff")
        await admin.commands.unlink(keys.registration(mine))  # in the legacy set only
        await admin.commands.sadd(keys.CONTAINERS, mine)

    async def listed() -> None:
        from qps import registry  # what only the fixed code has

        async with await qps.connect(redis_url) as admin:
            found = await registry.listing(admin)
            assert {mine, theirs} <= set(found.names)
            assert "*" not in found.names and len(found.problems) == 3
            rows = await registry.container_summaries(admin)
            row = next(x for x in rows if x.name == theirs)
            assert row.registered and row.resources["queues"] == 1

    run(go())
    run(listed())
    r = invoke("container", "ls", "--url", redis_url)
    assert r.exit_code == 0, r.output
    assert any(line.split()[:2] == [theirs, "1"] for line in r.stdout.splitlines())
    assert "not a valid container name" in r.stderr
    r = invoke("container", "reset", "--all", "--yes", "--url", redis_url, "--json")
    assert r.exit_code == 0, r.output
    out = {x["container"]: x for x in json.loads(r.stdout)}
    assert out[theirs]["existed"] and out[mine]["existed"]
    assert {c for c, x in out.items() if "skipped" in x} == {"*", "a\nb", "\ufffd"}
    assert run(dump_of(redis_url, theirs)) == {} and run(dump_of(redis_url, mine)) == {}
    assert run(_names(redis_url)) == []

"""Tests of the ``qps`` command line against a real server.

The queue commands run in-process through click's CliRunner. CliRunner's commands call
``asyncio.run``, which cannot run inside a running event loop, so these tests are plain
functions that set up state with ``asyncio.run(...)`` helpers. Every test uses its own
container, so the tests do not see each other's queues. The demo runs as a real
subprocess, as a user would run it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner, Result

import qps
from qps.cli import queue as cli_queue
from qps.cli.main import cli, run
from qps.errors import CancelledError
from qps.queues import list_queues, queue_stats
from tests.conftest import on_cluster

REPO_ROOT = str(Path(__file__).resolve().parents[1])


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def container() -> str:
    """A container of this test's own."""
    return f"clitest-{secrets.token_hex(4)}"


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def qargs(cmd: str, url: str, container: str, *rest: str) -> list[str]:
    return ["queue", cmd, *rest, "--url", url, "--container", container]


def make_fifo(url: str, container: str, name: str, n: int = 3, capacity: int = 10) -> None:
    """A FIFOQueue of (float32[2,3], int64) holding elements i = 0..n-1: (i*6 + arange(6), i)."""

    async def go() -> None:
        async with await qps.connect(url) as c:
            q = qps.FIFOQueue(
                capacity,
                [np.float32, np.int64],
                shapes=[[2, 3], []],
                shared_name=name,
                container=container,
                client=c,
            )
            images = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)
            await q.enqueue_many([images, np.arange(n, dtype=np.int64) + 100])

    asyncio.run(go())


def fifo_state(url: str, container: str, name: str) -> tuple[int, bool]:
    async def go() -> tuple[int, bool]:
        async with await qps.connect(url) as c:
            s = await queue_stats(c, name, container)
            return s.size, s.closed

    return asyncio.run(go())


# -- the group --------------------------------------------------------------------------


def test_version() -> None:
    r = invoke("--version")
    assert r.exit_code == 0
    assert r.output.strip() == f"qps {qps.__version__}"


def test_help_lists_commands() -> None:
    for flag in ("--help", "-h"):
        r = invoke(flag)
        assert r.exit_code == 0
        commands = r.output.split("Commands:")[1]
        assert re.search(r"^\s+queue\s", commands, re.M)
        assert re.search(r"^\s+demo\s", commands, re.M)
        assert "Exit codes" in r.output and "QPS_REDIS_URL" in r.output
    r = invoke("queue", "--help")
    for sub in ("ls", "stat", "peek", "close"):
        assert re.search(rf"^\s+{sub}\s", r.output, re.M)


def test_usage_error_is_exit_2() -> None:
    r = CliRunner().invoke(cli, ["queue", "stat"])  # NAME missing
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, ["queue", "peek", "x", "-n", "0"])
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, ["queue", "ls", "--container", "bad name!"])
    assert r.exit_code == 2


# -- ls ---------------------------------------------------------------------------------


def test_ls_json_lists_queue_with_size(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "batches", n=3)
    r = invoke(*qargs("ls", redis_url, container, "--json"))
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["name"] for row in rows] == ["batches"]
    row = rows[0]
    assert row["size"] == 3
    assert row["type"] == "FIFOQueue"
    assert row["capacity"] == 10
    assert row["closed"] is False
    assert row["enqueued_total"] == 3 and row["dequeued_total"] == 0
    assert row["dtypes"] == ["float32", "int64"]
    assert row["shapes"] == ["[2,3]", "[]"]


def test_ls_table(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "a", n=3)
    make_fifo(redis_url, container, "b", n=1, capacity=-1)
    r = invoke(*qargs("ls", redis_url, container))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "NAME", "TYPE", "SIZE/CAP", "CLOSED", "PEND_ENQ", "PEND_DEQ", "ENQUEUED", "DEQUEUED",
    ]  # fmt: skip
    assert lines[1].split() == ["a", "FIFOQueue", "3/10", "no", "0", "0", "3", "0"]
    assert lines[2].split() == ["b", "FIFOQueue", "1/inf", "no", "0", "0", "1", "0"]


def test_ls_empty_container(redis_url: str, container: str) -> None:
    r = invoke(*qargs("ls", redis_url, container))
    assert r.exit_code == 0
    assert "no queues" in r.stdout
    r = invoke(*qargs("ls", redis_url, container, "--json"))
    assert json.loads(r.stdout) == []


# -- stat -------------------------------------------------------------------------------


def test_stat_shows_type_capacity_size(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "batches", n=3)
    r = invoke(*qargs("stat", redis_url, container, "batches"))
    assert r.exit_code == 0, r.output
    fields = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in r.stdout.splitlines())
    assert fields["queue"] == f"{container}/batches"
    assert fields["type"] == "FIFOQueue"
    assert fields["capacity"] == "10"
    assert fields["size"].startswith("3 ")
    assert fields["dtypes"] == "float32, int64"
    assert fields["shapes"] == "[2,3], []"
    assert fields["closed"] == "no"
    assert fields["pending enqueues"] == "0"
    assert fields["dead letters"].startswith("0 ")


def test_stat_json_shuffle_queue(redis_url: str, container: str) -> None:
    async def go() -> None:
        async with await qps.connect(redis_url) as c:
            q = qps.RandomShuffleQueue(
                50, 4, np.int32, shapes=[[]], seed=11, shared_name="shuf", container=container,
                client=c,
            )  # fmt: skip
            await q.enqueue_many(np.arange(7, dtype=np.int32))

    asyncio.run(go())
    r = invoke(*qargs("stat", redis_url, container, "shuf", "--json"))
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["type"] == "RandomShuffleQueue"
    assert (d["capacity"], d["min_after_dequeue"], d["seed"], d["size"]) == (50, 4, 11, 7)
    text = invoke(*qargs("stat", redis_url, container, "shuf")).stdout
    assert re.search(r"^min_after_dequeue\s+4$", text, re.M)
    assert re.search(r"^seed\s+11$", text, re.M)


@pytest.mark.parametrize(
    ("field", "value"), [("spec", "{not json"), ("x", "-100"), ("kind", None), ("items", "list")]
)
def test_ls_and_stat_show_a_broken_queue(
    redis_url: str, container: str, field: str, value: str | None
) -> None:
    """A queue whose meta lacked 'spec' or held '{not json' (or a WRONGTYPE items key)
    failed `queue ls` for the whole container with "unexpected KeyError: b'spec'"."""
    make_fifo(redis_url, container, "good", n=2)
    make_fifo(redis_url, container, "bad", n=3)
    prefix = f"qps:{{{container}/q/bad}}:"
    kind = redis.RedisCluster if on_cluster(redis_url) else redis.Redis
    with kind.from_url(redis_url) as r:
        if field == "items":
            r.delete(prefix + "items")
            r.set(prefix + "items", "not a list")
        elif value is None:
            r.hdel(prefix + "meta", field)
        else:
            r.hset(prefix + "meta", field, value)
    key = prefix + ("items" if field == "items" else "meta")
    ls = CliRunner().invoke(cli, qargs("ls", redis_url, container))
    assert ls.exit_code == 1, ls.output
    rows = {line.split()[0]: line.split()[1:3] for line in ls.stdout.splitlines()[1:3]}
    assert rows == {"bad": ["BROKEN", "-"], "good": ["FIFOQueue", "2/10"]}
    assert f"bad: BROKEN: corrupt queue state: {key}: " in ls.stdout
    listed = json.loads(CliRunner().invoke(cli, qargs("ls", redis_url, container, "--json")).stdout)
    assert [d.get("broken", "").startswith(f"corrupt queue state: {key}") for d in listed] == [
        True,
        False,
    ]
    st = CliRunner().invoke(cli, qargs("stat", redis_url, container, "bad"))
    assert st.exit_code == 1 and st.stderr.startswith(f"qps: error: corrupt queue state: {key}: ")
    assert "Traceback" not in st.output


def test_stat_missing_queue_exit_3(redis_url: str, container: str) -> None:
    r = CliRunner().invoke(cli, qargs("stat", redis_url, container, "nope"))
    assert r.exit_code == 3
    assert r.stderr.strip() == f"qps: error: no queue 'nope' in container '{container}'"
    assert "Traceback" not in r.output


def test_main_maps_exit_codes(redis_url: str, container: str, capsys: Any) -> None:
    assert run([*qargs("stat", redis_url, container, "nope")]) == 3
    assert "qps: error: no queue 'nope'" in capsys.readouterr().err
    assert run(["--version"]) == 0
    assert run(["queue", "stat"]) == 2
    assert run(["queue", "ls", "--url", "redis://user:sekret@127.0.0.1:1/0"]) == 5
    err = capsys.readouterr().err
    assert "redis://user:***@127.0.0.1:1/0" in err and "sekret" not in err
    assert "Traceback" not in err


def test_unreachable_server_exit_5_and_redacted() -> None:
    r = CliRunner().invoke(cli, ["queue", "ls", "--url", "redis://user:sekret@127.0.0.1:1/0"])
    assert r.exit_code == 5
    assert r.stderr.startswith("qps: error: cannot reach Redis at redis://user:***@127.0.0.1:1/0")
    assert "sekret" not in r.output


def test_malformed_url_exit_2() -> None:
    r = CliRunner().invoke(cli, ["queue", "ls", "--url", "nosuch://u:sekret@host/0"])
    assert r.exit_code == 2
    assert "qps: error: invalid Redis URL" in r.stderr and "sekret" not in r.output


def test_url_from_env(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "envq", n=2)
    r = CliRunner().invoke(
        cli, ["queue", "ls", "--json"], env={"QPS_REDIS_URL": redis_url, "QPS_CONTAINER": container}
    )
    assert r.exit_code == 0, r.output
    assert [(q["name"], q["size"]) for q in json.loads(r.stdout)] == [("envq", 2)]


# -- peek -------------------------------------------------------------------------------


def test_peek_two_elements_removes_nothing(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "batches", n=3)
    r = invoke(*qargs("peek", redis_url, container, "batches", "-n", "2"))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "element 0:" in out and "element 1:" in out and "element 2:" not in out
    assert "float32 [2,3]" in out and "int64 []  100" in out and "int64 []  101" in out
    assert "[[0. 1. 2.]" in out and "[3. 4. 5.]]" in out  # element 0's image
    assert "[[ 6.  7.  8.]" in out  # element 1's image
    assert fifo_state(redis_url, container, "batches") == (3, False)

    r = invoke(*qargs("peek", redis_url, container, "batches", "-n", "2", "--json"))
    assert r.exit_code == 0, r.output
    elements = json.loads(r.stdout)
    assert len(elements) == 2
    img, label = elements[1]["components"]
    assert img == {
        "name": None,
        "dtype": "float32",
        "shape": [2, 3],
        "values": [6.0, 7.0, 8.0, 9.0, 10.0, 11.0],
        "truncated": False,
    }
    assert (label["dtype"], label["shape"], label["values"]) == ("int64", [], [101])
    assert fifo_state(redis_url, container, "batches") == (3, False)


def test_peek_json_truncates_to_100_values(redis_url: str, container: str) -> None:
    async def go() -> None:
        async with await qps.connect(redis_url) as c:
            q = qps.FIFOQueue(
                5, np.float64, shapes=[[250]], names=["x"], shared_name="big",
                container=container, client=c,
            )  # fmt: skip
            await q.enqueue({"x": np.arange(250, dtype=np.float64)})

    asyncio.run(go())
    r = invoke(*qargs("peek", redis_url, container, "big", "--json"))
    (comp,) = json.loads(r.stdout)[0]["components"]
    assert comp["name"] == "x" and comp["shape"] == [250]
    assert comp["values"] == [float(i) for i in range(100)] and comp["truncated"] is True
    text = invoke(*qargs("peek", redis_url, container, "big")).stdout
    assert "[x] float64 [250]" in text and "..." in text  # summarized preview


def test_stat_and_peek_string_queue(redis_url: str, container: str) -> None:
    async def go() -> None:
        async with await qps.connect(redis_url) as c:
            q = qps.PaddingFIFOQueue(
                5, [qps.string, np.int32], shapes=[[None], []], shared_name="words",
                container=container, client=c,
            )  # fmt: skip
            await q.enqueue([["héllo", "a"], 1])
            await q.enqueue([[b"\xff\xfe"], 2])

    asyncio.run(go())
    text = invoke(*qargs("stat", redis_url, container, "words")).stdout
    assert re.search(r"^dtypes\s+string, int32$", text, re.M)
    d = json.loads(invoke(*qargs("stat", redis_url, container, "words", "--json")).stdout)
    assert d["dtypes"] == ["string", "int32"] and d["shapes"] == ["[?]", "[]"]
    r = invoke(*qargs("peek", redis_url, container, "words", "-n", "2"))
    assert r.exit_code == 0, r.output
    assert "string [2]" in r.stdout and "b'h\\xc3\\xa9llo'" in r.stdout
    elements = json.loads(
        invoke(*qargs("peek", redis_url, container, "words", "-n", "2", "--json")).stdout
    )
    words, n = elements[0]["components"]
    assert (words["dtype"], words["shape"], words["values"]) == ("string", [2], ["héllo", "a"])
    assert n["values"] == [1]
    assert elements[1]["components"][0]["values"] == ["\\xff\\xfe"]  # not UTF-8: escaped
    assert fifo_state(redis_url, container, "words")[0] == 2


def test_peek_reports_undecodable_bytes(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "dirty", n=1)

    async def corrupt() -> None:
        async with await qps.connect(redis_url) as c:
            await c.commands.rpush(f"qps:{{{container}/q/dirty}}:items", b"not a tensor")

    asyncio.run(corrupt())
    r = invoke(*qargs("peek", redis_url, container, "dirty", "-n", "5"))
    assert r.exit_code == 0, r.output
    assert "element 0: 2 component(s)" in r.stdout
    assert re.search(r"element 1: 12 bytes, UNDECODABLE: not a qps message", r.stdout)
    elements = json.loads(
        invoke(*qargs("peek", redis_url, container, "dirty", "-n", "5", "--json")).stdout
    )
    assert elements[1]["bytes"] == 12 and elements[1]["error"].startswith("undecodable")


def test_peek_large_element_stored_in_chunks(redis_url: str, container: str) -> None:
    big = np.arange(600_000, dtype=np.float32)  # 2.4 MB: stored out of line, in chunks

    async def go() -> None:
        async with await qps.connect(redis_url) as c:
            q = qps.FIFOQueue(
                4, [np.float32, np.int32], shapes=[[600_000], []], shared_name="large",
                container=container, client=c,
            )  # fmt: skip
            await q.enqueue([big, 9])

    asyncio.run(go())
    r = invoke(*qargs("peek", redis_url, container, "large"))
    assert r.exit_code == 0, r.output
    assert re.search(r"element 0: 2 component\(s\), \d+ bytes in 3 chunks", r.stdout)
    assert "[0] float32 [600000]" in r.stdout and "[1] int32 []  9" in r.stdout
    (element,) = json.loads(invoke(*qargs("peek", redis_url, container, "large", "--json")).stdout)
    img, label = element["components"]
    assert element["chunks"] == 3
    assert img["values"] == big[:100].tolist() and img["truncated"] is True
    assert label["values"] == [9]

    async def dequeue() -> Any:
        async with await qps.connect(redis_url) as c:
            q = qps.FIFOQueue(
                4, [np.float32, np.int32], shapes=[[600_000], []], shared_name="large",
                container=container, client=c,
            )  # fmt: skip
            return await q.dequeue(timeout=5)

    x, y = asyncio.run(dequeue())  # peeking left the chunks in place
    assert np.array_equal(x, big) and int(y) == 9


def test_peek_missing_queue_exit_3(redis_url: str, container: str) -> None:
    r = CliRunner().invoke(cli, qargs("peek", redis_url, container, "nope"))
    assert r.exit_code == 3


# -- close ------------------------------------------------------------------------------


def test_close_without_yes_non_interactive_is_exit_2(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "q")
    r = CliRunner().invoke(cli, qargs("close", redis_url, container, "q"))
    assert r.exit_code == 2
    assert "--yes" in r.stderr
    assert fifo_state(redis_url, container, "q") == (3, False)


def test_close_yes_closes(redis_url: str, container: str) -> None:
    make_fifo(redis_url, container, "q")
    r = invoke(*qargs("close", redis_url, container, "q", "--yes"))
    assert r.exit_code == 0, r.output
    assert f"closed FIFOQueue '{container}/q'" in r.stdout

    async def is_closed() -> bool:
        async with await qps.connect(redis_url) as c:
            q = qps.FIFOQueue(
                10, [np.float32, np.int64], shapes=[[2, 3], []], shared_name="q",
                container=container, client=c,
            )  # fmt: skip
            return await q.is_closed()

    assert asyncio.run(is_closed()) is True
    assert fifo_state(redis_url, container, "q") == (3, True)  # elements stay for dequeuers

    r = CliRunner().invoke(cli, qargs("close", redis_url, container, "q", "--yes"))
    assert r.exit_code == 1
    assert "already closed" in r.stderr
    r = invoke(*qargs("close", redis_url, container, "q", "--yes", "--cancel-pending", "--json"))
    assert r.exit_code == 0
    assert json.loads(r.stdout)["was_closed"] is True


def test_close_missing_queue_exit_3(redis_url: str, container: str) -> None:
    r = CliRunner().invoke(cli, qargs("close", redis_url, container, "nope", "--yes"))
    assert r.exit_code == 3


def test_close_asks_when_interactive(
    redis_url: str, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fifo(redis_url, container, "q")
    monkeypatch.setattr(cli_queue, "_interactive", lambda: True)
    r = CliRunner().invoke(cli, qargs("close", redis_url, container, "q"), input="n\n")
    assert r.exit_code == 1
    assert "cannot be undone" in r.output and "left open" in r.stderr
    assert fifo_state(redis_url, container, "q") == (3, False)
    r = CliRunner().invoke(cli, qargs("close", redis_url, container, "q"), input="y\n")
    assert r.exit_code == 0, r.output
    assert fifo_state(redis_url, container, "q") == (3, True)


def test_close_padding_shuffle_priority_from_stored_spec(redis_url: str, container: str) -> None:
    async def go() -> None:
        async with await qps.connect(redis_url) as c:
            await qps.PaddingFIFOQueue(
                -1, [np.int32], shapes=[[None]], names=["tok"], shared_name="pad",
                container=container, client=c,
            ).enqueue({"tok": np.arange(3, dtype=np.int32)})  # fmt: skip
            await qps.RandomShuffleQueue(
                8, 2, np.float32, shapes=[[4]], shared_name="shuf", container=container, client=c
            ).size()
            prio = qps.PriorityQueue(
                4, [np.float32], [[2]], shared_name="prio", container=container, client=c
            )
            await prio.enqueue((3, np.ones(2, np.float32)))
            await prio.enqueue((-3, np.zeros(2, np.float32)))

    asyncio.run(go())
    r = invoke(*qargs("peek", redis_url, container, "prio", "--json"))
    assert r.exit_code == 0, r.output
    [first] = json.loads(r.stdout)
    assert [c["values"] for c in first["components"]] == [[-3], [0.0, 0.0]]
    for name in ("pad", "shuf", "prio"):
        r = invoke(*qargs("close", redis_url, container, name, "-y"))
        assert r.exit_code == 0, r.output
    rows = json.loads(invoke(*qargs("ls", redis_url, container, "--json")).stdout)
    assert {(q["name"], q["type"], q["closed"]) for q in rows} == {
        ("pad", "PaddingFIFOQueue", True),
        ("shuf", "RandomShuffleQueue", True),
        ("prio", "PriorityQueue", True),
    }


@pytest.fixture
def blocked_enqueue(redis_url: str, container: str) -> Iterator[dict[str, Any]]:
    """A full queue 'full' with one enqueue blocked on it, in a thread of its own."""
    make_fifo(redis_url, container, "full", n=1, capacity=1)
    outcome: dict[str, Any] = {}
    started = threading.Event()

    async def enqueue() -> None:
        async with await qps.connect(redis_url) as c:
            q = qps.FIFOQueue(
                1, [np.float32, np.int64], shapes=[[2, 3], []], shared_name="full",
                container=container, client=c,
            )  # fmt: skip
            started.set()
            try:
                await q.enqueue([np.zeros((2, 3), np.float32), 7], timeout=20)
                outcome["result"] = "enqueued"
            except CancelledError:
                outcome["result"] = "cancelled"

    t = threading.Thread(target=lambda: asyncio.run(enqueue()))
    t.start()
    started.wait(10)
    deadline = time.monotonic() + 10
    while True:
        rows = json.loads(invoke(*qargs("ls", redis_url, container, "--json")).stdout)
        if rows[0]["pending_enqueues"] == 1:
            break
        assert time.monotonic() < deadline, "the enqueue did not block"
        time.sleep(0.02)
    yield outcome
    t.join(30)


def test_close_timeout_then_cancel_pending(
    redis_url: str, container: str, blocked_enqueue: dict[str, Any]
) -> None:
    r = CliRunner().invoke(
        cli, qargs("close", redis_url, container, "full", "-y", "--timeout", "0.3")
    )
    assert r.exit_code == 4
    assert "waiting behind 1 pending enqueue" in r.stderr
    assert "still open" in r.stderr
    assert fifo_state(redis_url, container, "full") == (1, False)

    r = invoke(*qargs("close", redis_url, container, "full", "-y", "--cancel-pending"))
    assert r.exit_code == 0, r.output
    assert "cancelled 1 pending enqueue" in r.stdout
    deadline = time.monotonic() + 10
    while "result" not in blocked_enqueue and time.monotonic() < deadline:
        time.sleep(0.02)
    assert blocked_enqueue.get("result") == "cancelled"
    assert fifo_state(redis_url, container, "full") == (1, True)


# -- demo (real processes) -----------------------------------------------------------------


def demo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPS_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def qps_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qps.cli.main", "demo", *args],
        capture_output=True,
        text=True,
        timeout=150,
        env=env or demo_env(),
        cwd=REPO_ROOT,
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_demo_against_given_server(redis_url: str) -> None:
    p = qps_demo("--elements", "500", "--batch", "50", "--url", redis_url)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert f"server:   Redis at {redis_url}" in out
    assert "producer: enqueued 500 elements in 10 enqueue_many calls" in out
    assert "consumer: dequeued 500 elements" in out and "all verified" in out
    assert re.search(
        r"moved 500 elements \(1\.57 MB of tensors\) in [\d.]+ s: [\d,]+ elements/s", out
    )
    assert "verified OK" in out
    name = re.search(r"queue:\s+demo/(demo-[0-9a-f]+)", out)
    assert name is not None

    async def names() -> list[str]:
        async with await qps.connect(redis_url) as c:
            return await list_queues(c, "demo")

    assert name.group(1) not in asyncio.run(names())  # cleaned up


@pytest.mark.slow
def test_demo_with_embedded_server_stops_it() -> None:
    # 510 = 10 full batches + a partial one: dequeue_many, then dequeue_up_to
    p = qps_demo("--elements", "510", "--batch", "50")
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "10 dequeue_many + 1 dequeue_up_to calls, all verified" in out
    assert "verified OK" in out
    m = re.search(r"server:\s+embedded \S+ at unix://(/\S+)/redis\.sock \(pid (\d+)\)", out)
    assert m is not None, out
    run_dir, pid = m.group(1), int(m.group(2))
    assert f"stopped the embedded server (pid {pid})" in out
    assert not pid_alive(pid)
    assert not os.path.exists(run_dir)


@pytest.mark.slow
def test_demo_unreachable_server_exit_5() -> None:
    p = qps_demo("--url", "redis://demo:sekret@127.0.0.1:1/0")
    assert p.returncode == 5
    assert "qps: error: cannot reach Redis at redis://demo:***@127.0.0.1:1/0" in p.stderr
    assert "sekret" not in p.stdout + p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_demo_timeout_kills_children() -> None:
    p = qps_demo("--elements", "50000000", "--batch", "500", "--timeout", "2")
    assert p.returncode == 1
    assert "timed out after 2 s" in p.stderr
    m = re.search(r"at unix://(/\S+)/redis\.sock \(pid (\d+)\)", p.stdout)
    assert m is not None
    assert not pid_alive(int(m.group(2))) and not os.path.exists(m.group(1))


@pytest.mark.slow
def test_demo_sigterm_stops_children_and_server() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qps.cli.main", "demo", "--elements", "50000000", "--batch", "500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=demo_env(),
        cwd=REPO_ROOT,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]  # title, server, queue
        m = re.search(r"at unix://(/\S+)/redis\.sock \(pid (\d+)\)", lines[1])
        assert m is not None, lines
        q = re.match(r"queue:\s+(\S+)/(\S+),", lines[2])
        assert q is not None, lines
        url = f"unix://{m.group(1)}/redis.sock"

        async def moved() -> int:  # elements the consumer took from the producer
            async with await qps.connect(url) as c:
                return (await queue_stats(c, q.group(2), q.group(1))).dequeued_total

        deadline = time.monotonic() + 60
        while not asyncio.run(moved()):  # until both children are at work
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the demo's children moved no element"
            time.sleep(0.05)  # paces the poll
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143
    assert "terminated by SIGTERM" in err
    assert not pid_alive(int(m.group(2))) and not os.path.exists(m.group(1))
    if shutil.which("pgrep"):
        pattern = f"qps.cli.demo .*--parent-pid {proc.pid}"
        left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        assert left.stdout.strip() == ""


# -- qps queue drain ------------------------------------------------------------------------


def test_drain_needs_yes_then_takes_everything_into_an_npz(
    redis_url: str, container: str, tmp_path: Path
) -> None:
    make_fifo(redis_url, container, "q", n=1200, capacity=2000)
    r = CliRunner().invoke(cli, qargs("drain", redis_url, container, "q"))
    assert r.exit_code == 2 and "--yes" in r.stderr
    assert fifo_state(redis_url, container, "q") == (1200, False)

    out = tmp_path / "taken.npz"
    r = CliRunner().invoke(cli, qargs("drain", redis_url, container, "q", "--yes", "--max",
                                      "1000", "-o", str(out)))  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"drained 1000 element(s) from FIFOQueue '{container}/q' into {out}; 200 left" in (
        r.stdout
    )
    # not a terminal: plain progress lines on stderr, the last at 100 %
    assert "qps queue drain q: 1,000/1,000 elements (100%)" in r.stderr
    with np.load(out, allow_pickle=False) as z:
        assert sorted(z.files) == ["c0", "c1"]
        assert z["c0"].shape == (1000, 2, 3) and z["c0"].dtype == np.float32
        np.testing.assert_array_equal(z["c1"], np.arange(1000) + 100)  # FIFO order
        np.testing.assert_array_equal(z["c0"][7].ravel(), np.arange(42, 48, dtype=np.float32))

    r = invoke(*qargs("drain", redis_url, container, "q", "--yes", "--json"))
    d = json.loads(r.stdout)
    assert (d["drained"], d["left"], d["stopped"], d["saved"]) == (200, 0, "empty", None)
    assert fifo_state(redis_url, container, "q") == (0, False)  # still open
    r = invoke(*qargs("drain", redis_url, container, "q", "--json"))  # nothing: no question
    assert json.loads(r.stdout)["drained"] == 0


def test_drain_closed_queue_and_varying_shapes(
    redis_url: str, container: str, tmp_path: Path
) -> None:
    async def fill() -> None:
        async with await qps.connect(redis_url) as c:
            q = qps.FIFOQueue(10, [np.int32], shared_name="v", container=container, client=c)
            for n in (1, 3, 2):
                await q.enqueue(np.arange(n, dtype=np.int32))
            await q.close()

    asyncio.run(fill())
    out = tmp_path / "v"
    r = invoke(*qargs("drain", redis_url, container, "v", "--yes", "-o", str(out), "--json"))
    d = json.loads(r.stdout)
    assert (d["drained"], d["stopped"], d["saved"]) == (3, "closed and empty", f"{out}.npz")
    with np.load(f"{out}.npz", allow_pickle=False) as z:
        assert [z[f"c0_{j}"].tolist() for j in range(3)] == [[0], [0, 1, 2], [0, 1]]


def test_drain_missing_queue_exit_3(redis_url: str, container: str) -> None:
    r = CliRunner().invoke(cli, qargs("drain", redis_url, container, "nope", "--yes"))
    assert r.exit_code == 3


def test_commands_run_on_uvloop_unless_asked_for_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands (and so the roles) run on uvloop's event loop where it is installed
    (a dependency on Linux); QPS_EVENT_LOOP=asyncio picks the standard one."""
    from qps.cli import run_async

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    monkeypatch.delenv("QPS_EVENT_LOOP", raising=False)
    assert run_async(which()) == "uvloop"
    monkeypatch.setenv("QPS_EVENT_LOOP", "asyncio")
    assert run_async(which()) == "asyncio"

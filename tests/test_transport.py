"""transport.Client's combined operations on every backend (fakeredis, a real server
and, when asked for, a cluster): the one NOSCRIPT path (load the script, send it
again with what must follow it) and the same replies and errors everywhere."""

from __future__ import annotations

import pytest

from qps import transport
from qps.errors import InternalError

SCRIPT = "counters/update"  # KEYS[1] a counter; ARGV 'add', n: {'ok', value after}
COUNTER = "{t}c"  # every key of a call in one slot: a cluster routes by its hash tag
LIST = "{t}l"
WAKE = "{t}w"


async def _lost(client: transport.Client) -> None:
    """The server forgets its scripts (as after a restart): the next EVALSHA meets
    NOSCRIPT."""
    await client.commands.script_flush()
    await client.commands.set(COUNTER, 0)


async def test_run_script_loads_the_script_again(client: transport.Client) -> None:
    await _lost(client)
    assert await client.run_script(SCRIPT, [COUNTER], ["add", 1]) == [b"ok", b"1"]
    await client.commands.script_flush()
    assert await client.run_script(SCRIPT, [COUNTER], ["add", 2]) == [b"ok", b"3"]
    assert await client.run_script(SCRIPT, [COUNTER], ["add", 3]) == [b"ok", b"6"]


async def test_commands_then_script_runs_the_commands_once(client: transport.Client) -> None:
    await _lost(client)
    replies, reply = await client.run_commands_then_script(
        [("RPUSH", LIST, "x")], SCRIPT, [COUNTER], ["add", 1]
    )
    assert replies == [1] and reply == [b"ok", b"1"]
    assert await client.commands.llen(LIST) == 1


@pytest.mark.parametrize("once", [False, True])
async def test_script_then_commands_runs_them_again_unless_once(
    client: transport.Client, once: bool
) -> None:
    await _lost(client)
    reply, replies = await client.run_script_then_commands(
        SCRIPT, [COUNTER], ["add", 1], [("RPUSH", LIST, "x")], once=once,
        before=[("SET", "{t}b", "v")],
    )  # fmt: skip
    assert reply == [b"ok", b"1"]
    ran = 1 if once else 2  # they ran in the first round trip, and again after the load
    assert replies == [ran] and await client.commands.llen(LIST) == ran
    assert await client.commands.get("{t}b") == b"v"
    # the script loaded now: one round trip, the commands once
    reply, replies = await client.run_script_then_commands(
        SCRIPT, [COUNTER], ["add", 1], [("RPUSH", LIST, "x")], once=once
    )
    assert reply == [b"ok", b"2"] and replies == [ran + 1]


async def test_wait_then_script_loads_the_script_again(client: transport.Client) -> None:
    await _lost(client)
    await client.commands.rpush(WAKE, "1", "1")
    reply, replies = await client.wait_then_script(
        WAKE, 1.0, SCRIPT, [COUNTER], ["add", 1], [("LLEN", WAKE)]
    )
    assert reply == [b"ok", b"1"] and replies == [1]
    await client.commands.script_flush()
    assert await client.wait_then_script(WAKE, 1.0, SCRIPT, [COUNTER], ["add", 1]) == [
        b"ok",
        b"2",
    ]
    assert await client.commands.llen(WAKE) == 0  # each wait took one token


async def test_script_then_wait_runs_the_first_script_alone_after_noscript(
    client: transport.Client,
) -> None:
    await _lost(client)
    got = await client.script_then_wait(
        SCRIPT, [COUNTER], ["add", 1], WAKE, 0.05, SCRIPT, ["add", 10], [("LLEN", LIST)]
    )
    if got is None:  # no waiter connection (fakeredis): the caller runs the steps
        assert client._endpoint is None
        return
    assert got == ([b"ok", b"1"], None, [])  # the wait served nothing: not run
    await client.commands.rpush(WAKE, "1")
    got = await client.script_then_wait(
        SCRIPT, [COUNTER], ["add", 1], WAKE, 1.0, SCRIPT, ["add", 10], [("LLEN", LIST)]
    )
    assert got == ([b"ok", b"2"], [b"ok", b"12"], [0])


async def test_errors_read_the_same_on_every_backend(client: transport.Client) -> None:
    await _lost(client)
    sha = transport._Script(SCRIPT).sha
    replies = await client.run_commands_replies(
        [("EVALSHA", sha, 1, COUNTER, "add", 1), ("LPUSH", COUNTER, "x")]
    )
    assert transport.is_noscript(replies[0])
    assert isinstance(replies[1], InternalError)
    assert str(replies[1]).startswith("unexpected Redis error: WRONGTYPE")
    with pytest.raises(InternalError, match=r"^unexpected Redis error: WRONGTYPE"):
        await client.run_commands([("GET", COUNTER), ("LPUSH", COUNTER, "x")])
    with pytest.raises(InternalError, match=r"^unexpected Redis error: WRONGTYPE"):
        await client.run_commands_then_script(
            [("LPUSH", COUNTER, "x")], SCRIPT, [COUNTER], ["add", 1]
        )
    assert await client.commands.get(COUNTER) == b"1"  # the script ran all the same

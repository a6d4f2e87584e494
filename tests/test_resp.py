"""The lean RESP2 connection (qps/resp.py) and its use by transport.Client, against
real servers: the session's single server (unix socket) and servers started here on
TCP (with a password, and with TLS when the binary and openssl allow it). One server
process on purpose, also with the cluster backend: a cluster node answers MOVED for the
keys of other nodes' slots; the cluster's use of these connections (routing, MOVED,
lost nodes) is tested in tests/test_cluster.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qps
from qps import resp, resp_codec, transport
from qps.embedded import find_server_binary
from qps.errors import DeadlineExceededError, InternalError, UnavailableError
from tests.conftest import until

PASSWORD = "s3cret pass"  # a space: must survive URL quoting and the AUTH command


# -- servers ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int, password: str | None) -> bool:
    """True once the server on ``port`` answers PING (after AUTH, if any)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            if password is not None:
                p = password.encode()
                sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(p), p))
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            data = b""
            while b"PONG" not in data and len(data) < 200:
                chunk = sock.recv(200)
                if not chunk:
                    break
                data += chunk
            return b"+PONG" in data
    except OSError:
        return False


class _Server:
    """A throwaway redis-server on loopback TCP (and a unix socket), in a temp dir."""

    def __init__(self, *extra: str, password: str | None = None, tcp: bool = True) -> None:
        self.dir = tempfile.mkdtemp(prefix="qpsr", dir="/tmp")
        self.port = _free_port()
        self.sock = os.path.join(self.dir, "r.sock")
        self.password = password
        args = [
            find_server_binary()[0],
            "--port", str(self.port if tcp else 0),
            "--bind", "127.0.0.1",
            "--unixsocket", self.sock,
            "--unixsocketperm", "700",
            "--dir", self.dir,
            "--save", "",
            "--appendonly", "no",
            "--logfile", os.path.join(self.dir, "log"),
        ]  # fmt: skip
        if password is not None:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(
            [*args, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )

    def wait(self, ready: Any) -> bool:
        end = time.monotonic() + 15
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            if ready():
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def auth_server() -> Iterator[_Server]:
    """A TCP + unix-socket server that requires PASSWORD (and knows user ``alice``)."""
    server = _Server(password=PASSWORD)
    try:
        if not server.wait(lambda: _answers(server.port, PASSWORD)):
            pytest.fail("the password server did not start")
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            cmd = [b"AUTH", PASSWORD.encode(), b"ACL", b"SETUSER", b"alice", b"on", b">pw",
                   b"~*", b"&*", b"+@all"]  # fmt: skip
            auth, acl = cmd[:2], cmd[2:]
            for c in (auth, acl):
                sock.sendall(b"".join(resp.pack_command(c)))
                assert sock.recv(100).startswith(b"+OK")
        yield server
    finally:
        server.stop()


def _q(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def tcp_url(server: _Server, db: int = 0) -> str:
    return f"redis://:{_q(PASSWORD)}@127.0.0.1:{server.port}/{db}"


def unix_url(server: _Server, db: int = 0) -> str:
    return f"unix://:{_q(PASSWORD)}@{server.sock}?db={db}"


async def _open(url: str) -> resp.Connection:
    return await resp.open_connection(transport.lean_endpoint(url))


@contextlib.asynccontextmanager
async def lean(url: str) -> Any:
    conn = await _open(url)
    try:
        yield conn
    finally:
        conn.close()
        await conn.wait_closed()


# -- packing ----------------------------------------------------------------------------


def _flat(parts: list[Any]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def test_pack_every_argument_type() -> None:
    class Text(str):
        pass

    args = (
        b"SET",
        "k\u00e9",
        bytearray(b"ba"),
        memoryview(b"mv"),
        -42,
        2**70,
        0.5,
        np.bytes_(b"nb"),
        Text("sub"),
        np.float64(1.25),
    )
    want = (
        b"*10\r\n$3\r\nSET\r\n$3\r\nk\xc3\xa9\r\n$2\r\nba\r\n$2\r\nmv\r\n$3\r\n-42\r\n"
        b"$22\r\n1180591620717411303424\r\n$3\r\n0.5\r\n$2\r\nnb\r\n$3\r\nsub\r\n"
        b"$4\r\n1.25\r\n"
    )
    assert _flat(resp.pack_command(args)) == want
    # what the connection writes: hiredis' packer where it takes every argument
    assert _flat([resp_codec._pack((b"SET", "k\u00e9", -42, 0.5))]) == _flat(
        resp.pack_command((b"SET", "k\u00e9", -42, 0.5))
    )
    for bad in (None, True, object(), [b"x"]):
        with pytest.raises(TypeError):
            resp.pack_command((b"SET", bad))


def test_pack_large_bytes_the_same_without_hiredis() -> None:
    # bytes of LARGE_ARG or more skip hiredis' packer (ten times slower at 1 MiB) and
    # give the same bytes on the wire; smaller commands still take it
    big = bytes(range(256)) * (resp.LARGE_ARG // 256)
    args = (b"SET", "k", big, b"PX", 600000)
    packed = resp_codec._pack(args)
    assert isinstance(packed, list)  # pack_command's buffers, not hiredis' bytes
    assert _flat(packed) == resp_codec._hiredis_pack(args)
    small = (b"SET", "k", big[:-1])
    assert isinstance(resp_codec._pack(small), bytes)
    assert resp_codec._pack(small) == _flat(resp.pack_command(small))


def test_pack_large_buffers_are_not_copied() -> None:
    big = np.arange(resp.LARGE_ARG, dtype=np.float32)  # 4 x LARGE_ARG bytes
    view = memoryview(big)  # format "f": written as its bytes
    parts = resp.pack_command((b"SET", "k", view, b"tail"))
    assert len(parts) == 3
    head, body, rest = parts
    assert head == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % big.nbytes
    assert isinstance(body, memoryview) and body.obj is big  # the caller's buffer itself
    assert rest == b"\r\n$4\r\ntail\r\n"
    # a small view is copied into the command; a non-contiguous one is made contiguous
    assert resp.pack_command((memoryview(b"abc"),)) == [b"*1\r\n$3\r\nabc\r\n"]
    strided = memoryview(np.arange(10, dtype=np.uint8))[::2]
    assert resp.pack_command((strided,)) == [b"*1\r\n$5\r\n\x00\x02\x04\x06\x08\r\n"]


async def test_every_argument_type_round_trips(server_url: str) -> None:
    big = np.random.default_rng(1).integers(0, 255, 5 * 2**20 + 7, dtype=np.uint8)
    values: list[Any] = [
        b"bytes",
        "str \u00e9",
        bytearray(b"ba"),
        memoryview(b"small mv"),
        memoryview(big),
        bytearray(big[:100_000].tobytes()),
        12345,
        -7,
        0.25,
    ]
    async with lean(server_url) as conn:
        for i, value in enumerate(values):
            assert await conn.call((b"SET", f"rt:{i}", value)) == b"OK"
        got = await conn.call((b"MGET", *[f"rt:{i}" for i in range(len(values))]))
        want = [
            b"bytes",
            "str \u00e9".encode(),
            b"ba",
            b"small mv",
            big.tobytes(),
            big[:100_000].tobytes(),
            b"12345",
            b"-7",
            b"0.25",
        ]
        assert got == want
        # a large view in the middle of a pipelined batch
        replies = await conn.call_many(
            [(b"SET", "rt:a", memoryview(big)), (b"STRLEN", "rt:a"), (b"ECHO", b"after")]
        )
        assert replies == [b"OK", big.nbytes, b"after"]
        await conn.call((b"DEL", *[f"rt:{i}" for i in range(len(values))], "rt:a"))


async def test_write_flow_control(server_url: str) -> None:
    """With a tiny write buffer the transport pauses the protocol; calls wait for the
    drain and every reply still arrives in order."""
    big = memoryview(os.urandom(8 * 2**20))
    async with lean(server_url) as conn:
        assert conn._transport is not None
        conn._transport.set_write_buffer_limits(high=4096, low=1024)
        paused = []
        orig = conn.pause_writing

        def spy() -> None:
            paused.append(True)
            orig()

        conn.pause_writing = spy  # type: ignore[method-assign]
        results = await asyncio.gather(
            *(conn.call((b"SET", f"fc:{i}", big)) for i in range(3)),
            conn.call((b"ECHO", b"last")),
        )
        assert results == [b"OK", b"OK", b"OK", b"last"]
        assert paused, "the transport never paused writing"
        assert await conn.call((b"STRLEN", "fc:2")) == len(big)
        await conn.call((b"DEL", "fc:0", "fc:1", "fc:2"))

        # a call issued while paused waits for resume_writing (not for its reply)
        conn.pause_writing()
        task = asyncio.ensure_future(conn.call((b"ECHO", b"x")))
        await until(lambda: _true(len(conn._drain_waiters) == 1))
        assert not task.done()
        conn.resume_writing()
        assert await task == b"x"


async def _true(value: bool) -> bool:
    return value


async def test_large_writes_go_on_a_connection_of_their_own(server_url: str) -> None:
    """Client.write_commands: the buffers as they are, one round trip, replies (errors in
    place) in order, not on the connection the scripts share; transport.write_all
    raises the first error."""
    client = await transport.connect(server_url)
    try:
        big = np.arange(3 * 2**20, dtype=np.uint8)  # a NumPy buffer, sent without a copy
        replies = await client.write_commands(
            [(b"SET", "wc:a", big.data, b"PX", 60_000), (b"SET", "wc:b", b"x"), (b"INCR", "wc:b")]
        )
        assert replies is not None and replies[:2] == [b"OK", b"OK"]
        assert isinstance(replies[2], InternalError)  # not an integer: in its place
        assert await client.commands.get("wc:a") == big.tobytes()
        assert 0 < await client.commands.pttl("wc:a") <= 60_000
        assert client._lean is None or client._lean not in client._idle
        with pytest.raises(InternalError):
            await transport.write_all(client, [(b"SET", "wc:c", b"1"), (b"INCR", "wc:b")])
        assert await client.commands.get("wc:c") == b"1"
        await client.commands.delete("wc:a", "wc:b", "wc:c")
    finally:
        await client.close()


# -- pipelining, cancellation, errors ---------------------------------------------------


async def test_many_concurrent_calls_pipeline_on_one_connection(server_url: str) -> None:
    async with lean(server_url) as conn:
        n = 3000
        replies = await asyncio.gather(*(conn.call((b"ECHO", b"m%d" % i)) for i in range(n)))
        assert replies == [b"m%d" % i for i in range(n)]
        batches = await asyncio.gather(
            *(conn.call_many([(b"ECHO", b"a%d" % i), (b"ECHO", b"b%d" % i)]) for i in range(500))
        )
        assert batches == [[b"a%d" % i, b"b%d" % i] for i in range(500)]
        assert conn.pending == 0
        assert await conn.call_many([]) == []


async def test_cancelled_calls_keep_the_stream_in_step(server_url: str) -> None:
    async with lean(server_url) as conn, lean(server_url) as other:
        key = "cancel:list"
        await conn.call((b"DEL", key))
        blocked = asyncio.ensure_future(_await(conn.call((b"BLPOP", key, 0))))
        behind = [
            asyncio.ensure_future(_await(conn.call((b"ECHO", b"e%d" % i)))) for i in range(50)
        ]
        await until(lambda: _blocked_clients(other, 1))
        blocked.cancel()
        for i in range(0, 50, 3):  # cancel every third caller queued behind it too
            behind[i].cancel()
        await asyncio.sleep(0)  # one loop turn: the cancelled tasks end (no wait on time)
        assert await other.call((b"RPUSH", key, b"v1", b"v2")) == 2
        for i, task in enumerate(behind):
            if i % 3 == 0:
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                assert await task == b"e%d" % i
        # the cancelled BLPOP's reply was read (and dropped) in its turn
        assert await conn.call((b"LRANGE", key, 0, -1)) == [b"v2"]
        assert conn.pending == 0 and not conn.closed
        await conn.call((b"DEL", key))


async def _await(aw: Any) -> Any:
    return await aw


async def _blocked_clients(conn: resp.Connection, n: int) -> bool:
    info = await conn.call((b"INFO", b"clients"))
    return b"blocked_clients:%d\r\n" % n in info


async def test_error_replies(server_url: str) -> None:
    async with lean(server_url) as conn:
        with pytest.raises(resp.ReplyError) as err:
            await conn.call((b"NOSUCHCOMMAND", b"x"))
        assert err.value.code == "ERR"
        await conn.call((b"SET", "err:s", b"x"))
        with pytest.raises(resp.ReplyError) as err:
            await conn.call((b"LPUSH", "err:s", b"y"))
        assert err.value.code == "WRONGTYPE"
        with pytest.raises(resp.ReplyError) as err:
            await conn.call((b"EVALSHA", "0" * 40, 0))
        assert err.value.code == "NOSCRIPT"
        replies = await conn.call_many([(b"ECHO", b"a"), (b"INCR", "err:s"), (b"ECHO", b"b")])
        assert replies[0] == b"a" and replies[2] == b"b"
        assert isinstance(replies[1], resp.ReplyError) and replies[1].code == "ERR"
        assert await conn.call((b"DEL", "err:s")) == 1  # still in step
    assert isinstance(transport.translate(resp.ReplyError("ERR boom")), InternalError)
    # the same qps error text as through redis-py
    client = await transport.connect(server_url)
    try:
        for command in ((b"EVAL", "error('boom')", 0), (b"NOSUCHCOMMAND",)):
            with pytest.raises(Exception) as via_redis_py:
                await client.commands.execute_command(*command)
            assert client._lean is not None
            with pytest.raises(resp.ReplyError) as via_lean:
                await client._lean.call(command)
            assert str(transport.translate(via_lean.value)) == str(
                transport.translate(via_redis_py.value)  # type: ignore[arg-type]
            )
        with pytest.raises(InternalError):  # as redis-py's DataError would be
            await client.run_script("abort", ["k"], [None])  # type: ignore[list-item]
        assert await client.ping()
    finally:
        await client.close()
    for text in ("LOADING Redis is loading", "NOAUTH Authentication required."):
        assert isinstance(transport.translate(resp.ReplyError(text)), UnavailableError)


async def test_connection_loss_fails_pending_calls(server_url: str) -> None:
    async with lean(server_url) as conn, lean(server_url) as other:
        cid = await conn.call((b"CLIENT", b"ID"))
        blocked = asyncio.ensure_future(_await(conn.call((b"BLPOP", "loss:k", 0))))
        behind = asyncio.ensure_future(_await(conn.call((b"ECHO", b"x"))))
        batch = asyncio.ensure_future(conn.call_many([(b"ECHO", b"y")]))
        await until(lambda: _blocked_clients(other, 1))
        assert await other.call((b"CLIENT", b"KILL", b"ID", cid)) == 1
        for task in (blocked, behind, batch):
            with pytest.raises(UnavailableError):
                await task
        assert conn.closed
        with pytest.raises(UnavailableError):
            await conn.call((b"PING",))
        with pytest.raises(UnavailableError):
            await conn.call_many([(b"PING",)])


# -- handshake: TCP, unix, AUTH, SELECT, TLS ----------------------------------------------


async def test_tcp_and_unix_with_password_and_db(auth_server: _Server) -> None:
    for url in (tcp_url(auth_server, 3), unix_url(auth_server, 3)):
        endpoint = transport.lean_endpoint(url)
        assert endpoint.password == PASSWORD and endpoint.db == 3
        async with lean(url) as conn:
            assert await conn.call((b"SET", "db:k", url)) == b"OK"
            assert await conn.call((b"CLIENT", b"INFO"))  # authenticated
    tcp = transport.lean_endpoint(tcp_url(auth_server))
    assert tcp.path is None and tcp.keepalive and tcp.port == auth_server.port
    unix = transport.lean_endpoint(unix_url(auth_server))
    assert unix.path == auth_server.sock and not unix.keepalive
    async with lean(tcp_url(auth_server, 3)) as conn:
        assert await conn.call((b"GET", "db:k")) == unix_url(auth_server, 3).encode()
        assert conn._transport is not None
        sock = conn._transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        await conn.call((b"DEL", "db:k"))
    async with lean(tcp_url(auth_server, 0)) as conn:
        assert await conn.call((b"GET", "db:k")) is None  # db 0 is another database


async def test_acl_user_and_refused_handshakes(auth_server: _Server) -> None:
    url = f"redis://alice:pw@127.0.0.1:{auth_server.port}/0?client_name=lean-test"
    async with lean(url) as conn:
        assert await conn.call((b"ACL", b"WHOAMI")) == b"alice"
        assert await conn.call((b"CLIENT", b"GETNAME")) == b"lean-test"
    with pytest.raises(UnavailableError, match="handshake"):
        await _open(f"redis://:wrong@127.0.0.1:{auth_server.port}/0")
    with pytest.raises(UnavailableError, match="handshake"):
        await _open(f"redis://:{_q(PASSWORD)}@127.0.0.1:{auth_server.port}/99")  # no db 99
    async with lean(f"redis://127.0.0.1:{auth_server.port}") as conn:  # no password
        with pytest.raises(resp.ReplyError) as err:
            await conn.call((b"PING",))
        assert isinstance(transport.translate(err.value), UnavailableError)
    with pytest.raises(UnavailableError):
        await _open(f"redis://127.0.0.1:{_free_port()}")  # nobody listens


async def test_client_on_password_server_select_db(auth_server: _Server) -> None:
    """A Client made by connect() runs its queue scripts over lean connections, with the
    URL's password and database."""
    async with await transport.connect(tcp_url(auth_server, 5)) as client:
        assert client._lean is not None and not client._lean.closed
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="dbq", client=client)
        await q.enqueue(np.int64(4))
        assert await client.commands.dbsize() > 0
        assert int(await q.dequeue()) == 4
        await qps.queues.delete_queue(client, "dbq")
    async with await transport.connect(unix_url(auth_server, 0)) as client:
        assert not [k async for k in client.commands.scan_iter(match="qps:*dbq*")]


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[_Server, str]]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    certs = tempfile.mkdtemp(prefix="qpsc", dir="/tmp")
    cert, key = os.path.join(certs, "cert.pem"), os.path.join(certs, "key.pem")
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
         cert, "-days", "2", "-subj", "/CN=localhost", "-addext",
         "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        capture_output=True,
    )  # fmt: skip
    if made.returncode != 0:
        shutil.rmtree(certs, ignore_errors=True)
        pytest.skip("openssl could not make a certificate")
    port = _free_port()
    server = _Server(
        "--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key,
        "--tls-auth-clients", "no", tcp=False,
    )  # fmt: skip
    server.port = port
    try:
        if not server.wait(lambda: os.path.exists(server.sock) and _tcp_open(port)):
            pytest.skip("this server binary does not do TLS")
        yield server, cert
    finally:
        server.stop()
        shutil.rmtree(certs, ignore_errors=True)


def _tcp_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        return True
    except OSError:
        return False


async def test_tls(tls_server: tuple[_Server, str]) -> None:
    server, cert = tls_server
    verified = f"rediss://localhost:{server.port}/2?ssl_ca_certs={_q(cert)}"
    async with lean(verified) as conn:
        assert await conn.call((b"ECHO", b"over tls")) == b"over tls"
        assert conn._transport is not None
        assert conn._transport.get_extra_info("sslcontext") is not None
    unverified = f"rediss://127.0.0.1:{server.port}?ssl_cert_reqs=none"
    async with lean(unverified) as conn:
        assert await conn.call((b"PING",)) == b"PONG"
    with pytest.raises(UnavailableError):  # the self-signed certificate is not trusted
        await _open(f"rediss://localhost:{server.port}")
    async with await transport.connect(verified) as client:
        q = qps.FIFOQueue(3, np.int64, shapes=[[]], shared_name="tlsq", client=client)
        await q.enqueue(np.int64(9))
        assert int(await q.dequeue()) == 9
        await qps.queues.delete_queue(client, "tlsq")


# -- transport.Client on lean connections -------------------------------------------------


async def test_run_script_reloads_after_noscript(server_url: str) -> None:
    async with await transport.connect(server_url) as client:
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="noscript", client=client)
        await q.enqueue(np.int64(1))
        lean_conn = client._lean

        async def no_redis_py(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a script went through redis-py")

        client.commands.evalsha = no_redis_py  # type: ignore[method-assign]
        client.commands.script_load = no_redis_py  # type: ignore[method-assign]
        client.blocking.pipeline = no_redis_py  # type: ignore[assignment, method-assign]
        await client.commands.script_flush()
        await q.enqueue(np.int64(2))  # NOSCRIPT, SCRIPT LOAD, EVALSHA again
        sha = client._script("enqueue").sha
        assert await client.commands.script_exists(sha) == [True]
        assert [int(await q.dequeue()) for _ in range(2)] == [1, 2]

        # and in a blocking wait: the collect script after BLPOP is missing too
        await client.commands.script_flush()
        task = asyncio.create_task(q.dequeue(timeout=30))
        await until(lambda: _pending_dequeues(q, 1))
        async with await transport.connect(server_url) as other:
            q2 = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="noscript", client=other)
            await q2.enqueue(np.int64(3))
        assert int(await task) == 3
        assert client._lean is lean_conn  # one shared connection all along
        assert len(client._idle) == 1 and not client._busy  # the waiter's, given back
        await qps.queues.delete_queue(client, "noscript")


async def _pending_dequeues(q: qps.QueueBase, n: int) -> bool:
    return (await q.stats()).pending_dequeues == n


async def test_lost_script_connection_fails_calls_then_recovers(server_url: str) -> None:
    async with await transport.connect(server_url) as client:
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="lossq", client=client)
        await q.enqueue(np.int64(1))
        conn = client._lean
        assert conn is not None
        cid = await conn.call((b"CLIENT", b"ID"))
        # hold the shared connection up with a BLPOP, queue a script call behind it
        blocker = asyncio.ensure_future(_await(conn.call((b"BLPOP", "lossq:never", 0))))
        call = asyncio.create_task(q.size())  # not a script: redis-py, unaffected
        pending = asyncio.create_task(q.dequeue_nowait())
        async with lean(server_url) as other:
            await until(lambda: _blocked_clients(other, 1))
            await until(lambda: _true(conn.pending == 2))
            assert await other.call((b"CLIENT", b"KILL", b"ID", cid)) == 1
        with pytest.raises(UnavailableError):
            await blocker
        with pytest.raises(UnavailableError):
            await pending
        assert await call == 1
        assert conn.closed
        # the next call opens a new connection; the element was not taken
        assert int(await q.dequeue_nowait()) == 1
        assert client._lean is not None and client._lean is not conn
        await qps.queues.delete_queue(client, "lossq")


async def test_lost_waiter_connection_is_not_reused(server_url: str) -> None:
    async with await transport.connect(server_url) as client:
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="waitloss", client=client)
        task = asyncio.create_task(q.dequeue(timeout=30))
        await until(lambda: _true(len(client._busy) == 1))
        (waiter,) = client._busy
        cid = await client.commands.client_id()  # any id but the waiter's
        async with lean(server_url) as other:
            await until(lambda: _blocked_clients(other, 1))
            clients = await other.call((b"CLIENT", b"LIST"))
            ids = [
                int(line.split(b"id=")[1].split(b" ")[0])
                for line in clients.splitlines()
                if b"cmd=blpop" in line
            ]
            assert len(ids) == 1 and ids[0] != cid
            assert await other.call((b"CLIENT", b"KILL", b"ID", ids[0])) == 1
        with pytest.raises(UnavailableError):
            await task
        assert waiter.closed and not client._busy and waiter not in client._idle
        # the failed wait withdrew its attempt: the next element is not handed to it
        await q.enqueue(np.int64(5))
        assert int(await q.dequeue(timeout=5)) == 5
        # the client still works; the next wait opens a new waiter connection
        with pytest.raises(DeadlineExceededError):
            await q.dequeue(timeout=0.01)
        assert len(client._idle) == 1 and not client._idle[0].closed
        await qps.queues.delete_queue(client, "waitloss")


async def test_cancelled_waiter_connection_is_discarded(server_url: str) -> None:
    async with await transport.connect(server_url) as client:
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="waitcancel", client=client)
        with pytest.raises(DeadlineExceededError):
            await q.dequeue(timeout=0.01)
        assert len(client._idle) <= 1  # a finished wait gives its connection back
        for conn in client._idle:
            assert not conn.closed
        task = asyncio.create_task(q.dequeue())
        await until(lambda: _true(len(client._busy) == 1))
        (waiter,) = client._busy
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert waiter.closed and waiter not in client._idle and not client._busy
        assert (await q.stats()).pending_dequeues == 0  # the abort ran
        await q.enqueue(np.int64(1))
        assert int(await q.dequeue()) == 1
        await qps.queues.delete_queue(client, "waitcancel")


async def test_send_each_gives_each_reply_as_it_comes(server_url: str) -> None:
    """Commands sent in one write, a blocking one among them: the replies before it are
    usable at once, its own comes when it unblocks, an error reply is a result; the
    connection is reused after the last reply. Cancelling the futures not answered
    closes it (a blocked command may still run)."""
    async with await transport.connect(server_url) as client:
        await client.commands.delete("each:l", "each:s")
        futures = await client.send_each(
            [
                ("SET", "each:s", "1"),
                ("BLPOP", "each:l", 10),
                ("INCR", "each:s"),
                ("HGET", "each:s", "x"),
            ]
        )
        assert futures is not None and len(futures) == 4
        assert await futures[0] in (b"OK", "OK")
        assert not futures[1].done() and len(client._busy) == 1
        await client.commands.rpush("each:l", "v")
        assert await futures[1] == [b"each:l", b"v"]
        assert await futures[2] == 2
        assert isinstance(await futures[3], InternalError)  # WRONGTYPE, not raised
        await until(lambda: _true(not client._busy))
        (conn,) = client._idle
        assert not conn.closed
        futures = await client.send_each([("BLPOP", "each:l", 10), ("BLPOP", "each:l", 10)])
        assert futures is not None
        for f in futures:
            f.cancel()
        await until(lambda: _true(conn.closed and not client._busy))
        assert int(await client.commands.incr("each:s")) == 3  # the client goes on
        await client.commands.delete("each:l", "each:s")


async def test_many_concurrent_waiters_get_their_own_connections(server_url: str) -> None:
    async with await transport.connect(server_url) as client:
        q = qps.FIFOQueue(100, np.int64, shapes=[[]], shared_name="manyw", client=client)
        n = 12
        tasks = [asyncio.create_task(q.dequeue(timeout=30)) for _ in range(n)]
        await until(lambda: _pending_dequeues(q, n))
        await until(lambda: _true(len(client._busy) == n))
        await q.enqueue_many(np.arange(n, dtype=np.int64))
        assert sorted(int(v) for v in await asyncio.gather(*tasks)) == list(range(n))
        assert not client._busy and len(client._idle) == n
        await qps.queues.delete_queue(client, "manyw")


async def test_close_closes_lean_connections_and_wakes_waiters(server_url: str) -> None:
    client = await transport.connect(server_url)
    q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="closew", client=client)
    task = asyncio.create_task(q.dequeue())
    await until(lambda: _true(len(client._busy) == 1))
    shared = client._lean
    assert shared is not None
    (waiter,) = client._busy
    await client.close()
    with pytest.raises(qps.errors.CancelledError):
        await task
    assert shared.closed and waiter.closed
    assert client._lean is None and not client._idle and not client._busy
    # after close, calls go through redis-py, as they did before lean connections
    assert await q.size() == 0
    await client.commands.aclose()
    await client.blocking.aclose()
    async with await transport.connect(server_url) as c2:
        await qps.queues.delete_queue(c2, "closew")


async def test_fakeredis_clients_keep_the_redis_py_path() -> None:
    import fakeredis

    client = transport.from_redis(fakeredis.FakeAsyncRedis())
    q = qps.FIFOQueue(3, np.int64, shapes=[[]], shared_name="fk", client=client)
    await q.enqueue(np.int64(1))
    assert int(await q.dequeue()) == 1
    assert client._lean is None and client._endpoint is None
    await client.close()


def test_resp_module_does_not_import_redis_py() -> None:
    source = Path(resp.__file__).read_text(encoding="utf-8")
    assert "import redis" not in source and "from redis" not in source

"""Security basics: TLS (rediss://) against a local server with a self-signed CA, and a
scan of the package for pickle, eval/exec and object dtypes."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qps
from qps.embedded import find_server_binary
from qps.errors import UnavailableError
from tests.conftest import on_cluster

ROOT = Path(__file__).resolve().parents[1]


# -- no pickle, eval or object dtypes -----------------------------------------------------------


def _sources() -> list[Path]:
    return sorted([*ROOT.joinpath("qps").rglob("*.py"), *ROOT.joinpath("workers").rglob("*.py")])


def test_the_package_never_unpickles_evals_or_uses_object_dtypes() -> None:
    problems = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names]
                mod = node.module if isinstance(node, ast.ImportFrom) else None
                for n in [*names, mod or ""]:
                    if n.split(".")[0] in (
                        "pickle",
                        "cPickle",
                        "dill",
                        "cloudpickle",
                        "marshal",
                        "shelve",
                    ):
                        problems.append(f"{where}: imports {n}")
            elif isinstance(node, ast.Call):
                fn = node.func
                name = (
                    fn.id
                    if isinstance(fn, ast.Name)
                    else fn.attr
                    if isinstance(fn, ast.Attribute)
                    else ""
                )
                if name in ("eval", "exec") and isinstance(fn, ast.Name):
                    problems.append(f"{where}: calls {name}()")
                for kw in node.keywords:
                    if kw.arg == "allow_pickle" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is False
                    ):
                        problems.append(f"{where}: allow_pickle is not False")
                    if kw.arg == "dtype" and (
                        (isinstance(kw.value, ast.Name) and kw.value.id == "object")
                        or (
                            isinstance(kw.value, ast.Constant) and kw.value.value in ("O", "object")
                        )
                    ):
                        problems.append(f"{where}: an object dtype")
            elif isinstance(node, ast.Attribute) and node.attr == "object_":
                problems.append(f"{where}: np.object_")
    assert problems == []


def test_the_wire_refuses_object_arrays() -> None:
    with pytest.raises(qps.errors.InvalidArgumentError):
        qps.wire.encode([np.array([{"a": 1}], dtype=object)])


# -- TLS --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_ca(cn: str, name: str, cwd: str) -> None:
    """A self-signed CA (``name``.key, ``name``.crt) with the extensions Python 3.13's
    strict certificate verification asks for."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.crt",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash", cwd=cwd)  # fmt: skip


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[int, str]]:
    """A TLS-only redis-server with a certificate signed by a fresh self-signed CA;
    yields its port and the CA file."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    binary, _ = find_server_binary()
    d = tempfile.mkdtemp(prefix="qpstls")
    try:
        _make_ca("qps test CA", "ca", d)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
                 "-keyout", "server.key", "-out", "server.csr", cwd=d)  # fmt: skip
        # what Python 3.13's strict verification (VERIFY_X509_STRICT) asks of a leaf
        Path(d, "ext.cnf").write_text(
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid,issuer\n"
        )
        _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "server.crt",
                 cwd=d)  # fmt: skip
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", "server.crt",
             "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt",
             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", d],
            cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                if proc.poll() is not None:
                    pytest.skip("this redis-server cannot serve TLS")
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.05)
            yield port, str(Path(d, "ca.crt"))
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_queues_and_variables_work_over_tls(tls_server: tuple[int, str]) -> None:
    port, ca = tls_server
    url = f"rediss://localhost:{port}/0?ssl_ca_certs={ca}"
    async with await qps.connect(url) as client:
        q = qps.FIFOQueue(10, [np.float32, np.int64], shapes=[[3], []], shared_name="tls",
                          client=client)  # fmt: skip
        await q.enqueue_many([np.ones((4, 3), np.float32), np.arange(4)])
        task = asyncio.create_task(q.dequeue_many(6))  # blocks (lean waiter, over TLS)
        await q.enqueue_many([np.zeros((2, 3), np.float32), np.arange(4, 6)])
        x, y = await asyncio.wait_for(task, 10)
        assert y.tolist() == list(range(6)) and x.shape == (6, 3)
        v = qps.Variable("w", (2, 2), np.float32, initializer="ones", client=client,
                         container="tls")  # fmt: skip
        got = await v.read()
        assert np.array_equal(got.value, np.ones((2, 2), np.float32))


async def test_tls_without_the_ca_or_without_tls_is_refused(tls_server: tuple[int, str]) -> None:
    port, _ = tls_server
    with pytest.raises(UnavailableError):
        client = await qps.connect(f"rediss://localhost:{port}/0")  # system CAs only
        try:
            await qps.FIFOQueue(1, np.int64, shared_name="x", client=client).size()
        finally:
            await client.close()
    with pytest.raises(UnavailableError):
        client = await qps.connect(f"redis://127.0.0.1:{port}/0")  # plain text to a TLS port
        try:
            await qps.FIFOQueue(1, np.int64, shared_name="x", client=client).size()
        finally:
            await client.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_job_trains_over_tls_and_a_wrong_ca_is_refused(
    tls_server: tuple[int, str], tmp_path: Path
) -> None:
    """`qps train` against the TLS server (a shard and a worker, each its own process,
    all over TLS with the test CA); the same command with another CA is refused."""
    port, ca = tls_server
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OPENBLAS_NUM_THREADS": "1"}  # fmt: skip
    env.pop("QPS_REDIS_URL", None)

    def train(ca_file: str) -> subprocess.CompletedProcess[str]:
        url = f"rediss://localhost:{port}/0?ssl_ca_certs={ca_file}"
        return subprocess.run(
            [sys.executable, "-m", "qps.cli.main", "train", "--url", url, "--ps", "1",
             "--workers", "1", "--steps", "200", "--json", "-q"],
            capture_output=True, text=True, env=env, timeout=240, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    ok = train(ca)
    assert ok.returncode == 0, ok.stderr[-3000:]
    result = json.loads(ok.stdout)
    assert result["global_step"] == 200 and result["failed"] == {}
    assert result["test_value"] is not None and result["test_value"] > 0.5
    _make_ca("some other CA", "other", str(tmp_path))
    bad = train(str(tmp_path / "other.crt"))
    assert bad.returncode == 5, bad.stderr[-2000:]  # unavailable: the handshake failed
    assert "certificate verify failed" in bad.stderr or "CERTIFICATE" in bad.stderr.upper()
    assert "Traceback" not in bad.stderr


# -- ACL: a job's credentials reach its own container only ----------------------------------


async def test_an_acl_user_of_one_container_cannot_touch_another(redis_url: str) -> None:
    """A Redis ACL user limited to one container's key patterns (``qps:{C}:*`` and
    ``qps:{C/*``, nothing else: the recipe of docs/containers.md, which
    tests/test_tenants.py runs whole) runs queues, variables and counters there; reading or writing another container is refused with
    PermissionDeniedError, and that container is unchanged."""
    import redis.asyncio as aioredis

    admin: Any = (  # a cluster's ACL users are per node: set on every node
        aioredis.RedisCluster.from_url(redis_url)
        if on_cluster(redis_url)
        else aioredis.Redis.from_url(redis_url)
    )
    every: dict[str, Any] = {"target_nodes": None} if on_cluster(redis_url) else {}
    user = f"job{secrets.token_hex(3)}"
    mine, theirs = f"{user}-a", f"{user}-b"
    if every:
        await admin.initialize()
        every["target_nodes"] = admin.get_nodes()
    await admin.execute_command(
        "ACL", "SETUSER", user, "on", ">s3cret", "resetkeys",
        f"~qps:{{{mine}}}:*", f"~qps:{{{mine}/*",
        "+@all", "-@admin", "-@dangerous", **every,
    )  # fmt: skip
    try:
        async with await qps.connect(redis_url) as owner:  # the other job, full rights
            q_b = qps.FIFOQueue(5, np.int64, shared_name="q", container=theirs, client=owner)
            await q_b.enqueue(np.int64(7))
        scheme, rest = redis_url.split("://", 1)
        url = (
            f"unix://{user}:s3cret@{rest}"
            if scheme == "unix"
            else f"{scheme}://{user}:s3cret@{rest}"
        )
        async with await qps.connect(url) as client:
            q = qps.FIFOQueue(5, np.int64, shared_name="q", container=mine, client=client)
            await q.enqueue(np.int64(1))
            assert int(await q.dequeue()) == 1
            counter = qps.Counter("steps", container=mine, client=client)
            assert await counter.add(2) == 2
            v = qps.Variable("w", (3,), np.float32, initializer="ones", container=mine,
                             client=client)  # fmt: skip
            assert (await v.read()).value.tolist() == [1.0, 1.0, 1.0]
            other = qps.FIFOQueue(5, np.int64, shared_name="q", container=theirs, client=client)
            with pytest.raises(qps.errors.PermissionDeniedError):
                await other.dequeue_nowait()
            with pytest.raises(qps.errors.PermissionDeniedError):
                await other.enqueue(np.int64(9))
            with pytest.raises(qps.errors.PermissionDeniedError):
                await qps.Counter("steps", container=theirs, client=client).add(1)
        async with await qps.connect(redis_url) as owner:
            q_b = qps.FIFOQueue(5, np.int64, shared_name="q", container=theirs, client=owner)
            assert await q_b.size() == 1 and int(await q_b.dequeue()) == 7
    finally:
        await admin.execute_command("ACL", "DELUSER", user, **every)
        await admin.aclose()

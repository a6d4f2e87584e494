"""Fuzzing the command line's inputs: resource names, Redis URLs and checkpoint files.

Whatever the input, ``qps`` must end cleanly: an exit code from docs/cli.md (0 success,
1 failure, 2 usage, 3 not found, 5 unavailable), no Python traceback, a failure reported
as one ``qps: error: ...`` line (a usage error as click's ``Error: ...``), and a password
given in a URL never printed. The commands run in-process through click's CliRunner
against the session's real server (CliRunner's commands call ``asyncio.run``, so these
are plain functions), each example with fresh random containers.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qps
from qps import checkpoint, keys
from qps.cli.main import cli

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=True)


def assert_clean(res: Result, args: list[str], codes: tuple[int, ...], secret: str = "") -> None:
    """The outcome a user may see, and nothing else."""
    where = f"qps {' '.join(repr(a) for a in args)} -> {res.exit_code}\n{res.output}"
    exc = res.exception
    assert exc is None or isinstance(exc, SystemExit), f"{where}\nraised {exc!r}"
    assert res.exit_code in codes, where
    assert "Traceback" not in res.output, where
    if secret:
        for form in {secret, urllib.parse.quote(secret, safe="")}:
            assert form not in res.output, f"password {form!r} printed: {where}"
    if res.exit_code == 0:
        return
    # lines as a terminal shows them (str.splitlines would also split at \x85, \x1c...)
    lines = [ln for ln in res.stderr.replace("\r\n", "\n").split("\n") if ln.strip()]
    if res.exit_code == 2 and any(ln.startswith("Error: ") for ln in lines):
        return  # click's usage error: usage line, hint, one "Error:" line
    errors = [ln for ln in lines if ln.startswith("qps: error: ")]
    assert len(errors) == 1, where
    assert all(ln.startswith("qps: ") for ln in lines), where  # errors and log records


# -- names ------------------------------------------------------------------------------------

_odd = st.sampled_from(
    [
        "",
        " ",
        "*",
        "?",
        "[a]",
        "{x}",
        "a:b",
        "::",
        "a b",
        "-x",
        "--help",
        "..",
        "/",
        "\\",
        "é",
        "\u2603",
    ]
)
_names = (
    _odd
    | st.text(alphabet=st.sampled_from(list("ab:{}*? -_./\\\u00e9\u4e2d\U0001f600\t")), max_size=12)
    | st.text(max_size=8)
    | st.integers(129, 700).map(lambda n: "n" * n)
    | st.builds(lambda a, b: a + b, _odd, st.text(alphabet="xyz", max_size=3))
)


def _name_commands(name: str, container: str) -> list[list[str]]:
    return [
        ["queue", "stat", name, "--container", container],
        ["queue", "peek", name, "-n", "2", "--container", container],
        ["queue", "close", name, "--yes", "--container", container],
        ["var", "stat", name, "--container", container],
        ["var", "get", name, "--container", container],
        ["container", "stat", name],
        ["container", "reset", name, "--yes"],
        ["queue", "ls", "--container", name],
        ["var", "ls", "--container", name],
    ]


@FUZZ
@given(name=_names, container=_names, valid_container=st.booleans())
def test_fuzz_names(redis_url: str, name: str, container: str, valid_container: bool) -> None:
    if valid_container:
        container = f"clifuzz-{secrets.token_hex(3)}"
    for args in _name_commands(name, container):
        args = [*args, "--url", redis_url]
        assert_clean(invoke(*args), args, (0, 1, 2, 3))


def test_names_that_exist_are_found(redis_url: str) -> None:
    """The fuzz above mostly reaches 'not found': a name that exists goes through."""
    container = f"clifuzz-{secrets.token_hex(3)}"
    name = "odd:name/x-1.y_2"  # every character a name may have

    async def make() -> None:
        async with await qps.connect(redis_url) as c:
            q = qps.FIFOQueue(
                3, np.int64, shapes=[[]], shared_name=name, container=container, client=c
            )
            await q.enqueue(np.int64(7))

    asyncio.run(make())
    for args in (
        ["queue", "stat", name],
        ["queue", "peek", name],
        ["queue", "close", name, "--yes"],
    ):
        args = [*args, "--container", container, "--url", redis_url]
        res = invoke(*args)
        assert_clean(res, args, (0,))
    args = ["container", "reset", container, "--yes", "--url", redis_url]
    assert_clean(invoke(*args), args, (0,))


# -- URLs -------------------------------------------------------------------------------------

_password = st.builds(
    lambda s: "Pw" + s,
    st.text(
        alphabet=st.sampled_from(list("abcXYZ019!$&'()*+,;=:@/?#[]% ~é")), min_size=6, max_size=16
    ),
)
_schemes = st.sampled_from(
    ["redis", "rediss", "unix", "http", "REDIS", "redis+sentinel", "", "valkey"]
)
# hosts that never need DNS and ports that refuse at once (never the system's 6379)
_hosts = st.sampled_from(["127.0.0.1", "[::1]", "", "127.0.0.1.", "[::1", "0.0.0.0", "127.1"])
_ports = st.sampled_from(["1", "0", "65536", "-1", "abc", "", "99999999999", "9", "1:2"])


@st.composite
def _urls(draw: st.DrawFn, real: str) -> tuple[str, str]:
    """A URL with a password in it, and the password."""
    pw = draw(_password)
    user = draw(st.sampled_from(["", "user", "default", "a:b"]))
    quoted = draw(st.booleans())
    auth = f"{user}:{urllib.parse.quote(pw, safe='') if quoted else pw}@"
    shape = draw(st.integers(0, 3))
    if shape == 0:  # the real server (a unix socket), with a password it does not want
        parsed = urllib.parse.urlsplit(real)
        return urllib.parse.urlunsplit(parsed._replace(netloc=auth + parsed.netloc)), pw
    if shape == 1:
        path = draw(st.sampled_from(["/nonexistent/qps.sock", "", "/", "/tmp"]))
        return f"unix://{auth}{path}", pw
    scheme, host, port = draw(_schemes), draw(_hosts), draw(_ports)
    db = draw(st.sampled_from(["", "/0", "/x", "/99", "?db=1", "?password=" + pw]))
    return f"{scheme}://{auth}{host}:{port}{db}", pw


def test_url_whose_password_looks_like_a_query_is_a_usage_error(redis_url: str) -> None:
    """Found by the fuzz below: redis-py read '?=' in an unquoted password as a query with
    an empty option name and raised TypeError, which escaped as a traceback."""
    scheme, rest = redis_url.split("://", 1)
    url = f"{scheme}://:Pw0000?=@{rest}"
    args = ["queue", "ls", "--url", url]
    res = invoke(*args)
    assert_clean(res, args, (2,), secret="Pw0000?=")
    assert "invalid Redis URL" in res.stderr


def test_password_in_the_query_is_not_printed() -> None:
    """Found by the fuzz below: redis-py takes a password from '?password=' too, and the
    error message showed it (only the user:password@ part was redacted)."""
    args = ["queue", "ls", "--url", "redis://127.0.0.1:1/0?password=Pw123456&db=0"]
    res = invoke(*args)
    assert_clean(res, args, (5,), secret="Pw123456")


@pytest.fixture(scope="module")
def real_url(redis_url: str) -> str:
    return redis_url


@FUZZ
@given(data=st.data())
def test_fuzz_urls_never_print_the_password(real_url: str, data: st.DataObject) -> None:
    url, pw = data.draw(_urls(real_url))
    # one command per example: a refused connection costs redis-py's retries
    cmd = data.draw(st.sampled_from([["queue", "ls"], ["container", "ls"], ["var", "ls"]]))
    args = [*cmd, "--url", url]
    assert_clean(invoke(*args), args, (0, 1, 2, 5), secret=pw)


# -- checkpoint files ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_checkpoint(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real checkpoint of a small container (two variables, the global step)."""
    container = f"clifuzz-ck-{secrets.token_hex(3)}"
    root = tmp_path_factory.mktemp("ck")

    async def make() -> Path:
        async with await qps.connect(redis_url) as c:
            async with qps.Session(client=c, container=container) as s:
                await s.variable("w", (2, 3), np.float32, np.ones((2, 3), np.float32)).create()
                await s.variable("names", (2,), "S5", np.array([b"ab", b"hello"])).create()
                await s.counter(keys.GLOBAL_STEP).add(5)
            info = await checkpoint.save(c, root / "good", container=container)
            await qps.reset(client=c, containers=[container])
            return info.path

    yield asyncio.run(make())
    shutil.rmtree(root, ignore_errors=True)


def _mutate(raw: bytes, data: st.DataObject) -> bytes:
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "replace"]), label="edit")
        pos = data.draw(st.integers(0, max(len(out) - 1, 0)), label="at")
        if kind == "flip" and out:
            out[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif kind == "truncate":
            del out[pos:]
        elif kind == "insert":
            out[pos:pos] = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
        else:
            out = bytearray(data.draw(st.binary(max_size=64), label="garbage"))
    return bytes(out)


@FUZZ
@given(data=st.data())
def test_fuzz_checkpoint_files(
    redis_url: str,
    good_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
) -> None:
    work = tmp_path_factory.mktemp("fuzzck")
    ck = work / "ck"
    shutil.copytree(good_checkpoint, ck)
    files = sorted(p.name for p in ck.iterdir())
    for name in data.draw(st.sets(st.sampled_from(files), min_size=1, max_size=2), label="files"):
        path = ck / name
        if data.draw(st.integers(0, 9), label="delete") == 0:
            path.unlink()
        else:
            path.write_bytes(_mutate(path.read_bytes(), data))
    container = f"clifuzz-{secrets.token_hex(3)}"
    try:
        for args in (
            ["checkpoint", "ls", str(work)],
            ["checkpoint", "ls", str(ck / "manifest.json")],
            [
                "checkpoint",
                "restore",
                str(ck),
                "--yes",
                "--container",
                container,
                "--url",
                redis_url,
            ],
        ):
            res = invoke(*args)
            assert_clean(res, args, (0, 1, 3))
            if args[1] == "restore" and res.exit_code == 0:
                # a mutation the checks let through must not have changed the values
                args = ["var", "get", "w", "--container", container, "--url", redis_url]
                got = invoke(*args)
                assert_clean(got, args, (0,))
    finally:

        async def drop() -> None:
            async with await qps.connect(redis_url) as c:
                await qps.reset(client=c, containers=[container])

        asyncio.run(drop())
        shutil.rmtree(work, ignore_errors=True)


def test_manifest_without_a_key_restore_needs_is_refused_before_writing(
    redis_url: str, good_checkpoint: Path, tmp_path: Path
) -> None:
    """Found by the fuzz above: a manifest without "config" passed the checks, the
    container was reset and variables written, then restore died with KeyError."""
    ck = tmp_path / "ck"
    shutil.copytree(good_checkpoint, ck)
    m = json.loads((ck / "manifest.json").read_text())
    del m["config"]
    (ck / "manifest.json").write_text(json.dumps(m))
    container = f"clifuzz-{secrets.token_hex(3)}"
    args = ["checkpoint", "restore", str(ck), "--yes", "--container", container]
    res = invoke(*args, "--url", redis_url)
    assert_clean(res, args, (1,))
    assert "bad manifest" in res.stderr
    args = ["container", "stat", container, "--url", redis_url]
    assert_clean(invoke(*args), args, (3,))  # nothing was written


def test_good_checkpoint_restores(redis_url: str, good_checkpoint: Path) -> None:
    """The fuzz above starts from a checkpoint that restores cleanly."""
    container = f"clifuzz-{secrets.token_hex(3)}"
    args = ["checkpoint", "restore", str(good_checkpoint), "--yes", "--container", container]
    res = invoke(*args, "--url", redis_url)
    assert_clean(res, args, (0,))
    assert "restored" in res.output

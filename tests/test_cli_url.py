"""A malformed ``--url`` is a usage error in every command that takes one.

``qps queue ls --url http://...`` always said ``qps: error: invalid Redis URL ...`` and
exited 2, but ``qps train`` let redis-py's ValueError escape ("unexpected ValueError",
exit 1). The URL is now checked where ``--url`` is parsed, for every command, before
the command does anything: no output, no server, no process, no connection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest

from qps.cli import EXIT_USAGE
from qps.cli.main import cli, run

BAD = "http://localhost:6379"
SCHEME = "Redis URL must specify one of the following schemes (redis://, rediss://, unix://)"

#: every command that takes --url, with the other arguments it needs
COMMANDS: list[list[str]] = [
    ["queue", "ls"],
    ["queue", "stat", "q"],
    ["queue", "peek", "q"],
    ["queue", "close", "q", "--yes"],
    ["queue", "drain", "q", "--yes"],
    ["container", "ls"],
    ["container", "stat", "c"],
    ["container", "reset", "c", "--yes"],
    ["var", "ls"],
    ["var", "stat", "v"],
    ["var", "get", "v"],
    ["worker", "--index", "0", "--num-workers", "1"],
    ["train"],
    ["train", "--workers", "1", "--ps", "1", "--steps", "1"],
    ["ps", "--shard", "0", "--num-shards", "1"],
    ["ps", "status"],
    ["ps", "finish"],
    ["ps", "dlq", "ls"],
    ["ps", "dlq", "show", "0"],
    ["ps", "dlq", "drop", "--yes"],
    ["job", "ls"],
    ["job", "status"],
    ["job", "wait"],
    ["job", "stop", "--yes"],
    ["top"],
    ["top", "--once"],
    ["checkpoint", "save", "ck"],
    ["checkpoint", "restore", "ck", "--yes"],
    ["demo"],
    ["feed", "--dataset", "digits"],
]


def _commands_with_url(group: click.Group, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    found = set()
    for name, cmd in group.commands.items():
        if any(p.name == "url" for p in cmd.params):
            found.add((*path, name))
        if isinstance(cmd, click.Group):
            found |= _commands_with_url(cmd, (*path, name))
    return found


def test_every_command_with_url_is_covered() -> None:
    covered = {tuple(a for a in args if not a.startswith("-"))[:3] for args in COMMANDS}
    for path in _commands_with_url(cli):
        assert any(c[: len(path)] == path for c in covered), path


def _assert_usage_error(argv: list[str], capsys: Any, shown: str = BAD) -> str:
    code = run(argv)
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE, err
    assert out == ""  # nothing started, nothing printed before the error
    assert err.splitlines() == [f"qps: error: invalid Redis URL {shown}: {SCHEME}"]
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_bad_url_is_a_usage_error(args: list[str], capsys: Any) -> None:
    _assert_usage_error([*args, "--url", BAD], capsys)


@pytest.mark.parametrize(
    "args",
    [["train"], ["worker", "--index", "0", "--num-workers", "1"], ["ps", "status"], ["top"]],
    ids=lambda a: a[0],
)
def test_bad_url_from_the_environment(
    args: list[str], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QPS_REDIS_URL is checked the same way."""
    monkeypatch.setenv("QPS_REDIS_URL", BAD)
    _assert_usage_error(args, capsys)


def test_bad_url_before_other_options(capsys: Any) -> None:
    """The URL is checked as it is parsed: before a missing --index is reported."""
    _assert_usage_error(["worker", "--url", BAD], capsys)


def test_bad_url_in_a_train_config(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "job.toml"
    config.write_text(f'url = "{BAD}"\nworkers = 1\n')
    _assert_usage_error(["train", "--config", str(config)], capsys)


def test_password_of_a_bad_url_is_not_printed(capsys: Any) -> None:
    err = _assert_usage_error(
        ["train", "--url", "http://user:sekret@localhost:6379/0"],
        capsys,
        shown="http://user:***@localhost:6379/0",
    )
    assert "sekret" not in err


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://localhost:abc/0", "Port could not be cast to integer"),
        ("redis://localhost:1/0?nosuch=1", "unknown query option (AbstractConnection"),
        ("redis://localhost:1/0?cluster=maybe", "cluster= in the Redis URL must be yes or no"),
        ("rediss://localhost:1/0?ssl_cert_reqs=bogus", "Invalid SSL Certificate Requirements"),
    ],
)
def test_other_malformed_urls(url: str, why: str, capsys: Any) -> None:
    assert run(["train", "--url", url]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"qps: error: invalid Redis URL {url}: ")
    assert why in err and not err.startswith("qps: error: unexpected")


def test_well_formed_urls_pass_the_check() -> None:
    """Only the form is checked here: reaching the server is the command's business."""
    from qps.cli import check_url

    for url in (
        None,
        "redis://localhost:1/0",
        "redis://user:pw@127.0.0.1:6379/2?cluster=no",
        "rediss://h:1/0?ssl_cert_reqs=none",
        "unix:///nonexistent/redis.sock?db=1",
    ):
        assert check_url(url) == url

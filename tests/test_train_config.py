"""`qps train`'s settings: where they come from.

* Every option's environment variable is QPS_<COMMAND>_<LONG OPTION> (QPS_TRAIN_WORKERS,
  not click's QPS_TRAIN_NUM_WORKERS), shown in every --help.

The in-process tests replace :func:`workers.launcher.run_job` with a stand-in that
records the job's :class:`~workers.launcher.TrainConfig`: nothing starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from qps.cli import _docgen
from qps.cli.main import cli, run
from workers import launcher
from workers.launcher import JobResult, TrainConfig

REPO = str(Path(__file__).resolve().parents[1])

#: the global variables, whatever the command (qps --help lists them)
GLOBAL_ENVVARS = {
    "QPS_LOG_LEVEL", "QPS_LOG_JSON", "QPS_REDIS_URL", "QPS_CLUSTER", "QPS_CONTAINER",
    "QPS_METRICS_PORT", "QPS_METRICS_ADDR", "QPS_BACKEND", "QPS_RUN_DIR",
}  # fmt: skip


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[TrainConfig]]:
    """The configs `qps train` would run (run_job replaced); no QPS_ variable set."""
    for name in list(os.environ):
        if name.startswith("QPS_") and not name.startswith("QPS_TEST"):
            monkeypatch.delenv(name)
    seen: list[TrainConfig] = []

    async def fake_run_job(cfg: TrainConfig, *args: Any, **kwargs: Any) -> JobResult:
        seen.append(cfg)
        return JobResult(stopped="finished")

    monkeypatch.setattr(launcher, "run_job", fake_run_job)
    yield seen


# -- environment variables: one rule, shown in every --help ------------------------------


def test_train_reads_qps_train_workers_and_ps(
    jobs: list[TrainConfig], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("QPS_TRAIN_WORKERS", "1")
    monkeypatch.setenv("QPS_TRAIN_PS", "1")
    monkeypatch.setenv("QPS_TRAIN_LEARNING_RATE", "0.5")  # either long name of --lr
    monkeypatch.setenv("QPS_TRAIN_NUM_SHARDS", "6")  # the parameter's name: no variable
    assert run(["train"]) == 0
    (cfg,) = jobs
    assert (cfg.num_workers, cfg.num_shards, cfg.learning_rate) == (1, 1, 0.5)
    capsys.readouterr()
    monkeypatch.setenv("QPS_TRAIN_WORKERS", "three")
    assert run(["train"]) == 2
    assert "QPS_TRAIN_WORKERS" in capsys.readouterr().err
    assert len(jobs) == 1


def _options(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[Any]:
    """(command path, command, option) of every option of the tree (not --version)."""
    for param in command.params:
        if isinstance(param, click.Option) and not (param.is_eager and param.is_flag):
            yield path, command, param
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _options(sub, (*path, name))


def test_every_option_has_its_variable_by_the_rule_and_shows_it_in_help() -> None:
    helps: dict[tuple[str, ...], str] = {}
    count = 0
    for path, _, option in _options(cli):
        count += 1
        names = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or [])
        assert names, (path, option.opts)
        longs = [o[2:] for o in option.opts if o.startswith("--")] or [option.name]
        wanted = ["_".join(["QPS", *path, n]).upper().replace("-", "_") for n in longs]
        assert names == wanted or set(names) <= GLOBAL_ENVVARS, (path, option.opts, names)
        if path not in helps:
            result = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200)
            assert result.exit_code == 0, result.output
            helps[path] = " ".join(result.output.split())
        assert f"env var: {', '.join(names)}" in helps[path], (path, option.opts)
    assert count > 150  # the whole tree
    assert "env var: QPS_TRAIN_WORKERS;" in helps[("train",)]
    assert "env var: QPS_PS_DLQ_LS_SHARD;" in helps[("ps", "dlq", "ls")]


def test_the_rule_is_in_qps_help_and_the_reference() -> None:
    text = " ".join(CliRunner().invoke(cli, ["--help"]).output.split())
    assert (
        "QPS_<COMMAND>_<OPTION>" in text and "QPS_TRAIN_WORKERS for `qps train --workers`" in text
    )
    reference = _docgen.render()
    assert "- `--workers INTEGER RANGE` (env `QPS_TRAIN_WORKERS`" in reference
    assert "(env `QPS_TRAIN_LR, QPS_TRAIN_LEARNING_RATE`)" in reference
    assert "QPS_TRAIN_NUM_WORKERS" not in reference
    docs = (Path(REPO) / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "QPS_TRAIN_WORKERS" in docs and "auto_envvar_prefix" not in docs

"""`qps train`'s settings: where they come from and what is refused before a job starts.

* A ``--config`` file's values go through their options' types, ranges and choices, as
  the flags' would (``mode = "fast"`` trained asynchronously, ``steps = -3`` failed in
  every worker, ``workers = "three"`` was an unexpected TypeError); the error names the
  file and the key. Precedence: command line > environment > file > example > default.
* Every option's environment variable is QPS_<COMMAND>_<LONG OPTION> (QPS_TRAIN_WORKERS,
  not click's QPS_TRAIN_NUM_WORKERS), shown in every --help.
* A model, optimizer or data set no role could use is refused by `qps train` itself
  (exit 2, one line), and a role that exits 2 is never started again.
* `qps --log-level` and `qps --log-json` reach the roles.

The in-process tests replace :func:`workers.launcher.run_job` with a stand-in that
records the job's :class:`~workers.launcher.TrainConfig`: nothing starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
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


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``qps ARGV``; assert a usage error of one ``qps: error:`` line, nothing on
    stdout; return the message."""
    code = run(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qps: error: "), err
    return lines[0][len("qps: error: ") :]


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


# -- --config values are checked as their options' --------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('mode = "fast"', "mode='fast' is not one of async, ssp, sync"),
        ("steps = -3", "steps=-3: -3 is not in the range x>=1"),
        ('workers = "three"', "workers='three': 'three' is not a valid integer"),
        ("steps = 2.5", "steps=2.5: '2.5' is not a valid integer"),  # as --steps 2.5
        ('[train]\nmax-staleness = -1\nmode = "ssp"', "max-staleness=-1: -1 is not in the range"),
        ('pack = "maybe"', "pack='maybe': 'maybe' is not a valid boolean"),
        ("ps = true", "ps=True: 'True' is not a valid integer"),
        ('grad_dtype = "int8"', "grad_dtype='int8' is not one of float16"),
        ('example = "mnist"', "example='mnist' is not one of ctr, digits"),
    ],
)
def test_a_bad_config_value_is_refused_naming_the_file_and_key(
    text: str, message: str, tmp_path: Path, jobs: list[TrainConfig], capsys: Any
) -> None:
    path = _config(tmp_path, text)
    got = _refused(["train", "--config", path], capsys)
    assert got.startswith(f"{path}: {message}"), got
    assert jobs == []


def test_config_keys_spellings_table_and_alias(tmp_path: Path, jobs: list[TrainConfig]) -> None:
    """Keys as the long option names, - or _, optionally under [train]; lr is
    learning-rate; each value arrives converted as its flag's would."""
    path = _config(
        tmp_path,
        '[train]\nps = 1\nworkers = 2\nmax-staleness = 1\nmode = "ssp"\nbatch_size = 16\n'
        'lr = 0.25\npack = false\nmetrics-port = 0\ngrad-dtype = "float16"\n',
    )
    assert run(["train", "--config", path]) == 0
    (cfg,) = jobs
    assert (cfg.num_shards, cfg.num_workers, cfg.max_staleness) == (1, 2, 1)
    assert (cfg.batch_size, cfg.learning_rate, cfg.pack) == (16, 0.25, False)
    assert cfg.metrics_port == 0 and cfg.grad_dtype == "float16"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope = 1", "unknown key 'nope' (known: "),
        ("quiet = true", "unknown key 'quiet'"),  # what a run prints is no job setting
        ("lr = 0.1\nlearning-rate = 0.2", "'lr' and 'learning-rate' set the same option"),
        ("model = [1, 2]", "model must be a string, a number or a boolean"),
        ("train = 3", "[train] must be a table"),
    ],
)
def test_config_files_that_name_no_options_are_refused(
    text: str, message: str, tmp_path: Path, jobs: list[TrainConfig], capsys: Any
) -> None:
    path = _config(tmp_path, text)
    assert _refused(["train", "--config", path], capsys).startswith(f"{path}: {message}")
    assert jobs == []


def test_config_keys_are_the_options_of_before() -> None:
    """Every job option's long name, no more (the set the file took before, and the
    options added since: --checkpoint-keep, --until-global-step)."""
    from qps.cli.train import config_keys

    assert set(config_keys(cli.commands["train"])) == {
        "example", "ps", "workers", "mode", "max_staleness", "backup_workers", "model",
        "data", "batch_size", "steps", "optimizer", "learning_rate", "lr", "seed", "url",
        "container", "max_group", "max_message_mib", "metrics_port", "metrics_addr",
        "checkpoint_dir", "checkpoint_every", "log_every", "logdir", "restarts", "backend",
        "grad_dtype", "pack", "checkpoint_keep", "until_global_step",
    }  # fmt: skip


def test_precedence_command_line_env_file_example_default(
    tmp_path: Path, jobs: list[TrainConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _config(
        tmp_path, 'example = "ctr"\nps = 4\nworkers = 5\nsteps = 7\nlr = 0.3\nseed = 9\n'
    )
    monkeypatch.setenv("QPS_TRAIN_WORKERS", "2")  # beats the file
    monkeypatch.setenv("QPS_TRAIN_PS", "3")  # loses to the command line
    assert run(["train", "--config", path, "--ps", "1", "--seed", "4"]) == 0
    (cfg,) = jobs
    assert cfg.num_shards == 1 and cfg.seed == 4  # command line
    assert cfg.num_workers == 2  # environment
    assert cfg.steps == 7 and cfg.learning_rate == 0.3  # file, over the example's
    assert cfg.optimizer == "adagrad" and cfg.batch_size == 128  # the file's example
    assert cfg.max_group == 8 and cfg.restarts == 3  # defaults
    assert cfg.data == "ctr" and cfg.model.startswith("embbag:")


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


# -- settings no role could use: refused before anything starts --------------------------


def test_settings_no_role_could_use_are_refused_up_front(
    tmp_path: Path, jobs: list[TrainConfig], capsys: Any
) -> None:
    np.savez(tmp_path / "three.npz", a=np.zeros(2), b=np.zeros(2), c=np.zeros(2))
    (tmp_path / "junk.npz").write_text("not a zip")
    cases = [
        (["--model", "foo:1,2"], "unknown model 'foo'; names: embbag, mlp"),
        (["--model", "mlp:64"], "model mlp: needs at least 2 widths"),
        (
            ["--model", "py:no_such_module_here.Model"],
            "py:no_such_module_here.Model: cannot import",
        ),
        (["--optimizer", "fast"], "unknown optimizer 'fast'; known: adagrad"),
        (["--lr", "-1"], "SGD: learning_rate must be >= 0, got -1.0"),
        (["--data", "mnist"], "--data 'mnist' is not one of digits, teacher, ctr"),
        (["--data", str(tmp_path / "none.npz")], "No such file or directory"),
        (["--data", str(tmp_path / "junk.npz")], "is not an .npz file"),
        (["--data", str(tmp_path / "three.npz")], "expected arrays 'x' and 'y'"),
        (["--data", "queue:"], "--data queue:: invalid resource name ''"),
        (["--data", "ctr"], "--data ctr needs an embedding-bag model"),
        (["--batch-size", "2000"], "--batch-size 2000 is larger than the 1,437 training"),
        (["--container", "a b"], "invalid container name 'a b'"),
    ]
    for args, message in cases:
        assert message in _refused(["train", *args], capsys), args
    assert jobs == []
    path = _config(tmp_path, 'model = "foo:1,2"\n')  # from a file too
    assert _refused(["train", "--config", path], capsys).startswith("unknown model 'foo'")
    assert jobs == []


def test_the_builtin_sizes_are_the_data_sets() -> None:
    from workers.data import builtin_split
    from workers.models import build_model

    model = build_model("embbag:tables=10,dim=2")
    for name, size in launcher.BUILTIN_TRAIN_SIZES.items():
        train, _ = builtin_split(name, model)
        assert len(train[-1]) == size, name


def test_a_worker_refuses_a_bad_model_before_it_connects(capsys: Any) -> None:
    # the URL names no server: an exit status of 2 says nothing tried to connect
    base = ["worker", "--index", "0", "--num-workers", "1", "--url", "redis://127.0.0.1:1/0"]
    assert "unknown model 'foo'" in _refused([*base, "--model", "foo:1,2"], capsys)
    assert "--data ctr needs" in _refused([*base, "--data", "ctr"], capsys)


def test_a_bad_url_is_a_usage_error(tmp_path: Path, jobs: list[TrainConfig], capsys: Any) -> None:
    shown = "invalid Redis URL http://localhost:6379: Redis URL must specify one of"
    assert _refused(["train", "--url", "http://localhost:6379"], capsys).startswith(shown)
    path = _config(tmp_path, 'url = "http://localhost:6379"\n')
    assert _refused(["train", "--config", path], capsys).startswith(shown)
    assert jobs == []


def test_a_role_that_exits_with_a_usage_error_is_not_started_again(redis_url: str) -> None:
    """The worker refuses an option (exit status 2): it would again, so it is not
    restarted (--restarts 3) and the job stops at once with it failed."""
    lines: list[str] = []
    cfg = TrainConfig(
        num_shards=1, num_workers=1, steps=5, restarts=3, url=redis_url,
        container=f"t-{secrets.token_hex(4)}", extra_worker_args=["--no-such-option"],
    )  # fmt: skip
    result = asyncio.run(launcher.run_job(cfg, lines.append))
    assert result.failed == {"worker0": 2} and result.restarts == {}, (result, lines)
    assert result.exit_code == 1 and result.stopped == "every worker failed"
    assert not [ln for ln in lines if "starting it again" in ln], lines
    assert "qps train: worker0 exited with status 2 (a usage error: not started again)" in lines
    assert sum("No such option '--no-such-option'" in ln for ln in lines) == 1, lines


# -- qps --log-level / --log-json reach the roles ----------------------------------------


def _train_logs(redis_url: str, *global_args: str) -> list[str]:
    """The roles' lines (``[ps0] ...``) of a small job run with ``qps GLOBAL_ARGS train``."""
    env = {**os.environ, "PYTHONPATH": REPO}
    for name in ("QPS_LOG_LEVEL", "QPS_LOG_JSON", "QPS_REDIS_URL"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-m", "qps.cli.main", *global_args, "train", "--url", redis_url,
         "--container", f"t-{secrets.token_hex(4)}", "--ps", "1", "--workers", "1",
         "--steps", "40", "--log-every", "10"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return [ln for ln in out.stderr.splitlines() if re.match(r"\[(ps|worker)\d+\] ", ln)]


def test_the_roles_log_as_json_at_info_by_default(redis_url: str) -> None:
    """`qps --log-json train`: every role logs JSON lines, at INFO as `qps train` always
    streamed them (no --log-level given)."""
    lines = _train_logs(redis_url, "--log-json")
    records = [json.loads(ln.split("] ", 1)[1]) for ln in lines if "] {" in ln]
    assert {r["level"] for r in records} == {"INFO"}, lines
    assert {"qps.ps", "qps.worker"} <= {r["logger"] for r in records}, records
    assert not [ln for ln in lines if " qps: INFO: " in ln], lines  # no text records


def test_the_roles_log_at_the_level_given(redis_url: str) -> None:
    lines = _train_logs(redis_url, "--log-level", "warning")
    assert lines  # the roles' own output still streams ("qps ps: shard 0/1 ...")
    assert not [ln for ln in lines if "INFO" in ln], lines

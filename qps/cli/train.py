"""``qps train``: run a whole training job locally (:mod:`workers.launcher`)."""

from __future__ import annotations

import json as jsonlib
import logging
import sys
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from qps import backend
from qps.cli import EXIT_USAGE, CliError, json_option, run_async, url_option
from qps.cli.progress import Progress
from qps.ps.messages import GRAD_DTYPES
from qps.stopping import Stopped, Stopper

if TYPE_CHECKING:
    from workers.launcher import JobResult

log = logging.getLogger("qps.train")

#: after SIGTERM/SIGINT, ``qps train`` cuts its waits short and stops its roles (each
#: exits within 1.5 s: qps.stopping), then reports within REPORT_SECONDS
#: (workers.launcher): it is done within about 2 s. Should something not be cut short,
#: its main task is cancelled this long after the signal (the summary still printed),
#: and it exits at once (status 130) at the deadline.
STOP_GRACE_SECONDS = 3.0
STOP_DEADLINE_SECONDS = 4.0

#: the examples ``--example`` names: option defaults for each
EXAMPLES: dict[str, dict[str, Any]] = {
    "digits": {
        "model": "mlp:64,128,10",
        "data": "digits",
        "batch_size": 64,
        "steps": 1500,
        "optimizer": "sgd",
        "learning_rate": 0.05,
    },
    # a CTR model with three embedding tables (rows pulled and pushed sparsely) on
    # synthetic click data; reported metric: test AUC
    "ctr": {
        "model": "embbag:tables=20000-2000-200,dim=8,dense=4,hidden=32,pool=mean,bag=3",
        "data": "ctr",
        "batch_size": 128,
        "steps": 600,
        "optimizer": "adagrad",
        "learning_rate": 0.1,
    },
}

#: train's parameters a --config file cannot set (what a run prints, and the file itself)
NOT_IN_CONFIG = frozenset({"config_path", "quiet", "json", "cluster"})

#: where the --config callback leaves (path, {parameter name: (key, value)}) for errors
_CONFIG_META = "qps.train.config"


def _read_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # a dependency on Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}", EXIT_USAGE) from exc
    except tomllib.TOMLDecodeError as exc:
        raise CliError(f"{path} is not valid TOML: {exc}", EXIT_USAGE) from exc
    table = raw.get("train", raw)
    if not isinstance(table, dict):
        raise CliError(f"{path}: [train] must be a table", EXIT_USAGE)
    return table


def config_keys(command: click.Command) -> dict[str, str]:
    """The keys a --config file may hold (``_`` spelling) -> the parameter each sets:
    every long option name of ``command`` (``ps``, ``workers``, ``lr`` and
    ``learning_rate``...) but those of :data:`NOT_IN_CONFIG`."""
    keys: dict[str, str] = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name and param.name not in NOT_IN_CONFIG:
            for opt in param.opts:
                if opt.startswith("--"):
                    keys[opt[2:].replace("-", "_")] = param.name
    return keys


def _load_config(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """``--config``, eager: the file's values become the command's ``default_map``, so
    each goes through its option's type, range and choices as a flag's value would (as
    text: ``steps = 2.5`` is refused like ``--steps 2.5``), below the command line and
    the environment and above the example's preset."""
    if not path:
        return
    known = config_keys(ctx.command)
    defaults: dict[str, str] = {}
    where: dict[str, tuple[str, Any]] = {}
    for key, value in _read_toml(path).items():
        name = known.get(key.replace("-", "_"))
        if name is None:
            raise CliError(
                f"{path}: unknown key {key!r} (known: {', '.join(sorted(known))})", EXIT_USAGE
            )
        if name in where:
            raise CliError(
                f"{path}: {where[name][0]!r} and {key!r} set the same option", EXIT_USAGE
            )
        if not isinstance(value, (str, int, float, bool)):
            raise CliError(
                f"{path}: {key} must be a string, a number or a boolean, got {value!r}",
                EXIT_USAGE,
            )
        defaults[name] = str(value)
        where[name] = (key, value)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[_CONFIG_META] = (path, where)


class TrainCommand(click.Command):
    """``qps train``: a value of its --config file that its option refuses is reported
    with the file and the key (exit status 2)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as exc:
            config = ctx.meta.get(_CONFIG_META)
            param = exc.param
            if config is None or param is None or param.name not in config[1]:
                raise
            if ctx.get_parameter_source(param.name) is not ParameterSource.DEFAULT_MAP:
                raise
            path, where = config
            key, value = where[param.name]
            if isinstance(param.type, click.Choice):
                choices = ", ".join(str(c) for c in param.type.choices)
                message = f"{path}: {key}={value!r} is not one of {choices}"
            else:
                message = f"{path}: {key}={value!r}: {exc.message}"
            raise CliError(message, EXIT_USAGE) from exc


@click.command(name="train", cls=TrainCommand)
@click.option(
    "--example",
    type=click.Choice(sorted(EXAMPLES)),
    default="digits",
    show_default=True,
    help="A built-in example: its model, data and hyper-parameters are the defaults.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    is_eager=True,
    expose_value=False,
    callback=_load_config,
    help="A TOML file of these options (keys as the long option names, - or _, e.g. "
    "workers = 3, max-staleness = 2), optionally under [train]; each value is checked "
    "as its option's. Options given on the command line or in their environment "
    "variables win; the file wins over the --example preset.",
)
@click.option("--ps", "num_shards", type=click.IntRange(min=1), default=None, help="PS shards [2].")
@click.option(
    "--workers", "num_workers", type=click.IntRange(min=1), default=None, help="Workers [3]."
)
@click.option(
    "--mode",
    type=click.Choice(["async", "ssp", "sync"]),
    default=None,
    help="async: every gradient applied on arrival (TF's default) [async]; ssp: bounded "
    "staleness, see --max-staleness; sync: SyncReplicasOptimizer: each update applies the "
    "mean of one gradient per worker, all computed from the same parameters (see "
    "--backup-workers).",
)
@click.option(
    "--backup-workers",
    type=click.IntRange(min=0),
    default=None,
    help="sync: updates aggregate workers - B gradients; the slowest B are backups whose "
    "late gradients are dropped (TF's replicas_to_aggregate < total_num_replicas) [0].",
)
@click.option(
    "--max-staleness",
    type=click.IntRange(min=0),
    default=None,
    help="ssp: how many steps a worker may run ahead of the slowest one [2].",
)
@click.option(
    "--max-group",
    type=click.IntRange(min=1),
    default=None,
    help="Messages a shard reads ahead and applies as one group [8]. Larger groups apply "
    "faster; each message read ahead is one more update a gradient can be stale by.",
)
@click.option(
    "--max-message-mib",
    type=click.IntRange(min=1, max=2048),
    default=None,
    help="The largest gradient message in MiB (see `qps ps --max-message-mib`) [512].",
)
@click.option("--model", default=None, help="NAME:OPTIONS (see `qps worker --help`).")
@click.option("--data", default=None, help="digits, a .npz file, or queue:NAME.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None)
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Steps per worker.")
@click.option("--optimizer", default=None, help="sgd, momentum, adagrad, adam, rmsprop, ftrl.")
@click.option("--lr", "--learning-rate", "learning_rate", type=float, default=None)
@click.option("--seed", type=int, default=None, help="Worker I draws with default_rng(seed + I).")
@url_option(
    "Redis URL of the job. Default: a private server started for this run and stopped after it."
)
@click.option(
    "--container",
    default=None,
    help="The job's container (default: a fresh train-<time>-<random> one). Run again "
    "after a crash or Ctrl-C, the same command resumes the job, from Redis or from the "
    "newest checkpoint, whichever is newer; a container whose job finished, or that "
    "another qps train is running, is refused.",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The chief restores the newest checkpoint here (when it is newer than what "
    "the container holds) and saves checkpoints here with --checkpoint-every.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=0),
    default=None,
    help="The chief saves a checkpoint under --checkpoint-dir every this many global steps.",
)
@click.option(
    "--checkpoint-keep",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="The chief keeps its newest N checkpoints and deletes older ones (TF's "
    "max_to_keep; 0: keep all) [5].",
)
@click.option(
    "--until-global-step",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="The workers stop once the job's global step reaches N (or after --steps, "
    "whichever comes first): a resumed job ends where the first run would have.",
)
@click.option("--log-every", type=click.IntRange(min=1), default=None)
@click.option(
    "--metrics-port",
    envvar="QPS_METRICS_PORT",
    show_envvar=True,
    type=click.IntRange(0, 65535),
    default=None,
    metavar="BASE",
    help="Serve each role's Prometheus metrics: shard I on BASE+I, worker K on "
    "BASE+shards+K (0: each a free port); the ports are printed.",
)
@click.option(
    "--metrics-addr",
    envvar="QPS_METRICS_ADDR",
    show_envvar=True,
    default=None,
    metavar="ADDR",
    help="Address the roles' metrics endpoints listen on [127.0.0.1].",
)
@click.option(
    "--logdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Every worker writes TensorBoard scalars under LOGDIR/worker-<index>/ "
    "(see `qps plot LOGDIR`).",
)
@click.option(
    "--restarts",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Start a role that dies (a crash, a kill) again, up to N times each, as a "
    "process manager would: a shard takes its lease back at once, a worker resumes "
    "after its last published step. 0: never. [3]",
)
@click.option(
    "--backend",
    type=click.Choice(backend.CHOICES, case_sensitive=False),
    default=None,
    help="Where the workers' math runs (see `qps worker --backend`) [$QPS_BACKEND, "
    "else auto: CuPy on a CUDA device for a model of over 200,000 dense parameters, "
    "NumPy otherwise].",
)
@click.option(
    "--grad-dtype",
    type=click.Choice(GRAD_DTYPES),
    default=None,
    help="The workers send gradients in this narrower float dtype (see `qps worker "
    "--grad-dtype`) [the variables' dtype].",
)
@click.option(
    "--pack/--no-pack",
    default=None,
    help="Store a small dense model's parameters packed into one flat variable per "
    "PS shard (see `qps worker --pack`; `qps var get W1` still works) [pack].",
)
@click.option("--quiet", "-q", is_flag=True, help="Do not stream the roles' logs.")
@json_option
@click.pass_context
def train(ctx: click.Context, /, quiet: bool, json: bool, **flags: Any) -> None:
    """Train a model with parameter servers on this machine: one command starts a
    Redis server (or uses --url), the PS shards and the workers as separate processes,
    shows progress, and prints the final metrics.

    `qps train` runs the digits example: an MLP 64-128-10 on scikit-learn's digits,
    2 PS shards, 3 asynchronous workers of 1,500 steps each, SGD with learning rate
    0.05. Every role's log is streamed with its name in front (at INFO unless
    `qps --log-level` or QPS_LOG_LEVEL says otherwise; as JSON with `qps --log-json`);
    a progress bar (on a
    terminal; a plain line every 10% elsewhere) shows the workers' steps, the global
    step, examples/s and the loss. When the workers are done the job is
    marked finished, the shards drain their queues and exit, and the test accuracy,
    global step, examples/s and staleness (p50/p99, in applied updates) are printed.

    A setting no role could run with (an unknown model, optimizer or data set, a bad
    value in --config) is refused before anything starts (exit status 2).
    Ctrl-C stops every role (SIGTERM, then SIGKILL after 10 s): nothing is left
    running; `qps train` is done within about 2 s, its set-up included (exit status
    130). Redis lost while the job runs stops it too: the roles are not started
    again, the summary gives the last global step (exit status 5).
    A role that dies is started again (--restarts, 3 times each by default;
    never one that exits with status 2, a usage error): every gradient is still applied
    exactly once. Past that, a worker that crashes does
    not stop an asynchronous job; a shard that fails stops it (exit status 1).
    --metrics-port gives every role a Prometheus endpoint (docs/metrics.md).
    """
    from workers.launcher import TrainConfig, run_job

    preset = EXAMPLES[flags.pop("example")]
    merged = {**preset, **{k: v for k, v in flags.items() if v is not None}}
    mode = merged.pop("mode", "async")
    staleness = merged.pop("max_staleness", None)
    backups = merged.pop("backup_workers", None)
    if backups is not None and mode != "sync":
        raise CliError("--backup-workers needs --mode sync", EXIT_USAGE)
    if mode == "ssp":
        staleness = 2 if staleness is None else staleness
    elif staleness is not None:
        raise CliError("--max-staleness needs --mode ssp", EXIT_USAGE)
    if merged.get("checkpoint_every") and not merged.get("checkpoint_dir"):
        raise CliError("--checkpoint-every needs --checkpoint-dir", EXIT_USAGE)
    sync_replicas = None
    if mode == "sync":
        sync_replicas = merged.get("num_workers", 3) - (backups or 0)
        if sync_replicas < 1:
            raise CliError(
                f"--backup-workers {backups} leaves no worker to aggregate "
                f"(--workers {merged.get('num_workers', 3)})",
                EXIT_USAGE,
            )
    cfg = TrainConfig(
        max_staleness=staleness, sync_replicas=sync_replicas, role_env=_role_env(ctx), **merged
    )
    if cfg.metrics_port and cfg.metrics_port + cfg.num_shards + cfg.num_workers > 65536:
        raise CliError(f"--metrics-port {cfg.metrics_port} leaves too few ports", EXIT_USAGE)
    try:  # what a role would refuse: refused once, here, before anything starts
        cfg.check()
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    bar = Progress("qps train", unit="worker steps", live=sys.stderr.isatty() and not json)

    def emit(line: str) -> None:
        if quiet and line.startswith("["):
            return
        bar.line(line)

    stopper = Stopper(grace=STOP_GRACE_SECONDS, deadline=STOP_DEADLINE_SECONDS)

    async def main() -> Any:
        return await stopper.run(run_job(cfg, emit, bar.update, stopper), "qps train", log)

    with bar:
        try:
            result = run_async(main())
        except Stopped:  # cancelled before run_job could say (a stop it did not see)
            stopper.ended(130)
            raise click.exceptions.Exit(130) from None
    stopper.ended(result.exit_code)  # what the watchdog exits with, should it fire now
    if json:
        click.echo(jsonlib.dumps(result.as_dict(), indent=2))
    else:
        click.echo(summary(result))
        if result.failed:
            click.echo(
                "roles that failed: "
                + ", ".join(f"{k} (status {v})" for k, v in result.failed.items())
            )
    if result.exit_code:
        sys.exit(result.exit_code)


def summary(result: JobResult) -> str:
    """The last line of ``qps train``: how the job ended (``finished``,
    ``interrupted``, ``ps0 failed``...; ``failed: Redis at URL became unreachable after
    N s`` with the last global step seen), the test metric, the global step, the
    examples and their rate, the staleness."""
    metric = result.test_metric or "accuracy"
    value = "-" if result.test_value is None else f"{result.test_value:.4f}"
    p50 = "-" if result.staleness_p50 is None else str(result.staleness_p50)
    p99 = "-" if result.staleness_p99 is None else str(result.staleness_p99)
    how = f"failed: {result.error}" if result.error else result.stopped
    last = "last " if result.error else ""
    return (
        f"{how}: test {metric} {value}, {last}global step {result.global_step:,}, "
        f"{result.examples:,} examples in {result.seconds:.1f} s "
        f"({result.examples_per_second:,.0f} examples/s), staleness p50 {p50} / p99 {p99}"
    )


def _role_env(ctx: click.Context) -> dict[str, str]:
    """The environment the roles need to log as ``qps --log-level/--log-json`` asked.

    A role logs at INFO unless a level was chosen (:func:`qps.cli.role_logs`): a level
    given on the command line is passed on as QPS_LOG_LEVEL (one from QPS_LOG_LEVEL is
    inherited as it is), and so is --log-json as QPS_LOG_JSON."""
    root = ctx.find_root()
    env: dict[str, str] = {}
    source = root.get_parameter_source("log_level")
    if source is not None and source is not ParameterSource.DEFAULT:
        env["QPS_LOG_LEVEL"] = str(root.params["log_level"]).upper()
    if root.params.get("log_json"):
        env["QPS_LOG_JSON"] = "1"
    return env

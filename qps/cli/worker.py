"""``qps worker``: run one training worker (:mod:`workers.worker`)."""

from __future__ import annotations

import dataclasses
import json as jsonlib

import click

from qps import backend
from qps.cli import (
    EXIT_USAGE,
    CliError,
    container_option,
    json_option,
    metrics_options,
    role_logs,
    serve_metrics,
    url_option,
)
from qps.cli.role import run_role
from qps.errors import InvalidArgumentError
from qps.ps.messages import GRAD_DTYPES

MODEL_HELP = (
    "The model, NAME:OPTIONS: softmax:IN,CLASSES; mlp:IN,HIDDEN...,CLASSES; "
    "embbag:tables=...,dim=...; packed:[GROUPS:]INNER for model INNER with its dense "
    "parameters stored as GROUPS flat variables (faster updates for small dense models; "
    "GROUPS = the number of PS shards spreads them); py:MODULE.ATTR[:OPTIONS] for a "
    "model of your own (see docs/models.md)."
)
DATA_HELP = (
    "Where batches come from: a built-in data set, each worker drawing its own "
    "minibatches: 'digits' (scikit-learn's digits, W4's split), 'teacher' (W5's "
    "synthetic data) or 'ctr' (synthetic clicks shaped for an embbag model); a .npz "
    "file with arrays x and y; or queue:NAME (a shared input queue filled by `qps feed`; "
    "the worker stops when it is closed and empty)."
)


def _index(ctx: click.Context, param: click.Parameter, value: str) -> int:
    if value == "auto":
        return -1
    try:
        index = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an integer or 'auto'") from None
    if index < 0:
        raise click.BadParameter(f"{index} is below 0")
    return index


@click.command(name="worker")
@click.option(
    "--index",
    required=True,
    callback=_index,
    metavar="I|auto",
    help="This worker's index I (0 is the chief), or auto: claim a free index from 1 up "
    "(replicas of one compose service; a restarted replica gets its index back).",
)
@click.option(
    "--num-workers", type=click.IntRange(min=1), required=True, help="Workers in the job (W)."
)
@click.option(
    "--num-shards",
    type=click.IntRange(min=1),
    default=None,
    help="PS shards in the job; the chief records it if no shard has yet.",
)
@click.option("--model", default="mlp:64,128,10", show_default=True, help=MODEL_HELP)
@click.option("--data", default="digits", show_default=True, help=DATA_HELP)
@click.option(
    "--eval-data",
    default=None,
    metavar="NAME|FILE.npz",
    help="The chief evaluates the job's parameters on this held-out data: a built-in data "
    "set's test split, or an .npz file (x, y) [the test split of --data when that is "
    "built in; none for --data queue:NAME].",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(min=0),
    default=1500,
    show_default=True,
    help="This worker's steps (0: no limit; stop at the end of input or --until-global-step).",
)
@click.option(
    "--until-global-step",
    type=click.IntRange(min=0),
    default=None,
    help="Stop once the job's global step reaches this (read every --log-every steps, "
    "and more often as it nears).",
)
@click.option(
    "--seed",
    type=int,
    default=1,
    show_default=True,
    help="Worker I draws its minibatches with default_rng(seed + I).",
)
@click.option(
    "--max-staleness",
    type=click.IntRange(min=0),
    default=None,
    help="Bounded staleness (SSP): wait while more than this many steps ahead of the "
    "slowest running worker. Default: asynchronous, no bound.",
)
@click.option("--log-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option(
    "--backend",
    type=click.Choice(backend.CHOICES, case_sensitive=False),
    envvar=backend.ENV_VAR,
    show_envvar=True,
    default="auto",
    show_default=True,
    help="Where each step's math runs: auto (CuPy where CuPy and a CUDA device exist "
    "and the model has over 200,000 dense parameters; a smaller one is faster in "
    "NumPy), numpy, or cupy (refused without a device). On the device the parameters "
    "are copied there after each pull and the gradients back before each push.",
)
@click.option(
    "--grad-dtype",
    type=click.Choice(GRAD_DTYPES),
    default=None,
    help="Send gradients in this narrower float dtype (float16: half the bytes of "
    "float32 gradients); the shard widens them to the variable's dtype before the "
    "apply. A value past float16's range (65504) becomes Inf and the shard "
    "dead-letters the message. Default: the variables' dtype.",
)
@click.option(
    "--pack/--no-pack",
    default=True,
    show_default=True,
    help="Store a small dense model's parameters (two or more of one dtype, no "
    "embedding table, at most 262,144 elements) joined into one flat variable per PS "
    "shard, packed/0, packed/1...: a shard commits and a worker reads one variable "
    "instead of one per parameter, much faster for small models. `qps var get W1` "
    "still reads a parameter by its name. The chief decides for the job (and keeps "
    "the variables a container or checkpoint already holds); the others follow.",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The chief restores the newest checkpoint here into an empty container, and "
    "writes checkpoints here with --checkpoint-every.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=0),
    default=0,
    help="The chief saves a checkpoint every this many global steps (0: never).",
)
@click.option(
    "--checkpoint-keep",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    metavar="N",
    help="The chief keeps its newest N checkpoints in --checkpoint-dir (those of this "
    "container, model-<step>) and deletes older ones after each save, as TF's "
    "max_to_keep (0: keep all).",
)
@click.option(
    "--logdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write TensorBoard scalars (loss, examples/s, staleness; the chief's test "
    "accuracy) under LOGDIR/worker-<index>/ every --log-every steps; see `qps plot`.",
)
@click.option(
    "--ready-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds a worker waits for the chief to make the model ready.",
)
@click.option(
    "--finish-job/--no-finish-job",
    default=True,
    show_default=True,
    help="Whether the last worker to finish marks the PS job finished (the shards then "
    "drain their queues and exit).",
)
@url_option()
@container_option
@json_option
@metrics_options
@click.pass_context
def worker(
    ctx: click.Context, /, json: bool, metrics_port: int | None, metrics_addr: str, **opts: object
) -> None:
    """Run training worker I of W (TF 1.x between-graph replication).

    Worker 0 is the chief: it initialises the variables (or restores the newest
    checkpoint of --checkpoint-dir into an empty container) and marks the model ready;
    the others wait for it, blocked in Redis. Each step takes a batch, reads the
    parameters straight from Redis, computes the gradients (NumPy, or CuPy on a GPU:
    --backend) and pushes them to the PS shards (`qps ps`), which apply them. The next batch is
    fetched while a step computes, and the push and the next pull travel together.

    It stops after --steps steps, at --until-global-step, at the end of its input, or
    on SIGTERM/Ctrl-C or `qps job stop` after the step in hand (a wait for the chief, a
    batch, a token or slower workers ends at once); then it records itself done (the
    chief prints the test accuracy of the digits example, but not after a signal) and
    exits 0. A stop by a signal that cannot end within 1 s (Redis hung) is cut short:
    exit status 128 + the signal (143, 130). Progress is logged
    every --log-every steps and published for `qps top`; --metrics-port serves
    Prometheus metrics (docs/metrics.md); with --logdir the training curves are
    written for TensorBoard and `qps plot`.
    """
    from workers.worker import WorkerConfig, run_worker

    role_logs(ctx, "qps.worker")
    steps = opts.pop("steps")
    opts["grad_dtype"] = opts.get("grad_dtype") or ""
    cfg = WorkerConfig(steps=None if steps == 0 else steps, **opts)  # type: ignore[arg-type]
    try:  # refused here, before it connects: exit 2, which `qps train` never restarts
        cfg.check()
        from workers.launcher import check_data, check_model

        model = check_model(cfg.model)
        check_data(cfg.data, model, cfg.batch_size)
        if cfg.eval_data is not None:
            if cfg.eval_data.startswith("queue:"):
                raise InvalidArgumentError("--eval-data takes a built-in data set or an .npz file")
            check_data(cfg.eval_data, model)
    except Exception as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    serve_metrics(ctx, metrics_port, metrics_addr)
    result = run_role("qps worker", "qps.worker", lambda stopper: run_worker(cfg, stopper))
    if json:
        data = dataclasses.asdict(result)
        data.pop("losses", None)
        click.echo(jsonlib.dumps(data, indent=2))

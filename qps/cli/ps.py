"""``qps ps``: run a PS shard, and inspect or finish a PS job.

* ``qps ps --shard I --num-shards N [--optimizer NAME --lr X -p NAME=VALUE ...]`` runs
  shard ``I`` (:class:`qps.ps.Shard`) until the job is finished (exit 0), ``SIGTERM`` or
  Ctrl-C (exit 0 after the group of messages in hand; see :mod:`qps.stopping`), or its
  lease is lost or the job's stored state is corrupt (exit 1, the error naming the key).
* ``qps ps status``: each shard's state, lease, counters and staleness per worker.
* ``qps ps dlq ls|show|drop``: the dead letters (messages a shard refused).
* ``qps ps finish``: mark the job finished (the shards drain their queues and exit).
"""

from __future__ import annotations

import contextlib
import json as jsonlib
import sys
import time
from typing import Any

import click

from qps import wire
from qps.cli import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CliError,
    connected,
    container_option,
    json_option,
    metrics_options,
    role_logs,
    run_async,
    serve_metrics,
    url_option,
)
from qps.cli.role import run_role
from qps.cli.var import report_broken
from qps.optimizers import make_optimizer
from qps.ps import control
from qps.ps.messages import SparseGradient, decode_message
from qps.ps.shard import (
    DEFAULT_COMMIT_INTERVAL_MS,
    DEFAULT_LEASE_MS,
    DEFAULT_MAX_GROUP,
    DEFAULT_MAX_GROUP_BYTES,
    Shard,
    ShardOptions,
)
from qps.stopping import Stopper
from qps.transport import Client


def _echo_json(data: Any) -> None:
    click.echo(jsonlib.dumps(data, indent=2, default=str))


def _hparam_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        return float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number or a bool") from None


def _optimizer(name: str | None, lr: float | None, hparams: tuple[str, ...]) -> Any:
    if name is None:
        if lr is not None or hparams:
            raise CliError("--lr and -p need --optimizer", EXIT_USAGE)
        return None
    kw: dict[str, Any] = {}
    if lr is not None:
        kw["learning_rate"] = lr
    for item in hparams:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"-p takes NAME=VALUE, got {item!r}", EXIT_USAGE)
        kw[key.strip()] = _hparam_value(value)
    try:
        return make_optimizer(name, **kw)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc


async def _serve(url: str | None, options: ShardOptions, stopper: Stopper) -> str:
    async with contextlib.AsyncExitStack() as stack:
        async with stopper.interruptible("connecting to Redis"):
            client = await stack.enter_async_context(connected(url))
        shard = Shard(client, options)
        stopper.on_stop(shard.request_stop)  # after the group of messages in hand
        return await shard.run()


@click.group(name="ps", invoke_without_command=True)
@click.option("--shard", type=click.IntRange(min=0), default=None, help="This shard's index I.")
@click.option(
    "--num-shards", type=click.IntRange(min=1), default=None, help="Shards in the job (N)."
)
@url_option()
@container_option
@click.option(
    "--optimizer",
    default=None,
    help="sgd, momentum, adagrad, adam, rmsprop or ftrl (default: the job's stored one; "
    "until another shard or qps.ps.configure records one, the shard waits for it).",
)
@click.option("--lr", "--learning-rate", "lr", type=float, default=None, help="learning_rate.")
@click.option(
    "-p",
    "--hparam",
    "hparams",
    multiple=True,
    metavar="NAME=VALUE",
    help="Another hyper-parameter by its TF name, e.g. -p beta1=0.9 -p lazy=true.",
)
@click.option(
    "--lease-ms",
    type=click.IntRange(min=300),
    default=DEFAULT_LEASE_MS,
    show_default=True,
    help="The shard's lease; a standby takes over at most this long after a crash.",
)
@click.option(
    "--reset-slots",
    is_flag=True,
    default=False,
    help="Replace optimizer slots stored by another optimizer with fresh ones.",
)
@click.option(
    "--max-group",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_GROUP,
    show_default=True,
    help="Most messages applied together and committed once per variable "
    "(1: a commit per message).",
)
@click.option(
    "--max-group-mib",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_GROUP_BYTES >> 20,
    show_default=True,
    help="Most MiB of gradients in one group (and read ahead, at most 64).",
)
@click.option(
    "--commit-interval-ms",
    type=click.FloatRange(min=0),
    default=DEFAULT_COMMIT_INTERVAL_MS,
    show_default=True,
    help="How long a group keeps taking messages that are in the queue before it "
    "commits (at least 4 x the last commit's duration: slow commits of large variables "
    "stay within about a fifth of the time); it commits at once when the queue is empty.",
)
@click.option(
    "--max-message-mib",
    type=click.IntRange(min=1, max=(wire.MAX_MESSAGE_BYTES >> 20) + 1),
    default=None,
    help="The job's largest gradient message, in MiB: workers refuse to push a larger "
    "one, and a shard dead-letters one that arrives. Set once per job, like "
    "--num-shards; 2048 means the wire format's limit, 2 GiB - 1 byte "
    f"[default: {control.DEFAULT_MAX_MESSAGE_BYTES >> 20}].",
)
@metrics_options
@click.pass_context
def ps(
    ctx: click.Context,
    shard: int | None,
    num_shards: int | None,
    url: str | None,
    container: str,
    optimizer: str | None,
    lr: float | None,
    hparams: tuple[str, ...],
    lease_ms: int,
    reset_slots: bool,
    max_group: int,
    max_group_mib: int,
    commit_interval_ms: float,
    max_message_mib: int | None,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Run PS shard I of N: own the variables placed on it, apply the gradient messages
    of its queue with the optimizer, publish versioned parameters.

    One writer per shard: a second copy waits as a standby until the lease of the first
    one runs out (or it exits), then fences the variables and takes over. Every message
    is applied exactly once across crashes. Under load it applies the messages that are
    waiting as one group and commits each variable once for all of them (--max-group,
    --max-group-mib, --commit-interval-ms). It exits 0 when the job is finished
    (`qps ps finish`) and its queue is drained, and on SIGTERM or Ctrl-C after the
    group in hand (128 + the signal if that takes over 1 s: Redis hung); 1 if its
    lease was lost, or if it found the job's stored state corrupt (its config,
    placement or lease, or a key of a variable it owns: the error names the key). The
    first shard records N, the
    optimizer and --max-message-mib in the container; later ones must agree.
    --metrics-port serves its Prometheus metrics (docs/metrics.md).

    \b
    Subcommands: status, dlq ls|show|drop, finish (see `qps ps COMMAND --help`).
    """
    if ctx.invoked_subcommand is not None:
        return
    if shard is None or num_shards is None:
        raise CliError("give --shard I and --num-shards N (or a subcommand)", EXIT_USAGE)
    if shard >= num_shards:
        raise CliError(f"--shard {shard} is not below --num-shards {num_shards}", EXIT_USAGE)
    role_logs(ctx, "qps.ps")
    serve_metrics(ctx, metrics_port, metrics_addr)
    options = ShardOptions(
        shard=shard,
        num_shards=num_shards,
        container=container,
        optimizer=_optimizer(optimizer, lr, hparams),
        lease_ms=lease_ms,
        reset_slots=reset_slots,
        max_group=max_group,
        max_group_bytes=max_group_mib << 20,
        commit_interval_ms=commit_interval_ms,
        max_message_bytes=_mib_bytes(max_message_mib),
    )
    reason = run_role("qps ps", "qps.ps", lambda stopper: _serve(url, options, stopper))
    click.echo(f"qps ps: shard {shard}/{num_shards} {reason}", err=True)


# -- status ----------------------------------------------------------------------------------


async def _statuses(client: Client, container: str) -> list[control.ShardStatus]:
    cfg = await control.read_config(client, container)
    if cfg is None:
        raise CliError(f"no PS job in container '{container}'", EXIT_NOT_FOUND)
    return [await control.shard_status(client, container, i) for i in range(cfg.num_shards)]


async def _status(url: str | None, container: str) -> tuple[list[control.ShardStatus], int, bool]:
    async with connected(url) as client:
        st = await _statuses(client, container)
        gs = await control.global_step_counter(client, container).get()
        return st, gs, await control.is_finished(client, container)


def _p(v: int | None) -> str:
    return "-" if v is None else str(v)


def _mib_bytes(mib: int | None) -> int | None:
    """MiB as bytes, capped at the wire's limit (2 GiB - 1: 2048 MiB is one byte over)."""
    return None if mib is None else min(mib << 20, wire.MAX_MESSAGE_BYTES)


def _b(n: int | None) -> str:
    """A byte count for a table cell: 0, 812B, 1.5K, 24.0M, 2.0G."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "K", "M"):
        if size < 1024:
            return f"{n}B" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}G"


@ps.command(name="status")
@url_option()
@container_option
@json_option
def status_command(url: str | None, container: str, json: bool) -> None:
    """Each shard's state, lease owner and fencing token, variables owned, messages
    applied, skipped (redeliveries) and dropped as stale (synchronous training), rows,
    dead letters, queue size, the bytes held for it, and staleness p50/p99 (updates a
    gradient missed between its read and its apply) per worker.

    Bytes held: QUEUED, the messages waiting in its queue (in Redis); BLOCKED, the
    pushes waiting for room in the full queue (in Redis too); HELD, the messages the
    shard took and has not acknowledged yet, read ahead and in the group it applies (in
    Redis until the ack; as of its last group or lease renewal).

    A shard whose stats, lease or dead letters are corrupt is listed as broken, with
    what is wrong, naming the key, on a line under the table ("problem" with --json);
    the other shards are listed as usual, and the command exits with 1.

    With --json: {"container", "global_step", "finished", "shards": [...]}.
    """
    statuses, gs, finished = run_async(_status(url, container))
    broken = [(f"shard {s.shard}", s.problem) for s in statuses if s.problem]
    if json:
        _echo_json(
            {
                "container": container,
                "global_step": gs,
                "finished": finished,
                "shards": [s.as_dict() for s in statuses],
            }
        )
        report_broken(broken, json)
        return
    state = "finished" if finished else "running"
    click.echo(f"container {container}: global step {gs}, job {state}")
    header = ["SHARD", "STATE", "TOKEN", "VARS", "APPLIED", "SKIPPED", "DROPPED", "ROWS", "DLQ"]
    header.append("QUEUE")
    header += ["QUEUED", "BLOCKED", "HELD"]
    rows = [header]
    for s in statuses:
        rows.append(
            [
                str(s.shard),
                s.state,
                _p(s.token),
                str(s.variables),
                str(s.applied),
                str(s.skipped),
                str(s.dropped_stale),
                str(s.rows),
                str(s.dead_letters),
                _p(s.queue_size),
                _b(s.queue_bytes),
                _b(s.pending_bytes),
                _b(s.held_bytes),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        )
    for s in statuses:
        per = s.percentiles()
        if not per:
            continue
        click.echo(f"shard {s.shard} staleness (updates missed between read and apply):")
        for worker, p in per.items():
            name = "all workers" if worker == "*" else worker
            click.echo(
                f"  {name}: {p['messages']} message(s), p50 {_p(p['p50'])}, p99 {_p(p['p99'])}"
            )
    report_broken(broken, json)


# -- finish ----------------------------------------------------------------------------------


async def _finish(url: str | None, container: str) -> int:
    async with connected(url) as client:
        if await control.read_config(client, container) is None:
            raise CliError(f"no PS job in container '{container}'", EXIT_NOT_FOUND)
        return await control.mark_finished(client, container)


@ps.command(name="finish")
@url_option()
@container_option
def finish_command(url: str | None, container: str) -> None:
    """Mark the job finished: the shards' gradient queues close, each shard applies
    what its queue still holds and exits 0; later pushes fail."""
    n = run_async(_finish(url, container))
    click.echo(f"job in container '{container}' marked finished ({n} queue(s) closed)")


# -- dead letters ----------------------------------------------------------------------------


@ps.group(name="dlq")
def dlq() -> None:
    """Dead letters: gradient messages a shard refused (undecodable, unknown variable,
    wrong shape or dtype, NaN or Inf), kept with their provenance and bytes."""


async def _dlq(url: str | None, container: str, shard: int | None) -> list[dict[str, Any]]:
    async with connected(url) as client:
        cfg = await control.read_config(client, container)
        if cfg is None:
            raise CliError(f"no PS job in container '{container}'", EXIT_NOT_FOUND)
        shards = range(cfg.num_shards) if shard is None else [shard]
        out = []
        for s in shards:
            for d in await control.dead_letters(client, container, s):
                d.setdefault("shard", s)
                out.append(d)
        return out


def _shard_option(f: Any) -> Any:
    return click.option(
        "--shard", type=click.IntRange(min=0), default=None, help="Only this shard."
    )(f)


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != "data"}


@dlq.command(name="ls")
@url_option()
@container_option
@_shard_option
@json_option
def dlq_ls(url: str | None, container: str, shard: int | None, json: bool) -> None:
    """List dead letters: shard, index, time, worker, step, variable, reason."""
    letters = run_async(_dlq(url, container, shard))
    if json:
        _echo_json([_summary(d) for d in letters])
        return
    if not letters:
        click.echo(f"no dead letters in container '{container}'")
        return
    for d in letters:
        when = time.strftime("%H:%M:%S", time.localtime(float(d.get("time", 0))))
        who = f"worker {d.get('worker', '?')} step {d.get('step', '?')}"
        var = f" variable {d['variable']}" if "variable" in d else ""
        click.echo(f"{d['shard']}:{d['index']}  {when}  {who}{var}: {d.get('reason')}")


@dlq.command(name="show")
@click.argument("index", type=int)
@url_option()
@container_option
@click.option("--shard", type=click.IntRange(min=0), default=0, show_default=True)
@json_option
def dlq_show(url: str | None, container: str, index: int, shard: int, json: bool) -> None:
    """Show dead letter INDEX of a shard: its provenance and, if it decodes, the
    gradients it carried (shapes, dtypes, versions)."""
    letters = run_async(_dlq(url, container, shard))
    match = [d for d in letters if d["index"] == index]
    if not match:
        raise CliError(f"shard {shard} has no dead letter {index}", EXIT_NOT_FOUND)
    d = match[0]
    out = _summary(d)
    data = d.get("data") or b""
    out["bytes"] = len(data)
    try:
        if not data and "size" in d:
            raise ValueError(f"its {d['size']} bytes were not kept")
        msg = decode_message(data)
        grads: dict[str, Any] = {}
        for name, g in msg.grads.items():
            if isinstance(g, SparseGradient):
                rows = int(g.indices.shape[0])
                grads[name] = {"kind": "sparse", "rows": rows, "dtype": str(g.values.dtype)}
            else:
                grads[name] = {"kind": "dense", "shape": list(g.shape), "dtype": str(g.dtype)}
        out["gradients"] = grads
        out["versions"] = msg.versions
    except Exception as exc:
        out["decode_error"] = str(exc)
    if json:
        _echo_json(out)
        return
    for k, v in out.items():
        if k == "time" and isinstance(v, (int, float)):
            v = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v)) + f" ({v:.3f})"
        click.echo(f"{k:<12} {v}")


async def _drop(url: str | None, container: str, shard: int | None) -> int:
    async with connected(url) as client:
        cfg = await control.read_config(client, container)
        if cfg is None:
            raise CliError(f"no PS job in container '{container}'", EXIT_NOT_FOUND)
        shards = range(cfg.num_shards) if shard is None else [shard]
        return sum([await control.drop_dead_letters(client, container, s) for s in shards])


@dlq.command(name="drop")
@url_option()
@container_option
@_shard_option
@click.option("--yes", "-y", is_flag=True, default=False, help="Do not ask for confirmation.")
def dlq_drop(url: str | None, container: str, shard: int | None, yes: bool) -> None:
    """Delete the dead letters (of one shard, or all)."""
    if not yes:
        if not sys.stdin.isatty():
            raise CliError("stdin is not a terminal to confirm it: pass --yes", EXIT_USAGE)
        if not click.confirm("Delete the dead letters for good?", default=False, err=True):
            raise CliError("not confirmed; nothing deleted")
    n = run_async(_drop(url, container, shard))
    click.echo(f"{n} dead letter(s) deleted")

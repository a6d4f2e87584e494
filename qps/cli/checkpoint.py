"""``qps checkpoint ...``: save a container's PS job to a directory, restore it, and
list the checkpoints under a directory (:mod:`qps.checkpoint`).

``restore`` into a container that owns keys resets it first, after a confirmation
(``--yes`` skips it; without a terminal ``--yes`` is required).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from qps import checkpoint as ck
from qps import keys
from qps.cli import (
    EXIT_FAILURE,
    EXIT_USAGE,
    CliError,
    connected,
    container_option,
    exit_code_for,
    json_option,
    run_async,
    url_option,
)
from qps.cli import (
    echo_json as _echo_json,
)
from qps.cli import (
    interactive as _interactive,
)
from qps.cli.progress import Progress, to_stderr
from qps.errors import QpsError


def _size_text(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _time_text(ms: int) -> str:
    t = datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _check_container(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return keys.check_container(value)
    except QpsError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


@click.group(name="checkpoint")
def checkpoint() -> None:
    """Save, restore and list checkpoints of a PS job.

    A checkpoint is a directory: manifest.json (specs, versions, shard map, global
    step, PS config, a sha256 per file) and one .npz per PS shard with the values and
    optimizer slots. `save` takes a consistent snapshot while training goes on;
    `restore` verifies every checksum, then recreates the job in an empty container.
    """


# -- save --------------------------------------------------------------------------------------


#: a save or restore done sooner prints no progress line, only its result
QUIET_SECONDS = 2.0


def _progress(description: str, json: bool) -> Progress:
    """Variables done of all: a bar on a terminal, else a line every 25% once it has
    run 2 s (none with --json, whose output is the result alone)."""
    return Progress(
        description,
        unit="variables",
        live=False if json else None,
        write=(lambda _: None) if json else to_stderr,
        plain_step=25.0,
        quiet_for=QUIET_SECONDS,
    )


async def _save(
    url: str | None, container: str, directory: str, progress: Callable[[int, int], None]
) -> ck.CheckpointInfo:
    async with connected(url) as client:
        return await ck.save(client, directory, container=container, progress=progress)


@checkpoint.command(name="save")
@click.argument("directory", metavar="DIR")
@url_option()
@container_option
@json_option
def save_command(directory: str, url: str | None, container: str, json: bool) -> None:
    """Save the container's variables, optimizer slots, counters (global step), PS
    config and placement to DIR, which must not exist ("{step}" in DIR is replaced by
    the global step, e.g. ckpt/model-{step}).

    The snapshot is one instant of the job: every shard's variables hold whole
    gradient messages, and training pauses only while Redis copies the model in
    memory. The directory appears whole or not at all. With --json, the checkpoint's
    {"path", "container", "global_step", "created_ms", "created", "variables",
    "nbytes", "qps_version"}. Exits with 3 if the container holds no variables, 1 if
    DIR exists.
    """
    with _progress("qps checkpoint save", json) as bar:
        info = run_async(_save(url, container, directory, bar.update))
    if json:
        _echo_json(info.as_dict())
        return
    click.echo(
        f"saved container '{info.container}' at global step {info.global_step} to "
        f"{info.path}: {info.variables} variable(s), {_size_text(info.nbytes)} of values "
        f"(paused training for {info.manifest['snapshot_pause_ms']:.1f} ms)"
    )


# -- restore -----------------------------------------------------------------------------------


async def _restore(
    url: str | None,
    container: str | None,
    directory: str,
    yes: bool,
    progress: Callable[[int, int], None],
) -> ck.CheckpointInfo:
    info = ck.load(directory).info  # verified before anything is asked or written
    target = container or info.container
    async with connected(url) as client:
        empty = await ck.container_is_empty(client, target)
        if not empty and not yes:
            if not _interactive():
                raise CliError(
                    f"container '{target}' is not empty; restoring resets it first, deleting "
                    "all of its state, and stdin is not a terminal to confirm it: pass --yes",
                    EXIT_USAGE,
                )
            question = (
                f"Container '{target}' is not empty. Reset it (deleting every queue, counter "
                f"and variable in it) and restore {info.path} (global step "
                f"{info.global_step})?"
            )
            if not click.confirm(question, default=False, err=True):
                raise CliError(f"not confirmed; '{target}' left as it was", EXIT_FAILURE)
        return await ck.restore(
            client, directory, container=target, overwrite=not empty, progress=progress
        )


@checkpoint.command(name="restore")
@click.argument("directory", metavar="DIR")
@click.option(
    "--yes",
    "-y",
    is_flag=True,
    default=False,
    help="Reset a non-empty container without asking (required when stdin is not a terminal).",
)
@url_option()
@click.option(
    "--container",
    envvar="QPS_CONTAINER",
    show_envvar=True,
    default=None,
    callback=_check_container,
    help="The container to restore into. Default: the one the checkpoint was taken from.",
)
@json_option
def restore_command(
    directory: str, yes: bool, url: str | None, container: str | None, json: bool
) -> None:
    """Restore checkpoint DIR: variables (values, versions, slots), counters (global
    step), PS config and placement. Start the PS shards afterwards.

    Every file's sha256 and every array are checked first; a corrupt checkpoint is
    refused with nothing written (exit 1). A container that is not empty is reset
    first, after a confirmation (--yes skips it; without a terminal it exits with 2
    unless --yes is given). Exits with 3 if DIR holds no checkpoint. With --json, the
    checkpoint as for `save`, plus "restored_into".
    """
    with _progress("qps checkpoint restore", json) as bar:
        info = run_async(_restore(url, container, directory, yes, bar.update))
    target = container or info.container
    if json:
        _echo_json({**info.as_dict(), "restored_into": target})
        return
    click.echo(
        f"restored {info.path} (global step {info.global_step}, {info.variables} variable(s)) "
        f"into container '{target}'"
    )


# -- ls ------------------------------------------------------------------------------------------


@checkpoint.command(name="ls")
@click.argument("root", metavar="[DIR_ROOT]", default=".")
@json_option
def ls_command(root: str, json: bool) -> None:
    """List the checkpoints in DIR_ROOT (default: the current directory) and in its
    subdirectories, oldest first, with their global step and time. With --json, a list
    of the checkpoints as for `save`. Exits with 3 if DIR_ROOT is not a directory.
    """
    try:
        found = ck.list_checkpoints(root)
    except QpsError as exc:
        raise CliError(str(exc), exit_code_for(exc)) from exc
    if json:
        _echo_json([i.as_dict() for i in found])
        return
    if not found:
        click.echo(f"no checkpoints in {Path(root)}")
        return
    rows = [
        [str(i.path), str(i.global_step), _time_text(i.created_ms), i.container,
         str(i.variables), _size_text(i.nbytes)]
        for i in found
    ]  # fmt: skip
    header = ["PATH", "STEP", "CREATED", "CONTAINER", "VARS", "BYTES"]
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for row in [header, *rows]:
        cells = [c.rjust(w) if k in (1, 4, 5) else c.ljust(w) for k, (c, w) in
                 enumerate(zip(row, widths, strict=True))]  # fmt: skip
        click.echo("  ".join(cells).rstrip())

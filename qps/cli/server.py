"""``qps server start|stop|status``: the shared embedded Redis of a run directory.

Every qps process given no URL uses the server of its run directory (``$QPS_RUN_DIR``,
default ``<tmp>/qps-<uid>/default``; see :mod:`qps.embedded`): it reuses a running one,
or starts one that lasts as long as the process that started it. ``qps server start``
starts one that outlives the command, so that a series of commands (a chief, shards,
workers, inspection) all share it; ``qps server stop`` stops it (``SHUTDOWN``: the AOF
is fsynced first).
"""

from __future__ import annotations

import os
from typing import Any

import click

from qps import embedded
from qps.cli import EXIT_NOT_FOUND, CliError, echo_json, json_option

RUN_DIR_HELP = (
    "The run directory that holds the server's socket, AOF, log and state file. "
    "[default: $QPS_RUN_DIR, else <tmp>/qps-<uid>/default]"
)


def _run_dir_option(f: Any) -> Any:
    return click.option(
        "--run-dir",
        type=click.Path(file_okay=False),
        default=None,
        envvar="QPS_RUN_DIR",
        show_envvar=True,
        help=RUN_DIR_HELP,
    )(f)


def _status(run_dir: str) -> dict[str, Any]:
    state = embedded.read_state(run_dir) or {}
    url = embedded._live_url(state, timeout=2.0) if state else None
    return {
        "run_dir": run_dir,
        "running": url is not None,
        "url": url,
        "pid": state.get("pid") if url else None,
        "binary": state.get("binary") if url else None,
        "log": os.path.join(run_dir, embedded.LOG_NAME),
    }


@click.group()
def server() -> None:
    """Start, stop and look at the embedded Redis server of a run directory.

    Without --url, every qps command uses the server of its run directory: it reuses a
    running one, or starts one that lasts only as long as that command. Start one with
    `qps server start` to share it between the commands of a session (shards, workers,
    inspection); all of them find it through the run directory. It keeps its data in an
    append-only file there, so a restarted server has the same queues and variables.
    """


@server.command()
@_run_dir_option
@click.option(
    "--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
    help="Seconds to wait for the server to answer PING.",
)  # fmt: skip
@json_option
def start(run_dir: str | None, timeout: float, json: bool) -> None:
    """Start the server of the run directory, in the background, and print its URL.

    It keeps running after this command exits, until `qps server stop`. If one is
    running already, this says so and exits 0.
    """
    directory = os.path.abspath(run_dir) if run_dir else embedded.default_run_dir()
    _, srv = embedded.ensure_local_server(directory, timeout=timeout, detach=True)
    started = srv is not None
    st = _status(directory)
    if not st["running"]:
        raise CliError(f"the server in {directory} stopped right after it started; see {st['log']}")
    st["started"] = started
    if json:
        echo_json(st)
        return
    verb = "started" if started else "already running:"
    click.echo(f"qps server {verb} pid {st['pid']}, {st['url']}")
    click.echo(f"  run directory {directory}; stop it with: qps server stop")


@server.command()
@_run_dir_option
@click.option(
    "--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
    help="Seconds to wait for it to exit before SIGTERM, then SIGKILL.",
)  # fmt: skip
@json_option
def stop(run_dir: str | None, timeout: float, json: bool) -> None:
    """Stop the server of the run directory (SHUTDOWN: it writes its AOF and exits).

    Exits 0 whether or not one was running; the data stays in the run directory.
    """
    directory = os.path.abspath(run_dir) if run_dir else embedded.default_run_dir()
    pid = _status(directory)["pid"]
    stopped = embedded.stop_local_server(directory, timeout)
    if json:
        echo_json({"run_dir": directory, "stopped": stopped, "pid": pid if stopped else None})
    elif stopped:
        click.echo(f"qps server stopped (pid {pid}, {directory})")
    else:
        click.echo(f"no qps server was running in {directory}")


@server.command()
@_run_dir_option
@json_option
def status(run_dir: str | None, json: bool) -> None:
    """Whether the server of the run directory runs, and its URL and pid.

    Exits 0 when it runs, 3 when it does not.
    """
    directory = os.path.abspath(run_dir) if run_dir else embedded.default_run_dir()
    st = _status(directory)
    if json:
        echo_json(st)
    elif st["running"]:
        click.echo(f"running: pid {st['pid']}, {st['url']}")
        click.echo(f"  binary {st['binary']}; log {st['log']}")
    else:
        click.echo(f"not running (run directory {directory})")
    if not st["running"]:
        click.get_current_context().exit(EXIT_NOT_FOUND)

"""``qps``: the command-line entry point (``qps = "qps.cli.main:main"``).

:func:`main` runs the click group in non-standalone mode so that it decides the exit
code itself: errors print one ``qps: error: ...`` line (a traceback only with
``--log-level DEBUG``) and exit with the codes listed in :mod:`qps.cli`.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

import click

from qps import __version__
from qps.cli import (
    EXIT_FAILURE,
    EXIT_OK,
    LOG_LEVELS,
    CliError,
    configure_logging,
    debug_enabled,
    exit_code_for,
    scrub,
)
from qps.cli.checkpoint import checkpoint
from qps.cli.container import container
from qps.cli.demo import demo
from qps.cli.feed import feed_command
from qps.cli.job import job
from qps.cli.plot import plot
from qps.cli.ps import ps
from qps.cli.queue import queue
from qps.cli.server import server
from qps.cli.top import top
from qps.cli.train import train
from qps.cli.var import var
from qps.cli.worker import worker
from qps.errors import QpsError
from qps.owners import die_with_parent

#: Exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(name="qps", context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "--version", prog_name="qps", message="%(prog)s %(version)s")
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="WARNING",
    show_default=True,
    envvar="QPS_LOG_LEVEL",
    show_envvar=True,
    help="Log messages at this level and above go to stderr; DEBUG also shows tracebacks.",
)
@click.option(
    "--log-json",
    is_flag=True,
    default=False,
    envvar="QPS_LOG_JSON",
    show_envvar=True,
    help="Log one JSON object per line (time, level, logger, message, pid) instead of text.",
)
def cli(log_level: str, log_json: bool) -> None:
    """qps: a parameter-server runtime on Redis and asyncio, with TensorFlow 1.x queues.

    Run `qps train` to train a model with PS shards and workers on this machine (the
    digits example by default), `qps ps` and `qps worker` to run those roles yourself,
    `qps job status|stop` and `qps top` to watch and stop a running job, `qps demo` to
    move real tensors between two processes through a shared queue, `qps queue ...` to
    inspect and close queues, `qps var ...` to inspect and print variables,
    `qps container ...` to list, inspect and reset resource containers, and
    `qps checkpoint ...` to save, restore and list checkpoints of a PS job,
    `qps server start|stop|status` to run the embedded Redis server across commands,
    and `qps plot` to draw the training curves of `qps train --logdir`.

    Every command takes --url (env QPS_REDIS_URL); without one it uses the local
    embedded server. Every option can also be set through an environment variable,
    shown in each command's --help: QPS_<COMMAND>_<OPTION>, the command path and the
    long option name in upper case with - as _ (e.g. QPS_TRAIN_WORKERS for
    `qps train --workers`, QPS_PS_DLQ_LS_SHARD for `qps ps dlq ls --shard`), except
    the global ones: QPS_LOG_LEVEL, QPS_LOG_JSON, QPS_REDIS_URL, QPS_CLUSTER,
    QPS_CONTAINER, QPS_METRICS_PORT, QPS_METRICS_ADDR, QPS_BACKEND and QPS_RUN_DIR.
    An option on the command line wins over its variable.

    \b
    Exit codes:
      0  success
      1  failure (any other qps error)
      2  usage error
      3  not found (no such queue, variable, container or checkpoint)
      4  timeout (--timeout ran out)
      5  unavailable (Redis cannot be reached, or no server can be started)
    """
    configure_logging(log_level, log_json)


cli.add_command(queue)
cli.add_command(container)
cli.add_command(var)
cli.add_command(worker)
cli.add_command(train)
cli.add_command(ps)
cli.add_command(job)
cli.add_command(top)
cli.add_command(checkpoint)
cli.add_command(demo)
cli.add_command(feed_command)
cli.add_command(server)
cli.add_command(plot)


def envvar_names(path: Sequence[str], option: click.Option) -> list[str]:
    """The variables of ``option`` of the command at ``path`` (``["ps", "dlq", "ls"]``):
    ``QPS_<PATH>_<LONG NAME>`` for each long name (``--lr/--learning-rate`` has two),
    upper case, ``-`` as ``_``; the parameter's name for one with short names only."""
    names = [o[2:] for o in option.opts if o.startswith("--")] or [str(option.name)]
    return ["_".join(["QPS", *path, n]).upper().replace("-", "_") for n in names]


def name_envvars(command: click.Command, path: Sequence[str] = ()) -> None:
    """Give every option of ``command`` and the commands below it its environment
    variable (:func:`envvar_names`; an option that names its own, a global one such as
    QPS_REDIS_URL, keeps it) and show it in ``--help``. One rule for every command,
    instead of click's ``auto_envvar_prefix``, which names a variable after the
    parameter (QPS_TRAIN_NUM_WORKERS for ``--workers``) and shows none."""
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        if param.is_flag and param.is_eager and not param.expose_value:
            continue  # --version, like --help, is an action rather than a setting
        if not param.envvar:
            names = envvar_names(path, param)
            param.envvar = names[0] if len(names) == 1 else names
        param.show_envvar = True
    if isinstance(command, click.Group):
        subs = command.commands
        for name, sub in subs.items():
            name_envvars(sub, (*path, name))


name_envvars(cli)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the ``qps`` command line on ``argv`` (default ``sys.argv[1:]``); return the
    exit code instead of exiting."""
    try:
        rv = cli.main(
            args=list(argv) if argv is not None else None,
            prog_name="qps",
            standalone_mode=False,
        )
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):
            click.echo("qps: interrupted", err=True)
            return EXIT_INTERRUPTED
        click.echo("qps: aborted", err=True)
        return EXIT_FAILURE
    except click.ClickException as exc:  # CliError and click's own usage errors
        exc.show()
        return exc.exit_code
    except QpsError as exc:  # a command that did not go through run_async
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        CliError(str(exc)).show()
        return exit_code_for(exc)
    except KeyboardInterrupt:
        click.echo("qps: interrupted", err=True)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: say so in one line unless asked for detail
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
            hint = ""
        else:
            hint = " (rerun with --log-level DEBUG for a traceback)"
        click.echo(scrub(f"qps: error: unexpected {type(exc).__name__}: {exc}{hint}"), err=True)
        return EXIT_FAILURE
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else EXIT_OK


def main(argv: Sequence[str] | None = None) -> None:
    """The console-script entry point: :func:`run`, then exit with its code."""
    die_with_parent()  # a role of `qps train` stops when its launcher dies
    sys.exit(run(argv))


if __name__ == "__main__":
    main()

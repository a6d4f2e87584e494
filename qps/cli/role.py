"""Running a long-running role (``qps ps``, ``qps worker``, ``qps feed``): its main
coroutine under the process's :class:`qps.stopping.Stopper`, which handles SIGTERM and
SIGINT, and the exit status of a stop (0 when it stopped as asked; ``128 + signal``
when it did not stop in time: see :mod:`qps.stopping`)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click

from qps.cli import run_async
from qps.stopping import Stopped, Stopper

__all__ = ["run_role"]

T = TypeVar("T")


def run_role(name: str, logger: str, main: Callable[[Stopper], Coroutine[Any, Any, T]]) -> T:
    """Run ``main(stopper)`` to its end (:func:`qps.cli.run_async`) with the signals
    handled by ``stopper``; ``name`` (``qps worker``) and the logger ``logger`` say
    what is stopping and that it stopped. Returns what ``main`` returns; a role that
    stopped before it could return exits here (0, or ``128 + signal`` if it had to be
    cancelled).

    Raises:
        click.exceptions.Exit: the role stopped on request before it finished.
        CliError: a qps error ended the role (see :func:`qps.cli.run_async`).
    """
    log = logging.getLogger(logger)
    stopper = Stopper()

    async def go() -> T:
        return await stopper.run(main(stopper), name, log)

    try:
        result = run_async(go())
    except Stopped as exc:
        status = 0 if exc.clean else stopper.exit_status
        level = logging.INFO if exc.clean else logging.WARNING
        log.log(level, "%s: stopped (%s), exit status %d", name, exc, status)
        _exiting(stopper, status)
        raise click.exceptions.Exit(status) from None
    if stopper.overran:  # it returned, but only once cancelled: not in time
        log.warning("%s: stopped (%s), exit status %d", name, stopper.reason, stopper.exit_status)
        _exiting(stopper, stopper.exit_status)
        raise click.exceptions.Exit(stopper.exit_status)
    if stopper.requested:
        log.info("%s: stopped (%s), exit status 0", name, stopper.reason)
        _exiting(stopper, 0)
    return result


def _exiting(stopper: Stopper, status: int) -> None:
    """The role stopped on request and the process is about to exit with ``status``,
    within the stop's deadline: have the watchdog use that status, and spare the
    interpreter's teardown its collection of every object (``gc.freeze``; that final
    pass took up to a second with scikit-learn's modules loaded)."""
    stopper.ended(status)
    gc.freeze()

"""Progress of a long command (``qps train``, ``qps checkpoint save|restore``): a rich
progress bar on a terminal, plain lines otherwise.

On a terminal (stderr by default) :class:`Progress` draws one bar that redraws in
place; other lines (:meth:`Progress.line`) are printed above it. Anywhere else (a
pipe, a file, a CI log) it prints one plain line each time the work passes another
``plain_step`` percent of its total, and one when it ends; with no known total, at
most one line per ``plain_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as _Bar

__all__ = ["Progress", "to_stderr"]


def to_stderr(text: str) -> None:
    """Print one plain line to stderr (the default writer of plain lines)."""
    click.echo(text, err=True)


class Progress:
    """One operation's progress (use it as a context manager).

    Args:
        description: what is done, e.g. ``"qps train"``; it starts every plain line.
        total: the amount of work (None: unknown).
        unit: what is counted, for the plain lines (``"worker steps"``).
        console: where the bar goes (default: a rich console on stderr); the bar is
            drawn only when it is a terminal (``Console(force_terminal=True)`` forces it).
        live: draw the bar (default: ``console.is_terminal``); False: plain lines.
        write: prints one plain line (default: to stderr).
        plain_step: a plain line each time this many percent more are done.
        plain_seconds: with no total, at least this long between plain lines.
        quiet_for: no plain line until the work has run this long (seconds): work
            done sooner prints only its result.
    """

    def __init__(
        self,
        description: str,
        total: float | None = None,
        *,
        unit: str = "",
        console: Console | None = None,
        live: bool | None = None,
        write: Callable[[str], None] = to_stderr,
        plain_step: float = 10.0,
        plain_seconds: float = 10.0,
        quiet_for: float = 0.0,
    ) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.console = console if console is not None else Console(stderr=True)
        self.live = self.console.is_terminal if live is None else live
        self.write = write
        self.plain_step = plain_step
        self.plain_seconds = plain_seconds
        self.quiet_until = time.monotonic() + quiet_for if quiet_for > 0 else 0.0
        self.completed = 0.0
        self.info = ""
        self._bar: _Bar | None = None
        self._task: TaskID | None = None
        self._mark = 0  # plain lines: the last plain_step mark passed
        self._last_line = 0.0
        self._printed_at: float | None = None  # the `completed` of the last plain line

    def __enter__(self) -> Progress:
        return self

    def _start(self) -> None:
        """Draw the bar (at the first update, so a question asked before the work
        starts is not drawn over)."""
        self._bar = _Bar(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
        )
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=self.total, info="")

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif (
            not self.live
            and exc[0] is None
            and self.completed
            and self._printed_at != self.completed
            and (not self.quiet_until or self._printed_at is not None)
        ):
            self._plain()  # where it ended

    def update(self, completed: float, total: float | None = None, info: str = "") -> None:
        """``completed`` of ``total`` (None: as before) are done; ``info`` is shown
        beside the bar or at the end of the plain line."""
        self.completed = completed
        if total is not None:
            self.total = total
        self.info = info
        if self.live and self._bar is None:
            self._start()
        if self._bar is not None:
            assert self._task is not None
            self._bar.update(self._task, completed=completed, total=self.total, info=info)
            return
        if self.quiet_until and time.monotonic() < self.quiet_until:
            if self.total:
                self._mark = int(100 * completed / self.total // self.plain_step)
            return
        if self.total:
            mark = int(100 * completed / self.total // self.plain_step)
            if mark > self._mark:
                self._mark = mark
                self._plain()
        elif time.monotonic() - self._last_line >= self.plain_seconds and completed:
            self._plain()

    def line(self, text: str) -> None:
        """Print ``text`` as it is (no markup), above the bar when there is one."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self.write(text)

    def _plain(self) -> None:
        done = f"{self.completed:,.0f}"
        if self.total:
            done += f"/{self.total:,.0f}"
        if self.unit:
            done += f" {self.unit}"
        if self.total:
            done += f" ({self.completed / self.total:.0%})"
        self.write(f"{self.description}: {done}" + (f", {self.info}" if self.info else ""))
        self._last_line = time.monotonic()
        self._printed_at = self.completed

"""``qps top``: a live terminal dashboard of a training job, drawn with ``rich``.

Every ``--interval`` seconds it reads a :func:`workers.monitor.snapshot` from Redis
(nothing else: it works from any machine that reaches the server) and computes rates
from the previous one (:func:`workers.monitor.rates`): the global step and steps/s;
per worker its steps/s, examples/s, last loss, staleness p50/p99 and the age of its
status; per shard its applies/s, lag (messages waiting) and staleness; every queue's
depth against its capacity, with a bar; the dead letters. Ctrl-C (or SIGTERM) exits 0.

``--once`` prints one frame (two snapshots ``--interval`` apart, so that the rates are
known) and exits; ``--once --json`` prints it as JSON for scripts.
"""

from __future__ import annotations

import asyncio
import signal
import time

import click
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from qps.aio import wait_event
from qps.cli import (
    EXIT_USAGE,
    CliError,
    connected,
    echo_json,
    json_option,
    run_async,
    url_option,
)
from qps.cli.job import (
    fmt_age,
    fmt_depth,
    fmt_loss,
    fmt_metric,
    fmt_opt,
    fmt_rate,
    job_container,
    job_container_option,
)
from qps.errors import NotFoundError, QpsError
from qps.transport import Client
from workers.monitor import JobSnapshot, QueueRow, Rates, rates, snapshot

__all__ = ["BAR_WIDTH", "PIPE_WIDTH", "bar", "render", "top"]

#: characters of a queue's depth bar
BAR_WIDTH = 20
#: the width ``--once`` draws at when stdout is not a terminal
PIPE_WIDTH = 160
#: below this many columns the tables are drawn compact (short bars, short headers)
WIDE = 110


def bar(size: int, capacity: int, width: int = BAR_WIDTH) -> Text:
    """A depth bar: ``size`` of ``capacity`` as filled cells, coloured by fullness."""
    if capacity <= 0:  # unbounded (-1): nothing to measure against
        return Text("░" * width, "dim")
    frac = min(1.0, max(0.0, size / capacity))
    filled = round(frac * width)
    if size > 0 and filled == 0:
        filled = 1  # something is waiting: show it
    style = "green" if frac < 0.5 else "yellow" if frac < 0.9 else "red"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def _p(v: int | None) -> str:
    return "-" if v is None else str(v)


def _state_style(state: str) -> str:
    return {
        "training": "green",
        "running": "green",
        "done": "cyan",
        "finished": "cyan",
        "stopping": "yellow",
        "stopped": "yellow",
        "gone": "bold red",
    }.get(state, "")


def _header(snap: JobSnapshot, r: Rates | None, interval: float) -> Text:
    gsr = None if r is None else r.global_steps_per_s
    shards = "no PS config" if snap.num_shards is None else f"{snap.num_shards} shard(s)"
    t = Text.assemble(
        ("qps top", "bold"),
        f"  container {snap.container}  job ",
        (snap.state, "bold " + _state_style(snap.state)),
        "  global step ",
        (f"{snap.global_step:,}", "bold"),
        f" ({fmt_rate(gsr)} steps/s)",
    )
    t.append(
        f"\n{shards}, {fmt_opt(snap.optimizer)}  staleness p50 {_p(snap.staleness_p50)} / "
        f"p99 {_p(snap.staleness_p99)}  "
    )
    t.append(f"dead letters {snap.dead_letters}", "bold red" if snap.dead_letters else "")
    if snap.test_value is not None:
        t.append(f"  test {fmt_metric(snap.test_metric)} {snap.test_value:.4f}")
    when = time.strftime("%H:%M:%S", time.localtime(snap.time))
    t.append(f"\nat {when}, every {interval:g} s; Ctrl-C quits", "dim")
    return t


def _table(title: str) -> Table:
    # no outer edges and only a rule under the header: a frame fits in 80x24
    return Table(
        title=title, title_justify="left", title_style="bold", expand=False,
        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
    )  # fmt: skip


def _workers(snap: JobSnapshot, r: Rates | None) -> RenderableType:
    if not snap.workers:
        return Text("no worker has published a status yet", style="dim")
    t = _table("workers")
    for name, right in [
        ("WORKER", False),
        ("STATE", False),
        ("STEP", True),
        ("STEPS/S", True),
        ("EXAMPLES/S", True),
        ("LOSS", True),
        ("P50", True),
        ("P99", True),
        ("AGE", True),
    ]:
        t.add_column(name, justify="right" if right else "left", no_wrap=True)
    for w in snap.workers:
        rate = None if r is None else r.worker_steps_per_s.get(w.name)
        t.add_row(
            w.name,
            Text(w.state, _state_style(w.state)),
            f"{w.step:,}",
            fmt_rate(rate),
            fmt_rate(w.examples_per_s),
            fmt_loss(w.loss),
            _p(w.staleness_p50),
            _p(w.staleness_p99),
            fmt_age(w.age_s),
        )
    return t


def _shards(snap: JobSnapshot, r: Rates | None, bar_width: int) -> RenderableType | None:
    """The shards' table. Compact (a narrow terminal): without the APPLIED total and
    the depth bar (the queues' table draws it), so that both message rates fit."""
    if not snap.shards:
        return None
    t = _table("PS shards")
    compact = bar_width < BAR_WIDTH
    columns = [
        ("SHARD", True),
        ("STATE", False),
        ("IN/S" if compact else "ARRIVED/S", True),
        ("OUT/S" if compact else "TAKEN/S", True),
        *([] if compact else [("APPLIED", True)]),
        ("APPL/S" if compact else "APPLIES/S", True),
        ("LAG", True),
        ("QUEUE", True),
        *([] if compact else [("", False)]),
        ("P50", True),
        ("P99", True),
        ("DLQ", True),
    ]
    for name, right in columns:
        t.add_column(name, justify="right" if right else "left", no_wrap=True)
    for s in snap.shards:
        rate = None if r is None else r.shard_applies_per_s.get(s.shard)
        arrived = None if r is None else r.shard_arrivals_per_s.get(s.shard)
        taken = None if r is None else r.shard_takes_per_s.get(s.shard)
        q = s.queue
        depth = Text("") if q is None else bar(q.size, q.capacity, bar_width)
        t.add_row(
            str(s.shard),
            Text(s.state, _state_style(s.state)),
            fmt_rate(arrived),
            fmt_rate(taken),
            *([] if compact else [f"{s.applied:,}"]),
            fmt_rate(rate),
            _p(s.lag),
            "-" if q is None else fmt_depth(q.size, q.capacity),
            *([] if compact else [depth]),
            _p(s.staleness_p50),
            _p(s.staleness_p99),
            Text(str(s.dead_letters), "bold red" if s.dead_letters else ""),
        )
    return t


def _queues(snap: JobSnapshot, r: Rates | None, compact: bool) -> RenderableType | None:
    rows: list[QueueRow] = [s.queue for s in snap.shards if s.queue is not None]
    rows += snap.queues
    # a shard's gradient list, where its workers pushed (a single server): a row of its own
    lists = {
        s.queue.name: s.list
        for s in snap.shards
        if s.queue is not None and s.list is not None and (s.list.pushed or s.list.waiting)
    }
    if not rows:
        return None
    t = _table("queues")
    for name, right in [
        ("QUEUE", False),
        ("TYPE", False),
        ("DEPTH", True),
        ("", False),
        ("DEQ/S" if compact else "DEQUEUES/S", True),
        ("WAIT" if compact else "WAITING", True),
        ("CLOSED", False),
        ("DLQ", True),
    ]:
        t.add_column(name, justify="right" if right else "left", no_wrap=True)
    for q in rows:
        rate = None if r is None else r.queue_dequeues_per_s.get(q.name)
        lst = lists.get(q.name)
        t.add_row(
            q.name,
            q.type.removesuffix("Queue") if compact else q.type,
            fmt_depth(q.size, q.capacity),
            bar(q.size, q.capacity, 8 if compact else BAR_WIDTH),
            fmt_rate(rate),
            f"{q.pending_enqueues}e/{q.pending_dequeues}d",
            "yes" if q.closed else "no",
            Text(str(q.dead_letters), "bold red" if q.dead_letters else ""),
        )
        if lst is not None:  # the shard's other channel, right under its queue
            rate = None if r is None else r.list_takes_per_s.get(lst.name)
            t.add_row(
                lst.name,
                "list",
                fmt_depth(lst.waiting, -1),
                bar(lst.waiting, -1, 8 if compact else BAR_WIDTH),
                fmt_rate(rate),
                "-",
                "-",
                "-",
            )
    return t


def render(
    snap: JobSnapshot | None,
    r: Rates | None,
    interval: float,
    container: str = "",
    error: str | None = None,
    width: int = PIPE_WIDTH,
) -> RenderableType:
    """One frame of the dashboard for a terminal ``width`` columns wide (narrower than
    :data:`WIDE`: compact); ``snap`` None: ``error`` says why there is none."""
    if snap is None:
        return Text.assemble(
            ("qps top", "bold"),
            f"  container {container}\n",
            (error or "no data yet", "yellow"),
            (f"\nretrying every {interval:g} s; Ctrl-C quits", "dim"),
        )
    parts: list[RenderableType] = [_header(snap, r, interval)]
    if error:
        parts.append(Text(f"last refresh failed: {error}", "bold red"))
    parts.append(_workers(snap, r))
    compact = width < WIDE
    bar_width = 8 if compact else BAR_WIDTH
    for extra in (_shards(snap, r, bar_width), _queues(snap, r, compact)):
        if extra is not None:
            parts.append(extra)
    return Group(*parts)


async def _once(
    url: str | None, container: str | None, interval: float
) -> tuple[JobSnapshot, Rates]:
    async with connected(url) as client:
        container = await job_container(client, container)
        first = await snapshot(client, container)
        await asyncio.sleep(interval)
        second = await snapshot(client, container)
    return second, rates(first, second)


class _Dashboard:
    """The state of the live loop: the last snapshot and rates, and the last error."""

    def __init__(self, client: Client, container: str, interval: float, console: Console) -> None:
        self.console = console
        self.client = client
        self.container = container
        self.interval = interval
        self.snap: JobSnapshot | None = None
        self.rates: Rates | None = None

    async def frame(self) -> RenderableType:
        try:
            snap = await snapshot(self.client, self.container)
        except NotFoundError as exc:
            self.snap, self.rates = None, None
            return render(
                None, None, self.interval, self.container, f"{exc}; waiting for one", self.width
            )
        except QpsError as exc:  # e.g. Redis restarting: keep the last frame, say why
            return render(
                self.snap, self.rates, self.interval, self.container, str(exc), self.width
            )
        if self.snap is not None:
            self.rates = rates(self.snap, snap, self.rates)
        self.snap = snap
        return render(snap, self.rates, self.interval, self.container, width=self.width)

    @property
    def width(self) -> int:
        return self.console.size.width  # read each frame: the terminal may be resized


async def _live(url: str | None, container: str | None, interval: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with connected(url) as client:
            container = await job_container(client, container)
            console = Console()
            board = _Dashboard(client, container, interval, console)
            with Live(
                await board.frame(), console=console, screen=True, auto_refresh=False
            ) as live:
                while not stop.is_set():
                    await wait_event(stop, interval)
                    if not stop.is_set():
                        live.update(await board.frame(), refresh=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@click.command(name="top")
@url_option()
@job_container_option
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between refreshes (and between the two snapshots of --once).",
)
@click.option(
    "--once",
    is_flag=True,
    default=False,
    help="Print one frame (rates over --interval) and exit; exit code 3 without a job.",
)
@json_option
def top(url: str | None, container: str | None, interval: float, once: bool, json: bool) -> None:
    """A live dashboard of the training job in the container, refreshed from Redis
    every --interval seconds: the global step and steps/s; per worker its steps/s,
    examples/s, last loss, staleness p50/p99 and the age of its status; per PS shard its
    applies/s, lag (messages waiting), gradient queue and dead letters; every queue's
    depth/capacity with a bar. It waits for a job that has not started yet. Ctrl-C
    exits 0. Without --container: the only job on the server that is not finished.

    With --once --json: one snapshot with a "rates" object, for scripts (see
    docs/operations.md).
    """
    if json and not once:
        raise CliError("--json needs --once (the live dashboard is for a terminal)", EXIT_USAGE)
    if once:
        snap, r = run_async(_once(url, container, interval))
        if json:
            echo_json({**snap.as_dict(), "rates": r.as_dict()})
        else:
            console = Console()
            if not console.is_terminal:  # a pipe or a file: do not squeeze the tables
                console = Console(width=PIPE_WIDTH)
            console.print(render(snap, r, interval, width=console.width))
        return
    run_async(_live(url, container, interval))

"""``qps plot LOGDIR``: draw the training curves the workers wrote (:mod:`qps.curves`)
as one PNG of four panels, with matplotlib's Agg backend (no screen needed).

matplotlib is the optional extra ``plot`` (``pip install 'qps[plot]'``); ``--json``
prints the series without it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import click

from qps import curves
from qps.cli import EXIT_FAILURE, CliError, echo_json, exit_code_for
from qps.errors import QpsError

#: the panels, left to right and top to bottom: (title, y label, tags)
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Loss", "training loss", (curves.LOSS,)),
    ("Accuracy", "test accuracy", curves.ACCURACY_TAGS),
    ("Throughput", "examples/s", (curves.THROUGHPUT,)),
    ("Staleness", "updates (mean per log point)", (curves.STALENESS,)),
)


def draw(scalars: curves.Scalars, path: str | os.PathLike[str], title: str = "") -> int:
    """Draw ``scalars`` (:func:`qps.curves.read_scalars`) as a 2×2 PNG at ``path``:
    loss, accuracy (or AUC), examples/s and staleness against the worker's step, one
    line per run. Returns the number of points drawn.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), dpi=80, layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    drawn = 0
    for ax, (name, ylabel, tags) in zip(axes, PANELS):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        used = ""
        values: list[float] = []
        for run, series in scalars.items():
            tag = next((t for t in tags if series.get(t)), None)
            if tag is None:
                continue
            used = used or tag
            points = series[tag]
            steps = [s for s, _ in points]
            ys = [v for _, v in points]
            values += ys
            ax.plot(steps, ys, marker="." if len(points) < 30 else None, label=run)
            drawn += len(points)
        ax.set_ylabel("test AUC" if used == curves.AUC else ylabel)
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        if name == "Loss" and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(os.fspath(path), format="png")
    return drawn


def _as_json(scalars: curves.Scalars) -> dict[str, Any]:
    return {
        run: {tag: [[s, None if math.isnan(v) else v] for s, v in pts] for tag, pts in tags.items()}
        for run, tags in scalars.items()
    }


@click.command(name="plot")
@click.argument("logdir", metavar="LOGDIR")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    default="curves.png",
    show_default=True,
    help="The PNG to write.",
)
@click.option("--title", default="", help="A title above the panels.")
@click.option(
    "--json",
    "json",
    is_flag=True,
    default=False,
    help="Print the scalars as JSON ({run: {tag: [[step, value], ...]}}) and draw nothing.",
)
def plot(logdir: str, output: str, title: str, json: bool) -> None:
    """Draw the training curves under LOGDIR (written by `qps train --logdir` or
    `qps worker --logdir`) as one PNG: loss, test accuracy (AUC for a CTR model),
    throughput (examples/s) and staleness, each against the worker's step, one line
    per worker.

    Needs matplotlib (pip install 'qps[plot]'). Exits with 3 if LOGDIR does not exist
    or holds no event files, 1 if an event file is corrupt.
    """
    try:
        scalars = curves.read_scalars(logdir)
    except QpsError as exc:
        raise CliError(str(exc), exit_code_for(exc)) from exc
    if json:
        echo_json(_as_json(scalars))
        return
    try:
        drawn = draw(scalars, output, title)
    except ImportError as exc:
        raise CliError(
            f"qps plot needs matplotlib ({exc}): install the 'plot' extra, pip install 'qps[plot]'",
            EXIT_FAILURE,
        ) from exc
    click.echo(
        f"wrote {Path(output)}: {len(scalars)} run(s), {drawn} point(s) "
        f"(loss, accuracy, throughput, staleness)"
    )

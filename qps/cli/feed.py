"""``qps feed``: the feeder role (:mod:`workers.feeder`).

Reads a dataset (an ``.npz`` file, ``.npy`` files, or the built-in digits), enqueues
every example once per epoch into a shared input queue and closes the queue; exits 0
when done and on SIGTERM or Ctrl-C (after stopping cleanly; see :mod:`qps.stopping`).
"""

from __future__ import annotations

import contextlib

import click

from qps.aio import in_daemon_thread
from qps.cli import (
    EXIT_USAGE,
    CliError,
    connected,
    container_option,
    echo_json,
    json_option,
    metrics_options,
    role_logs,
    serve_metrics,
    url_option,
)
from qps.cli.role import run_role
from qps.errors import InvalidArgumentError
from qps.stopping import Stopper
from workers.feeder import DATASETS, FeedOptions, FeedResult, feed, load_dataset
from workers.input import Coordinator


async def _run(
    url: str | None,
    data_paths: tuple[str, ...],
    options: FeedOptions,
    dataset: str | None,
    x_key: str,
    y_key: str | None,
    split: str,
    stopper: Stopper,
) -> FeedResult:
    # load before connecting: a bad file is a usage error, whatever the server
    async with stopper.interruptible("loading the data"):
        # a daemon thread: a stop while scikit-learn loads does not wait for the load
        data = await in_daemon_thread(
            load_dataset, data_paths, dataset, x_key=x_key, y_key=y_key, split=split
        )
    coord = Coordinator()
    stopper.on_stop(coord.request_stop)  # between two chunks, or cutting an enqueue short
    async with contextlib.AsyncExitStack() as stack:
        async with stopper.interruptible("connecting to Redis"):
            client = await stack.enter_async_context(connected(url))
        return await feed(client, data, options, coord)


@click.command(name="feed")
@click.option(
    "--data",
    "data_paths",
    multiple=True,
    metavar="PATH",
    help="An .npz file (arrays named by --x-key/--y-key), or one or two .npy files "
    "(features, then labels). Repeat --data for the second .npy.",
)
@click.option(
    "--dataset",
    type=click.Choice(DATASETS),
    default=None,
    help="A built-in dataset instead of --data: digits = scikit-learn's 8x8 digits "
    "(needs scikit-learn), 80/20 split with random_state 0, standardized, x float32[64], "
    "y int64.",
)
@click.option(
    "--split",
    type=click.Choice(["train", "test"]),
    default="train",
    show_default=True,
    help="Which part of --dataset to feed.",
)
@click.option("--x-key", default="x", show_default=True, help="The features' name in the .npz.")
@click.option(
    "--y-key",
    default="y",
    show_default=True,
    help="The labels' name in the .npz; an empty string feeds the features alone.",
)
@click.option(
    "--queue",
    default="input",
    show_default=True,
    help="Shared name of the input queue. An existing queue (of any type) is used as it "
    "is; otherwise a FIFOQueue shaped like the data is created.",
)
@click.option(
    "--epochs", type=click.IntRange(min=1), default=1, show_default=True,
    help="Passes over the data.",
)  # fmt: skip
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Examples per enqueue_many.",
)
@click.option(
    "--seed", type=int, default=None,
    help="Seed of the per-epoch permutations (and of a created RandomShuffleQueue).",
)  # fmt: skip
@click.option(
    "--capacity",
    type=int,
    default=1024,
    show_default=True,
    help="Capacity of the queue when the feeder creates it (negative: unbounded).",
)
@click.option(
    "--shuffle/--no-shuffle",
    default=True,
    show_default=True,
    help="A fresh random permutation of the examples each epoch, or the file's order.",
)
@click.option(
    "--min-after-dequeue",
    type=click.IntRange(min=0),
    default=None,
    help="Create a RandomShuffleQueue with this min_after_dequeue instead of a FIFOQueue.",
)
@click.option(
    "--close-on-term",
    is_flag=True,
    default=False,
    help="On SIGTERM/Ctrl-C also close the queue (cancelling pending enqueues) so that "
    "consumers drain it and stop; by default it is left open for another feeder.",
)
@click.option(
    "--fresh",
    is_flag=True,
    default=False,
    help="Start a new feed even if an earlier feed into the queue did not end (by default "
    "the next feeder resumes it where it stopped).",
)
@url_option()
@container_option
@json_option
@metrics_options
@click.pass_context
def feed_command(
    ctx: click.Context,
    data_paths: tuple[str, ...],
    dataset: str | None,
    split: str,
    x_key: str,
    y_key: str,
    queue: str,
    epochs: int,
    batch_size: int,
    seed: int | None,
    capacity: int,
    shuffle: bool,
    min_after_dequeue: int | None,
    close_on_term: bool,
    fresh: bool,
    url: str | None,
    container: str,
    json: bool,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Feed a dataset into a shared input queue: every example once per epoch (a fresh
    permutation each epoch unless --no-shuffle), in enqueue_many chunks of
    --batch-size, then close the queue so that consumers drain it and get
    OutOfRangeError.

    \b
    Examples:
      qps feed --dataset digits --epochs 5 --queue input --seed 1
      qps feed --data train.npz --x-key images --y-key labels --epochs 3
      qps feed --data x.npy --data y.npy --min-after-dequeue 500 --capacity 2000

    An element is [x[i], y[i]]. Progress is logged (epochs, examples) and counted in the
    container's counters feed/<queue>/examples and feed/<queue>/epochs (see `qps
    container stat`). SIGTERM or Ctrl-C stops enqueuing, leaves the queue consistent
    (open unless --close-on-term) and exits 0 (128 + the signal if it cannot within
    1 s: Redis hung).

    One feeder at a time runs the feed into a queue; another one waits until it ends.
    A feed that did not end (the feeder was killed or stopped) is resumed by the next
    `qps feed` with the same data and options (the seed, if none was given, was drawn
    and recorded): every example still goes in exactly once per epoch. Rerunning a feed
    that ended does nothing; --fresh starts a new one. Options also come from QPS_FEED_<OPTION>
    variables (QPS_FEED_EPOCHS=3). --metrics-port serves Prometheus metrics
    (docs/metrics.md).
    """
    role_logs(ctx, "qps.feed")
    options = FeedOptions(
        queue=queue,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        capacity=capacity,
        shuffle=shuffle,
        min_after_dequeue=min_after_dequeue,
        container=container,
        close_on_stop=close_on_term,
        fresh=fresh,
    )
    try:
        options.check()
        if bool(data_paths) == bool(dataset):
            raise InvalidArgumentError(
                "give --data PATH (an .npz, or .npy files) or --dataset NAME"
            )
    except InvalidArgumentError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    serve_metrics(ctx, metrics_port, metrics_addr)
    result = run_role(
        "qps feed",
        "qps.feed",
        lambda stopper: _run(
            url, data_paths, options, dataset, x_key, y_key or None, split, stopper
        ),
    )
    if json:
        echo_json(result.as_dict())
        return
    state = "closed" if result.closed else "left open"
    how = "stopped" if result.stopped else "done"
    click.echo(
        f"qps feed: {how}: {result.examples} example(s), {result.epochs} epoch(s) into "
        f"{result.kind} '{result.queue}' (container '{result.container}'), queue {state}",
        err=True,
    )

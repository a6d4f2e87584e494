"""The feeder role (``qps feed``): put a dataset's examples into a shared input queue,
once per epoch, then close the queue.

A dataset is a list of equally long arrays, one per component (features ``x`` and,
usually, labels ``y``); example ``i`` is ``[x[i], y[i]]``. :func:`load_dataset` reads
one from an ``.npz`` file, from ``.npy`` files, or builds the scikit-learn digits
example; :func:`feed` enqueues it. Each epoch enqueues every example exactly once, in a
fresh random permutation with ``shuffle`` (seeded by ``seed``), as chunks of
``batch_size`` examples (``enqueue_many``). After the last epoch the queue is closed, so
consumers drain it and then get ``OutOfRangeError`` (TF's end of input).

Progress is logged on the ``qps.feed`` logger and counted in two counters of the
container (:class:`qps.Counter`), readable by any process or with ``qps container
stat``: ``feed/<queue>/examples`` (examples whose enqueue completed) and
``feed/<queue>/epochs`` (epochs completed). They add up over every feeder run on that
queue and container.

A stop requested through the :class:`~workers.input.Coordinator` (``qps feed`` does it
on SIGTERM and Ctrl-C) ends the feed between two chunks, or interrupts an enqueue that
waits for room: the queue stays consistent (an interrupted ``enqueue_many`` keeps the
prefix it had stored, which the counter then misses) and open, unless
``close_on_stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from qps import keys
from qps import metrics as _metrics
from qps.containers import Counter
from qps.errors import (
    CancelledError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from qps.queues import FIFOQueue, QueueBase, RandomShuffleQueue
from qps.queues.spec import format_shape
from qps.session import Session
from qps.transport import Client
from workers.input import Coordinator

__all__ = [
    "DATASETS",
    "Dataset",
    "FeedOptions",
    "FeedResult",
    "counter_names",
    "feed",
    "load_dataset",
    "load_digits",
    "load_npy",
    "load_npz",
]

log = logging.getLogger("qps.feed")

T = TypeVar("T")

#: The built-in datasets of ``--dataset``.
DATASETS = ("digits",)


@dataclass(frozen=True)
class Dataset:
    """Equally long arrays, one per component, and where they came from."""

    arrays: list[np.ndarray]
    source: str

    def __len__(self) -> int:
        return int(self.arrays[0].shape[0])

    def describe(self) -> str:
        parts = ", ".join(f"{a.dtype}{format_shape(a.shape[1:])}" for a in self.arrays)
        return f"{self.source}: {len(self)} examples of ({parts})"


def _check(arrays: list[np.ndarray], source: str) -> Dataset:
    if not arrays:
        raise InvalidArgumentError(f"{source}: no arrays")
    for a in arrays:
        if a.ndim == 0:
            raise InvalidArgumentError(f"{source}: a scalar is not a dataset (need dim 0)")
        if a.dtype.kind == "O":
            raise InvalidArgumentError(f"{source}: object arrays are not supported")
    n = arrays[0].shape[0]
    if any(a.shape[0] != n for a in arrays):
        lens = ", ".join(str(a.shape[0]) for a in arrays)
        raise InvalidArgumentError(f"{source}: the arrays have different lengths ({lens})")
    if n == 0:
        raise InvalidArgumentError(f"{source}: the dataset is empty")
    return Dataset([np.ascontiguousarray(a) for a in arrays], source)


def _load(path: str) -> Any:
    try:
        return np.load(path, allow_pickle=False)  # never unpickle what a file holds
    except FileNotFoundError:
        raise NotFoundError(f"no such file: {path}") from None
    except (ValueError, OSError) as exc:
        raise InvalidArgumentError(f"cannot read {path}: {exc}") from exc


def load_npz(path: str, x_key: str = "x", y_key: str | None = "y") -> Dataset:
    """The arrays ``x_key`` and ``y_key`` (None: features only) of an ``.npz`` file.

    Raises:
        NotFoundError: no such file.
        InvalidArgumentError: unreadable, a missing key (the message lists the keys),
            object arrays, or arrays of different lengths.
    """
    with _load(path) as npz:
        names = list(npz.files)
        wanted = [x_key] if y_key is None else [x_key, y_key]
        missing = [k for k in wanted if k not in names]
        if missing:
            raise InvalidArgumentError(
                f"{path} has no array {missing[0]!r} (it has: {', '.join(names) or 'none'}); "
                "choose with --x-key/--y-key"
            )
        try:
            arrays = [np.asarray(npz[k]) for k in wanted]
        except ValueError as exc:  # an object array would need pickle
            raise InvalidArgumentError(f"cannot read {path}: {exc}") from exc
    return _check(arrays, path)


def load_npy(paths: Sequence[str]) -> Dataset:
    """One ``.npy`` file per component: features, then labels.

    Raises:
        NotFoundError, InvalidArgumentError: as :func:`load_npz`.
    """
    arrays = []
    for p in paths:
        a = _load(p)
        if not isinstance(a, np.ndarray):
            raise InvalidArgumentError(f"{p} is not a .npy array file")
        arrays.append(a)
    return _check(arrays, " + ".join(paths))


def load_digits(split: str = "train") -> Dataset:
    """scikit-learn's 8×8 digits: ``train_test_split(test_size=0.2, random_state=0)``,
    features standardized with a StandardScaler fitted on the training part; x float32
    ``[n, 64]``, y int64 ``[n]``.

    Raises:
        InvalidArgumentError: ``split`` is not ``train`` or ``test``.
        FailedPreconditionError: scikit-learn is not installed.
    """
    if split not in ("train", "test"):
        raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}")
    try:  # imported by name: scikit-learn is optional and ships no type hints
        datasets = importlib.import_module("sklearn.datasets")
        model_selection = importlib.import_module("sklearn.model_selection")
        preprocessing = importlib.import_module("sklearn.preprocessing")
    except ImportError as exc:
        raise FailedPreconditionError(
            "the digits dataset needs scikit-learn, which is not installed: "
            "pip install scikit-learn"
        ) from exc
    x, y = datasets.load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x, y, test_size=0.2, random_state=0
    )
    scaler = preprocessing.StandardScaler().fit(x_train)
    xs, ys = (x_train, y_train) if split == "train" else (x_test, y_test)
    arrays = [scaler.transform(xs).astype(np.float32), np.asarray(ys).astype(np.int64)]
    return _check(arrays, f"digits ({split})")


def load_dataset(
    data: Sequence[str] = (),
    dataset: str | None = None,
    *,
    x_key: str = "x",
    y_key: str | None = "y",
    split: str = "train",
) -> Dataset:
    """The dataset named by ``qps feed``'s options: ``data`` is one ``.npz`` file, or one
    or two ``.npy`` files (features, then labels); ``dataset`` a built-in name.

    Raises:
        InvalidArgumentError: neither or both given, too many files, an unknown name
            or file type.
        NotFoundError: a file does not exist.
    """
    if bool(data) == bool(dataset):
        raise InvalidArgumentError("give --data PATH (an .npz, or .npy files) or --dataset NAME")
    if dataset is not None:
        if dataset != "digits":
            raise InvalidArgumentError(
                f"unknown dataset {dataset!r}; built in: {', '.join(DATASETS)}"
            )
        return load_digits(split)
    exts = {os.path.splitext(p)[1].lower() for p in data}
    if exts == {".npz"}:
        if len(data) != 1:
            raise InvalidArgumentError("give one .npz file")
        return load_npz(data[0], x_key, y_key)
    if exts == {".npy"}:
        if len(data) > 2:
            raise InvalidArgumentError("give at most two .npy files: features, then labels")
        return load_npy(data)
    raise InvalidArgumentError(
        f"--data takes one .npz file or one or two .npy files, got {', '.join(data)}"
    )


# -- feeding ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeedOptions:
    """What :func:`feed` does; the fields are ``qps feed``'s options.

    Attributes:
        queue: the input queue's shared name.
        epochs: passes over the dataset.
        batch_size: examples per ``enqueue_many``.
        seed: seeds the per-epoch permutations (and a new RandomShuffleQueue).
        capacity: capacity of the queue, when the feeder creates it.
        shuffle: a fresh random permutation per epoch (else the file's order).
        min_after_dequeue: create a RandomShuffleQueue with this ``min_after_dequeue``
            instead of a FIFOQueue (only when the feeder creates the queue).
        container: the resource container.
        close_on_stop: on a stop request, close the queue (cancelling pending enqueues)
            so consumers drain it; by default the queue is left open.
    """

    queue: str = "input"
    epochs: int = 1
    batch_size: int = 128
    seed: int | None = None
    capacity: int = 1024
    shuffle: bool = True
    min_after_dequeue: int | None = None
    container: str = keys.DEFAULT_CONTAINER
    close_on_stop: bool = False

    def check(self) -> None:
        """Raises InvalidArgumentError for an invalid combination."""
        keys.check_name(self.queue)
        keys.check_container(self.container)
        if self.epochs < 1:
            raise InvalidArgumentError(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch size must be >= 1, got {self.batch_size}")
        if self.min_after_dequeue is not None and not (
            0 <= self.min_after_dequeue < self.capacity or self.capacity < 0
        ):
            raise InvalidArgumentError(
                f"min_after_dequeue {self.min_after_dequeue} must be < capacity {self.capacity}"
            )


@dataclass
class FeedResult:
    """What a :func:`feed` run did."""

    examples: int = 0  # enqueued by this run (completed enqueues)
    epochs: int = 0  # epochs completed by this run
    closed: bool = False  # this run closed the queue
    stopped: bool = False  # a stop request ended it early
    queue: str = ""
    container: str = ""
    kind: str = ""
    counters: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "container": self.container,
            "kind": self.kind,
            "examples": self.examples,
            "epochs": self.epochs,
            "closed": self.closed,
            "stopped": self.stopped,
            "counters": dict(self.counters),
        }


def counter_names(queue: str) -> tuple[str, str]:
    """The names of the examples and epochs counters of a feeder of ``queue``."""
    return f"feed/{queue}/examples", f"feed/{queue}/epochs"


async def _open_queue(client: Client, data: Dataset, options: FeedOptions) -> QueueBase:
    """The existing queue ``options.queue`` (any type), checked against the data, or a
    new FIFOQueue / RandomShuffleQueue shaped like the data."""
    session = Session(client=client, container=options.container)
    await session.open()
    try:
        q = await session.queue(options.queue)
    except NotFoundError:
        dtypes = [a.dtype for a in data.arrays]
        shapes = [list(a.shape[1:]) for a in data.arrays]
        if options.min_after_dequeue is not None:
            return RandomShuffleQueue(
                options.capacity,
                options.min_after_dequeue,
                dtypes,
                shapes,
                seed=options.seed,
                shared_name=options.queue,
                container=options.container,
                client=client,
            )
        return FIFOQueue(
            options.capacity,
            dtypes,
            shapes,
            shared_name=options.queue,
            container=options.container,
            client=client,
        )
    spec = q.spec
    want = ", ".join(f"{a.dtype}{format_shape(a.shape[1:])}" for a in data.arrays)
    have = ", ".join(
        f"{d}{'' if spec.shapes is None else format_shape(s)}"
        for d, s in zip(spec.dtypes, spec.shapes or [()] * len(spec.dtypes))
    )
    same = len(spec.dtypes) == len(data.arrays) and all(
        d == a.dtype for d, a in zip(spec.dtypes, data.arrays)
    )
    if spec.shapes is not None:
        same = same and all(
            len(s) == a.ndim - 1 and all(d is None or d == g for d, g in zip(s, a.shape[1:]))
            for s, a in zip(spec.shapes, data.arrays)
        )
    if not same or spec.kind == "priority":
        raise InvalidArgumentError(
            f"queue '{options.queue}' in container '{options.container}' holds "
            f"{spec.class_name} elements ({have}); the data has ({want})"
        )
    return q


async def _until_stop(aw: Awaitable[T], coord: Coordinator) -> tuple[bool, T | None]:
    """Await ``aw`` unless a stop is requested first; then cancel it. Returns
    ``(finished, result)``."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(coord.wait_for_stop())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


async def feed(
    client: Client,
    data: Dataset,
    options: FeedOptions,
    coord: Coordinator | None = None,
    metrics: _metrics.Metrics | None = None,
) -> FeedResult:
    """Enqueue every example of ``data`` once per epoch into the shared queue
    ``options.queue``, then close it; see the module doc.

    The queue is opened if it exists (of any type whose components match the data) or
    created as a FIFOQueue (a RandomShuffleQueue with ``min_after_dequeue``). Examples,
    epochs and the queue's size go to ``metrics`` (default: the process's); the size is
    read after each chunk only while that registry is served (one more round trip).

    Raises:
        InvalidArgumentError: bad options, or data that does not fit the existing queue.
        CancelledError: the queue was closed by someone else while feeding.
    """
    options.check()
    coord = coord or Coordinator()
    queue = await _open_queue(client, data, options)
    ex_name, ep_name = counter_names(options.queue)
    examples = Counter(ex_name, container=options.container, client=client)
    epochs = Counter(ep_name, container=options.container, client=client)
    await examples.get()  # creates and registers both counters
    await epochs.get()
    registry = metrics or _metrics.default()
    m = registry.feed(options.container, options.queue)
    result = FeedResult(
        queue=queue.name,
        container=options.container,
        kind=queue.spec.class_name,
        counters={"examples": ex_name, "epochs": ep_name},
    )
    n = len(data)
    log.info(
        "feeding %s, %d epoch(s), into %s '%s' (container '%s', capacity %d)",
        data.describe(),
        options.epochs,
        queue.spec.class_name,
        queue.name,
        options.container,
        queue.capacity,
    )
    rng = np.random.default_rng(options.seed)
    for epoch in range(options.epochs):
        order = rng.permutation(n) if options.shuffle else None
        for start in range(0, n, options.batch_size):
            if coord.should_stop():
                break
            stop = min(start + options.batch_size, n)
            if order is None:
                chunk = [a[start:stop] for a in data.arrays]
            else:
                idx = order[start:stop]
                chunk = [a[idx] for a in data.arrays]
            done, _ = await _until_stop(queue.enqueue_many(chunk), coord)
            if not done:
                log.warning(
                    "stopped during an enqueue of %d example(s): a prefix of them may "
                    "be stored, and is not counted",
                    stop - start,
                )
                break
            result.examples += stop - start
            await examples.add(stop - start)
            m.examples.inc(stop - start)
            if registry.serving:
                m.queue_depth.set(await queue.size())
        if coord.should_stop():
            break
        result.epochs += 1
        await epochs.add(1)
        m.epochs.inc()
        log.info(
            "epoch %d/%d done: %d examples this epoch, %d in all",
            epoch + 1,
            options.epochs,
            n,
            result.examples,
        )
    if coord.should_stop():
        result.stopped = True
        if options.close_on_stop:
            with contextlib.suppress(CancelledError):
                await queue.close(cancel_pending_enqueues=True)
            result.closed = True
        log.info(
            "stopped after %d example(s) (%d full epoch(s)); queue '%s' left %s",
            result.examples,
            result.epochs,
            queue.name,
            "closed" if result.closed else "open",
        )
        return result
    try:
        done, _ = await _until_stop(queue.close(), coord)
    except CancelledError:  # someone closed it after our last enqueue
        log.warning("queue '%s' was already closed", queue.name)
        done = True
    result.closed = done
    result.stopped = not done
    log.info(
        "done: %d example(s), %d epoch(s); queue '%s' %s",
        result.examples,
        result.epochs,
        queue.name,
        "closed" if done else "left open (stopped while the close waited)",
    )
    return result

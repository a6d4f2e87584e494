"""The feeder role (``qps feed``): put a dataset's examples into a shared input queue,
once per epoch, then close the queue.

A dataset is a list of equally long arrays, one per component (features ``x`` and,
usually, labels ``y``); example ``i`` is ``[x[i], y[i]]``.
:func:`workers.data.load_dataset` reads one from an ``.npz`` file, from ``.npy``
files, or builds the scikit-learn digits example; :func:`feed` enqueues it. Each epoch
enqueues every example exactly once, in a fresh random permutation with ``shuffle``
(seeded by ``seed``), as chunks of ``batch_size`` examples (``enqueue_many``). After
the last epoch the queue is closed, so consumers drain it and then get
``OutOfRangeError`` (TF's end of input).

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

A feed survives its feeder. One feeder at a time runs the feed into a queue: it holds a
lease (:mod:`workers.feedlease`, renewed in the background and before each chunk); another
feeder waits for it, blocked in Redis, or takes it over at once from a dead process of
this host. The feed's state in Redis records a digest of the data, the options, the seed
(drawn when none is given) and the queue's count of inserted elements when the feed
began. The queue counts every insert in the script that makes it, so a feeder that
takes over an unfinished feed knows exactly how far it got: it undoes the dead feeder's
waiting enqueue (whose rest would otherwise slip in later), reads the count and goes on
after it, in the same permutations. Every example goes in exactly once per epoch
however often feeders die.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qps import keys
from qps import metrics as _metrics
from qps.containers import Counter
from qps.errors import CancelledError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from qps.owners import default_owner
from qps.queues import FIFOQueue, QueueBase, RandomShuffleQueue
from qps.queues.spec import format_shape
from qps.registry import text_of
from qps.session import Session
from qps.transport import Client
from workers.data import DATASETS, Dataset, load_dataset
from workers.feedlease import FeedLease, until_stop
from workers.input import Coordinator

__all__ = [
    "DATASETS",  # the loading is workers.data's; qps feed takes it from here
    "FeedOptions",
    "FeedResult",
    "counter_names",
    "feed",
    "load_dataset",
]

log = logging.getLogger("qps.feed")


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
        fresh: start a new feed even if an earlier one into the queue did not end
            (by default it is resumed).
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
    fresh: bool = False

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
            f"{spec.class_name} elements ({have}); the data has ({data.components()})"
        )
    return q


def fingerprint(data: Dataset) -> str:
    """A short digest of a dataset: its length, its components' dtypes and shapes, and
    the bytes of up to its first 16 MiB per component. A resumed feed must be fed the
    same data."""
    h = hashlib.blake2b(digest_size=12)
    h.update(str([(str(a.dtype), a.shape) for a in data.arrays]).encode())
    for a in data.arrays:
        flat = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
        h.update(flat[: 16 << 20].tobytes())
    return h.hexdigest()


@dataclass
class _Plan:
    """Where a feed starts: ``start`` elements of ``n * epochs`` already inserted."""

    seed: int
    start: int
    resumed: bool
    done: bool


async def _plan(
    client: Client,
    queue: QueueBase,
    data: Dataset,
    options: FeedOptions,
    counters: tuple[Counter, Counter],
) -> _Plan:
    """Read (or create) the feed's state: a new feed records the queue's count of
    inserted elements as its base; a resumed one undoes its dead predecessor's waiting
    enqueues and counts what got in since the base."""
    state_key = keys.feed_prefix(options.container, options.queue) + "state"
    raw = await client.hgetall(state_key)
    st = {text_of(k): text_of(v) for k, v in raw.items()}
    n, fp = len(data), fingerprint(data)
    stats = await queue.stats()
    if st and not options.fresh:
        want = {
            "fingerprint": fp,
            "epochs": str(options.epochs),
            "shuffle": str(int(options.shuffle)),
        }
        if options.seed is not None:
            want["seed"] = str(options.seed)
        diff = [f"{k} {st.get(k)} (this feed: {v})" for k, v in want.items() if st.get(k) != v]
        if diff:
            raise FailedPreconditionError(
                f"an earlier feed into queue '{options.queue}' (container "
                f"'{options.container}') differs: " + "; ".join(diff) + ". Feed the same "
                "data and options to resume it, or pass --fresh to start a new feed"
            )
        if st.get("done") == "1":
            return _Plan(int(st["seed"]), n * options.epochs, True, True)
        old = st.get("client", "")
        if old and old != client.client_id:
            undone = await queue.abort_enqueues_of(old)
            if undone:
                log.info("undid %d waiting enqueue(s) of the previous feeder", undone)
            stats = await queue.stats()
        start = stats.enqueued_total - int(st["base"])
        total = n * options.epochs
        if not 0 <= start <= total:
            raise FailedPreconditionError(
                f"queue '{options.queue}' counts {start} element(s) inserted since the earlier "
                f"feed began, not 0 to {total}: another producer used it, or it was "
                "recreated. Pass --fresh to start a new feed"
            )
        examples, epochs = counters
        # what a killed run inserted but did not count
        for counter, field_, value in ((examples, "ex0", start), (epochs, "ep0", start // n)):
            missing = int(st.get(field_, 0)) + value - await counter.get()
            if missing > 0:
                await counter.add(missing)
        await client.hset(state_key, "client", client.client_id)
        return _Plan(int(st["seed"]), start, True, False)
    seed = options.seed if options.seed is not None else secrets.randbits(63)
    examples, epochs = counters
    fields: dict[Any, Any] = {
        "fingerprint": fp,
        "n": n,
        "epochs": options.epochs,
        "shuffle": int(options.shuffle),
        "seed": seed,
        "base": stats.enqueued_total,
        "client": client.client_id,
        "ex0": await examples.get(),
        "ep0": await epochs.get(),
        "done": 0,
    }
    await client.delete(state_key)
    await client.hset(state_key, mapping=fields)
    return _Plan(seed, 0, False, False)


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

    One feeder at a time runs the feed into a queue (a lease in Redis); another waits
    until it ends. A feed that did not end (a killed or stopped feeder) is resumed where
    it stopped by the next feeder given the same data and options: each example still
    goes in exactly once per epoch (see the module doc).

    Raises:
        InvalidArgumentError: bad options, or data that does not fit the existing queue.
        FailedPreconditionError: an unfinished earlier feed into the queue had other
            data or options (``fresh`` starts a new one).
        CancelledError: the queue was closed by someone else while feeding.
        AbortedError: another feeder took the feed over while this one stalled.
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
    lease = FeedLease(client, options.container, options.queue, default_owner())
    if not await lease.acquire(coord):
        result.stopped = True
        return result
    renew = asyncio.ensure_future(lease.renew_loop())
    try:
        plan = await _plan(client, queue, data, options, (examples, epochs))
        if plan.done:
            result.closed = True
            log.info("the feed into '%s' is complete already: nothing to do", queue.name)
            return result
        await _feed(
            queue, data, options, coord, plan, lease, result, (examples, epochs), m, registry
        )
        if result.closed:
            await client.hset(
                keys.feed_prefix(options.container, options.queue) + "state", "done", 1
            )
        return result
    finally:
        renew.cancel()
        await asyncio.gather(renew, return_exceptions=True)
        await lease.release()


async def _feed(
    queue: QueueBase,
    data: Dataset,
    options: FeedOptions,
    coord: Coordinator,
    plan: _Plan,
    lease: FeedLease,
    result: FeedResult,
    counters: tuple[Counter, Counter],
    m: Any,
    registry: _metrics.Metrics,
) -> None:
    examples, epochs = counters
    n = len(data)
    first_epoch, offset = divmod(plan.start, n)
    log.info(
        "%s %s, %d epoch(s), into %s '%s' (container '%s', capacity %d)%s",
        "resuming the feed of" if plan.resumed else "feeding",
        data.describe(),
        options.epochs,
        queue.spec.class_name,
        queue.name,
        options.container,
        queue.capacity,
        f" at epoch {first_epoch + 1}, example {offset}" if plan.resumed else "",
    )
    rng = np.random.default_rng(plan.seed)
    for epoch in range(options.epochs):
        order = rng.permutation(n) if options.shuffle else None
        if epoch < first_epoch:
            continue  # drawn all the same: each epoch's permutation depends on the seed only
        begin = offset if epoch == first_epoch else 0
        for start in range(begin, n, options.batch_size):
            if coord.should_stop():
                break
            await lease.check()
            stop = min(start + options.batch_size, n)
            if order is None:
                chunk = [a[start:stop] for a in data.arrays]
            else:
                idx = order[start:stop]
                chunk = [a[idx] for a in data.arrays]
            done, _ = await until_stop(queue.enqueue_many(chunk), coord)
            if not done:
                log.warning(
                    "stopped during an enqueue of %d example(s): a prefix of them may "
                    "be stored; the next feeder goes on after it",
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
            "closed" if result.closed else "open (another feeder resumes the feed)",
        )
        return
    try:
        done, _ = await until_stop(queue.close(), coord)
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

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

A feed survives its feeder. One feeder at a time runs the feed into a queue: it holds a
lease (``FEED_LEASE_MS``, renewed in the background and before each chunk); another
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
import importlib
import logging
import os
import secrets
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from qps import keys
from qps import metrics as _metrics
from qps.containers import Counter
from qps.errors import (
    AbortedError,
    CancelledError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    QpsError,
)
from qps.owners import default_owner, owner_is_dead
from qps.queues import FIFOQueue, QueueBase, RandomShuffleQueue
from qps.queues.spec import format_shape
from qps.session import Session
from qps.transport import BLOCK_SECONDS, Client, map_errors
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


#: How long a feeder's lease on its feed lasts unless renewed (a third of it).
FEED_LEASE_MS = 10_000

#: The feed lease: KEYS owner, wake; ARGV op, owner, ms[, held]. 'take' takes a free
#: lease (or renews our own), 'takeover' takes it from ``held`` (a dead process), 'renew'
#: renews ours, 'release' drops ours and wakes a standby. A refused op returns
#: {'held', owner, pttl} ('lost' for 'renew').
_LEASE = """
local cur = redis.call('GET', KEYS[1])
local op = ARGV[1]
if op == 'take' or op == 'takeover' then
  if (not cur) or cur == ARGV[2] or (op == 'takeover' and cur == ARGV[4]) then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return {'ok'}
  end
  return {'held', cur, redis.call('PTTL', KEYS[1])}
elseif op == 'renew' then
  if cur ~= ARGV[2] then return {'lost', cur or ''} end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'ok'}
end
if cur == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return {'ok'}
"""


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


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _Lease:
    """The feeder's lease on the feed into one queue: one feeder at a time feeds it."""

    def __init__(self, client: Client, container: str, queue: str, owner: str) -> None:
        prefix = keys.feed_prefix(container, queue)
        self.keys = [prefix + "owner", prefix + "wake"]
        self.client, self.owner, self.queue = client, owner, queue
        self.script = client.commands.register_script(_LEASE)
        self.lost: str | None = None  # who took it from us

    async def _call(self, *args: Any) -> list[Any]:
        with map_errors():
            return list(await self.script(keys=self.keys, args=list(args)))

    async def acquire(self, coord: Coordinator) -> bool:
        """Take the lease, taking it over at once from a dead process of this host,
        else waiting (blocked in Redis) until it is released or runs out; False if a stop
        is requested first."""
        announced = False
        while not coord.should_stop():
            reply = await self._call("take", self.owner, FEED_LEASE_MS)
            if reply[0] == b"ok":
                return True
            held, pttl = _text(reply[1]), int(reply[2])
            if owner_is_dead(held):
                reply = await self._call("takeover", self.owner, FEED_LEASE_MS, held)
                if reply[0] == b"ok":
                    log.info(
                        "took over the feed into '%s' from %s, a dead process", self.queue, held
                    )
                    return True
                continue
            if not announced:
                log.info(
                    "the feed into '%s' is run by %s: waiting until it ends or its lease "
                    "(%d ms left) runs out",
                    self.queue,
                    held,
                    pttl,
                )
                announced = True
            wait = min(max(pttl, 10) / 1000.0, BLOCK_SECONDS)
            await _until_stop(self.client.blocking.blpop([self.keys[1]], wait), coord)
        return False

    async def check(self) -> None:
        """Renew the lease; raises AbortedError if another feeder took it."""
        if self.lost is None:
            reply = await self._call("renew", self.owner, FEED_LEASE_MS)
            if reply[0] != b"ok":
                self.lost = _text(reply[1]) or "nobody (it ran out)"
        if self.lost is not None:
            raise AbortedError(
                f"the feed into '{self.queue}' was taken over by {self.lost} while this "
                "feeder stalled: stopping (the new feeder goes on where it is)"
            )

    async def renew_loop(self) -> None:
        while True:
            await asyncio.sleep(FEED_LEASE_MS / 3000.0)
            try:
                await self.check()
            except AbortedError as exc:
                log.error("%s", exc)
                return
            except QpsError as exc:
                log.warning("could not renew the feed lease: %s", exc)

    async def release(self) -> None:
        with contextlib.suppress(QpsError):
            await self._call("release", self.owner, FEED_LEASE_MS)


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
    with map_errors():
        raw = await client.commands.hgetall(state_key)
    st = {_text(k): _text(v) for k, v in raw.items()}
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
        with map_errors():
            await client.commands.hset(state_key, "client", client.client_id)
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
    with map_errors():
        await client.commands.delete(state_key)
        await client.commands.hset(state_key, mapping=fields)
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
    lease = _Lease(client, options.container, options.queue, default_owner())
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
            with map_errors():
                await client.commands.hset(
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
    lease: _Lease,
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
            done, _ = await _until_stop(queue.enqueue_many(chunk), coord)
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

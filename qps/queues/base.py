"""The queue machinery shared by FIFOQueue, RandomShuffleQueue and PaddingFIFOQueue.

State lives in Redis; every state transition is one Lua script (``qps/lua``). A call
that cannot finish at once is registered as a pending *attempt* in the queue's FIFO
attempt lists (TensorFlow's model: head-of-line blocking, ``close`` queued behind
earlier enqueues) and its caller blocks in ``BLPOP`` on the attempt's wake key; the
script that makes progress for it pushes the wake token. Nothing polls.

Guarantees beyond TensorFlow's (docs/queues.md, "Where qps differs from TensorFlow 1.x"):

* cancellation atomicity: a dequeue that raises (timeout, asyncio cancellation, client
  closed) leaves the queue as if it had never been made: elements it had taken go back
  to the front in order. An enqueue that raises while it waits inserted nothing, except
  that ``enqueue_many`` keeps the prefix it had already inserted (as in TF). One race
  cannot be undone: an enqueue (or close) whose task is cancelled at the very moment it
  completes raises ``asyncio.CancelledError`` although it took effect, exactly once (its
  elements may already have been consumed). A timeout or a closing client never reports
  a completed call as failed;
* attempts of a process that died are undone when their lease (renewed by every wait)
  runs out;
* an element that does not decode is moved to the queue's dead-letter list and the
  dequeue goes on with the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from qps import keys, wire
from qps.aio import shielded
from qps.errors import (
    AbortedError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    QpsError,
    WouldBlockError,
)
from qps.queues.convert import to_component
from qps.queues.decode import check_element, quarantine, quick_codec, split_bad
from qps.queues.inspect import QueueStats, delete_queue, peek_blobs, queue_stats
from qps.queues.large import (
    BATCH_ENTRY,
    CHUNK_BYTES,
    ONE_CHUNK_MIN_BYTES,
    REF,
    Run,
    batch_runs,
    chunk_of,
    encode_batch,
    encode_element,
    fetch_large,
    handed_rows,
    inline_rows,
    is_ref,
    one_chunk,
    place_rows,
    read_batch_rows,
    read_commands,
    release_args,
    rows_buffer,
    stage_batch,
    store_large,
    taken_chunk,
)
from qps.queues.large import nbytes as blob_bytes
from qps.queues.spec import QueueSpec, Shape, format_shape, is_string
from qps.queues.state import (
    check_count,
    corrupt,
    reraise,
    size_of_replies,
    size_reads,
    stored_spec,
)
from qps.queues.waiters import LEASE_MS, default_client, waiters_of
from qps.transport import BLOCK_SECONDS, Client, map_errors

log = logging.getLogger("qps.queue")

Element = Any  # an array, a list of arrays, or a dict of arrays


@dataclass(frozen=True)
class Delivery:
    """Elements taken by an acknowledged dequeue, held for their caller until
    :meth:`QueueBase.ack` (done with them), :meth:`QueueBase.nack` (put them back) or
    the lease running out (they go back by themselves).

    Attributes:
        value: the element(s), as the matching plain dequeue returns them.
        tokens: ids of the dequeue attempts that delivered them (usually one).
    """

    value: Element
    tokens: tuple[str, ...]
    #: True when none of its stored values referred to bytes kept out of line: its ack
    #: then has nothing to release but the delivery records (the server skips reading
    #: them back)
    plain: bool = False


class _Tokens(list[str]):
    """The attempt ids of an acknowledged dequeue, and whether any delivered value was
    a reference to bytes kept out of line."""

    refs = False


class QueueBase:
    """Behaviour common to every queue type; use a subclass."""

    KIND: ClassVar[str] = ""

    def __init__(
        self,
        spec: QueueSpec,
        *,
        shared_name: str | None,
        name: str,
        container: str | None,
        client: Client | None,
    ) -> None:
        self._spec = spec
        self._container = keys.check_container(container or keys.DEFAULT_CONTAINER)
        self._client = client
        self._shared = shared_name is not None
        if shared_name is not None:
            self._name = keys.check_name(shared_name)
        else:
            # private to this object, like a TF queue without shared_name
            self._name = keys.check_name(f"_{os.getpid()}_{id(self):x}_{name}")
        prefix = keys.queue_prefix(self._container, self._name)
        self._prefix = prefix
        self._keys = [prefix + s for s in ("meta", "items", "ew", "dw", "lease")]
        self._skeys = self._keys[:1]  # scripts get the meta key and derive the others
        self._opened = False
        self._forget = ""  # id of our last delivery record, dropped with the next call
        #: whether our last two dequeue attempts had to wait (bit 0: the last one)
        self._waited = 0
        self._saw_entries = False  # whether a batch entry was ever delivered to us
        self._saw_refs = False  # whether an element stored out of line was delivered to us
        self._list = spec.kind in ("fifo", "padding")  # its elements in a list, in order
        # the fixed-shape batch fast path needs one element length: strings vary in width
        self._fixed = spec.fully_defined and not any(is_string(d) for d in spec.dtypes)
        # one-element enqueues and dequeues skip the general codec where elements are
        # all alike (and the subclass stores them as they are: not PriorityQueue's keys)
        self._quick = (
            quick_codec(spec, self._fixed)
            if type(self)._order_keys is QueueBase._order_keys
            and type(self)._strip_keys is QueueBase._strip_keys
            else None
        )

    # -- properties -----------------------------------------------------------
    @property
    def name(self) -> str:
        """The queue's name (its ``shared_name``, or a generated private one)."""
        return self._name

    @property
    def container(self) -> str:
        return self._container

    @property
    def spec(self) -> QueueSpec:
        return self._spec

    @property
    def dtypes(self) -> list[np.dtype[Any]]:
        return list(self._spec.dtypes)

    @property
    def shapes(self) -> list[Shape] | None:
        return None if self._spec.shapes is None else list(self._spec.shapes)

    @property
    def names(self) -> list[str] | None:
        return None if self._spec.names is None else list(self._spec.names)

    @property
    def capacity(self) -> int:
        return self._spec.capacity

    def __repr__(self) -> str:
        return (
            f"<qps.{self._spec.class_name} {self._container}/{self._name} "
            f"capacity={self._spec.capacity}>"
        )

    # -- opening ----------------------------------------------------------------
    async def _c(self) -> Client:
        if self._client is None:
            self._client = await default_client()
        if not self._opened:
            await self._open(self._client)
        return self._client

    async def _open(self, client: Client) -> None:
        seed = self._spec.seed
        if seed is None:
            rng_seed = int.from_bytes(os.urandom(4), "little") % 2147483646 + 1
        else:
            rng_seed = int(seed) % 2147483646 + 1
        spec = self._spec
        try:
            reply = await client.run_script(
                "create",
                self._skeys,
                [
                    f"{LEASE_MS} {spec.kind} {spec.capacity} {spec.min_after_dequeue} {rng_seed}",
                    spec.to_json(),
                ],
            )
        except QpsError as exc:
            await reraise(client, self._prefix, exc)
        if reply[0] == b"exists":
            self._spec.check_same(stored_spec(reply[1], self._keys[0]), self._name)
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            pipe.set(keys.registration(self._container), 1, nx=True)
            pipe.sadd(keys.container_queues(self._container), self._name)
            await pipe.execute()
        if not self._shared:
            client.on_close(self._drop_private)
        self._opened = True

    async def _drop_private(self) -> None:
        assert self._client is not None
        await delete_queue(self._client, self._name, self._container)

    def _gone(self) -> NotFoundError:
        """The error for a script's ``'gone'`` reply: the queue's keys were deleted."""
        return NotFoundError(
            f"{self._spec.class_name} '{self._name}' no longer exists in container "
            f"'{self._container}' (was it reset?)"
        )

    # -- input checking -----------------------------------------------------------
    def _components(self, vals: Any) -> list[Any]:
        names = self._spec.names
        if names is not None:
            if not isinstance(vals, Mapping):
                raise InvalidArgumentError("You must enqueue a dictionary in a Queue with names")
            if set(vals) != set(names):
                raise InvalidArgumentError(
                    f"Keys in dictionary to enqueue do not match names of Queue. "
                    f"Dictionary: {sorted(vals)}, Queue: {sorted(names)}"
                )
            return [vals[n] for n in names]
        if isinstance(vals, Mapping):
            raise InvalidArgumentError("Queue must have names to enqueue a dictionary")
        if not isinstance(vals, (list, tuple)):
            vals = [vals]
        if len(vals) != len(self._spec.dtypes):
            # TF silently drops extra components (issue #13580); qps refuses both ways.
            raise InvalidArgumentError(
                f"Signature mismatch: the queue has {len(self._spec.dtypes)} components, "
                f"got {len(vals)} values"
            )
        return list(vals)

    def _check_shape(self, arr: np.ndarray, index: int, batch: int | None) -> None:
        shapes = self._spec.shapes
        if shapes is None:
            return
        want = shapes[index]
        got = arr.shape if batch is None else arr.shape[1:]
        ok = len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got))
        if not ok:
            full = want if batch is None else (None if batch < 0 else batch, *want)
            raise InvalidArgumentError(
                f"Shape mismatch in tuple component {index}. Expected {format_shape(full)}, "
                f"got {format_shape(arr.shape)}"
            )

    def _prepare_one(self, vals: Any) -> list[np.ndarray]:
        comps = self._components(vals)
        arrays = []
        for i, (v, dt) in enumerate(zip(comps, self._spec.dtypes)):
            arr = to_component(v, dt, i)
            self._check_shape(arr, i, None)
            arrays.append(arr)
        return arrays

    def _prepare_many(self, vals: Any) -> tuple[list[np.ndarray], int]:
        comps = self._components(vals)
        arrays = []
        batch = -1
        for i, (v, dt) in enumerate(zip(comps, self._spec.dtypes)):
            arr = to_component(v, dt, i)
            if arr.ndim == 0:
                raise InvalidArgumentError(
                    f"enqueue_many needs a batch dimension; component {i} is a scalar"
                )
            if batch < 0:
                batch = arr.shape[0]
            elif arr.shape[0] != batch:
                raise InvalidArgumentError(
                    "All input tensors must have the same size in the 0th dimension. "
                    f"Component {i} has {arr.shape[0]}, and should have {batch}"
                )
            self._check_shape(arr, i, batch)
            arrays.append(arr)
        return arrays, batch

    def _encode_rows(self, arrays: list[np.ndarray], batch: int) -> Any:
        shapes = self._spec.shapes if self._fixed else None
        return encode_batch(arrays, batch, self._spec.dtypes, shapes)

    # -- output -------------------------------------------------------------------
    def _format(self, arrays: list[np.ndarray]) -> Element:
        names = self._spec.names
        if names is not None:
            return dict(zip(names, arrays))
        if len(arrays) == 1:
            return arrays[0]
        return arrays

    def _decode_one(self, blob: bytes) -> list[np.ndarray]:
        quick = self._quick
        if (
            quick is not None
            and type(blob) is bytes
            and len(blob) == quick.total
            and blob.startswith(quick.header)
        ):  # exactly the bytes wire.encode gives for an element of the spec
            flat = np.frombuffer(blob, quick.dtype, offset=len(quick.header))
            return [flat.reshape(quick.shape)]
        arrays = wire.decode(blob).arrays
        check_element(self._spec, arrays)
        return arrays

    def _batch(self, elements: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Stack decoded elements into batch arrays (PaddingFIFOQueue overrides).

        String components of different widths stack into the widest (``np.stack``
        promotes ``S<n>``); an empty batch of strings is ``S1``."""
        ncomp = len(self._spec.dtypes)
        if not elements:
            assert self._spec.shapes is not None
            return [
                np.empty((0, *(int(d) for d in s if d is not None)), dtype=dt)
                for s, dt in zip(self._spec.shapes, self._spec.dtypes)
            ]
        return [np.stack([e[j] for e in elements]) for j in range(ncomp)]

    async def _quarantine(self, client: Client, bad: list[tuple[bytes, str]]) -> None:
        where = f"{self._container}/{self._name}"
        try:
            await quarantine(client, self._skeys, where, bad, LEASE_MS)
        except QpsError as exc:
            await reraise(client, self._prefix, exc)

    # -- the attempt loop ---------------------------------------------------------
    async def _attempt(
        self,
        client: Client,
        script: str,
        entry: str,
        aid: str,
        tokens: str,
        payload: Sequence[Any],
        timeout: float | None,
        what: str,
        before: Sequence[Sequence[Any]] = (),
        may_wait: bool = False,
        after: Sequence[Sequence[Any]] = (),
        sink: list[Any] | None = None,
        acked: bool = False,
        blocking: bool = False,
    ) -> list[Any]:
        """Run one attempt to completion; returns the final reply.

        ``tokens``: the script's small arguments after the lease, space-separated;
        ``payload``: its binary arguments; ``before``: plain commands sent ahead of the
        first script call, in the same round trip (a batch's buffer); ``may_wait``: a
        dequeue that may block (not a nowait one); ``after``: plain commands sent after
        each script call that may deliver (the first, and the collect after each wait),
        in its round trip; ``sink`` gets the replies of those sent with the final reply
        (none if that came from elsewhere, e.g. a timed-out attempt's abort); ``acked``:
        an acknowledged dequeue; ``blocking``: ``after`` may block, so it goes once, with
        the first script call, on a connection of its own, and ``sink`` gets its replies
        whatever the attempt does next.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        wake = f"{self._prefix}a:{aid}:w"
        waiters = None  # set up only when the attempt has to wait
        done: asyncio.Event | None = None  # made when the attempt registers as blocked
        # A dequeue after one that had to wait will probably wait too (a consumer that
        # outpaces its producers): send it with its first wait, in one round trip; the
        # script wakes the wait itself if it does not leave the attempt waiting. An
        # acknowledged one goes so after one of the last two waited: a consumer that
        # takes in pairs, the first of which waits (a synchronous PS shard gathering two
        # workers' gradients), sends every attempt with its wait.
        pipelined = (
            may_wait
            and script == "dequeue"
            and self._waited & (0b11 if acked else 0b01)
            and (timeout is None or timeout >= BLOCK_SECONDS)
        )
        try:
            reply: list[Any]
            triple = None
            if pipelined:
                waiters = waiters_of(client)
                done = done or asyncio.Event()
                waiters.blocked[aid] = (self._skeys, entry, done)
                triple = await client.script_then_wait(
                    script,
                    self._skeys,
                    [f"{LEASE_MS} {tokens} 1", *payload],
                    wake,
                    BLOCK_SECONDS,
                    "collect",
                    [f"{LEASE_MS} {entry} {aid} -"],
                    after,
                )
            if triple is not None:
                reply, waited, extra = triple
                first = reply[0]
                if first == b"wait" and waited is not None:
                    reply = waited  # the wait's outcome, or 'pending'
                if sink is not None:
                    sink[:] = extra
            elif after:
                reply, extra = await client.run_script_then_commands(
                    script,
                    self._skeys,
                    [f"{LEASE_MS} {tokens}", *payload],
                    after,
                    before=before,
                    blocking=blocking,
                )
                first = reply[0]
                if sink is not None:
                    sink[:] = extra
                if blocking:
                    after, sink = (), None
            elif before:
                _, reply = await client.run_commands_then_script(
                    before, script, self._skeys, [f"{LEASE_MS} {tokens}", *payload]
                )
                first = reply[0]
            else:
                reply = await client.run_script(
                    script, self._skeys, [f"{LEASE_MS} {tokens}", *payload]
                )
                first = reply[0]
            if script == "dequeue":  # it dropped the record named in args
                self._forget = ""
                self._waited = (self._waited << 1 | (first == b"wait")) & 0b11
            while reply[0] in (b"wait", b"pending"):
                if deadline is None:
                    block = BLOCK_SECONDS
                else:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        reply = await client.run_script(
                            "abort", self._skeys, [f"{LEASE_MS} {entry} {aid} timeout"]
                        )
                        if sink is not None:
                            sink.clear()
                        if reply[0] in (b"aborted", b"cancelled"):
                            raise DeadlineExceededError(
                                f"Timed out after {timeout} s waiting to {what} "
                                f"{self._spec.class_name} '{self._name}'"
                            )
                        break
                    block = min(BLOCK_SECONDS, remaining)
                if waiters is None:
                    waiters = waiters_of(client)
                done = done or asyncio.Event()
                waiters.blocked[aid] = (self._skeys, entry, done)
                collect = [f"{LEASE_MS} {entry} {aid} {self._forget or '-'}"]
                if after:
                    reply, extra = await client.wait_then_script(
                        wake, block, "collect", self._skeys, collect, after
                    )
                    if sink is not None:
                        sink[:] = extra
                else:
                    reply = await client.wait_then_script(
                        wake, block, "collect", self._skeys, collect
                    )
                self._forget = ""
        except asyncio.CancelledError:
            await shielded(
                client.run_script("abort", self._skeys, [f"{LEASE_MS} {entry} {aid} cancel"])
            )
            raise
        except QpsError as exc:
            # e.g. the wait's connection died: withdraw the attempt now if Redis can be
            # reached, rather than leave it registered until its lease runs out
            with contextlib.suppress(QpsError):
                await shielded(
                    client.run_script("abort", self._skeys, [f"{LEASE_MS} {entry} {aid} cancel"])
                )
            await reraise(client, self._prefix, exc)  # corrupt state: the key named
        finally:
            if waiters is not None:
                waiters.blocked.pop(aid, None)
                if done is not None:
                    done.set()
        status = reply[0]
        if status in (b"cancelled", b"aborted"):
            verb = "Dequeue" if what == "dequeue" else "Enqueue"
            raise CancelledError(f"{verb} operation was cancelled")
        if status == b"gone":
            raise self._gone()
        if status == b"expired":
            raise AbortedError(
                f"the {what} attempt on '{self._name}' was taken for dead (its lease of "
                f"{LEASE_MS} ms ran out while the event loop was stalled or Redis was out "
                "of reach) and undone"
            )
        return reply

    # -- enqueue ------------------------------------------------------------------
    # PriorityQueue overrides these three: it stores a sort key in front of each element.
    def _order_keys(self, arrays: list[np.ndarray], batch: int | None) -> list[bytes] | None:
        """Bytes to store in front of each element (``batch`` None: one element)."""
        return None

    def _strip_keys(self, blobs: list[bytes]) -> list[bytes]:
        """The elements of stored values, without what :meth:`_order_keys` put in front."""
        return blobs

    def _give_back_keys(self, elements: list[list[np.ndarray]]) -> list[bytes] | None:
        """The keys elements a caller gives back are stored under."""
        return None

    async def _enqueue_blobs(
        self,
        blobs: Sequence[Any],
        timeout: float | None,
        nowait: bool,
        order: list[bytes] | None = None,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        blocking: bool = False,
    ) -> None:
        client = await self._c()
        aid = client.new_id()
        buffer = rows_buffer(blobs)
        before: list[tuple[Any, ...]] = []
        if buffer is not None:
            blobs, before = await stage_batch(
                client, self._prefix, aid, buffer, len(blobs), self._list
            )
        elif (
            len(blobs) == 1
            and not isinstance(blobs[0], list)
            and ONE_CHUNK_MIN_BYTES < blob_bytes(blobs[0]) <= CHUNK_BYTES
            and self._list
        ):  # out of Lua: one chunk, written in the script's round trip
            ref, store = one_chunk(self._prefix, aid, blobs[0])
            blobs, before = [ref], [store]
        else:
            blobs = await store_large(client, self._prefix, aid, blobs)
        if order is not None:
            blobs = [k + bytes(b) for k, b in zip(order, blobs)]
        reply = await self._attempt(
            client,
            "enqueue",
            f"e|{aid}",
            aid,
            f"{aid} {int(nowait)}",
            blobs,
            timeout,
            "enqueue",
            before,
            after=then,
            sink=then_out,
            blocking=blocking,
        )
        status = reply[0]
        if status == b"ok":
            return
        if status == b"closed":
            raise CancelledError(f"{self._spec.class_name} '{self._name}' is closed.")
        if status == b"wouldblock":
            raise WouldBlockError(
                f"{self._spec.class_name} '{self._name}' has no room for "
                f"{len(blobs)} element(s) now"
            )
        raise AbortedError(f"unexpected enqueue reply {status!r}")

    async def enqueue(self, vals: Any, *, timeout: float | None = None) -> None:
        """Insert one element, blocking while the queue is full.

        ``vals``: one value per component (a list/tuple, a single array for a
        one-component queue, or a dict for a queue with ``names``).

        Raises:
            InvalidArgumentError: wrong dtype, shape or number of components (nothing
                is inserted).
            CancelledError: the queue is closed, or the call was cancelled by
                ``close(cancel_pending_enqueues=True)`` or by closing the client.
            DeadlineExceededError: ``timeout`` seconds passed; nothing was inserted.
        """
        await self._enqueue_one(vals, timeout)

    async def enqueue_then(
        self,
        vals: Any,
        commands: Sequence[Sequence[Any]],
        *,
        timeout: float | None = None,
        blocking: bool = False,
    ) -> list[Any]:
        """:meth:`enqueue`, then plain Redis ``commands`` sent in the same round trip and
        run by the server right after the element is in: a producer that writes and
        then reads something (an asynchronous worker pushing its gradients, then
        pulling the parameters for its next step) saves a round trip.

        Returns the commands' replies (an error reply in its place, not raised), or an
        empty list when they did not run with the attempt that put the element in
        (e.g. a script had to be loaded first): then run them yourself. The commands
        must only read and must not block: an enqueue that waits for room runs them
        after each wait, not only the last. On a Redis Cluster they go to this queue's
        node: keys of its slot only.

        With ``blocking`` the commands may block (a synchronous worker's ``BLPOP`` for
        its token): they run once, right after the first attempt's script whatever it
        answered (an enqueue that must wait for room waits after them), on a connection
        of their own; without lean connections (fakeredis) they do not run ([]). An
        enqueue that fails (a closed queue) raises once they are done.

        Raises:
            as :meth:`enqueue`.
        """
        out: list[Any] = []
        await self._enqueue_one(vals, timeout, commands, out, blocking)
        return out

    async def _enqueue_one(
        self,
        vals: Any,
        timeout: float | None,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        blocking: bool = False,
    ) -> None:
        quick = self._quick
        if (
            quick is not None
            and type(vals) is np.ndarray
            and vals.dtype is quick.dtype
            and vals.shape == quick.shape
        ):  # what _prepare_one and encode_element give for it, without their checks
            blobs = [quick.header + vals.tobytes()]
            await self._enqueue_blobs(blobs, timeout, False, None, then, then_out, blocking)
            return
        arrays = self._prepare_one(vals)
        blobs = [encode_element(arrays)]
        order = self._order_keys(arrays, None)
        await self._enqueue_blobs(blobs, timeout, False, order, then, then_out, blocking)

    async def enqueue_nowait(self, vals: Any) -> None:
        """:meth:`enqueue` that never waits.

        Raises:
            WouldBlockError: the queue is full or other enqueues are waiting; nothing changed.
            InvalidArgumentError, CancelledError: as :meth:`enqueue`.
        """
        arrays = self._prepare_one(vals)
        order = self._order_keys(arrays, None)
        await self._enqueue_blobs([encode_element(arrays)], None, True, order)

    async def enqueue_many(self, vals: Any, *, timeout: float | None = None) -> None:
        """Insert the slices of a batch (dimension 0) as separate elements, in order.

        Inserts what fits and blocks for the rest, so it can move more elements than
        the capacity while consumers run. A batch of 0 does nothing, even on a closed queue.

        Raises:
            InvalidArgumentError: components disagree on dimension 0, or wrong dtype/shape.
            CancelledError: the queue is closed (or gets closed with cancel while this
                call waits: the prefix already inserted stays).
            DeadlineExceededError: ``timeout`` passed; the prefix already inserted stays.
        """
        arrays, batch = self._prepare_many(vals)
        if batch == 0:
            return
        order = self._order_keys(arrays, batch)
        await self._enqueue_blobs(self._encode_rows(arrays, batch), timeout, False, order)

    async def enqueue_many_nowait(self, vals: Any) -> None:
        """:meth:`enqueue_many` that inserts all of the batch at once, or nothing.

        Raises:
            WouldBlockError: not enough room now; nothing changed.
        """
        arrays, batch = self._prepare_many(vals)
        if batch == 0:
            return
        order = self._order_keys(arrays, batch)
        await self._enqueue_blobs(self._encode_rows(arrays, batch), None, True, order)

    # -- dequeue ------------------------------------------------------------------
    async def _take(
        self,
        n: int,
        mode: str,
        timeout: float | None,
        nowait: bool,
        acked: _Tokens | None = None,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        listed: bool = False,
    ) -> Any:
        """Take ``n`` good elements (fewer for a closed ``upto``) and return their
        components: one element's for mode ``one``, else stacked into batch arrays.

        ``acked``: an acknowledged dequeue; the ids of the attempts that delivered the
        elements are appended to it (see :meth:`dequeue_acked`). If this call fails,
        whatever it had taken goes back to the front. ``then``: plain commands run
        after the attempt that delivers, in its round trip; their replies go to
        ``then_out`` (see :meth:`dequeue_then`). ``listed``: return the elements as a
        list (each one's components), not stacked (see :meth:`dequeue_ready_acked`)."""
        client = await self._c()
        got: list[list[np.ndarray]] = []
        try:
            return await self._take_attempts(
                client, got, n, mode, timeout, nowait, acked, then, then_out, listed
            )
        except BaseException:
            if acked:
                await shielded(self._settle("nack", client, acked))
            elif got:
                await self._give_back(client, got)
            raise

    async def _take_attempts(
        self,
        client: Client,
        got: list[list[np.ndarray]],
        n: int,
        mode: str,
        timeout: float | None,
        nowait: bool,
        acked: _Tokens | None,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        listed: bool = False,
    ) -> Any:
        flag = "A" if acked is not None else ""
        # A list queue's delivery of one whole batch buffer takes the buffer along
        # (renamed b:<aid>: see hand_over in queue_common.lua), read in the same round
        # trip as the reply. Asked for with batch dequeues, and with single ones once
        # this queue object has seen a batch entry.
        handed = acked is None and self._list and (mode != "one" or self._saw_entries)
        # A one-chunk element taken alone takes its chunk along (renamed after the
        # attempt: see fast_take_chunk in fast_common.lua), read in the same round trip
        # too. Asked for once this queue object has seen an element stored out of line.
        chunked = mode == "one" and self._saw_refs and self._list
        while True:
            need = n - len(got)
            aid = client.new_id()
            sink: list[Any] = []
            lead: list[tuple[Any, ...]] = []
            if handed:
                lead.append((b"GET", f"{self._prefix}b:{aid}"))
            if chunked:
                lead.append((b"GET", chunk_of(self._prefix, aid)))
            reply = await self._attempt(
                client,
                "dequeue",
                f"d|{need}|{mode}{flag}|{aid}",
                aid,
                f"{aid} {need} {mode} {int(nowait)} {self._forget or '-'} {int(bool(flag))}",
                (),
                timeout,
                "dequeue",
                may_wait=not nowait,
                acked=acked is not None,
                after=(*lead, *then),
                sink=sink,
            )
            status = reply[0]
            if status == b"ok":
                if then_out is not None:  # the replies to `then`, if they came with this
                    then_out[:] = sink[len(lead) :] if len(sink) == len(lead) + len(then) else []
                    del sink[len(lead) :]
                # the buffer and the chunk read with the reply (an error in its place, or
                # missing: read them anew)
                data = chunk = None
                if sink:
                    read = [None if isinstance(r, BaseException) else r for r in sink]
                    data = read[0] if handed else None
                    chunk = read[int(handed)] if chunked and len(read) > int(handed) else None
                stored = reply[1]
                blobs = self._strip_keys(stored)
                if acked is not None:
                    acked.append(aid)
                    acked.refs = acked.refs or any(is_ref(b) for b in blobs)
                joined = None
                rows = handed_rows(aid, blobs, data)
                taken = None if chunk is None else taken_chunk(aid, blobs, chunk)
                if rows is not None:
                    blobs, joined = rows
                elif taken is not None:
                    blobs = taken
                elif any(is_ref(b) for b in blobs):
                    self._saw_refs = self._saw_refs or any(b[:3] == REF for b in blobs)
                    self._saw_entries = self._saw_entries or any(
                        b[:3] == BATCH_ENTRY for b in blobs
                    )
                    blobs, joined = await self._fetch_out_of_line(
                        client, stored, blobs, acked is None
                    )
                if acked is None:  # read: the next dequeue may drop the record
                    self._forget = aid
                if self._fixed and len(blobs) > 1 and not got and not listed:
                    assert self._spec.shapes is not None
                    batch = wire.decode_rows(blobs, self._spec.dtypes, self._spec.shapes, joined)  # type: ignore[arg-type]
                    if batch is not None:
                        return batch
                good, bad = split_bad(self._decode_one, blobs)
                got.extend(good)
                if bad:
                    await self._quarantine(client, bad)
                if len(got) >= n or (mode == "upto" and got and len(blobs) < need):
                    if listed:
                        return list(got)
                    return got[0] if mode == "one" else self._batch(got)
                continue
            if got and mode == "upto" and status.startswith(b"oor"):
                return list(got) if listed else self._batch(got)
            if got and not acked:
                await self._give_back(client, got)
                got.clear()
            if status.startswith(b"oor"):
                size = int(status.split(b":")[1]) + len(got)
                raise OutOfRangeError(
                    f"{self._spec.class_name} '{self._name}' is closed and has insufficient "
                    f"elements (requested {n}, current size {size})"
                )
            if status == b"wouldblock":
                raise WouldBlockError(
                    f"{self._spec.class_name} '{self._name}' cannot give {n} element(s) now"
                )
            raise AbortedError(f"unexpected dequeue reply {status!r}")

    async def _fetch_out_of_line(
        self, client: Client, stored: list[Any], blobs: list[Any], release: bool = True
    ) -> tuple[list[Any], Any]:
        """Replace references among delivered ``blobs`` (``stored``: the same values as
        the queue held them) by the bytes stored out of line. If reading fails, the
        delivered values go back to the front as they were, and nothing is deleted.

        ``release`` false (an acknowledged dequeue): read only; the ack releases the
        bytes, and a failure is left to the caller, whose nack puts the values back.

        Returns the values, and the buffer holding all of them back to back when they
        are the rows of one read (else None)."""
        try:
            if not release:
                out = await read_batch_rows(client, self._prefix, blobs)
                return await fetch_large(client, self._prefix, out, delete=False), None
            runs = batch_runs(blobs)
            if runs and not any(b[:3] == REF for b in blobs):
                return await self._read_and_release_rows(client, stored, blobs, runs)
            try:
                out = await read_batch_rows(client, self._prefix, blobs)
                out = await fetch_large(client, self._prefix, out)
            except BaseException as exc:
                if not isinstance(exc, InternalError):  # else: set aside as unread
                    await shielded(
                        client.run_script("requeue", self._skeys, [str(LEASE_MS), *stored])
                    )
                raise
        except InternalError:  # a key of the wrong type: the values are left unread,
            return list(blobs), None  # set aside as dead letters by the caller
        rows = release_args(blobs)
        if rows:
            tokens = " ".join([str(LEASE_MS), *rows])
            await shielded(client.run_script("release", self._skeys, [tokens]))
        return out, None

    async def _read_and_release_rows(
        self,
        client: Client,
        stored: list[Any],
        blobs: list[Any],
        runs: list[Run],
    ) -> tuple[list[Any], Any]:
        """Read delivered batch rows and release them in one round trip.

        A caller cancelled meanwhile lets the call finish and puts the rows back at the
        front inline (as the element bytes they are). If the call fails, the references
        go back; should the release have run before the connection broke, their rows
        then come out as dead letters (the at-most-once window of a lost reply)."""
        counts: dict[str, int] = {}
        for bid, _, count, _, _ in runs:
            counts[bid] = counts.get(bid, 0) + count
        tokens = " ".join([str(LEASE_MS), *(f"{bid} {n}" for bid, n in counts.items())])
        call = asyncio.ensure_future(
            client.run_commands_then_script(
                read_commands(self._prefix, runs), "release", self._skeys, [tokens]
            )
        )
        try:
            datas, _ = await asyncio.shield(call)
        except asyncio.CancelledError:
            with contextlib.suppress(QpsError):
                datas, _ = await call
                back = inline_rows(stored, blobs, runs, datas)
                await shielded(client.run_script("requeue", self._skeys, [str(LEASE_MS), *back]))
            raise
        except QpsError as exc:
            if isinstance(exc, InternalError):  # a buffer of the wrong type: set aside
                return list(blobs), None
            with contextlib.suppress(QpsError):
                await shielded(client.run_script("requeue", self._skeys, [str(LEASE_MS), *stored]))
            raise
        one = len(runs) == 1 and len(runs[0][4]) == len(blobs)  # every value, in order
        return place_rows(blobs, runs, datas), datas[0] if one else None

    async def _settle(
        self,
        script: str,
        client: Client,
        tokens: Sequence[str],
        after: Sequence[Sequence[Any]] = (),
    ) -> list[str]:
        """Run ack/nack/touch for ``tokens`` (then plain commands ``after``, in the same
        round trip); return the tokens whose lease had run out."""
        args = [" ".join([str(LEASE_MS), *tokens])]
        try:
            if after:
                reply, replies = await client.run_script_then_commands(
                    script, self._skeys, args, after, once=True
                )
                for r in replies:
                    if isinstance(r, BaseException):
                        log.warning("%s on '%s': a command failed: %s", script, self._name, r)
            else:
                reply = await client.run_script(script, self._skeys, args)
        except QpsError as exc:
            await reraise(client, self._prefix, exc)
        if reply[0] == b"gone":
            raise self._gone()
        return [t.decode() for t in reply[1:]] if reply[0] == b"expired" else []

    async def _give_back(self, client: Client, elements: list[list[np.ndarray]]) -> None:
        blobs = await store_large(
            client, self._prefix, client.new_id(), [encode_element(e) for e in elements]
        )
        order = self._give_back_keys(elements)
        if order is not None:
            blobs = [k + bytes(b) for k, b in zip(order, blobs)]
        await client.run_script("requeue", self._skeys, [str(LEASE_MS), *blobs])

    def _check_many(self, n: int, op: str) -> None:
        check_count(n, op)
        if self._spec.shapes is None:
            raise InvalidArgumentError(
                f"{self._spec.class_name}'s DequeueMany and DequeueUpTo require the "
                "components to have specified shapes."
            )

    async def dequeue(self, *, timeout: float | None = None) -> Element:
        """Remove and return one element, blocking while none may be taken.

        Returns an array (one component), a list (several) or a dict (``names``).

        Raises:
            OutOfRangeError: the queue is closed and empty.
            CancelledError: the client was closed while this call waited.
            DeadlineExceededError: ``timeout`` passed; the queue is unchanged.
        """
        return self._format(await self._take(1, "one", timeout, False))

    async def dequeue_then(
        self, commands: Sequence[Sequence[Any]], *, timeout: float | None = None
    ) -> tuple[Element, list[Any]]:
        """:meth:`dequeue`, then plain Redis ``commands`` sent in the same round trip and
        run by the server right after the element is taken: a caller that blocks for an
        element and then reads something (a worker waiting for its sync token, then
        reading the parameters the token says are ready) saves a round trip.

        Returns the element and the commands' replies (an error reply in its place, not
        raised), or an empty list when they did not run with the attempt that delivered
        (e.g. a script had to be loaded first): then run them yourself. The commands
        must only read (this queue's keys too, as :meth:`size_commands` does) and must
        not block: they run after each wait of a blocked call, not only the last. On a
        Redis Cluster they go to this queue's node: keys of its slot only.

        Raises:
            as :meth:`dequeue`.
        """
        out: list[Any] = []
        value = await self._take(1, "one", timeout, False, then=list(commands), then_out=out)
        return self._format(value), out

    async def dequeue_nowait(self) -> Element:
        """:meth:`dequeue` that never waits.

        Raises:
            WouldBlockError: nothing may be taken now; nothing changed.
            OutOfRangeError: the queue is closed and empty.
        """
        return self._format(await self._take(1, "one", None, True))

    async def dequeue_many(self, n: int, *, timeout: float | None = None) -> Element:
        """Remove exactly ``n`` elements, stacked along a new dimension 0.

        Collects incrementally (``n`` may exceed the capacity). ``n == 0`` returns empty
        arrays at once, even on a closed queue.

        Raises:
            InvalidArgumentError: ``n < 0``, or the queue has no shapes.
            OutOfRangeError: the queue is (or gets) closed with fewer than ``n``; the
                elements this call had collected go back to the front, in order.
            DeadlineExceededError: ``timeout`` passed; collected elements go back too.
        """
        self._check_many(n, "DequeueManyOp")
        if n == 0:
            return self._format(self._batch([]))
        return self._format(await self._take(int(n), "many", timeout, False))

    async def dequeue_many_nowait(self, n: int) -> Element:
        """:meth:`dequeue_many` that never waits.

        Raises:
            WouldBlockError: fewer than ``n`` may be taken now; nothing changed.
        """
        self._check_many(n, "DequeueManyOp")
        if n == 0:
            return self._format(self._batch([]))
        return self._format(await self._take(int(n), "many", None, True))

    async def dequeue_up_to(self, n: int, *, timeout: float | None = None) -> Element:
        """Like :meth:`dequeue_many` while the queue is open; once it is closed, return
        the remaining ``1..n`` elements (a pending call returns its partial batch).

        Raises:
            InvalidArgumentError: ``n < 0``, or the queue has no shapes.
            OutOfRangeError: the queue is closed and empty.
            DeadlineExceededError: ``timeout`` passed; collected elements go back.
        """
        self._check_many(n, "DequeueUpToOp")
        if n == 0:
            return self._format(self._batch([]))
        return self._format(await self._take(int(n), "upto", timeout, False))

    async def dequeue_up_to_nowait(self, n: int) -> Element:
        """Return ``1..n`` elements that may be taken now, without waiting.

        Raises:
            WouldBlockError: none may be taken now.
            OutOfRangeError: the queue is closed and empty.
        """
        self._check_many(n, "DequeueUpToOp")
        if n == 0:
            return self._format(self._batch([]))
        return self._format(await self._take(int(n), "upto", None, True))

    # -- acknowledged (at-least-once) dequeues --------------------------------------
    async def _take_acked(
        self,
        n: int,
        mode: str,
        timeout: float | None,
        nowait: bool,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        listed: bool = False,
    ) -> Delivery:
        """An acknowledged :meth:`_take` as its :class:`Delivery` (``listed``: its value
        is the list of the elements, each formatted)."""
        tokens = _Tokens()
        got = await self._take(n, mode, timeout, nowait, tokens, then, then_out, listed)
        value = [self._format(e) for e in got] if listed else self._format(got)
        return Delivery(value, tuple(tokens), not tokens.refs)

    async def dequeue_acked(self, *, timeout: float | None = None) -> Delivery:
        """:meth:`dequeue`, at least once: the element stays held for this caller until
        :meth:`ack`. If the caller dies, or does not :meth:`touch` the delivery within
        the lease (``QPS_LEASE_MS``, 10 s by default), the element goes back to the
        front of the queue and is delivered again.

        Raises:
            as :meth:`dequeue`.
        """
        return await self._take_acked(1, "one", timeout, False)

    async def dequeue_acked_then(
        self, commands: Sequence[Sequence[Any]], *, timeout: float | None = None
    ) -> tuple[Delivery, list[Any]]:
        """:meth:`dequeue_acked` with plain ``commands`` run right after the element is
        taken, in the same round trip, as :meth:`dequeue_then` runs them; returns the
        delivery and their replies (an empty list if they did not run with it).

        Raises:
            as :meth:`dequeue`.
        """
        out: list[Any] = []
        return await self._take_acked(1, "one", timeout, False, list(commands), out), out

    async def dequeue_ready_acked(
        self, n: int, *, then: Sequence[Sequence[Any]] = ()
    ) -> tuple[Delivery, list[Any]]:
        """At least once (see :meth:`dequeue_acked`), without waiting: up to ``n`` of the
        elements there now, at least one, in one attempt. The queue needs no shapes:
        the delivery's ``value`` is the list of the elements, each as :meth:`dequeue`
        returns it, and one :meth:`ack` (or :meth:`nack`) settles them all. ``then``:
        as for :meth:`dequeue_acked_then`; returns their replies too.

        A reader that keeps up with its producers takes one element at a time with
        :meth:`dequeue_acked`; one that falls behind takes what piled up with this, in
        one round trip and one script call instead of one per element.

        Raises:
            InvalidArgumentError: ``n < 1``.
            WouldBlockError: nothing can be taken now; nothing changed.
            OutOfRangeError: the queue is closed and empty.
        """
        check_count(n, "dequeue_ready_acked", 1)
        out: list[Any] = []
        return await self._take_acked(int(n), "upto", None, True, list(then), out, True), out

    async def dequeue_many_acked(self, n: int, *, timeout: float | None = None) -> Delivery:
        """:meth:`dequeue_many`, at least once (see :meth:`dequeue_acked`)."""
        self._check_many(n, "DequeueManyOp")
        if n == 0:
            return Delivery(self._format(self._batch([])), ())
        return await self._take_acked(int(n), "many", timeout, False)

    async def dequeue_up_to_acked(self, n: int, *, timeout: float | None = None) -> Delivery:
        """:meth:`dequeue_up_to`, at least once (see :meth:`dequeue_acked`)."""
        self._check_many(n, "DequeueUpToOp")
        if n == 0:
            return Delivery(self._format(self._batch([])), ())
        return await self._take_acked(int(n), "upto", timeout, False)

    async def ack(self, delivery: Delivery, *, after: Sequence[Sequence[Any]] = ()) -> None:
        """Done with a delivery: its elements are gone for good.

        ``after``: plain commands sent in the ack's round trip, run after it whatever it
        answers (a failed one is logged, not raised). On Redis Cluster they must be of
        the queue's slot.

        Raises:
            AbortedError: the lease ran out first; the elements were put back and will be
                (or were) delivered again. Work done on them must be idempotent.
        """
        if not delivery.tokens:
            return
        tokens = ("+p", *delivery.tokens) if delivery.plain else delivery.tokens
        lost = await self._settle("ack", await self._c(), tokens, after)
        if lost:
            raise AbortedError(
                f"ack on '{self._name}' came after the lease ({LEASE_MS} ms) ran out: the "
                "elements were put back and are delivered again"
            )

    async def nack(self, delivery: Delivery) -> None:
        """Put a delivery's elements back at the front of the queue, in order, now.
        A delivery whose lease had run out is back already; that is not an error."""
        if delivery.tokens:
            await self._settle("nack", await self._c(), delivery.tokens)

    async def touch(self, delivery: Delivery) -> None:
        """Renew a delivery's lease: call it at least every ``QPS_LEASE_MS / 2`` while
        working on the elements.

        Raises:
            AbortedError: the lease had run out; the elements were put back.
        """
        if not delivery.tokens:
            return
        if await self._settle("touch", await self._c(), delivery.tokens):
            raise AbortedError(
                f"the lease of a delivery from '{self._name}' ran out: its elements were put back"
            )

    async def held(self) -> int:
        """How many attempts of consumers hold elements of this queue or wait for some:
        acknowledged dequeues not yet acked or nacked, and waiting dequeues."""
        return int((await self._reclaim("count"))[1])

    async def reclaim(self) -> int:
        """Put back at the front everything this queue's consumers hold (pending
        deliveries of acknowledged dequeues, elements handed to waiting dequeues) and
        cancel their waits, as if their leases had run out now; return how many attempts
        were undone. Enqueues are left alone.

        Only for a queue with one consumer at a time that knows it is the only one: a
        PS shard whose new owner took the shard's lease gets back at once what its dead
        predecessor held (instead of when those leases run out). A live consumer's
        later ack of a reclaimed delivery raises AbortedError, as after its lease ran out.
        """
        return int((await self._reclaim("undo"))[1])

    async def abort_enqueues_of(self, client_id: str) -> int:
        """Undo the enqueues of the client ``client_id`` (a :attr:`Client.client_id`
        <qps.transport.Client.client_id>) that still wait for room, as if their leases
        had run out now: what they had inserted stays, the rest is dropped. Returns how
        many were undone.

        Only for a producer that restarted and knows it is the only one: a feeder
        resuming its dead predecessor's feed stops the dead run's waiting rest from
        slipping in behind its own enqueues.

        Raises:
            InvalidArgumentError: ``client_id`` is not a client id.
        """
        if not client_id or not all(c in "0123456789abcdef" for c in client_id):
            raise InvalidArgumentError(f"not a client id: {client_id!r}")
        return int((await self._reclaim(f"enqueues {client_id}"))[1])

    async def _reclaim(self, op: str) -> list[Any]:
        client = await self._c()
        try:
            reply = await client.run_script("reclaim", self._skeys, [f"{LEASE_MS} {op}"])
        except QpsError as exc:
            await reraise(client, self._prefix, exc)
        if reply[0] == b"gone":
            raise self._gone()
        return list(reply)

    # -- close / state ------------------------------------------------------------
    async def close(
        self, cancel_pending_enqueues: bool = False, *, timeout: float | None = None
    ) -> None:
        """Close the queue: no more enqueues; dequeues drain what is stored.

        Without ``cancel_pending_enqueues`` the close waits behind enqueues that are
        already pending (TF semantics) and returns once it has taken effect. With it,
        the queue closes at once and pending enqueues fail with CancelledError (the
        prefixes they inserted stay).

        Raises:
            CancelledError: a plain close of a queue that is already closed.
            DeadlineExceededError: ``timeout`` passed while the close waited; it is withdrawn.
        """
        client = await self._c()
        aid = client.new_id()
        reply = await self._attempt(
            client,
            "close",
            f"c|{aid}",
            aid,
            f"{aid} {int(cancel_pending_enqueues)}",
            (),
            timeout,
            "close",
        )
        if reply[0] == b"already":
            raise CancelledError(f"Queue '{self._name}' is already closed.")

    async def is_closed(self) -> bool:
        """Whether the close has taken effect."""
        client = await self._c()
        try:
            with map_errors():
                closed = await client.commands.hget(self._keys[0], "closed")
        except QpsError as exc:
            await reraise(client, self._prefix, exc)
        if closed not in (b"0", b"1", None):  # None: deleted since (a reset container)
            raise corrupt(self._keys[0], f"field 'closed' is {closed!r}, not 0 or 1")
        return closed == b"1"

    async def size(self) -> int:
        """The number of stored elements (not counting those held by pending dequeues).

        Raises:
            DataLossError: the stored counts are corrupt (the key named).
        """
        client = await self._c()
        with map_errors():
            pipe = client.commands.pipeline(transaction=True)  # read atomically
            for command in self._size_reads():
                pipe.execute_command(*command)
            replies = await pipe.execute(raise_on_error=False)
        return size_of_replies(replies, self._spec.kind, self._prefix)

    def _size_reads(self) -> list[tuple[Any, ...]]:
        """The reads whose replies add up to :meth:`size`."""
        return size_reads(self._spec.kind, self._prefix)

    def size_commands(self) -> list[tuple[Any, ...]]:
        """:meth:`size` as plain commands (one ``MULTI``/``EXEC``) for a round trip of the
        caller's own (:meth:`dequeue_then`); :meth:`size_of` reads their replies."""
        return [("MULTI",), *self._size_reads(), ("EXEC",)]

    def size_of(self, replies: Sequence[Any]) -> int | None:
        """The size from the replies to :meth:`size_commands` (all of them, in order);
        None if they are not usable (an error reply)."""
        done = replies[-1] if replies else None
        if not isinstance(done, list) or not done:
            return None
        try:
            return size_of_replies(done, self._spec.kind, self._prefix)
        except (QpsError, TypeError, ValueError):
            return None

    async def stats(self) -> QueueStats:
        """A snapshot of the queue; changes nothing."""
        client = await self._c()
        return await queue_stats(client, self._name, self._container)

    async def peek(self, k: int = 1) -> list[Element]:
        """Up to ``k`` stored elements, decoded, without removing them (the next ones out
        for a FIFO queue; any ``k`` for a shuffle queue)."""
        client = await self._c()
        out = []
        for i, e in enumerate(await peek_blobs(client, self._name, self._container, k)):
            try:
                out.append(self._format(self._decode_one(e.blob)))
            except (DataLossError, ValueError, TypeError) as exc:
                raise corrupt(self._keys[1], f"stored element {i}: {e.error or exc}") from exc
        return out


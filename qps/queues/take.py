"""Taking elements out: a dequeue's attempts until it has its elements, reading what
they refer to out of line, and putting elements back when the call fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from qps import wire
from qps.aio import shielded
from qps.errors import (
    AbortedError,
    InternalError,
    InvalidArgumentError,
    OutOfRangeError,
    QpsError,
    WouldBlockError,
)
from qps.queues.attempt import Dequeue, Riders, line
from qps.queues.core import QueueCore
from qps.queues.decode import split_bad
from qps.queues.large import (
    BATCH_ENTRY,
    REF,
    Run,
    batch_runs,
    chunk_of,
    encode_element,
    fetch_large,
    handed_rows,
    inline_rows,
    is_ref,
    place_rows,
    read_batch_rows,
    read_commands,
    release_args,
    store_large,
    taken_chunk,
)
from qps.queues.state import check_count
from qps.transport import Client

log = logging.getLogger("qps.queue")


class Tokens(list[str]):
    """The attempt ids of an acknowledged dequeue, and whether any delivered value was
    a reference to bytes kept out of line."""

    refs = False


class Taking(QueueCore):
    """The dequeue machinery of :class:`~qps.queues.base.QueueBase`."""

    async def _take(
        self,
        n: int,
        mode: str,
        timeout: float | None,
        nowait: bool,
        acked: Tokens | None = None,
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
        acked: Tokens | None,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        listed: bool = False,
    ) -> Any:
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
            args = Dequeue(aid, need, mode, nowait, self._forget, acked is not None)
            riders = Riders(after=(*lead, *then), sink=sink)
            reply = await self._attempt(client, args, (), timeout, riders)
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
                    await shielded(self._requeue(client, stored))
                raise
        except InternalError:  # a key of the wrong type: the values are left unread,
            return list(blobs), None  # set aside as dead letters by the caller
        rows = release_args(blobs)
        if rows:
            await shielded(client.run_script("release", self._skeys, [line(*rows)]))
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
        tokens = line(*(f"{bid} {n}" for bid, n in counts.items()))
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
                await shielded(self._requeue(client, back))
            raise
        except QpsError as exc:
            if isinstance(exc, InternalError):  # a buffer of the wrong type: set aside
                return list(blobs), None
            with contextlib.suppress(QpsError):
                await shielded(self._requeue(client, stored))
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
        if not after:
            reply = await self._run(client, script, [line(*tokens)])
        else:
            reply, replies = await self._run(client, script, [line(*tokens)], after)
            for r in replies:
                if isinstance(r, BaseException):
                    log.warning("%s on '%s': a command failed: %s", script, self._name, r)
        return [t.decode() for t in reply[1:]] if reply[0] == b"expired" else []

    async def _give_back(self, client: Client, elements: list[list[np.ndarray]]) -> None:
        blobs = await store_large(
            client, self._prefix, client.new_id(), [encode_element(e) for e in elements]
        )
        order = self._give_back_keys(elements)
        if order is not None:
            blobs = [k + bytes(b) for k, b in zip(order, blobs)]
        await self._requeue(client, blobs)

    async def _requeue(self, client: Client, values: Sequence[Any]) -> None:
        """Put stored ``values`` back at the front, in order."""
        await client.run_script("requeue", self._skeys, [line(), *values])

    def _many(self, n: int, mode: str) -> int:
        """``n`` checked for dequeue_many (mode ``many``) or dequeue_up_to (``upto``)."""
        check_count(n, "DequeueManyOp" if mode == "many" else "DequeueUpToOp")
        if self._spec.shapes is None:
            raise InvalidArgumentError(
                f"{self._spec.class_name}'s DequeueMany and DequeueUpTo require the "
                "components to have specified shapes."
            )
        return int(n)

    async def _take_many(self, n: int, mode: str, timeout: float | None, nowait: bool) -> Any:
        """dequeue_many/dequeue_up_to: ``n`` elements stacked (none: empty arrays)."""
        if self._many(n, mode) == 0:
            return self._format(self._batch([]))
        return self._format(await self._take(int(n), mode, timeout, nowait))

"""Bulk reads straight into the caller's buffers: :class:`BulkReader`.

Opened by :func:`qps.resp.open_bulk_reader`, which runs the handshake on a plain
connection and then hands its transport over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

from qps.errors import UnavailableError
from qps.resp_codec import Arg, ReplyError, _hiredis_pack


class BulkReader(asyncio.BufferedProtocol):
    """A connection that reads ``GET`` replies straight into buffers given by the caller:
    the kernel copies each value's bytes into its place, and nothing else does (no
    hiredis buffer, no bytes objects, no join). Used for the chunks of large elements.

    Build one with :func:`open_bulk_reader`. One :meth:`get_into` at a time; a call that
    fails or is cancelled leaves the connection closed (its reply stream is unknown).
    """

    SCRATCH = 1 << 16

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "") -> None:
        self._loop = loop
        self._name = name
        self._transport: asyncio.Transport | None = None
        self._scratch = bytearray(self.SCRATCH)
        self._view = memoryview(self._scratch)
        self._fill = 0  # bytes of scratch holding unparsed input
        self._skip = 0  # bytes still to drop: the CRLF after a value
        self._targets: Sequence[memoryview] = ()
        self._results: list[int | None] = []
        self._body: memoryview | None = None  # where the current value's rest goes
        self._discard = 0  # bytes of a value that fits no target, still to drop
        self._error: ReplyError | None = None
        self._future: asyncio.Future[list[int | None]] | None = None
        self._failure: str | None = None

    @property
    def closed(self) -> bool:
        return self._failure is not None

    # -- protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # an asyncio.Transport, or one of the same interface (uvloop's is no subclass)
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body
        if self._discard:
            return self._view[: min(self._discard, self.SCRATCH)]
        return self._view[self._fill :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._body is not None:
                self._body = self._body[nbytes:] if nbytes < len(self._body) else None
                if self._body is None:
                    self._skip = 2
            elif self._discard:
                self._discard -= nbytes
                if not self._discard:
                    self._skip = 2
            else:
                self._fill += nbytes
                self._parse()
        except (ValueError, IndexError) as exc:
            self._fail(f"Redis protocol error on {self._name}: {exc}")
            self._close_transport()

    def _parse(self) -> None:
        """Consume what scratch holds: CRLF to skip, reply headers, value bytes that
        came in with a header."""
        data, pos, fill = self._scratch, 0, self._fill
        while pos < fill:
            if self._skip:
                take = min(self._skip, fill - pos)
                self._skip -= take
                pos += take
                continue
            if self._future is None or len(self._results) >= len(self._targets):
                raise ValueError("a reply nobody asked for")
            end = data.find(b"\r\n", pos, fill)
            if end < 0:
                if pos == 0 and fill == len(data):
                    raise ValueError("a reply header longer than 64 KiB")
                break
            kind, line = data[pos], bytes(data[pos + 1 : end])
            pos = end + 2
            if kind == 0x24:  # '$': a bulk string
                n = int(line)
                if n < 0:
                    self._results.append(None)
                    continue
                target = self._targets[len(self._results)]
                fits = len(target) == n
                self._results.append(n if fits else -1)
                take = min(n, fill - pos)
                if fits:
                    target[:take] = data[pos : pos + take]
                pos += take
                if take < n:  # the rest comes straight into the target (or is dropped)
                    if fits:
                        self._body = target[take:]
                    else:
                        self._discard = n - take
                    break
                self._skip = 2
            elif kind == 0x2D:  # '-': an error reply
                self._results.append(-1)
                if self._error is None:
                    self._error = ReplyError(line.decode("utf-8", "replace"))
            elif kind in (0x3A, 0x2B):  # ':' or '+': an integer or status (UNLINK, OK)
                self._results.append(-1)
            else:
                raise ValueError(f"unexpected reply type {chr(kind)!r}")
        rest = fill - pos
        if rest and pos:
            data[:rest] = data[pos:fill]
        self._fill = rest
        self._settle()

    def _settle(self) -> None:
        fut = self._future
        if (
            fut is not None
            and len(self._results) == len(self._targets)
            and self._body is None
            and not self._discard
            and not self._skip
        ):
            self._future = None
            if fut.done():
                return
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._results)

    def eof_received(self) -> bool | None:
        self._fail(f"lost the Redis connection {self._name}: the server closed it")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc is not None else ""
        self._fail(f"lost the Redis connection {self._name}{reason}")
        self._transport = None

    def _fail(self, why: str) -> None:
        if self._failure is not None:
            return
        self._failure = why
        fut, self._future = self._future, None
        if fut is not None and not fut.done():
            fut.set_exception(UnavailableError(why))

    def _close_transport(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.abort()

    def close(self) -> None:
        """Close now; a pending :meth:`get_into` raises UnavailableError. Idempotent."""
        self._fail(f"the Redis connection {self._name} was closed")
        self._close_transport()

    # -- the one call -----------------------------------------------------------------
    async def get_into(
        self, keys: Sequence[Arg], targets: Sequence[memoryview]
    ) -> list[int | None]:
        """``GET`` every key in one round trip, each value read into its target.

        Returns, per key: the value's length (it filled its target), None (no such
        key) or -1 (a value whose length is not its target's: its bytes were dropped).

        Raises:
            ReplyError: the server answered a GET with an error (after every reply).
            UnavailableError: the connection is, or went, down.
        """
        if self._failure is not None:
            raise UnavailableError(self._failure)
        if self._future is not None:
            raise RuntimeError("BulkReader.get_into: a call is already running")
        if len(keys) != len(targets):
            raise ValueError("get_into: one target per key")
        if not keys:
            return []
        fut: asyncio.Future[list[int | None]] = self._loop.create_future()
        self._targets = [t if t.format == "B" and t.ndim == 1 else t.cast("B") for t in targets]
        self._results = []
        self._error = None
        self._future = fut
        assert self._transport is not None
        self._transport.write(b"".join(_hiredis_pack((b"GET", k)) for k in keys))  # type: ignore[arg-type]
        try:
            return await fut
        except BaseException:
            if not fut.done() or self._future is fut:  # cancelled mid-read: stream unknown
                self.close()
            raise

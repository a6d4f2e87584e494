"""What every queue operation stands on: a queue's identity and spec, its opening (the
``create`` script and the container's registration), and running its scripts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from qps import keys
from qps.errors import NotFoundError, QpsError
from qps.queues import waiters
from qps.queues.attempt import Args, Attempt, Riders, WaitForecast, line
from qps.queues.decode import quarantine, quick_codec
from qps.queues.elements import Elements
from qps.queues.inspect import delete_queue
from qps.queues.spec import QueueSpec, Shape, is_string
from qps.queues.state import reraise, stored_spec
from qps.queues.waiters import default_client
from qps.transport import Client

_NO_RIDERS = Riders()  # never changed: an attempt that has riders gets its own


class QueueCore(Elements):
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
        self._forecast = WaitForecast()  # whether our next dequeue will probably wait
        self._saw_entries = False  # whether a batch entry was ever delivered to us
        self._saw_refs = False  # whether an element stored out of line was delivered to us
        self._list = spec.kind in ("fifo", "padding")  # its elements in a list, in order
        # the fixed-shape batch fast path needs one element length: strings vary in width
        self._fixed = spec.fully_defined and not any(is_string(d) for d in spec.dtypes)
        # one-element enqueues and dequeues skip the general codec where elements are
        # all alike (and the subclass stores them as they are: not PriorityQueue's keys)
        self._quick = (
            quick_codec(spec, self._fixed)
            if type(self)._order_keys is QueueCore._order_keys
            and type(self)._strip_keys is QueueCore._strip_keys
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
        reply = await self._run(
            client,
            "create",
            [line(spec.kind, spec.capacity, spec.min_after_dequeue, rng_seed), spec.to_json()],
        )
        if reply[0] == b"exists":
            self._spec.check_same(stored_spec(reply[1], self._keys[0]), self._name)
        batch = client.batch().set(keys.registration(self._container), 1, nx=True)
        await batch.sadd(keys.container_queues(self._container), self._name).run()
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

    async def _run(
        self, client: Client, script: str, argv: Sequence[Any], after: Sequence[Any] = ()
    ) -> Any:
        """Run one of this queue's scripts that does not wait (then plain commands
        ``after``, in the same round trip: the reply and theirs); corrupt state raises
        DataLossError naming the key, a deleted queue NotFoundError."""
        try:
            if after:
                reply, replies = await client.run_script_then_commands(
                    script, self._skeys, argv, after, once=True
                )
            else:
                reply = await client.run_script(script, self._skeys, argv)
        except QpsError as exc:
            await reraise(client, self._prefix, exc)
        if reply[0] == b"gone":
            raise self._gone()
        return (reply, replies) if after else reply

    async def _attempt(
        self,
        client: Client,
        args: Args,
        payload: Sequence[Any] = (),
        timeout: float | None = None,
        riders: Riders | None = None,
    ) -> list[Any]:
        """Run one attempt to completion (see :class:`~qps.queues.attempt.Attempt`)."""
        return await Attempt(self, client, args, payload, timeout, riders or _NO_RIDERS).run()

    async def _quarantine(self, client: Client, bad: list[tuple[bytes, str]]) -> None:
        where = f"{self._container}/{self._name}"
        try:
            await quarantine(client, self._skeys, where, bad, waiters.LEASE_MS)
        except QpsError as exc:
            await reraise(client, self._prefix, exc)

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

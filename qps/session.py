"""``qps.Session``: one process's handle on a resource container.

Between-graph replication, as in TF 1.x: every worker process opens its own session on
the same server and container, and finds or creates the shared resources there by name::

    async with qps.Session(container="job-42") as s:
        q = s.fifo_queue(100, [np.float32], shapes=[[4]], shared_name="batches")
        step = s.counter("global_step")
        await q.enqueue(np.zeros(4, np.float32))
        await step.add(1)

All state lives in Redis: it outlives the session and the process, and a later session
on the same container (in any process) sees the same queues and counter values.
:func:`reset` deletes containers (TF: ``tf.Session.reset``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from qps import containers as _containers
from qps import keys
from qps.containers import ContainerStats, Counter, ResetResult
from qps.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from qps.placement import PartitionedVariable, Partitioner
from qps.ps.client import PSClient
from qps.queues import (
    FIFOQueue,
    PaddingFIFOQueue,
    PriorityQueue,
    QueueBase,
    QueueSpec,
    RandomShuffleQueue,
    list_queues,
)
from qps.transport import Client, connect
from qps.variables import Variable, VariableValue, list_variables


def queue_from_spec(spec: QueueSpec, name: str, container: str, client: Client) -> QueueBase:
    """The queue object of the right class for a stored ``spec``, opened as the shared
    queue ``name`` of ``container``.

    Raises:
        InternalError: a spec of an unknown queue type.
    """
    dtypes = list(spec.dtypes)
    shapes = None if spec.shapes is None else [list(s) for s in spec.shapes]
    names = None if spec.names is None else list(spec.names)
    common: dict[str, Any] = {"shared_name": name, "container": container, "client": client}
    if spec.kind == "fifo":
        return FIFOQueue(spec.capacity, dtypes, shapes=shapes, names=names, **common)
    if spec.kind == "padding":
        return PaddingFIFOQueue(spec.capacity, dtypes, shapes=shapes, names=names, **common)
    if spec.kind == "shuffle":
        return RandomShuffleQueue(
            spec.capacity,
            spec.min_after_dequeue,
            dtypes,
            shapes=shapes,
            names=names,
            seed=spec.seed,
            **common,
        )
    if spec.kind == "priority":
        assert shapes is not None
        # the stored spec includes the priority component; the constructor adds it
        return PriorityQueue(spec.capacity, dtypes[1:], shapes[1:], names=names, **common)
    raise InternalError(f"queue '{container}/{name}' has an unknown type {spec.kind!r}")


class Session:
    """A process's connection to one resource container (TF 1.x: ``tf.Session`` with
    ``tf.container``), used as ``async with qps.Session(...) as s:``.

    Opening it connects (unless ``client`` is given) and registers the container.
    Resources are found by name or created: the queue methods take the same arguments as
    the queue classes (a queue is shared when it has a ``shared_name``; without one it is
    private and dropped when the session's client closes), :meth:`counter` finds or
    creates a counter, :meth:`variable` a variable. Closing the session closes the client
    it opened (not one it was given); the resources' state stays in Redis.

    Args:
        url: the Redis URL (see :func:`qps.connect`); default ``$QPS_REDIS_URL``, else
            the local embedded server.
        container: the resource container (default ``"default"``).
        client: an open :class:`qps.Client` to use instead of connecting; the session
            does not close it.
        worker: this process's name as a worker of a PS job (message ids, staleness
            per worker; TF: the task index); default ``<host>-<pid>``.

    Raises:
        InvalidArgumentError: an invalid container or worker name, or both ``url`` and
            ``client``.
    """

    def __init__(
        self,
        url: str | None = None,
        container: str = keys.DEFAULT_CONTAINER,
        client: Client | None = None,
        *,
        worker: str | None = None,
    ) -> None:
        if url is not None and client is not None:
            raise InvalidArgumentError("give Session a url or a client, not both")
        if worker is not None:
            keys.check_container(worker)  # the same alphabet
        self._worker = worker
        self._ps: PSClient | None = None
        self._container = keys.check_container(container)
        self._url = url
        self._client = client
        self._owns_client = client is None
        self._open = False
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------
    async def open(self) -> Session:
        """Connect (if no client was given) and register the container. Idempotent.

        Raises:
            UnavailableError: the server cannot be reached.
            FailedPreconditionError: the session was closed.
        """
        if self._closed:
            raise FailedPreconditionError("this Session is closed; open a new one")
        if self._open:
            return self
        if self._client is None:
            self._client = await connect(self._url)
        try:
            await _containers.register_container(self._client, self._container)
        except BaseException:
            if self._owns_client:
                await self._client.close()
                self._client = None
            raise
        self._open = True
        return self

    async def close(self) -> None:
        """Close the client the session opened (blocked calls on it raise
        :class:`~qps.errors.CancelledError`); a given client stays open. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._open = False
        if self._owns_client and self._client is not None:
            await self._client.close()

    async def __aenter__(self) -> Session:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def container(self) -> str:
        return self._container

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def client(self) -> Client:
        """The session's :class:`qps.Client`.

        Raises:
            FailedPreconditionError: the session is not open.
        """
        if not self._open or self._client is None:
            state = "closed" if self._closed else "not open"
            raise FailedPreconditionError(
                f"the Session is {state}: use `async with qps.Session(...) as s:` "
                "or `await s.open()`"
            )
        return self._client

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._open else "not open")
        return f"<qps.Session container={self._container!r} {state}>"

    def _common(self) -> dict[str, Any]:
        return {"container": self._container, "client": self.client}

    # -- queues -------------------------------------------------------------------------
    def fifo_queue(
        self,
        capacity: int,
        dtypes: Any,
        shapes: Any = None,
        names: Any = None,
        shared_name: str | None = None,
        name: str = "fifo_queue",
    ) -> FIFOQueue:
        """A :class:`qps.FIFOQueue` in this session's container (see there)."""
        return FIFOQueue(capacity, dtypes, shapes, names, shared_name, name, **self._common())

    def random_shuffle_queue(
        self,
        capacity: int,
        min_after_dequeue: int,
        dtypes: Any,
        shapes: Any = None,
        names: Any = None,
        seed: int | None = None,
        shared_name: str | None = None,
        name: str = "random_shuffle_queue",
    ) -> RandomShuffleQueue:
        """A :class:`qps.RandomShuffleQueue` in this session's container (see there)."""
        return RandomShuffleQueue(
            capacity,
            min_after_dequeue,
            dtypes,
            shapes,
            names,
            seed,
            shared_name,
            name,
            **self._common(),
        )

    def padding_fifo_queue(
        self,
        capacity: int,
        dtypes: Any,
        shapes: Any,
        names: Any = None,
        shared_name: str | None = None,
        name: str = "padding_fifo_queue",
    ) -> PaddingFIFOQueue:
        """A :class:`qps.PaddingFIFOQueue` in this session's container (see there)."""
        return PaddingFIFOQueue(
            capacity, dtypes, shapes, names, shared_name, name, **self._common()
        )

    def priority_queue(
        self,
        capacity: int,
        types: Any,
        shapes: Any,
        names: Any = None,
        shared_name: str | None = None,
        name: str = "priority_queue",
    ) -> PriorityQueue:
        """A :class:`qps.PriorityQueue` in this session's container (see there)."""
        return PriorityQueue(capacity, types, shapes, names, shared_name, name, **self._common())

    async def queue(self, name: str) -> QueueBase:
        """The existing shared queue ``name``, opened from its stored spec, for a process
        that does not know how it was declared.

        Raises:
            NotFoundError: no such queue in the container.
        """
        keys.check_name(name)
        client = self.client
        raw = await client.hget(keys.queue_prefix(self._container, name) + "meta", "spec")
        if raw is None:
            raise NotFoundError(f"no queue '{name}' in container '{self._container}'")
        return queue_from_spec(QueueSpec.from_json(raw), name, self._container, client)

    async def list_queues(self) -> list[str]:
        """Names of the queues registered in the container, sorted."""
        return await list_queues(self.client, self._container)

    # -- counters -----------------------------------------------------------------------
    def counter(self, name: str, initial: int = 0) -> Counter:
        """The :class:`qps.Counter` ``name`` of the container, created with ``initial``
        on first use if it does not exist (an existing one keeps its value)."""
        return Counter(name, initial=initial, **self._common())

    async def list_counters(self) -> list[str]:
        """Names of the counters registered in the container, sorted."""
        return await _containers.list_counters(self.client, self._container)

    # -- variables ----------------------------------------------------------------------
    def variable(
        self,
        name: str,
        shape: Sequence[int] | int | None = None,
        dtype: npt.DTypeLike = np.float32,
        initializer: Any = None,
        trainable: bool = True,
    ) -> Variable:
        """The :class:`qps.Variable` ``name`` of the container (see there): created with
        its initial value on first use if it does not exist, else attached to."""
        return Variable(name, shape, dtype, initializer, trainable, **self._common())

    def partitioned_variable(
        self,
        name: str,
        shape: Sequence[int],
        dtype: npt.DTypeLike = np.float32,
        partitioner: Partitioner | Sequence[int] | None = None,
        initializer: Any = None,
        trainable: bool = True,
    ) -> PartitionedVariable:
        """A :class:`qps.PartitionedVariable` in the container (TF: ``get_variable``
        with a ``partitioner``); its parts are variables ``<name>/part_<i>``."""
        return PartitionedVariable(
            name, shape, dtype, partitioner, initializer, trainable, **self._common()
        )

    async def list_variables(self) -> list[str]:
        """Names of the variables registered in the container (parts included), sorted."""
        return await list_variables(self.client, self._container)

    # -- parameter servers --------------------------------------------------------------
    @property
    def ps(self) -> PSClient:
        """The session's :class:`qps.ps.PSClient` (what :meth:`pull`, :meth:`push` and
        :meth:`global_step` use)."""
        if self._ps is None:
            self._ps = PSClient(self.client, self._container, self._worker)
        return self._ps

    async def pull(self, variables: Any) -> Any:
        """Read parameters straight from Redis (no PS involved): one variable (or name)
        -> its ``VariableValue(value, version)``; a list -> dict name -> VariableValue.
        The versions are remembered: the next :meth:`push` says which version each
        gradient was computed from (the shard records the staleness).

        Raises:
            NotFoundError: an unknown variable.
        """
        return await self.ps.pull(variables)

    async def pull_rows(self, variable: Any, ids: Any) -> VariableValue:
        """Rows ``ids`` of a variable (a sparse pull) and their version.

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: ids out of range.
        """
        return await self.ps.pull_rows(variable, ids)

    async def push(
        self,
        grads: Mapping[Any, Any],
        *,
        step: int | None = None,
        versions: Mapping[str, int] | None = None,
    ) -> dict[int, str]:
        """Send one step's gradients to the PS shards (async training: each shard
        applies them on arrival). ``grads`` maps variables (or names) to dense arrays
        or sparse ``(indices, values)`` rows; returns shard -> message id. See
        :meth:`qps.ps.PSClient.push`.

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: a gradient of the wrong shape, dtype or kind (nothing
                is sent).
            FailedPreconditionError: no PS job is configured in the container.
            CancelledError: the job is finished.
        """
        return await self.ps.push(grads, step=step, versions=versions)

    async def global_step(self) -> int:
        """TF's global step: the worker steps the shards applied so far."""
        return await self.ps.global_step()

    # -- the container ------------------------------------------------------------------
    async def stats(self, *, memory: bool = True) -> ContainerStats:
        """:func:`qps.containers.container_stats` of the session's container."""
        return await _containers.container_stats(self.client, self._container, memory=memory)


async def reset(
    url: str | None = None,
    containers: Iterable[str] | None = None,
    *,
    client: Client | None = None,
) -> list[ResetResult]:
    """Delete every key of the named containers on the server at ``url`` (TF:
    ``tf.Session.reset(target, containers)``); return what was deleted per container.

    ``containers=None`` resets **every** container, as in TF. A missing container is
    reported with ``existed=False``. See :func:`qps.containers.reset`.

    Args:
        url: the server (see :func:`qps.connect`); ignored when ``client`` is given.
        containers: the containers to reset (a list; None: all).
        client: an open client to use instead of connecting.

    Raises:
        InvalidArgumentError: an invalid container name (nothing is deleted).
        UnavailableError: the server cannot be reached.
    """
    if containers is not None:
        containers = _containers.check_containers(containers)
    if client is not None:
        return await _containers.reset(client, containers)
    own = await connect(url)
    try:
        return await _containers.reset(own, containers)
    finally:
        await own.close()

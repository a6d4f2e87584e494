"""Variables: named, versioned tensors in a resource container, written by one writer
(the PS shard that owns them) and read by anyone straight from Redis (docs/variables.md).

Storage (``P = qps:{<container>/v/<name>}:``, spelled by :func:`qps.keys.variable_prefix`)::

    P meta            hash: spec (JSON), gen, ver, prev, pver, token, nbytes, nseg, segb,
                      ctime, mtime, publishes, row_publishes
    P d:<gen>:<i>     string: segment i of generation <gen> of the value (whole rows,
                      row-major, little-endian; see qps.varspec.Layout)
    P s:<id>          string: rows staged by a publish_rows in flight (10 min TTL)
    P cur             string: a small value's copy, its version in 16 hex digits last

**Generations.** :meth:`Variable.publish` writes the new value under a fresh generation
id with plain commands, one ``SET`` per segment (docs/variables.md, "Storage": the bytes never pass
through Lua), then one small script checks the fencing token and the version
and flips ``gen`` to it. The flip keeps the previous generation (``prev``, at version
``pver``) for :data:`PREV_TTL_MS` or until the next flip, and deletes the one before, so
a reader that started on the old generation finishes even if a publish lands meanwhile.
:meth:`Variable.publish_rows` copies staged rows into the current generation in place
(one script) and bumps the version: each call is atomic for readers.

**Reads are exact snapshots.** Every read returns ``(value, version)``, ``value`` being
exactly the variable at ``version``:

* up to 1 MiB: the copy of the value that every write keeps (``P cur``, ending with its
  version) and the version, in one ``MULTI``/``EXEC`` (:mod:`qps.varread`); on Redis
  Cluster, or when the copy is not current, one script reads both;
* larger: ``HMGET`` the pointer (gen ``g``, version ``v``), every segment of ``g``
  ``GET`` straight into one buffer, then the pointer again. The read stands iff ``g`` is
  still current at ``v``, or is now ``prev`` with ``pver == v`` (one flip happened and
  ``g`` was not written after it), and every segment came back whole. Otherwise it
  retries (:data:`qps.varread.READ_ATTEMPTS`), then reads inside ``MULTI``/``EXEC``
  (at once where the client has no lean connections: fakeredis). Readers never block
  the writer and the writer never waits for readers;
* :meth:`Variable.read_rows` (the sparse pull): one script per ≤ 4 MiB of rows reads
  ``GETRANGE`` runs of consecutive rows atomically; batches must agree on the version.

**Fencing.** Every write carries a token (an int from the PS lease, larger for every new
lease). The variable keeps the highest token it accepted and refuses a lower one with
:class:`StaleTokenError`, changing nothing; :meth:`Variable.fence` raises the stored
token without writing (a new owner does that first). Versions must increase.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from qps import initializers, keys, varcheck, varread, varspec, varwrite
from qps.errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    QpsError,
)
from qps.initializers import Initializer
from qps.transport import Client
from qps.varread import ReadPlan, VariableState, VariableValue, _read_current, read_many, read_plan
from qps.varspec import (
    MAX_BYTES,
    Layout,
    PartitionInfo,
    VariableSpec,
    check_dtype,
    check_indices,
    check_shape,
    dtype_name,
    format_shape,
)
from qps.varstats import VariableStats, list_variables, variable_stats
from qps.varwrite import (
    APPLIED_KEEP_MS,
    PREV_TTL_MS,
    STAGE_TTL_MS,
    WRITE_BATCH_BYTES,
    AlreadyAppliedError,
    CheckpointHold,
    StaleTokenError,
    load_publish_script,
    text,
)

__all__ = [
    "APPLIED_KEEP_MS",
    "PREV_TTL_MS",
    "STAGE_TTL_MS",
    "WRITE_BATCH_BYTES",
    "AlreadyAppliedError",
    "CheckpointHold",
    "ReadPlan",
    "StaleTokenError",
    "Variable",
    "VariableState",
    "VariableStats",
    "VariableValue",
    "delete_variable",
    "list_variables",
    "load_publish_script",
    "open_variable",
    "read_many",
    "read_plan",
    "variable_stats",
]

#: Values from this size on are read lock-free, segment by segment straight into a
#: reused buffer (a lean connection, :meth:`qps.transport.Client.read_into`;
#: qps.buffers); smaller ones of several segments (only with small segments: tests)
#: inside ``MULTI``/``EXEC``.
LEAN_READ_BYTES = 1 << 20


_M = TypeVar("_M", bound=Callable[..., Awaitable[Any]])


def _typed(method: _M) -> _M:
    """``method`` of :class:`Variable`, with a ``WRONGTYPE`` reply raised as
    DataLossError naming the key of the variable that holds another type."""

    @functools.wraps(method)
    async def checked(self: Variable, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except InternalError as exc:
            if "WRONGTYPE" not in str(exc) or self._client is None:
                raise
            raise await varcheck.wrong_type(self._client, [self._prefix], exc) from exc

    return cast(_M, checked)


class Variable:
    """A named, versioned tensor in a container, shared by every process that opens the
    same name (TF 1.x: ``tf.get_variable`` on a PS; a resource variable).

    It is created on first use (or by :meth:`create`) if it does not exist: the first
    creator's initial value wins. A later opener with the same dtype and shape attaches
    to it; another dtype or shape raises :class:`InvalidArgumentError`. Reads
    (:meth:`read`, :meth:`read_rows`) return ``(value, version)`` and need no PS; writes
    (:meth:`publish`, :meth:`publish_rows`) are the owning PS shard's, guarded by a
    fencing token. The module docstring describes the storage and its consistency.

    Args:
        name: ``[A-Za-z0-9_.:/-]``, 1-200 characters.
        shape: a fully defined shape; may be left out when ``initializer`` is an array.
        dtype: bool, (u)int8-64, float16/32/64, bfloat16 (with ml_dtypes) or ``S<n>``.
        initializer: an :mod:`qps.initializers` initializer, its name, or an array-like
            initial value. Default (as TF): ``glorot_uniform`` for floats, else zeros.
        trainable: recorded in the spec (TF's ``trainable``).
        container: the resource container (default ``"default"``).
        client: a :class:`qps.Client`; default the process-wide one.
        partition: where this variable sits in a partitioned variable (set by
            :class:`qps.placement.PartitionedVariable`).

    Raises:
        InvalidArgumentError: a bad name, container, shape, dtype or initializer, or more
            than :data:`qps.varspec.MAX_BYTES`.
    """

    def __init__(
        self,
        name: str,
        shape: Sequence[int] | int | None = None,
        dtype: npt.DTypeLike = np.float32,
        initializer: Any = None,
        trainable: bool = True,
        *,
        container: str | None = None,
        client: Client | None = None,
        partition: PartitionInfo | None = None,
    ) -> None:
        self._name = keys.check_name(name)
        self._container = keys.check_container(container or keys.DEFAULT_CONTAINER)
        self._client = client
        dt = check_dtype(dtype)
        init = initializers.get(initializer)
        if shape is None:
            if not isinstance(init, initializers.Array) or partition is not None:
                raise InvalidArgumentError(
                    f"variable '{name}': give a shape (or an array as the initializer)"
                )
            shape = init.value.shape
        shp = check_shape(shape)
        if init is None:
            init = initializers.default_for(dt)
        self._init: Initializer = init
        self._spec = VariableSpec(dt, shp, bool(trainable), init.spec(), partition)
        if self._spec.nbytes > MAX_BYTES:
            raise InvalidArgumentError(
                f"variable '{name}' of {self._spec.nbytes} bytes is over the {MAX_BYTES}-byte "
                "limit: partition it (qps.placement partitioners)"
            )
        if isinstance(init, initializers.Array):  # fail now rather than on first use
            full = partition.full_shape if partition is not None else shp
            if init.value.shape != full:
                raise InvalidArgumentError(
                    f"variable '{name}': the initial value has shape "
                    f"{format_shape(init.value.shape)}, the variable {format_shape(full)}"
                )
            initializers.cast_value(init.value.reshape(-1)[:0], dt, "the initial value")
        self._layout = Layout.of(self._spec)
        self._prefix = keys.variable_prefix(self._container, self._name)
        self._meta = self._prefix + "meta"
        self._must_exist = False
        self._opened = False
        self._lock: asyncio.Lock | None = None

    # -- properties ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def container(self) -> str:
        return self._container

    @property
    def spec(self) -> VariableSpec:
        """The spec (once opened: the stored one, the first creator's)."""
        return self._spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._spec.dtype

    @property
    def nbytes(self) -> int:
        return self._spec.nbytes

    @property
    def trainable(self) -> bool:
        return self._spec.trainable

    @property
    def partition(self) -> PartitionInfo | None:
        return self._spec.partition

    @property
    def initializer(self) -> Initializer:
        return self._init

    def __repr__(self) -> str:
        return (
            f"<qps.Variable {self._container}/{self._name} "
            f"shape={format_shape(self.shape)} dtype={dtype_name(self.dtype)}>"
        )

    def _seg(self, gen: str | bytes, i: int) -> str:
        return f"{self._prefix}d:{text(gen)}:{i}"

    def _slot_seg(self, gen: str | bytes, slot: str, i: int) -> str:
        return f"{self._prefix}o:{text(gen)}:{slot}:{i}"

    def _where(self) -> str:
        return f"variable '{self._container}/{self._name}'"

    def _count(self, raw: Any, field: str = "ver") -> int:
        return varcheck.count(raw, self._meta, field)

    async def _missing(self, field: str) -> QpsError:
        """What a read that found meta field ``field`` missing raises: NotFoundError if
        the variable is gone, DataLossError if its meta lacks the field."""
        assert self._client is not None
        return await varcheck.missing(self._client, self._meta, field, self._gone())

    def _gone(self) -> NotFoundError:
        return NotFoundError(
            f"variable '{self._name}' does not exist in container '{self._container}'"
            + (" (was it reset?)" if self._opened else "")
        )

    # -- creation ----------------------------------------------------------------------
    async def _c(self) -> Client:
        if self._client is None:
            from qps.queues.waiters import default_client

            self._client = await default_client()
        if not self._opened:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if not self._opened:
                    await self._open(self._client)
        return self._client

    async def create(self) -> Variable:
        """Create the variable with its initial value if it does not exist, else attach
        to it. Idempotent; every other method does this on first use.

        Raises:
            InvalidArgumentError: it exists with another dtype or shape.
            NotFoundError: opened by :func:`open_variable` and since deleted.
            UnavailableError: Redis cannot be reached.
        """
        await self._c()
        return self

    @_typed
    async def _open(self, client: Client) -> None:
        stored = await varcheck.read_opened(client, self._meta)
        if stored is None:
            if self._must_exist:
                raise self._gone()
            if await varwrite.create(self, client):  # another creator was first: open theirs
                return await self._open(client)
        else:
            self._spec.check_same(stored[0], self._name)
            self._spec, self._layout = stored
        await client.run_commands(
            [
                (b"SET", keys.registration(self._container), 1, b"NX"),
                (b"SADD", keys.container_variables(self._container), self._name),
            ]
        )
        self._opened = True

    # -- writes (qps.varwrite) ---------------------------------------------------------
    def _check_write(self, reply: Any, what: str, version: int, token: int) -> None:
        varwrite.check_reply(self._where(), self._gone(), reply, what, version, token)

    @_typed
    async def publish(
        self,
        value: Any,
        version: int,
        token: int,
        *,
        slots: Mapping[str, Any] | None = None,
        applied: str | Sequence[str] | None = None,
        t: int = 0,
    ) -> None:
        """Publish a new value as ``version`` (the writer's side: the owning PS shard).

        The value goes under a new generation, in chunks; then one script checks
        ``token`` and ``version`` and flips the pointer. Readers see the old value or
        the new one, never a mixture.

        A PS shard's **commit** also passes ``slots`` (every optimizer slot, as stored
        by :meth:`init_slots`), the id of the gradient message it ``applied`` (or the
        ids of all the messages a group commit applied) and ``t`` (the variable's count
        of applied updates): the value, the slots, ``t`` and the applied ids become
        current in the same script, atomically.

        While a checkpoint on Redis Cluster holds the variable (:mod:`qps.checkpoint`),
        the script refuses and writes nothing; the publish waits for the release (as do
        :meth:`publish_rows` and :meth:`init_slots`) and writes again.

        Raises:
            InvalidArgumentError: a value (or slot) of another shape, or of a dtype that
                does not convert without a change of kind; a version/token outside
                [0, 2**53).
            StaleTokenError: ``token`` is lower than one the variable accepted.
            AlreadyAppliedError: a message of ``applied`` is recorded as applied already.
            FailedPreconditionError: ``version`` is not above the published version, or
                ``slots`` are not the stored slots.
            NotFoundError: the variable was deleted (its container reset).
        """
        p = varwrite.publication(self, value, version, token, slots, applied, t)
        await varwrite.publish(self, await self._c(), p)

    def publish_plan(
        self,
        value: Any,
        version: int,
        token: int,
        *,
        slots: Mapping[str, Any],
        applied: str | Sequence[str] | None,
        t: int,
    ) -> tuple[list[tuple[Any, ...]], Callable[[Any], None]] | None:
        """:meth:`publish` (a commit, with ``slots``) as plain commands, its script last,
        for a caller that sends them in one round trip with others (a PS shard commits
        all its small variables at once); and the check of the script's reply, which
        raises as :meth:`publish` does. None when the commit is over WRITE_BATCH_BYTES
        or the variable was not opened yet (then call :meth:`publish`).

        The caller sends the commands in order on one connection. Should the script
        come back NOSCRIPT, it did not run: load it (:func:`load_publish_script`) and publish
        again. No clean-up otherwise (see :meth:`publish`)."""
        return varwrite.publish_plan(self, value, version, token, slots, applied, t)

    @_typed
    async def publish_rows(
        self,
        indices: Any,
        rows: Any,
        version: int,
        token: int,
        *,
        slot_rows: Mapping[str, Any] | None = None,
        applied: str | Sequence[str] | None = None,
        t: int = 0,
    ) -> None:
        """Write ``rows[k]`` into row ``indices[k]`` in place, as ``version`` (the
        owning PS shard's sparse update).

        The rows are staged with one ``SET``; then one script checks ``token`` and
        ``version`` and copies them into the current generation. A reader sees all the
        rows of one call or none of them, and the version rises with them.

        A PS shard's **commit** also passes ``slot_rows`` (the same rows of every stored
        optimizer slot), ``applied`` and ``t`` as for :meth:`publish`: all of them
        change in the same script.

        Raises:
            AlreadyAppliedError: a message of ``applied`` is recorded as applied already.
            InvalidArgumentError: indices not 1-D ints in range, or repeated; rows of
                the wrong shape or dtype; a version/token outside [0, 2**53); a scalar.
            StaleTokenError: ``token`` is lower than one the variable accepted.
            FailedPreconditionError: ``version`` is not above the published version.
            NotFoundError: the variable was deleted (its container reset).
        """
        await varwrite.publish_rows(self, indices, rows, version, token, slot_rows, applied, t)

    @_typed
    async def fence(self, token: int) -> int:
        """Raise the variable's fencing token to ``token`` without writing (a new owner
        does this first, so that the previous one cannot write any more); return the
        published version.

        Raises:
            InvalidArgumentError: a token outside [0, 2**53).
            StaleTokenError: the variable already accepted a higher token.
            NotFoundError: the variable was deleted (its container reset).
        """
        return await varwrite.fence(self, token)

    @_typed
    async def init_slots(self, slots: Mapping[str, Any], token: int) -> None:
        """Store optimizer ``slots`` (name -> array of the variable's shape) as the
        variable's slots, replacing any stored ones, without changing its value or
        version (the owning PS shard, before its first commit, or to reset them).

        Raises:
            InvalidArgumentError: a bad slot name, shape or dtype.
            StaleTokenError: ``token`` is lower than one the variable accepted.
            NotFoundError: the variable was deleted (its container reset).
        """
        await varwrite.init_slots(self, slots, token)

    @_typed
    async def read_state(self) -> VariableState:
        """The value, its version, the stored optimizer slots and ``t``, as one snapshot
        (the owning PS shard loads them when it starts; others may call it too).

        Raises:
            NotFoundError: the variable was deleted (its container reset).
            AbortedError: no consistent read (a writer committing faster than a read).
        """
        return await varread.read_state(self, await self._c())

    @_typed
    async def version(self) -> int:
        """The published version (0 for the initial value).

        Raises:
            NotFoundError: the variable was deleted (its container reset).
        """
        client = await self._c()
        raw = await client.hget(self._meta, "ver")
        if raw is None:
            raise await self._missing("ver")
        return self._count(raw)

    def _array(self, data: bytes | bytearray, key: str = "its value") -> npt.NDArray[Any]:
        if len(data) != self.nbytes:
            raise DataLossError(
                f"corrupt state: {self._where()}: {key} holds {len(data)} bytes, its "
                f"layout says {self.nbytes}"
            )
        buf = data if isinstance(data, bytearray) else bytearray(data)
        return np.frombuffer(buf, dtype=self.dtype).reshape(self.shape)

    @_typed
    async def read(self) -> VariableValue:
        """The whole value and its version: exactly the variable at that version, in a
        new writable array.

        Raises:
            NotFoundError: the variable was deleted (its container reset).
            AbortedError: no consistent read could be made (a writer flipping
                generations twice within every round trip, for a long time).
        """
        client = await self._c()
        if self.small:
            if not client.cluster:
                got = (await _read_current([self]))[0]
                if got is not None:
                    return got
            return await self._read_small()
        return await varread.read_large(self, client, self.nbytes >= LEAN_READ_BYTES)

    @_typed
    async def _read_small(self) -> VariableValue:
        return await varread.read_small(self, await self._c())

    @property
    def small(self) -> bool:
        """Whether one read script returns the whole value (see :func:`read_many`)."""
        return self._layout.nseg <= 1 and self.nbytes <= varspec.CHUNK_BYTES

    @_typed
    async def read_rows(self, indices: Any) -> VariableValue:
        """Rows ``indices`` (ints of any shape; repeats and any order allowed) and the
        version they were read at: ``value[k] == variable[indices[k]]`` exactly at that
        version, shape ``indices.shape + shape[1:]`` (NumPy fancy indexing).

        Each distinct row is read once; runs of consecutive rows (and rows at most
        :data:`GAP_BYTES` apart) are one ``GETRANGE``; one atomic script reads up to
        :data:`ROWS_BATCH_BYTES`, and several batches go in one pipeline.

        Raises:
            InvalidArgumentError: indices that are not ints or not in ``[0, shape[0])``
                (TF's ``indices[i] = x is not in [0, n)``), or a scalar variable.
            NotFoundError: the variable was deleted (its container reset).
        """
        if not self.shape:
            raise InvalidArgumentError(f"variable '{self._name}' is a scalar: it has no rows")
        idx = check_indices(indices, self.shape[0])
        client = await self._c()
        return await varread.read_rows(self, client, idx)

    async def stats(self) -> VariableStats:
        """:func:`variable_stats` of this variable."""
        client = await self._c()
        return await variable_stats(client, self._name, self._container)


async def open_variable(
    client: Client, name: str, container: str = keys.DEFAULT_CONTAINER
) -> Variable:
    """The existing variable ``name``, opened from its stored spec (for a process that
    does not know how it was declared: the CLI, a checkpoint, a PS shard).

    Raises:
        InvalidArgumentError: an invalid name or container.
        NotFoundError: no such variable.
        DataLossError: its meta hash is corrupt (the message names the key and field).
    """
    keys.check_name(name)
    keys.check_container(container)
    stored = await varcheck.read_opened(client, keys.variable_meta(container, name))
    if stored is None:
        raise NotFoundError(f"no variable '{name}' in container '{container}'")
    spec = stored[0]
    v = Variable(
        name,
        spec.shape,
        spec.dtype,
        initializer=initializers.from_spec(spec.initializer or {}) or initializers.zeros(),
        trainable=spec.trainable,
        container=container,
        client=client,
        partition=spec.partition,
    )
    v._must_exist = True
    return await v.create()


async def delete_variable(
    client: Client, name: str, container: str = keys.DEFAULT_CONTAINER
) -> int:
    """Delete every key of variable ``name`` and unregister it; return how many keys
    were deleted (0 if it did not exist).

    Raises:
        InvalidArgumentError: an invalid name or container.
    """
    keys.check_name(name)
    keys.check_container(container)
    pattern = keys.glob_escape(keys.variable_prefix(container, name)) + "*"
    found = [k async for k in client.scan(pattern, 1000)]
    deleted = await client.unlink(*found) if found else 0
    await client.srem(keys.container_variables(container), name)
    return deleted

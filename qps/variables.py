"""Variables: named, versioned tensors in a resource container, written by one writer
(the PS shard that owns them) and read by anyone straight from Redis (docs/variables.md).

Storage (``P = qps:{<container>/v/<name>}:``, spelled by :func:`qps.keys.variable_prefix`)::

    P meta            hash: spec (JSON), gen, ver, prev, pver, token, nbytes, nseg, segb,
                      ctime, mtime, publishes, row_publishes
    P d:<gen>:<i>     string: segment i of generation <gen> of the value (whole rows,
                      row-major, little-endian; see qps.varspec.Layout)
    P s:<id>          string: rows staged by a publish_rows in flight (10 min TTL)

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

* up to 1 MiB: one script reads the version and the bytes;
* larger: ``HMGET`` the pointer (gen ``g``, version ``v``), then one pipeline of
  ``GETRANGE`` chunks of ``g`` followed by the pointer again. The read stands iff ``g``
  is still current at ``v``, or is now ``prev`` with ``pver == v`` (one flip happened
  and ``g`` was not written after it), and every chunk came back whole. Otherwise it
  retries (:data:`READ_ATTEMPTS`), then reads inside ``MULTI``/``EXEC``. Readers never
  block the writer and the writer never waits for readers;
* :meth:`Variable.read_rows` (the sparse pull): one script per ≤ 4 MiB of rows reads
  ``GETRANGE`` runs of consecutive rows atomically; batches must agree on the version.

**Fencing.** Every write carries a token (an int from the PS lease, larger for every new
lease). The variable keeps the highest token it accepted and refuses a lower one with
:class:`StaleTokenError`, changing nothing; :meth:`Variable.fence` raises the stored
token without writing (a new owner does that first). Versions must increase.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np
import numpy.typing as npt
from redis.exceptions import NoScriptError

from qps import buffers, initializers, keys, varcheck, varspec
from qps.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    QpsError,
)
from qps.initializers import Initializer
from qps.transport import Client, map_errors, pipeline_script, write_all
from qps.varscripts import _scripts_of
from qps.varspec import (
    MAX_BYTES,
    Layout,
    PartitionInfo,
    VariableSpec,
    check_counter,
    check_dtype,
    check_indices,
    check_shape,
    dtype_name,
    format_shape,
    row_runs,
    split_runs,
)
from qps.varstats import VariableStats, list_variables, variable_stats

__all__ = [
    "AlreadyAppliedError",
    "CheckpointHold",
    "StaleTokenError",
    "Variable",
    "VariableState",
    "VariableStats",
    "VariableValue",
    "delete_variable",
    "list_variables",
    "open_variable",
    "variable_stats",
]

#: A commit's applied-message id is forgotten after this long even if never released
#: (the PS shard releases it once the message is acknowledged).
APPLIED_KEEP_MS = 24 * 3600 * 1000
_SLOT_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
#: Data written for a publish (or staged rows) expires unless its script commits it.
STAGE_TTL_MS = 600_000
#: The previous generation stays readable this long after a flip (or until the next).
PREV_TTL_MS = 60_000
#: Lock-free attempts of a large read before the ``MULTI``/``EXEC`` fallback.
READ_ATTEMPTS = 4
#: Values from this size on are read segment by segment straight into a reused buffer
#: (a lean connection, :meth:`qps.transport.Client.read_into`; qps.buffers), not as
#: ``GETRANGE`` replies joined into a fresh buffer.
LEAN_READ_BYTES = 1 << 20
#: Tries of the fallback (one loses only to two flips within one round trip).
FALLBACK_ATTEMPTS = 100
#: One ``read_rows`` script reads at most about this many bytes of rows.
ROWS_BATCH_BYTES = 4 << 20
#: A write of a generation goes in pipelines of at most about this many bytes of data.
WRITE_BATCH_BYTES = 4 << 20
#: ``read_rows`` also reads the rows between two wanted ones when they are at most this
#: many bytes apart (one ``GETRANGE`` instead of two).
GAP_BYTES = 1024


class StaleTokenError(FailedPreconditionError):
    """A write carried a fencing token lower than one the variable already accepted:
    another writer (a newer lease holder) owns it. Nothing was changed."""


class AlreadyAppliedError(FailedPreconditionError):
    """A PS commit named a gradient message that the variable records as applied
    already (a redelivery): nothing was changed. ``message_id`` is the message's id."""

    def __init__(self, message: str, message_id: str = "") -> None:
        super().__init__(message)
        self.message_id = message_id


class CheckpointHold(Exception):
    """A write's script found the variable held by a checkpoint being taken on a Redis
    Cluster (:mod:`qps.checkpoint`): it wrote nothing. The writes of :class:`Variable`
    wait for the release and write again; only a caller of :meth:`Variable.publish_plan`
    sees this (then :meth:`Variable.publish` waits)."""

    def __init__(self, where: str, left_ms: int) -> None:
        super().__init__(f"{where} is held by a checkpoint for at most {left_ms} ms more")
        self.left_ms = left_ms


class VariableState(NamedTuple):
    """What a PS shard loads: the value at ``version``, the optimizer ``slots`` stored
    with it (name -> array) and ``t``, the number of updates its commits applied."""

    value: npt.NDArray[Any]
    version: int
    slots: dict[str, npt.NDArray[Any]]
    t: int


class VariableValue(NamedTuple):
    """A read: ``value`` is exactly the variable at ``version``."""

    value: npt.NDArray[Any]
    version: int


def _text(x: bytes | str | None) -> str:
    if x is None:
        return ""
    return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else str(x)


def _applied_ids(applied: str | Sequence[str] | None) -> tuple[str, list[str]]:
    """A commit's message ids as the scripts take them: the first, then the others."""
    ids = ([applied] if applied else []) if isinstance(applied, str) else list(applied or ())
    if any(not isinstance(i, str) or not i for i in ids) or len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"applied message ids must be distinct, non-empty: {ids!r}")
    return (ids[0], ids[1:]) if ids else ("", [])


def _as_bytes(arr: npt.NDArray[Any]) -> memoryview:
    """The C-order bytes of a C-contiguous array, without a copy."""
    return arr.reshape(-1).view(np.uint8).data


async def _execute_then(client: Client, pipe: Any, script: Any, keys: Any, args: Any) -> Any:
    """Run redis-py pipeline ``pipe`` with ``script`` queued last; return the script's
    reply. A script the server does not hold yet runs again, by itself (it did not run).

    Raises:
        UnavailableError: the server cannot be reached.
        InternalError: a command or the script failed.
    """
    if client.cluster:  # queued with its source (see pipeline_script)
        await pipeline_script(client, pipe, script, keys, args)
    else:  # by SHA alone: redis-py would ask SCRIPT EXISTS first, one more round trip
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    with map_errors():
        replies = await pipe.execute(raise_on_error=False)
        *before, reply = replies
        for r in before:
            if isinstance(r, Exception):
                raise r
        if isinstance(reply, NoScriptError):
            return await script(keys=keys, args=args)
        if isinstance(reply, Exception):
            raise reply
    return reply


async def load_publish_script(client: Client) -> None:
    """Load the commit (publish) script into the server, for a caller that runs it by
    SHA among plain commands (:meth:`Variable.publish_plan`).

    Raises:
        UnavailableError: the server cannot be reached.
    """
    with map_errors():
        await client.commands.script_load(_scripts_of(client).publish.script)


class _Publication(NamedTuple):
    gen: str
    view: memoryview
    slots: dict[str, memoryview] | None
    args: list[Any]
    version: int
    token: int


def _ranges_arg(
    lay: Layout, starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64], last: int
) -> str:
    """The script argument naming runs of rows as ``"segment offset x,..."`` (byte
    offset in the segment; ``x`` the last byte for ``last=-1``, the length for 0)."""
    seg = starts // lay.seg_rows
    lo = (starts - seg * lay.seg_rows) * lay.row_bytes
    x = counts * lay.row_bytes + (lo + last if last else 0)
    return ",".join(f"{a} {b} {c}" for a, b, c in zip(seg.tolist(), lo.tolist(), x.tolist()))


async def read_many(variables: Sequence[Variable]) -> list[VariableValue]:
    """:meth:`Variable.read` of several variables of one client; the small ones (one
    script each) all in one round trip, as a pipeline on the client's lean connection.
    Each value is an exact snapshot of its variable (not one instant for all)."""
    out: list[VariableValue | None] = [None] * len(variables)
    small = [k for k, v in enumerate(variables) if v._opened and v.small]
    client = variables[small[0]]._client if small else None
    if client is not None and not all(variables[k]._client is client for k in small):
        client = None
    if client is not None and not client.cluster:
        for k, got in zip(small, await _read_current([variables[k] for k in small])):
            out[k] = got
        small = [k for k in small if out[k] is None]  # not kept current (older writers)
    if client is not None and len(small) > 1:
        sha = _scripts_of(client).read.sha
        try:
            replies = await client.run_commands(
                [(b"EVALSHA", sha, 1, variables[k]._meta) for k in small]
            )
        except QpsError:  # e.g. NOSCRIPT: the plain reads below load the script
            replies = None
        if replies is not None:
            for k, reply in zip(small, replies):
                out[k] = await variables[k]._script_value(reply)
    rest = [k for k, got in enumerate(out) if got is None]
    for k, got in zip(rest, await asyncio.gather(*(variables[k].read() for k in rest))):
        out[k] = got
    return [got for got in out if got is not None]


def _unchanged(now: Sequence[Any], gen: Any, ver: Any) -> bool:
    """Whether generation ``gen``, seen current at version ``ver``, is untouched since:
    still current at ``ver``, or retired (once) at ``ver`` (``now``: the meta's ``gen
    ver prev pver``, read after the data)."""
    return bool((now[0] == gen and now[1] == ver) or (now[2] == gen and now[3] == ver))


async def _read_current(variables: Sequence[Variable]) -> list[VariableValue | None]:
    """The values of small variables of one client on a single server, from the copies
    their writes keep current (``<V>cur`` at the meta's ``curver``), all in one
    ``MULTI``/``EXEC``: one instant for all, and no bytes through Lua (a read script
    copies the value into a Lua string and back, about 1 us per KB on the server). None
    for a variable whose copy is missing or not at its version (written by an older
    qps), or whose meta lacks ``ver`` (deleted, or corrupt): read it with the script,
    which tells them apart. All None on an error reply (a key of the wrong type: the
    script's read names it).

    Raises:
        UnavailableError: the server cannot be reached.
    """
    client = variables[0]._client
    assert client is not None
    try:
        replies = await client.run_transaction(_current_commands(variables))
    except InternalError:
        return [None] * len(variables)
    return _current_values(variables, replies)


def _current_commands(variables: Sequence[Variable]) -> list[tuple[Any, ...]]:
    """The commands of :func:`_read_current`, to run inside one ``MULTI``/``EXEC``."""
    commands: list[tuple[Any, ...]] = []
    for v in variables:
        commands.append((b"HMGET", v._meta, b"ver", b"curver"))
        commands.append((b"GET", v._prefix + "cur"))
    return commands


def _current_values(
    variables: Sequence[Variable], replies: Sequence[Any]
) -> list[VariableValue | None]:
    """The values of :func:`_read_current` from the replies of its commands."""
    out: list[VariableValue | None] = []
    for k, v in enumerate(variables):
        (ver, curver), data = replies[2 * k], replies[2 * k + 1]
        if ver is None or data is None or curver != ver or len(data) != v.nbytes + CUR_SUFFIX:
            out.append(None)  # not current: read the segment (read_many)
            continue
        version = v._count(ver)
        if data[-CUR_SUFFIX:] != b"%016x" % version:
            out.append(None)  # not a copy qps wrote: read the segment
            continue
        value = bytearray(memoryview(data)[:-CUR_SUFFIX])
        out.append(VariableValue(v._array(value), version))
    return out


#: the copy ``<V>cur`` of a small value ends with its version, 16 hex digits
CUR_SUFFIX = 16


class ReadPlan:
    """A read of several small variables of one client on a single server, as plain
    commands that a caller sends in a round trip of its own (e.g. after a dequeue, to
    read the parameters the moment a token arrives: :meth:`qps.queues.FIFOQueue.dequeue_then`).

    :attr:`commands` are one ``MULTI``/``EXEC`` (an exact snapshot of all of them);
    :meth:`values` turns their replies into the values, or None when a copy was not
    current (written by an older qps) or a reply was an error: then read them again
    with :func:`read_many`."""

    def __init__(self, variables: Sequence[Variable]) -> None:
        self.variables = list(variables)
        self.commands: list[tuple[Any, ...]] = [
            (b"MULTI",),
            *_current_commands(self.variables),
            (b"EXEC",),
        ]

    def values(self, replies: Sequence[Any]) -> list[VariableValue] | None:
        """The values from the replies to :attr:`commands` (all of them, in order)."""
        done = replies[-1] if len(replies) == len(self.commands) else None
        if not isinstance(done, list) or len(done) != 2 * len(self.variables):
            return None
        if any(isinstance(r, BaseException) for r in (*replies, *done)):
            return None
        try:
            got = _current_values(self.variables, done)
        except (TypeError, ValueError):  # not the replies of these commands
            return None
        return None if any(v is None for v in got) else [v for v in got if v is not None]


def read_plan(variables: Sequence[Variable]) -> ReadPlan | None:
    """A :class:`ReadPlan` for ``variables``, or None where :func:`read_many` must read
    them: one not opened or not small, several clients, or a Redis Cluster."""
    if not variables or not all(v._opened and v.small for v in variables):
        return None
    client = variables[0]._client
    if client is None or client.cluster or not all(v._client is client for v in variables):
        return None
    return ReadPlan(variables)


# -- the variable ----------------------------------------------------------------------------

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
        return f"{self._prefix}d:{_text(gen)}:{i}"

    def _slot_seg(self, gen: str | bytes, slot: str, i: int) -> str:
        return f"{self._prefix}o:{_text(gen)}:{slot}:{i}"

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
            if await self._create(client):  # another creator was first: open theirs
                return await self._open(client)
        else:
            self._spec.check_same(stored[0], self._name)
            self._spec, self._layout = stored
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            pipe.set(keys.registration(self._container), 1, nx=True)
            pipe.sadd(keys.container_variables(self._container), self._name)
            await pipe.execute()
        self._opened = True

    async def _create(self, client: Client) -> bool:
        """Write the initial value and commit it: False if this call created the
        variable, True if another creator got there first."""
        spec, lay = self._spec, self._layout
        view = None
        if not self._init.zero_bytes:  # zeros: the server allocates them
            p = spec.partition
            value = self._init(
                spec.shape,
                spec.dtype,
                full_shape=None if p is None else p.full_shape,
                offset=None if p is None else p.offset,
            )
            view = _as_bytes(np.ascontiguousarray(value, dtype=spec.dtype))
        gen = secrets.token_hex(8)
        await self._write(client, gen, view)
        with map_errors():
            reply = await _scripts_of(client).create(
                keys=[self._meta],
                args=[spec.to_json(), gen, lay.nbytes, lay.nseg, lay.seg_bytes],
            )
        status = _text(reply[0])
        if status != "ok" and status != "exists":
            raise InternalError(
                f"{self._where()}: its initial value vanished before it was committed "
                "(evicted or deleted by hand?)"
            )
        return status == "exists"

    async def _write(
        self,
        client: Client,
        gen: str,
        view: memoryview | None,
        slots: Mapping[str, memoryview] | None = None,
        then: tuple[Any, Sequence[Any], Sequence[Any]] | None = None,
    ) -> Any:
        """Write generation ``gen`` (``view``; None: zeros, and no value at all when
        ``view`` is None and ``slots`` are given) and the ``slots`` under it, segment by
        segment, in chunks, with a TTL that the committing script removes. On failure
        the keys are removed (or expire).

        ``then``: a redis-py script with its keys and arguments (the commit), run after
        the writes and returned; no clean-up on failure then (the script may have run
        with its reply lost). The writes go on a lean connection where there is one
        (:func:`~qps.transport.write_all`: the segments' buffers are sent as they are)."""
        batches = self._write_batches(gen, view, slots)
        names = [c[1] for b in batches for c in b if c[0] in ("PEXPIRE", "SET")]
        try:
            for batch in batches:
                await write_all(client, batch)
            if then is None:
                return None
            names = []  # the script may run: its keys may be the current value
            with map_errors():
                return await _execute_then(
                    client, client.commands.pipeline(transaction=False), *then
                )
        except BaseException:
            if names:
                with contextlib.suppress(Exception):  # they expire anyway
                    await client.commands.unlink(*names)
            raise

    def _write_batches(
        self, gen: str, view: memoryview | None, slots: Mapping[str, memoryview] | None
    ) -> list[list[tuple[Any, ...]]]:
        """The commands of :meth:`_write`, in batches of at most WRITE_BATCH_BYTES (one
        segment) of data. Each batch is sent as one pipeline, one after the other: the
        client joins a pipeline into one buffer, and a buffer of a whole 48 MiB commit
        (value + two Adam slots) is a fresh mmap with its page faults every time, while
        4 MiB ones are reused from the heap. Measured: a 48 MiB commit 66-89 ms ->
        27-33 ms. A segment is one SET (not SETRANGE chunks into a zero-filled string:
        54 -> 41 ms for the 48 MiB commit)."""
        lay = self._layout
        todo: list[tuple[list[str], memoryview | None]] = []
        if view is not None or slots is None:
            todo.append(([self._seg(gen, i) for i in range(lay.nseg)], view))
        for slot, sview in (slots or {}).items():
            todo.append(([self._slot_seg(gen, slot, i) for i in range(lay.nseg)], sview))
        batches: list[list[tuple[Any, ...]]] = []
        batch: list[tuple[Any, ...]] = []
        queued = 0
        for seg_keys, data in todo:
            base = 0
            for i, key in enumerate(seg_keys):
                size = lay.segment_size(i)
                if data is not None and queued and queued + size > WRITE_BATCH_BYTES:
                    batches.append(batch)
                    batch, queued = [], 0
                if data is None:  # zeros: one allocation of the final size, zero-filled
                    batch.append(("SETRANGE", key, size - 1, b"\0"))
                    batch.append(("PEXPIRE", key, STAGE_TTL_MS))
                else:
                    batch.append(("SET", key, data[base : base + size], "PX", STAGE_TTL_MS))
                    queued += size
                base += size
        if batch:
            batches.append(batch)
        return batches

    # -- writes ------------------------------------------------------------------------
    def _check_write(self, reply: Any, what: str, version: int, token: int) -> None:
        status = _text(reply[0])
        if status == "ok":
            return
        if status == "gone":
            raise self._gone()
        if status == "stale":
            raise StaleTokenError(
                f"{self._where()}: {what} with fencing token {token} refused, the variable "
                f"has accepted token {_text(reply[1])} (another writer owns it); "
                "nothing changed"
            )
        if status == "version":
            raise FailedPreconditionError(
                f"{self._where()}: {what} of version {version} refused, the published "
                f"version is {_text(reply[1])} and versions must increase; nothing changed"
            )
        if status == "held":
            raise CheckpointHold(self._where(), int(_text(reply[1])))
        if status == "dup":
            raise AlreadyAppliedError(
                f"{self._where()}: message {_text(reply[1])} was already applied; nothing changed",
                _text(reply[1]),
            )
        if status == "slots":
            raise FailedPreconditionError(
                f"{self._where()}: {what} refused, the variable's optimizer slots are "
                f"[{_text(reply[1])}]; nothing changed"
            )
        if status == "corrupt":  # the script names the key (and field)
            raise DataLossError(f"corrupt state: {self._where()}: {_text(reply[1])}")
        if status == "changed":
            raise FailedPreconditionError(
                f"{self._where()} was created again with another shape "
                f"({_text(reply[1])} bytes): open it again"
            )
        raise InternalError(f"{self._where()}: {what} failed: {status} {_text(reply[-1])}")

    def _check_value(self, value: Any) -> npt.NDArray[Any]:
        arr = initializers.cast_value(value, self.dtype, f"the value of '{self._name}'")
        if arr.shape != self.shape:
            raise InvalidArgumentError(
                f"variable '{self._name}' has shape {format_shape(self.shape)}, the value "
                f"{format_shape(arr.shape)}"
            )
        return np.ascontiguousarray(arr, dtype=self.dtype)

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
        p = self._publication(value, version, token, slots, applied, t)
        client = await self._c()
        flip = (_scripts_of(client).publish, [self._meta], p.args)

        async def attempt() -> None:
            # The flip goes in the round trip of the last chunks. No clean-up if it fails:
            # the flip may have happened with its reply lost, and then these keys are the
            # current value. Uncommitted ones expire (STAGE_TTL_MS); a refused flip
            # deletes them, and the next attempt writes them again.
            reply = await self._write(client, p.gen, p.view, p.slots, then=flip)
            self._check_write(reply, "publish", p.version, p.token)

        await self._unless_held(client, attempt)

    async def _unless_held(self, client: Client, attempt: Callable[[], Awaitable[None]]) -> None:
        """Run ``attempt`` (a write whose script refuses while a checkpoint holds the
        variable) until it is not refused so: each refusal waits, blocked in Redis, for
        the checkpoint's release (or for the hold's time to run out)."""
        while True:
            try:
                await attempt()
                return
            except CheckpointHold as held:
                with map_errors():
                    await client.blocking.blpop(
                        [self._prefix + "unheld"], timeout=held.left_ms / 1000 + 0.01
                    )

    def _publication(
        self,
        value: Any,
        version: int,
        token: int,
        slots: Mapping[str, Any] | None,
        applied: str | Sequence[str] | None,
        t: int,
    ) -> _Publication:
        """A publish's checked inputs, its new generation and the flip script's
        arguments (see :meth:`publish`)."""
        version = check_counter(version, "version")
        token = check_counter(token, "token")
        view = _as_bytes(self._check_value(value))
        slot_views = None
        if slots is not None:
            slot_views = {
                self._check_slot_name(n): _as_bytes(self._check_value(v)) for n, v in slots.items()
            }
        gen = secrets.token_hex(8)
        args: list[Any] = [token, version, gen, self._layout.nseg, PREV_TTL_MS, self.nbytes]
        if slot_views is not None:
            first, more = _applied_ids(applied)
            args += [",".join(slot_views), first, check_counter(t, "t"), APPLIED_KEEP_MS, *more]
        return _Publication(gen, view, slot_views, args, version, token)

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
        if not self._opened or self._client is None:
            return None
        if self.nbytes * (1 + len(slots)) > WRITE_BATCH_BYTES:
            return None
        p = self._publication(value, version, token, slots, applied, t)
        commands = [c for b in self._write_batches(p.gen, p.view, p.slots) for c in b]
        sha = _scripts_of(self._client).publish.sha
        commands.append(("EVALSHA", sha, 1, self._meta, *p.args))

        def check(reply: Any) -> None:
            self._check_write(reply, "publish", p.version, p.token)

        return commands, check

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
        version = check_counter(version, "version")
        token = check_counter(token, "token")
        if not self.shape:
            raise InvalidArgumentError(f"variable '{self._name}' is a scalar: it has no rows")
        idx = check_indices(indices, self.shape[0])
        if idx.ndim != 1:
            raise InvalidArgumentError(f"indices must be 1-D, got shape {list(idx.shape)}")
        vals = initializers.cast_value(rows, self.dtype, "rows")
        want = (idx.size, *self.shape[1:])
        if vals.shape != want:
            raise InvalidArgumentError(
                f"rows have shape {format_shape(vals.shape)}, expected {format_shape(want)} "
                f"for {idx.size} indices of '{self._name}'"
            )
        order = np.argsort(idx, kind="stable")
        srt = idx[order]
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        if dup.size:
            raise InvalidArgumentError(
                f"indices repeat row {int(srt[dup[0]])}: publish_rows writes each row once"
            )
        blocks = [vals]
        if slot_rows is not None:
            for n, r in slot_rows.items():
                self._check_slot_name(n)
                sr = initializers.cast_value(r, self.dtype, f"rows of slot {n!r}")
                if sr.shape != want:
                    raise InvalidArgumentError(
                        f"rows of slot {n!r} have shape {format_shape(sr.shape)}, expected "
                        f"{format_shape(want)}"
                    )
                blocks.append(sr)
        staged = np.concatenate([np.ascontiguousarray(b[order], dtype=self.dtype) for b in blocks])
        client = await self._c()
        lay = self._layout
        runs = row_runs(srt, lay.seg_rows)
        stage = f"{self._prefix}s:{secrets.token_hex(8)}"
        ranges = _ranges_arg(lay, runs.starts, runs.counts, 0)
        args: list[Any] = [token, version, staged.nbytes, lay.nbytes, ranges]
        if slot_rows is not None:
            first, more = _applied_ids(applied)
            args += [",".join(slot_rows), first, check_counter(t, "t"), APPLIED_KEEP_MS, *more]

        async def attempt() -> None:
            with map_errors():
                pipe = client.commands.pipeline(transaction=False)
                pipe.set(stage, _as_bytes(staged), px=STAGE_TTL_MS)
                await pipeline_script(
                    client, pipe, _scripts_of(client).publish_rows, [self._meta, stage], args
                )
                replies = await pipe.execute()
            self._check_write(replies[-1], "publish_rows", version, token)

        await self._unless_held(client, attempt)

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
        token = check_counter(token, "token")
        client = await self._c()
        with map_errors():
            reply = await _scripts_of(client).fence(keys=[self._meta], args=[token])
        self._check_write(reply, "fence", 0, token)
        return self._count(reply[1])

    def _check_slot_name(self, name: Any) -> str:
        if not isinstance(name, str) or not _SLOT_RE.fullmatch(name):
            raise InvalidArgumentError(f"invalid slot name {name!r}: use [A-Za-z0-9_]{{1,64}}")
        return name

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
        token = check_counter(token, "token")
        views = {
            self._check_slot_name(n): _as_bytes(self._check_value(v)) for n, v in slots.items()
        }
        client = await self._c()

        async def attempt() -> None:
            gen = secrets.token_hex(8)
            await self._write(client, gen, None, views)
            args: list[Any] = [token, gen, ",".join(views), self.nbytes, self._layout.nseg]
            with map_errors():
                reply = await _scripts_of(client).init_slots(keys=[self._meta], args=args)
            self._check_write(reply, "init_slots", 0, token)

        await self._unless_held(client, attempt)

    @_typed
    async def read_state(self) -> VariableState:
        """The value, its version, the stored optimizer slots and ``t``, as one snapshot
        (the owning PS shard loads them when it starts; others may call it too).

        Raises:
            NotFoundError: the variable was deleted (its container reset).
            AbortedError: no consistent read (a writer committing faster than a read).
        """
        client = await self._c()
        fields = ("gen", "ver", "sgen", "slots", "t")
        for _ in range(FALLBACK_ATTEMPTS):
            with map_errors():
                ptr = await client.commands.hmget(self._meta, *fields)
                if ptr[0] is None:
                    raise await self._missing("gen")
                names = [n for n in _text(ptr[3]).split(",") if n]
                if names and not ptr[2]:
                    raise varcheck.field_error(self._meta, "sgen", ptr[2], "a generation id")
                pipe = client.commands.pipeline(transaction=True)
                self._queue_chunks(pipe, ptr[0])
                for n in names:
                    for seg, lo, hi in self._layout.chunks():
                        pipe.getrange(self._slot_seg(ptr[2] or "", n, seg), lo, hi)
                pipe.hmget(self._meta, *fields)
                replies = await pipe.execute()
            if replies[-1] != ptr:
                continue
            per = len(self._layout.chunks())
            where = [functools.partial(self._seg, ptr[0])]
            where += [functools.partial(self._slot_seg, ptr[2] or "", n) for n in names]
            arrays = [
                self._array(self._assembled(replies[k * per : (k + 1) * per], key))
                for k, key in enumerate(where)
            ]
            value, slots = arrays[0], dict(zip(names, arrays[1:]))
            return VariableState(value, self._count(ptr[1]), slots, self._count(ptr[4] or 0, "t"))
        raise AbortedError(f"{self._where()}: no consistent read of its state")

    # -- reads -------------------------------------------------------------------------
    @_typed
    async def version(self) -> int:
        """The published version (0 for the initial value).

        Raises:
            NotFoundError: the variable was deleted (its container reset).
        """
        client = await self._c()
        with map_errors():
            raw = await client.commands.hget(self._meta, "ver")
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
            with map_errors():
                return await self._script_value(await _scripts_of(client).read(keys=[self._meta]))
        for _ in range(READ_ATTEMPTS):
            got = await self._read_at(client, *await self._pointer(client))
            if got is not None:
                return got
        return await self._read_atomic(client)

    async def _script_value(self, reply: Any) -> VariableValue:
        """The value of a reply of the read script."""
        if _text(reply[0]) != "ok":
            raise await self._missing("gen")
        key = self._seg(reply[2], 0)
        if reply[3] is None:
            raise varcheck.short(self._where(), key)
        return VariableValue(self._array(reply[3], key), self._count(reply[1]))

    @property
    def small(self) -> bool:
        """Whether one read script returns the whole value (see :func:`read_many`)."""
        return self._layout.nseg <= 1 and self.nbytes <= varspec.CHUNK_BYTES

    def _assemble(self, parts: Sequence[bytes]) -> bytearray | None:
        """The chunks in one buffer; None if one is short (its key expired or was
        deleted meanwhile)."""
        buf = bytearray(self.nbytes)
        view = memoryview(buf)
        at = 0
        for (_, lo, hi), part in zip(self._layout.chunks(), parts, strict=True):
            if len(part) != hi - lo + 1:
                return None
            view[at : at + len(part)] = part
            at += len(part)
        return buf

    def _assembled(self, parts: Sequence[bytes], key: Callable[[int], str]) -> bytearray:
        """:meth:`_assemble` of chunks read atomically from a current generation, whose
        segment ``i`` is ``key(i)``: a short one is corrupt."""
        buf = self._assemble(parts)
        if buf is None:
            chunks = zip(self._layout.chunks(), parts, strict=True)
            seg = next(i for (i, lo, hi), part in chunks if len(part) != hi - lo + 1)
            raise varcheck.short(self._where(), key(seg))
        return buf

    _POINTER = ("gen", "ver", "prev", "pver")

    def _queue_chunks(self, pipe: Any, gen: bytes | str) -> None:
        for seg, lo, hi in self._layout.chunks():
            pipe.getrange(self._seg(gen, seg), lo, hi)

    async def _pointer(self, client: Client) -> tuple[Any, Any]:
        """The current generation and version."""
        with map_errors():
            gen, ver = await client.commands.hmget(self._meta, "gen", "ver")
        if gen is None:
            raise await self._missing("gen")
        return gen, ver

    async def _read_at(self, client: Client, gen: Any, ver: Any) -> VariableValue | None:
        """Generation ``gen`` as it was at version ``ver``, read without locks; None if a
        writer changed or removed it meanwhile."""
        if self.nbytes >= LEAN_READ_BYTES:
            done, got = await self._read_lean(client, gen, ver)
            if done:
                return got
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            self._queue_chunks(pipe, gen)
            pipe.hmget(self._meta, *self._POINTER)
            replies = await pipe.execute()
        now = replies[-1]
        if now[0] is None:
            raise await self._missing("gen")
        intact = _unchanged(now, gen, ver)
        buf = self._assemble(replies[:-1]) if intact else None
        return None if buf is None else VariableValue(self._array(buf), self._count(ver))

    async def _read_lean(
        self, client: Client, gen: Any, ver: Any
    ) -> tuple[bool, VariableValue | None]:
        """:meth:`_read_at` of a large value: every segment ``GET`` straight into its
        place in one buffer from the pool, then the pointer read again (a round trip of
        its own, after the data). ``(False, None)`` if the client has no lean
        connections (read another way then), else ``(True, what _read_at returns)``."""
        lay = self._layout
        buf = buffers.take(self.nbytes)
        targets, at = [], 0
        for i in range(lay.nseg):
            size = lay.segment_size(i)
            targets.append(buf[at : at + size])
            at += size
        lengths = await client.read_into([self._seg(gen, i) for i in range(lay.nseg)], targets)
        if lengths is None:
            return False, None
        with map_errors():
            now = await client.commands.hmget(self._meta, *self._POINTER)
        if now[0] is None:
            raise await self._missing("gen")
        intact = _unchanged(now, gen, ver)
        if not intact or any(n is None or n < 0 for n in lengths):
            return True, None
        value = np.frombuffer(buf, self.dtype).reshape(self.shape)
        return True, VariableValue(value, self._count(ver))

    async def _read_atomic(self, client: Client) -> VariableValue:
        """The fallback: learn the generation, then read it inside MULTI/EXEC."""
        for _ in range(FALLBACK_ATTEMPTS):
            with map_errors():
                gen = await client.commands.hget(self._meta, "gen")
                if gen is None:
                    raise await self._missing("gen")
                pipe = client.commands.pipeline(transaction=True)
                pipe.hmget(self._meta, *self._POINTER)
                self._queue_chunks(pipe, gen)
                replies = await pipe.execute()
            now = replies[0]
            buf: bytearray | None
            if now[0] == gen:  # current, read atomically: a short chunk is corrupt
                ver = now[1]
                buf = self._assembled(replies[1:], functools.partial(self._seg, gen))
            elif now[2] == gen:  # flipped once since: kept, untouched, at pver (or expired)
                ver = now[3]
                buf = self._assemble(replies[1:])
            elif now[0] is None:
                raise await self._missing("gen")
            else:
                continue
            if buf is not None:
                return VariableValue(self._array(buf), self._count(ver))
        raise AbortedError(
            f"{self._where()}: no consistent read in {FALLBACK_ATTEMPTS} attempts; its "
            "writer publishes faster than a read completes"
        )

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
        row_shape = self.shape[1:]
        lay = self._layout
        rb = lay.row_bytes
        flat = idx.reshape(-1)
        if flat.size == 0 or rb == 0:
            return VariableValue(np.zeros(idx.shape + row_shape, self.dtype), await self.version())
        uniq, inverse = np.unique(flat, return_inverse=True)
        runs = row_runs(uniq, lay.seg_rows, GAP_BYTES // rb)
        batches = split_runs(runs, max(1, ROWS_BATCH_BYTES // rb))
        args: list[list[Any]] = [[_ranges_arg(lay, s, c, -1)] for s, c in batches]
        script = _scripts_of(client).read_rows
        replies: list[Any] = []
        for attempt in range(READ_ATTEMPTS + 1):
            with map_errors():
                if len(args) == 1:
                    replies = [await script(keys=[self._meta], args=args[0])]
                else:
                    # the last attempt runs the batches inside MULTI/EXEC: one snapshot
                    pipe = client.commands.pipeline(transaction=attempt == READ_ATTEMPTS)
                    for a in args:
                        await pipeline_script(client, pipe, script, [self._meta], a)
                    replies = await pipe.execute()
            if any(_text(r[0]) != "ok" for r in replies):
                raise await self._missing("gen")
            if len({(r[1], r[2]) for r in replies}) == 1:
                break
        data = b"".join(part for r in replies for part in r[3:])
        if len(data) != int(runs.counts.sum()) * rb:  # a run short in its atomic read
            raise self._short_run(args, replies)
        table = np.frombuffer(data, dtype=self.dtype).reshape((-1, *row_shape))
        out = table[runs.pos[inverse.reshape(-1)]].reshape(idx.shape + row_shape)
        return VariableValue(out, self._count(replies[0][1]))

    def _short_run(self, args: list[list[Any]], replies: list[Any]) -> DataLossError:
        """The error naming the segment of the first run of ``read_rows`` that came
        back short (``args``: each script's runs, ``replies``: its replies)."""
        for (ranges,), r in zip(args, replies):
            for run, part in zip(ranges.split(","), r[3:]):
                seg, lo, hi = (int(x) for x in run.split())
                if len(part) != hi - lo + 1:
                    return varcheck.short(self._where(), self._seg(r[2], seg))
        raise AssertionError("no short run")

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
    with map_errors():
        found = [k async for k in client.commands.scan_iter(match=pattern, count=1000)]
        deleted = int(await client.commands.unlink(*found)) if found else 0
        await client.commands.srem(keys.container_variables(container), name)
    return deleted

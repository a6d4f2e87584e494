"""The writer's side of :class:`qps.variables.Variable`: its writes (create, publish,
publish rows, init slots, fence), the refusals their script ``vars/write`` replies with,
and the errors those become. Each write is plain commands that put the new bytes in
place under a TTL (no bytes through Lua), then one run of the script that checks the
fencing token and the version and commits them (``qps/lua/vars/write.lua``).
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qps import initializers
from qps.errors import DataLossError, FailedPreconditionError, InternalError, InvalidArgumentError
from qps.transport import Client, write_all
from qps.varspec import check_counter, check_indices, format_shape, ranges_arg, row_runs

if TYPE_CHECKING:
    from qps.variables import Variable

#: The script of every write; its first argument names the write.
SCRIPT = "vars/write"
#: A commit's applied-message id is forgotten after this long even if never released
#: (the PS shard releases it once the message is acknowledged).
APPLIED_KEEP_MS = 24 * 3600 * 1000
_SLOT_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
#: Data written for a publish (or staged rows) expires unless its script commits it.
STAGE_TTL_MS = 600_000
#: The previous generation stays readable this long after a flip (or until the next).
PREV_TTL_MS = 60_000
#: A write of a generation goes in pipelines of at most about this many bytes of data.
WRITE_BATCH_BYTES = 4 << 20


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
    Cluster (:mod:`qps.checkpoint`): it wrote nothing. The writes of
    :class:`~qps.variables.Variable` wait for the release and write again; only a caller
    of :meth:`~qps.variables.Variable.publish_plan` sees this (then
    :meth:`~qps.variables.Variable.publish` waits)."""

    def __init__(self, where: str, left_ms: int) -> None:
        super().__init__(f"{where} is held by a checkpoint for at most {left_ms} ms more")
        self.left_ms = left_ms


def text(x: bytes | str | None) -> str:
    if x is None:
        return ""
    return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else str(x)


def as_bytes(arr: npt.NDArray[Any]) -> memoryview:
    """The C-order bytes of a C-contiguous array, without a copy."""
    return arr.reshape(-1).view(np.uint8).data


def _applied_ids(applied: str | Sequence[str] | None) -> tuple[str, list[str]]:
    """A commit's message ids as the script takes them: the first, then the others."""
    ids = ([applied] if applied else []) if isinstance(applied, str) else list(applied or ())
    if any(not isinstance(i, str) or not i for i in ids) or len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"applied message ids must be distinct, non-empty: {ids!r}")
    return (ids[0], ids[1:]) if ids else ("", [])


def _commit_args(names: Sequence[str], applied: str | Sequence[str] | None, t: int) -> list[Any]:
    """The arguments a PS shard's commit adds to a publish: slots, ids, ``t``, keep."""
    first, more = _applied_ids(applied)
    return [",".join(names), first, check_counter(t, "t"), APPLIED_KEEP_MS, *more]


def slot_name(name: Any) -> str:
    if not isinstance(name, str) or not _SLOT_RE.fullmatch(name):
        raise InvalidArgumentError(f"invalid slot name {name!r}: use [A-Za-z0-9_]{{1,64}}")
    return name


def script_of(client: Client) -> Any:
    """The write script as the client runs it (its ``sha`` and ``source``)."""
    return client._script(SCRIPT)


async def load_publish_script(client: Client) -> None:
    """Load the commit (publish) script into the server, for a caller that runs it by
    SHA among plain commands (:meth:`~qps.variables.Variable.publish_plan`).

    Raises:
        UnavailableError: the server cannot be reached.
    """
    await client.run_commands([(b"SCRIPT", b"LOAD", script_of(client).source)])


def check_reply(
    where: str, gone: Exception, reply: Any, what: str, version: int, token: int
) -> None:
    """Raise what a refusal of the write script means (``gone``: the error for a
    deleted variable); return on ``ok``."""
    status = text(reply[0])
    if status == "ok":
        return
    said = text(reply[1]) if len(reply) > 1 else ""
    if status == "gone":
        raise gone
    if status == "stale":
        raise StaleTokenError(
            f"{where}: {what} with fencing token {token} refused, the variable has accepted "
            f"token {said} (another writer owns it); nothing changed"
        )
    if status == "version":
        raise FailedPreconditionError(
            f"{where}: {what} of version {version} refused, the published version is "
            f"{said} and versions must increase; nothing changed"
        )
    if status == "held":
        raise CheckpointHold(where, int(said))
    if status == "dup":
        raise AlreadyAppliedError(
            f"{where}: message {said} was already applied; nothing changed", said
        )
    if status == "slots":
        raise FailedPreconditionError(
            f"{where}: {what} refused, the variable's optimizer slots are [{said}]; nothing changed"
        )
    if status == "corrupt":  # the script names the key (and field)
        raise DataLossError(f"corrupt state: {where}: {said}")
    if status == "changed":
        raise FailedPreconditionError(
            f"{where} was created again with another shape ({said} bytes): open it again"
        )
    raise InternalError(f"{where}: {what} failed: {status} {text(reply[-1])}")


async def unless_held(v: Variable, client: Client, attempt: Callable[[], Awaitable[None]]) -> None:
    """Run ``attempt`` (a write whose script refuses while a checkpoint holds the
    variable) until it is not refused so: each refusal waits, blocked in Redis, for the
    checkpoint's release (or for the hold's time to run out)."""
    while True:
        try:
            await attempt()
            return
        except CheckpointHold as held:
            await client.blpop([v._prefix + "unheld"], held.left_ms / 1000 + 0.01)


# -- generations ---------------------------------------------------------------------


def write_batches(
    v: Variable, gen: str, view: memoryview | None, slots: Mapping[str, memoryview] | None
) -> list[list[tuple[Any, ...]]]:
    """The commands that write generation ``gen`` (``view``; None: zeros, and no value
    at all when ``slots`` are given) and the ``slots`` under it, with a TTL that the
    committing script removes, in batches of at most WRITE_BATCH_BYTES (one segment) of
    data. Each batch is sent as one pipeline, one after the other: the client joins a
    pipeline into one buffer, and a buffer of a whole 48 MiB commit (value + two Adam
    slots) is a fresh mmap with its page faults every time, while 4 MiB ones are reused
    from the heap. Measured: a 48 MiB commit 66-89 ms -> 27-33 ms. A segment is one SET
    (not SETRANGE chunks into a zero-filled string: 54 -> 41 ms for the 48 MiB commit)."""
    lay = v._layout
    todo: list[tuple[list[str], memoryview | None]] = []
    if view is not None or slots is None:
        todo.append(([v._seg(gen, i) for i in range(lay.nseg)], view))
    for slot, sview in (slots or {}).items():
        todo.append(([v._slot_seg(gen, slot, i) for i in range(lay.nseg)], sview))
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


async def write_then(
    v: Variable,
    client: Client,
    gen: str,
    view: memoryview | None,
    slots: Mapping[str, memoryview] | None,
    keys: Sequence[str],
    args: Sequence[Any],
) -> Any:
    """Write generation ``gen`` (:func:`write_batches`; the segments' buffers are sent as
    they are, on a lean connection where there is one), then run the write script with
    ``keys`` and ``args`` (its commit) and return its reply. On a failure of the writes
    their keys are removed (or expire); none once the script may have run (it may have
    run with its reply lost, and then these keys are the current value)."""
    batches = write_batches(v, gen, view, slots)
    names = [c[1] for b in batches for c in b if c[0] in ("PEXPIRE", "SET")]
    try:
        for batch in batches:
            await write_all(client, batch)
    except BaseException:
        with contextlib.suppress(Exception):  # they expire anyway
            await client.unlink(*names)
        raise
    return await client.run_script(SCRIPT, keys, args)


# -- the writes ----------------------------------------------------------------------


async def create(v: Variable, client: Client) -> bool:
    """Write the initial value and commit it: False if this call created the variable,
    True if another creator got there first."""
    spec, lay = v._spec, v._layout
    view = None
    if not v._init.zero_bytes:  # zeros: the server allocates them
        p = spec.partition
        value = v._init(
            spec.shape,
            spec.dtype,
            full_shape=None if p is None else p.full_shape,
            offset=None if p is None else p.offset,
        )
        view = as_bytes(np.ascontiguousarray(value, dtype=spec.dtype))
    gen = secrets.token_hex(8)
    args = ["create", spec.to_json(), gen, lay.nbytes, lay.nseg, lay.seg_bytes]
    reply = await write_then(v, client, gen, view, None, [v._meta], args)
    status = text(reply[0])
    if status != "ok" and status != "exists":
        raise InternalError(
            f"{v._where()}: its initial value vanished before it was committed "
            "(evicted or deleted by hand?)"
        )
    return status == "exists"


class Publication(NamedTuple):
    """A publish's checked inputs, its new generation and the script's arguments."""

    gen: str
    view: memoryview
    slots: dict[str, memoryview] | None
    args: list[Any]
    version: int
    token: int


def publication(
    v: Variable,
    value: Any,
    version: int,
    token: int,
    slots: Mapping[str, Any] | None,
    applied: str | Sequence[str] | None,
    t: int,
) -> Publication:
    version = check_counter(version, "version")
    token = check_counter(token, "token")
    view = as_bytes(_checked(v, value))
    slot_views = None
    if slots is not None:
        slot_views = {slot_name(n): as_bytes(_checked(v, s)) for n, s in slots.items()}
    gen = secrets.token_hex(8)
    args: list[Any] = ["publish", token, version, gen, v._layout.nseg, PREV_TTL_MS, v.nbytes]
    if slot_views is not None:
        args += _commit_args(list(slot_views), applied, t)
    return Publication(gen, view, slot_views, args, version, token)


def _checked(v: Variable, value: Any) -> npt.NDArray[Any]:
    """``value`` as a C-contiguous array of the variable's dtype and shape."""
    arr = initializers.cast_value(value, v.dtype, f"the value of '{v.name}'")
    if arr.shape != v.shape:
        raise InvalidArgumentError(
            f"variable '{v.name}' has shape {format_shape(v.shape)}, the value "
            f"{format_shape(arr.shape)}"
        )
    return np.ascontiguousarray(arr, dtype=v.dtype)


async def publish(v: Variable, client: Client, p: Publication) -> None:
    async def attempt() -> None:
        # Uncommitted keys expire (STAGE_TTL_MS); a refused flip deletes them, and the
        # next attempt writes them again.
        reply = await write_then(v, client, p.gen, p.view, p.slots, [v._meta], p.args)
        v._check_write(reply, "publish", p.version, p.token)

    await unless_held(v, client, attempt)


def publish_plan(
    v: Variable,
    value: Any,
    version: int,
    token: int,
    slots: Mapping[str, Any],
    applied: str | Sequence[str] | None,
    t: int,
) -> tuple[list[tuple[Any, ...]], Callable[[Any], None]] | None:
    if not v._opened or v._client is None:
        return None
    if v.nbytes * (1 + len(slots)) > WRITE_BATCH_BYTES:
        return None
    p = publication(v, value, version, token, slots, applied, t)
    sent = [c for b in write_batches(v, p.gen, p.view, p.slots) for c in b]
    sent.append(("EVALSHA", script_of(v._client).sha, 1, v._meta, *p.args))

    def check(reply: Any) -> None:
        v._check_write(reply, "publish", p.version, p.token)

    return sent, check


async def publish_rows(
    v: Variable,
    indices: Any,
    rows: Any,
    version: int,
    token: int,
    slot_rows: Mapping[str, Any] | None,
    applied: str | Sequence[str] | None,
    t: int,
) -> None:
    version = check_counter(version, "version")
    token = check_counter(token, "token")
    if not v.shape:
        raise InvalidArgumentError(f"variable '{v.name}' is a scalar: it has no rows")
    idx = check_indices(indices, v.shape[0])
    if idx.ndim != 1:
        raise InvalidArgumentError(f"indices must be 1-D, got shape {list(idx.shape)}")
    want = (idx.size, *v.shape[1:])
    blocks = [_rows(v, rows, "rows", want, f"for {idx.size} indices of '{v.name}'")]
    order = np.argsort(idx, kind="stable")
    srt = idx[order]
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        raise InvalidArgumentError(
            f"indices repeat row {int(srt[dup[0]])}: publish_rows writes each row once"
        )
    for n, r in (slot_rows or {}).items():
        blocks.append(_rows(v, r, f"rows of slot {slot_name(n)!r}", want, ""))
    staged = np.concatenate([np.ascontiguousarray(b[order], dtype=v.dtype) for b in blocks])
    client = await v._c()
    lay = v._layout
    runs = row_runs(srt, lay.seg_rows)
    stage = f"{v._prefix}s:{secrets.token_hex(8)}"
    ranges = ranges_arg(lay, runs.starts, runs.counts, 0)
    args: list[Any] = ["publish_rows", token, version, staged.nbytes, lay.nbytes, ranges]
    if slot_rows is not None:
        args += _commit_args(list(slot_rows), applied, t)
    put = [("SET", stage, as_bytes(staged), "PX", STAGE_TTL_MS)]

    async def attempt() -> None:
        _, reply = await client.run_commands_then_script(put, SCRIPT, [v._meta, stage], args)
        v._check_write(reply, "publish_rows", version, token)

    await unless_held(v, client, attempt)


def _rows(v: Variable, rows: Any, what: str, want: tuple[int, ...], of: str) -> npt.NDArray[Any]:
    """``rows`` as the variable's dtype, checked to be of shape ``want``."""
    arr = initializers.cast_value(rows, v.dtype, what)
    if arr.shape != want:
        raise InvalidArgumentError(
            f"{what} have shape {format_shape(arr.shape)}, expected {format_shape(want)}"
            + (f" {of}" if of else "")
        )
    return arr


async def init_slots(v: Variable, slots: Mapping[str, Any], token: int) -> None:
    token = check_counter(token, "token")
    views = {slot_name(n): as_bytes(_checked(v, s)) for n, s in slots.items()}
    client = await v._c()

    async def attempt() -> None:
        gen = secrets.token_hex(8)
        args = ["init_slots", token, gen, ",".join(views), v.nbytes, v._layout.nseg]
        reply = await write_then(v, client, gen, None, views, [v._meta], args)
        v._check_write(reply, "init_slots", 0, token)

    await unless_held(v, client, attempt)


async def fence(v: Variable, token: int) -> int:
    token = check_counter(token, "token")
    client = await v._c()
    reply = await client.run_script(SCRIPT, [v._meta], ["fence", token])
    v._check_write(reply, "fence", 0, token)
    return v._count(reply[1])

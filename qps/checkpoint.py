"""Checkpoints: a consistent snapshot of a container's PS job on disk, and its restore
(TF 1.x: ``tf.train.Saver``; see ``docs/checkpoints.md``).

A checkpoint is a directory of a manifest and NumPy ``.npz`` files (:mod:`qps.ckfiles`:
its format, writing, reading and verifying it).

**Consistency.** :func:`save` takes the snapshot in one ``MULTI``/``EXEC``: for every
variable, one script copies (server-side ``COPY``, no bytes through Lua or the network)
the segments of its current value generation and slot generation to pinned keys
``<V>ck:<id>:...`` and returns its meta (version, ``t``, token) and its applied ids;
the same transaction reads every counter (the global step, the fencing-token counter),
the PS config and the placement. Every PS commit is one script, so the snapshot is the
state of the whole job between two commits: each variable holds whole messages, value,
slots and ``t`` agree, and the global step is the one of that instant. Training is
paused only for that ``EXEC`` (an in-server copy of the model); the pinned copies are
then read at leisure, written to disk and deleted.

**On Redis Cluster** no transaction spans slots, so the same script also *holds* each
variable (a ``hold`` time in its meta): until the snapshot releases it, every write
script of the variable refuses with ``held`` and writes nothing, and the writer waits
in ``BLPOP`` on ``<V>unheld`` (:class:`qps.variables.CheckpointHold`). The scripts of
all variables run concurrently, one pipeline per node; once every variable is held the
counters, config and placement are read, then every hold is released (the waiting
commits go on). As no variable changed after its pin, the pinned copies together are
the state of the job at the instant the last hold was placed: the same guarantee as the
single server's, a shard's group commit being one script per variable on both. A saver
that dies holding variables stalls their commits for at most :data:`HOLD_MS`.

**On disk** a crash leaves either no checkpoint or a whole one; :func:`restore`
verifies every checksum and every array before it writes anything to Redis.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qps import ckfiles, initializers, keys, packing
from qps._version import __version__
from qps.ckfiles import (
    MANIFEST,
    Checkpoint,
    CheckpointInfo,
    latest,
    list_checkpoints,
    load,
    read_manifest,
)
from qps.containers import Counter, reset, scan_container_keys
from qps.errors import (
    DataLossError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from qps.session import Session
from qps.transport import Batch, Client
from qps.variables import Variable
from qps.varspec import Layout, VariableSpec, dtype_name
from qps.varwrite import text

__all__ = [
    "MANIFEST",
    "Checkpoint",
    "CheckpointInfo",
    "container_is_empty",
    "latest",
    "list_checkpoints",
    "load",
    "read_manifest",
    "restore",
    "save",
]

#: Pinned copies of a snapshot expire after this long if the saver dies before it
#: deletes them.
PIN_TTL_MS = 600_000
#: Attempts at a snapshot whose set of variables or counters changed while it was taken.
SNAPSHOT_ATTEMPTS = 5

#: How long a snapshot on Redis Cluster may hold the variables (their commits wait
#: meanwhile) if the saver dies before it releases them; a save releases them as soon as
#: it has pinned them all and read the counters (milliseconds, in-server copies).
HOLD_MS = 10_000

#: The scripts of a snapshot (qps/lua/checkpoint/): pin (and hold), release, unpin.
SNAPSHOT, RELEASE, UNPIN = "checkpoint/snapshot", "checkpoint/release", "checkpoint/unpin"


def _pairs(flat: list[Any]) -> list[tuple[str, Any]]:
    return [(text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]


def _client_and_container(obj: Any, container: str | None) -> tuple[Client, str | None]:
    if isinstance(obj, Session):
        return obj.client, container or obj.container
    if isinstance(obj, Client):
        return obj, container
    raise InvalidArgumentError(f"expected a qps.Session or a qps.Client, got {obj!r}")


# -- the snapshot ------------------------------------------------------------------------------


@dataclass
class _Snap:
    names: list[str]
    metas: dict[str, dict[str, str]]
    applied: dict[str, list[list[Any]]]
    counters: dict[str, dict[str, Any]]
    config: dict[str, str]
    placement: dict[str, int]
    time_ms: int
    pause_ms: float


async def _snapshot(client: Client, container: str, snap_id: str) -> _Snap:
    """Pin every variable's current value and slots and read everything else, as of one
    instant of the job (see the module docstring)."""
    vreg, creg = keys.container_variables(container), keys.container_counters(container)
    take = _take_held if client.cluster else _take_at_once
    for _ in range(SNAPSHOT_ATTEMPTS):
        names = sorted(text(n) for n in await client.smembers(vreg))
        counters = sorted(text(n) for n in await client.smembers(creg))
        t0 = time.perf_counter()
        try:
            replies = await take(client, container, names, counters, snap_id)
        except BaseException:
            await _unpin(client, container, names, snap_id)
            raise
        pause_ms = (time.perf_counter() - t0) * 1000
        now_names = sorted(text(n) for n in replies[0])
        now_counters = sorted(text(n) for n in replies[1])
        if now_names != names or now_counters != counters:
            await _unpin(client, container, names, snap_id)
            continue  # a variable or counter was created meanwhile: take it again
        secs, usecs = replies[2]
        snap = _Snap(
            names=[],
            metas={},
            applied={},
            counters={},
            config={text(k): text(v) for k, v in replies[3].items()},
            placement={text(k): int(v) for k, v in replies[4].items()},
            time_ms=int(secs) * 1000 + int(usecs) // 1000,
            pause_ms=pause_ms,
        )
        at = 5
        for c in counters:
            raw, applied = replies[at], replies[at + 1]
            at += 2
            if raw is not None:
                snap.counters[c] = {
                    "value": int(raw),
                    "applied": [[text(i), int(s)] for i, s in applied],
                }
        for n, reply in zip(names, replies[at:], strict=True):
            status = text(reply[0])
            if status == "gone":  # registered but deleted: not part of the job
                continue
            if status != "ok":
                await _unpin(client, container, names, snap_id)
                raise DataLossError(
                    f"variable '{container}/{n}': key {text(reply[1])} of its current "
                    "state is missing; nothing was saved"
                )
            snap.names.append(n)
            snap.metas[n] = {k: text(v) for k, v in _pairs(reply[1])}
            snap.applied[n] = [[k, int(float(text(v)))] for k, v in _pairs(reply[2])]
        return snap
    raise InternalError(
        f"container '{container}': its variables kept changing during {SNAPSHOT_ATTEMPTS} "
        "snapshot attempts"
    )


def _queue_reads(batch: Batch, container: str, counters: list[str], time: bool = True) -> Batch:
    """Queue the snapshot's reads other than the variables' (in the order
    :func:`_snapshot` takes the replies): the registries, the time (unless ``time`` is
    false: a cluster pipeline refuses TIME), the PS config and placement, every
    counter's value and applied ids."""
    batch.smembers(keys.container_variables(container))
    batch.smembers(keys.container_counters(container))
    if time:
        batch.time()
    batch.hgetall(keys.ps_config(container)).hgetall(keys.ps_placement(container))
    for c in counters:
        batch.get(keys.counter_key(container, c))
        batch.zrange(keys.counter_applied(container, c), 0, -1, withscores=True)
    return batch


async def _take_at_once(
    client: Client, container: str, names: list[str], counters: list[str], snap_id: str
) -> list[Any]:
    """A single server's snapshot: the reads and every variable's pin in one
    ``MULTI``/``EXEC``, one instant of the server (the script loaded first: inside the
    transaction it must not meet NOSCRIPT)."""
    script = client._script(SNAPSHOT)
    await client.script_load(script.source)
    batch = _queue_reads(client.batch(transaction=True), container, counters)
    for n in names:
        meta = keys.variable_meta(container, n)
        batch.command("EVALSHA", script.sha, 1, meta, snap_id, PIN_TTL_MS)
    return await batch.run()


async def _take_held(
    client: Client, container: str, names: list[str], counters: list[str], snap_id: str
) -> list[Any]:
    """A Redis Cluster's snapshot (no transaction spans slots): every variable is held
    and pinned, each by one script on its own node (all concurrently); with all of them
    held, the counters and the rest are read; then the holds are released. While a
    variable is held its commits wait, so once all are held the pinned copies are the
    job's state of that instant (see the module docstring)."""
    metas = [keys.variable_meta(container, n) for n in names]
    try:
        pinned = await _each(client, SNAPSHOT, metas, [snap_id, PIN_TTL_MS, HOLD_MS])
        for reply in pinned:
            if isinstance(reply, BaseException):
                raise reply
        registries = await _queue_reads(client.batch(), container, counters, time=False).run()
    finally:
        await _each(client, RELEASE, metas, [snap_id])  # else the holds run out
    now = await client.time()
    return [*registries[:2], now, *registries[2:], *pinned]


async def _unpin(client: Client, container: str, names: list[str], snap_id: str) -> None:
    """Delete the snapshot's pinned copies (one script per variable; any left over
    expire after PIN_TTL_MS)."""
    await _each(client, UNPIN, [keys.variable_meta(container, n) for n in names], [snap_id])


#: Scripts of :func:`_each` in flight at once.
EACH_AT_ONCE = 256


async def _each(client: Client, name: str, metas: list[str], args: list[Any]) -> list[Any]:
    """Script ``name`` run for each variable meta of ``metas`` with ``args``, all
    concurrently (they pipeline on the connection to each node); the replies, an
    exception in place of a failed one's. Every script has run or failed on return."""
    out: list[Any] = []
    for at in range(0, len(metas), EACH_AT_ONCE):
        runs = (client.run_script(name, [k], args) for k in metas[at : at + EACH_AT_ONCE])
        out += await asyncio.gather(*runs, return_exceptions=True)
    return out


async def _read_pinned(
    client: Client, prefix: str, lay: Layout, spec: VariableSpec, what: str
) -> npt.NDArray[Any]:
    """A pinned copy (``<prefix><i>`` per segment) as an array."""
    buf = bytearray(lay.nbytes)
    chunks = lay.chunks()
    if chunks:
        batch = client.batch()
        for seg, lo, hi in chunks:
            batch.getrange(f"{prefix}{seg}", lo, hi)
        parts = await batch.run()
        view = memoryview(buf)
        at = 0
        for (_, lo, hi), part in zip(chunks, parts, strict=True):
            if len(part) != hi - lo + 1:
                raise DataLossError(f"{what}: the pinned copy expired or was deleted")
            view[at : at + len(part)] = part
            at += len(part)
    return np.frombuffer(buf, dtype=spec.dtype).reshape(spec.shape)


async def save(
    session_or_client: Session | Client,
    directory: str | os.PathLike[str],
    *,
    container: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CheckpointInfo:
    """Save a consistent snapshot of the container's variables, optimizer slots,
    applied-message ids, counters (global step included), PS config and placement to
    ``directory``, which must not exist yet (``{step}`` in its name is replaced by the
    global step). Training goes on meanwhile; it pauses only for one ``MULTI``/``EXEC``
    (on Redis Cluster: while every variable is held, one round trip per node and back).

    Args:
        session_or_client: a :class:`qps.Session` (its container is the default) or a
            :class:`qps.Client` (default container ``"default"``).
        directory: the checkpoint directory to create.
        container: the container to save.
        progress: called with (variables read, variables) after each one is read.

    Raises:
        FailedPreconditionError: ``directory`` exists already.
        NotFoundError: the container holds no variables.
        DataLossError: a variable's stored state is incomplete (nothing is written).
    """
    client, cont = _client_and_container(session_or_client, container)
    cont = keys.check_container(cont or keys.DEFAULT_CONTAINER)
    snap_id = secrets.token_hex(8)
    snap = await _snapshot(client, cont, snap_id)
    try:
        if not snap.names:
            raise NotFoundError(f"container '{cont}' holds no variables: nothing to save")
        num_shards = int(snap.config.get("num_shards", 0) or 0)
        gs = int(snap.counters.get(keys.GLOBAL_STEP, {}).get("value", 0))
        target = Path(os.fspath(directory).replace("{step}", str(gs)))
        if target.exists():
            raise FailedPreconditionError(f"checkpoint directory {target} exists already")
        files: dict[str, dict[str, npt.NDArray[Any]]] = {}
        variables: dict[str, Any] = {}
        partitioned: dict[str, Any] = {}
        total = 0
        for n in snap.names:
            meta = snap.metas[n]
            spec = VariableSpec.from_json(meta["spec"])
            lay = Layout.of(spec, int(meta["segb"]))
            if lay.nbytes != int(meta["nbytes"]) or lay.nseg != int(meta["nseg"]):
                raise DataLossError(f"variable '{cont}/{n}': its meta disagrees with its spec")
            pin = keys.variable_checkpoint_prefix(cont, n, snap_id)
            value = await _read_pinned(client, pin + "d:", lay, spec, f"variable '{n}'")
            slot_names = [s for s in meta.get("slots", "").split(",") if s]
            shard = snap.placement.get(n)
            fname = ckfiles.data_file(shard, num_shards)
            arrays = files.setdefault(fname, {})
            stored, raw = ckfiles.storable(value)
            vkey = f"a{len(arrays)}"
            arrays[vkey] = stored
            slot_keys = {}
            for s in slot_names:
                arr = await _read_pinned(
                    client, f"{pin}o:{s}:", lay, spec, f"slot '{s}' of variable '{n}'"
                )
                skey = f"a{len(arrays)}"
                arrays[skey] = ckfiles.storable(arr)[0]
                slot_keys[s] = skey
            total += spec.nbytes
            variables[n] = {
                "spec": json.loads(meta["spec"]),
                "dtype": dtype_name(spec.dtype),
                "shape": list(spec.shape),
                "nbytes": spec.nbytes,
                "version": int(meta["ver"]),
                "t": int(meta.get("t") or 0),
                "token": int(meta.get("token") or 0),
                "shard": shard,
                "file": fname,
                "value": vkey,
                "slots": slot_keys,
                "raw": raw,
                "applied": snap.applied[n],
            }
            if spec.partition is not None:
                p = spec.partition
                entry = partitioned.setdefault(
                    p.full_name,
                    {"full_shape": list(p.full_shape), "axis": p.axis, "parts": [None] * p.count},
                )
                entry["parts"][p.index] = n
            if progress is not None:
                progress(len(variables), len(snap.names))
        # a packed model's layout (the names of the parameters its parts hold): only
        # when every part it names is saved
        layout = await packing.read_layout(client, cont)
        if layout is not None and not {part for part, _ in layout.parts} <= set(variables):
            layout = None
        manifest: dict[str, Any] = {
            "format": ckfiles.FORMAT,
            "format_version": ckfiles.FORMAT_VERSION,
            "qps_version": __version__,
            "created_ms": snap.time_ms,
            "created": ckfiles.iso(snap.time_ms),
            "container": cont,
            "global_step": gs,
            "snapshot_pause_ms": round(snap.pause_ms, 3),
            "num_shards": num_shards or None,
            "config": snap.config,
            "placement": snap.placement,
            "counters": snap.counters,
            "variables": variables,
            "partitioned": partitioned,
            "packed": None if layout is None else json.loads(layout.to_json()),
            "files": {},
        }
        ckfiles.write_dir(target, files, manifest)
    finally:
        await _unpin(client, cont, snap.names, snap_id)
    return ckfiles.checkpoint_info(target, manifest)


# -- restore ---------------------------------------------------------------------------------


async def container_is_empty(client: Client, container: str) -> bool:
    """Whether ``container`` owns no key."""
    async for _ in scan_container_keys(client, container):
        return False
    return True


async def restore(
    session_or_client: Session | Client,
    directory: str | os.PathLike[str],
    *,
    container: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> CheckpointInfo:
    """Restore checkpoint ``directory`` into a container: variables (value, version,
    slots, ``t``, applied ids), counters (global step, fencing tokens), the PS config
    and the placement. Start the PS shards afterwards; they load the restored state.

    The checkpoint is verified (:func:`load`) before anything is written. The target
    container must own no key, unless ``overwrite`` (then it is reset first: its queues,
    including gradients not yet applied, are lost).

    Args:
        session_or_client: a :class:`qps.Session` (its container is the default) or a
            :class:`qps.Client` (default: the container the checkpoint was taken from).
        directory: the checkpoint.
        container: the target container.
        overwrite: reset a non-empty target container first.
        progress: called with (variables restored, variables) after each one.

    Raises:
        NotFoundError: no checkpoint there.
        DataLossError: a corrupt checkpoint (nothing was written).
        FailedPreconditionError: the container is not empty and ``overwrite`` is False
            (nothing was written).
    """
    ck = ckfiles.load(directory)
    m = ck.manifest
    packed = None
    if m.get("packed") is not None:  # checkpoints from before qps 0.x have none
        try:
            packed = packing.PackLayout.from_json(json.dumps(m["packed"]))
        except InvalidArgumentError as exc:
            raise DataLossError(f"checkpoint {ck.info.path}: its packed layout: {exc}") from None
    client, cont = _client_and_container(session_or_client, container)
    cont = keys.check_container(cont or m["container"])
    if not await container_is_empty(client, cont):
        if not overwrite:
            raise FailedPreconditionError(
                f"container '{cont}' is not empty: restoring checkpoint {ck.info.path} into "
                "it would mix two jobs; reset it first (or pass overwrite=True / --yes)"
            )
        await reset(client, [cont])
    max_token = done = 0
    for n, v in m["variables"].items():
        spec = VariableSpec.from_json(json.dumps(v["spec"]))
        max_token = max(max_token, int(v["token"]))
        await _restore_variable(client, cont, n, spec, v, ck.values[n], ck.slots[n])
        if progress is not None:
            progress(done := done + 1, len(m["variables"]))
    for c, cv in m["counters"].items():
        value = int(cv["value"])
        if c == keys.PS_TOKEN_COUNTER:
            value = max(value, max_token)  # new shards' tokens exceed the restored ones
        counter = Counter(c, container=cont, client=client, initial=value)
        await counter.set(value)
        if cv["applied"]:
            await client.zadd(keys.counter_applied(cont, c), {i: s for i, s in cv["applied"]})
    batch = client.batch().set(keys.registration(cont), 1, nx=True)
    if m["placement"]:
        batch.hset(keys.ps_placement(cont), m["placement"])
    if m["config"]:
        batch.hset(keys.ps_config(cont), m["config"])
    if packed is not None:
        batch.set(keys.packed_layout(cont), packed.to_json())
    await batch.run()
    return ck.info


class _Restored(initializers.Initializer):
    """The saved value of one variable (a partition's own slice, not the whole), under
    the initializer spec the variable was created with, so the restored spec is the
    saved one."""

    def __init__(self, value: npt.NDArray[Any], spec: dict[str, Any] | None) -> None:
        self.value = value
        self._spec = spec or {"kind": "array"}

    def _make(self, shape: Any, dtype: np.dtype[Any], full: Any, offset: Any) -> npt.NDArray[Any]:
        out: npt.NDArray[Any] = np.asarray(self.value, dtype=dtype).reshape(shape)
        return out

    def spec(self) -> dict[str, Any]:
        return dict(self._spec)


class _RestoredLater(_Restored):
    """Zeros at creation (the server allocates them); the value comes with the first
    publish."""

    zero_bytes = True


async def _restore_variable(
    client: Client,
    container: str,
    name: str,
    spec: VariableSpec,
    v: dict[str, Any],
    value: npt.NDArray[Any],
    slots: dict[str, npt.NDArray[Any]],
) -> None:
    token, version = int(v["token"]), int(v["version"])
    # version 0: created with its value; later versions: created as zeros, then
    # published at their version with slots and t, in one commit as a PS shard makes
    init = (_RestoredLater if version > 0 else _Restored)(value, spec.initializer)
    var = Variable(
        name,
        spec.shape,
        spec.dtype,
        initializer=init,
        trainable=spec.trainable,
        container=container,
        client=client,
        partition=spec.partition,
    )
    await var.create()
    if slots:
        await var.init_slots(slots, token)
    if version > 0:
        if slots:
            await var.publish(value, version, token, slots=slots, applied="", t=int(v["t"]))
        else:
            await var.publish(value, version, token)
    else:
        await var.fence(token)
        if int(v["t"]):
            await client.hset(keys.variable_meta(container, name), "t", int(v["t"]))
    if v["applied"]:
        await client.zadd(keys.variable_applied(container, name), {i: s for i, s in v["applied"]})


def _source(name: str) -> str:
    return (resources.files("qps") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


#: The pin and release scripts' sources, for tests that run them by hand (``EVAL``).
_SNAPSHOT, _RELEASE = _source(SNAPSHOT), _source(RELEASE)

"""Checkpoints: a consistent snapshot of a container's PS job on disk, and its restore
(TF 1.x: ``tf.train.Saver``; see ``docs/checkpoints.md``).

A checkpoint is a directory::

    manifest.json                 what is stored: specs, versions, shard map, counters,
                                  the PS config, a sha256 per data file
    shard-00000-of-00002.npz      the values and optimizer slots of the variables placed
    shard-00001-of-00002.npz      on each shard (NumPy .npz, loaded with allow_pickle=False)
    unplaced.npz                  variables placed on no shard (if any)

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

**On disk** the checkpoint is written to a temporary directory next to the target,
every file fsynced, then renamed into place: a crash leaves either no checkpoint or a
whole one. :func:`restore` verifies every checksum and every array before it writes
anything to Redis.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import secrets
import shutil
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qps import initializers, keys, packing
from qps._version import __version__
from qps.containers import Counter, reset, scan_container_keys
from qps.errors import (
    DataLossError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from qps.session import Session
from qps.transport import Client, map_errors, pipeline_script
from qps.variables import Variable
from qps.varspec import Layout, VariableSpec, dtype_name

__all__ = [
    "MANIFEST",
    "Checkpoint",
    "CheckpointInfo",
    "container_is_empty",
    "latest",
    "list_checkpoints",
    "load",
    "restore",
    "save",
]

#: The manifest's file name inside a checkpoint directory.
MANIFEST = "manifest.json"
FORMAT = "qps-checkpoint"
FORMAT_VERSION = 1
#: Pinned copies of a snapshot expire after this long if the saver dies before it
#: deletes them.
PIN_TTL_MS = 600_000
#: Attempts at a snapshot whose set of variables or counters changed while it was taken.
SNAPSHOT_ATTEMPTS = 5

#: How long a snapshot on Redis Cluster may hold the variables (their commits wait
#: meanwhile) if the saver dies before it releases them; a save releases them as soon as
#: it has pinned them all and read the counters (milliseconds, in-server copies).
HOLD_MS = 10_000

# KEYS[1]: a variable's meta. ARGV: snapshot id, TTL of the pinned copies (ms)[, hold
# (ms)]. Copies the segments of the current value generation and of the current slot
# generation to P ck:<id>:d:<i> and P ck:<id>:o:<slot>:<i> (same hash tag: same slot),
# and returns the meta hash and the applied ids, all as of this instant. With a hold
# (a snapshot on Redis Cluster), the variable's writes are refused ('held', see
# qps.variables) until _RELEASE or for that long.
_SNAPSHOT = """
local P = string.sub(KEYS[1], 1, -5)
if ARGV[3] and redis.call('EXISTS', KEYS[1]) == 1 then
  local t = redis.call('TIME')
  local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'hold', string.format('%.0f', until_ms), 'hold_by', ARGV[1])
  redis.call('DEL', P .. 'unheld')
end
local m = redis.call('HGETALL', KEYS[1])
if #m == 0 then return {'gone'} end
local f = {}
for i = 1, #m, 2 do f[m[i]] = m[i + 1] end
local nseg = tonumber(f['nseg'])
local pin = P .. 'ck:' .. ARGV[1] .. ':'
local function copy(src, dst)
  if redis.call('COPY', src, dst, 'REPLACE') == 0 then return false end
  redis.call('PEXPIRE', dst, ARGV[2])
  return true
end
for i = 0, nseg - 1 do
  if not copy(P .. 'd:' .. f['gen'] .. ':' .. i, pin .. 'd:' .. i) then
    return {'missing', 'd:' .. f['gen'] .. ':' .. i}
  end
end
if f['slots'] and f['slots'] ~= '' then
  for s in string.gmatch(f['slots'], '[^,]+') do
    for i = 0, nseg - 1 do
      if not copy(P .. 'o:' .. f['sgen'] .. ':' .. s .. ':' .. i, pin .. 'o:' .. s .. ':' .. i) then
        return {'missing', 'o:' .. f['sgen'] .. ':' .. s .. ':' .. i}
      end
    end
  end
end
return {'ok', m, redis.call('ZRANGE', P .. 'applied', 0, -1, 'WITHSCORES')}
"""

# KEYS[1]: a variable's meta. ARGV: snapshot id. Ends the snapshot's hold (not another
# snapshot's) and wakes the writers waiting for it (BLPOP on P unheld).
_RELEASE = """
local P = string.sub(KEYS[1], 1, -5)
if redis.call('HGET', KEYS[1], 'hold_by') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'hold', 'hold_by')
redis.call('RPUSH', P .. 'unheld', '1')
redis.call('PEXPIRE', P .. 'unheld', 60000)
return 1
"""

# KEYS[1]: a variable's meta. ARGV: snapshot id. Deletes the snapshot's pinned copies
# of the variable (as many segments and slots as it has now; any others expire).
_UNPIN = """
local pin = string.sub(KEYS[1], 1, -5) .. 'ck:' .. ARGV[1] .. ':'
local m = redis.call('HMGET', KEYS[1], 'nseg', 'slots')
local n = tonumber(m[1] or '0')
for i = 0, n - 1 do redis.call('UNLINK', pin .. 'd:' .. i) end
for s in string.gmatch(m[2] or '', '[^,]+') do
  for i = 0, n - 1 do redis.call('UNLINK', pin .. 'o:' .. s .. ':' .. i) end
end
return 1
"""


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, (bytes, bytearray)) else str(x)


def _pairs(flat: list[Any]) -> list[tuple[str, Any]]:
    return [(_text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]


def _client_and_container(obj: Any, container: str | None) -> tuple[Client, str | None]:
    if isinstance(obj, Session):
        return obj.client, container or obj.container
    if isinstance(obj, Client):
        return obj, container
    raise InvalidArgumentError(f"expected a qps.Session or a qps.Client, got {obj!r}")


# -- what a checkpoint holds --------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory, from its manifest (what ``qps checkpoint ls`` shows).

    Attributes:
        path: the directory.
        container: the container it was taken from.
        global_step: the global step at the snapshot.
        created_ms: when the snapshot was taken (the server's clock, ms).
        variables: how many variables it holds; ``nbytes``: their value bytes.
        manifest: the whole manifest.
    """

    path: Path
    container: str
    global_step: int
    created_ms: int
    variables: int
    nbytes: int
    manifest: dict[str, Any] = field(repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "container": self.container,
            "global_step": self.global_step,
            "created_ms": self.created_ms,
            "created": _iso(self.created_ms),
            "variables": self.variables,
            "nbytes": self.nbytes,
            "qps_version": self.manifest.get("qps_version"),
        }


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint: the manifest and every array.

    Attributes:
        info: what :func:`list_checkpoints` shows.
        values: variable name -> value.
        slots: variable name -> {slot name -> array}.
    """

    info: CheckpointInfo
    values: dict[str, npt.NDArray[Any]]
    slots: dict[str, dict[str, npt.NDArray[Any]]]

    @property
    def manifest(self) -> dict[str, Any]:
        return self.info.manifest


def _iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).isoformat(
        timespec="milliseconds"
    )


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
        with map_errors():
            names = sorted(_text(n) for n in await client.commands.smembers(vreg))
            counters = sorted(_text(n) for n in await client.commands.smembers(creg))
        t0 = time.perf_counter()
        try:
            replies = await take(client, container, names, counters, snap_id)
        except BaseException:
            await _unpin(client, container, names, snap_id)
            raise
        pause_ms = (time.perf_counter() - t0) * 1000
        now_names = sorted(_text(n) for n in replies[0])
        now_counters = sorted(_text(n) for n in replies[1])
        if now_names != names or now_counters != counters:
            await _unpin(client, container, names, snap_id)
            continue  # a variable or counter was created meanwhile: take it again
        secs, usecs = replies[2]
        snap = _Snap(
            names=[],
            metas={},
            applied={},
            counters={},
            config={_text(k): _text(v) for k, v in replies[3].items()},
            placement={_text(k): int(v) for k, v in replies[4].items()},
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
                    "applied": [[_text(i), int(s)] for i, s in applied],
                }
        for n, reply in zip(names, replies[at:], strict=True):
            status = _text(reply[0])
            if status == "gone":  # registered but deleted: not part of the job
                continue
            if status != "ok":
                await _unpin(client, container, names, snap_id)
                raise DataLossError(
                    f"variable '{container}/{n}': key {_text(reply[1])} of its current "
                    "state is missing; nothing was saved"
                )
            snap.names.append(n)
            snap.metas[n] = {k: _text(v) for k, v in _pairs(reply[1])}
            snap.applied[n] = [[k, int(float(_text(v)))] for k, v in _pairs(reply[2])]
        return snap
    raise InternalError(
        f"container '{container}': its variables kept changing during {SNAPSHOT_ATTEMPTS} "
        "snapshot attempts"
    )


def _queue_reads(pipe: Any, container: str, counters: list[str], time: bool = True) -> None:
    """Queue the snapshot's reads other than the variables' (in the order
    :func:`_snapshot` takes the replies): the registries, the time (unless ``time`` is
    false: a cluster pipeline refuses TIME), the PS config and placement, every
    counter's value and applied ids."""
    pipe.smembers(keys.container_variables(container))
    pipe.smembers(keys.container_counters(container))
    if time:
        pipe.time()
    pipe.hgetall(keys.ps_config(container))
    pipe.hgetall(keys.ps_placement(container))
    for c in counters:
        pipe.get(keys.counter_key(container, c))
        pipe.zrange(keys.counter_applied(container, c), 0, -1, withscores=True)


async def _take_at_once(
    client: Client, container: str, names: list[str], counters: list[str], snap_id: str
) -> list[Any]:
    """A single server's snapshot: the reads and every variable's pin in one
    ``MULTI``/``EXEC``, one instant of the server."""
    script = client.commands.register_script(_SNAPSHOT)
    with map_errors():
        pipe = client.commands.pipeline(transaction=True)
        _queue_reads(pipe, container, counters)
        for n in names:
            await script(
                keys=[keys.variable_meta(container, n)],
                args=[snap_id, PIN_TTL_MS],
                client=pipe,
            )
        return list(await pipe.execute())


async def _take_held(
    client: Client, container: str, names: list[str], counters: list[str], snap_id: str
) -> list[Any]:
    """A Redis Cluster's snapshot (no transaction spans slots): every variable is held
    and pinned, each by one script on its own node (all concurrently); with all of them
    held, the counters and the rest are read; then the holds are released. While a
    variable is held its commits wait, so once all are held the pinned copies are the
    job's state of that instant (see the module docstring)."""
    meta = [keys.variable_meta(container, n) for n in names]
    hold = client.commands.register_script(_SNAPSHOT)
    release = client.commands.register_script(_RELEASE)
    try:
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            for k in meta:
                await pipeline_script(client, pipe, hold, [k], [snap_id, PIN_TTL_MS, HOLD_MS])
            pinned = await pipe.execute()
            pipe = client.commands.pipeline(transaction=False)
            _queue_reads(pipe, container, counters, time=False)
            registries = await pipe.execute()
    finally:
        with contextlib.suppress(Exception), map_errors():  # else the holds run out
            pipe = client.commands.pipeline(transaction=False)
            for k in meta:
                await pipeline_script(client, pipe, release, [k], [snap_id])
            await pipe.execute()
    with map_errors():
        now = await client.commands.time()
    return [*registries[:2], now, *registries[2:], *pinned]


async def _unpin(client: Client, container: str, names: list[str], snap_id: str) -> None:
    """Delete the snapshot's pinned copies (one script per variable, all in one
    pipeline; any left over expire after PIN_TTL_MS)."""
    if not names:
        return
    script = client.commands.register_script(_UNPIN)
    with contextlib.suppress(Exception), map_errors():
        pipe = client.commands.pipeline(transaction=False)
        for n in names:
            k = keys.variable_meta(container, n)
            await pipeline_script(client, pipe, script, [k], [snap_id])
        await pipe.execute()


async def _read_pinned(
    client: Client, prefix: str, lay: Layout, spec: VariableSpec, what: str
) -> npt.NDArray[Any]:
    """A pinned copy (``<prefix><i>`` per segment) as an array."""
    buf = bytearray(lay.nbytes)
    chunks = lay.chunks()
    if chunks:
        with map_errors():
            pipe = client.commands.pipeline(transaction=False)
            for seg, lo, hi in chunks:
                pipe.getrange(f"{prefix}{seg}", lo, hi)
            parts = await pipe.execute()
        view = memoryview(buf)
        at = 0
        for (_, lo, hi), part in zip(chunks, parts, strict=True):
            if len(part) != hi - lo + 1:
                raise DataLossError(f"{what}: the pinned copy expired or was deleted")
            view[at : at + len(part)] = part
            at += len(part)
    return np.frombuffer(buf, dtype=spec.dtype).reshape(spec.shape)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _storable(arr: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], bool]:
    """The array as .npz stores it without pickle: dtypes NumPy does not know by
    itself (bfloat16 from ml_dtypes) as their raw bytes (``raw=True``)."""
    if arr.dtype.kind == "V" or arr.dtype.hasobject:
        return arr.copy(order="C").reshape(-1).view(np.uint8), True
    return arr if arr.flags.c_contiguous else arr.copy(order="C"), False


def _data_file(shard: int | None, num_shards: int) -> str:
    if shard is None:
        return "unplaced.npz"
    return f"shard-{shard:05d}-of-{num_shards:05d}.npz"


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
            fname = _data_file(shard, num_shards)
            arrays = files.setdefault(fname, {})
            stored, raw = _storable(value)
            vkey = f"a{len(arrays)}"
            arrays[vkey] = stored
            slot_keys = {}
            for s in slot_names:
                arr = await _read_pinned(
                    client, f"{pin}o:{s}:", lay, spec, f"slot '{s}' of variable '{n}'"
                )
                skey = f"a{len(arrays)}"
                arrays[skey] = _storable(arr)[0]
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
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "qps_version": __version__,
            "created_ms": snap.time_ms,
            "created": _iso(snap.time_ms),
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
        _write_dir(target, files, manifest)
    finally:
        await _unpin(client, cont, snap.names, snap_id)
    return _info(target, manifest)


def _write_dir(
    target: Path, files: Mapping[str, Mapping[str, npt.NDArray[Any]]], manifest: dict[str, Any]
) -> None:
    """Write the files to a temporary directory beside ``target``, fsync them, then
    rename it to ``target``: a crash leaves no checkpoint or a whole one."""
    parent = target.parent if str(target.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{target.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        for fname, arrays in files.items():
            path = tmp / fname
            with open(path, "wb") as f:
                np.savez(f, **arrays)  # type: ignore[arg-type]
                f.flush()
                os.fsync(f.fileno())
            manifest["files"][fname] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
        mpath = tmp / MANIFEST
        with open(mpath, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if target.exists():
            raise FailedPreconditionError(f"checkpoint directory {target} exists already")
        os.rename(tmp, target)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- reading -----------------------------------------------------------------------------------


def _info(path: Path, m: dict[str, Any]) -> CheckpointInfo:
    try:
        return CheckpointInfo(
            path=path,
            container=str(m["container"]),
            global_step=int(m["global_step"]),
            created_ms=int(m["created_ms"]),
            variables=len(m["variables"]),
            nbytes=sum(int(v["nbytes"]) for v in m["variables"].values()),
            manifest=m,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLossError(f"checkpoint {path}: bad manifest: {exc!r}") from exc


def read_manifest(directory: str | os.PathLike[str]) -> CheckpointInfo:
    """The manifest of checkpoint ``directory`` (no data file is read).

    Raises:
        NotFoundError: no checkpoint there (no manifest).
        DataLossError: a manifest that is not JSON or not a qps checkpoint's.
    """
    path = Path(directory)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise NotFoundError(f"no checkpoint at {path} (no {MANIFEST})")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataLossError(f"checkpoint {path}: unreadable manifest: {exc}") from exc
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataLossError(f"checkpoint {path}: {MANIFEST} is not a qps checkpoint manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise DataLossError(
            f"checkpoint {path}: format version {m.get('format_version')!r} is not known "
            f"to qps {__version__} (it reads {FORMAT_VERSION})"
        )
    return _info(path, m)


def load(directory: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify checkpoint ``directory``: every data file's sha256, and every
    array's presence, shape and dtype against the manifest (TF:
    ``tf.train.load_checkpoint``). Nothing is unpickled.

    Raises:
        NotFoundError: no checkpoint there.
        DataLossError: a missing or corrupt file, a checksum mismatch, or an array
            that disagrees with the manifest.
    """
    info = read_manifest(directory)
    m = info.manifest
    path = info.path
    opened: dict[str, Any] = {}
    try:
        for fname, meta in m["files"].items():
            if "/" in fname or fname.startswith("."):
                raise DataLossError(f"checkpoint {path}: bad file name {fname!r} in the manifest")
            fpath = path / fname
            if not fpath.is_file():
                raise DataLossError(f"checkpoint {path}: data file {fname} is missing")
            digest = _sha256(fpath)
            if digest != meta["sha256"]:
                raise DataLossError(
                    f"checkpoint {path}: data file {fname} is corrupt (sha256 {digest[:16]}..., "
                    f"the manifest says {str(meta['sha256'])[:16]}...); nothing was restored"
                )
            try:
                opened[fname] = np.load(fpath, allow_pickle=False)
            except (OSError, ValueError, zipfile.BadZipFile) as exc:
                raise DataLossError(f"checkpoint {path}: data file {fname}: {exc}") from exc
        values: dict[str, npt.NDArray[Any]] = {}
        slots: dict[str, dict[str, npt.NDArray[Any]]] = {}
        for n, v in m["variables"].items():
            spec = VariableSpec.from_json(json.dumps(v["spec"]))
            npz = opened.get(v["file"])
            if npz is None:
                raise DataLossError(f"checkpoint {path}: variable '{n}': no file {v['file']}")

            def get(
                key: str,
                what: str,
                npz: Any = npz,
                spec: VariableSpec = spec,
                raw: bool = bool(v.get("raw")),
            ) -> Any:
                try:
                    arr = npz[key]
                except (KeyError, ValueError, OSError, zipfile.BadZipFile) as exc:
                    raise DataLossError(f"checkpoint {path}: {what}: {exc!r}") from exc
                if raw:
                    if arr.dtype != np.uint8 or arr.size != spec.nbytes:
                        raise DataLossError(f"checkpoint {path}: {what}: wrong raw size")
                    return arr.view(spec.dtype).reshape(spec.shape)
                if arr.shape != spec.shape or arr.dtype != spec.dtype:
                    raise DataLossError(
                        f"checkpoint {path}: {what} is {arr.dtype} {list(arr.shape)}, the "
                        f"manifest says {dtype_name(spec.dtype)} {list(spec.shape)}"
                    )
                return arr

            values[n] = get(v["value"], f"variable '{n}'")
            slots[n] = {s: get(k, f"slot '{s}' of '{n}'") for s, k in v["slots"].items()}
            int(v["token"]), int(v["version"])  # what restore reads, checked before it writes
            if slots[n] and int(v["version"]) > 0:
                int(v["t"])
        for cv in m["counters"].values():
            int(cv["value"]), list(cv["applied"] or [])
        dict(m["placement"] or {}), dict(m["config"] or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLossError(f"checkpoint {path}: bad manifest: {exc!r}") from exc
    finally:
        for f in opened.values():
            f.close()
    return Checkpoint(info, values, slots)


def list_checkpoints(root: str | os.PathLike[str] = ".") -> list[CheckpointInfo]:
    """The checkpoints directly under ``root`` (and ``root`` itself, if it is one),
    oldest first (by global step, then time). Directories whose manifest cannot be
    read are left out.

    Raises:
        NotFoundError: ``root`` is not a directory.
    """
    base = Path(root)
    if not base.is_dir():
        raise NotFoundError(f"no directory {base}")
    found = []
    for d in [base, *sorted(p for p in base.iterdir() if p.is_dir())]:
        if d.name.startswith("."):  # a save in progress, or a hidden directory
            continue
        if (d / MANIFEST).is_file():
            with contextlib.suppress(DataLossError, NotFoundError):
                found.append(read_manifest(d))
    return sorted(found, key=lambda i: (i.global_step, i.created_ms, str(i.path)))


def latest(root: str | os.PathLike[str] = ".") -> Path | None:
    """The newest checkpoint under ``root`` (highest global step, then time), or None
    (TF: ``tf.train.latest_checkpoint``)."""
    found = list_checkpoints(root)
    return found[-1].path if found else None


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
    ck = load(directory)
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
            with map_errors():
                await client.commands.zadd(
                    keys.counter_applied(cont, c), {i: s for i, s in cv["applied"]}
                )
    with map_errors():
        pipe = client.commands.pipeline(transaction=False)
        pipe.set(keys.registration(cont), 1, nx=True)
        if m["placement"]:
            pipe.hset(keys.ps_placement(cont), mapping=dict(m["placement"]))
        if m["config"]:
            pipe.hset(keys.ps_config(cont), mapping=dict(m["config"]))
        if packed is not None:
            pipe.set(keys.packed_layout(cont), packed.to_json())
        await pipe.execute()
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
            with map_errors():
                await client.commands.hset(keys.variable_meta(container, name), "t", int(v["t"]))
    if v["applied"]:
        with map_errors():
            await client.commands.zadd(
                keys.variable_applied(container, name), {i: s for i, s in v["applied"]}
            )

"""The checkpoint directory (see :mod:`qps.checkpoint` and ``docs/checkpoints.md``)::

    manifest.json                 what is stored: specs, versions, shard map, counters,
                                  the PS config, a sha256 per data file
    shard-00000-of-00002.npz      the values and optimizer slots of the variables placed
    shard-00001-of-00002.npz      on each shard (NumPy .npz, loaded with allow_pickle=False)
    unplaced.npz                  variables placed on no shard (if any)

It is written to a temporary directory next to the target, every file fsynced, then
renamed into place: a crash leaves either no checkpoint or a whole one. :func:`load`
verifies every checksum and every array against the manifest; nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import secrets
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qps._version import __version__
from qps.errors import DataLossError, FailedPreconditionError, NotFoundError
from qps.varspec import VariableSpec, dtype_name

#: The manifest's file name inside a checkpoint directory.
MANIFEST = "manifest.json"
FORMAT = "qps-checkpoint"
FORMAT_VERSION = 1


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
            "created": iso(self.created_ms),
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


def iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).isoformat(
        timespec="milliseconds"
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def storable(arr: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], bool]:
    """The array as .npz stores it without pickle: dtypes NumPy does not know by
    itself (bfloat16 from ml_dtypes) as their raw bytes (``raw=True``)."""
    if arr.dtype.kind == "V" or arr.dtype.hasobject:
        return arr.copy(order="C").reshape(-1).view(np.uint8), True
    return arr if arr.flags.c_contiguous else arr.copy(order="C"), False


def data_file(shard: int | None, num_shards: int) -> str:
    if shard is None:
        return "unplaced.npz"
    return f"shard-{shard:05d}-of-{num_shards:05d}.npz"


def write_dir(
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
            manifest["files"][fname] = {"sha256": sha256(path), "bytes": path.stat().st_size}
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


def checkpoint_info(path: Path, m: dict[str, Any]) -> CheckpointInfo:
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
    return checkpoint_info(path, m)


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
            digest = sha256(fpath)
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

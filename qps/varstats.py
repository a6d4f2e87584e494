"""Inspecting variables without changing them: :func:`list_variables` and
:func:`variable_stats` (what ``qps var ls`` and ``qps var stat`` show), re-exported by
:mod:`qps.variables`. The stored state is checked as a read checks it
(:mod:`qps.varcheck`), and every segment of the current generation is measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qps import keys, varcheck
from qps.errors import DataLossError, NotFoundError
from qps.transport import Client
from qps.varspec import VariableSpec, dtype_name

__all__ = ["VariableStats", "list_variables", "variable_stats"]


def _text(x: bytes | str | None) -> str:
    if x is None:
        return ""
    return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else str(x)


@dataclass(frozen=True)
class VariableStats:
    """What is stored for one variable, read without changing it.

    Attributes:
        name, container: where it is.
        spec: the stored :class:`~qps.varspec.VariableSpec`.
        version: the published version; ``token``: the highest fencing token accepted.
        generation: the id of the current generation; ``previous``: the previous one
            while it is still kept ("" if none), at ``previous_version``.
        segments: data keys per generation.
        publishes, row_publishes: committed publish / publish_rows calls.
        created_ms, updated_ms: server times (ms) of the creation and the last write.
        memory_bytes: ``MEMORY USAGE`` of meta and the kept generations' keys, or None
            where the server lacks it (fakeredis) or it was not asked for.
    """

    name: str
    container: str
    spec: VariableSpec
    version: int
    token: int
    generation: str
    previous: str
    previous_version: int | None
    segments: int
    publishes: int
    row_publishes: int
    created_ms: int
    updated_ms: int
    memory_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "name": self.name,
            "container": self.container,
            "dtype": dtype_name(s.dtype),
            "shape": list(s.shape),
            "nbytes": s.nbytes,
            "trainable": s.trainable,
            "initializer": s.initializer,
            "partition": None if s.partition is None else s.partition.as_dict(),
            "save_slice_info": (
                None if s.partition is None else s.partition.save_slice_info(s.shape)
            ),
            "version": self.version,
            "token": self.token,
            "generation": self.generation,
            "previous": self.previous or None,
            "previous_version": self.previous_version,
            "segments": self.segments,
            "publishes": self.publishes,
            "row_publishes": self.row_publishes,
            "created_ms": self.created_ms,
            "updated_ms": self.updated_ms,
            "memory_bytes": self.memory_bytes,
        }


async def list_variables(client: Client, container: str = keys.DEFAULT_CONTAINER) -> list[str]:
    """Names of the variables registered in ``container``, sorted.

    Raises:
        InvalidArgumentError: an invalid container name.
    """
    keys.check_container(container)
    names = await client.smembers(keys.container_variables(container))
    return sorted(_text(n) for n in names)


async def variable_stats(
    client: Client, name: str, container: str = keys.DEFAULT_CONTAINER, *, memory: bool = True
) -> VariableStats:
    """Read what is stored for variable ``name`` (see :class:`VariableStats`).

    Raises:
        InvalidArgumentError: an invalid name or container.
        NotFoundError: no such variable.
        DataLossError: its meta hash is corrupt, or a segment of its current generation
            is missing, of another length than its layout says or of another type (the
            message names the key).
    """
    keys.check_name(name)
    keys.check_container(container)
    prefix = keys.variable_prefix(container, name)
    meta = prefix + "meta"
    with varcheck.naming(meta):
        raw = await client.hgetall(meta)
    m = {_text(k): v for k, v in raw.items()}
    opened = varcheck.opened(meta, [m.get(f) for f in varcheck.OPENED] if m else None)
    if opened is None:
        raise NotFoundError(f"no variable '{name}' in container '{container}'")
    spec, lay = opened

    def count(field: str, default: int | None = None) -> int:
        return varcheck.count(m.get(field, default), meta, field)

    gen, prev = _text(m["gen"]), _text(m.get("prev"))
    data = [f"{prefix}d:{gen}:{i}" for i in range(lay.nseg)]
    batch = client.batch()
    for k in data:
        batch.strlen(k)
    *lengths, prev_there = await batch.exists(f"{prefix}d:{prev}:0").run(raise_on_error=False)
    for i, (k, n) in enumerate(zip(data, lengths)):
        if n != lay.segment_size(i):
            held = "holds another type" if isinstance(n, Exception) else f"holds {n} bytes"
            raise DataLossError(
                f"corrupt state: {k} {held}, its layout says {lay.segment_size(i)} bytes"
            )
    prev_alive = bool(prev) and (lay.nseg == 0 or prev_there == 1)
    mem: int | None = None
    if memory:
        gens = [gen] + ([prev] if prev_alive else [])
        names = [meta] + [f"{prefix}d:{g}:{i}" for g in gens for i in range(lay.nseg)]
        batch = client.batch()
        for k in names:
            batch.memory_usage(k)
        replies = await batch.run(raise_on_error=False)
        if not any(isinstance(r, Exception) for r in replies):
            mem = sum(int(r or 0) for r in replies)
    return VariableStats(
        name=name,
        container=container,
        spec=spec,
        version=count("ver"),
        token=count("token"),
        generation=gen,
        previous=prev if prev_alive else "",
        previous_version=count("pver") if prev_alive else None,
        segments=lay.nseg,
        publishes=count("publishes", 0),
        row_publishes=count("row_publishes", 0),
        created_ms=count("ctime", 0),
        updated_ms=count("mtime", 0),
        memory_bytes=mem,
    )

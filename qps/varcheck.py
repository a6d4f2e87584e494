"""Checks of a variable's stored state, made where :mod:`qps.variables` reads it: a
corrupt value raises :class:`~qps.errors.DataLossError` naming its key (and field),
never a bare ``ValueError`` and never a wrong answer (docs/variables.md, "Corrupt
state").

What qps writes keeps these invariants, and each read checks those it touches:

* the meta hash holds ``spec``, ``gen``, ``ver``, ``token``, ``nbytes``, ``nseg`` and
  ``segb``; the spec parses, and ``nbytes``, ``nseg`` and ``segb`` are the layout of its
  dtype and shape (checked when a variable is opened, and by ``variable_stats``);
* versions, tokens, ``t`` and the counts are integers in [0, 2**53);
* the pointers name segments that are there with the length the layout gives them:
  ``gen`` for the value, ``sgen`` for each slot ``slots`` lists (a read that finds a
  segment of the current generation short, atomically, reports it; one of a generation
  that a flip retired meanwhile is a race, and the read is made again);
* every key holds its type: the meta a hash, ``applied`` a sorted set, the rest strings.

What no check sees, on purpose: **bytes of the right length**. A segment or a slot
segment overwritten with other bytes of its length is read as the value it now holds
(the copy ``cur`` of a small value ends with its version: other bytes over it are not
taken, and the read goes to the segment). Any bytes are a value of their dtype (sixteen 0xff
bytes are a float32[4] of NaN), and NaN and Inf are legitimate training state (a
diverged run, or a checkpoint of one): refusing them would refuse real variables, and a
checksum would cost every write and every read a pass over its bytes. Likewise a
segment *longer* than its layout is read up to its layout's length by the reads that
take byte ranges (and refused by those that measure it: a row write, ``variable_stats``,
a small value's read script), and a missing ``applied`` set is an empty one (it only
remembers messages applied and not yet acknowledged).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

from qps import keys
from qps.errors import DataLossError, InternalError, QpsError
from qps.transport import Client, map_errors
from qps.varspec import MAX_COUNTER, Layout, VariableSpec, dtype_name, format_shape

__all__ = [
    "OPENED",
    "count",
    "field_error",
    "missing",
    "naming",
    "opened",
    "read_opened",
    "short",
    "spec",
    "wrong_type",
]

_COUNT = re.compile(rb"[0-9]{1,16}")
#: the meta fields a variable is opened from (:func:`opened`)
OPENED = ("spec", "segb", "nbytes", "nseg", "gen", "ver", "token")
#: a variable key's type by its name after the variable's prefix (strings otherwise)
_TYPES = {"meta": "hash", "applied": "zset", "unheld": "list"}


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 60 else text[:57] + "..."


def field_error(key: str, field: str, raw: Any, want: str) -> DataLossError:
    """The error for field ``field`` of hash ``key`` holding ``raw`` (None: missing)
    instead of ``want``."""
    held = "is missing" if raw is None else f"holds {_shown(raw)}"
    return DataLossError(f"corrupt state: {key} field '{field}' {held}, not {want}")


def count(raw: Any, key: str, field: str) -> int:
    """Field ``field`` of ``key`` (a version, token, ``t`` or count) as an int.

    Raises:
        DataLossError: not an integer in [0, 2**53) (None: the field is missing).
    """
    if isinstance(raw, int) and not isinstance(raw, bool):  # a script's integer reply
        if 0 <= raw <= MAX_COUNTER:
            return raw
    else:
        b = raw.encode() if isinstance(raw, str) else raw
        if isinstance(b, (bytes, bytearray)) and _COUNT.fullmatch(b) and int(b) <= MAX_COUNTER:
            return int(b)
    raise field_error(key, field, raw, "an integer in [0, 2**53)")


def spec(raw: Any, key: str) -> VariableSpec:
    """Field ``spec`` of the meta hash ``key``, parsed.

    Raises:
        DataLossError: missing, or not a spec this qps reads.
    """
    if raw is None:
        raise field_error(key, "spec", raw, "a variable spec")
    try:
        return VariableSpec.from_json(raw)
    except DataLossError as exc:
        raise DataLossError(f"corrupt state: {key} field 'spec': {exc}") from exc


def opened(key: str, raw: Sequence[Any] | None) -> tuple[VariableSpec, Layout] | None:
    """The spec and layout of a variable from its meta ``key``'s fields :data:`OPENED`
    (as ``HMGET`` returns them; None: there is no meta, no such variable).

    Raises:
        DataLossError: a field missing or corrupt, or a layout that is not the spec's.
    """
    if raw is None:
        return None
    text, segb, nbytes, nseg, gen, ver, token = raw
    s = spec(text, key)
    lay = Layout.of(s, count(segb, key, "segb"))
    what = f"the layout of {dtype_name(s.dtype)} {format_shape(s.shape)}"
    if lay.seg_bytes != int(segb):
        raise field_error(key, "segb", segb, f"a whole number of rows ({what})")
    if count(nbytes, key, "nbytes") != lay.nbytes:
        raise field_error(key, "nbytes", nbytes, f"{lay.nbytes} ({what})")
    if count(nseg, key, "nseg") != lay.nseg:
        raise field_error(key, "nseg", nseg, f"{lay.nseg} ({what})")
    if not gen:
        raise field_error(key, "gen", gen, "a generation id")
    count(ver, key, "ver")
    count(token, key, "token")
    return s, lay


async def read_opened(client: Client, key: str) -> tuple[VariableSpec, Layout] | None:
    """:func:`opened` of the meta hash ``key`` read now (one round trip)."""
    with naming(key):
        raw, there = await client.batch().hmget(key, OPENED).exists(key).run()
    return opened(key, raw if there else None)


def short(where: str, key: str) -> DataLossError:
    """The error for a segment ``key`` of ``where`` that is missing or shorter than its
    layout, found so where no writer could have removed it (the current generation,
    read atomically)."""
    return DataLossError(
        f"corrupt state: {where}: {key} is missing or shorter than the variable's layout says"
    )


async def missing(client: Client, meta: str, field: str, gone: QpsError) -> QpsError:
    """What a read that found field ``field`` of the meta hash ``meta`` missing raises:
    ``gone`` (NotFoundError) if the meta itself is gone (deleted, or its container
    reset), else DataLossError naming the field."""
    there = await client.exists(meta)
    return field_error(meta, field, None, "a value") if there else gone


async def wrong_type(client: Client, prefixes: Sequence[str], exc: QpsError) -> QpsError:
    """What an operation on the variables of ``prefixes`` that met a ``WRONGTYPE`` reply
    (``exc``) raises: DataLossError naming the first key of theirs that holds another
    type than qps gives it; ``exc`` itself if none does (any longer)."""
    for prefix in prefixes:
        found = [k async for k in client.scan(keys.glob_escape(prefix) + "*", 1000)]
        batch = client.batch()
        for k in found:
            batch.type(k)
        for k, kind in zip(found, await batch.run()):
            name = k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            want = _TYPES.get(name[len(prefix) :], "string")
            if kind not in (want, "none"):
                return DataLossError(f"corrupt state: {name} is a {kind}, not a {want}")
    return exc


@contextlib.contextmanager
def naming(*candidates: str) -> Iterator[None]:
    """:func:`~qps.transport.map_errors`, with a ``WRONGTYPE`` reply raised as
    DataLossError naming the ``candidates``: the keys of the block's commands that can
    hold another type (one, as a rule)."""
    try:
        with map_errors():
            yield
    except InternalError as exc:
        if "WRONGTYPE" not in str(exc):
            raise
        which = " or ".join(candidates)
        raise DataLossError(f"corrupt state: {which} holds the wrong type of value") from exc

"""Decoding delivered elements, and setting aside those that do not decode.

Whatever is wrong with a stored value (garbage bytes, a truncated or foreign wire
header, a dtype or shape the queue does not hold, a reference to out-of-line bytes that
is malformed or whose bytes are missing or of the wrong length), the dequeue moves it
to the queue's dead-letter list with the reason and goes on with the next element: a
corrupt element never blocks a queue (docs/queues.md, "Dead letters").
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from qps import wire
from qps.errors import DataLossError
from qps.queues.large import (
    BATCH_ENTRY,
    BATCH_REF,
    REF,
    parse_batch_entry,
    parse_batch_ref,
    parse_ref,
)
from qps.queues.spec import QueueSpec, dtype_name, format_shape, is_string
from qps.transport import Client

log = logging.getLogger("qps.queue")


@dataclass(frozen=True)
class Quick:
    """The encoding of one element of a queue of one fixed-shape numeric component:
    every such element is ``header`` + the array's bytes in C order, ``total`` bytes."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    header: bytes
    total: int


QUICK_MAX_BYTES = 64 * 1024  # elements up to this size take the quick codec


def quick_codec(spec: QueueSpec, fixed: bool) -> Quick | None:
    """The quick codec of ``spec`` (see :class:`Quick`), or None where elements vary:
    several components, names, strings, bools (decoding checks their bytes), shapes not
    fully defined, or elements too large to be sent whole."""
    if not fixed or len(spec.dtypes) != 1 or spec.names is not None or spec.shapes is None:
        return None
    dtype = np.dtype(spec.dtypes[0])
    if dtype.kind not in "iuf" or not dtype.isnative:
        return None
    shape = tuple(int(d) for d in spec.shapes[0])  # type: ignore[arg-type]
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > QUICK_MAX_BYTES:
        return None
    header = wire.header_bytes([dtype], [shape])  # one buffer: nothing pads it
    return Quick(dtype, shape, header, len(header) + nbytes)


def check_element(spec: QueueSpec, arrays: list[np.ndarray]) -> None:
    """Check a decoded element against the queue's spec.

    Raises:
        DataLossError: another number of components, dtype or shape.
    """
    if len(arrays) != len(spec.dtypes):
        raise DataLossError(
            f"element has {len(arrays)} components, the queue has {len(spec.dtypes)}"
        )
    for i, (a, dt) in enumerate(zip(arrays, spec.dtypes)):
        if a.dtype != dt and not (is_string(dt) and a.dtype.kind == "S"):
            raise DataLossError(
                f"component {i} is {dtype_name(a.dtype)}, the queue holds {dtype_name(dt)}"
            )
        if spec.shapes is not None:
            want = spec.shapes[i]
            if len(want) != a.ndim or any(w is not None and w != g for w, g in zip(want, a.shape)):
                raise DataLossError(
                    f"component {i} has shape {format_shape(a.shape)}, the queue "
                    f"holds {format_shape(want)}"
                )


def _ref_reason(blob: bytes) -> str:
    """Why a reference was left unread."""
    tag = blob[:3]
    if tag == REF:
        if parse_ref(blob) is None:
            return "a malformed reference to a large element"
        return "the chunks of a large element are missing or of the wrong length"
    if tag == BATCH_ENTRY and parse_batch_entry(blob) is None:
        return "a malformed batch entry"
    if tag == BATCH_REF and parse_batch_ref(blob) is None:
        return "a malformed batch row reference"
    return "the buffer of a batch row is missing or too short"


def split_bad(
    decode: Callable[[Any], list[np.ndarray]], blobs: Sequence[Any]
) -> tuple[list[list[np.ndarray]], list[tuple[bytes, str]]]:
    """The elements among ``blobs`` that decode, and ``(bytes, reason)`` for the others."""
    good, bad = [], []
    for b in blobs:
        tag = b[:3]
        if tag in (REF, BATCH_REF, BATCH_ENTRY):
            bad.append((bytes(b), _ref_reason(bytes(b))))
            continue
        try:
            good.append(decode(b))
        except (DataLossError, ValueError, TypeError) as exc:  # a decode never trusts bytes
            bad.append((bytes(b), str(exc) or type(exc).__name__))
    return good, bad


_BID = re.compile(rb"Q[BS]\|([0-9A-Za-z_.:-]{1,64})\|")


def batch_ids(bad: list[tuple[bytes, str]]) -> list[str]:
    """The buffers named by the batch entries and rows among ``bad``: their bytes are
    missing or short, so the quarantine script sets aside the entries of them at the
    head of a list queue whose rows they do not hold, and the count of a buffer that
    is gone."""
    out: list[str] = []
    for blob, _ in bad:
        m = _BID.match(blob)
        if m is not None and m[1].decode() not in out:
            out.append(m[1].decode())
    return out


async def quarantine(
    client: Client,
    skeys: list[str],
    where: str,
    bad: list[tuple[bytes, str]],
    lease_ms: int,
) -> None:
    """Move undecodable values to the queue's dead-letter list, each with its reason."""
    records = [
        msgpack.packb(
            {"reason": reason, "data": blob, "time": time.time(), "by": client.client_id},
            use_bin_type=True,
        )
        for blob, reason in bad
    ]
    for _, reason in bad:
        log.warning("queue %s: set aside a corrupt element: %s", where, reason)
    tokens = " ".join([str(lease_ms), *batch_ids(bad)])
    await client.run_script("quarantine", skeys, [tokens, *records])

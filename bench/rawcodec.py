"""The encoding of the raw redis-py baselines (bench/README.md, "The workloads").

One message is ``u32 header length (little-endian) | msgpack [[dtype.str, shape], ...] |
raw C-contiguous bytes of each array``, decoded with ``np.frombuffer`` (zero copy).
No qps code is used here, on purpose: the baselines measure what a hand-written
redis-py program gets, and qps is judged against that.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import msgpack
import numpy as np

_U32 = struct.Struct("<I")


def encode(arrays: Sequence[np.ndarray]) -> bytes:
    """One message holding ``arrays``: a single join, no other copy."""
    header = msgpack.packb([[a.dtype.str, list(a.shape)] for a in arrays])
    parts: list[object] = [_U32.pack(len(header)), header]
    for a in arrays:
        parts.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return b"".join(parts)  # type: ignore[arg-type]


def decode(buf: bytes) -> list[np.ndarray]:
    """The arrays of one message, as read-only views into ``buf``."""
    (hlen,) = _U32.unpack_from(buf, 0)
    offset = 4 + hlen
    arrays = []
    for dtype_str, shape in msgpack.unpackb(memoryview(buf)[4:offset]):
        dtype = np.dtype(dtype_str)
        count = math.prod(shape)
        arrays.append(np.frombuffer(buf, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    if offset != len(buf):
        raise ValueError(f"message is {len(buf)} bytes, its header describes {offset}")
    return arrays

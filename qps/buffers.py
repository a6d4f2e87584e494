"""Receive buffers reused across reads of large values.

A fresh buffer of many MiB costs more than the copy into it: the kernel maps and
zeroes every page on first touch (with transparent huge pages, 2 MiB at a time). A PS
shard reading a 16 MiB gradient message per apply spent a fifth of its CPU there
(``perf``: ``clear_page_erms`` under ``recv``). :func:`take` hands out buffers that
come back by themselves: a buffer is reused once nothing refers to it any more (no
array decoded from it, no view of it is alive: CPython's reference count of the
array that owns the memory is back to the pool's own). Reading into a reused buffer
touches pages that are already mapped.

The pool keeps at most :data:`POOL_BYTES` of buffers (lent or idle); past that,
buffers are plain ones that the allocator frees as usual. Buffers under
:data:`MIN_BYTES` always are (the heap reuses those without page faults).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

#: Buffers from this size on are pooled.
MIN_BYTES = 1 << 20
#: The most bytes of buffers the pool keeps (lent and idle together).
POOL_BYTES = 256 << 20


def _idle_refs() -> int:
    """The reference count :meth:`BufferPool.take` sees for a buffer only the pool
    holds (the list's, the loop variable's, the call's argument: measured, not assumed,
    as interpreters differ)."""
    arrays = [np.empty(1, np.uint8)]
    count = 0
    for arr in arrays:
        count = sys.getrefcount(arr)
    return count


_IDLE = _idle_refs()


class BufferPool:
    """Reusable byte buffers, matched by exact size (reads of one kind of value
    repeat the same sizes)."""

    def __init__(self, limit: int = POOL_BYTES, min_bytes: int = MIN_BYTES) -> None:
        self.limit = limit
        self.min_bytes = min_bytes
        self._arrays: list[np.ndarray] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # counters, for tests and benchmarks
        self.fresh = 0

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` bytes (contents undefined)."""
        if nbytes < self.min_bytes:
            return np.empty(nbytes, np.uint8).data
        with self._lock:
            for arr in self._arrays:
                if arr.nbytes == nbytes and sys.getrefcount(arr) <= _IDLE:
                    self.reused += 1
                    return arr.data
            self.fresh += 1
            arr = np.empty(nbytes, np.uint8)
            if self._bytes + nbytes > self.limit:
                self._drop_idle(self._bytes + nbytes - self.limit)
            if self._bytes + nbytes <= self.limit:
                self._arrays.append(arr)
                self._bytes += nbytes
            return arr.data

    def _drop_idle(self, need: int) -> None:
        """Forget idle buffers (other sizes than wanted now) until ``need`` bytes are
        freed or none is idle."""
        kept: list[np.ndarray] = []
        for arr in self._arrays:
            if need > 0 and sys.getrefcount(arr) <= _IDLE:
                need -= arr.nbytes
                self._bytes -= arr.nbytes
            else:
                kept.append(arr)
        self._arrays = kept

    def clear(self) -> None:
        """Forget every buffer (those lent stay valid for their holders)."""
        with self._lock:
            self._arrays = []
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the pool keeps."""
        return self._bytes


_POOL = BufferPool()


def take(nbytes: int) -> Any:
    """A writable buffer of ``nbytes`` bytes from the process's pool (see the module
    docstring)."""
    return _POOL.take(nbytes)


def pool() -> BufferPool:
    """The process's pool."""
    return _POOL

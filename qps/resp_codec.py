"""RESP's encoding of commands, and the error reply both lean readers produce.

:func:`pack_command` turns one command into the buffers to write: small arguments are
joined, large buffers (and :class:`Pieces`) are written as they are, never copied into
the command. ``hiredis.pack_command`` does the common case in C (:func:`_pack`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import hiredis

#: Arguments of at least this many bytes given as ``memoryview`` or ``bytearray`` are
#: written as they are, after their header, instead of being copied into the command.
LARGE_ARG = 1 << 16

Arg = bytes | bytearray | memoryview | str | int | float

_hiredis_pack = hiredis.pack_command


class ReplyError(Exception):
    """An error reply from the server (``-ERR ...``, ``-NOSCRIPT ...``, ...)."""

    @property
    def code(self) -> str:
        """The error's first word: ``ERR``, ``NOSCRIPT``, ``WRONGTYPE``, ``LOADING``..."""
        text = str(self)
        return text.split(" ", 1)[0] if text else ""


class Pieces:
    """One command argument of ``nbytes`` bytes given as the buffers ``parts`` yields,
    in order: a value that is never joined into one buffer (a chunk that spans an
    element's header and its data, a batch encoded a window at a time).

    :meth:`Connection.stream_many` writes each part as it comes, so ``parts`` may make
    them on demand; other writers take them all at once (or :meth:`join` them, for
    redis-py). ``parts`` is iterated once per write: a write that may be made again (a
    cluster's redirection) needs one that starts over on each ``iter()``, not a
    generator.
    """

    __slots__ = ("_parts", "nbytes")

    def __init__(self, nbytes: int, parts: Iterable[Any]) -> None:
        self.nbytes = nbytes
        self._parts = parts

    def __iter__(self) -> Iterator[memoryview]:
        for part in self._parts:
            view = part if isinstance(part, memoryview) else memoryview(part)
            yield view if view.format == "B" and view.ndim == 1 else view.cast("B")

    def join(self) -> bytes:
        """The value as one bytes object (a copy)."""
        data = b"".join(self)
        if len(data) != self.nbytes:
            raise ValueError(f"pieces of {len(data)} bytes for a value of {self.nbytes}")
        return data


def _as_bytes(arg: Any) -> bytes | memoryview:
    """One argument as a flat byte buffer (a large buffer is not copied)."""
    cls = arg.__class__
    if cls is bytes:
        return arg  # type: ignore[no-any-return]
    if cls is str:
        return arg.encode("utf-8")  # type: ignore[no-any-return]
    if cls is int:
        return b"%d" % arg
    if isinstance(arg, (memoryview, bytearray)):
        view = memoryview(arg)
        if not view.c_contiguous:
            return view.tobytes()
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        return view if view.nbytes >= LARGE_ARG else view.tobytes()
    if isinstance(arg, bytes):  # subclasses, e.g. numpy.bytes_
        return bytes(arg)
    if isinstance(arg, str):
        return str.encode(arg, "utf-8")
    if isinstance(arg, float):
        return repr(float(arg)).encode("ascii")
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % int(arg)
    raise TypeError(
        f"invalid Redis command argument of type {cls.__name__}: "
        "use bytes, bytearray, memoryview, str, int or float"
    )


def pack_command(args: Sequence[Arg], pieces: bool = False) -> list[Any]:
    """The RESP encoding of one command, as a list of buffers to write in order.

    Small arguments are joined into bytes; a ``memoryview``/``bytearray`` of at least
    :data:`LARGE_ARG` bytes is its own item, between its header and the next (no copy);
    so is each buffer of a :class:`Pieces`, or (``pieces``) the :class:`Pieces` itself.
    """
    out: list[Any] = []
    head = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, Pieces):
            head.append(b"$%d\r\n" % arg.nbytes)
            out.append(b"".join(head))
            if pieces:
                out.append(arg)
            else:
                size = len(out)
                out.extend(arg)
                if sum(p.nbytes for p in out[size:]) != arg.nbytes:
                    raise TypeError(f"Pieces do not add up to the {arg.nbytes} bytes declared")
            head = [b"\r\n"]
            continue
        data = _as_bytes(arg)
        if isinstance(data, memoryview):
            head.append(b"$%d\r\n" % data.nbytes)
            out.append(b"".join(head))
            out.append(data)
            head = [b"\r\n"]
        else:
            head.append(b"$%d\r\n%b\r\n" % (len(data), data))
    out.append(b"".join(head))
    return out


def _pack(args: tuple[Any, ...]) -> bytes | list[bytes | memoryview]:
    """One command: bytes from hiredis' C packer when it takes every argument (bytes,
    str, int, float), else :func:`pack_command`'s list of buffers. Memoryviews always go
    to :func:`pack_command`, which writes large ones without copying (hiredis copies
    them, slowly: about 160 µs for 400 KB), and so do bytes of :data:`LARGE_ARG` or more
    (hiredis took 1.25 ms for a 1 MiB value, pack_command 0.13 ms)."""
    for a in args:
        cls = type(a)
        if cls is memoryview or (cls is bytes and len(a) >= LARGE_ARG):
            return pack_command(args)
    try:
        return _hiredis_pack(args)  # type: ignore[no-any-return]
    except TypeError:
        return pack_command(args)


def _pack_all(commands: Iterable[Sequence[Any]]) -> tuple[list[bytes | memoryview], int]:
    """Several commands packed for one write, and how many there are."""
    parts: list[bytes | memoryview] = []
    count = 0
    for command in commands:
        data = _pack(tuple(command))
        if isinstance(data, bytes):
            parts.append(data)
        else:
            parts.extend(data)
        count += 1
    return parts, count

"""Views of the parameters of a packed model (``workers.models.Packed``).

A packed model stores its dense parameters flattened and joined into one vector, cut
into a few flat variables (``packed/0``, ``packed/1``, ...): a PS shard then commits,
and a worker reads, one variable where the model has many (the per-variable work, not
the bytes, is most of a small model's update). What it loses is the names: the job's
chief records the layout, the parameters' names and shapes in order and the parts'
lengths, in the container (``qps:{<container>}:packed``, JSON), and :func:`read_view`
reads a parameter by its name from the parts that hold it (``qps var get W1``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qps import keys
from qps.errors import InvalidArgumentError
from qps.transport import Client
from qps.variables import open_variable

__all__ = ["PackLayout", "layout_of", "read_layout", "read_view", "record_layout"]


@dataclass(frozen=True)
class PackLayout:
    """Where each parameter of a packed model lies.

    Attributes:
        dtype: the parts' dtype (every packed parameter's).
        parts: ``(variable name, elements)`` of each part, in order.
        params: ``(name, shape)`` of each packed parameter, in the order they are
            joined (C order each).
    """

    dtype: str
    parts: tuple[tuple[str, int], ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "dtype": self.dtype,
                "parts": [list(p) for p in self.parts],
                "params": [[n, list(s)] for n, s in self.params],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> PackLayout:
        """The layout :meth:`to_json` wrote.

        Raises:
            InvalidArgumentError: not such a layout.
        """
        try:
            d = json.loads(text)
            return cls(
                str(d["dtype"]),
                tuple((str(n), int(k)) for n, k in d["parts"]),
                tuple((str(n), tuple(int(x) for x in s)) for n, s in d["params"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"not a packed-model layout: {exc}") from None

    def locate(self, name: str) -> tuple[int, int, tuple[int, ...]] | None:
        """``(start, stop, shape)`` of parameter ``name`` in the joined vector; None if
        it is not one of the layout's."""
        at = 0
        for n, shape in self.params:
            size = int(np.prod(shape, dtype=np.int64))
            if n == name:
                return at, at + size, shape
            at += size
        return None

    def names(self) -> list[str]:
        """The packed parameters' names, in order."""
        return [n for n, _ in self.params]


async def record_layout(client: Client, container: str, layout: PackLayout) -> None:
    """Record ``layout`` as the container's (the chief does, when it makes the model
    ready; a later one replaces it)."""
    await client.set(keys.packed_layout(container), layout.to_json())


async def read_layout(client: Client, container: str) -> PackLayout | None:
    """The container's packed-model layout; None if none was recorded."""
    raw = await client.get(keys.packed_layout(container))
    return None if raw is None else PackLayout.from_json(raw)


async def read_view(
    client: Client, container: str, name: str
) -> tuple[np.ndarray, list[tuple[str, int]]] | None:
    """Packed parameter ``name``'s value, read from the parts that hold it, with the
    ``(part, version)`` each was read at (a value spread over two parts is two reads,
    each an exact snapshot); None if the container records no such parameter.

    Raises:
        NotFoundError: a part is gone (the container was reset meanwhile).
    """
    layout = await read_layout(client, container)
    where = None if layout is None else layout.locate(name)
    if layout is None or where is None:
        return None
    start, stop, shape = where
    pieces: list[np.ndarray] = []
    versions: list[tuple[str, int]] = []
    lo = 0
    for part, size in layout.parts:
        hi = lo + size
        if lo < stop and start < hi:
            value, version = await (await open_variable(client, part, container)).read()
            pieces.append(np.asarray(value).reshape(-1)[max(start, lo) - lo : min(stop, hi) - lo])
            versions.append((part, version))
        lo = hi
    flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return flat.reshape(shape), versions


def layout_of(dtype: Any, parts: Sequence[tuple[str, int]], params: Sequence[Any]) -> PackLayout:
    """A layout from a packed model's parts and its ``ParamSpec``-like parameters (with
    ``name`` and ``shape``)."""
    return PackLayout(
        np.dtype(dtype).name,
        tuple((str(n), int(k)) for n, k in parts),
        tuple((p.name, tuple(int(x) for x in p.shape)) for p in params),
    )

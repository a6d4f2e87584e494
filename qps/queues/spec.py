"""A queue's immutable spec: type, component dtypes and shapes, names, capacity.

The spec is stored as JSON in the queue's ``meta`` hash (readable with ``redis-cli``) by
the first process that creates the queue; later users of the same ``shared_name`` must
request the same spec or get TensorFlow's "Shared queue 'X' has ..." errors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qps import wire
from qps.errors import InvalidArgumentError

Shape = tuple[int | None, ...]

#: kind -> the TensorFlow class name used in messages
CLASS_NAMES = {
    "fifo": "FIFOQueue",
    "shuffle": "RandomShuffleQueue",
    "padding": "PaddingFIFOQueue",
    "priority": "PriorityQueue",
}


def format_shape(shape: Shape | None) -> str:
    """TensorFlow's spelling of a shape: ``[2,3]``, ``[?,2]``, ``<unknown>``."""
    if shape is None:
        return "<unknown>"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def _is_single_shape(shapes: Any) -> bool:
    if isinstance(shapes, (tuple, list)):
        return all(d is None or isinstance(d, (int, np.integer)) for d in shapes)
    return False


STRING: np.dtype[Any] = np.dtype("S")
"""The dtype of a string component: NumPy bytes without a fixed width (``S0``).

Spelled ``"string"`` in a stored spec; values are ``S<n>`` arrays (``n`` varies)."""

STRING_CODE = "string"

#: The largest capacity, ``min_after_dequeue`` and count a queue call accepts: 2**53 - 1,
#: the largest integer the Lua scripts' numbers (doubles) hold exactly.
MAX_COUNT = 2**53 - 1


def check_capacity(capacity: Any, what: str = "capacity") -> int:
    """``capacity`` as an int, negative ones as -1 (unbounded).

    Raises:
        InvalidArgumentError: not an integer, or above :data:`MAX_COUNT`.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        try:
            exact = int(capacity) == capacity
        except (TypeError, ValueError, OverflowError):
            exact = False
        if not exact:
            raise InvalidArgumentError(f"{what} must be an integer, got {capacity!r}")
    n = int(capacity)
    if n > MAX_COUNT:
        raise InvalidArgumentError(f"{what} {n} is above the most a queue holds, {MAX_COUNT}")
    return -1 if n < 0 else n


def is_string(dt: np.dtype[Any]) -> bool:
    """Whether ``dt`` is a bytes dtype (the queue's ``STRING`` or any ``S<n>``)."""
    return dt.kind == "S"


def dtype_name(dt: np.dtype[Any]) -> str:
    """A component dtype as messages name it: ``string`` for strings (as TF does),
    else NumPy's name (``float32``)."""
    return "string" if dt.kind in "SU" else dt.name


def _string_spelling(dt: Any) -> bool:
    """``"string"``, or anything NumPy reads as a bytes or unicode dtype (``str``,
    ``bytes``, ``np.str_``, ``np.bytes_``, ``"S"``, ``"U7"``, ``np.dtype("S3")``...)."""
    if isinstance(dt, str) and dt == STRING_CODE:
        return True
    try:
        return np.dtype(dt).kind in "SU"
    except (TypeError, ValueError):
        return False


def normalize_dtypes(dtypes: Any) -> tuple[np.dtype[Any], ...]:
    """A single dtype becomes a list of one; each must be on the wire whitelist.

    Strings (``"string"``, ``str``, ``bytes``, ``np.bytes_``, ``np.str_`` and any
    ``S``/``U`` dtype, with or without a width) all become :data:`STRING`.

    Raises:
        InvalidArgumentError: an empty list or a dtype qps cannot carry.
    """
    items = list(dtypes) if isinstance(dtypes, (list, tuple)) else [dtypes]
    if not items:
        raise InvalidArgumentError("a queue needs at least one component dtype")
    out = []
    for dt in items:
        if _string_spelling(dt):
            out.append(STRING)
            continue
        try:
            ndt = np.dtype(dt)
        except TypeError as exc:
            raise InvalidArgumentError(f"not a dtype: {dt!r}") from exc
        wire.dtype_code(ndt)  # raises InvalidArgumentError for unsupported dtypes
        out.append(ndt)
    return tuple(out)


def spec_code(dt: np.dtype[Any]) -> str:
    """A component dtype as a stored spec writes it: ``"string"`` or its wire code."""
    return STRING_CODE if is_string(dt) else wire.dtype_code(dt)


def dtype_from_spec_code(code: Any) -> np.dtype[Any]:
    """The inverse of :func:`spec_code`.

    Raises:
        DataLossError: an unknown code.
    """
    return STRING if code == STRING_CODE else wire.dtype_from_code(code)


def normalize_shapes(
    shapes: Any, ncomp: int, *, allow_unknown_dims: bool
) -> tuple[Shape, ...] | None:
    """``None`` stays None; a single shape is promoted to a list of one.

    Raises:
        InvalidArgumentError: wrong count, a negative dimension, or an unknown
            dimension where the queue type needs fully defined shapes.
    """
    if shapes is None:
        return None
    if _is_single_shape(shapes):
        # [] or [2, 3] or [None, 2] is one shape; TF promotes it to a list of one.
        shapes = [shapes]
    if not isinstance(shapes, (list, tuple)):
        raise InvalidArgumentError(f"shapes must be a list of shapes, got {shapes!r}")
    if len(shapes) != ncomp:
        raise InvalidArgumentError("Queue shapes must have the same length as dtypes")
    out: list[Shape] = []
    for s in shapes:
        if s is None:
            raise InvalidArgumentError(
                "When providing partial shapes, a list of shapes must be provided."
            )
        if isinstance(s, (int, np.integer)):
            s = [s]
        dims: list[int | None] = []
        for d in s:
            if d is None:
                if not allow_unknown_dims:
                    raise InvalidArgumentError(
                        f"All shapes must be fully defined: {format_shape(tuple(s))}"
                    )
                dims.append(None)
            elif int(d) < 0:
                raise InvalidArgumentError(f"negative dimension in shape {list(s)}")
            else:
                dims.append(int(d))
        out.append(tuple(dims))
    return tuple(out)


def normalize_names(names: Any, ncomp: int) -> tuple[str, ...] | None:
    """Check ``names`` (one string per component, all distinct).

    Raises:
        InvalidArgumentError: wrong count, a non-string or a duplicate name.
    """
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    names = list(names)
    if len(names) != ncomp:
        raise InvalidArgumentError("List of names must have the same length as the list of dtypes")
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise InvalidArgumentError(f"names must be distinct strings, got {names!r}")
    return tuple(names)


@dataclass(frozen=True)
class QueueSpec:
    """What a queue is: fixed when it is created, shared by every user of its name."""

    kind: str
    dtypes: tuple[np.dtype[Any], ...]
    shapes: tuple[Shape, ...] | None
    names: tuple[str, ...] | None
    capacity: int
    min_after_dequeue: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in CLASS_NAMES:
            raise InvalidArgumentError(f"unknown queue kind {self.kind!r}")
        if not -1 <= self.capacity <= MAX_COUNT:
            raise InvalidArgumentError(f"capacity {self.capacity} is outside [-1, {MAX_COUNT}]")
        if not 0 <= self.min_after_dequeue <= MAX_COUNT:
            raise InvalidArgumentError(
                f"min_after_dequeue {self.min_after_dequeue} is outside [0, {MAX_COUNT}]"
            )

    @property
    def class_name(self) -> str:
        return CLASS_NAMES[self.kind]

    @property
    def fully_defined(self) -> bool:
        """True when every component has a shape without unknown dimensions."""
        return self.shapes is not None and all(d is not None for s in self.shapes for d in s)

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(spec_code(d) for d in self.dtypes)

    def to_json(self) -> str:
        return json.dumps(
            {
                "kind": self.kind,
                "dtypes": list(self.codes),
                "shapes": None if self.shapes is None else [list(s) for s in self.shapes],
                "names": None if self.names is None else list(self.names),
                "capacity": self.capacity,
                "min_after_dequeue": self.min_after_dequeue,
                "seed": self.seed,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> QueueSpec:
        d = json.loads(text)
        shapes = d["shapes"]
        return cls(
            kind=d["kind"],
            dtypes=tuple(dtype_from_spec_code(c) for c in d["dtypes"]),
            shapes=None if shapes is None else tuple(tuple(s) for s in shapes),
            names=None if d["names"] is None else tuple(d["names"]),
            capacity=int(d["capacity"]),
            min_after_dequeue=int(d.get("min_after_dequeue", 0)),
            seed=d.get("seed"),
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for the CLI."""
        return {
            "type": self.class_name,
            "dtypes": [dtype_name(d) for d in self.dtypes],
            "shapes": None if self.shapes is None else [format_shape(s) for s in self.shapes],
            "names": None if self.names is None else list(self.names),
            "capacity": self.capacity,
            "min_after_dequeue": self.min_after_dequeue if self.kind == "shuffle" else None,
            "seed": self.seed if self.kind == "shuffle" else None,
        }

    def check_same(self, existing: QueueSpec, name: str) -> None:
        """Compare a requested spec (self) with the stored one.

        Raises:
            InvalidArgumentError: with TensorFlow's text for the first difference.
        """
        if existing.kind != self.kind:
            raise InvalidArgumentError(
                f"Shared queue '{name}': expected {self.class_name}, found {existing.class_name}"
            )
        if existing.capacity != self.capacity:
            raise InvalidArgumentError(
                f"Shared queue '{name}' has capacity {existing.capacity} but requested "
                f"capacity was {self.capacity}"
            )
        if existing.codes != self.codes:
            have = ", ".join(dtype_name(d) for d in existing.dtypes)
            want = ", ".join(dtype_name(d) for d in self.dtypes)
            raise InvalidArgumentError(
                f"Shared queue '{name}' has component types {have} but requested "
                f"component types were {want}"
            )
        if existing.shapes != self.shapes:
            raise InvalidArgumentError(
                f"Shared queue '{name}' has component shapes {_shapes_text(existing.shapes)} "
                f"but requested component shapes were {_shapes_text(self.shapes)}"
            )
        if existing.names != self.names:
            raise InvalidArgumentError(
                f"Shared queue '{name}' has component names {existing.names} but requested "
                f"component names were {self.names}"
            )
        if existing.min_after_dequeue != self.min_after_dequeue:
            raise InvalidArgumentError(
                f"Shared queue '{name}' has min_after_dequeue {existing.min_after_dequeue} "
                f"but requested min_after_dequeue was {self.min_after_dequeue}"
            )
        if self.seed is not None and existing.seed != self.seed:
            raise InvalidArgumentError(
                f"Shared queue '{name}' has random seed {existing.seed} but requested "
                f"seed was {self.seed}"
            )


def _shapes_text(shapes: Sequence[Shape] | None) -> str:
    if shapes is None:
        return "<unknown>"
    return "[" + ", ".join(format_shape(s) for s in shapes) + "]"

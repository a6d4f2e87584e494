"""Gradient messages: what a worker sends a PS shard, as bytes. Pure: no I/O.

A message carries its id (worker, step, shard, plus a nonce that makes it unique), the
version of each variable the gradient was computed from, and per variable either a
dense gradient or sparse rows ``(indices, values)``. It is one :mod:`qps.wire` message
(msgpack header + raw buffers, no pickle) whose components are:

* ``@meta``: a ``uint8`` array holding a msgpack map (see :func:`encode_message`);
* per variable ``name``, in the order of ``meta["vars"]``: ``d:<name>`` (a dense
  gradient) or ``i:<name>`` (int64 indices, 1-D) and ``v:<name>`` (the rows).

The bytes travel as one ``uint8`` component of the shard's gradient queue, so a large
message goes out of line in chunks as every large queue element does.

:func:`check_gradient` validates one gradient against a variable's spec; the worker
calls it before sending and the shard again before applying (a message that still
arrives bad is dead-lettered, never applied).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from qps import wire
from qps.errors import DataLossError, InvalidArgumentError
from qps.varspec import VariableSpec, check_indices, dtype_name, format_shape

__all__ = [
    "FORMAT",
    "GRAD_DTYPES",
    "GradientMessage",
    "SparseGradient",
    "check_gradient",
    "decode_message",
    "encode_message",
    "is_finite",
    "narrower",
    "nbytes",
    "widen",
]

#: Version of the ``@meta`` map; other versions are refused.
FORMAT = 1
_META = "@meta"


@dataclass(frozen=True)
class SparseGradient:
    """Gradient rows: ``values[k]`` is the gradient of row ``indices[k]`` (TF's
    ``IndexedSlices``); repeated indices are summed when applied."""

    indices: npt.NDArray[np.int64]
    values: npt.NDArray[Any]

    @property
    def nbytes(self) -> int:
        return int(self.indices.nbytes + self.values.nbytes)


Gradient = npt.NDArray[Any] | SparseGradient


@dataclass
class GradientMessage:
    """One worker step's gradients for the variables of one PS shard.

    Attributes:
        worker: the sending worker's name (e.g. its task index).
        step: the worker's step number (provenance; need not be unique).
        shard: the PS shard the message is for.
        nonce: unique per message of one worker (session incarnation + a counter), so
            that :attr:`id` names exactly one message even when a worker restarts.
        grads: variable name -> dense array or :class:`SparseGradient`.
        versions: variable name -> the version the gradient was computed from
            (absent: unknown; staleness is then not recorded for it).
        global_step: advance the global step once this message is applied.
        time: the sender's wall clock (seconds) when it built the message.
    """

    worker: str
    step: int
    shard: int
    nonce: str
    grads: dict[str, Gradient] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    global_step: bool = False
    time: float = 0.0

    @property
    def id(self) -> str:
        """``<worker>/<step>/<shard>/<nonce>``: unique, recorded with every commit."""
        return f"{self.worker}/{self.step}/{self.shard}/{self.nonce}"

    @property
    def rows(self) -> int:
        """Rows the message updates (a dense gradient counts its first dimension)."""
        n = 0
        for g in self.grads.values():
            if isinstance(g, SparseGradient):
                n += int(g.indices.shape[0])
            else:
                n += int(g.shape[0]) if g.ndim else 1
        return n

    def provenance(self) -> dict[str, Any]:
        """The message's id fields and variables, for a dead letter."""
        return {
            "id": self.id,
            "worker": self.worker,
            "step": self.step,
            "shard": self.shard,
            "variables": sorted(self.grads),
            "time": self.time,
        }


def _str(x: Any, what: str) -> str:
    if not isinstance(x, str) or not x or len(x) > 256:
        raise DataLossError(f"gradient message: {what} must be a non-empty string, got {x!r}")
    return x


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**63:
        raise DataLossError(f"gradient message: {what} must be an int >= 0, got {x!r}")
    return x


def encode_message(msg: GradientMessage) -> bytes:
    """The wire bytes of ``msg``.

    The ``@meta`` map is ``{"format": 1, "worker", "step", "shard", "nonce", "gs"
    (bool), "time", "vars": [[name, "d" | "s", version or -1], ...]}``.

    Raises:
        InvalidArgumentError: a gradient that is not an array or a SparseGradient, or
            one the wire format cannot carry.
    """
    vars_meta: list[list[Any]] = []
    arrays: list[Any] = []
    names: list[str] = []
    for name, g in msg.grads.items():
        ver = msg.versions.get(name, -1)
        if isinstance(g, SparseGradient):
            vars_meta.append([name, "s", ver])
            arrays += [g.indices, g.values]
            names += [f"i:{name}", f"v:{name}"]
        elif isinstance(g, np.ndarray):
            vars_meta.append([name, "d", ver])
            arrays.append(g)
            names.append(f"d:{name}")
        else:
            raise InvalidArgumentError(
                f"gradient of '{name}' must be an array or a SparseGradient, got {type(g)}"
            )
    meta = {
        "format": FORMAT,
        "worker": msg.worker,
        "step": int(msg.step),
        "shard": int(msg.shard),
        "nonce": msg.nonce,
        "gs": bool(msg.global_step),
        "time": float(msg.time),
        "vars": vars_meta,
    }
    head = np.frombuffer(msgpack.packb(meta, use_bin_type=True), np.uint8)
    return wire.encode([head, *arrays], names=[_META, *names])


def decode_message(data: Any) -> GradientMessage:
    """The message encoded in ``data`` (bytes, or a ``uint8`` array of them). Arrays are
    zero-copy, read-only views into ``data``.

    Raises:
        DataLossError: anything malformed: not a wire message, a bad ``@meta`` map, an
            unknown format, components that do not match the variables listed.
    """
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise DataLossError(f"gradient message: expected uint8[n], got {data.dtype}")
        data = data.data
    m = wire.decode(data)
    names = m.names
    if not names or names[0] != _META or m.arrays[0].dtype != np.uint8:
        raise DataLossError("gradient message: the first component is not '@meta'")
    try:
        meta = msgpack.unpackb(m.arrays[0].tobytes(), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated classes
        raise DataLossError(f"gradient message: bad @meta: {exc}") from None
    if not isinstance(meta, dict):
        raise DataLossError("gradient message: @meta is not a map")
    if meta.get("format") != FORMAT:
        raise DataLossError(f"gradient message format {meta.get('format')!r} is not known")
    msg = GradientMessage(
        worker=_str(meta.get("worker"), "worker"),
        step=_int(meta.get("step"), "step"),
        shard=_int(meta.get("shard"), "shard"),
        nonce=_str(meta.get("nonce"), "nonce"),
        global_step=bool(meta.get("gs", False)),
    )
    t = meta.get("time", 0.0)
    msg.time = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
    vars_meta = meta.get("vars")
    if not isinstance(vars_meta, list):
        raise DataLossError("gradient message: 'vars' is not a list")
    pos = 1
    arrays = m.arrays
    for item in vars_meta:
        if not (isinstance(item, list) and len(item) == 3):
            raise DataLossError(f"gradient message: bad 'vars' entry {item!r}")
        name, kind, ver = item
        name = _str(name, "variable name")
        if name in msg.grads:
            raise DataLossError(f"gradient message: variable '{name}' is listed twice")
        if isinstance(ver, bool) or not isinstance(ver, int) or ver < -1:
            raise DataLossError(f"gradient message: bad version {ver!r} of '{name}'")
        if ver >= 0:
            msg.versions[name] = ver
        want = [f"d:{name}"] if kind == "d" else [f"i:{name}", f"v:{name}"]
        if kind not in ("d", "s") or list(names[pos : pos + len(want)]) != want:
            raise DataLossError(
                f"gradient message: the components of '{name}' are not {want} (kind {kind!r})"
            )
        if kind == "d":
            msg.grads[name] = arrays[pos]
        else:
            idx = arrays[pos]
            if idx.dtype != np.int64 or idx.ndim != 1:
                raise DataLossError(
                    f"gradient message: indices of '{name}' must be int64[n], got "
                    f"{idx.dtype}{list(idx.shape)}"
                )
            msg.grads[name] = SparseGradient(idx, arrays[pos + 1])
        pos += len(want)
    if pos != len(arrays):
        raise DataLossError(
            f"gradient message: {len(arrays) - pos} component(s) not named in 'vars'"
        )
    return msg


def check_gradient(name: str, spec: VariableSpec, grad: Any) -> Gradient:
    """``grad`` for variable ``name`` (of ``spec``) as it is sent: a C-contiguous array
    of the variable's shape and dtype, or a :class:`SparseGradient` (a pair
    ``(indices, values)`` is converted) with int64 1-D indices in range and rows of the
    variable's row shape and dtype.

    An array of another dtype is refused, as TF refuses it (nothing is cast silently),
    but for a narrower floating-point one (float16 for a float32 or float64 variable,
    float32 for a float64 one): a gradient compressed on purpose to move fewer bytes,
    kept as it is here and widened by the shard before the apply (:func:`widen`).
    Python scalars and lists are converted to the variable's dtype.

    Raises:
        InvalidArgumentError: a variable that is not floating point, or a gradient of
            the wrong shape, dtype or kind, or indices out of range.
    """
    if spec.dtype.kind != "f" and spec.dtype.name != "bfloat16":
        raise InvalidArgumentError(
            f"variable '{name}' is {dtype_name(spec.dtype)}: only floating-point variables "
            "take gradients"
        )
    if isinstance(grad, SparseGradient):
        grad = (grad.indices, grad.values)
    if isinstance(grad, tuple):
        if len(grad) != 2:
            raise InvalidArgumentError(
                f"a sparse gradient of '{name}' is a pair (indices, values), got {len(grad)} items"
            )
        if not spec.shape:
            raise InvalidArgumentError(f"variable '{name}' is a scalar: it takes no sparse rows")
        idx = check_indices(grad[0], spec.shape[0], f"indices of '{name}'")
        if idx.ndim != 1:
            raise InvalidArgumentError(
                f"indices of '{name}' must be 1-D, got shape {format_shape(idx.shape)}"
            )
        vals = _array(name, spec, grad[1], "values")
        want = (idx.shape[0], *spec.shape[1:])
        if vals.shape != want:
            raise InvalidArgumentError(
                f"sparse gradient of '{name}': values have shape {format_shape(vals.shape)}, "
                f"expected {format_shape(want)} for {idx.shape[0]} indices"
            )
        return SparseGradient(np.ascontiguousarray(idx, np.int64), vals)
    arr = _array(name, spec, grad, "gradient")
    if arr.shape != spec.shape:
        raise InvalidArgumentError(
            f"gradient of '{name}' has shape {format_shape(arr.shape)}, the variable "
            f"{format_shape(spec.shape)}"
        )
    return arr


#: the dtypes a worker may send gradients in on purpose (``qps worker --grad-dtype``):
#: narrower than their variables, widened by the shard (:func:`widen`)
GRAD_DTYPES = ("float16", "float32")


def narrower(dtype: np.dtype[Any], than: np.dtype[Any]) -> bool:
    """Whether a gradient of ``dtype`` may stand for one of ``than``: both IEEE
    floating point, ``dtype`` the narrower (float16 < float32 < float64)."""
    return dtype.kind == "f" and than.kind == "f" and dtype.itemsize < than.itemsize


def widen(grad: Gradient, spec: VariableSpec) -> Gradient:
    """``grad`` in its variable's dtype: a narrower one (see :func:`check_gradient`)
    widened, exactly (every float16 value is a float32 one); else ``grad`` itself."""
    vals = grad.values if isinstance(grad, SparseGradient) else grad
    if vals.dtype == spec.dtype:
        return grad
    wide = vals.astype(spec.dtype)
    return SparseGradient(grad.indices, wide) if isinstance(grad, SparseGradient) else wide


def _array(name: str, spec: VariableSpec, x: Any, what: str) -> npt.NDArray[Any]:
    if isinstance(x, np.ndarray):
        if narrower(x.dtype.newbyteorder("="), spec.dtype.newbyteorder("=")):
            return np.ascontiguousarray(x)  # compressed on purpose: widened by the shard
        if x.dtype.newbyteorder("=") != spec.dtype.newbyteorder("="):
            raise InvalidArgumentError(
                f"{what} of '{name}' is {dtype_name(x.dtype)}, the variable "
                f"{dtype_name(spec.dtype)} (cast it first; nothing is cast silently)"
            )
        return np.ascontiguousarray(x, dtype=spec.dtype)
    try:
        return np.ascontiguousarray(np.asarray(x, dtype=spec.dtype))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} of '{name}' is not numeric: {exc}") from exc


def is_finite(grad: Gradient) -> bool:
    """Whether every value of ``grad`` is finite (no NaN or Inf).

    float32/float64 first try the dot product of the values with themselves (BLAS,
    about 3x faster than ``isfinite`` over 16 MiB): NaN and Inf propagate into it, so a
    finite result means every value is finite. A non-finite one (which huge finite
    values can give too) is settled element by element."""
    vals = grad.values if isinstance(grad, SparseGradient) else grad
    if not vals.size:
        return True
    if vals.dtype in _DOT_DTYPES and vals.flags.c_contiguous:
        flat = vals.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            if bool(np.isfinite(np.dot(flat, flat))):
                return True
    return bool(np.isfinite(vals).all())


_DOT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def nbytes(grads: Mapping[str, Gradient]) -> int:
    """Bytes of gradient data in ``grads``."""
    return sum(g.nbytes for g in grads.values())

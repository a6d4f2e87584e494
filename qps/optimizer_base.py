"""What every optimizer rule of :mod:`qps.optimizers` stands on: :class:`Optimizer`
(hyper-parameters checked, arguments checked before anything is written, dense and
sparse dispatch, the JSON spec) and how the math runs on arrays: repeated sparse indices
summed, NumPy updates of large arrays in cache-sized blocks, fused CuPy kernels for dense
updates (the two measured speed-ups and their switches, docs/optimizers.md).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import math
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from qps.backend import xp_of
from qps.errors import InvalidArgumentError

Array = Any  # a NumPy or CuPy ndarray
Slots = dict[str, Array]
#: A rule's fused dense CuPy kernel: its name, its scalars, the slots it updates.
Kernel = tuple[str, tuple[float, ...], tuple[Array, ...]]

SPEC_VERSION = 1

#: Use the fused CuPy kernels for dense updates of CuPy float32/float64 arrays.
use_fused_kernels = True


# ------------------------------------------------------------------------------- sparse


def dedupe(xp: ModuleType, indices: Array, values: Array) -> tuple[Array, Array]:
    """``(unique indices, summed values)``; the input unchanged when there are no repeats."""
    if indices.shape[0] < 2:
        return indices, values
    # CuPy's sort is always stable and older CuPy rejects the kind= argument
    order = np.argsort(indices, kind="stable") if xp is np else xp.argsort(indices)
    sorted_idx = indices[order]
    new = sorted_idx[1:] != sorted_idx[:-1]
    if bool(new.all()):
        return indices, values
    starts = xp.concatenate([xp.zeros(1, dtype=xp.intp), xp.flatnonzero(new) + 1])
    if xp is np:
        summed = np.add.reduceat(values[order], starts, axis=0)
    else:  # CuPy has no ufunc.reduceat: scatter-add by group number instead
        group = xp.cumsum(xp.concatenate([xp.zeros(1, dtype=xp.intp), new.astype(xp.intp)]))
        summed = xp.zeros((starts.shape[0], *values.shape[1:]), dtype=values.dtype)
        add_at = getattr(xp.add, "at", None)  # CuPy >= 13; cupyx.scatter_add before
        if add_at is None:
            add_at = importlib.import_module("cupyx").scatter_add
        add_at(summed, group, values[order])
    return sorted_idx[starts], summed


# ----------------------------------------------------------------------- NumPy blocking

#: Elements per block when NumPy applies an element-wise rule to a large array. Each
#: rule makes several passes (and a temporary) over its operands; on blocks that fit in
#: the CPU's L2 cache those passes cost one trip to memory instead of several.
BLOCK_ELEMENTS = 1 << 16


def blocks(
    xp: ModuleType, var: Array, g: Array, slots: Mapping[str, Array]
) -> Iterator[tuple[Array, Array, Slots]]:
    """``(var, g, slots)`` in aligned flat blocks (views), or whole where blocking does
    not apply (CuPy, small or non-contiguous arrays)."""
    arrays = (var, g, *slots.values())
    if xp is not np or var.size <= BLOCK_ELEMENTS or not all(a.flags.c_contiguous for a in arrays):
        yield var, g, dict(slots)
        return
    flat_var, flat_g = var.reshape(-1), g.reshape(-1)
    flat_slots = {n: s.reshape(-1) for n, s in slots.items()}
    for start in range(0, var.size, BLOCK_ELEMENTS):
        b = slice(start, start + BLOCK_ELEMENTS)
        yield flat_var[b], flat_g[b], {n: s[b] for n, s in flat_slots.items()}


# -------------------------------------------------------------------------- CuPy fusion


@functools.cache
def fused(name: str) -> Any:
    """A fused CuPy element-wise kernel for a dense update (built on first use)."""
    import cupy as cp

    bodies = {
        "sgd": ("T g, T lr", "T var", "var -= g * lr;"),
        "momentum": (
            "T g, T lr, T mu",
            "T var, T accum",
            "accum = accum * mu + g; var -= lr * accum;",
        ),
        "nesterov": (
            "T g, T lr, T mu",
            "T var, T accum",
            "accum = accum * mu + g; var -= g * lr + accum * mu * lr;",
        ),
        "adagrad": (
            "T g, T lr",
            "T var, T accum",
            "accum += g * g; var -= lr * g / sqrt(accum);",
        ),
        "adam": (
            "T g, T lr_t, T one_m_b1, T one_m_b2, T eps",
            "T var, T m, T v",
            "m += (g - m) * one_m_b1; v += (g * g - v) * one_m_b2;"
            " var -= lr_t * m / (sqrt(v) + eps);",
        ),
    }
    inp, out, body = bodies[name]
    return cp.ElementwiseKernel(inp, out, body, f"qps_{name}_dense")


def fusable(xp: ModuleType, var: Array) -> bool:
    return use_fused_kernels and xp is not np and var.dtype in (np.float32, np.float64)


# --------------------------------------------------------------------------- validation


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{owner}: {name} must be a number, got {value!r}")
    f = float(value)
    if not math.isfinite(f):
        raise InvalidArgumentError(f"{owner}: {name} must be finite, got {value!r}")
    return f


def step_of(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise InvalidArgumentError(f"step must be an int >= 1 (1-based update count), got {step!r}")
    return int(step)


def _check_var(var: Any) -> ModuleType:
    xp = xp_of(var)
    if not isinstance(var, xp.ndarray):
        raise InvalidArgumentError(f"var must be an ndarray, got {type(var).__name__}")
    if np.dtype(var.dtype).kind != "f":
        raise InvalidArgumentError(f"var must have a floating dtype, got {var.dtype}")
    if not getattr(var.flags, "writeable", True):
        raise InvalidArgumentError("var is read-only; optimizers update it in place")
    return xp


def _as_array(xp: ModuleType, x: Any, what: str) -> Array:
    try:
        return xp.asarray(x)
    except Exception as exc:
        raise InvalidArgumentError(f"{what} cannot be read as an array: {exc}") from exc


def _check_same_dtype(var: Array, other: Array, what: str) -> None:
    if other.dtype != var.dtype:
        raise InvalidArgumentError(f"{what} has dtype {other.dtype}, but var has {var.dtype}")


# ---------------------------------------------------------------------------- the rules


@dataclasses.dataclass(frozen=True)
class Optimizer(abc.ABC):
    """Base class of the rules: validation, slots, dense/sparse dispatch and the spec."""

    name: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, (bool, np.bool_)):
                    raise InvalidArgumentError(
                        f"{type(self).__name__}: {f.name} must be a bool, got {value!r}"
                    )
                object.__setattr__(self, f.name, bool(value))
            else:
                object.__setattr__(self, f.name, _number(type(self).__name__, f.name, value))
        self._validate()

    @abc.abstractmethod
    def _validate(self) -> None:
        """Check the ranges of the hyper-parameters (raise InvalidArgumentError)."""

    def _require(self, ok: bool, name: str, rule: str) -> None:
        if not ok:
            raise InvalidArgumentError(
                f"{type(self).__name__}: {name} must be {rule}, got {getattr(self, name)!r}"
            )

    # ---- slots

    def slot_initial_values(self) -> dict[str, float]:
        """Slot name → the value every element of that slot starts at."""
        return {}

    def slot_names(self) -> tuple[str, ...]:
        """The names of this rule's per-variable slots (TF's slot names)."""
        return tuple(self.slot_initial_values())

    def init_slots(self, var: Array) -> Slots:
        """Fresh slots for ``var``: arrays of its shape, dtype and module (NumPy/CuPy)."""
        xp = _check_var(var)
        return {
            n: xp.full(var.shape, v, dtype=var.dtype) for n, v in self.slot_initial_values().items()
        }

    def _check_slots(self, var: Array, slots: Mapping[str, Array]) -> None:
        for n in self.slot_names():
            if n not in slots:
                raise InvalidArgumentError(f"{type(self).__name__}: slot {n!r} is missing")
            s = slots[n]
            if xp_of(s) is not xp_of(var) or s.shape != var.shape or s.dtype != var.dtype:
                raise InvalidArgumentError(
                    f"{type(self).__name__}: slot {n!r} must match var "
                    f"({var.dtype}{list(var.shape)}), got {s.dtype}{list(s.shape)}"
                )
            if not getattr(s.flags, "writeable", True):
                raise InvalidArgumentError(f"{type(self).__name__}: slot {n!r} is read-only")

    # ---- application

    def apply_dense(self, var: Array, grad: Array, slots: Mapping[str, Array], step: int) -> None:
        """Apply ``grad`` (same shape and dtype as ``var``) to all of ``var``, in place."""
        xp = _check_var(var)
        grad = _as_array(xp, grad, "grad")
        _check_same_dtype(var, grad, "grad")
        if grad.shape != var.shape:
            raise InvalidArgumentError(
                f"var and grad do not have the same shape: {list(var.shape)} vs {list(grad.shape)}"
            )
        self._check_slots(var, slots)
        t = step_of(step)
        work = dict(slots)
        if var.ndim == 0:  # 0-d arithmetic yields scalars, not arrays: use 1-element views
            var, grad = var.reshape(1), grad.reshape(1)
            work = {k: v.reshape(1) for k, v in work.items()}
        self._dense(xp, var, grad, work, t)

    def apply_sparse(
        self,
        var: Array,
        indices: Array,
        values: Array,
        slots: Mapping[str, Array],
        step: int,
    ) -> None:
        """Apply gradient rows: ``values[i]`` is the gradient of ``var[indices[i]]``.

        Repeated indices are summed first. Rows not named (and their slot rows) stay as
        they are, except with ``Adam(lazy=False)``, which follows TF1 (see :class:`Adam`).
        """
        xp = _check_var(var)
        if var.ndim < 1:
            raise InvalidArgumentError("a sparse update needs a var of rank >= 1")
        indices = _as_array(xp, indices, "indices")
        values = _as_array(xp, values, "values")
        if indices.ndim != 1 or np.dtype(indices.dtype).kind not in "iu":
            raise InvalidArgumentError(
                f"indices must be a 1-D integer array, got {indices.dtype}{list(indices.shape)}"
            )
        _check_same_dtype(var, values, "values")
        if values.ndim < 1 or values.shape[0] != indices.shape[0]:
            raise InvalidArgumentError(
                "grad must be the same size as indices in the first dimension: "
                f"{list(values.shape)} vs {indices.shape[0]} indices"
            )
        if values.shape[1:] != var.shape[1:]:
            raise InvalidArgumentError(
                f"grad rows have shape {list(values.shape[1:])}, var rows {list(var.shape[1:])}"
            )
        n = var.shape[0]
        if indices.shape[0]:
            bad = (indices < 0) | (indices >= n) if indices.dtype.kind == "i" else indices >= n
            if bool(bad.any()):
                off = int(xp.argmax(bad))
                raise InvalidArgumentError(
                    f"Index {int(indices[off])} at offset {off} in indices is out of range [0, {n})"
                )
        self._check_slots(var, slots)
        t = step_of(step)
        idx, vals = dedupe(xp, indices, values)
        self._sparse(xp, var, idx, vals, dict(slots), t)

    # ---- the math: subclasses implement _update (in place on the arrays given)

    @abc.abstractmethod
    def _update(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        """The rule itself, element-wise and in place on ``var`` and ``slots``."""

    def _dense(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        """The rule over the whole variable: one fused CuPy kernel where the rule has one
        (see :meth:`_kernel`), else on NumPy block by block (see blocks)."""
        kernel = self._kernel(slots, step) if fusable(xp, var) else None
        if kernel is not None:
            name, scalars, state = kernel
            fused(name)(g, *map(var.dtype.type, scalars), var, *state)
            return
        for v, gb, sb in blocks(xp, var, g, slots):
            self._update(xp, v, gb, sb, step)

    def _kernel(self, slots: Slots, step: int) -> Kernel | None:
        """``(kernel name, its scalars, the slots it updates)`` of this rule's fused dense
        CuPy kernel (:func:`qps.optimizer_kernels.fused`), or None for the generic path."""
        return None

    def _sparse(
        self, xp: ModuleType, var: Array, idx: Array, g: Array, slots: Slots, step: int
    ) -> None:
        """Lazy sparse update: gather the rows, run the dense rule on them, scatter back
        (``idx`` holds no repeats)."""
        if idx.shape[0] == 0:
            return
        rows = var[idx]
        slot_rows = {n: s[idx] for n, s in slots.items() if n in self.slot_names()}
        self._update(xp, rows, g, slot_rows, step)
        var[idx] = rows
        for n, r in slot_rows.items():
            slots[n][idx] = r

    # ---- spec

    def hparams(self) -> dict[str, Any]:
        """The hyper-parameters as a dict of plain floats and bools."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_spec(self) -> dict[str, Any]:
        """A JSON-able description from which :func:`from_spec` rebuilds this rule."""
        return {"optimizer": self.name, "version": SPEC_VERSION, "hparams": self.hparams()}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Optimizer:
        """Rebuild a rule from :meth:`to_spec`'s output (see the module's :func:`from_spec`)."""
        from qps.optimizers import from_spec  # the registry of rules, built on this class

        opt = from_spec(spec)
        if not isinstance(opt, cls):
            raise InvalidArgumentError(f"spec describes {opt.name!r}, not a {cls.__name__}")
        return opt

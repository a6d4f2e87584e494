"""Optimizer rules with TensorFlow 1.x's formulas and defaults, dense and sparse.

Each rule is a frozen dataclass of hyper-parameters (validated on construction, named as
in ``tf.compat.v1.train.*Optimizer``) with four operations:

* ``slot_names()`` and ``init_slots(var)``: the per-variable state (TF's slots) and its
  initial values, arrays of ``var``'s shape, dtype and array module;
* ``apply_dense(var, grad, slots, step)``: one update of the whole variable, in place;
* ``apply_sparse(var, indices, values, slots, step)``: one update of some rows
  (``var[indices[i]]`` gets ``values[i]``), in place. Duplicate indices are summed first,
  as TF's ``Optimizer.apply_gradients`` does (not applied one after the other like the raw
  ``SparseApply*`` kernels). Only the given rows of ``var`` and of the slots change,
  except for :class:`Adam` with ``lazy=False`` (TF1's ``AdamOptimizer``), which decays
  ``m`` and ``v`` and moves ``var`` on every row, as TF1 does.

``step`` is the 1-based number ``t`` of the update (an ``int >= 1``); only :class:`Adam`
reads it, for its bias correction ``β^t``. TF1 keeps ``beta1_power``/``beta2_power`` as
variables that start at ``β`` and are multiplied by ``β`` after every ``apply_gradients``
call, so the k-th call uses ``β^k``; with ``global_step`` passed to ``apply_gradients`` that
is ``global_step + 1`` read *before* the call's increment. Callers pass that number. The
rules keep no other state than their slots, so a rule is rebuilt exactly from
:meth:`Optimizer.to_spec` (plain JSON) and the slots.

The math is written once against the arrays' module (NumPy or CuPy, see
:mod:`qps.backend`); with CuPy, dense SGD, Momentum, Adagrad and Adam run as fused
element-wise kernels. Everything is validated before anything is written, so a bad call
changes nothing. See ``docs/optimizers.md`` for the formulas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from qps.errors import InvalidArgumentError
from qps.optimizer_base import SPEC_VERSION, Array, Kernel, Optimizer, Slots, blocks, step_of


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """``tf.train.GradientDescentOptimizer``: ``var -= lr·g``. No slots."""

    name: ClassVar[str] = "sgd"
    learning_rate: float

    def _validate(self) -> None:
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")

    def _update(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        var -= g * self.learning_rate

    def _kernel(self, slots: Slots, step: int) -> Kernel:
        return "sgd", (self.learning_rate,), ()

    def _sparse(
        self, xp: ModuleType, var: Array, idx: Array, g: Array, slots: Slots, step: int
    ) -> None:
        if idx.shape[0]:
            var[idx] -= g * self.learning_rate


@dataclasses.dataclass(frozen=True)
class Momentum(Optimizer):
    """``tf.train.MomentumOptimizer``: ``accum = μ·accum + g``; ``var -= lr·accum``, or with
    Nesterov ``var -= lr·g + lr·μ·accum`` (the new accum). Slot ``momentum`` (0)."""

    name: ClassVar[str] = "momentum"
    learning_rate: float
    momentum: float
    use_nesterov: bool = False

    def _validate(self) -> None:
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(self.momentum >= 0, "momentum", ">= 0")

    def slot_initial_values(self) -> dict[str, float]:
        return {"momentum": 0.0}

    def _update(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        accum = slots["momentum"]
        lr, mu = self.learning_rate, self.momentum
        accum *= mu
        accum += g
        if self.use_nesterov:
            t = g * lr
            var -= t
            xp.multiply(accum, mu * lr, out=t)
        else:
            t = accum * lr
        var -= t

    def _kernel(self, slots: Slots, step: int) -> Kernel:
        name = "nesterov" if self.use_nesterov else "momentum"
        return name, (self.learning_rate, self.momentum), (slots["momentum"],)


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """``tf.train.AdagradOptimizer``: ``accum += g²``; ``var -= lr·g/√accum`` (no ε, as in
    TF1's ApplyAdagrad). Slot ``accumulator`` (``initial_accumulator_value``, 0.1)."""

    name: ClassVar[str] = "adagrad"
    learning_rate: float
    initial_accumulator_value: float = 0.1

    def _validate(self) -> None:
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(self.initial_accumulator_value > 0, "initial_accumulator_value", "> 0")

    def slot_initial_values(self) -> dict[str, float]:
        return {"accumulator": self.initial_accumulator_value}

    def _update(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        accum = slots["accumulator"]
        t = xp.multiply(g, g)
        accum += t
        xp.sqrt(accum, out=t)
        xp.divide(g, t, out=t)
        t *= self.learning_rate
        var -= t

    def _kernel(self, slots: Slots, step: int) -> Kernel:
        return "adagrad", (self.learning_rate,), (slots["accumulator"],)


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """``tf.train.AdamOptimizer`` (TF1's ApplyAdam kernel)::

        lr_t = lr·√(1−β2^t)/(1−β1^t)     (t = step)
        m += (g − m)·(1 − β1);  v += (g² − v)·(1 − β2)
        var -= lr_t·m/(√v + ε)          (ε outside the square root)

    Slots ``m`` and ``v`` (0). ``β^t`` is computed from ``step`` in double precision
    instead of TF's running product of ``beta*_power`` variables.

    Sparse, ``lazy=False`` (TF1's default ``AdamOptimizer._apply_sparse``): ``m ← β1·m`` and
    ``v ← β2·v`` on **every** row, then the rows' ``(1−β1)·g`` and ``(1−β2)·g²`` are added,
    and **every** row moves by ``lr_t·m/(√v+ε)`` (rows whose m is 0 stay put).
    ``lazy=True`` (``tf.contrib.opt.LazyAdamOptimizer``) applies the dense formula to the
    given rows only, at a cost that does not grow with the number of rows.
    """

    name: ClassVar[str] = "adam"
    learning_rate: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    lazy: bool = False

    def _validate(self) -> None:
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(0 <= self.beta1 < 1, "beta1", "in [0, 1)")
        self._require(0 <= self.beta2 < 1, "beta2", "in [0, 1)")
        self._require(self.epsilon > 0, "epsilon", "> 0")

    def slot_initial_values(self) -> dict[str, float]:
        return {"m": 0.0, "v": 0.0}

    def lr_t(self, step: int) -> float:
        """The bias-corrected step size of update number ``step`` (1-based)."""
        t = step_of(step)
        return self.learning_rate * math.sqrt(1.0 - self.beta2**t) / (1.0 - self.beta1**t)

    def _update(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        m, v = slots["m"], slots["v"]
        t = xp.subtract(g, m)
        t *= 1.0 - self.beta1
        m += t
        xp.multiply(g, g, out=t)
        t -= v
        t *= 1.0 - self.beta2
        v += t
        self._move(xp, var, m, v, t, step)

    def _move(self, xp: ModuleType, var: Array, m: Array, v: Array, t: Array, step: int) -> None:
        xp.sqrt(v, out=t)
        t += self.epsilon
        xp.divide(m, t, out=t)
        t *= self.lr_t(step)
        var -= t

    def _kernel(self, slots: Slots, step: int) -> Kernel:
        scalars = (self.lr_t(step), 1.0 - self.beta1, 1.0 - self.beta2, self.epsilon)
        return "adam", scalars, (slots["m"], slots["v"])

    def _sparse(
        self, xp: ModuleType, var: Array, idx: Array, g: Array, slots: Slots, step: int
    ) -> None:
        if self.lazy:
            super()._sparse(xp, var, idx, g, slots, step)
            return
        # TF1: decay m and v everywhere, add the rows' contributions, move every row.
        mv = {"m": slots["m"], "v": slots["v"]}
        for _, _, b in blocks(xp, var, var, mv):
            b["m"] *= self.beta1
            b["v"] *= self.beta2
        if idx.shape[0]:
            mv["m"][idx] += g * (1.0 - self.beta1)
            mv["v"][idx] += (g * g) * (1.0 - self.beta2)
        for var_b, _, b in blocks(xp, var, var, mv):
            self._move(xp, var_b, b["m"], b["v"], xp.empty_like(var_b), step)


@dataclasses.dataclass(frozen=True)
class RMSProp(Optimizer):
    """``tf.train.RMSPropOptimizer``::

        ms += (g² − ms)·(1 − ρ)
        mg += (g − mg)·(1 − ρ)                     (centered only)
        mom = μ·mom + lr·g/√(ms + ε)              (centered: √(ms − mg² + ε))
        var -= mom

    Slots ``rms`` (**1.0**, as TF1 initialises it), ``momentum`` (0) and, when centered,
    ``mg`` (0).
    """

    name: ClassVar[str] = "rmsprop"
    learning_rate: float
    decay: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-10
    centered: bool = False

    def _validate(self) -> None:
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(0 <= self.decay <= 1, "decay", "in [0, 1]")
        self._require(self.momentum >= 0, "momentum", ">= 0")
        self._require(self.epsilon >= 0, "epsilon", ">= 0")

    def slot_initial_values(self) -> dict[str, float]:
        init = {"rms": 1.0, "momentum": 0.0}
        if self.centered:
            init["mg"] = 0.0
        return init

    def _update(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        ms, mom = slots["rms"], slots["momentum"]
        one_m_rho = 1.0 - self.decay
        t = xp.multiply(g, g)
        t -= ms
        t *= one_m_rho
        ms += t
        if self.centered:
            mg = slots["mg"]
            xp.subtract(g, mg, out=t)
            t *= one_m_rho
            mg += t
            xp.multiply(mg, mg, out=t)
            xp.subtract(ms, t, out=t)
            t += self.epsilon
        else:
            xp.add(ms, self.epsilon, out=t)
        xp.sqrt(t, out=t)
        xp.divide(g, t, out=t)
        t *= self.learning_rate
        mom *= self.momentum
        mom += t
        var -= mom


@dataclasses.dataclass(frozen=True)
class Ftrl(Optimizer):
    """``tf.train.FtrlOptimizer`` (TF1's ApplyFtrl / ApplyFtrlV2 kernels), p = lr_power::

        n' = n + g²
        gs = g + 2·l2_shrinkage·var
        linear += gs − (n'^(−p) − n^(−p))/lr · var
        quad = n'^(−p)/lr + 2·l2'               (l2' = l2 + beta/(2·lr))
        var = (sign(linear)·l1 − linear)/quad  if |linear| > l1  else 0
        n = n'

    Slots ``accum`` (``initial_accumulator_value``, 0.1) and ``linear`` (0).
    """

    name: ClassVar[str] = "ftrl"
    learning_rate: float
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0

    def _validate(self) -> None:
        self._require(self.learning_rate > 0, "learning_rate", "> 0")
        self._require(self.learning_rate_power <= 0, "learning_rate_power", "<= 0")
        self._require(self.initial_accumulator_value >= 0, "initial_accumulator_value", ">= 0")
        for n in (
            "l1_regularization_strength",
            "l2_regularization_strength",
            "l2_shrinkage_regularization_strength",
            "beta",
        ):
            self._require(getattr(self, n) >= 0, n, ">= 0")

    def slot_initial_values(self) -> dict[str, float]:
        return {"accum": self.initial_accumulator_value, "linear": 0.0}

    def _update(self, xp: ModuleType, var: Array, g: Array, slots: Slots, step: int) -> None:
        accum, linear = slots["accum"], slots["linear"]
        lr, p = self.learning_rate, self.learning_rate_power
        l1 = self.l1_regularization_strength
        l2 = self.l2_regularization_strength + self.beta / (2.0 * lr)
        shrink = self.l2_shrinkage_regularization_strength
        new_accum = xp.multiply(g, g)
        new_accum += accum
        if p == -0.5:
            a, b = xp.sqrt(new_accum), xp.sqrt(accum)
        else:
            a, b = xp.power(new_accum, -p), xp.power(accum, -p)
        b -= a  # b = −(n'^(−p) − n^(−p))
        b /= lr
        b *= var
        linear += b
        linear += g
        if shrink > 0:
            linear += var * (2.0 * shrink)
        a /= lr  # a = quad
        a += 2.0 * l2
        with np.errstate(divide="ignore", invalid="ignore"):
            x = xp.clip(linear, -l1, l1)
            x -= linear
            x /= a
            var[...] = xp.where(xp.abs(linear) > l1, x, 0)
        accum[...] = new_accum


# ----------------------------------------------------------------------------- registry

OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam, RMSProp, Ftrl)
}
_ALIASES = {"gradientdescent": "sgd"}


def _canonical(name: Any) -> str:
    if not isinstance(name, str):
        raise InvalidArgumentError(f"optimizer name must be a str, got {name!r}")
    key = name.strip().lower().replace("_", "").replace("-", "")
    key = key.removesuffix("optimizer")
    key = _ALIASES.get(key, key)
    if key not in OPTIMIZERS:
        raise InvalidArgumentError(
            f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}"
        )
    return key


def make_optimizer(name: str, **hparams: Any) -> Optimizer:
    """Build a rule by name (``sgd``/``gradient_descent``, ``momentum``, ``adagrad``,
    ``adam``, ``rmsprop``, ``ftrl``; case, ``_``/``-`` and an ``Optimizer`` suffix are
    ignored) with TF's keyword arguments."""
    cls = OPTIMIZERS[_canonical(name)]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(hparams) - known)
    if unknown:
        raise InvalidArgumentError(
            f"{cls.__name__}: unknown hyper-parameter(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.name not in hparams
    ]
    if missing:
        raise InvalidArgumentError(f"{cls.__name__}: missing {', '.join(missing)}")
    return cls(**hparams)


def from_spec(spec: Mapping[str, Any]) -> Optimizer:
    """Rebuild a rule from :meth:`Optimizer.to_spec`'s output (e.g. after a JSON round trip
    through Redis). Unknown versions, names or hyper-parameters are rejected."""
    if not isinstance(spec, Mapping):
        raise InvalidArgumentError(f"optimizer spec must be a mapping, got {type(spec).__name__}")
    extra = sorted(set(spec) - {"optimizer", "version", "hparams"})
    if extra:
        raise InvalidArgumentError(f"optimizer spec has unknown key(s) {', '.join(extra)}")
    if spec.get("version") != SPEC_VERSION:
        raise InvalidArgumentError(
            f"optimizer spec version {spec.get('version')!r} is not supported "
            f"(expected {SPEC_VERSION})"
        )
    hparams = spec.get("hparams", {})
    if not isinstance(hparams, Mapping) or not all(isinstance(k, str) for k in hparams):
        raise InvalidArgumentError("optimizer spec 'hparams' must be a mapping of names")
    return make_optimizer(spec.get("optimizer", ""), **hparams)  # a non-str name is rejected


__all__ = [
    "OPTIMIZERS",
    "SGD",
    "SPEC_VERSION",
    "Adagrad",
    "Adam",
    "Ftrl",
    "Momentum",
    "Optimizer",
    "RMSProp",
    "from_spec",
    "make_optimizer",
]

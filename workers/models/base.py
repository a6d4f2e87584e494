"""The model protocol: what a worker needs from a model, and the types it speaks in.

A model is a plain object (no state of its own besides its configuration) with:

* :meth:`Model.params_spec` — the parameters as :class:`ParamSpec` (name, shape, dtype,
  initializer, sparse or not), in a fixed order. Each maps onto one
  :class:`qps.Variable` (:meth:`ParamSpec.variable`).
* :meth:`Model.init_params` — initial values from a NumPy ``Generator``.
* :meth:`Model.loss_and_grads` — ``(loss, grads)`` of one batch: the mean loss as a
  float; a dense array per dense parameter and a :class:`~qps.ps.messages.SparseGradient`
  ``(indices, values)`` per sparse (row-wise) one.
* :meth:`Model.rows_needed` — for a sparse model, the rows of each sparse parameter a
  batch reads, so a worker pulls only those (``{}`` for a dense model).
* :meth:`Model.predict` and :meth:`Model.accuracy` — evaluation.

``params`` maps every parameter name to its value: an array (NumPy or CuPy; the model
computes with the module of the arrays it gets), or, for a sparse parameter, either the
whole table or :class:`Rows` (some rows of it, as pulled with
:meth:`qps.ps.client.PSClient.pull_rows`). A batch is a tuple of arrays whose last one
holds the labels; which arrays come before is the model's own business (``(x, y)`` for
the dense models). See ``docs/models.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from qps import initializers
from qps.backend import asnumpy, to_backend, xp_of
from qps.errors import InvalidArgumentError
from qps.initializers import Initializer
from qps.ps.messages import SparseGradient

if TYPE_CHECKING:
    from qps.transport import Client
    from qps.variables import Variable

__all__ = [
    "Array",
    "BaseModel",
    "Batch",
    "Gradient",
    "Model",
    "ParamSpec",
    "Params",
    "Rows",
    "SparseGradient",
    "check_params",
    "grads_to_host",
    "he_normal",
    "local_rows",
    "narrowed",
    "params_to",
]

Array = Any  # a NumPy or CuPy ndarray
Batch = Sequence[Array]
Gradient = Any  # an array, or a SparseGradient for a sparse parameter


@dataclass(frozen=True)
class Rows:
    """Some rows of a row-wise parameter: ``values[k]`` is row ``indices[k]`` of the
    whole table. ``indices`` are int64, distinct and sorted (what
    :meth:`Model.rows_needed` returns)."""

    indices: Array
    values: Array


Params = Mapping[str, Any]  # name -> array, or Rows for a sparse parameter


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a model.

    Attributes:
        name: the variable name (``[A-Za-z0-9_.:/-]``).
        shape: its full shape.
        dtype: its dtype (``float32`` for the built-in models).
        initializer: a seeded :mod:`qps.initializers` initializer that makes the value,
            or ``None`` when :meth:`Model.init_params` draws it from its ``rng`` (the
            dense layers: W4's sequential He-normal stream cannot be split per variable).
        sparse: read and updated by rows (an embedding table): the worker pulls only
            :meth:`Model.rows_needed` and pushes a ``SparseGradient``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any] = field(default_factory=lambda: np.dtype(np.float32))
    initializer: Initializer | None = None
    sparse: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def variable(
        self,
        init_value: Any = None,
        *,
        container: str | None = None,
        client: Client | None = None,
    ) -> Variable:
        """The :class:`qps.Variable` holding this parameter (not created yet: its first
        use or ``create()`` does that). ``init_value`` (an array from
        :meth:`Model.init_params`) is its initial value when :attr:`initializer` is
        ``None``.

        Raises:
            InvalidArgumentError: no initializer and no ``init_value``.
        """
        from qps.variables import Variable

        init: Any = self.initializer
        if init is None:
            if init_value is None:
                raise InvalidArgumentError(
                    f"parameter '{self.name}' is drawn by init_params(): pass its value"
                )
            init = initializers.Array(asnumpy(init_value))
        return Variable(self.name, self.shape, self.dtype, init, container=container, client=client)


@runtime_checkable
class Model(Protocol):
    """What a worker calls. Implement these (or subclass :class:`BaseModel`, which
    supplies :meth:`accuracy`, :meth:`rows_needed` and :meth:`loss`)."""

    #: the spec string that builds this model again (e.g. ``"mlp:64,128,10"``)
    spec: str

    def params_spec(self) -> list[ParamSpec]:
        """The parameters, in a fixed order."""
        ...

    def init_params(self, rng: np.random.Generator) -> dict[str, Array]:
        """Initial values (NumPy arrays) of every parameter."""
        ...

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, dict[str, Gradient]]:
        """Mean loss of ``batch`` and its gradient for every parameter."""
        ...

    def rows_needed(self, batch: Batch) -> dict[str, Array]:
        """Sparse parameter name -> the sorted distinct rows ``batch`` reads."""
        ...

    def predict(self, params: Params, batch: Batch) -> Array:
        """Predicted labels (int64 ``[N]``) of the examples of ``batch``."""
        ...

    def accuracy(self, params: Params, batch: Batch) -> float:
        """The fraction of ``batch`` that :meth:`predict` gets right."""
        ...


class BaseModel:
    """Shared plumbing of the built-in models; user models may subclass it too.

    Subclasses set :attr:`spec` and implement :meth:`params_spec`,
    :meth:`init_params`, :meth:`forward_loss` / :meth:`loss_and_grads` and
    :meth:`predict`.
    """

    spec: str = ""

    def params_spec(self) -> list[ParamSpec]:
        raise NotImplementedError

    def init_params(self, rng: np.random.Generator) -> dict[str, Array]:
        raise NotImplementedError

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, dict[str, Gradient]]:
        raise NotImplementedError

    def predict(self, params: Params, batch: Batch) -> Array:
        raise NotImplementedError

    def rows_needed(self, batch: Batch) -> dict[str, Array]:
        return {}

    def init_drawn(self, rng: np.random.Generator) -> dict[str, Array]:
        """The values :meth:`init_params` draws from ``rng`` (the parameters without an
        initializer of their own); models with large tables override it so the tables
        are not made."""
        values = self.init_params(rng)
        return {p.name: values[p.name] for p in self.params_spec() if p.initializer is None}

    def loss(self, params: Params, batch: Batch) -> float:
        """The mean loss of ``batch`` (the gradients are computed and dropped)."""
        return self.loss_and_grads(params, batch)[0]

    def accuracy(self, params: Params, batch: Batch) -> float:
        labels = batch[-1]
        n = int(labels.shape[0])
        if n == 0:
            return 0.0
        pred = self.predict(params, batch)
        return float((pred == labels.reshape(pred.shape)).sum()) / n

    def variables(
        self,
        rng: np.random.Generator | None = None,
        *,
        container: str | None = None,
        client: Client | None = None,
    ) -> dict[str, Variable]:
        """A :class:`qps.Variable` per parameter, initialized as :meth:`init_params`
        with ``rng`` (default ``default_rng(0)``, W4's) would. Parameters with their own
        initializer keep it (a huge table is never drawn here)."""
        values = self.init_drawn(rng if rng is not None else np.random.default_rng(0))
        return {
            p.name: p.variable(values.get(p.name), container=container, client=client)
            for p in self.params_spec()
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def grads_to_host(grads: Mapping[str, Gradient]) -> dict[str, Gradient]:
    """``grads`` with every array on the host (NumPy), ready for ``PSClient.push``: a
    no-op for NumPy arrays, one device-to-host copy per array for CuPy ones."""
    out: dict[str, Gradient] = {}
    for name, g in grads.items():
        if isinstance(g, SparseGradient):
            out[name] = SparseGradient(asnumpy(g.indices).astype(np.int64), asnumpy(g.values))
        else:
            out[name] = asnumpy(g)
    return out


def narrowed(grads: Mapping[str, Gradient], dtype: Any) -> dict[str, Gradient]:
    """``grads`` with every floating-point array wider than ``dtype`` cast to it (the
    values of a sparse gradient; its indices stay int64): gradients compressed for the
    wire (``qps worker --grad-dtype``), on the device where they are (half the bytes
    to copy back from a GPU too). ``None`` leaves them as they are."""
    if dtype is None:
        return dict(grads)
    want = np.dtype(dtype)

    def cast(a: Any) -> Any:
        d = np.dtype(a.dtype)
        return a.astype(want) if d.kind == "f" and d.itemsize > want.itemsize else a

    out: dict[str, Gradient] = {}
    for name, g in grads.items():
        if isinstance(g, SparseGradient):
            out[name] = SparseGradient(g.indices, cast(g.values))
        else:
            out[name] = cast(g)
    return out


def params_to(params: Params, xp: ModuleType) -> dict[str, Any]:
    """``params`` with every array (and :class:`Rows`) moved to the module ``xp``
    (``numpy`` or ``cupy``), e.g. pulled host arrays onto the GPU."""
    out: dict[str, Any] = {}
    for name, v in params.items():
        if isinstance(v, Rows):
            out[name] = Rows(to_backend(v.indices, xp), to_backend(v.values, xp))
        else:
            out[name] = to_backend(v, xp)
    return out


def he_normal(rng: np.random.Generator, fan_in: int, fan_out: int) -> Array:
    """W4's layer init: ``rng.standard_normal((fan_in, fan_out), float32) *
    np.sqrt(2 / fan_in)`` as float32. The product is taken in float64 and rounded once
    (what NumPy computes for that expression before a cast to float32; a product in
    float32 arithmetic can differ from it by one ulp)."""
    w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
    return (w * np.sqrt(2.0 / fan_in)).astype(np.float32)


def check_params(model: Model, params: Params) -> None:
    """Check that ``params`` holds every parameter of ``model`` with its shape (a
    :class:`Rows` with the row shape for a sparse one).

    Raises:
        InvalidArgumentError: a missing parameter or a wrong shape.
    """
    for p in model.params_spec():
        if p.name not in params:
            raise InvalidArgumentError(f"params has no '{p.name}' (the model needs it)")
        v = params[p.name]
        if isinstance(v, Rows):
            if not p.sparse:
                raise InvalidArgumentError(f"'{p.name}' is dense: pass the whole array")
            shape, want = tuple(v.values.shape[1:]), p.shape[1:]
        else:
            shape, want = tuple(getattr(v, "shape", ())), p.shape
        if shape != want:
            raise InvalidArgumentError(
                f"'{p.name}' has shape {list(shape)}, the model needs {list(want)}"
            )


def local_rows(name: str, value: Any, ids: Array) -> tuple[Array, Array | None]:
    """``(table, local ids)`` to index a sparse parameter's value with global ``ids``.

    For a whole table the ids are used as they are (``None`` is returned as the map);
    for :class:`Rows` the ids are mapped to positions in ``value.values``, and the map
    (``value.indices``) comes back so gradients can be turned into global rows again.

    Raises:
        InvalidArgumentError: an id (other than the padding ``-1``) whose row is not
            among the pulled ones.
    """
    if not isinstance(value, Rows):
        return value, None
    xp = xp_of(value.indices, ids)
    have = xp.asarray(value.indices)
    pos = xp.searchsorted(have, ids)
    pos = xp.minimum(pos, max(int(have.shape[0]) - 1, 0))
    valid = ids >= 0
    found = ~valid if int(have.shape[0]) == 0 else (have[pos] == ids) | ~valid
    if not bool(found.all()):
        missing = int(ids.reshape(-1)[int(xp.flatnonzero(~found.reshape(-1))[0])])
        raise InvalidArgumentError(
            f"row {missing} of '{name}' was not pulled (see rows_needed(batch))"
        )
    return value.values, xp.where(valid, pos, -1)

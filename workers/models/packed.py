""":class:`Packed`: a model's dense parameters stored as a few flat variables.

A PS shard commits each variable it owns with a script of its own, and a worker reads
and decodes each one; for a small dense model that per-variable work, not the bytes,
is most of an update's cost (docs/benchmarks.md, W6). ``Packed(model, groups)`` keeps
the model's arithmetic and stores its dense parameters, in the order of
:meth:`~workers.models.base.Model.params_spec`, flattened and joined into one vector
cut into ``groups`` parts of (nearly) equal length: the variables ``packed/0``,
``packed/1``, ... Give ``groups`` the number of PS shards and the parts spread over
them evenly (a part is placed like any variable). Sparse parameters (embedding tables)
stay variables of their own, read and updated by rows as before.

What changes for the user is what the PS holds: ``qps inspect`` and checkpoints show
the parts, not ``W1``, ``b1``...; :meth:`Packed.unpack` gives the model's parameters
back from them. Every optimizer of :mod:`qps.optimizers` acts element by element on a
dense variable, so training is the same update on the same numbers either way (the
tests check it against the unpacked model).

Spec strings: ``packed:INNER`` (one part) or ``packed:GROUPS:INNER``, e.g.
``packed:mlp:64,128,10`` or ``packed:2:mlp:64,128,10``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qps.backend import xp_of
from qps.errors import InvalidArgumentError
from qps.packing import PackLayout, layout_of
from workers.models.base import (
    Array,
    BaseModel,
    Batch,
    Gradient,
    Model,
    Params,
    ParamSpec,
)

__all__ = ["AUTO_PACK_MAX", "PACK_PREFIX", "Packed", "auto_packed", "packed_inner"]

#: the parts are named ``packed/<k>``
PACK_PREFIX = "packed/"
#: the most dense elements of a model that training packs by itself (qps worker
#: --pack): 1 MiB of float32. A larger model's cost is its bytes, not its variables.
AUTO_PACK_MAX = 1 << 18


def packed_inner(spec: str) -> str | None:
    """The inner model's spec of a packed model's spec (``packed:[GROUPS:]INNER``);
    None for any other spec."""
    name, _, options = spec.strip().partition(":")
    if name.strip().lower() != Packed.kind:
        return None
    groups, colon, rest = options.partition(":")
    return rest if colon and groups.strip().isdigit() else options


def auto_packed(model: Model, shards: int) -> Model:
    """``model`` packed into one part per PS shard (``shards``, capped by its number of
    elements) when packing pays: two or more dense parameters of one dtype, no sparse
    one, at most :data:`AUTO_PACK_MAX` elements in all; else ``model`` itself (and a
    model packed already)."""
    if isinstance(model, Packed):
        return model
    specs = model.params_spec()
    if len(specs) < 2 or any(p.sparse for p in specs) or len({p.dtype for p in specs}) > 1:
        return model
    size = sum(p.size for p in specs)
    if size > AUTO_PACK_MAX:
        return model
    try:
        return Packed(model, max(1, min(int(shards), size)))
    except InvalidArgumentError:  # a parameter already named packed/<k>
        return model


class Packed(BaseModel):
    """``model`` with its dense parameters stored as ``groups`` flat variables.

    Raises:
        InvalidArgumentError: ``groups`` not an int in [1, number of dense elements];
            a model without dense parameters, with dense parameters of several dtypes,
            or with a parameter already named ``packed/<k>``.
    """

    kind = "packed"

    def __init__(self, model: Model, groups: int = 1) -> None:
        self.inner = model
        specs = model.params_spec()
        self._dense = [p for p in specs if not p.sparse]
        self._sparse = [p for p in specs if p.sparse]
        if not self._dense:
            raise InvalidArgumentError(f"packed: {model.spec!r} has no dense parameter to pack")
        dtypes = {p.dtype for p in self._dense}
        if len(dtypes) > 1:
            raise InvalidArgumentError(
                f"packed: the dense parameters of {model.spec!r} have several dtypes "
                f"({', '.join(sorted(str(d) for d in dtypes))}); parts hold one"
            )
        self.dtype = self._dense[0].dtype
        self.size = sum(p.size for p in self._dense)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise InvalidArgumentError(f"packed: groups must be an int >= 1, got {groups!r}")
        if groups > self.size:
            raise InvalidArgumentError(
                f"packed: {groups} groups for {self.size} dense elements (at most one each)"
            )
        self.groups = groups
        names = [f"{PACK_PREFIX}{k}" for k in range(groups)]
        clash = sorted({p.name for p in specs} & set(names))
        if clash:
            raise InvalidArgumentError(f"packed: {model.spec!r} already has {', '.join(clash)}")
        self._names = names
        # part k is elements [bounds[k], bounds[k + 1]) of the joined vector
        self._bounds = [self.size * k // groups for k in range(groups + 1)]
        self._offsets: list[int] = []
        at = 0
        for p in self._dense:
            self._offsets.append(at)
            at += p.size
        count = f"{groups}:" if groups > 1 else ""
        self.spec = f"{self.kind}:{count}{model.spec}"

    def layout(self) -> PackLayout:
        """Where each packed parameter lies in the parts (the chief records it:
        :mod:`qps.packing`, ``qps var get W1``)."""
        lengths = [self._bounds[k + 1] - self._bounds[k] for k in range(self.groups)]
        return layout_of(self.dtype, list(zip(self._names, lengths)), self._dense)

    def params_spec(self) -> list[ParamSpec]:
        parts = [
            ParamSpec(name, (self._bounds[k + 1] - self._bounds[k],), self.dtype)
            for k, name in enumerate(self._names)
        ]
        return parts + list(self._sparse)

    # -- packing ---------------------------------------------------------------------
    def pack(self, values: Params) -> dict[str, Any]:
        """The parts (and the sparse parameters, as they are) of the model's parameter
        values ``values`` (arrays of one module; a sparse one may be left out)."""
        first = values[self._dense[0].name]
        xp = xp_of(first)
        flat = xp.empty(self.size, dtype=self.dtype)
        for p, at in zip(self._dense, self._offsets):
            flat[at : at + p.size] = xp.asarray(values[p.name]).reshape(-1)
        out: dict[str, Any] = {
            name: flat[self._bounds[k] : self._bounds[k + 1]] for k, name in enumerate(self._names)
        }
        for p in self._sparse:
            if p.name in values:
                out[p.name] = values[p.name]
        return out

    def unpack(self, params: Params) -> dict[str, Any]:
        """The model's parameters from the parts (views into them when there is one
        part; a copy joins several). Sparse parameters pass through."""
        if self.groups == 1:
            flat = params[self._names[0]]
        else:
            parts = [params[name] for name in self._names]
            flat = xp_of(*parts).concatenate([x.reshape(-1) for x in parts])
        if tuple(flat.shape) != (self.size,):
            raise InvalidArgumentError(
                f"packed: the parts hold {flat.shape[0]} elements, {self.inner.spec!r} "
                f"needs {self.size}"
            )
        out: dict[str, Any] = {
            p.name: flat[at : at + p.size].reshape(p.shape)
            for p, at in zip(self._dense, self._offsets)
        }
        for p in self._sparse:
            out[p.name] = params[p.name]
        return out

    # -- the model -------------------------------------------------------------------
    def init_params(self, rng: np.random.Generator) -> dict[str, Array]:
        return self.pack(self.inner.init_params(rng))

    def init_drawn(self, rng: np.random.Generator) -> dict[str, Array]:
        inner = self.inner
        drawn = inner.init_drawn(rng) if hasattr(inner, "init_drawn") else inner.init_params(rng)
        values = dict(drawn)
        for p in self._dense:  # a dense parameter with an initializer of its own
            if p.name not in values:
                if p.initializer is None:
                    raise InvalidArgumentError(
                        f"packed: {inner.spec!r} did not draw '{p.name}' and it has no initializer"
                    )
                values[p.name] = p.initializer(p.shape, p.dtype)
        parts = self.pack(values)
        return {name: parts[name] for name in self._names}

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, dict[str, Gradient]]:
        loss, grads = self.inner.loss_and_grads(self.unpack(params), batch)
        return loss, self.pack(grads)

    def rows_needed(self, batch: Batch) -> dict[str, Array]:
        return self.inner.rows_needed(batch)

    def predict(self, params: Params, batch: Batch) -> Array:
        return self.inner.predict(self.unpack(params), batch)

    def loss(self, params: Params, batch: Batch) -> float:
        inner_loss = getattr(self.inner, "loss", None)
        if callable(inner_loss):
            return float(inner_loss(self.unpack(params), batch))
        return self.inner.loss_and_grads(self.unpack(params), batch)[0]

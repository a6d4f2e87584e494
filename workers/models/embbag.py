"""A CTR-style sparse model: categorical fields -> embedding bags -> MLP.

Every field ``f`` has its own table ``emb<f>`` (``[vocab_f, dim]``, a *sparse*
parameter: read and updated by rows). An example holds, per field, a bag of ids; each bag
is pooled (sum or mean) into one ``dim`` vector, the vectors of all fields are
concatenated with the dense features, and an MLP (ReLU hidden layers) gives the logits:
one logit and the logistic loss for ``classes = 1`` (click / no click), ``classes``
logits and softmax cross-entropy otherwise.

A batch is ``(dense [N, n_dense] float, ids [N, fields, L] int64, y [N] int64)``; an id
of ``-1`` pads a bag shorter than ``L``. :meth:`EmbeddingBagMLP.rows_needed` gives each
table's distinct ids, so a worker pulls only those rows (as :class:`~workers.models.Rows`)
and pushes back a :class:`~qps.ps.messages.SparseGradient` per table with one summed row
per distinct id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from qps import initializers
from qps.backend import xp_of
from qps.errors import InvalidArgumentError
from workers import kernels
from workers.models.base import (
    Array,
    BaseModel,
    Batch,
    Gradient,
    Params,
    ParamSpec,
    SparseGradient,
    local_rows,
)
from workers.models.mlp import (
    check_widths,
    dense_backward,
    dense_forward,
    dense_init,
    dense_specs,
    features,
)

__all__ = ["EmbeddingBagMLP"]


class EmbeddingBagMLP(BaseModel):
    """Embedding bags (one table per field) + dense features -> MLP.

    Args:
        vocab: rows of each field's table (``len(vocab)`` fields).
        dim: embedding width.
        dense: number of dense features (0: none).
        hidden: hidden layer widths of the MLP (may be empty: a linear top).
        classes: 1 for a binary (logistic) output, >= 2 for softmax.
        pool: ``"sum"`` or ``"mean"`` over a bag.
        bag: ids per bag that :func:`workers.data.synthetic_ctr` draws for this model
            (the model itself takes any ``L``).
        seed: seed of the tables' initializer (``truncated_normal(stddev =
            1/sqrt(dim))``, TF's ``embedding_column`` default; seeded per table and
            row block, so a PS can initialize a partition of a table alone).

    Raises:
        InvalidArgumentError: no field, a size < 1, a bad pool mode.
    """

    kind = "embbag"

    def __init__(
        self,
        vocab: Sequence[int],
        dim: int,
        *,
        dense: int = 0,
        hidden: Sequence[int] = (64,),
        classes: int = 1,
        pool: str = "sum",
        bag: int = 1,
        seed: int = 0,
    ) -> None:
        name = type(self).__name__
        if not list(vocab):
            raise InvalidArgumentError(f"{name}: needs at least one field (table)")
        self.vocab = check_widths(vocab, f"{name} vocab", min_layers=0)
        (self.dim,) = check_widths([dim], f"{name} dim", min_layers=0)
        self.hidden = check_widths(hidden, f"{name} hidden", min_layers=0) if hidden else ()
        (self.bag,) = check_widths([bag], f"{name} bag", min_layers=0)
        (self.classes,) = check_widths([classes], f"{name} classes", min_layers=0)
        for what, v in (("dense", dense), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise InvalidArgumentError(f"{name}: {what} must be an int >= 0, got {v!r}")
        self.n_dense = int(dense)
        self.seed = int(seed)
        if pool not in kernels.POOL_MODES:
            raise InvalidArgumentError(
                f"{name}: pool must be one of {', '.join(kernels.POOL_MODES)}, got {pool!r}"
            )
        self.pool = pool
        self.fields = len(self.vocab)
        self.widths = (self.fields * self.dim + self.n_dense, *self.hidden, self.classes)
        self.layers = len(self.widths) - 1
        self.tables = [f"emb{f}" for f in range(self.fields)]
        self.spec = (
            f"{self.kind}:tables={_vocab_text(self.vocab)},dim={self.dim},dense={self.n_dense},"
            f"hidden={'-'.join(str(h) for h in self.hidden) or 'none'},classes={self.classes},"
            f"pool={self.pool},bag={self.bag},seed={self.seed}"
        )
        self._names = [p.name for p in self.params_spec()]

    # -- parameters ---------------------------------------------------------------------
    def params_spec(self) -> list[ParamSpec]:
        std = 1.0 / math.sqrt(self.dim)
        tables = [
            ParamSpec(
                name,
                (v, self.dim),
                initializer=initializers.truncated_normal(stddev=std, seed=self.seed + f),
                sparse=True,
            )
            for f, (name, v) in enumerate(zip(self.tables, self.vocab))
        ]
        return tables + dense_specs(self.widths)

    def init_params(self, rng: np.random.Generator) -> dict[str, Array]:
        out: dict[str, Array] = {}
        for p in self.params_spec():
            if p.initializer is not None:
                out[p.name] = p.initializer(p.shape, p.dtype)
        out.update(dense_init(rng, self.widths))
        return out

    def init_drawn(self, rng: np.random.Generator) -> dict[str, Array]:
        return dense_init(rng, self.widths)

    # -- batches ------------------------------------------------------------------------
    def _batch(self, batch: Batch) -> tuple[Array, Array, Array]:
        if len(batch) != 3:
            raise InvalidArgumentError(
                f"a batch of {self.kind} is (dense, ids, y), got {len(batch)} arrays"
            )
        dense, ids, y = batch
        xp = xp_of(ids)
        ids = xp.asarray(ids)
        if np.dtype(ids.dtype).kind not in "iu" or ids.ndim != 3 or ids.shape[1] != self.fields:
            raise InvalidArgumentError(
                f"ids must be int [N, {self.fields}, L], got {ids.dtype}{list(ids.shape)}"
            )
        ids = ids.astype(np.int64, copy=False)
        hi = xp.asarray(self.vocab, dtype=np.int64)[None, :, None]
        bad = (ids < -1) | (ids >= hi)
        if bool(bad.any()):
            n, f, j = (int(a[0]) for a in xp.nonzero(bad))
            raise InvalidArgumentError(
                f"ids[{n}, {f}, {j}] = {int(ids[n, f, j])} is not in [0, {self.vocab[f]}) "
                "(-1 pads a bag)"
            )
        return dense, ids, y

    def rows_needed(self, batch: Batch) -> dict[str, Array]:
        """Table name -> the sorted distinct ids (int64) the batch uses in it."""
        _, ids, _ = self._batch(batch)
        xp = xp_of(ids)
        out: dict[str, Array] = {}
        for f, name in enumerate(self.tables):
            u = xp.unique(ids[:, f, :])
            out[name] = u[u >= 0]
        return out

    # -- forward / backward -------------------------------------------------------------
    def _inputs(
        self, params: Params, batch: Batch
    ) -> tuple[Array, list[tuple[Array, Array | None]], Array]:
        dense, ids, y = self._batch(batch)
        w1 = params["W1"]
        xp = xp_of(w1)
        ids, y = xp.asarray(ids), xp.asarray(y)  # a host batch goes to the parameters' device
        pooled = []
        local: list[tuple[Array, Array | None]] = []
        for f, name in enumerate(self.tables):
            table, pos = local_rows(name, params[name], ids[:, f, :])
            lids = ids[:, f, :] if pos is None else pos
            pooled.append(kernels.embedding_bag(table, lids, mode=self.pool).astype(w1.dtype))
            local.append((lids, None if pos is None else params[name].indices))
        xp = xp_of(w1, *pooled)
        if self.n_dense:
            pooled.append(features(dense, w1, self.n_dense, "dense"))
        x = xp.concatenate(pooled, axis=1) if len(pooled) > 1 else pooled[0]
        return x, local, y

    def logits(self, params: Params, batch: Batch) -> Array:
        x, _, _ = self._inputs(params, batch)
        return dense_forward(params, x, self.layers)[-1]

    def _loss(self, logits: Array, y: Array) -> tuple[float, Array]:
        if self.classes == 1:
            return kernels.sigmoid_cross_entropy(logits, y)
        loss, g = kernels.softmax_cross_entropy(logits, y)
        assert g is not None
        return loss, g

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, dict[str, Gradient]]:
        x, local, y = self._inputs(params, batch)
        acts = dense_forward(params, x, self.layers)
        loss, g = self._loss(acts[-1], y)
        dense_grads, dx = dense_backward(params, acts, g, self.layers, need_dx=True)
        assert dx is not None
        grads: dict[str, Gradient] = {}
        for f, (name, (lids, row_map)) in enumerate(zip(self.tables, local)):
            d_pooled = dx[:, f * self.dim : (f + 1) * self.dim]
            rows, values = kernels.embedding_bag_backward(d_pooled, lids, mode=self.pool)
            if row_map is not None:
                rows = xp_of(rows).asarray(row_map)[rows]
            grads[name] = SparseGradient(rows, values)
        grads.update(dense_grads)
        return loss, {name: grads[name] for name in self._names}

    def predict(self, params: Params, batch: Batch) -> Array:
        z = self.logits(params, batch)
        if self.classes == 1:
            return (z[:, 0] > 0).astype(np.int64)
        return z.argmax(axis=1).astype(np.int64)


def _vocab_text(vocab: Sequence[int]) -> str:
    """``1000x3-50`` for ``[1000, 1000, 1000, 50]`` (runs of equal sizes folded)."""
    parts: list[str] = []
    i = 0
    while i < len(vocab):
        j = i
        while j < len(vocab) and vocab[j] == vocab[i]:
            j += 1
        parts.append(str(vocab[i]) if j - i == 1 else f"{vocab[i]}x{j - i}")
        i = j
    return "-".join(parts)


def parse_vocab(text: str) -> list[int]:
    """``"1000x3-50"`` -> ``[1000, 1000, 1000, 50]``.

    Raises:
        InvalidArgumentError: anything but ``SIZE`` or ``SIZExCOUNT`` items joined by
            ``-``.
    """
    out: list[int] = []
    for item in text.split("-"):
        size, _, count = item.partition("x")
        try:
            s, c = int(size), int(count) if count else 1
        except ValueError:
            s = c = 0
        if s < 1 or c < 1 or not size.isdigit() or (count and not count.isdigit()):
            raise InvalidArgumentError(
                f"tables: {item!r} is not SIZE or SIZExCOUNT (e.g. 1000x4-50)"
            )
        out += [s] * c
    return out

"""Dense classifiers: :class:`MLP` (ReLU hidden layers, softmax cross-entropy) and
:class:`SoftmaxRegression` (an MLP without hidden layers).

Parameters are ``W1, b1, W2, b2, ...`` (``W<i>`` of shape ``[fan_in, fan_out]``), drawn
as W4 says: one ``rng``, layer by layer in order, ``W = rng.standard_normal((fan_in,
fan_out), float32) * sqrt(2 / fan_in)`` and ``b = 0``. A batch is ``(x [N, in], y [N])``.
The helpers :func:`dense_forward` / :func:`dense_backward` are shared with the sparse
model's top network.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

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
    he_normal,
)

__all__ = ["MLP", "SoftmaxRegression", "dense_backward", "dense_forward", "dense_specs"]


def dense_specs(widths: Sequence[int], first: int = 1) -> list[ParamSpec]:
    """``W<i>``/``b<i>`` specs of the layers ``widths[0] -> widths[1] -> ...``."""
    out: list[ParamSpec] = []
    for k, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        i = first + k
        out.append(ParamSpec(f"W{i}", (fan_in, fan_out)))
        out.append(ParamSpec(f"b{i}", (fan_out,)))
    return out


def dense_init(rng: np.random.Generator, widths: Sequence[int], first: int = 1) -> dict[str, Array]:
    """W4's init of the layers, in order, from ``rng``."""
    out: dict[str, Array] = {}
    for k, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        i = first + k
        out[f"W{i}"] = he_normal(rng, fan_in, fan_out)
        out[f"b{i}"] = np.zeros(fan_out, np.float32)
    return out


def dense_forward(params: Params, x: Array, layers: int, first: int = 1) -> list[Array]:
    """``[x, h1, ..., logits]``: ReLU after every layer but the last."""
    acts = [x]
    h = x
    for k in range(layers):
        i = first + k
        w, b = params[f"W{i}"], params[f"b{i}"]
        z = h @ w
        h = kernels.bias_relu(z, b) if k < layers - 1 else z + b
        acts.append(h)
    return acts


def dense_backward(
    params: Params, acts: list[Array], g: Array, layers: int, first: int = 1, need_dx: bool = False
) -> tuple[dict[str, Array], Array | None]:
    """Gradients of the layers from ``g = d loss / d logits``, and ``d loss / d x`` when
    ``need_dx``."""
    grads: dict[str, Array] = {}
    for k in reversed(range(layers)):
        i = first + k
        h_in = acts[k]
        grads[f"W{i}"] = h_in.T @ g
        grads[f"b{i}"] = g.sum(axis=0)
        if k > 0 or need_dx:
            g = g @ params[f"W{i}"].T
            if k > 0:
                g = kernels.relu_backward(g, h_in)
    return grads, (g if need_dx else None)


def check_widths(widths: Sequence[int], what: str, min_layers: int = 1) -> tuple[int, ...]:
    """``widths`` as a tuple of ints >= 1, at least ``min_layers + 1`` of them.

    Raises:
        InvalidArgumentError: anything else.
    """
    ws = tuple(widths)
    for w in ws:
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
            raise InvalidArgumentError(f"{what}: every width must be an int >= 1, got {w!r}")
    if len(ws) < min_layers + 1:
        raise InvalidArgumentError(
            f"{what}: needs at least {min_layers + 1} widths (input ... classes), got {list(ws)}"
        )
    return tuple(int(w) for w in ws)


def features(x: Any, like: Array, n_in: int, what: str = "x") -> Array:
    """``x`` as a ``[N, n_in]`` array of the dtype and module of ``like`` (a parameter):
    a host batch moves to the device when the parameters are CuPy arrays.

    Raises:
        InvalidArgumentError: another shape.
    """
    xp = xp_of(like, x)
    x = xp.asarray(x)
    if x.ndim != 2 or x.shape[1] != n_in:
        raise InvalidArgumentError(f"{what} must be [N, {n_in}], got {list(x.shape)}")
    return x.astype(like.dtype, copy=False)


class MLP(BaseModel):
    """A multi-layer perceptron: ``widths = [in, hidden..., classes]``, ReLU on the
    hidden layers, mean softmax cross-entropy. W4 is ``MLP([64, 128, 10])``, W5
    ``MLP([784, 1024, 1024, 10])``.

    Raises:
        InvalidArgumentError: fewer than two widths, a width < 1, or fewer than 2
            classes.
    """

    kind = "mlp"

    def __init__(self, widths: Sequence[int]) -> None:
        self.widths = check_widths(widths, type(self).__name__)
        if self.widths[-1] < 2:
            raise InvalidArgumentError(
                f"{type(self).__name__}: the last width is the number of classes and must "
                f"be >= 2, got {self.widths[-1]}"
            )
        self.layers = len(self.widths) - 1
        self.spec = f"{self.kind}:{','.join(str(w) for w in self.widths)}"
        self._names = [p.name for p in self.params_spec()]

    @property
    def num_params(self) -> int:
        return sum(p.size for p in self.params_spec())

    def params_spec(self) -> list[ParamSpec]:
        return dense_specs(self.widths)

    def init_params(self, rng: np.random.Generator) -> dict[str, Array]:
        return dense_init(rng, self.widths)

    def logits(self, params: Params, x: Array) -> Array:
        """The ``[N, classes]`` logits of inputs ``x``."""
        x = features(x, params["W1"], self.widths[0])
        return dense_forward(params, x, self.layers)[-1]

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, dict[str, Gradient]]:
        x, y = _xy(batch)
        x = features(x, params["W1"], self.widths[0])
        acts = dense_forward(params, x, self.layers)
        loss, g = kernels.softmax_cross_entropy(acts[-1], y)
        grads, _ = dense_backward(params, acts, g, self.layers)
        return loss, {name: grads[name] for name in self._names}

    def loss(self, params: Params, batch: Batch) -> float:
        x, y = _xy(batch)
        return kernels.softmax_cross_entropy(self.logits(params, x), y, with_grad=False)[0]

    def predict(self, params: Params, batch: Batch) -> Array:
        return self.logits(params, batch[0]).argmax(axis=1).astype(np.int64)


class SoftmaxRegression(MLP):
    """Multinomial logistic regression: ``softmax(x @ W1 + b1)``, mean cross-entropy
    (an :class:`MLP` without hidden layers; W4's init)."""

    kind = "softmax"

    def __init__(self, n_in: int, classes: int) -> None:
        super().__init__([n_in, classes])


def _xy(batch: Batch) -> tuple[Array, Array]:
    if len(batch) != 2:
        raise InvalidArgumentError(f"a batch of this model is (x, y), got {len(batch)} arrays")
    return batch[0], batch[1]

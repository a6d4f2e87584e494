"""Models of the worker role, written once against ``xp`` (NumPy or CuPy).

* :mod:`workers.models.base` — the :class:`Model` protocol (``params_spec``,
  ``init_params``, ``loss_and_grads``, ``rows_needed``, ``predict``, ``accuracy``),
  :class:`ParamSpec`, :class:`Rows` and :class:`BaseModel`.
* :mod:`workers.models.mlp` — :class:`SoftmaxRegression` and :class:`MLP`.
* :mod:`workers.models.embbag` — :class:`EmbeddingBagMLP` (sparse, CTR style).
* :mod:`workers.models.packed` — :class:`Packed`: a model's dense parameters stored as
  a few flat variables.
* :mod:`workers.models.registry` — :func:`build_model` from a ``--model`` spec string.

``docs/models.md`` describes the protocol and how to plug in a model of your own.
"""

from workers.models.base import (
    BaseModel,
    Model,
    Params,
    ParamSpec,
    Rows,
    SparseGradient,
    check_params,
    grads_to_host,
    he_normal,
    narrowed,
    params_to,
)
from workers.models.embbag import EmbeddingBagMLP
from workers.models.mlp import MLP, SoftmaxRegression
from workers.models.packed import AUTO_PACK_MAX, Packed, auto_packed, packed_inner
from workers.models.registry import build_model, model_names, register_model

__all__ = [
    "AUTO_PACK_MAX",
    "MLP",
    "BaseModel",
    "EmbeddingBagMLP",
    "Model",
    "Packed",
    "ParamSpec",
    "Params",
    "Rows",
    "SoftmaxRegression",
    "SparseGradient",
    "auto_packed",
    "build_model",
    "check_params",
    "grads_to_host",
    "he_normal",
    "model_names",
    "narrowed",
    "packed_inner",
    "params_to",
    "register_model",
]

"""Models by name: the ``--model`` spec strings of the CLI.

A spec is ``NAME:OPTIONS``; each registered name parses its own options:

* ``softmax:IN,CLASSES`` — :class:`~workers.models.SoftmaxRegression`, e.g.
  ``softmax:64,10``.
* ``mlp:IN,HIDDEN...,CLASSES`` — :class:`~workers.models.MLP`, e.g. ``mlp:64,128,10``
  (W4) or ``mlp:784,1024,1024,10`` (W5).
* ``embbag:KEY=VALUE,...`` — :class:`~workers.models.EmbeddingBagMLP`, e.g.
  ``embbag:tables=1000x4-50,dim=8,dense=4,hidden=64-32``. Keys: ``tables`` (required;
  sizes joined by ``-``, ``SIZExCOUNT`` repeats one), ``dim`` (8), ``dense`` (0),
  ``hidden`` (``64``; ``-``-joined widths, ``none`` for none), ``classes`` (1: binary),
  ``pool`` (``sum`` | ``mean``), ``bag`` (1), ``seed`` (0).
* ``packed:[GROUPS:]INNER`` — :class:`~workers.models.packed.Packed`: the model of spec
  ``INNER`` with its dense parameters stored as ``GROUPS`` (default 1) flat variables
  ``packed/0``, ... (fewer, larger variables: a cheaper update for small dense models),
  e.g. ``packed:mlp:64,128,10`` or ``packed:2:mlp:64,128,10`` for two PS shards.
* ``py:MODULE.ATTR[:OPTIONS]`` — a model of your own: ``MODULE.ATTR`` is imported and
  called (with the options string if one is given, with no argument otherwise) and
  must return an object with the :class:`~workers.models.Model` methods.

:func:`register_model` adds a name.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

from qps.errors import InvalidArgumentError
from workers.models.base import Model
from workers.models.embbag import EmbeddingBagMLP, parse_vocab
from workers.models.mlp import MLP, SoftmaxRegression
from workers.models.packed import Packed

__all__ = ["MODEL_METHODS", "build_model", "model_names", "register_model"]

ModelFactory = Callable[[str], Model]

#: the methods :func:`build_model` checks a model for
MODEL_METHODS = (
    "params_spec",
    "init_params",
    "loss_and_grads",
    "rows_needed",
    "predict",
    "accuracy",
)

_FACTORIES: dict[str, tuple[ModelFactory, str]] = {}


def register_model(name: str, factory: ModelFactory, usage: str = "") -> None:
    """Make ``NAME:OPTIONS`` build ``factory(OPTIONS)``. ``usage`` is shown in errors.

    Raises:
        InvalidArgumentError: a name that is not ``[a-z0-9_]+``, or ``py`` (reserved).
    """
    if not name or not all(c.isalnum() or c == "_" for c in name) or name != name.lower():
        raise InvalidArgumentError(f"a model name is [a-z0-9_]+, got {name!r}")
    if name == "py":
        raise InvalidArgumentError("'py' is reserved for py:MODULE.ATTR specs")
    _FACTORIES[name] = (factory, usage)


def model_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_FACTORIES)


def _ints(name: str, options: str, usage: str) -> list[int]:
    out = []
    for item in options.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise InvalidArgumentError(f"model {name}: {item!r} is not an int >= 1; usage: {usage}")
        out.append(int(item))
    return out


_MLP_USAGE = "mlp:IN,HIDDEN...,CLASSES (e.g. mlp:64,128,10)"
_SOFTMAX_USAGE = "softmax:IN,CLASSES (e.g. softmax:64,10)"
_EMBBAG_USAGE = (
    "embbag:tables=SIZES,dim=D,dense=N,hidden=W1-W2,classes=C,pool=sum|mean,bag=L,seed=S "
    "(e.g. embbag:tables=1000x4-50,dim=8,dense=4,hidden=64-32)"
)


def _mlp(options: str) -> Model:
    widths = _ints("mlp", options, _MLP_USAGE)
    if len(widths) < 2:
        raise InvalidArgumentError(f"model mlp: needs at least 2 widths; usage: {_MLP_USAGE}")
    return MLP(widths)


def _softmax(options: str) -> Model:
    widths = _ints("softmax", options, _SOFTMAX_USAGE)
    if len(widths) != 2:
        raise InvalidArgumentError(
            f"model softmax: needs exactly 2 numbers; usage: {_SOFTMAX_USAGE}"
        )
    return SoftmaxRegression(widths[0], widths[1])


_PACKED_USAGE = "packed:[GROUPS:]INNER (e.g. packed:mlp:64,128,10 or packed:2:mlp:64,128,10)"


def _packed(options: str) -> Model:
    groups, colon, rest = options.partition(":")
    count = 1
    if colon and groups.strip().isdigit():
        count = int(groups)
        if count < 1:
            raise InvalidArgumentError(f"model packed: GROUPS must be >= 1; usage: {_PACKED_USAGE}")
        options = rest
    if options.strip().lower().startswith("packed:"):
        raise InvalidArgumentError("model packed: a packed model cannot be packed again")
    return Packed(build_model(options), count)


_EMBBAG_INTS = ("dim", "dense", "classes", "bag", "seed")


def _embbag(options: str) -> Model:
    kw: dict[str, str] = {}
    for item in options.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq:
            raise InvalidArgumentError(
                f"model embbag: {item!r} is not KEY=VALUE; usage: {_EMBBAG_USAGE}"
            )
        if key in kw:
            raise InvalidArgumentError(f"model embbag: {key} given twice")
        kw[key] = value.strip()
    unknown = sorted(set(kw) - {"tables", "hidden", "pool", *_EMBBAG_INTS})
    if unknown:
        raise InvalidArgumentError(
            f"model embbag: unknown option(s) {', '.join(unknown)}; usage: {_EMBBAG_USAGE}"
        )
    if "tables" not in kw:
        raise InvalidArgumentError(f"model embbag: tables= is required; usage: {_EMBBAG_USAGE}")
    ints: dict[str, int] = {}
    for key in _EMBBAG_INTS:
        if key in kw:
            if not kw[key].isdigit():
                raise InvalidArgumentError(
                    f"model embbag: {key}={kw[key]!r} is not an int >= 0; usage: {_EMBBAG_USAGE}"
                )
            ints[key] = int(kw[key])
    hidden_text = kw.get("hidden", "64")
    hidden: list[int] = []
    if hidden_text not in ("", "none", "0"):
        for h in hidden_text.split("-"):
            if not h.isdigit() or int(h) < 1:
                raise InvalidArgumentError(
                    f"model embbag: hidden={hidden_text!r}: widths >= 1 joined by '-' (or 'none')"
                )
            hidden.append(int(h))
    return EmbeddingBagMLP(
        parse_vocab(kw["tables"]),
        ints.get("dim", 8),
        dense=ints.get("dense", 0),
        hidden=hidden,
        classes=ints.get("classes", 1),
        pool=kw.get("pool", "sum"),
        bag=ints.get("bag", 1),
        seed=ints.get("seed", 0),
    )


def _from_python(target: str) -> Model:
    path, _, options = target.partition(":")
    module_name, dot, attr = path.rpartition(".")
    if not dot or not module_name or not attr:
        raise InvalidArgumentError(f"py:{target}: expected py:MODULE.ATTR[:OPTIONS]")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgumentError(f"py:{target}: cannot import {module_name}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InvalidArgumentError(f"py:{target}: {module_name} has no callable {attr!r}")
    model = factory(options) if options else factory()
    if not isinstance(getattr(model, "spec", None), str):
        with contextlib.suppress(AttributeError):
            model.spec = f"py:{target}"
    return model  # type: ignore[no-any-return]


def build_model(spec: str) -> Model:
    """The model a spec string names (see the module docstring).

    Raises:
        InvalidArgumentError: an unknown name, bad options (the message shows the
            usage), or a ``py:`` target that is missing or does not build a model.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise InvalidArgumentError(
            f"model spec {spec!r} is not NAME:OPTIONS; names: {', '.join(model_names())}, "
            "py:MODULE.ATTR"
        )
    name, _, options = spec.strip().partition(":")
    name = name.strip().lower()
    if name == "py":
        model = _from_python(options.strip())
    else:
        if name not in _FACTORIES:
            raise InvalidArgumentError(
                f"unknown model {name!r}; names: {', '.join(model_names())}, py:MODULE.ATTR"
            )
        factory, usage = _FACTORIES[name]
        if not options.strip():
            raise InvalidArgumentError(f"model {name}: options missing; usage: {usage}")
        model = factory(options.strip())
    missing = [m for m in MODEL_METHODS if not callable(getattr(model, m, None))]
    if missing:
        raise InvalidArgumentError(
            f"model spec {spec!r} built a {type(model).__name__} without "
            f"{', '.join(missing)} (see docs/models.md)"
        )
    return model


register_model("mlp", _mlp, _MLP_USAGE)
register_model("softmax", _softmax, _SOFTMAX_USAGE)
register_model("embbag", _embbag, _EMBBAG_USAGE)
register_model("packed", _packed, _PACKED_USAGE)

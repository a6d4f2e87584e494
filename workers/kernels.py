"""The hot-path kernels of the models, written once against the arrays' module.

Every kernel takes NumPy or CuPy arrays and answers with arrays of the same module
(:func:`qps.backend.xp_of`): NumPy arrays stay on the host, CuPy arrays on the device.
Each has a plain implementation in NumPy's API (which CuPy mirrors, so it also runs on
CuPy arrays of any dtype) and, for CuPy ``float32`` arrays, a fused CUDA version built on
first use (:mod:`workers.fused`). :data:`use_fused_kernels` switches the fused versions
off (the GPU tests compare the two). CuPy is imported only when a CuPy array arrives:
importing this module never imports CuPy.

Conventions: activations and parameters are floating (``float32`` in training; the
gradient checks use ``float64`` copies), labels and row indices are ``int64``. Losses
are means over the batch and come back as Python floats; gradients are of that mean.

Kernels:

* :func:`softmax_cross_entropy` — mean softmax cross-entropy of logits ``[N, C]`` and
  int labels ``[N]``, and its gradient, in one pass (log-sum-exp with the row maximum
  subtracted, so no overflow for any finite logits).
* :func:`sigmoid_cross_entropy` — mean logistic loss of logits ``[N]`` and 0/1 labels,
  and its gradient (``max(z, 0) - z y + log1p(exp(-|z|))``: stable for any ``z``).
* :func:`relu`, :func:`relu_backward`, :func:`bias_relu` — ReLU and its gradient.
* :func:`gather_rows` — ``table[ids]``.
* :func:`embedding_bag` — rows of ``table`` pooled (``sum`` or ``mean``) over bags, given
  as a fixed-width ``[B, L]`` block of ids (``-1`` pads a short bag) or as flat ids with
  ``offsets`` (bag ``b`` is ``ids[offsets[b]:offsets[b + 1]]``, as
  ``torch.nn.EmbeddingBag``); :func:`embedding_bag_backward` is its gradient with respect
  to the table, as sparse rows.
* :func:`scatter_add_rows` — ``(unique ids, summed rows)`` of per-occurrence row gradients:
  duplicates summed, ids sorted. This is the :class:`qps.ps.messages.SparseGradient` a PS
  shard wants (``indices``, ``values``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np

from qps.backend import xp_of
from workers.fused import kernel as _cuda

__all__ = [
    "POOL_MODES",
    "bias_relu",
    "embedding_bag",
    "embedding_bag_backward",
    "gather_rows",
    "log_softmax",
    "relu",
    "relu_backward",
    "scatter_add_rows",
    "sigmoid_cross_entropy",
    "softmax",
    "softmax_cross_entropy",
    "use_fused_kernels",
]

Array = Any  # a NumPy or CuPy ndarray

#: Use the fused CUDA kernels for CuPy float32 arrays (the plain versions otherwise).
use_fused_kernels = True

#: Pooling modes of :func:`embedding_bag`.
POOL_MODES = ("sum", "mean")


# --------------------------------------------------------------------------- helpers


def _fusable(xp: ModuleType, *arrays: Array) -> bool:
    return use_fused_kernels and xp is not np and all(a.dtype == np.float32 for a in arrays)


def _float(x: Array, what: str) -> None:
    if np.dtype(x.dtype).kind != "f":
        raise TypeError(f"{what} must be a floating array, got dtype {x.dtype}")


def _int_ids(xp: ModuleType, ids: Array, what: str) -> Array:
    ids = xp.asarray(ids)
    if np.dtype(ids.dtype).kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def _check_labels(xp: ModuleType, labels: Array, n: int, classes: int) -> Array:
    labels = _int_ids(xp, labels, "labels")
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape [{n}], got {list(labels.shape)}")
    if n and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        bad = int(xp.flatnonzero((labels < 0) | (labels >= classes))[0])
        raise ValueError(f"labels[{bad}] = {int(labels[bad])} is not in [0, {classes})")
    return labels


# --------------------------------------------------------------------- softmax & co


def log_softmax(logits: Array) -> Array:
    """``log(softmax(logits))`` along the last axis, computed stably."""
    xp = xp_of(logits)
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - xp.log(xp.exp(z).sum(axis=-1, keepdims=True))


def softmax(logits: Array) -> Array:
    """Softmax along the last axis (the row maximum subtracted first)."""
    xp = xp_of(logits)
    e = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_cross_entropy(
    logits: Array, labels: Array, *, with_grad: bool = True
) -> tuple[float, Array | None]:
    """Mean softmax cross-entropy and its gradient, in one pass.

    Args:
        logits: ``[N, C]`` floats.
        labels: ``[N]`` ints in ``[0, C)``.
        with_grad: also compute ``d loss / d logits`` (``(softmax - onehot) / N``).

    Returns:
        ``(loss, grad)``: the mean loss as a float and the ``[N, C]`` gradient (``None``
        when ``with_grad`` is false). ``N = 0`` gives loss 0.

    Raises:
        TypeError: non-float logits or non-int labels.
        ValueError: shapes that do not match, or a label out of range.
    """
    xp = xp_of(logits, labels)
    logits = xp.asarray(logits)
    _float(logits, "logits")
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be [N, C] with C >= 1, got {list(logits.shape)}")
    n, c = int(logits.shape[0]), int(logits.shape[1])
    labels = _check_labels(xp, labels, n, c)
    if n == 0:
        return 0.0, (xp.zeros_like(logits) if with_grad else None)
    if _fusable(xp, logits):
        logits = xp.ascontiguousarray(logits)
        labels = xp.ascontiguousarray(labels)
        row_loss = xp.empty(n, np.float32)
        grad = xp.empty_like(logits) if with_grad else row_loss  # a dummy pointer
        threads = 128
        blocks = (n + threads - 1) // threads
        _cuda("softmax_xent")(
            (blocks,),
            (threads,),
            (
                logits,
                labels,
                grad,
                row_loss,
                np.int64(n),
                np.int64(c),
                np.float32(1.0 / n),
                np.int32(with_grad),
            ),
        )
        return float(row_loss.sum(dtype=np.float64)) / n, (grad if with_grad else None)
    # Each row's label picked by one flat index (one gather, not a gather by (row,
    # label) pairs); the gradient made in place in exp(z): (e / s - onehot) / N.
    z = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(z)
    s = e.sum(axis=1)
    picked = xp.arange(0, n * c, c) + labels
    loss = float((xp.log(s) - z.ravel()[picked]).sum(dtype=np.float64)) / n
    if not with_grad:
        return loss, None
    e /= (s * logits.dtype.type(n))[:, None]
    e.ravel()[picked] -= logits.dtype.type(1.0 / n)
    return loss, e


def sigmoid_cross_entropy(logits: Array, labels: Array) -> tuple[float, Array]:
    """Mean logistic loss of ``logits`` against 0/1 ``labels`` and its gradient
    ``(sigmoid(z) - y) / N``, stable for any logits (TF's
    ``sigmoid_cross_entropy_with_logits``).

    Args:
        logits: ``[N]`` (or ``[N, 1]``) floats.
        labels: ``[N]`` numbers (ints or floats) in ``[0, 1]``.

    Returns:
        ``(loss, grad)``, ``grad`` shaped as ``logits``.

    Raises:
        TypeError: non-float logits.
        ValueError: shapes that do not match.
    """
    xp = xp_of(logits, labels)
    logits = xp.asarray(logits)
    _float(logits, "logits")
    n = int(logits.shape[0]) if logits.ndim else 0
    if logits.ndim not in (1, 2) or (logits.ndim == 2 and logits.shape[1] != 1):
        raise ValueError(f"logits must be [N] or [N, 1], got {list(logits.shape)}")
    y = xp.asarray(labels)
    if y.shape != (n,):
        raise ValueError(f"labels must have shape [{n}], got {list(y.shape)}")
    if n == 0:
        return 0.0, xp.zeros_like(logits)
    z = logits.reshape(n)
    y = y.astype(logits.dtype, copy=False)
    if _fusable(xp, z):
        loss_el, g = _cuda("sigmoid_xent")(z, y, np.float32(1.0 / n))
    else:
        e = xp.exp(-xp.abs(z))
        loss_el = xp.maximum(z, 0) - z * y + xp.log1p(e)
        p = xp.where(z >= 0, 1 / (1 + e), e / (1 + e))
        g = (p - y) * logits.dtype.type(1.0 / n)
    return float(loss_el.sum(dtype=np.float64)) / n, g.reshape(logits.shape)


# ----------------------------------------------------------------------------- ReLU


def relu(x: Array) -> Array:
    """``max(x, 0)`` (a new array)."""
    xp = xp_of(x)
    if _fusable(xp, x):
        return _cuda("relu")(x)
    return xp.maximum(x, 0)


def bias_relu(x: Array, b: Array) -> Array:
    """``max(x + b, 0)`` in one pass (``b`` broadcast over the rows of ``x``)."""
    xp = xp_of(x, b)
    if _fusable(xp, x, b):
        return _cuda("bias_relu")(x, b)
    out = x + b
    return xp.maximum(out, 0, out=out)


def relu_backward(grad_out: Array, out: Array) -> Array:
    """The gradient of a ReLU's input, given the gradient of its output and the output
    itself (``out > 0`` exactly where the input was > 0). NumPy multiplies by the mask
    (four times faster than ``where`` on W4's sizes), so a NaN in ``grad_out`` stays NaN
    even where the unit was off: a poisoned gradient is never hidden."""
    xp = xp_of(grad_out, out)
    if _fusable(xp, grad_out, out):
        return _cuda("relu_backward")(grad_out, out)
    return grad_out * (out > 0)


# ------------------------------------------------------------------------ embeddings


def _check_table(table: Array) -> None:
    _float(table, "table")
    if table.ndim != 2:
        raise ValueError(f"an embedding table must be [rows, dim], got {list(table.shape)}")


def _check_range(xp: ModuleType, ids: Array, rows: int, allow_pad: bool) -> None:
    if ids.size == 0:
        return
    lo = -1 if allow_pad else 0
    bad = (ids < lo) | (ids >= rows)
    if bool(bad.any()):
        k = int(xp.flatnonzero(bad.reshape(-1))[0])
        v = int(ids.reshape(-1)[k])
        pad = " (-1 pads a bag)" if allow_pad else ""
        raise IndexError(f"ids[{k}] = {v} is not in [0, {rows}){pad}")


def gather_rows(table: Array, ids: Array) -> Array:
    """``table[ids]``: shape ``ids.shape + table.shape[1:]``.

    Raises:
        IndexError: an id not in ``[0, rows)``.
    """
    xp = xp_of(table, ids)
    ids = _int_ids(xp, ids, "ids")
    _check_range(xp, ids, int(table.shape[0]), allow_pad=False)
    return xp.take(table, ids, axis=0)


def _bags(
    xp: ModuleType, ids: Array, offsets: Array | None
) -> tuple[Array, Array | None, Array | None]:
    """``(ids, starts, ends)``: ids as int64 ``[B, L]`` (fixed width) or flat ``[n]``
    with every bag's first and one-past-last position."""
    ids = _int_ids(xp, ids, "ids")
    if offsets is None:
        if ids.ndim != 2:
            raise ValueError(
                f"ids must be [B, L] (or flat with offsets), got shape {list(ids.shape)}"
            )
        return ids, None, None
    if ids.ndim != 1:
        raise ValueError(f"ids given with offsets must be flat, got shape {list(ids.shape)}")
    starts = _int_ids(xp, offsets, "offsets")
    if starts.ndim != 1:
        raise ValueError(f"offsets must be [B], got shape {list(starts.shape)}")
    n = int(ids.shape[0])
    ends = xp.concatenate([starts[1:], xp.asarray([n], dtype=np.int64)])
    if starts.size and (int(starts[0]) != 0 or bool((ends < starts).any()) or int(starts[-1]) > n):
        raise ValueError(f"offsets must start at 0 and never decrease nor pass len(ids) = {n}")
    return ids, starts, ends


def _pool_mode(mode: str) -> bool:
    if mode not in POOL_MODES:
        raise ValueError(f"mode must be one of {', '.join(POOL_MODES)}, got {mode!r}")
    return mode == "mean"


def _bag_scale(
    xp: ModuleType, ids: Array, ends: Array | None, starts: Array | None, mean: bool, dtype: Any
) -> Array:
    """Per bag: 1 (sum) or 1 / max(count, 1) (mean), as ``dtype``."""
    if ends is None:
        count = (ids >= 0).sum(axis=1)
    else:
        assert starts is not None
        count = ends - starts
    if not mean:
        return xp.ones(count.shape, dtype)
    return (1.0 / xp.maximum(count, 1)).astype(dtype)


def embedding_bag(
    table: Array, ids: Array, offsets: Array | None = None, mode: str = "sum"
) -> Array:
    """Rows of ``table`` pooled over bags: ``out[b] = pool(table[id] for id in bag b)``.

    Args:
        table: ``[rows, dim]`` floats.
        ids: ``[B, L]`` ints, one bag per row, ``-1`` padding a short bag; or, with
            ``offsets``, flat ``[n]`` ints (no padding).
        offsets: ``[B]`` start of every bag in the flat ``ids`` (non-decreasing, the
            first 0); bag ``b`` ends where bag ``b + 1`` starts, the last one at ``n``.
        mode: ``"sum"`` or ``"mean"`` (over the bag's ids; an empty bag gives zeros).

    Returns:
        ``[B, dim]``, the dtype of ``table``.

    Raises:
        ValueError: bad shapes, offsets or mode.
        IndexError: an id not in ``[0, rows)`` (or ``-1`` with fixed-width ids).
    """
    xp = xp_of(table, ids, *(() if offsets is None else (offsets,)))
    _check_table(table)
    mean = _pool_mode(mode)
    ids, starts, ends = _bags(xp, ids, offsets)
    rows, dim = int(table.shape[0]), int(table.shape[1])
    _check_range(xp, ids, rows, allow_pad=offsets is None)
    nbags = int(ids.shape[0]) if starts is None else int(starts.shape[0])
    if _fusable(xp, table):
        table = xp.ascontiguousarray(table)
        out = xp.empty((nbags, dim), table.dtype)
        if out.size == 0:
            return out
        if starts is None:
            _cuda("bag_fixed")(
                table, xp.ascontiguousarray(ids), int(ids.shape[1]), dim, int(mean), out
            )
        else:
            _cuda("bag_offsets")(
                table,
                xp.ascontiguousarray(ids),
                xp.ascontiguousarray(starts),
                xp.ascontiguousarray(ends),
                dim,
                int(mean),
                out,
            )
        return out
    scale = _bag_scale(xp, ids, ends, starts, mean, table.dtype)
    if starts is None:
        valid = ids >= 0
        gathered = xp.take(table, xp.where(valid, ids, 0), axis=0)  # [B, L, dim]
        if not bool(valid.all()):
            gathered *= valid[..., None].astype(table.dtype)
        out = gathered.sum(axis=1)
    else:
        assert ends is not None
        bag_of = xp.searchsorted(starts, xp.arange(ids.shape[0]), side="right") - 1
        out = xp.zeros((nbags, dim), table.dtype)
        if ids.shape[0]:
            _, summed = _segment_sum(xp, bag_of, xp.take(table, ids, axis=0))
            nonempty = xp.flatnonzero(ends > starts)
            out[nonempty] = summed
    out *= scale[:, None]
    return out


def embedding_bag_backward(
    grad: Array, ids: Array, offsets: Array | None = None, mode: str = "sum"
) -> tuple[Array, Array]:
    """The gradient of :func:`embedding_bag` with respect to its table, as sparse rows.

    Args:
        grad: ``[B, dim]``, the gradient of the pooled output.
        ids, offsets, mode: as given to :func:`embedding_bag`.

    Returns:
        ``(indices, values)``: the distinct ids used (sorted, int64 ``[U]``) and the
        gradient of each of those table rows (``[U, dim]``, contributions of repeated ids
        summed). Rows not in ``indices`` have a zero gradient.
    """
    xp = xp_of(grad, ids, *(() if offsets is None else (offsets,)))
    _float(grad, "grad")
    mean = _pool_mode(mode)
    ids, starts, ends = _bags(xp, ids, offsets)
    nbags = int(ids.shape[0]) if starts is None else int(starts.shape[0])
    if grad.ndim != 2 or grad.shape[0] != nbags:
        raise ValueError(f"grad must be [{nbags}, dim], got {list(grad.shape)}")
    dim = int(grad.shape[1])
    scale = _bag_scale(xp, ids, ends, starts, mean, grad.dtype)
    if starts is None and _fusable(xp, grad):
        flat = xp.ascontiguousarray(ids).reshape(-1)
        uniq, inv = xp.unique(flat, return_inverse=True)
        inv = inv.reshape(-1).astype(np.int64, copy=False)
        out = xp.zeros((int(uniq.shape[0]), dim), grad.dtype)
        if flat.size and dim:
            _cuda("bag_fixed_backward")(
                xp.ascontiguousarray(grad),
                flat,
                inv,
                scale,
                int(ids.shape[1]),
                dim,
                out,
                size=int(flat.size) * dim,
            )
        if uniq.size and int(uniq[0]) < 0:  # the padding id
            uniq, out = uniq[1:], out[1:]
        return uniq, out
    if starts is None:
        occ_ids = ids.reshape(-1)
        occ_grad = xp.repeat(grad * scale[:, None], ids.shape[1], axis=0)
        keep = occ_ids >= 0
        if not bool(keep.all()):
            occ_ids, occ_grad = occ_ids[keep], occ_grad[keep]
    else:
        bag_of = xp.searchsorted(starts, xp.arange(ids.shape[0]), side="right") - 1
        occ_ids = ids
        occ_grad = xp.take(grad * scale[:, None], bag_of, axis=0)
    return scatter_add_rows(occ_ids, occ_grad)


def _segment_sum(xp: ModuleType, ids: Array, values: Array) -> tuple[Array, Array]:
    """``(unique ids, rows summed per id)`` with ``ids`` sorted (a plain version)."""
    n = int(ids.shape[0])
    if n == 0:
        return ids, values[:0]
    if xp is np:
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        new = np.empty(n, bool)
        new[0] = True
        np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        if starts.size == n:  # no repeats
            return sorted_ids, values[order]
        return sorted_ids[starts], np.add.reduceat(values[order], starts, axis=0)
    uniq, inv = xp.unique(ids, return_inverse=True)
    inv = inv.reshape(-1).astype(np.int64, copy=False)
    out = xp.zeros((int(uniq.shape[0]), *values.shape[1:]), values.dtype)
    if _fusable(xp, values) and values.ndim == 2:
        if values.size:
            _cuda("scatter_add")(xp.ascontiguousarray(values), inv, int(values.shape[1]), out)
        return uniq, out
    add_at = getattr(xp.add, "at", None)
    if add_at is None:  # CuPy < 13
        add_at = importlib.import_module("cupyx").scatter_add
    add_at(out, inv, values)
    return uniq, out


def scatter_add_rows(ids: Array, values: Array) -> tuple[Array, Array]:
    """Row gradients summed per row: ``(indices, summed)`` with ``indices`` the distinct
    ``ids`` in increasing order and ``summed[k] = sum of values[j] where ids[j] ==
    indices[k]``.

    Args:
        ids: ``[n]`` ints (any order, repeats allowed).
        values: ``[n, ...]``, one row per id.

    Returns:
        ``(int64 [U], [U, ...])``: what :class:`qps.ps.messages.SparseGradient` carries.

    Raises:
        ValueError: ``ids`` not 1-D or not matching ``values``.
    """
    xp = xp_of(ids, values)
    ids = _int_ids(xp, ids, "ids")
    if ids.ndim != 1 or values.ndim < 1 or values.shape[0] != ids.shape[0]:
        raise ValueError(
            f"ids must be [n] and values [n, ...], got {list(ids.shape)} and {list(values.shape)}"
        )
    return _segment_sum(xp, ids, values)

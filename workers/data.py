"""Data for the workers and the feeder: built-in data sets, files, minibatches.

* :func:`load_digits` — scikit-learn's 8×8 digits, split 1,437 train / 360 test by
  ``train_test_split(test_size=0.2, random_state=0)`` and standardized on the train part.
* :func:`teacher_data` — a random-teacher data set (Gaussian features, labels the argmax
  of a random linear map), drawn in a fixed order from seed 0.
* :func:`synthetic_ctr` — seeded click data for :class:`~workers.models.EmbeddingBagMLP`
  (skewed ids, so a batch repeats rows as real CTR data does).
* :func:`load_xy` — ``(x, y)`` from ``.npz`` / ``.npy`` files (never pickles).
* :class:`Dataset` and :func:`load_dataset` — what ``qps feed`` enqueues: equally long
  arrays, one per component, from files or a built-in name.
* :func:`minibatches` — W4's minibatch order: a fresh permutation each epoch, consecutive
  chunks, the last partial chunk dropped; :func:`take` slices a batch tuple.

A batch is a tuple of arrays whose last one holds the labels (see
:mod:`workers.models.base`). Everything here is NumPy on the host.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qps.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from qps.queues.spec import format_shape

__all__ = [
    "DATASETS",
    "Dataset",
    "Split",
    "load_dataset",
    "load_digits",
    "load_npy",
    "load_npz",
    "load_xy",
    "minibatches",
    "synthetic_ctr",
    "take",
    "teacher_data",
]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


class Split(NamedTuple):
    """A train/test split of features and int64 labels."""

    x_train: F32
    y_train: I64
    x_test: F32
    y_test: I64


def load_digits() -> Split:
    """W4's data: ``sklearn.datasets.load_digits(return_X_y=True)``, split by
    ``train_test_split(test_size=0.2, random_state=0)`` (1,437 train / 360 test), a
    ``StandardScaler`` fit on the train part and applied to both; float32 features,
    int64 labels.

    Raises:
        FailedPreconditionError: scikit-learn is not installed.
    """
    try:  # imported by name: scikit-learn is optional and ships no type hints
        datasets = importlib.import_module("sklearn.datasets")
        selection = importlib.import_module("sklearn.model_selection")
        preprocessing = importlib.import_module("sklearn.preprocessing")
    except ImportError as exc:
        raise FailedPreconditionError(
            "the digits dataset needs scikit-learn, which is not installed: "
            "pip install scikit-learn"
        ) from exc
    x, y = datasets.load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = selection.train_test_split(x, y, test_size=0.2, random_state=0)
    scaler = preprocessing.StandardScaler().fit(x_tr)
    return Split(
        np.ascontiguousarray(scaler.transform(x_tr), dtype=np.float32),
        np.asarray(y_tr, dtype=np.int64),
        np.ascontiguousarray(scaler.transform(x_te), dtype=np.float32),
        np.asarray(y_te, dtype=np.int64),
    )


def teacher_data(
    n_train: int = 60_000, n_test: int = 10_000, features: int = 784, classes: int = 10
) -> Split:
    """W5's data: ``rng = default_rng(0)``; in this order ``X = rng.standard_normal((60000,
    784), float32)``, teacher ``T = rng.standard_normal((784, 10), float32)``, ``Xte =
    rng.standard_normal((10000, 784), float32)``; labels ``argmax(X @ T)``. Smaller sizes
    are for tests (they draw other numbers than W5's)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n_train, features), dtype=np.float32)
    t = rng.standard_normal((features, classes), dtype=np.float32)
    x_te = rng.standard_normal((n_test, features), dtype=np.float32)
    return Split(
        x,
        np.argmax(x @ t, axis=1).astype(np.int64),
        x_te,
        np.argmax(x_te @ t, axis=1).astype(np.int64),
    )


def synthetic_ctr(
    n: int,
    vocab: Sequence[int],
    *,
    bag: int = 1,
    dense: int = 0,
    classes: int = 1,
    seed: int = 0,
    skew: float = 2.0,
    ragged: bool = False,
) -> tuple[F32, I64, I64]:
    """Seeded click data ``(dense [n, dense] float32, ids [n, fields, bag] int64, y [n]
    int64)`` with a learnable rule.

    A hidden teacher gives every id of every field a weight per class and every dense
    feature one; an example's score per class is the sum over fields of its bag's mean
    id weight plus its dense features times theirs. ``y`` is ``score > 0`` for
    ``classes = 1`` and the best class otherwise. Ids are ``floor(vocab * u**skew)``
    for uniform ``u`` (``skew > 1`` makes small ids common). With ``ragged``, bag sizes
    are uniform in ``[1, bag]`` and ``-1`` pads the rest. The same ``seed`` and ``vocab``
    give the same teacher, so two calls with different ``n`` share the rule only when
    ``seed`` is equal; draw once and split for train and test.

    Raises:
        InvalidArgumentError: sizes < 1 (``n``, ``dense`` may be 0) or ``skew <= 0``.
    """
    vocab = [int(v) for v in vocab]
    if not vocab or min(vocab) < 1 or bag < 1 or classes < 1 or n < 0 or dense < 0:
        raise InvalidArgumentError(
            f"synthetic_ctr: bad sizes n={n}, vocab={vocab}, bag={bag}, dense={dense}, "
            f"classes={classes}"
        )
    if not skew > 0:
        raise InvalidArgumentError(f"synthetic_ctr: skew must be > 0, got {skew}")
    rng = np.random.default_rng(seed)
    k = classes
    w_ids = [rng.standard_normal((v, k)) for v in vocab]
    w_dense = rng.standard_normal((dense, k))
    fields = len(vocab)
    u = rng.random((n, fields, bag))
    ids = np.floor(np.asarray(vocab)[None, :, None] * u**skew).astype(np.int64)
    if ragged and bag > 1:
        length = rng.integers(1, bag + 1, size=(n, fields, 1))
        ids[np.arange(bag)[None, None, :] >= length] = -1
    x_dense = rng.standard_normal((n, dense), dtype=np.float32)
    score = x_dense.astype(np.float64) @ w_dense
    for f in range(fields):
        valid = ids[:, f, :] >= 0
        w = w_ids[f][np.where(valid, ids[:, f, :], 0)] * valid[..., None]
        score += w.sum(axis=1) / np.maximum(valid.sum(axis=1), 1)[:, None]
    y = (score[:, 0] > 0) if k == 1 else score.argmax(axis=1)
    return x_dense, ids, y.astype(np.int64)


def load_xy(
    path: str | os.PathLike[str], y_path: str | os.PathLike[str] | None = None
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """``(x, y)`` from files, read without pickle.

    * ``data.npz``: arrays named ``x`` and ``y`` (or ``X`` and ``Y``/``y``), or exactly
      two arrays (the first is x).
    * ``x.npy`` with ``y_path="y.npy"``.

    Raises:
        InvalidArgumentError: another kind of file, names that do not say which array
            is which, x and y of different lengths, or a file that cannot be read.
        NotFoundError: no such file.
    """
    p = os.fspath(path)
    if p.endswith(".npz"):
        if y_path is not None:
            raise InvalidArgumentError(f"{p}: an .npz holds both arrays; give no y_path")
        with _load(p) as z:
            names = list(z.files)
            xn = next((n for n in ("x", "X") if n in names), None)
            yn = next((n for n in ("y", "Y") if n in names), None)
            if xn is None or yn is None:
                if len(names) != 2:
                    raise InvalidArgumentError(
                        f"{p}: expected arrays 'x' and 'y' (or exactly two), got {names}"
                    )
                xn, yn = names
            x, y = z[xn], z[yn]
    elif p.endswith(".npy"):
        if y_path is None:
            raise InvalidArgumentError(f"{p}: an .npy holds one array; give y_path too")
        x, y = _load(p), _load(os.fspath(y_path))
    else:
        raise InvalidArgumentError(f"{p}: expected a .npz or .npy file")
    if x.ndim < 1 or y.ndim < 1 or x.shape[0] != y.shape[0]:
        raise InvalidArgumentError(
            f"{p}: x {list(x.shape)} and y {list(y.shape)} do not have the same length"
        )
    return x, y


def _load(path: str) -> Any:
    try:
        return np.load(path, allow_pickle=False)  # never unpickle what a file holds
    except FileNotFoundError:
        raise NotFoundError(f"no such file: {path}") from None
    except (ValueError, OSError) as exc:
        raise InvalidArgumentError(f"cannot read {path}: {exc}") from exc


# -- what a feeder enqueues --------------------------------------------------------------

#: The built-in datasets of ``qps feed --dataset``.
DATASETS = ("digits",)


@dataclass(frozen=True)
class Dataset:
    """Equally long arrays, one per component, and where they came from."""

    arrays: list[np.ndarray]
    source: str

    def __len__(self) -> int:
        return int(self.arrays[0].shape[0])

    def components(self) -> str:
        """The components' dtypes and shapes, e.g. ``float32[64], int64[]``."""
        return ", ".join(f"{a.dtype}{format_shape(a.shape[1:])}" for a in self.arrays)

    def describe(self) -> str:
        return f"{self.source}: {len(self)} examples of ({self.components()})"


def _check(arrays: list[np.ndarray], source: str) -> Dataset:
    if not arrays:
        raise InvalidArgumentError(f"{source}: no arrays")
    for a in arrays:
        if a.ndim == 0:
            raise InvalidArgumentError(f"{source}: a scalar is not a dataset (need dim 0)")
        if a.dtype.kind == "O":
            raise InvalidArgumentError(f"{source}: object arrays are not supported")
    n = arrays[0].shape[0]
    if any(a.shape[0] != n for a in arrays):
        lens = ", ".join(str(a.shape[0]) for a in arrays)
        raise InvalidArgumentError(f"{source}: the arrays have different lengths ({lens})")
    if n == 0:
        raise InvalidArgumentError(f"{source}: the dataset is empty")
    return Dataset([np.ascontiguousarray(a) for a in arrays], source)


def load_npz(path: str, x_key: str = "x", y_key: str | None = "y") -> Dataset:
    """The arrays ``x_key`` and ``y_key`` (None: features only) of an ``.npz`` file.

    Raises:
        NotFoundError: no such file.
        InvalidArgumentError: unreadable, a missing key (the message lists the keys),
            object arrays, or arrays of different lengths.
    """
    with _load(path) as npz:
        names = list(npz.files)
        wanted = [x_key] if y_key is None else [x_key, y_key]
        missing = [k for k in wanted if k not in names]
        if missing:
            raise InvalidArgumentError(
                f"{path} has no array {missing[0]!r} (it has: {', '.join(names) or 'none'}); "
                "choose with --x-key/--y-key"
            )
        try:
            arrays = [np.asarray(npz[k]) for k in wanted]
        except ValueError as exc:  # an object array would need pickle
            raise InvalidArgumentError(f"cannot read {path}: {exc}") from exc
    return _check(arrays, path)


def load_npy(paths: Sequence[str]) -> Dataset:
    """One ``.npy`` file per component: features, then labels.

    Raises:
        NotFoundError, InvalidArgumentError: as :func:`load_npz`.
    """
    arrays = []
    for p in paths:
        a = _load(p)
        if not isinstance(a, np.ndarray):
            raise InvalidArgumentError(f"{p} is not a .npy array file")
        arrays.append(a)
    return _check(arrays, " + ".join(paths))


def load_dataset(
    data: Sequence[str] = (),
    dataset: str | None = None,
    *,
    x_key: str = "x",
    y_key: str | None = "y",
    split: str = "train",
) -> Dataset:
    """The dataset named by ``qps feed``'s options: ``data`` is one ``.npz`` file, or one
    or two ``.npy`` files (features, then labels); ``dataset`` a built-in name, of which
    ``split`` (``train`` or ``test``) is taken.

    Raises:
        InvalidArgumentError: neither or both given, too many files, an unknown name,
            split or file type.
        NotFoundError: a file does not exist.
        FailedPreconditionError: the digits without scikit-learn.
    """
    if bool(data) == bool(dataset):
        raise InvalidArgumentError("give --data PATH (an .npz, or .npy files) or --dataset NAME")
    if dataset is not None:
        if dataset != "digits":
            raise InvalidArgumentError(
                f"unknown dataset {dataset!r}; built in: {', '.join(DATASETS)}"
            )
        if split not in ("train", "test"):
            raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}")
        d = load_digits()
        arrays: list[np.ndarray] = (
            [d.x_train, d.y_train] if split == "train" else [d.x_test, d.y_test]
        )
        return _check(arrays, f"digits ({split})")
    exts = {os.path.splitext(p)[1].lower() for p in data}
    if exts == {".npz"}:
        if len(data) != 1:
            raise InvalidArgumentError("give one .npz file")
        return load_npz(data[0], x_key, y_key)
    if exts == {".npy"}:
        if len(data) > 2:
            raise InvalidArgumentError("give at most two .npy files: features, then labels")
        return load_npy(data)
    raise InvalidArgumentError(
        f"--data takes one .npz file or one or two .npy files, got {', '.join(data)}"
    )


def minibatches(
    n: int, batch_size: int, rng: np.random.Generator, epochs: int | None = None
) -> Iterator[I64]:
    """Index arrays of W4's minibatches: each epoch a fresh ``rng.permutation(n)`` cut
    into consecutive chunks of ``batch_size``, the last partial chunk dropped; forever
    when ``epochs`` is None. Worker ``k`` uses ``default_rng(1 + k)``.

    Raises:
        InvalidArgumentError: ``batch_size`` not in ``[1, n]``.
    """
    if not 1 <= batch_size <= n:
        raise InvalidArgumentError(f"batch_size {batch_size} is not in [1, {n}]")
    per_epoch = n // batch_size
    epoch = 0
    while epochs is None or epoch < epochs:
        perm = rng.permutation(n)
        for i in range(per_epoch):
            yield perm[i * batch_size : (i + 1) * batch_size]
        epoch += 1


def take(batch: Sequence[npt.NDArray[Any]], idx: Any) -> tuple[npt.NDArray[Any], ...]:
    """``batch`` restricted to examples ``idx`` (every array indexed on axis 0)."""
    return tuple(a[idx] for a in batch)


#: built-in data sets a worker can train on by name (``--data NAME``)
BUILTIN = ("digits", "teacher", "ctr")


def builtin_split(name: str, model: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(train batch, test batch)`` of built-in data set ``name``: ``digits`` (W4),
    ``teacher`` (W5), or ``ctr``: 60,000 examples of :func:`synthetic_ctr` shaped for
    ``model`` (an embedding-bag model: its tables, bag size, dense features and
    classes; seed 7), the last 10,000 held out.

    Raises:
        InvalidArgumentError: an unknown name, or ``ctr`` for a model without tables.
    """
    if name == "digits":
        ds = load_digits()
    elif name == "teacher":
        ds = teacher_data()
    elif name == "ctr":
        vocab = getattr(model, "vocab", None)
        if not vocab:
            raise InvalidArgumentError("--data ctr needs an embedding-bag model (embbag:...)")
        dense, ids, y = synthetic_ctr(
            60_000, vocab, bag=model.bag, dense=model.n_dense, classes=model.classes, seed=7
        )
        cut = 50_000
        return (dense[:cut], ids[:cut], y[:cut]), (dense[cut:], ids[cut:], y[cut:])
    else:
        raise InvalidArgumentError(f"no built-in data set {name!r} (known: {', '.join(BUILTIN)})")
    return (ds.x_train, ds.y_train), (ds.x_test, ds.y_test)


def auc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (the Mann-Whitney
    statistic, ties counted half); 0.5 when one class is missing."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel() > 0
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return 0.5
    _, group, counts = np.unique(s, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # 0-based rank of each distinct score's first copy
    ranks = first[group] + (counts[group] + 1) / 2  # 1-based ranks, ties averaged
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))

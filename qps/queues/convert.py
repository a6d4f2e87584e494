"""Enqueued values as arrays of their component's dtype (docs/queues.md, "Dtypes").

:func:`to_component` is the one place every queue class's ``enqueue`` and
``enqueue_many`` turn a value into an array:

* a NumPy array or scalar must have the component's dtype exactly (TF would cast a
  ``np.float32`` into an int64 component; qps refuses it);
* a Python scalar or (nested) list is converted only where that is exact: bools to bool,
  ints to any integer or float dtype (in range), floats to float dtypes (finite stays
  finite);
* an empty Python list, or nested empty lists (``[]``, ``[[], []]``), is an empty array
  of the component's dtype, whatever the dtype, as in TF: it holds no value to check;
* a string component takes ``str`` (as UTF-8), bytes, and lists or arrays of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qps.errors import InvalidArgumentError
from qps.queues.spec import dtype_name, is_string

__all__ = ["to_component"]


def _only_empty_lists(value: Any) -> bool:
    """True for ``[]``, ``()`` and lists or tuples of only those, however nested."""
    return isinstance(value, (list, tuple)) and all(_only_empty_lists(v) for v in value)


def to_component(value: Any, dtype: np.dtype[Any], index: int) -> np.ndarray:
    """``value`` as an array of ``dtype`` for component ``index`` (see the module).

    Raises:
        InvalidArgumentError: ``Type mismatch in tuple component <index>: expected
            <dtype>, got ...``, or a value that does not fit the dtype, or ragged lists.
    """
    if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
        value = value.get()
    if is_string(dtype):
        return _string_array(value, index)
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.dtype != dtype:
            raise InvalidArgumentError(
                f"Type mismatch in tuple component {index}: expected {dtype.name}, "
                f"got {dtype_name(arr.dtype)}"
            )
        return arr
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"component {index}: cannot convert {value!r}") from exc
    if not arr.size and _only_empty_lists(value):  # no values: float64 is only a default
        return np.empty(arr.shape, dtype)
    src, dst = arr.dtype.kind, dtype.kind
    # Python bools go to bool, ints to any integer or float, floats to floats only.
    if src not in "biuf" or (dst == "b") != (src == "b") or (dst in "iu" and src == "f"):
        raise InvalidArgumentError(
            f"Type mismatch in tuple component {index}: expected {dtype.name}, "
            f"got {value!r} ({dtype_name(arr.dtype)})"
        )
    if dst in "iu" and arr.size:
        info = np.iinfo(dtype)
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise InvalidArgumentError(
                f"component {index}: {value!r} is out of range for {dtype.name}"
            )
    with np.errstate(over="ignore"):
        out = arr.astype(dtype)
    if dst == "f" and not np.array_equal(np.isfinite(out), np.isfinite(arr)):
        raise InvalidArgumentError(f"component {index}: {value!r} overflows {dtype.name}")
    return out


def _string_mismatch(index: int, value: Any, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Type mismatch in tuple component {index}: expected string, got {what}"
    )


def _string_leaf(v: Any, index: int, value: Any) -> Any:
    """One nested-list item of a string component, as bytes (or nested lists of them)."""
    if isinstance(v, str):  # np.str_ too
        try:
            return v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(
                f"component {index}: {v!r} cannot be encoded as UTF-8: {exc}"
            ) from exc
    if isinstance(v, (bytes, bytearray, memoryview)):  # np.bytes_ too
        return bytes(v)
    if isinstance(v, (list, tuple)):
        return [_string_leaf(x, index, value) for x in v]
    if isinstance(v, np.ndarray):
        return _string_array(v, index).tolist()
    item = "" if v is value else f" (an item is {type(v).__name__})"
    raise _string_mismatch(index, value, f"{value!r}{item}")


def _string_array(value: Any, index: int) -> np.ndarray:
    """``value`` as an ``S<n>`` array for a string component: bytes as they are, str
    encoded as UTF-8 (Python or NumPy, scalars, nested lists, ``S``/``U``/object arrays).

    Raises:
        InvalidArgumentError: a value that is not strings, text that is not encodable,
            or ragged nested lists.
    """
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        kind = arr.dtype.kind
        if kind == "S":
            return arr
        if kind == "U":
            try:
                out: np.ndarray = np.char.encode(arr, "utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError(
                    f"component {index}: text that cannot be encoded as UTF-8: {exc}"
                ) from exc
            return out
        if kind != "O":
            raise _string_mismatch(index, value, dtype_name(arr.dtype))
        items = [_string_leaf(v, index, value) for v in arr.ravel().tolist()]
        if any(not isinstance(v, bytes) for v in items):
            raise _string_mismatch(index, value, "an object array holding non-strings")
        return np.array(items, dtype=np.bytes_).reshape(arr.shape)
    leaves = _string_leaf(value, index, value)
    try:
        return np.array(leaves, dtype=np.bytes_)
    except ValueError as exc:  # ragged nested lists
        raise InvalidArgumentError(f"component {index}: cannot convert {value!r}") from exc

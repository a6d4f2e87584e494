"""The qps wire format's vocabulary: dtype codes, shapes and the message header.

Shared by the codec of single messages (:mod:`qps.wire`) and of batches of fixed-shape
elements (:mod:`qps.wire_rows`); see :mod:`qps.wire` for the layout.
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from qps.errors import DataLossError, InvalidArgumentError

try:  # optional: bfloat16 support
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None


FORMAT_VERSION = 1
"""The format version this module writes and the only one it reads."""

MAX_MESSAGE_BYTES = 2**31 - 1
"""Default limit on the size a message may declare (2 GiB - 1)."""

MAX_NDIM = 32
"""Most dimensions one component may have."""

MAGIC = b"QW"
_FLAG_NAMES = 0x01
_PREFIX = struct.Struct("<2sBBI")  # magic, version, flags, header_len
_PREFIX_LEN = _PREFIX.size  # 8
_ALIGN = 8
_U32_MAX = 2**32 - 1
_INTP_MAX = int(np.iinfo(np.intp).max)
_ZEROS = bytes(_ALIGN)
_PADS = tuple(bytes(i) for i in range(_ALIGN))
# Headers up to this size are parsed once and remembered; larger ones are parsed each time
# so that the cache cannot pin large amounts of memory.
_CACHED_HEADER_MAX = 4096

_DTYPE_BY_CODE: dict[str, np.dtype[Any]] = {
    "b1": np.dtype(np.bool_),
    "i1": np.dtype("<i1"),
    "i2": np.dtype("<i2"),
    "i4": np.dtype("<i4"),
    "i8": np.dtype("<i8"),
    "u1": np.dtype("<u1"),
    "u2": np.dtype("<u2"),
    "u4": np.dtype("<u4"),
    "u8": np.dtype("<u8"),
    "f2": np.dtype("<f2"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
}
_BF16: np.dtype[Any] | None = None
if _ml_dtypes is not None:
    _BF16 = np.dtype(_ml_dtypes.bfloat16)
    # ml_dtypes types are native-endian only; the wire stores little-endian.
    if sys.byteorder == "little":
        _DTYPE_BY_CODE["bf16"] = _BF16
_CODE_BY_DTYPE: dict[np.dtype[Any], str] = {dt: code for code, dt in _DTYPE_BY_CODE.items()}
_SUPPORTED = (
    "bool, int8-64, uint8-64, float16/32/64, bfloat16 (with ml_dtypes) and fixed-width "
    "bytes S1..S2147483647"
)
MAX_STRING_ITEMSIZE = 2**31 - 1
"""Widest fixed-width bytes dtype (``S<n>``) the format carries: numpy's own limit."""
_STRING_CODE_MAX_LEN = 1 + len(str(MAX_STRING_ITEMSIZE))

Shape = tuple[int, ...]


# --------------------------------------------------------------------------- dtypes


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def dtype_code(dt: npt.DTypeLike) -> str:
    """Return the wire code (``"f4"``, ``"b1"``, ``"bf16"``, ``"S5"``, ...) of dtype ``dt``.

    Either byte order is accepted: the wire always stores little-endian. A fixed-width
    bytes dtype ``S<n>`` has the code ``"S<n>"`` (its itemsize is part of the code).

    Raises:
        InvalidArgumentError: ``dt`` is not a dtype, or not one the format carries
            (object, unicode ``U``, bytes without a width (``S0``), void/structured,
            complex, datetime, longdouble...).
    """
    try:
        d = np.dtype(dt)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{dt!r} is not a numpy dtype: {e}") from e
    code = _CODE_BY_DTYPE.get(d)
    if code is not None:
        return code
    return _code_slow(d)


def _code_slow(d: np.dtype[Any]) -> str:
    """The code of a dtype that is not in the table as is (e.g. big-endian, bytes)."""
    if d.kind in "biuf" and d.fields is None and d.subdtype is None:
        code = _CODE_BY_DTYPE.get(d.newbyteorder("<"))
        if code is not None:
            return code
    if d.kind == "S" and d.itemsize > 0:
        return f"S{d.itemsize}"
    raise InvalidArgumentError(
        f"dtype {d} ({d.str}) cannot be sent on the qps wire; supported: {_SUPPORTED}"
    )


def dtype_from_code(code: str) -> np.dtype[Any]:
    """Return the little-endian numpy dtype of a wire dtype code.

    Raises:
        DataLossError: ``code`` is not a known code (for bytes: not ``"S<n>"`` with ``n``
            written in decimal without leading zeros, ``1 <= n <=``
            :data:`MAX_STRING_ITEMSIZE`), or is ``"bf16"`` and ``ml_dtypes`` is not
            installed.
    """
    dt = _DTYPE_BY_CODE.get(code) if type(code) is str else None
    if dt is not None:
        return dt
    if type(code) is str and code.startswith("S"):
        return _string_dtype(code)
    if code == "bf16":
        raise DataLossError("dtype code 'bf16' needs the optional package ml_dtypes")
    raise DataLossError(f"unknown dtype code {code!r}")


@functools.lru_cache(maxsize=256)
def _string_dtype(code: str) -> np.dtype[Any]:
    """The ``S<n>`` dtype of a bytes code; only the canonical spelling is accepted."""
    digits = code[1:]
    if (
        len(code) <= _STRING_CODE_MAX_LEN
        and digits.isascii()
        and digits.isdigit()
        and digits[0] != "0"
        and int(digits) <= MAX_STRING_ITEMSIZE
    ):
        return np.dtype(code)
    raise DataLossError(f"unknown dtype code {code!r} (bytes codes are S1..S{MAX_STRING_ITEMSIZE})")


def _to_numpy(x: Any, j: int) -> npt.NDArray[Any]:
    """Component ``j`` as a host numpy array (CuPy arrays are copied to the host)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__") and hasattr(x, "get"):
        x = x.get()
        if isinstance(x, np.ndarray):
            return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgumentError(f"component {j} is not convertible to an array: {e}") from e


def _check_names(names: Sequence[str] | None, count: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise InvalidArgumentError(f"names must be a sequence of str, got {type(names).__name__}")
    names_t = tuple(names)
    for k in names_t:
        if type(k) is not str:
            raise InvalidArgumentError(f"component names must be str, got {k!r}")
    if len(names_t) != count:
        raise InvalidArgumentError(f"{len(names_t)} names given for {count} components")
    return names_t


@functools.lru_cache(maxsize=1024)
def _header(
    codes: tuple[str, ...], shapes: tuple[Shape, ...], names: tuple[str, ...] | None
) -> bytes:
    """The padded header prefix for already validated codes/shapes/names."""
    comps = [[c, list(s)] for c, s in zip(codes, shapes, strict=True)]
    body: bytes = msgpack.packb([comps, None if names is None else list(names)], use_bin_type=True)
    if len(body) > _U32_MAX:
        raise InvalidArgumentError(f"header of {len(body)} bytes does not fit the u32 length")
    flags = 0 if names is None else _FLAG_NAMES
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(body))
    end = _PREFIX_LEN + len(body)
    return prefix + body + _PADS[_align(end) - end]


def _check_shape(s: Any, j: int) -> Shape:
    if isinstance(s, (str, bytes)) or not isinstance(s, (Sequence, np.ndarray)):
        raise InvalidArgumentError(f"shape {j} must be a sequence of ints, got {s!r}")
    out: list[int] = []
    for d in s:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d <= _INTP_MAX:
            raise InvalidArgumentError(f"shape {j}: dimension {d!r} is not an int >= 0")
        out.append(int(d))
    if len(out) > MAX_NDIM:
        raise InvalidArgumentError(f"shape {j} has {len(out)} dimensions, most is {MAX_NDIM}")
    return tuple(out)


def _normalize_spec(
    dtypes: Sequence[npt.DTypeLike], shapes: Sequence[Sequence[int]]
) -> tuple[tuple[str, ...], tuple[Shape, ...]]:
    if len(dtypes) != len(shapes):
        raise InvalidArgumentError(f"{len(dtypes)} dtypes but {len(shapes)} shapes")
    codes = tuple(dtype_code(d) for d in dtypes)
    shps = tuple(_check_shape(s, j) for j, s in enumerate(shapes))
    return codes, shps


def header_bytes(
    dtypes: Sequence[npt.DTypeLike],
    shapes: Sequence[Sequence[int]],
    names: Sequence[str] | None = None,
) -> bytes:
    """The exact header prefix (magic through the padding before buffer 0) that
    :func:`encode` writes for arrays of these dtypes and shapes (and names).

    Raises:
        InvalidArgumentError: unsupported dtype, bad shape (not ints >= 0, more than
            :data:`MAX_NDIM` dims), or dtypes/shapes/names of different lengths.
    """
    codes, shps = _normalize_spec(dtypes, shapes)
    return _header(codes, shps, _check_names(names, len(codes)))

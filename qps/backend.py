"""The one array-backend switch: CuPy where a CUDA device exists, NumPy otherwise.

Code that does array math is written once against an ``xp`` module (NumPy's API, which
CuPy mirrors) and takes it from here:

* :func:`get_xp` is the process-wide default backend. It is chosen on the first call:
  ``QPS_BACKEND=numpy`` forces NumPy, ``QPS_BACKEND=cupy`` forces CuPy (and fails with a
  clear error where CuPy or a device is missing), and ``auto`` or an unset variable picks
  CuPy when it imports *and* sees at least one CUDA device, else NumPy.
* :func:`xp_of` is the module that owns some given arrays. Kernels that receive arrays
  (the optimizer rules, for one) use it, so NumPy arrays stay on the host even on a GPU
  machine and CuPy arrays stay on the device.
* :func:`asnumpy` brings any array to the host, e.g. at the wire boundary.

Importing this module never imports CuPy and never fails without it.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import Any

import numpy as np

ENV_VAR = "QPS_BACKEND"
#: the values ``QPS_BACKEND`` (and ``qps worker --backend``) take
CHOICES = ("auto", "numpy", "cupy")


@functools.cache
def _probe_cupy() -> tuple[ModuleType | None, str]:
    """CuPy if it imports and sees a CUDA device, else None; plus why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything
        return None, f"CuPy cannot be imported ({type(exc).__name__}: {exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device, a driver/runtime mismatch, ...
        return None, f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "CuPy sees no CUDA device"
    return cupy, ""


def cupy_or_none() -> ModuleType | None:
    """The ``cupy`` module when it imports and a CUDA device exists, else ``None``."""
    return _probe_cupy()[0]


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    return cupy_or_none() is not None


def choose(preference: str | None = None, what: str = ENV_VAR) -> ModuleType:
    """The backend for a ``QPS_BACKEND`` value (``None`` or ``""`` mean ``auto``);
    ``what`` names where the value came from in the errors.

    Raises ``ValueError`` for an unknown value and ``RuntimeError`` for ``cupy`` where
    CuPy or a CUDA device is missing.
    """
    pref = (preference or "auto").strip().lower()
    if pref not in CHOICES:
        raise ValueError(f"{what}={preference!r} is not one of {', '.join(CHOICES)}")
    if pref == "numpy":
        return np
    cp, why = _probe_cupy()
    if cp is not None:
        return cp
    if pref == "cupy":
        raise RuntimeError(f"{what}=cupy, but {why}")
    return np


@functools.cache
def get_xp() -> ModuleType:
    """The process-wide array module (NumPy or CuPy), chosen once from ``QPS_BACKEND``."""
    return choose(os.environ.get(ENV_VAR))


def backend_name() -> str:
    """``"numpy"`` or ``"cupy"``: the name of :func:`get_xp`'s module."""
    return "cupy" if get_xp() is not np else "numpy"


def describe(xp: ModuleType) -> str:
    """``xp`` in words for a log line: ``numpy``, or ``cupy on <device name>``."""
    if xp is np:
        return "numpy"
    try:
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # an exotic runtime: the module's name will do
        return xp.__name__
    return f"{xp.__name__} on {name}"


def is_cupy_array(x: Any) -> bool:
    """True for a CuPy ndarray (checked without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


def xp_of(*arrays: Any) -> ModuleType:
    """The module owning ``arrays``: CuPy if any of them is a CuPy array, else NumPy."""
    for a in arrays:
        if is_cupy_array(a):
            # a CuPy array exists, so CuPy imports; no device probe needed
            return cupy_or_none() or importlib.import_module("cupy")
    return np


def asnumpy(x: Any) -> np.ndarray[Any, Any]:
    """``x`` as a NumPy array on the host (a copy for CuPy arrays, no copy otherwise)."""
    if is_cupy_array(x):
        return np.asarray(x.get())
    return np.asarray(x)


def to_backend(x: Any, xp: ModuleType) -> Any:
    """``x`` as an array of ``xp`` (host → device or device → host as needed)."""
    if xp is np:
        return asnumpy(x)
    return xp.asarray(x)


__all__ = [
    "CHOICES",
    "ENV_VAR",
    "asnumpy",
    "backend_name",
    "choose",
    "cupy_or_none",
    "describe",
    "get_xp",
    "gpu_available",
    "is_cupy_array",
    "to_backend",
    "xp_of",
]

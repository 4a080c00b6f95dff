"""Argument and device helpers shared by the launchers (no kernels here)."""
from __future__ import annotations

import numpy as np

_SM_COUNT: dict[int, int] = {}


def sm_count() -> int:
    """Streaming multiprocessors of the current device (asked once per device)."""
    import cupy as cp

    dev = cp.cuda.Device().id
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _SM_COUNT[dev]


def null():
    """A null device pointer argument."""
    return np.uintp(0)


def ptr(a):
    """`a`, or a null pointer when it is None (optional kernel arguments)."""
    return null() if a is None else a


def contig(a, dtype, shape, what):
    """Raise ValueError unless `a` is C-contiguous with this dtype and shape."""
    if a.dtype != dtype or tuple(a.shape) != tuple(shape) or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected contiguous {np.dtype(dtype).name}{list(shape)}, "
                         f"got {a.dtype.name}{list(a.shape)} (contiguous={a.flags.c_contiguous})")


def check_dev(a, dtype, shape, what):
    """contig(), and `a` must be a cupy array (TypeError otherwise)."""
    import cupy as cp

    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{what}: expected a cupy array, got {type(a).__name__}")
    contig(a, dtype, shape, what)

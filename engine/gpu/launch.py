"""Kernel launches: CuPy's own, or programmatic dependent launches inside captured graphs.

`capture_graph(stream, enqueue)` records enqueue()'s launches into a CUDA graph. On sm_90+ (and
unless GGUF_PREFILL_PDL=0) every kernel of ours launched meanwhile goes through the driver's
cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the graph gets
programmatic edges, so a kernel's blocks are scheduled while its predecessor finishes and wait
in common.cuh's pdl_entry() (griddepcontrol.wait) for its completion and memory. That hides
the launch latency and block ramp-up of each of the ~350-450 kernels of a decode step. It is
only correct because every kernel in kernels_cu waits before touching global memory
(tests/test_kernels_compile.py checks each entry's PTX); CuPy's own kernels (copies, fills)
are never launched this way.

`Kernel` is what engine.gpu.kernels.get_kernel returns: a cupy.RawKernel's attributes, called
as one (grid, block, args, shared_mem=...).
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager

import numpy as np

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6     # CUlaunchAttributeID


class _AttrValue(ctypes.Union):          # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_void_p), ("allowed", ctypes.c_int)]


class _Attr(ctypes.Structure):           # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):         # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


_state = {"active": False, "driver": None, "log": None}
# (kernel name, grid, block) of each of our launches recorded by the latest capture_graph, in
# order: what the KERNEL_TIMELINE stamps of a replay are matched to (dev/graph_timeline.py)
captured_launches: list[tuple[str, tuple[int, int, int], tuple[int, int, int]]] = []


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(d) <= 3:
        raise ValueError(f"launch dimensions {d!r}: 1 to 3 values")
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


def c_arg(a):
    """One kernel argument as the ctypes value CuPy would pass: an array's device pointer, a
    numpy scalar of its own width, a Python int / float / bool as int64 / double / bool."""
    import cupy

    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.generic):
        return np.ctypeslib.as_ctypes_type(a.dtype)(a.item())
    if isinstance(a, bool):
        return ctypes.c_bool(a)
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    raise TypeError(f"kernel argument of type {type(a).__name__} (expected a cupy array or a scalar)")


def _driver():
    if _state["driver"] is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = (ctypes.POINTER(_Config), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        _state["driver"] = lib
    return _state["driver"]


def occupancy(kernel, threads: int, shared_mem: int = 0) -> int:
    """Blocks of `threads` threads with `shared_mem` dynamic bytes that one SM holds at once
    (cuOccupancyMaxActiveBlocksPerMultiprocessor) for a Kernel or cupy.RawKernel."""
    raw = getattr(kernel, "raw", kernel)
    lib = _driver()
    n = ctypes.c_int()
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(raw.kernel.ptr),
                                                         ctypes.c_int(threads), ctypes.c_size_t(shared_mem))
    if rc:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor({raw.name}): error {rc}")
    return int(n.value)


def launch_programmatic(raw, grid, block, args, shared_mem: int = 0) -> None:
    """cuLaunchKernelEx of a cupy.RawKernel on the current stream, allowed to overlap the
    previous kernel of the stream (the kernel must begin with pdl_entry())."""
    import cupy

    lib = _driver()
    values = [c_arg(a) for a in args]
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    attr = _Attr(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.allowed = 1
    cfg = _Config(grid=(ctypes.c_uint * 3)(*_dims(grid)), block=(ctypes.c_uint * 3)(*_dims(block)),
                  shared_mem=int(shared_mem), stream=cupy.cuda.get_current_stream().ptr,
                  attrs=ctypes.pointer(attr), n_attrs=1)
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), raw.kernel.ptr, params, None)
    if rc:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx({raw.name}): {(name.value or b'?').decode()} ({rc})")


class Kernel:
    """A cupy.RawKernel (its attributes read and set through this) whose calls become
    programmatic launches inside capture_graph()."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        object.__setattr__(self, "raw", raw)

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def __setattr__(self, name, value):
        setattr(self.raw, name, value)

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        if _state["log"] is not None:
            _state["log"].append((self.raw.name, _dims(grid), _dims(block)))
        if _state["active"]:
            launch_programmatic(self.raw, grid, block, args, shared_mem)
        else:
            self.raw(grid, block, args, shared_mem=shared_mem)


def pdl_enabled() -> bool:
    """Programmatic launches in captured graphs: on sm_90+ unless GGUF_PREFILL_PDL=0."""
    import cupy

    if os.environ.get("GGUF_PREFILL_PDL", "1").strip() == "0":
        return False
    try:
        return int(cupy.cuda.Device().compute_capability) >= 90
    except Exception:       # an emulated or unusual device: plain launches
        return False


@contextmanager
def programmatic_launches():
    """Within: our kernels launch with the programmatic attribute (when pdl_enabled())."""
    prev = _state["active"]
    _state["active"] = pdl_enabled()
    try:
        yield
    finally:
        _state["active"] = prev


def capture_graph(stream, enqueue):
    """Record enqueue() on `stream` into a CUDA graph (programmatic launches where enabled),
    upload it and wait for the upload; returns the cupy Graph."""
    log: list = []
    with stream:
        stream.begin_capture()
        prev, _state["log"] = _state["log"], log
        try:
            with programmatic_launches():
                enqueue()
        finally:
            _state["log"] = prev
            graph = stream.end_capture()
    captured_launches[:] = log
    graph.upload(stream)
    stream.synchronize()
    return graph

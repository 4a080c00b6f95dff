"""A CPU stand-in for CuPy + the CUDA kernels, for checking the decode kernels' logic and the
Python plumbing around them on a machine without a GPU (never used by CI or at run time; CI
compiles only cuda_emu.h with the wgmma weight policies, tests/test_wgmma_reference.py).

    from tests.cuda_emu import emu
    emu.install()        # sys.modules["cupy"] = the fake; engine.gpu.kernels.get_kernel -> emulated

Arrays are numpy arrays (a subclass with CuPy's .get()); kernels of kernels_cu/*.cu are compiled
with g++ against cuda_emu.h (one thunk per extern "C" kernel, names from engine.gpu.kernels.INSTANCES)
and run block by block, each CUDA thread a fiber. Kernels written with PTX that the emulator
cannot compile get a numpy stand-in (FALLBACKS). Stream capture records launches; a graph
replays them. Slow: keep shapes small.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("GGP_EMU_BUILD", "/tmp/ggp_cuda_emu"))


# ----------------------------------------------------------------------------- arrays

class ndarray(np.ndarray):
    def get(self, stream=None, out=None):
        return np.array(self, copy=True).view(np.ndarray)

    def set(self, arr, stream=None):
        self[...] = arr


def _wrap(a):
    return np.ascontiguousarray(a).view(ndarray) if not isinstance(a, ndarray) else a


def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype).view(ndarray)


def empty(shape, dtype=np.float32):
    # poisoned, so a read of never-written memory shows
    a = np.empty(shape, dtype=dtype)
    a.view(np.uint8)[...] = 0xFF
    return a.view(ndarray)


def full(shape, value, dtype=np.float32):
    return np.full(shape, value, dtype=dtype).view(ndarray)


def asarray(a, dtype=None):
    return np.array(a, dtype=dtype, copy=True, order="C").view(ndarray) if not isinstance(a, ndarray) \
        else (a if dtype is None else a.astype(dtype).view(ndarray))


def asnumpy(a):
    return np.array(a, copy=True).view(np.ndarray)


# ----------------------------------------------------------------------------- streams, graphs

class Graph:
    def __init__(self, launches):
        self.launches = launches

    def launch(self, stream=None):
        for fn in self.launches:
            fn()

    def upload(self, stream=None):
        pass


class Stream:
    _current: list = []

    def __init__(self, non_blocking=False, null=False):
        self.capturing = None

    def __enter__(self):
        Stream._current.append(self)
        return self

    def __exit__(self, *a):
        Stream._current.pop()

    def begin_capture(self, mode=None):
        self.capturing = []

    def end_capture(self):
        g = Graph(self.capturing)
        self.capturing = None
        return g

    def is_capturing(self):
        return self.capturing is not None

    def synchronize(self):
        pass

    def record(self, event=None):
        e = event or Event()
        e.record(self)
        return e

    def wait_event(self, event):
        pass

    @staticmethod
    def current():
        return Stream._current[-1] if Stream._current else None


class Event:
    def __init__(self, *a, **kw):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


Stream.null = Stream(null=True)


def get_elapsed_time(e0, e1):
    return (e1.t - e0.t) * 1e3


class Device:
    def __init__(self, i=0):
        self.id = i
        self.attributes = {"MultiProcessorCount": 132}

    def synchronize(self):
        pass


def _submit(fn):
    s = Stream.current()
    if s is not None and s.capturing is not None:
        s.capturing.append(fn)
    else:
        fn()


# ----------------------------------------------------------------------------- kernels

_libs: dict[tuple[str, tuple[str, ...]], ctypes.CDLL] = {}
_emu_lib_names: dict[str, set] = {}


def _param_types(params: str) -> list[str]:
    out = []
    for p in [p.strip() for p in params.split(",") if p.strip()]:
        m = re.match(r"(.*?)([A-Za-z_]\w*)\s*$", p)
        out.append(m.group(1).strip())
    return out


def _build(fname: str):
    from engine.gpu import kernels

    lib_key = (fname, kernels.file_defines(fname))        # one build per define set (in-process A/B)
    if lib_key in _libs:
        return _libs[lib_key]
    # the kernel file with the real kernels_cu headers inlined, exactly as NVRTC gets it
    # (common.cuh, numerics.cuh, ...; their GGP_EMU branches stand in for the PTX)
    src = kernels.source(fname)
    header = (HERE / "cuda_emu.h").read_text()
    # GGUF_PREFILL_KERNEL_DEFINES (engine.gpu.kernels.kernel_defines, -DNAME=VALUE) as #defines
    defines = "".join(f"#define {d[2:].replace('=', ' ', 1)}\n" for d in kernels.file_defines(fname))
    full_src = defines + header + "\n" + src
    names = kernels.INSTANCES.get(fname, ())
    BUILD.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256((full_src + repr(names)).encode()).hexdigest()[:16]
    so = BUILD / f"{fname}.{key}.so"
    if not so.exists():
        pre = subprocess.run(["g++", "-std=c++20", "-E", "-x", "c++", "-"], input=full_src, text=True,
                             capture_output=True)
        if pre.returncode:
            raise RuntimeError(f"emu preprocess {fname}:\n{pre.stderr}")
        thunks = []
        for n in names:
            m = re.search(r'extern\s+"C"\s+void\s+' + re.escape(n) + r"\s*\(([^)]*)\)\s*\{", pre.stdout)
            if not m:
                raise RuntimeError(f"emu: kernel {n} not found in {fname}")
            types_ = _param_types(m.group(1))
            args = ", ".join(f"*({t}*)a[{i}]" for i, t in enumerate(types_))
            thunks.append(f'extern "C" void emu_thunk_{n}(void** a) {{ {n}({args}); }}')
        cpp = BUILD / f"{fname}.{key}.cpp"
        cpp.write_text(full_src + "\n" + "\n".join(thunks) + "\n")
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-g", "-fPIC", "-shared", "-ffp-contract=off",
                            "-Wno-unknown-pragmas", "-o", str(so), str(cpp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"emu compile {fname}:\n{r.stderr[-6000:]}")
    lib = ctypes.CDLL(str(so))
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_uint] * 6
    _libs[lib_key] = lib
    return lib


def _carg(a):
    if isinstance(a, np.ndarray):
        return ctypes.c_void_p(a.ctypes.data), a
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a)), None
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a)), None
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a)), None
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a)), None
    raise TypeError(f"kernel argument of type {type(a).__name__} (pass numpy scalars or arrays)")


def _dims(d):
    d = tuple(d) if isinstance(d, (tuple, list)) else (d,)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


class EmuKernel:
    def __init__(self, fname, name):
        self.fname, self.name = fname, name
        self.max_dynamic_shared_size_bytes = 1 << 30
        self.num_regs = 64                  # what launch planners read (mmsb's plan); no occupancy here
        fb = FALLBACKS.get((fname, name))
        for (f, prefix), pfb in PREFIX_FALLBACKS.items():
            if fb is None and f == fname and name.startswith(prefix):
                fb = pfb
        if fb is not None:
            self.fallback = fb
        else:
            self.fallback = None
            lib = _build(fname)
            self.thunk = ctypes.cast(getattr(lib, "emu_thunk_" + name), ctypes.c_void_p)
            self.lib = lib

    def __call__(self, grid, block, args, shared_mem=0, **kw):
        args = tuple(args)
        grid, block = _dims(grid), _dims(block)
        if self.fallback is not None:
            _submit(lambda: self.fallback(grid, block, args))
            return
        conv = [_carg(a) for a in args]

        def run():
            vals = [c for c, _ in conv]
            ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
            rc = self.lib.emu_launch(self.thunk, ptrs, *grid, *block)
            if rc:
                raise RuntimeError(f"emu: {self.name} failed (rc {rc})")
        _submit(run)


def _fb_quantize_q8_1(grid, block, args):
    from engine.formats.quants import quantize_q8_1

    x, q, ds, nblk = args
    n = int(nblk) * 32
    xq, d, s = quantize_q8_1(np.asarray(x).reshape(1, -1)[:, :n])
    np.asarray(q).reshape(-1)[:n] = xq.reshape(-1)
    dsv = np.asarray(ds).reshape(-1, 2)
    dsv[: n // 32, 0] = d.reshape(-1)
    dsv[: n // 32, 1] = s.reshape(-1)


def _fb_mmq(kind):
    """MMQ GEMMs (template kernels with tensor-core PTX) through the numpy oracle."""
    def run(grid, block, args):
        from engine.formats import quants as Q
        from engine.reference.mmq import mmq_reference

        w, aq, ads, y, T, N, K = args[:7]
        T, N, K = int(T), int(N), int(K)
        bs = int(args[7]) if kind == "q6_k" else Q.Q4_K_BYTES
        nb = K // Q.QK_K
        wr = np.asarray(w).reshape(-1)[: N * nb * bs].reshape(N, nb * bs)
        q = np.asarray(aq).reshape(-1)[: T * K].reshape(T, K)
        ds = np.asarray(ads).reshape(-1)[: T * K // 16].reshape(T, K // 32, 2)
        r = mmq_reference(kind, wr, q, ds[..., 0], ds[..., 1], padded=bs == Q.Q6_K_PADDED_BYTES)
        np.asarray(y).reshape(-1)[: T * N] = r.astype(np.float32).reshape(-1)
    return run


def _fb_mmsb(kind):
    """Small-batch GEMMs (mmsb_common.cuh: template kernels with tensor-core PTX; the K split's
    parts reduce inside the launch) through the same numpy oracle; the q6_K block stride from the
    weight array's bytes per row (DeviceWeight rows are whole)."""
    mmq = _fb_mmq(kind)

    def run(grid, block, args):
        from engine.formats import quants as Q

        w, aq, ads, y, T, N, K = args[:7]
        mmq(grid, block, (w, aq, ads, y, T, N, K, np.int32(np.asarray(w).size // (int(N) * (int(K) // Q.QK_K)))))
    return run


FALLBACKS = {("quantize_q8_1.cu", "quantize_q8_1"): _fb_quantize_q8_1}
PREFIX_FALLBACKS = {("mmq_q4_k.cu", "mmq_q4_k<"): _fb_mmq("q4_k"), ("mmq_q6_k.cu", "mmq_q6_k<"): _fb_mmq("q6_k"),
                    ("mmsb_q4_k.cu", "mmsb_q4_k<"): _fb_mmsb("q4_k"), ("mmsb_q6_k.cu", "mmsb_q6_k<"): _fb_mmsb("q6_k")}

_kcache: dict = {}


def get_kernel(fname, name, dynamic_smem=0):
    from engine.gpu import kernels

    key = (fname, name, kernels.file_defines(fname))   # one build per define set, as on the GPU
    k = _kcache.get(key)
    if k is None:
        k = _kcache[key] = EmuKernel(fname, name)
    return k


# ----------------------------------------------------------------------------- install

def install():
    """Put the fake cupy in sys.modules and route engine.gpu.kernels.get_kernel to the emulator."""
    cp = types.ModuleType("cupy")
    cp.__emulated__ = True
    cp.ndarray = ndarray
    for n in ("zeros", "empty", "full", "asarray", "asnumpy"):
        setattr(cp, n, globals()[n])
    cp.array = asarray
    cp.concatenate = lambda arrs, axis=0: _wrap(np.concatenate([np.asarray(a) for a in arrs], axis=axis))
    for n in ("float32", "float16", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
              "uint64"):
        setattr(cp, n, getattr(np, n))
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream, cuda.Event, cuda.Device, cuda.Graph = Stream, Event, Device, Graph
    cuda.get_elapsed_time = get_elapsed_time
    cuda.get_current_stream = lambda: Stream.current() or Stream.null
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    cuda.runtime = runtime
    cp.cuda = cuda
    sys.modules["cupy"] = cp
    sys.modules["cupy.cuda"] = cuda
    from engine.gpu import kernels

    kernels.get_kernel = get_kernel
    return cp

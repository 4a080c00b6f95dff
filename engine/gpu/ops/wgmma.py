"""Hopper f16 GEMM (kernels_cu/wgmma_q4_k.cu, sm_90a; issue 14): y[T, N] = W x with q4_K weights
dequantized to f16 in registers and f16 activations in the kernel's permuted k order; on the
current stream, no sync.

    xp = permute_x16(x)                          # float32 [T, K] -> float16 [T, K], permuted
    y = wgmma_q4k(weight, xp, out, bt, stages)   # DeviceWeight q4_K [N, K] -> float32 [T, N]

Grid: (N / 128 row tiles, ceil(T / bt) token tiles), 256 threads (two warpgroups of 64 rows),
`stages` activation buffers of bt x 64 f16 in dynamic shared memory.
"""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels, registry
from engine.gpu.ops._util import check_dev
from engine.gpu.weights import GGML_Q4_K, DeviceWeight

FILE = "wgmma_q4_k.cu"
ROWS = 128            # WG_ROWS
THREADS = 256         # WG_THREADS
BK = 64               # WG_BK


def smem_bytes(bt: int, stages: int) -> int:
    return stages * bt * BK * 2


def permute_x16(x, out=None):
    """float32 [T, K] -> float16 [T, K] in wgmma_q4_k.cu's k order (engine.reference.wgmma)."""
    import cupy as cp

    T, K = x.shape
    if K % 256:
        raise ValueError(f"permute_x16: K={K} is not a multiple of 256")
    check_dev(x, np.float32, (T, K), "permute_x16 x")
    if out is None:
        out = cp.empty((T, K), dtype=cp.float16)
    check_dev(out, np.float16, (T, K), "permute_x16 out")
    n = T * K
    kernels.get_kernel(FILE, "wgmma_permute_x16")(((n + 255) // 256,), (256,), (x, out, np.int32(T), np.int32(K)))
    return out


def wgmma_q4k(weight: DeviceWeight, xp, out=None, bt: int | None = None, stages: int | None = None):
    """y[T, N] (float32) = xp . W^T for a q4_K DeviceWeight and permuted f16 activations."""
    import cupy as cp

    bt = bt or registry.WGMMA_CONFIG[0]
    stages = stages or registry.WGMMA_CONFIG[1]
    if weight.ggml_type != GGML_Q4_K:
        raise ValueError(f"wgmma_q4k: weight type {weight.type_name} is not q4_K")
    N, K = weight.rows, weight.cols
    if N % ROWS:
        raise ValueError(f"wgmma_q4k: {N} rows is not a multiple of {ROWS}")
    T = xp.shape[0]
    check_dev(xp, np.float16, (T, K), "wgmma_q4k activations")
    if out is None:
        out = cp.empty((T, N), dtype=cp.float32)
    check_dev(out, np.float32, (T, N), "wgmma_q4k out")
    if T == 0:
        return out
    smem = smem_bytes(bt, stages)
    k = kernels.get_kernel(FILE, registry.wgmma_instance(bt, stages), dynamic_smem=smem)
    k((N // ROWS, -(-T // bt)), (THREADS,), (weight.data, xp, out, np.int32(T), np.int32(N), np.int32(K)),
      shared_mem=smem)
    return out

"""One Python function per GPU kernel: shapes, grid, kernel choice, launch.

Arrays are cupy arrays on the current device; every function launches on the current stream
and returns without synchronizing.

    act = quantize_q8_1(x)              # x float32 [T, K] -> Q8Act(q int8 [T, K], ds f32 [T, K/32, 2])
    y = mmq(weight, act)                # DeviceWeight [N, K] -> y float32 [T, N] (token-major)
    y = linear(weight, x)               # both
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine import kernels
from engine.gpu_weights import GGML_Q4_K, GGML_Q6_K, DeviceWeight

# Tile variant per kernel family (engine.kernels.MMQ_CONFIGS), chosen from the measurements in
# docs/perf-log.md: the 128x128 tiles (8 warps of 64x32, KS 256) are fastest once the grid
# fills the GPU; while the 64-token grid still fits on the SMs (one block each), a lone
# 64x128 block finishes ~1.5x sooner than a lone 128x128 one, so short prompts use it.
DEFAULT_VARIANT = {"q4_k": "m128n128w8tc_k256", "q6_k": "m128n128w8_k256"}
SMALL_VARIANT = {"q4_k": "m64n128tc_k256", "q6_k": "m64n128"}
_SM_COUNT: dict[int, int] = {}


def _sm_count() -> int:
    import cupy as cp

    dev = cp.cuda.Device().id
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _SM_COUNT[dev]


def choose_variant(kind: str, tokens: int, rows: int, sm_count: int | None = None) -> str:
    """Production tile variant for a [tokens x rows] MMQ output."""
    sms = sm_count if sm_count is not None else _sm_count()
    small_blocks = -(-tokens // 64) * -(-rows // 128)
    return (SMALL_VARIANT if small_blocks <= sms else DEFAULT_VARIANT)[kind]


class Q8Act(NamedTuple):
    """q8_1 activations on the device: q int8 [T, K]; ds float32 [T, K/32, 2] = (d, s)."""
    q: object
    ds: object

    @property
    def tokens(self) -> int:
        return int(self.q.shape[0])

    @property
    def cols(self) -> int:
        return int(self.q.shape[1])


def _check_dev(a, dtype, shape, what):
    import cupy as cp

    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{what}: expected a cupy array, got {type(a).__name__}")
    if a.dtype != dtype or tuple(a.shape) != tuple(shape) or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected contiguous {np.dtype(dtype).name}{list(shape)}, "
                         f"got {a.dtype.name}{list(a.shape)} (contiguous={a.flags.c_contiguous})")


def quantize_q8_1(x, out: Q8Act | None = None) -> Q8Act:
    """f32 activations [T, K] (K % 32 == 0) -> q8_1 blocks, bit-identical to
    engine.quants.quantize_q8_1 (d = ds[..., 0], s = ds[..., 1])."""
    import cupy as cp

    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"quantize_q8_1: expected [T, K] with K % 32 == 0, got {x.shape}")
    T, K = map(int, x.shape)
    _check_dev(x, np.float32, (T, K), "quantize_q8_1 x")
    if out is None:
        out = Q8Act(cp.empty((T, K), dtype=cp.int8), cp.empty((T, K // 32, 2), dtype=cp.float32))
    else:
        _check_dev(out.q, np.int8, (T, K), "quantize_q8_1 out.q")
        _check_dev(out.ds, np.float32, (T, K // 32, 2), "quantize_q8_1 out.ds")
    nblk = T * K // 32
    if nblk:
        k = kernels.get_kernel("quantize_q8_1.cu", "quantize_q8_1")
        threads = 256
        grid = (nblk * 32 + threads - 1) // threads
        k((grid,), (threads,), (x, out.q, out.ds, np.int64(nblk)))
    return out


def mmq(weight: DeviceWeight, act: Q8Act, out=None, variant: str | None = None):
    """y[T, N] = dequant(weight) . x^T over q8_1 activations, float32, token-major.
    Picks the q4_K or q6_K kernel from the weight; the q6_K arm (uint4 / per-byte) follows
    the weight's layout (padded or raw)."""
    import cupy as cp

    T, K = act.tokens, act.cols
    N = weight.rows
    if K != weight.cols:
        raise ValueError(f"mmq: activations have K={K}, weight {weight.rows}x{weight.cols}")
    if K % 256:
        raise ValueError(f"mmq: K={K} is not a multiple of 256")
    _check_dev(act.q, np.int8, (T, K), "mmq act.q")
    _check_dev(act.ds, np.float32, (T, K // 32, 2), "mmq act.ds")
    if out is None:
        out = cp.empty((T, N), dtype=cp.float32)
    else:
        _check_dev(out, np.float32, (T, N), "mmq out")
    if T == 0 or N == 0:
        return out
    kind = weight.kind
    if weight.ggml_type not in (GGML_Q4_K, GGML_Q6_K):
        raise ValueError(f"mmq: unsupported weight type {weight.ggml_type}")
    variant = variant or choose_variant(kind, T, N)
    bm, bn, nth = kernels.mmq_tile(kind, variant)
    smem = kernels.mmq_smem_bytes(kind, variant)
    k = kernels.get_kernel(f"mmq_{kind}.cu", kernels.mmq_instance(kind, variant), dynamic_smem=smem)
    grid = ((N + bn - 1) // bn, (T + bm - 1) // bm)
    args = [weight.data, act.q, act.ds, out, np.int32(T), np.int32(N), np.int32(K)]
    if kind == "q6_k":
        args.append(np.int32(weight.block_stride))
    k(grid, (nth,), tuple(args), shared_mem=smem)
    return out


def linear(weight: DeviceWeight, x, out=None, variant: str | None = None):
    """x float32 [T, K] -> y float32 [T, N] through q8_1 + MMQ."""
    return mmq(weight, quantize_q8_1(x), out=out, variant=variant)


def q6k_expand_check(blocks_padded):
    """Verification kernel: padded q6_K blocks uint8 [nblocks, 224] (device) ->
    (closed-form expansion, per-element expansion), each int8 [nblocks, 256] centred values."""
    import cupy as cp

    nb = int(blocks_padded.shape[0])
    _check_dev(blocks_padded, np.uint8, (nb, 224), "q6k_expand_check blocks")
    closed = cp.full((nb, 256), 127, dtype=cp.int8)     # poison: never a centred q6 value
    elem = cp.full((nb, 256), 127, dtype=cp.int8)
    k = kernels.get_kernel("q6k_expand_check.cu", "q6k_expand_check")
    units = nb * 4
    k(((units + 255) // 256,), (256,), (blocks_padded, closed, elem, np.int32(nb)))
    return closed, elem

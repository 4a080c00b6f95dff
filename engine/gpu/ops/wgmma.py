"""Hopper f16 GEMMs (kernels_cu/wgmma_q4_k.cu, wgmma_q6_k.cu, sm_90a; issue 14): y[T, N] = W x
with q4_K / q6_K weights dequantized to f16 in registers and f16 activations in the kernels'
tiled, permuted layout (one operand for both formats); on the current stream, no sync.

    xt = tile_x16(x)                                  # float32 [T, K] -> float16 [K/64, ceil(T/8), 8, 8, 8]
    y = wgmma_q4k(weight, xt, T, out, bt, stages, kp) # DeviceWeight q4_K [N, K] -> float32 [T, N]
    y = wgmma_q6k(weight, xt, T, out, bt, stages, kp) # DeviceWeight q6_K (padded or raw), same xt
    ya, yb = wgmma_pair(wa, wb, xt, T, out_a, out_b)  # q4_K wa and q6_K wb in one launch (wgmma_pair.cu)
    ht = wgmma_swiglu(w_gate_up, xt, T, out)          # q4_K [gate; up] -> tiled f16 of silu(g) * u
    wgmma_qkv_rope(ws, xt, T, bq, .., kc, vc, ..)     # [q; k; v] -> rope.cu's outputs (T <= 32)

Grid: (ceil(T / bt) token tiles, N / 128 row tiles (the pair: both matrices'), kp K-parts),
256 threads (two warpgroups of 64 rows), `stages` activation buffers of bt x 64 f16 (and their
mbarriers) in dynamic shared memory; kp > 1: clusters of the kp blocks of one output tile (the
*_kp instances). kp = STREAMK (every launcher here, bt <= 64): the stream-K form
(kernels_cu/wgmma_streamk.cuh, an A/B), a 1-D grid of as many blocks as the GPU holds at once
sharing every tile's super-blocks (the pair: two deals, blocks in proportion to their units), with
a partial-tile workspace (streamk_workspace); the define WG_STREAMK=1 makes it the choice at bt <=
64 where the caller leaves bt and kp.
bt, stages, kp default to the production choice (registry.wgmma_config, wgmma_stages).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.gpu import kernels, launch, registry
from engine.gpu.ops._util import check_dev, ptr, sm_count
from engine.gpu.registry import STREAMK
from engine.gpu.weights import GGML_Q4_K, GGML_Q6_K, DeviceWeight

FILE = "wgmma_q4_k.cu"
Q6_FILE = "wgmma_q6_k.cu"
PAIR_FILE = "wgmma_pair.cu"
ACT_FILE = "wgmma_act.cu"
ROWS = 128            # WG_ROWS
THREADS = 256         # WG_THREADS
BK = 64               # WG_BK


def smem_bytes(bt: int, stages: int, kp: int = 1) -> int:
    """wgmma_common.cuh wg_stage_area (the stage buffers; with kp > 1 at least the partial tile
    of bt x 128 floats), then one 8-byte mbarrier per stage."""
    area = stages * bt * BK * 2
    if kp > 1:
        area = max(area, bt * ROWS * 4)
    return area + 8 * stages


def tiled_shape(T: int, K: int) -> tuple[int, int, int, int, int]:
    return (K // BK, -(-T // 8), 8, 8, 8)


def tiled_buffer(T: int, K: int):
    """A zeroed tiled operand for T tokens (the producers write tokens < T only)."""
    import cupy as cp

    return cp.zeros(tiled_shape(T, K), dtype=cp.float16)


def tile_x16(x, out=None):
    """float32 [T, K] -> float16 [K/64, ceil(T/8), 8, 8, 8] as the wgmma GEMMs read it
    (engine.reference.wgmma.tile_x16), rows past T written zero."""
    import cupy as cp

    T, K = x.shape
    if K % 256:
        raise ValueError(f"tile_x16: K={K} is not a multiple of 256")
    check_dev(x, np.float32, (T, K), "tile_x16 x")
    shape = tiled_shape(T, K)
    if out is None:
        out = cp.empty(shape, dtype=cp.float16)
    check_dev(out, np.float16, shape, "tile_x16 out")
    n = out.size
    if n:
        kernels.get_kernel(ACT_FILE, "wgmma_tile_x16")(((n + 255) // 256,), (256,), (x, out, np.int32(T), np.int32(K)))
    return out


def default_stages(bt: int) -> int:
    """Activation buffers of a bt-token launch: registry.wgmma_stages (8 for bt <= 64: wgmma_gemm
    refills a super-block's 4 buffers after one block barrier), or for bt <= 64 the value of the
    A/B define WG_SMALL_STAGES (4: the ring refilled a buffer a stage, each after a barrier)."""
    stages = registry.wgmma_stages(bt)
    return kernels.define_value("WG_SMALL_STAGES", stages) if bt <= 64 else stages


def _config(op: str, T: int, N: int, K: int, bt: int | None, stages: int | None, kp: int | None):
    """(bt, stages, kp, dynamic shared bytes) of a launch over N rows: the production choice
    (registry.wgmma_config) where bt is None (with the define WG_STREAMK=1, the stream-K form at bt
    <= 64 where kp is None too); a given bt runs unsplit unless kp says."""
    if bt is None:
        bt, auto_kp = registry.wgmma_config(T, N, K)
        if kp is None and bt <= 64 and kernels.define_value("WG_STREAMK", 0):
            kp = STREAMK
        kp = kp or auto_kp
    kp = kp or 1
    stages = stages or default_stages(bt)
    if kp != STREAMK and kp > K // 256:
        raise ValueError(f"{op}: {kp} K-parts of {K // 256} super-blocks (at most one part per super-block)")
    return bt, stages, kp, smem_bytes(bt, stages, 1 if kp == STREAMK else kp)


# ----------------------------------------------------------------------------- stream-K (an A/B)

_sk_work: dict[int, list] = {}          # device -> [part float32, flags int32]
_sk_occupancy: dict[tuple[int, int], int] = {}   # (id of a cached kernel build, shared bytes) -> blocks an SM


def streamk_grid(units: int, per_sm: int, n_sm: int) -> int:
    """Blocks of a stream-K launch: every one resident at once (an owner waits for later blocks,
    wgmma_streamk.cuh), at most one a unit."""
    if per_sm < 1:
        raise ValueError("stream-K: the kernel does not fit an SM")
    return max(1, min(units, per_sm * n_sm))


def streamk_segments(units: int, blocks: int, nsb: int) -> list[list[tuple[int, int, int]]]:
    """The kernel's deal (wgmma_streamk.cuh), for tests and plans: per block its segments (tile,
    first super-block, end), block b taking units b U / G .. (b + 1) U / G - 1."""
    out = []
    for b in range(blocks):
        u, u1 = b * units // blocks, (b + 1) * units // blocks
        segs = []
        while u < u1:
            q, sa = divmod(u, nsb)
            sb_end = min(nsb, sa + (u1 - u))
            segs.append((q, sa, sb_end))
            u += sb_end - sa
        out.append(segs)
    return out


def streamk_block_of(u: int, units: int, blocks: int) -> int:
    """wgmma_streamk.cuh wg_sk_block_of: the block holding unit u."""
    return ((u + 1) * blocks - 1) // units


def streamk_workspace(blocks: int, bt: int, tiles: int):
    """(part, flags) of a stream-K launch: float32 [blocks, bt / 2, 256] partial tiles and int32
    [tiles] arrival counts, zero (the owners leave them zero). One per device, so stream-K GEMMs
    run on one stream at a time (the A/B's benches and tests do); grown only, on the current
    stream: the first launch of a size must be an eager one, before a graph captures it."""
    import cupy as cp

    dev = cp.cuda.Device().id
    work = _sk_work.setdefault(dev, [cp.zeros(0, dtype=cp.float32), cp.zeros(0, dtype=cp.int32)])
    if work[0].size < blocks * bt * 128:
        work[0] = cp.zeros(blocks * bt * 128, dtype=cp.float32)
    if work[1].size < tiles:
        work[1] = cp.zeros(tiles, dtype=cp.int32)
    return work[0], work[1]


def streamk_split(units_a: int, units_b: int, blocks: int) -> int:
    """Blocks of a two-deal launch (the pair) given to the first deal: in proportion to the units,
    at least one to each and no more than a deal's units."""
    if blocks < 2:
        raise ValueError("stream-K pair: two deals need two blocks")
    ga = round(blocks * units_a / (units_a + units_b))
    return max(1, blocks - units_b, min(ga, units_a, blocks - 1))


def _grid_launch(fname: str, name: str, bt: int, kp: int, T: int, rows: tuple[int, ...], K: int, smem: int,
                 args: tuple, tail: tuple = ()) -> None:
    """Kernel `name` of one GEMM over the row counts `rows` (one matrix, or the pair's two): grid
    (token tiles, row tiles, kp) with args + tail, or for kp = STREAMK a 1-D grid of what the SMs
    hold with args + (part, flags) [+ (blocks of the first deal,) for two] + tail."""
    k = kernels.get_kernel(fname, name, dynamic_smem=smem)
    ntok = -(-T // bt)
    if kp != STREAMK:
        k((ntok, sum(rows) // ROWS, kp), (THREADS,), args + tail, shared_mem=smem)
        return
    key = (id(k.raw), smem)            # get_kernel keeps one build per device, file, name and define set
    if key not in _sk_occupancy:
        _sk_occupancy[key] = launch.occupancy(k, THREADS, smem)
    tiles = [ntok * (n // ROWS) for n in rows]
    units = [t * (K // 256) for t in tiles]
    G = streamk_grid(sum(units), _sk_occupancy[key], sm_count())
    split = (np.int32(streamk_split(units[0], units[1], G)),) if len(rows) == 2 else ()
    part, flags = streamk_workspace(G, bt, sum(tiles))
    k((G,), (THREADS,), args + (part, flags) + split + tail, shared_mem=smem)


def _out(label: str, weight: DeviceWeight, T: int, out):
    """The float32 [T, weight.rows] output of a wgmma GEMM (made when None), checked; `label`
    names the operand in errors."""
    import cupy as cp

    N = weight.rows
    if N % ROWS:
        raise ValueError(f"{label}: {N} rows is not a multiple of {ROWS}")
    if out is None:
        out = cp.empty((T, N), dtype=cp.float32)
    check_dev(out, np.float32, (T, N), f"{label} out")
    return out


def _launch(op: str, fname: str, instance: Callable[[int, int, int], str], weight: DeviceWeight, xt, T: int, out,
            bt: int | None, stages: int | None, kp: int | None):
    """The shared checks and launch of the wgmma GEMMs: `instance` is a function (bt, stages, kp)
    -> the template instance of kernels_cu/<fname>."""
    N, K = weight.rows, weight.cols
    out = _out(op, weight, T, out)
    check_dev(xt, np.float16, tiled_shape(T, K), f"{op} activations")
    if T == 0:
        return out
    bt, stages, kp, smem = _config(op, T, N, K, bt, stages, kp)
    _grid_launch(fname, instance(bt, stages, kp), bt, kp, T, (N,), K, smem,
                 (weight.data, xt, out, np.int32(T), np.int32(N), np.int32(K)))
    return out


def wgmma_q4k(weight: DeviceWeight, xt, T: int, out=None, bt: int | None = None, stages: int | None = None,
              kp: int | None = None):
    """y[T, N] (float32) = x . W^T for a q4_K DeviceWeight and xt = tile_x16(x) (module docstring)."""
    if weight.ggml_type != GGML_Q4_K:
        raise ValueError(f"wgmma_q4k: weight type {weight.type_name} is not q4_K")
    return _launch("wgmma_q4k", FILE, registry.wgmma_instance, weight, xt, T, out, bt, stages, kp)


def wgmma_q6k(weight: DeviceWeight, xt, T: int, out=None, bt: int | None = None, stages: int | None = None,
              kp: int | None = None):
    """y[T, N] (float32) = x . W^T for a q6_K DeviceWeight (padded 224-byte or raw 210-byte
    blocks, weight.padded; the same result bit for bit) and xt = tile_x16(x), the operand the
    q4_K GEMM reads (module docstring)."""
    if weight.ggml_type != GGML_Q6_K:
        raise ValueError(f"wgmma_q6k: weight type {weight.type_name} is not q6_K")
    return _launch("wgmma_q6k", Q6_FILE, lambda bt, st, kp: registry.wgmma_q6_instance(weight.padded, bt, st, kp),
                   weight, xt, T, out, bt, stages, kp)


def wgmma_pair(wa: DeviceWeight, wb: DeviceWeight, xt, T: int, out_a=None, out_b=None, bt: int | None = None,
               stages: int | None = None, kp: int | None = None):
    """(ya, yb) = (x . wa^T, x . wb^T) for a q4_K wa and a q6_K wb of the same K in one launch,
    each equal bit for bit to wgmma_q4k / wgmma_q6k with the same bt, stages, kp (the production
    choice: registry.wgmma_config of the two matrices' rows together). kp = STREAMK deals each
    matrix to its share of one grid, so its sums may split elsewhere than a lone launch's."""
    if wa.ggml_type != GGML_Q4_K or wb.ggml_type != GGML_Q6_K:
        raise ValueError(f"wgmma_pair: weight types {wa.type_name}, {wb.type_name} are not q4_K, q6_K")
    if wa.cols != wb.cols:
        raise ValueError(f"wgmma_pair: K differs ({wa.cols} and {wb.cols})")
    K = wa.cols
    outs = [_out("wgmma_pair a", wa, T, out_a), _out("wgmma_pair b", wb, T, out_b)]
    check_dev(xt, np.float16, tiled_shape(T, K), "wgmma_pair activations")
    if T == 0:
        return tuple(outs)
    bt, stages, kp, smem = _config("wgmma_pair", T, wa.rows + wb.rows, K, bt, stages, kp)
    _grid_launch(PAIR_FILE, registry.wgmma_pair_instance(wb.padded, bt, stages, kp), bt, kp, T, (wa.rows, wb.rows),
                 K, smem, (wa.data, outs[0], np.int32(wa.rows), wb.data, outs[1], np.int32(wb.rows), xt, np.int32(T),
                           np.int32(K)))
    return tuple(outs)


def _epilogue_instanced(T: int, N: int, K: int) -> bool:
    """Whether the production tile choice of an N x K launch at T tokens has a fused-epilogue
    instance (those are built for registry.WGMMA_PAIR_LAUNCHED: no KP 8)."""
    return registry.wgmma_config(T, N, K) in registry.WGMMA_PAIR_LAUNCHED


def swiglu_fusable(weight: DeviceWeight, T: int) -> bool:
    """Whether wgmma_swiglu takes this [gate; up] weight at T tokens: q4_K, F = rows / 2 a multiple
    of 256 (the down GEMM's operand), and a production K split that has an instance (KP < 8)."""
    return (weight.ggml_type == GGML_Q4_K and weight.rows % 512 == 0 and T > 0
            and _epilogue_instanced(T, weight.rows, weight.cols))


def wgmma_swiglu(weight: DeviceWeight, xt, T: int, out=None, bt: int | None = None, stages: int | None = None,
                 kp: int | None = None):
    """The gate|up GEMM with SwiGLU fused: weight = [gate; up] q4_K (2 F rows, gate first), xt as
    wgmma_q4k's; out = the tiled f16 operand [T, F] of the down GEMM (tiled_buffer(T, F): tokens
    past T are not written) holding h = silu(gate) * up, bit for bit what wgmma_q4k with the same
    bt, stages, kp and then activation.swiglu_x16 make (kernels_cu/wgmma_common.cuh SWIGLU)."""
    if weight.ggml_type != GGML_Q4_K:
        raise ValueError(f"wgmma_swiglu: weight type {weight.type_name} is not q4_K")
    N, K = weight.rows, weight.cols
    if N % 512:
        raise ValueError(f"wgmma_swiglu: {N} rows is not 2 x a multiple of 256 (gate and up of F % 256 == 0)")
    F = N // 2
    check_dev(xt, np.float16, tiled_shape(T, K), "wgmma_swiglu activations")
    if out is None:
        out = tiled_buffer(T, F)
    check_dev(out, np.float16, tiled_shape(T, F), "wgmma_swiglu out")
    if T == 0:
        return out
    bt, stages, kp, smem = _config("wgmma_swiglu", T, N, K, bt, stages, kp)
    _grid_launch(FILE, registry.wgmma_swiglu_instance(bt, stages, kp), bt, kp, T, (N,), K, smem,
                 (weight.data, xt, out, np.int32(T), np.int32(N), np.int32(K)))
    return out


def _qkv_group(weights, q_dim: int, kv_dim: int, head_dim: int) -> bool:
    """One q4_K [Wq; Wk; Wv], or a q4_K [Wq; Wk] beside a padded q6_K Wv (wgmma_pair's), with
    every RoPE pair inside a 128-row tile (128 % head_dim == 0)."""
    if 128 % head_dim:
        return False
    if len(weights) == 1:
        return (weights[0].ggml_type == GGML_Q4_K and weights[0].rows == q_dim + 2 * kv_dim
                and weights[0].rows % ROWS == 0)
    return (pairs(weights) and weights[1].padded and weights[0].rows == q_dim + kv_dim
            and weights[1].rows == kv_dim)


# The q|k|v GEMM takes the fused RoPE epilogue for ubatches of at most this many tokens (one
# 32-token tile): H100, Session 27, pp32 about +1% in the clean samples (+0.5..+2.0%), but pp64
# 0.98, pp128 0.89-1.02, pp3314 0.92-0.97 (the epilogue's scattered f16 stores cost more than
# the qkv_rope launch they save once the tiles are wide; not profiled). GGUF_PREFILL_KERNEL_DEFINES
# WG_QKV_EPI=0: never, WG_QKV_EPI=2: at every T (the A/B forms).
QKV_ROPE_MAX_T = 32


def qkv_rope_wanted(T: int) -> bool:
    """Whether a T-token ubatch's q|k|v group should take the fused epilogue (QKV_ROPE_MAX_T and
    the WG_QKV_EPI define); qkv_rope_fusable says whether it can."""
    mode = kernels.define_value("WG_QKV_EPI", 1)
    return mode == 2 or (mode == 1 and T <= QKV_ROPE_MAX_T)


def qkv_rope_fusable(weights, T: int, q_dim: int, kv_dim: int, head_dim: int) -> bool:
    """Whether wgmma_qkv_rope takes this q|k|v group at T tokens: _qkv_group's layout and a
    production K split that has an instance (KP < 8)."""
    return (T > 0 and _qkv_group(weights, q_dim, kv_dim, head_dim)
            and _epilogue_instanced(T, sum(w.rows for w in weights), weights[0].cols))


def wgmma_qkv_rope(weights, xt, T: int, bq, bk, bv, cos, sin, qout, kc, vc, start: int, neox: bool,
                   n_heads: int, n_kv_heads: int, head_dim: int, start_dev=None, rows=None,
                   bt: int | None = None, stages: int | None = None, kp: int | None = None) -> None:
    """The q|k|v GEMM with bias + RoPE + the K/V append fused (production at T <= QKV_ROPE_MAX_T;
    kernels_cu/wgmma_rope.cuh): `weights` as qkv_rope_fusable takes them, xt as wgmma_q4k's; the
    outputs (qout, kc, vc) and every other argument as ops.rope.qkv_rope's, bit for bit what the
    GEMM (wgmma_q4k / wgmma_pair, same bt, stages, kp) and then qkv_rope make."""
    from engine.gpu.ops.rope import rope_params

    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    if not _qkv_group(weights, q_dim, kv_dim, head_dim):
        raise ValueError(f"wgmma_qkv_rope: weights {[w.type_name for w in weights]} of rows "
                         f"{[w.rows for w in weights]} are not [q; k; v] q4_K or [q; k] q4_K + v padded q6_K "
                         f"(q {q_dim}, kv {kv_dim}, head_dim {head_dim})")
    K = weights[0].cols
    check_dev(xt, np.float16, tiled_shape(T, K), "wgmma_qkv_rope activations")
    if int(qout.shape[1]) != T:
        raise ValueError(f"wgmma_qkv_rope: qout holds {int(qout.shape[1])} tokens, the GEMM {T}")
    tail = rope_params(cos, sin, qout, kc, vc, start, neox, n_heads, n_kv_heads, head_dim, start_dev, rows,
                       "wgmma_qkv_rope")
    if T == 0:
        return
    N = sum(w.rows for w in weights)
    bt, stages, kp, smem = _config("wgmma_qkv_rope", T, N, K, bt, stages, kp)
    rope = (ptr(bq), ptr(bk), ptr(bv), cos, sin, qout, kc, vc, np.int32(q_dim), np.int32(kv_dim),
            np.int32(head_dim), *tail)
    if len(weights) == 1:
        _grid_launch(FILE, registry.wgmma_rope_instance(bt, stages, kp), bt, kp, T, (N,), K, smem,
                     (weights[0].data, xt, np.int32(T), np.int32(N), np.int32(K)), rope)
    else:
        wa, wb = weights
        _grid_launch(PAIR_FILE, registry.wgmma_pair_rope_instance(True, bt, stages, kp), bt, kp, T,
                     (wa.rows, wb.rows), K, smem,
                     (wa.data, np.int32(wa.rows), wb.data, np.int32(wb.rows), xt, np.int32(T), np.int32(K)), rope)


def pairs(weights) -> bool:
    """Whether wgmma_pair takes these weights (a q4_K then a q6_K matrix of the same K)."""
    return (len(weights) == 2 and weights[0].ggml_type == GGML_Q4_K and weights[1].ggml_type == GGML_Q6_K
            and weights[0].cols == weights[1].cols and all(w.rows % ROWS == 0 for w in weights))


def wgmma(weight: DeviceWeight, xt, T: int, out=None):
    """The Hopper GEMM of the weight's type (q4_K or q6_K), production tile choice."""
    fn = {GGML_Q4_K: wgmma_q4k, GGML_Q6_K: wgmma_q6k}.get(weight.ggml_type)
    if fn is None:
        raise ValueError(f"wgmma: no Hopper GEMM for {weight.type_name}")
    return fn(weight, xt, T, out=out)

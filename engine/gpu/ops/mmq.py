"""MMQ: the prefill GEMMs over q8_1 activations (mmq_q4_k.cu / mmq_q6_k.cu): tile variant
choice, tail-split plan, grid, launch.

Arrays are cupy arrays on the current device; every function launches on the current stream
and returns without synchronizing.

    y = mmq(weight, act)                # DeviceWeight [N, K], Q8Act [T, K] -> y float32 [T, N]
    y = linear(weight, x)               # x float32 [T, K]: q8.quantize_q8_1, then mmq
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import check_dev
from engine.gpu.ops._util import sm_count as _sm_count   # (parameters below are named sm_count)
from engine.gpu.ops.mmvq import mmvq_launch
from engine.gpu.ops.q8 import Q8Act, quantize_q8_1
from engine.gpu.weights import DeviceWeight

# The production tile choice (which config when, tail split or not) is registry data, next to the
# instance list it decides; see engine.gpu.registry for the measurements behind it.
from engine.gpu.registry import (DEFAULT_SPLIT, DEFAULT_VARIANT, MMSB_VARIANT, MMVQ_VARIANT,  # noqa: E402,F401
                                 MMSB_MAX_TOKENS, SMALL_BATCH_TIERS, SMALL_BATCH_WIDE, SMALL_VARIANT,
                                 SPLIT_MAX_PARTS, is_mmsb, split_max_parts)
_SPLIT_BUFFERS: dict[int, tuple] = {}
_RETIRED_BUFFERS: list = []      # outgrown workspaces, kept: CUDA graphs (prefill_graph.py) hold their pointers




def choose_variant(kind: str, tokens: int, rows: int, sm_count: int | None = None) -> str:
    """The production kernel for a [tokens x rows] output: the decode GEMV (MMVQ_VARIANT) or
    an MMQ tile variant, by registry.SMALL_BATCH_WIDE (wide matrices) and SMALL_BATCH_TIERS,
    then by whether the 64-token grid fits on the SMs (the 64-token tile, K split so the grid
    fills them) or not (DEFAULT_VARIANT). GGUF_PREFILL_MMSB_TOKENS=N[:VARIANT] (measurement):
    the small-batch kernel (MMSB_VARIANT or the one named) for every T = 2..N, before the tables."""
    max_t, sb_variant = mmsb_override()
    if 2 <= tokens <= max_t:
        return sb_variant
    for min_t, max_t, min_rows, v in SMALL_BATCH_WIDE[kind]:
        if min_t <= tokens <= max_t and rows >= min_rows:
            return v
    for max_t, v in SMALL_BATCH_TIERS[kind]:
        if tokens <= max_t:
            return v
    sms = sm_count if sm_count is not None else _sm_count()
    small_blocks = -(-tokens // 64) * -(-rows // 128)
    if small_blocks <= sms:
        return SMALL_VARIANT[kind] + kernels.MMQ_SPLIT_SUFFIX
    return DEFAULT_VARIANT[kind] + (kernels.MMQ_SPLIT_SUFFIX if DEFAULT_SPLIT[kind] else "")


def mmsb_override() -> tuple[int, str]:
    """GGUF_PREFILL_MMSB_TOKENS=N[:VARIANT] -> (N, VARIANT or MMSB_VARIANT); (0, ..) when unset:
    the small-batch kernel up to N tokens whatever SMALL_BATCH_TIERS says (an A/B of the
    crossover, or of a registry.mmsb_config variant, in one call)."""
    raw = os.environ.get("GGUF_PREFILL_MMSB_TOKENS", "").strip()
    if not raw:
        return 0, MMSB_VARIANT
    n, _, variant = raw.partition(":")
    variant = variant or MMSB_VARIANT
    if not n.isdigit() or int(n) > MMSB_MAX_TOKENS or not is_mmsb(variant):
        raise ValueError(f"GGUF_PREFILL_MMSB_TOKENS={raw[:40]!r}: want N[:VARIANT], N a token count "
                         f"0..{MMSB_MAX_TOKENS}, VARIANT {MMSB_VARIANT} or {MMSB_VARIANT}.r<MR>d<D>")
    return int(n), variant


def split_plan(tiles: int, slots: int, stages: int, max_parts: int = SPLIT_MAX_PARTS) -> tuple[int, int]:
    """(split0, parts) for `tiles` equal blocks on `slots` block slots (SMs x blocks per SM)
    and `stages` K stages per tile: the last tiles % slots tiles (the partial last wave) are
    each computed by `parts` blocks over 1/parts of K, so that wave takes ~1/parts of a tile's
    time instead of a whole one (tiles // slots + 1/parts waves instead of + 1). parts is the
    most that still fit in one wave (<= slots // tail, <= stages, <= max_parts); (tiles, 1)
    when that is < 2 (no split)."""
    tail = tiles % slots
    parts = min(slots // tail, stages, max_parts) if tail else 1
    return (tiles - tail, parts) if parts >= 2 else (tiles, 1)


class MmqGrid(NamedTuple):
    tiles: int        # output tiles BM x BN
    split0: int       # tiles >= split0 are split along K ...
    parts: int        # ... into this many blocks each
    blocks: int       # blocks with work: split0 whole tiles + the split tiles x parts
    waves: float      # predicted duration in whole-tile waves (1 per wave unsplit)


def mmq_grid(kind: str, variant: str, T: int, N: int, K: int, sm_count: int | None = None,
             split: tuple[int, int] | None = None) -> MmqGrid:
    """Grid of one MMQ launch. A "+split" variant uses split_plan with slots = SMs x the
    instance's blocks per SM (its __launch_bounds__ minimum, which the register and shared
    memory use make exact); `split` = (split0, parts) forces a plan (tests)."""
    bm, bn, _ = kernels.mmq_tile(kind, variant)
    _, _, _, _, minb, ks, _ = kernels.mmq_config(kind, variant)
    tiles = -(-T // bm) * -(-N // bn)
    stages = K // ks
    slots = (sm_count if sm_count is not None else _sm_count()) * minb
    if split is None:
        split = (split_plan(tiles, slots, stages, split_max_parts(variant))
                 if kernels.mmq_split_name(variant)[1] else (tiles, 1))
    split0, parts = split
    if not (0 <= split0 <= tiles and 1 <= parts <= max(stages, 1)):
        raise ValueError(f"mmq: split {split} for {tiles} tiles of {stages} stages")
    if parts == 1:
        split0 = tiles
    # waves of whole tiles, then those of the parts (the longest part: ceil(stages / parts)
    # of the tile's stages); for split_plan's plans ~ tiles // slots + 1/parts
    part_len = -(-stages // parts) / max(stages, 1)
    waves = -(-split0 // slots) + -(-(tiles - split0) * parts // slots) * part_len
    return MmqGrid(tiles, split0, parts, split0 + (tiles - split0) * parts, waves)


def _split_buffers(n_floats: int, n_slots: int):
    """Workspace float32 [>= n_floats] and counters uint32 [>= n_slots] (zero; the kernels
    re-arm them) of the tail split, per device, grown on demand (an outgrown one is kept alive,
    a captured graph may replay into it). One MMQ launch at a time
    may use them (the forward runs on one stream)."""
    import cupy as cp

    dev = cp.cuda.Device().id
    ws, cnt = _SPLIT_BUFFERS.get(dev, (None, None))
    if ws is None or ws.size < n_floats:
        if ws is not None:
            _RETIRED_BUFFERS.append(ws)       # a captured graph may still point at it
        ws = cp.empty(n_floats, dtype=cp.float32)
    if cnt is None or cnt.size < n_slots:
        if cnt is not None:
            _RETIRED_BUFFERS.append(cnt)
        cnt = cp.zeros(max(n_slots, 1024), dtype=cp.uint32)
    _SPLIT_BUFFERS[dev] = (ws, cnt)
    return ws, cnt


def mmq(weight: DeviceWeight, act: Q8Act, out=None, variant: str | None = None,
        split: tuple[int, int] | None = None):
    """y[T, N] = dequant(weight) . x^T over q8_1 activations, float32, token-major.
    Picks the q4_K or q6_K kernel from the weight (MMVQ_VARIANT: the decode GEMV, T = 1); the q6_K arm (uint4 / per-byte) follows
    the weight's layout (padded or raw). variant: a kernels.MMQ_CONFIGS name, optionally with
    "+split" (the tail split, mmq_grid); default choose_variant. split = (split0, parts)
    forces a split plan (tests)."""
    import cupy as cp

    T, K = act.tokens, act.cols
    N = weight.rows
    if K != weight.cols:
        raise ValueError(f"mmq: activations have K={K}, weight {weight.rows}x{weight.cols}")
    if K % 256:
        raise ValueError(f"mmq: K={K} is not a multiple of 256")
    check_dev(act.q, np.int8, (T, K), "mmq act.q")
    check_dev(act.ds, np.float32, (T, K // 32, 2), "mmq act.ds")
    if out is None:
        out = cp.empty((T, N), dtype=cp.float32)
    else:
        check_dev(out, np.float32, (T, N), "mmq out")
    if T == 0 or N == 0:
        return out
    kind = weight.kind
    if kind not in kernels.MMQ_CONFIGS:
        raise ValueError(f"mmq: no GEMM kernel for weight type {weight.type_name}")
    variant = variant or choose_variant(kind, T, N)
    if kernels.is_mmsb(variant):
        from engine.gpu.ops.mmsb import mmsb

        return mmsb(weight, act, out, _sm_count(), variant, parts=None if split is None else split[1],
                    workspace=_split_buffers)
    if variant == MMVQ_VARIANT:
        if T != 1:
            raise ValueError(f"mmq: the {MMVQ_VARIANT} kernel takes one token, got {T}")
        mmvq_launch([weight], [out.reshape(N)], act.q.reshape(K), act.ds.reshape(K // 32, 2), "store")
        return out
    bm, bn, nth = kernels.mmq_tile(kind, variant)
    smem = kernels.mmq_smem_bytes(kind, variant)
    g = mmq_grid(kind, variant, T, N, K, split=split)
    args = [weight.data, act.q, act.ds, out, np.int32(T), np.int32(N), np.int32(K)]
    if weight.qtype.padded_bytes != weight.qtype.block_bytes:    # two layouts (q6_K): the kernel takes the stride
        args.append(np.int32(weight.block_stride))
    args += [np.int32(g.split0), np.int32(g.parts)]
    if g.split0:                    # whole tiles [0, split0), 2-D grid (common.cuh mmq_work)
        nx = -(-N // bn)
        k = kernels.get_kernel(f"mmq_{kind}.cu", kernels.mmq_instance(kind, variant), dynamic_smem=smem)
        k((nx, -(-g.split0 // nx)), (nth,), tuple(args + [out, out]), shared_mem=smem)
    if g.parts > 1:                 # then the K-parts of the tiles of the last, partial wave
        ws, cnt = _split_buffers((g.tiles - g.split0) * g.parts * bm * bn, g.tiles - g.split0)
        k = kernels.get_kernel(f"mmq_{kind}.cu", kernels.mmq_instance(kind, variant, split_part=True),
                               dynamic_smem=smem)
        k((g.blocks - g.split0,), (nth,), tuple(args + [ws, cnt]), shared_mem=smem)
    return out


def linear(weight: DeviceWeight, x, out=None, variant: str | None = None):
    """x float32 [T, K] -> y float32 [T, N] through q8_1 + MMQ."""
    return mmq(weight, quantize_q8_1(x), out=out, variant=variant)

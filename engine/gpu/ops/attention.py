"""Attention launchers.

Prefill (attention_prefill.cu, mma.sync; attention_wgmma.cu, Hopper wgmma, chosen by
prefill_variant): causal GQA flash attention of a ubatch of queries (f16 [H, n, hd], rope.cu's
output) over the layer's f16 cache, q8_1 or float32 output (the two gave the same bits in every
measured case).

Varlen (attention_prefill.cu's varlen entry): a batched step mixing sequences (continuous
batching): the rows of several sequences, each at its own positions over its own cache rows,
cut into the same 64-query tiles (varlen_tiles) and run by the same loop as the prefill. With
a VarlenDecode, the one-query tiles (every decoder's token) go instead to attention_decode.cu's
varlen split + combine (varlen_plan): the prefill loop gives a lone query one warp of four and
walks its keys in one block; the split spreads them over the GPU.

Decode (attention_decode.cu): one query row per head over keys 0..pos (pos read on the device),
split over keys then combined, q8_1 output for the Wo GEMV.
"""
from __future__ import annotations

import os

import numpy as np

from engine.errors import GGUFError
from engine.gpu import kernels, registry
from engine.gpu.ops._util import contig, null, ptr, sm_count

# prefill
ATT_BQ = 64                 # queries per attention block (attention_prefill.cu AT_BQ)
ATT_THREADS = 128
ATT_HEAD_DIMS = registry.ATT_PREFILL_HEAD_DIMS   # instantiated head sizes
# attention_wgmma.cu's block shape in production (its AW_NWG, AW_BK, AW_STAGES, AW_PROD defaults);
# an A/B run may change each through GGUF_PREFILL_KERNEL_DEFINES, and the launcher follows
ATT_WGMMA_NWG, ATT_WGMMA_BK, ATT_WGMMA_STAGES, ATT_WGMMA_PROD = 2, 128, 3, 1
ATT_WGMMA_KST, ATT_WGMMA_VST = 3, 3       # its K / V ring sizes under the AW_SPLIT A/B define
# Ubatches of fewer queries take fa2 on sm_90 too (prefill_variant): at 32 queries (llama2-7b
# pp32, ncu, H100) fa2 runs 5.5 us a layer against wgmma's 6.5; whole model pp32 1.010x, pp128
# 1.007x (docs/perf-log.md Session 23). Not measured between 129 and 511.
ATT_WGMMA_MIN_QUERIES = 129
SMEM_PER_BLOCK_MAX = 227 * 1024    # dynamic shared memory of one block on sm_90
# prefill kernel variants (dev/attn_bench compares them): "fa2" = attention_prefill.cu (mma.sync,
# any GPU), "wgmma" = attention_wgmma.cu (Hopper warpgroup MMAs, sm_90); prefill_variant chooses
PREFILL_VARIANTS = ("fa2", "wgmma")
# decode
ATT_TK = 64                 # keys per attention tile (attention_decode.cu)


def _cupy():
    import cupy as cp

    return cp


def wgmma_warpgroups() -> int:
    """Warpgroups (64 queries each) of an attention_wgmma.cu block: AW_NWG, 2 unless an A/B run
    sets it through GGUF_PREFILL_KERNEL_DEFINES."""
    return kernels.define_value("AW_NWG", ATT_WGMMA_NWG)


def wgmma_block_threads() -> int:
    """Threads of an attention_wgmma.cu block: 128 per warpgroup of queries, and 128 more for the
    producer warpgroup (AW_PROD; 0 under that A/B define)."""
    return 128 * (wgmma_warpgroups() + kernels.define_value("AW_PROD", ATT_WGMMA_PROD))


def attention_smem_bytes(head_dim: int, variant: str = "fa2") -> int:
    """Dynamic shared memory of a prefill attention block: fa2 Q + 2 x (K, V) tiles of 64 rows;
    wgmma AW_STAGES x (K, V) tiles of AW_BK keys (AW_SPLIT: AW_KST K and AW_VST V tiles), a 64-row
    Q tile per warpgroup, then two 8-byte mbarriers per stage (AW_SPLIT: per tile buffer)."""
    if variant == "fa2":
        return 5 * 64 * head_dim * 2
    split = kernels.define_value("AW_SPLIT", 0)     # K and V rings of their own (an A/B define)
    if split:
        tiles = kernels.define_value("AW_KST", ATT_WGMMA_KST) + kernels.define_value("AW_VST", ATT_WGMMA_VST)
    else:
        tiles = 2 * kernels.define_value("AW_STAGES", ATT_WGMMA_STAGES)
    rows = tiles * kernels.define_value("AW_BK", ATT_WGMMA_BK) + 64 * wgmma_warpgroups()
    mbarriers = 2 * tiles if split else tiles       # full + empty per buffer, or per K+V stage
    nbytes = rows * head_dim * 2 + 8 * mbarriers
    if nbytes > SMEM_PER_BLOCK_MAX:
        raise ValueError(f"attention_wgmma.cu at head size {head_dim} with GGUF_PREFILL_KERNEL_DEFINES="
                         f"{os.environ.get('GGUF_PREFILL_KERNEL_DEFINES', '')!r} needs {nbytes // 1024} "
                         f"KB of shared memory, over the {SMEM_PER_BLOCK_MAX // 1024} KB of a block")
    return nbytes


def prefill_grid(n_tiles: int, heads: int) -> tuple[int, int]:
    """Grid of a prefill / varlen attention launch: (heads, tiles), so blocks go out longest
    first over all heads (attention_common.cuh, at_head_tile)."""
    return heads, n_tiles


def prefill_variant(n_queries: int | None = None) -> str:
    """The attention_prefill kernel for a ubatch of n_queries: "wgmma" on an sm_90 GPU (measured
    1.23-1.33x attention_prefill.cu on the H100 at head size 128, outputs bit-identical) from
    ATT_WGMMA_MIN_QUERIES queries on, "fa2" below that and on other GPUs; GGUF_PREFILL_ATTN names
    the variant instead, for every size (A/B runs: fa2 anywhere, wgmma on sm_90 only)."""
    env = os.environ.get("GGUF_PREFILL_ATTN", "").strip()
    if env and env not in PREFILL_VARIANTS:
        raise GGUFError(f"GGUF_PREFILL_ATTN={env!r}: one of {', '.join(PREFILL_VARIANTS)}")
    if env == "fa2":
        return "fa2"
    import cupy

    if getattr(cupy.cuda.Device(), "compute_capability", "") != "90":
        return "fa2"
    small = not env and n_queries is not None and n_queries < ATT_WGMMA_MIN_QUERIES
    return "fa2" if small else "wgmma"


def _check_io(op: str, qh, kc, vc, out_act, out_f32, out_x16):
    """Shapes of an attention launch; (H, n, hd, KVH, maxT, output form, O, Oq, Ods)."""
    from engine.gpu.ops.wgmma import tiled_shape

    H, n, hd = map(int, qh.shape)
    KVH, maxT = int(kc.shape[0]), int(kc.shape[1])
    if hd not in ATT_HEAD_DIMS:
        raise ValueError(f"{op}: head size {hd} not instantiated ({ATT_HEAD_DIMS})")
    if H % KVH:
        raise ValueError(f"{op}: {H} heads over {KVH} KV heads")
    if sum(o is not None for o in (out_act, out_f32, out_x16)) != 1:
        raise ValueError(f"{op}: give exactly one of out_act, out_f32, out_x16")
    contig(qh, np.float16, (H, n, hd), "attention q")
    contig(kc, np.float16, (KVH, maxT, hd), "attention kc")
    contig(vc, np.float16, (KVH, maxT, hd), "attention vc")
    QD = H * hd
    if out_act is not None:
        contig(out_act.q, np.int8, (n, QD), "attention out q")
        contig(out_act.ds, np.float32, (n, QD // 32, 2), "attention out ds")
        return H, n, hd, KVH, maxT, "q8", null(), out_act.q, out_act.ds
    if out_x16 is not None:
        if QD % 256:
            raise ValueError(f"{op}: {H} x {hd} columns are no whole 256-column super-blocks for out_x16")
        contig(out_x16, np.float16, tiled_shape(n, QD), "attention out x16")
        return H, n, hd, KVH, maxT, "x16", out_x16, null(), null()
    contig(out_f32, np.float32, (n, QD), "attention out")
    return H, n, hd, KVH, maxT, "f32", out_f32, null(), null()


def attention_prefill(qh, kc, vc, start: int, out_act=None, out_f32=None, start_dev=None,
                      variant: str | None = None, out_x16=None) -> None:
    """Causal GQA attention of the ubatch queries qh f16 [H, n, hd] (rope.cu's output) over the
    layer's cache kc/vc f16 [KVH, maxT, hd] (keys 0..start+n-1). Output: out_act (Q8Act
    [n, H*hd], the attn_output MMQ GEMM's input), out_f32 (float32 [n, H*hd]) or out_x16 (the
    Hopper GEMM's tiled f16 operand, ops.wgmma.tiled_shape(n, H*hd): the bits tile_x16 makes of
    out_f32); exactly one.
    start_dev (int32 [1] on the device, or None) is added to start in the kernel. variant: one of
    PREFILL_VARIANTS (None: the production choice)."""
    H, n, hd, KVH, maxT, out, o, oq, ods = _check_io("attention_prefill", qh, kc, vc, out_act, out_f32, out_x16)
    if variant is None:
        variant = prefill_variant(n)
    if variant not in PREFILL_VARIANTS:
        raise ValueError(f"attention_prefill: unknown variant {variant!r} ({PREFILL_VARIANTS})")
    if start + n > maxT:
        raise ValueError(f"attention_prefill: tokens {start}..{start + n} exceed the cache ({maxT})")
    if n == 0:
        return
    smem = attention_smem_bytes(hd, variant)
    if variant == "wgmma":
        k = kernels.get_kernel("attention_wgmma.cu", registry.attn_wgmma_name(hd, out),
                               dynamic_smem=smem)
        bq, nth = 64 * wgmma_warpgroups(), wgmma_block_threads()
    else:
        k = kernels.get_kernel("attention_prefill.cu", registry.attn_prefill_name(hd, out), dynamic_smem=smem)
        bq, nth = ATT_BQ, ATT_THREADS
    k(prefill_grid((n + bq - 1) // bq, H), (nth,),
      (qh, kc, vc, o, oq, ods, np.int32(n), np.int32(H), np.int32(KVH), ptr(start_dev), np.int32(start),
       np.int32(maxT)), shared_mem=smem)


# ----------------------------------------------------------------------------- varlen (batched step)

def varlen_max_tiles(n_rows: int, max_seqs: int) -> int:
    """Most tiles that varlen_tiles can make from n_rows query rows in at most max_seqs sequences
    (a fixed grid for a CUDA graph of a batched step): sum ceil(n_s / 64) <= (T + 63 E) // 64
    (<= T // 64 + E), and never more than T (a tile holds at least one query)."""
    if n_rows < 0 or max_seqs < 0:
        raise ValueError(f"varlen_max_tiles: {n_rows} rows, {max_seqs} sequences")
    return min(n_rows, (n_rows + (ATT_BQ - 1) * max_seqs) // ATT_BQ)


def varlen_tiles(seqs, n_tiles: int | None = None) -> np.ndarray:
    """The tiles (int32 [n, 4] of (row0, nq, pos0, kvbase)) of attention_varlen (host, numpy).

    seqs: (row0, n, start, kvbase) per sequence: its n queries are rows row0..row0+n-1 of the
    batch at positions start..start+n-1, its key p at cache row kvbase + p. Each sequence is cut
    into tiles of ATT_BQ queries from its first query (the tiles attention_prefill makes for it
    with that start); tiles in decreasing key count (pos0 + nq; the longest first, stable),
    then zero tiles (skipped by the kernel) up to n_tiles when given (ValueError if more are
    needed)."""
    tiles = []
    for i, seq in enumerate(seqs):
        row0, n, start, kvbase = (int(x) for x in seq)
        if min(row0, n, start, kvbase) < 0:
            raise ValueError(f"varlen_tiles: sequence {i} {tuple(seq)} has a negative field")
        for q0 in range(0, n, ATT_BQ):
            tiles.append((row0 + q0, min(ATT_BQ, n - q0), start + q0, kvbase))
    tiles.sort(key=lambda t: -(t[2] + t[1]))
    return _pad_rows(tiles, n_tiles, "tiles")


def _pad_rows(rows: list, n: int | None, what: str) -> np.ndarray:
    if n is not None:
        if len(rows) > n:
            raise ValueError(f"varlen: {len(rows)} {what} needed, the grid has {n}")
        rows = rows + [(0, 0, 0, 0)] * (n - len(rows))
    return np.array(rows, dtype=np.int32).reshape(-1, 4)


def varlen_max_multi_tiles(n_rows: int, max_seqs: int) -> int:
    """Most tiles of two or more queries (varlen_plan's first part) in n_rows rows of at most
    max_seqs sequences: varlen_max_tiles, and at most n_rows // 2 (none for a 1-token step)."""
    return min(n_rows // 2, varlen_max_tiles(n_rows, max_seqs))


def varlen_plan(seqs, n_tiles: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """varlen_tiles' tiles split for attention_varlen with a VarlenDecode: (the tiles of two
    or more queries, zero tiles up to n_tiles; the one-query tiles as decode rows int32
    [n_rows, 4] = (row, keys = pos + 1, kvbase, 0), zero rows up to n_rows)."""
    tiles = varlen_tiles(seqs).tolist()
    multi = [t for t in tiles if t[1] > 1]
    rows = [(t[0], t[2] + 1, t[3], 0) for t in tiles if t[1] == 1]
    return _pad_rows(multi, n_tiles, "tiles"), _pad_rows(rows, n_rows, "decode rows")


# decode rows of a batched step (attention_decode.cu varlen): key splits enough for about
# VARLEN_BLOCKS_PER_SM (row, KV head, split) blocks per SM, at most VARLEN_MAX_SPLIT. Measured
# (ncu, llama2-7b shape, depth 256; perf-log session 7 run 8), attention ms per step for 2 / 4 / 8
# blocks per SM: 32 rows 1.539 / 1.541 / 1.686, 8 rows 0.692 / 0.651 / 0.644, 1 row (9 / 16 / 16
# splits) 0.298 / 0.337 / 0.337.
VARLEN_BLOCKS_PER_SM = 4
VARLEN_MAX_SPLIT = 8


class VarlenDecode:
    """The decode rows of a batched step for attention_varlen: rows_dev int32 [R, 4] on the
    device (varlen_plan's second part), and the split workspace for R rows of H heads."""

    def __init__(self, rows_dev, n_heads: int, n_kv_heads: int, head_dim: int, n_sm: int | None = None):
        cp = _cupy()
        R = int(rows_dev.shape[0])
        if n_sm is None:
            n_sm = sm_count()
        self.rows = rows_dev
        self.n_split = max(1, min(VARLEN_MAX_SPLIT, -(-VARLEN_BLOCKS_PER_SM * n_sm // max(1, R * n_kv_heads))))
        self.part_o = cp.empty((max(R, 1), n_heads, self.n_split, head_dim), dtype=cp.float32)
        self.part_ml = cp.empty((max(R, 1), n_heads, self.n_split, 2), dtype=cp.float32)


def attention_varlen(qh, kc, vc, tiles_dev, out_act=None, out_f32=None, decode: VarlenDecode | None = None,
                     out_x16=None) -> None:
    """Causal GQA attention of a batched step mixing sequences: queries qh f16 [H, T, hd]
    (rope.cu's output, rows in batch order), the layer's cache kc/vc f16 [KVH, maxT, hd], and
    tiles_dev int32 [n_tiles, 4] on the device (varlen_tiles: (row0, nq, pos0, kvbase) per
    tile, zero tiles skipped; their ranges are the caller's check). One block per tile and
    head. Output rows in batch order: out_act (Q8Act [T, H*hd]), out_f32 (float32 [T, H*hd]) or,
    without decode rows, out_x16 (attention_prefill's); exactly one. decode (VarlenDecode): its
    rows (the one-query tiles, which tiles_dev then leaves out: varlen_plan) through
    attention_decode.cu's varlen split + combine, grids (splits, KVH, R) and (H, R)."""
    H, T, hd, KVH, maxT, out, o, oq, ods = _check_io("attention_varlen", qh, kc, vc, out_act, out_f32, out_x16)
    if out == "x16" and decode is not None:
        raise ValueError("attention_varlen: decode rows (attention_decode.cu) write f32 or q8_1, not out_x16")
    n_tiles = int(tiles_dev.shape[0]) if tiles_dev.ndim == 2 else -1
    contig(tiles_dev, np.int32, (max(n_tiles, 0), 4), "attention tiles")
    _check_int4(tiles_dev, "tiles")
    if T == 0:
        return
    if n_tiles:
        smem = attention_smem_bytes(hd)
        k = kernels.get_kernel("attention_prefill.cu", registry.attn_prefill_varlen_name(hd, out), dynamic_smem=smem)
        k(prefill_grid(n_tiles, H), (ATT_THREADS,),
          (qh, kc, vc, o, oq, ods, tiles_dev, np.int32(T), np.int32(H), np.int32(KVH), np.int32(maxT)),
          shared_mem=smem)
    if decode is None:
        return
    R, G = int(decode.rows.shape[0]), H // KVH
    contig(decode.rows, np.int32, (R, 4), "attention decode rows")
    _check_int4(decode.rows, "decode rows")
    if G not in registry.ATTN_GROUPS or hd not in registry.ATTN_HEAD_DIMS:
        raise GGUFError(f"attention_varlen: {H} heads / {KVH} KV heads, head size {hd} is not compiled for "
                        f"decode rows (groups {registry.ATTN_GROUPS}, head sizes {registry.ATTN_HEAD_DIMS})")
    S = decode.n_split
    contig(decode.part_o, np.float32, (max(R, 1), H, S, hd), "attention decode part_o")
    contig(decode.part_ml, np.float32, (max(R, 1), H, S, 2), "attention decode part_ml")
    if R == 0:
        return
    ks = kernels.get_kernel("attention_decode.cu", registry.attn_split_varlen_name(hd, G))
    ks((S, KVH, R), (128,), (qh, kc, vc, decode.rows, np.int32(T), np.int32(maxT), decode.part_o, decode.part_ml))
    kc_ = kernels.get_kernel("attention_decode.cu", registry.attn_combine_varlen_name(hd))
    kc_((H, R), (hd,), (decode.part_o, decode.part_ml, decode.rows, np.int32(S), o, oq, ods))


def _check_int4(a, what: str) -> None:
    ptr_ = getattr(getattr(a, "data", None), "ptr", 0)
    if isinstance(ptr_, int) and ptr_ % 16:
        raise ValueError(f"attention_varlen: {what} must be 16-byte aligned (the kernel reads int4)")


# ----------------------------------------------------------------------------- decode

def attention_splits(max_tokens: int, n_kv_heads: int, n_sm: int | None = None) -> int:
    """Splits over keys: enough blocks to fill the GPU (about 4 per SM) at the longest context,
    but at least a tile of keys per split."""
    if n_sm is None:
        n_sm = sm_count()
    return max(1, min(-(-max_tokens // ATT_TK), -(-4 * n_sm // n_kv_heads)))


def attention_launch(q, k_layer, v_layer, tok_stride: int, head_stride: int, pos_dev,
                     n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype: str, n_split: int,
                     part_o, part_ml, oq, ods, out=None) -> None:
    """Decode attention of q [H, hd] (float32) over keys 0..pos (pos read on the device):
    split kernel, then combine kernel; writes q8_1 (oq, ods) and, if given, float32 `out`."""
    group = n_heads // n_kv_heads
    if group not in registry.ATTN_GROUPS or head_dim not in registry.ATTN_HEAD_DIMS:
        raise GGUFError(f"decode attention: {n_heads} heads / {n_kv_heads} KV heads, head size {head_dim} "
                        f"is not compiled (groups {registry.ATTN_GROUPS}, head sizes {registry.ATTN_HEAD_DIMS})")
    scale = np.float32(1.0 / np.sqrt(head_dim))
    o = out if out is not None else null()
    ks = kernels.get_kernel("attention_decode.cu", registry.attn_split_name(head_dim, group, kv_dtype))
    ks((n_split, n_kv_heads), (128,), (q, k_layer, v_layer, np.int64(tok_stride), np.int64(head_stride),
                                       pos_dev, scale, part_o, part_ml))
    kc = kernels.get_kernel("attention_decode.cu", registry.attn_combine_name(head_dim))
    kc((n_heads,), (head_dim,), (part_o, part_ml, np.int32(n_split), o, oq, ods))

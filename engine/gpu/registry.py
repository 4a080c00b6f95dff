"""Every production kernel instance, per kernels_cu file: the one list that the run-time
compile (engine.gpu.kernels.get_module), the CPU compile check (compile_for_check,
tests/test_kernels_compile.py) and the CPU emulator (tests/cuda_emu) read.

A leaf module (no engine imports): names and tile geometry only. Only instances that the
product launches are here; experiment arms that lost their measurements were removed from
the kernels and are listed, with the perf-log run that retired them and the commit where
their code still is, in dev/RETIRED.md.

Prefill GEMMs (mmq_q4_k.cu / mmq_q6_k.cu, launched by engine.gpu.ops.mmq): a template instance
per tile configuration; the configuration names are MMQ_CONFIGS keys, a launch's variant name
may end in MMQ_SPLIT_SUFFIX (the tail split: the whole-tile instance, then its split-part
instance). Decode GEMVs (mmvq_*.cu, engine.gpu.ops.mmvq) and everything else: extern "C"
kernels, so the listed name is also the lowered name.
"""
from __future__ import annotations

import re

# ----------------------------------------------------------------------------- MMQ (prefill GEMMs)

# name -> (MT, NT, WM, WN, MINB, KS, TC): warp tile (16 MT) tokens x (8 NT) rows, WM x WN warps,
# block tile BM = 16 MT WM tokens x BN = 8 NT WN rows, __launch_bounds__ minimum blocks per SM
# MINB, KS k per pipeline stage (128 = half a super-block, 256 = one); last field, q4_K: the min
# term per stage on TF32 tensor cores (1); q6_K: the compute loop's unroll over the stage's
# q8_1 blocks (1). Measured in docs/perf-log.md (runs 7 and 9 chose these).
MMQ_CONFIGS: dict[str, dict[str, tuple[int, int, int, int, int, int, int]]] = {
    "q4_k": {
        "m16n128tc_k256": (1, 4, 1, 4, 3, 256, 1),      # 4 warps of 16x32, 3 blocks/SM (small batch)
        "m32n128tc_k256": (1, 4, 2, 4, 2, 256, 1),      # 8 warps of 16x32, 2 blocks/SM (small batch)
        "m64n128tc_k256": (2, 4, 2, 4, 2, 256, 1),      # 8 warps of 32x32, 2 blocks/SM
        "m128n128w8tc_k256": (4, 4, 2, 4, 1, 256, 1),   # 8 warps of 64x32, 1 block/SM
    },
    "q6_k": {
        "m16n128": (1, 4, 1, 4, 3, 128, 1),             # small batch
        "m32n128": (1, 4, 2, 4, 2, 128, 1),             # small batch
        "m64n128": (2, 4, 2, 4, 2, 128, 1),
        "m128n128w8_k256": (4, 4, 2, 4, 1, 256, 1),
    },
}
# The production choice (engine.gpu.ops.mmq.choose_variant): the 128x128 tiles once the grid
# fills the GPU; while the 64-token grid still fits on the SMs (one block each), a lone 64x128
# block finishes ~1.5x sooner than a lone 128x128 one, so short prompts use it (perf-log run 9).
DEFAULT_VARIANT = {"q4_k": "m128n128w8tc_k256", "q6_k": "m128n128w8_k256"}
SMALL_VARIANT = {"q4_k": "m64n128tc_k256", "q6_k": "m64n128"}
# Tail split for the DEFAULT_VARIANT choice, measured on the H200 (perf-log run 12): T=3314 q6_K
# 4096x4096 0.793 -> 0.739 ms, q4_K 4096x11008 1.266 -> 1.167; whole-wave grids (T=512) unchanged.
DEFAULT_SPLIT = {"q4_k": True, "q6_k": True}
# Small batches (issue 12): (largest T, variant) in increasing T, the first tier that holds T wins;
# past the last tier the rule above (SMALL_VARIANT with the split). MMVQ_VARIANT: the decode
# GEMV (mmvq_*.cu, store mode); MMSB_VARIANT (below): the small-batch GEMMs. Chosen from one
# gemm_bench --variants small run on the H200 (graph timing, the 7B shapes; perf-log session 5):
# per kind and T the least total time over the shapes.
MMVQ_VARIANT = "mmvq"
MMSB_VARIANT = "mmsb"         # the small-batch GEMMs (section "small batch" below)
SMALL_BATCH_TIERS = {
    "q4_k": ((1, MMVQ_VARIANT), (8, MMSB_VARIANT), (16, "m16n128tc_k256+split8"), (32, "m32n128tc_k256+split"),
             (64, "m64n128tc_k256+split"), (128, "m128n128w8tc_k256+split8")),
    "q6_k": ((1, MMVQ_VARIANT), (16, MMSB_VARIANT), (32, "m32n128+split8"), (64, "m64n128+split8"),
             (128, "m128n128w8_k256+split")),
}
# Wide matrices at 17..32 tokens (perf-log session 10, gemm_bench graph timing on the H100): the
# small-batch kernel (MR = 2, pipelined activation stages) beats the best MMQ tiles on q4_K with
# >= 8192 rows (gate|up 22016: 49 -> 46 us, qkv 12288: 32 -> 31, 11008: 28 -> 25) and on the q6_K
# output matrix (32000 rows: 104 -> 93 us), not on 4096 rows (q4_K 4096^2: 14 -> 16).
# (min T, max T, min rows, variant), checked before SMALL_BATCH_TIERS.
SMALL_BATCH_WIDE = {"q4_k": ((17, 32, 8192, MMSB_VARIANT),), "q6_k": ((17, 32, 32000, MMSB_VARIANT),)}
# What the last MMQ_CONFIGS field is, per family: "tc" (q4_K's TF32 min term) or "unroll" (q6_K).
MMQ_LAST_FIELD = {"q4_k": "tc", "q6_k": "unroll"}
MMQ_SPLIT_SUFFIX = "+split"
SPLIT_MAX_PARTS = 4       # parts per split tile unless the variant names another ("+split8")


def mmq_variants(kind: str) -> list[str]:
    """Tile configurations compiled (and tested, benchmarked) for a kernel family."""
    return list(MMQ_CONFIGS[kind])


def mmq_split_name(variant: str) -> tuple[str, bool]:
    """(MMQ_CONFIGS name, split?) of a variant name: NAME, NAME+split or NAME+splitP."""
    name, sep, parts = variant.partition(MMQ_SPLIT_SUFFIX)
    if sep and (parts == "" or (parts.isdigit() and int(parts) >= 2)):
        return name, True
    return variant, False


def split_max_parts(variant: str) -> int:
    """Most K-parts per split tile of a "+split" / "+splitP" variant."""
    tail = variant.partition(MMQ_SPLIT_SUFFIX)[2]
    return int(tail) if tail.isdigit() else SPLIT_MAX_PARTS


def mmq_config(kind: str, variant: str) -> tuple[int, int, int, int, int, int, int]:
    try:
        return MMQ_CONFIGS[kind][mmq_split_name(variant)[0]]
    except KeyError:
        raise KeyError(f"unknown MMQ variant {variant!r} for {kind} "
                       f"(have {', '.join(MMQ_CONFIGS.get(kind, {}))}, each also with "
                       f"{MMQ_SPLIT_SUFFIX}; retired ones: dev/RETIRED.md)") from None


def mmq_instance(kind: str, variant: str, split_part: bool = False) -> str:
    """Template instance of a variant: split_part=False the whole-tile kernel, True the one
    that computes the K-parts of split tiles (the "+split" launch uses both)."""
    mt, nt, wm, wn, minb, ks, tc = mmq_config(kind, variant)
    return f"mmq_{kind}<{mt}, {nt}, {wm}, {wn}, {minb}, {ks}, {tc}, {str(split_part).lower()}>"


def mmq_launched(kind: str) -> list[tuple[str, bool]]:
    """(config, split_part) of every MMQ instance the production choice launches."""
    out = [(SMALL_VARIANT[kind], False), (SMALL_VARIANT[kind], True), (DEFAULT_VARIANT[kind], False)]
    if DEFAULT_SPLIT[kind]:
        out.append((DEFAULT_VARIANT[kind], True))
    for v in [v for _, v in SMALL_BATCH_TIERS[kind]] + [w[-1] for w in SMALL_BATCH_WIDE[kind]]:
        name, split = mmq_split_name(v)
        if name in MMQ_CONFIGS[kind]:
            out += [(name, False)] + ([(name, True)] if split else [])
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------- small batch

# mmsb_q4_k.cu / mmsb_q6_k.cu (launched by engine.gpu.ops.mmsb): one instance per n-tile count
# NTT (T <= 8 NTT tokens) and, for q6_K, row layout, with MMSB_CONFIGS[kind][NTT] = (MR m-tiles
# per warp, D super-blocks in flight per warp). The variant name MMSB_VARIANT (optionally
# "+splitP": at most P K-parts) is what choose_variant returns for them; "mmsb.r<MR>d<D>" names
# another (MR, D) for measurements (gemm_bench), compiled on demand.
MMSB_CONFIGS: dict[str, dict[int, tuple[int, int]]] = {
    "q4_k": {1: (1, 4), 2: (1, 4), 4: (2, 2), 8: (2, 2)},
    "q6_k": {1: (1, 3), 2: (1, 3), 4: (2, 2), 8: (2, 1)},
}
MMSB_NTT = (1, 2, 4, 8)
MMSB_MAX_TOKENS = 8 * MMSB_NTT[-1]


def mmsb_ntt(tokens: int) -> int:
    """The n-tile count of the instance that takes `tokens` (1..MMSB_MAX_TOKENS)."""
    for n in MMSB_NTT:
        if tokens <= 8 * n:
            return n
    raise ValueError(f"mmsb: {tokens} tokens is over the small-batch limit {MMSB_MAX_TOKENS}")


_MMSB_NAME = re.compile(re.escape(MMSB_VARIANT) + r"(?:\.r([12])d([1-6]))?")


def is_mmsb(variant: str) -> bool:
    """MMSB_VARIANT or "mmsb.r<MR>d<D>", optionally with "+splitP"."""
    return _MMSB_NAME.fullmatch(mmq_split_name(variant)[0]) is not None


def mmsb_config(kind: str, ntt: int, variant: str = MMSB_VARIANT) -> tuple[int, int]:
    """(MR, D) of a small-batch variant at NTT n-tiles: the one "mmsb.r<MR>d<D>" names, else
    MMSB_CONFIGS."""
    m = _MMSB_NAME.fullmatch(mmq_split_name(variant)[0])
    if m is None:
        raise ValueError(f"{variant!r} is not a small-batch variant ({MMSB_VARIANT} or {MMSB_VARIANT}.r<MR>d<D>)")
    if kind not in MMSB_CONFIGS:
        raise ValueError(f"no small-batch kernel for {kind!r}")
    return (int(m.group(1)), int(m.group(2))) if m.group(1) else MMSB_CONFIGS[kind][ntt]


def mmsb_instance(kind: str, ntt: int, padded: bool = True, variant: str = MMSB_VARIANT) -> str:
    """Template instance of the small-batch kernel for NTT n-tiles (mmsb_config)."""
    mr, d = mmsb_config(kind, ntt, variant)
    if kind == "q4_k":
        return f"mmsb_q4_k<{ntt}, {mr}, {d}>"
    return f"mmsb_q6_k<{ntt}, {mr}, {d}, {str(padded).lower()}>"


def mmsb_launched_ntt(kind: str) -> tuple[int, ...]:
    """The n-tile counts the production choice launches: those of every T that SMALL_BATCH_TIERS
    or SMALL_BATCH_WIDE sends to MMSB_VARIANT (the others compile on demand for measurements)."""
    ranges, lo = [], 1
    for max_t, v in SMALL_BATCH_TIERS[kind]:
        if mmq_split_name(v)[0] == MMSB_VARIANT:
            ranges.append((lo, max_t))
        lo = max_t + 1
    ranges += [(min_t, max_t) for min_t, max_t, _, v in SMALL_BATCH_WIDE[kind]
               if mmq_split_name(v)[0] == MMSB_VARIANT]
    return tuple(sorted({mmsb_ntt(t) for a, b in ranges for t in range(max(a, 2), b + 1)}))


# ----------------------------------------------------------------------------- Hopper (wgmma)

# kernels_cu/wgmma_q4_k.cu (sm_90a; issues 14, 12): BT tokens per block, 4 activation stages, the
# K range in KP parts (wgmma_*_kp: clusters of KP blocks adding their tiles through distributed
# shared memory). Large ubatches: BT = 128 or 256, KP = 1. BT = 256 halves the L2 reads of the
# weights per token but needs two full waves of 256-token tiles to keep the tail short (H100
# hopper_bench, perf-log Session 12: 256 wins at T = 3314 on every 7B shape and at T = 512 only
# on 22016 rows). Small ubatches (perf-log Sessions 13 and 15, H200 hopper_bench at T = 32, 64,
# 128): the time is set by the blocks' serial K loops, not by the GPU's width. T <= 64: 32- or
# 64-token tiles with K split in the most parts that keep tiles x parts <= WGMMA_SPLIT_BLOCKS
# (about 1.5 blocks per SM; two fit: 96 row tiles best at 2 parts, 48 and 36 at 4, a 4096-row
# matrix at 4, 172 tiles unsplit). T = 65..128: a matrix of >= WGMMA_WIDE_TILES row tiles
# unsplit in one 128-token tile, a narrower one in 64-token tiles split by the same limit.
WGMMA_BTS = (32, 64, 128, 256)
WGMMA_KPS = (1, 2, 4)
# Ubatches of at least this many tokens run their q4_K and q6_K GEMMs on wgmma (engine.gpu.model):
# from hopper_bench (H200, Session 13) wgmma beats the MMQ / small-batch kernels on every 7B shape
# at T = 32 (1.0-1.6x, one tie: q4_K 4096x11008), 64 (1.2-2.2x) and 128 (1.3-2.9x).
WGMMA_MIN_TOKENS = 17
WGMMA_STAGES = 4
# Token tiles of at most 64 take 8 activation buffers: wgmma_gemm then refills a super-block's 4
# buffers after one block barrier instead of one buffer after a barrier each stage (perf-log
# Session 27, H100: pp128 +0.9-2.7% in 8 of 8 samples, pp32 -1.5..+5%; T = 64 GEMMs summed over
# the 7B shapes 262.0 -> 250.3 us).
WGMMA_SMALL_STAGES = 8
WGMMA_WAVE_SMS = 132
WGMMA_WIDE_TILES = 80
WGMMA_SPLIT_BLOCKS = 3 * WGMMA_WAVE_SMS // 2
# A long K (the down matrices of llama3-8b, 14336, and qwen2-7b, 18944) splits in 8 parts where
# 4 would leave a block per SM and 8 fit two (perf-log Session 24: T = 32 1.08-1.22x, T = 64
# 1.04-1.17x per GEMM; 43 super-blocks (11008) tie, 16 (4096) lose).
WGMMA_KP8_MIN_SB = 48


def wgmma_config(T: int, N: int, K: int) -> tuple[int, int]:
    """(BT, KP) of the production launch for T tokens of an N x K matrix."""
    tiles = N // 128
    if T > 128:
        tiles_256 = -(-T // 256) * tiles
        return (256 if tiles_256 >= 2 * WGMMA_WAVE_SMS else 128), 1
    bt = next(b for b in WGMMA_BTS if b >= T)
    if bt == 128 and tiles >= WGMMA_WIDE_TILES:
        return bt, 1
    bt = min(bt, 64)
    blocks = -(-T // bt) * tiles
    kp = 1
    while 2 * kp in WGMMA_KPS and blocks * 2 * kp <= WGMMA_SPLIT_BLOCKS and 2 * kp <= K // 256:
        kp *= 2
    if kp == 4 and K // 256 >= WGMMA_KP8_MIN_SB and blocks * 8 <= 2 * WGMMA_WAVE_SMS:
        kp = 8
    return bt, kp


# Deeper activation rings for token tiles <= 64 (an A/B form: hopper_bench configs such as 32x16,
# or the define WG_SMALL_STAGES=16): the super-block refill of wgmma_gemm (STAGES >= 8) runs
# STAGES / 4 - 1 super-blocks ahead; 16 stages of a 64-token tile are 128 KB of shared memory.
WGMMA_DEEP_STAGES = (12, 16)


# kp = STREAMK names the stream-K form of a GEMM (kernels_cu/wgmma_streamk.cuh, an A/B: a 1-D grid
# sharing the tiles' super-blocks; token tiles <= 64), `kernel_sk<lead bt, stages>`, which these
# kernels have.
STREAMK = -1
WGMMA_STREAMK_KERNELS = ("wgmma_q4_k", "wgmma_q4_k_swiglu", "wgmma_q6_k", "wgmma_q4_k_rope", "wgmma_pair",
                         "wgmma_pair_rope")


def _check_wgmma_config(kernel: str, bt: int, stages: int, kp: int) -> None:
    stages_ok = 3 <= stages <= 8 or (stages in WGMMA_DEEP_STAGES and bt <= 64)
    if kp == STREAMK:
        if kernel not in WGMMA_STREAMK_KERNELS or bt > 64:
            raise ValueError(f"{kernel}: no stream-K form at BT={bt} (only {', '.join(WGMMA_STREAMK_KERNELS)}, "
                             f"BT <= 64)")
        kp = 1
    if bt not in WGMMA_BTS or not stages_ok or not 1 <= kp <= 8:
        raise ValueError(f"{kernel}: BT={bt} ({', '.join(map(str, WGMMA_BTS))}), STAGES={stages} (3..8; "
                         f"{' or '.join(map(str, WGMMA_DEEP_STAGES))} at BT <= 64), KP={kp} (1..8) not supported")


def wgmma_stages(bt: int) -> int:
    """Activation buffers of the production launch of a bt-token tile."""
    return WGMMA_SMALL_STAGES if bt <= 64 else WGMMA_STAGES


def _wgmma_name(kernel: str, lead: str, bt: int, stages: int | None, kp: int) -> str:
    """`kernel<lead bt, stages>`, or its K-split twin `kernel_kp<lead bt, stages, kp>`, or with kp =
    STREAMK its stream-K form `kernel_sk<lead bt, stages>` (stages None: the production count,
    wgmma_stages)."""
    stages = stages or wgmma_stages(bt)
    _check_wgmma_config(kernel, bt, stages, kp)
    if kp == STREAMK:
        return f"{kernel}_sk<{lead}{bt}, {stages}>"
    return f"{kernel}<{lead}{bt}, {stages}>" if kp == 1 else f"{kernel}_kp<{lead}{bt}, {stages}, {kp}>"


def wgmma_instance(bt: int, stages: int | None = None, kp: int = 1) -> str:
    return _wgmma_name("wgmma_q4_k", "", bt, stages, kp)


def wgmma_swiglu_instance(bt: int, stages: int | None = None, kp: int = 1) -> str:
    """kernels_cu/wgmma_q4_k.cu's gate|up GEMM with SwiGLU fused (the down GEMM's f16 operand out)."""
    return _wgmma_name("wgmma_q4_k_swiglu", "", bt, stages, kp)


def wgmma_q6_instance(padded: bool, bt: int, stages: int | None = None, kp: int = 1) -> str:
    """kernels_cu/wgmma_q6_k.cu: PADDED selects the 224-byte (8-byte loads) or the raw 210-byte
    block layout (2-byte loads), bit-identical results."""
    return _wgmma_name("wgmma_q6_k", "true, " if padded else "false, ", bt, stages, kp)


def wgmma_rope_instance(bt: int, stages: int | None = None, kp: int = 1) -> str:
    """kernels_cu/wgmma_q4_k.cu's q|k|v GEMM with bias + RoPE + the K/V append fused (T <= 32)."""
    return _wgmma_name("wgmma_q4_k_rope", "", bt, stages, kp)


def wgmma_pair_rope_instance(padded: bool, bt: int, stages: int | None = None, kp: int = 1) -> str:
    """kernels_cu/wgmma_pair.cu's q4_K [Wq; Wk] + q6_K Wv launch with the same fused epilogue."""
    return _wgmma_name("wgmma_pair_rope", "true, " if padded else "false, ", bt, stages, kp)


def wgmma_pair_instance(padded: bool, bt: int, stages: int | None = None, kp: int = 1) -> str:
    """kernels_cu/wgmma_pair.cu: a q4_K and a q6_K matrix (PADDED: its layout) in one launch."""
    return _wgmma_name("wgmma_pair", "true, " if padded else "false, ", bt, stages, kp)


# (BT, KP) of every instance wgmma_config can return (the pairs' and the gate|up GEMMs' K, d_model,
# never reaches KP 8's).
WGMMA_LAUNCHED = tuple((bt, kp) for bt in (32, 64) for kp in WGMMA_KPS + (8,)) + ((128, 1), (256, 1))
WGMMA_PAIR_LAUNCHED = tuple(c for c in WGMMA_LAUNCHED if c[1] < 8)


# ----------------------------------------------------------------------------- decode

MMVQ_MODES = ("store", "add", "swiglu")   # mmvq_*.cu MODE 0, 1, 2
ATTN_HEAD_DIMS = (64, 128)
ATTN_GROUPS = (1, 2, 4, 6, 7, 8)          # query heads per KV head (GQA)
KV_DTYPES = ("f16", "f32")


# Per kernel family: the layouts its MMVQ kernels come in (q6_K: the padded 224-byte blocks and
# the raw 210-byte ones; q4_K: one layout, no infix in the name).
MMVQ_LAYOUTS: dict[str, tuple[str, str] | None] = {"q4_k": None, "q6_k": ("pad", "raw")}


def mmvq_name(kind: str, mode: str, padded: bool = True) -> str:
    """MMVQ kernel of a weight kind / layout and epilogue mode."""
    if mode not in MMVQ_MODES:
        raise ValueError(f"no MMVQ mode {mode!r} (have {MMVQ_MODES}; retired ones: dev/RETIRED.md)")
    if kind not in MMVQ_LAYOUTS:
        raise ValueError(f"no MMVQ kernel for {kind!r}")
    layouts = MMVQ_LAYOUTS[kind]
    return f"mmvq_{kind}_{mode}" if layouts is None else f"mmvq_{kind}_{layouts[0 if padded else 1]}_{mode}"


def mmvq_mixed_name(padded: bool = True) -> str:
    """mmvq_mixed.cu: q4_K then q6_K matrices (padded: that layout) in one store launch."""
    return f"mmvq_mixed_{'pad' if padded else 'raw'}_store"


def attn_split_name(head_dim: int, group: int, kv_dtype: str) -> str:
    return f"attn_split_h{head_dim}_g{group}_{kv_dtype}"


def attn_combine_name(head_dim: int) -> str:
    return f"attn_combine_h{head_dim}"


def attn_split_varlen_name(head_dim: int, group: int) -> str:
    """The decode rows of a batched step (f16 Q and cache, exp2-domain scores)."""
    return f"attn_split_varlen_h{head_dim}_g{group}"


def attn_combine_varlen_name(head_dim: int) -> str:
    return f"attn_combine_varlen_h{head_dim}"


# ----------------------------------------------------------------------------- prefill (extern "C")

ATT_PREFILL_HEAD_DIMS = (64, 128)


ATT_OUTPUTS = ("f32", "q8", "x16")   # attention output forms: float32 rows, q8_1 blocks, tiled f16


def attn_prefill_name(head_dim: int, out: str) -> str:
    return f"attn_prefill_h{head_dim}_{out}"


def attn_wgmma_name(head_dim: int, out: str) -> str:
    """attention_wgmma.cu's one-sequence entry (Hopper; the arguments of attn_prefill_name's)."""
    return f"attn_wgmma_h{head_dim}_{out}"


def attn_prefill_varlen_name(head_dim: int, out: str) -> str:
    """The varlen entry of attention_prefill.cu (a batched step's tiles of several sequences)."""
    return f"attn_prefill_varlen_h{head_dim}_{out}"


# ----------------------------------------------------------------------------- the registry

INSTANCES: dict[str, tuple[str, ...]] = {
    # prefill
    "embed.cu": ("embed_q4_k", "embed_q6_k"),
    "rmsnorm.cu": ("add_rmsnorm_q8_1", "add_rmsnorm_x16"),
    "rope.cu": ("qkv_rope",),
    "attention_prefill.cu": tuple(attn_prefill_name(h, o) for h in ATT_PREFILL_HEAD_DIMS for o in ATT_OUTPUTS)
    + tuple(attn_prefill_varlen_name(h, o) for h in ATT_PREFILL_HEAD_DIMS for o in ATT_OUTPUTS),
    "attention_wgmma.cu": tuple(attn_wgmma_name(h, o) for h in ATT_PREFILL_HEAD_DIMS
                                for o in ATT_OUTPUTS),
    "swiglu.cu": ("swiglu_q8_1", "swiglu_x16"),
    "quantize_q8_1.cu": ("quantize_q8_1",),
    "mmq_q4_k.cu": tuple(mmq_instance("q4_k", v, sp) for v, sp in mmq_launched("q4_k")),
    "mmq_q6_k.cu": tuple(mmq_instance("q6_k", v, sp) for v, sp in mmq_launched("q6_k")),
    "mmsb_q4_k.cu": tuple(mmsb_instance("q4_k", n) for n in mmsb_launched_ntt("q4_k")),
    "mmsb_q6_k.cu": tuple(mmsb_instance("q6_k", n, p) for p in (True, False) for n in mmsb_launched_ntt("q6_k")),
    "wgmma_q4_k.cu": (tuple(wgmma_instance(bt, kp=kp) for bt, kp in WGMMA_LAUNCHED)
                      + tuple(wgmma_swiglu_instance(bt, kp=kp) for bt, kp in WGMMA_PAIR_LAUNCHED)
                      + tuple(wgmma_rope_instance(bt, kp=kp) for bt, kp in WGMMA_PAIR_LAUNCHED)),
    "wgmma_q6_k.cu": tuple(wgmma_q6_instance(p, bt, kp=kp) for p in (True, False) for bt, kp in WGMMA_LAUNCHED),
    "wgmma_pair.cu": (tuple(wgmma_pair_instance(p, bt, kp=kp) for p in (True, False) for bt, kp in WGMMA_PAIR_LAUNCHED)
                      + tuple(wgmma_pair_rope_instance(True, bt, kp=kp) for bt, kp in WGMMA_PAIR_LAUNCHED)),
    "wgmma_act.cu": ("wgmma_tile_x16",),
    # decode step
    "decode_fused.cu": ("decode_embed", "rmsnorm_q8", "quantize_row_q8", "qkv_post_f32", "qkv_post_f16",
                        "swiglu_mul", "set_state"),
    "mmvq_q4_k.cu": tuple(mmvq_name("q4_k", m) for m in MMVQ_MODES),
    "mmvq_q6_k.cu": tuple(mmvq_name("q6_k", m, p) for p in (True, False) for m in MMVQ_MODES),
    "mmvq_mixed.cu": tuple(mmvq_mixed_name(p) for p in (True, False)),
    "attention_decode.cu": tuple(attn_split_name(h, g, t) for g in ATTN_GROUPS for h in ATTN_HEAD_DIMS
                                 for t in KV_DTYPES) + tuple(attn_combine_name(h) for h in ATTN_HEAD_DIMS)
    + tuple(attn_split_varlen_name(h, g) for g in ATTN_GROUPS for h in ATTN_HEAD_DIMS)
    + tuple(attn_combine_varlen_name(h) for h in ATTN_HEAD_DIMS),
    "argmax.cu": ("argmax_step", "argmax_rows"),
    "gather_rows.cu": ("gather_add_rows",),
    "follow_tokens.cu": ("record_last", "resolve_follow"),
    # verification (tests/test_gpu_mmq.py, not on the forward path)
    "q6k_expand_check.cu": ("q6k_expand_check",),
}


def instance_count() -> dict[str, int]:
    """Instances per kernel file (the compile test prints it)."""
    return {f: len(v) for f, v in sorted(INSTANCES.items())}

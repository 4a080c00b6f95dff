"""Kernel names of the decode-step .cu files (engine/gpu/decode.py launches them).

A leaf module (no imports) so that engine.gpu.kernels can list these instances for its CPU
compile check without importing the decode engine. Every kernel here is an `extern "C"`
wrapper, so its name is also its lowered name.
"""
from __future__ import annotations

# MMVQ variants (rows per warp R, load batch U; U = 0 is run 1's loop) and epilogue modes
MMVQ_VARIANTS = ((1, 0), (2, 0), (4, 0), (1, 2), (2, 2), (4, 2), (1, 4), (2, 4))
MMVQ_ROWS_PER_WARP = (1, 2, 4)
MMVQ_MODES = ("store", "add", "swiglu", "addnorm")
ATTN_HEAD_DIMS = (64, 128)
ATTN_GROUPS = (1, 2, 4, 6, 7, 8)       # query heads per KV head (GQA)
KV_DTYPES = ("f16", "f32")


def mmvq_name(kind: str, rows_per_warp: int, mode: str, padded: bool = True, unroll: int = 0) -> str:
    if (rows_per_warp, unroll) not in MMVQ_VARIANTS:
        raise ValueError(f"no MMVQ variant R={rows_per_warp} U={unroll} (have {MMVQ_VARIANTS})")
    if kind == "q4_k":
        return f"mmvq_q4_k_r{rows_per_warp}u{unroll}_{mode}"
    if kind == "q6_k":
        return f"mmvq_q6_k_{'pad' if padded else 'raw'}_r{rows_per_warp}u{unroll}_{mode}"
    raise ValueError(f"no MMVQ kernel for {kind!r}")


def attn_split_name(head_dim: int, group: int, kv_dtype: str) -> str:
    return f"attn_split_h{head_dim}_g{group}_{kv_dtype}"


def attn_combine_name(head_dim: int) -> str:
    return f"attn_combine_h{head_dim}"


DECODE_INSTANCES: dict[str, tuple[str, ...]] = {
    "mmvq_q4_k.cu": tuple(mmvq_name("q4_k", r, m, unroll=u) for r, u in MMVQ_VARIANTS for m in MMVQ_MODES),
    "mmvq_q6_k.cu": tuple(mmvq_name("q6_k", r, m, p, u) for p in (True, False)
                          for r, u in MMVQ_VARIANTS for m in MMVQ_MODES),
    "attention_decode.cu": tuple(attn_split_name(h, g, t) for g in ATTN_GROUPS for h in ATTN_HEAD_DIMS
                                 for t in KV_DTYPES) + tuple(attn_combine_name(h) for h in ATTN_HEAD_DIMS),
    "argmax.cu": ("argmax_step",),
    "decode_fused.cu": ("decode_embed", "rmsnorm_q8", "quantize_row_q8", "qkv_post_f32", "qkv_post_f16",
                        "swiglu_mul", "set_state"),
}

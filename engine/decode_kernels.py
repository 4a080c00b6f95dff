"""Kernel names of the decode-step .cu files (engine/gpu_decode.py launches them).

A leaf module (no imports) so that engine.kernels can list these instances for its CPU
compile check without importing the decode engine. Every kernel here is an `extern "C"`
wrapper, so its name is also its lowered name.
"""
from __future__ import annotations

MMVQ_ROWS_PER_WARP = (1, 2, 4)
MMVQ_MODES = ("store", "add", "swiglu")
ATTN_HEAD_DIMS = (64, 128)
ATTN_GROUPS = (1, 2, 4, 6, 7, 8)       # query heads per KV head (GQA)
KV_DTYPES = ("f16", "f32")


def mmvq_name(kind: str, rows_per_warp: int, mode: str, padded: bool = True) -> str:
    if kind == "q4_k":
        return f"mmvq_q4_k_r{rows_per_warp}_{mode}"
    if kind == "q6_k":
        return f"mmvq_q6_k_{'pad' if padded else 'raw'}_r{rows_per_warp}_{mode}"
    raise ValueError(f"no MMVQ kernel for {kind!r}")


def attn_split_name(head_dim: int, group: int, kv_dtype: str) -> str:
    return f"attn_split_h{head_dim}_g{group}_{kv_dtype}"


def attn_combine_name(head_dim: int) -> str:
    return f"attn_combine_h{head_dim}"


DECODE_INSTANCES: dict[str, tuple[str, ...]] = {
    "mmvq_q4_k.cu": tuple(mmvq_name("q4_k", r, m) for r in MMVQ_ROWS_PER_WARP for m in MMVQ_MODES),
    "mmvq_q6_k.cu": tuple(mmvq_name("q6_k", r, m, p) for p in (True, False)
                          for r in MMVQ_ROWS_PER_WARP for m in MMVQ_MODES),
    "attention_decode.cu": tuple(attn_split_name(h, g, t) for g in ATTN_GROUPS for h in ATTN_HEAD_DIMS
                                 for t in KV_DTYPES) + tuple(attn_combine_name(h) for h in ATTN_HEAD_DIMS),
    "argmax.cu": ("argmax_step",),
    "decode_fused.cu": ("decode_embed", "rmsnorm_q8", "quantize_row_q8", "qkv_post_f32", "qkv_post_f16",
                        "swiglu_mul", "set_state"),
}

"""Kernel names of the prefill kernels (extern "C" entry points), per kernels_cu file.

A leaf module (no imports) so engine.gpu.kernels can register them in INSTANCES: the CPU compile
check then reports their registers/spills, and CuPy compiles them with the same names.
"""
PREFILL_INSTANCES: dict[str, tuple[str, ...]] = {
    "embed.cu": ("embed_q4_k", "embed_q6_k"),
    "rmsnorm.cu": ("add_rmsnorm_q8_1",),
    "rope.cu": ("qkv_rope",),
    "swiglu.cu": ("swiglu_q8_1",),
    "attention_prefill.cu": ("attn_prefill_h64_f32", "attn_prefill_h64_q8",
                             "attn_prefill_h128_f32", "attn_prefill_h128_q8"),
}

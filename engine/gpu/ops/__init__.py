"""Launchers, one module per op family (one Python function per kernel launch): shapes,
grid, kernel choice, launch on the current stream, no synchronization.

    q8          Q8Act (the q8_1 activation layout), quantize_q8_1        quantize_q8_1.cu
    mmq         prefill GEMMs: tile variant, tail split, grid            mmq_q4_k.cu, mmq_q6_k.cu
    mmvq        decode GEMVs with their epilogues                        mmvq_q4_k.cu, mmvq_q6_k.cu
    embed       token embedding rows                                     embed.cu
    norm        residual add + RMSNorm + q8_1 or tiled f16 (prefill)     rmsnorm.cu
    rope        bias + RoPE + f16, K/V into the cache (prefill)          rope.cu
    attention   prefill flash attention (one sequence, or varlen: a      attention_prefill.cu, attention_decode.cu
                batched step's sequences); decode split + combine
    activation  SwiGLU + q8_1 or tiled f16 (prefill)                     swiglu.cu
    wgmma       Hopper f16 GEMMs of ubatches of >= 17 tokens (sm_90),     wgmma_q4_k.cu, wgmma_q6_k.cu,
                their tiled f16 operand                                  wgmma_act.cu
    argmax      greedy ids of several logit rows (a batched step), and   argmax.cu (argmax_rows),
                the follow tokens of overlapped steps                    follow_tokens.cu
    checks      verification kernels                                     q6k_expand_check.cu

The submodules are imported here so that `from engine.gpu import ops` then `ops.norm.add_rmsnorm_q8_1`
works, and a test may patch a launcher on its module (tests/gpu_emulation.py).
"""
from engine.gpu.ops import activation, argmax, attention, checks, embed, mmq, mmvq, norm, q8, rope, wgmma  # noqa: F401

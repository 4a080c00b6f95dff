"""The CPU backend and every oracle, by responsibility:

    ops.py       float32 reference ops (dequantize_rows, rms_norm, apply_rope, silu, causal_attention)
    model.py     ReferenceModel (the numpy forward, the CPU backend) and its KVCache
    numerics.py  what the GPU kernels compute, with their q8_1 / f16 numerics, one function per op
    mmq.py       the integer-dot MMQ oracles and their error bounds
"""

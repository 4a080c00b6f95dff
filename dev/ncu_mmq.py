"""Launch sequence for Nsight Compute: one warm-up then one profiled launch of each MMQ kernel
(VARIANT "wgmma": the Hopper GEMMs of engine.gpu.ops.wgmma, production tiles, instead).

    ncu --clock-control none --kernel-name regex:mmq_q --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats ... python3 -m dev.ncu_mmq [T N K VARIANT]
"""
import sys

import cupy as cp
import numpy as np

from engine.gpu.ops import mmq as gpu_ops
from engine.reference.mmq import random_blocks
from engine.gpu.weights import upload_weight

T, N, K = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (3314, 11008, 4096)
variant = sys.argv[4] if len(sys.argv) > 4 else None
rng = np.random.default_rng(0)
w4 = upload_weight(random_blocks(rng, "q4_k", N, K, special=False), "Q4_K")
w6 = upload_weight(random_blocks(rng, "q6_k", N, K, special=False), "Q6_K")
x = cp.random.standard_normal((T, K), dtype=cp.float32)
y = cp.empty((T, N), dtype=cp.float32)
if variant == "wgmma":
    from engine.gpu.ops import wgmma

    xt = wgmma.tile_x16(x)
    for _ in range(2):
        wgmma.wgmma_q4k(w4, xt, T, out=y)
        wgmma.wgmma_q6k(w6, xt, T, out=y)
else:
    act = gpu_ops.quantize_q8_1(x)
    for _ in range(2):
        gpu_ops.mmq(w4, act, out=y, variant=variant)
        gpu_ops.mmq(w6, act, out=y, variant=variant)
cp.cuda.runtime.deviceSynchronize()
print("done", T, N, K, variant)

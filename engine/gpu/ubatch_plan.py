"""How a prompt longer than the ubatch size is split, on the Hopper GEMM path (issue 14).

A wgmma GEMM of N rows and K input features over T tokens launches
blocks = ceil(T / BT) * (N / 128) * KP (BT, KP: registry.wgmma_config) and runs them in
ceil(blocks / SMS) waves of about BT * K / KP multiply-adds per row of a block. The last wave is
partly empty: qwen2-7b's 3,584-row matrices over 4,096 tokens are 448 blocks = 3.39 waves, run
as 4, where 3,584 tokens are 392 blocks = 2.97 waves, run as 3. So the split of a long prompt
changes its GEMM time: pp8192 in ubatches of 3,584 + 3,584 + 1,024 tokens runs 4% fewer modeled
wave-costs on qwen2-7b than 4,096 + 4,096 (measured: pp8192 +2.2%, docs/perf-log.md Session 23),
while llama2-7b and llama3-8b (4,096 rows: 3.88 waves) model best at 4,096.

With the default ubatch of 8,192 tokens (DEFAULT_UBATCH) a prompt of up to 8,192 tokens is one
ubatch; the split below applies to longer ones (and to smaller GGUF_PREFILL_UBATCH values).

plan_ubatches(n, ubatch, gemms): ubatches of U tokens (the last one the rest), U = ubatch or a
multiple of 256 in [ubatch / 2, ubatch), whichever split has the smallest modeled cost over the
model's layer GEMMs (ties: the largest U, so the fewest ubatches); one ubatch when n <= ubatch,
plain ubatches below 512 (tests' small ubatches keep their split). The model
ignores attention (its work over a prompt hardly depends on the split) and the per-ubatch
launches (a few per mille of a 4,096-token ubatch).

default_ubatch(): the ubatch size itself (DEFAULT_UBATCH or GGUF_PREFILL_UBATCH).
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Callable

from engine.errors import GGUFError
from engine.gpu import registry
from engine.gpu.ops.wgmma import ROWS

# One ubatch for prompts of up to 8,192 tokens: pp8192 in one ubatch against production's 4,096 +
# 4,096 (qwen2-7b: 3,584 + 3,584 + 1,024) measured +2.4..+3.5% in 6 of 6 round pairs (H100,
# Session 27, llama2-7b / qwen2-7b / llama3-8b): the raster keeps a wave's activations in L2
# whatever T is, and the attention runs as one 8192@0 launch. Activations of a 7B model at
# 8,192 tokens take about 1.5 GB (batch.FIT_RESERVE + the 15% the KV cache leaves).
DEFAULT_UBATCH = 8192


def default_ubatch() -> int:
    """DEFAULT_UBATCH, or GGUF_PREFILL_UBATCH (tokens per prompt forward: larger takes more
    activation memory; A/B runs of long prompts)."""
    env = os.environ.get("GGUF_PREFILL_UBATCH", "").strip()
    if not env:
        return DEFAULT_UBATCH
    if not env.isdigit() or int(env) < 1:
        raise GGUFError(f"GGUF_PREFILL_UBATCH={env!r}: a token count >= 1")
    return int(env)


STEP = 256                       # candidate ubatch sizes: multiples of the large token tile


def gemm_wave_cost(T: int, gemms: Counter, sms: int = registry.WGMMA_WAVE_SMS) -> float:
    """Modeled time of one ubatch of T tokens through the GEMMs {(N, K): launches}: the waves of
    each launch times the work of a block in a wave (BT tokens x K / KP)."""
    total = 0.0
    for (N, K), count in gemms.items():
        bt, kp = registry.wgmma_config(T, N, K)
        blocks = -(-T // bt) * (N // ROWS) * kp
        total += count * -(-blocks // sms) * bt * K / kp
    return total


def split(n: int, u: int) -> list[int]:
    """n tokens in ubatches of u (the last one the rest)."""
    return [min(u, n - u0) for u0 in range(0, n, u)]


def bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive ubatch sizes -> their [u0, u1) token ranges."""
    out, u0 = [], 0
    for size in sizes:
        out.append((u0, u0 + size))
        u0 += size
    return out


def plan_ubatches(n: int, ubatch: int, gemms: Counter | None, sms: int = registry.WGMMA_WAVE_SMS) -> list[int]:
    """The ubatch sizes of an n-token prompt (module docstring); `gemms` empty: plain ubatches
    (None: n <= ubatch, where they are not needed)."""
    if n <= ubatch or not gemms or ubatch < 2 * STEP:
        return split(n, ubatch)
    best = None
    below = range((ubatch - 1) // STEP * STEP, ubatch // 2 - 1, -STEP)
    for u in (ubatch, *below):                        # largest first: a tie keeps it
        cost = sum(gemm_wave_cost(t, gemms, sms) for t in split(n, u))
        if best is None or cost < best[0]:
            best = (cost, u)
    return split(n, best[1])


def layer_launches(layers, on_wgmma: Callable, one_launch: Callable) -> Counter:
    """{(N, K): count} of the layer GEMM launches that run on wgmma: per layer (engine.gpu.model
    _Layer) the q|k|v and gate|up groups (their segments' matrices in one launch where
    one_launch(ws), wgmma_pair, else one each), Wo and down; on_wgmma(w): whether w's GEMM takes
    the Hopper path. A pair's rows add up, as in its grid."""
    out: Counter = Counter()

    def add(ws):
        out[(sum(int(w.rows) for w in ws), int(ws[0].cols))] += 1

    for L in layers:
        for segs in (L.qkv, L.gate_up):
            ws = [s.w for s in segs if on_wgmma(s.w)]
            if ws and one_launch(ws):
                add(ws)
            else:
                for w in ws:
                    add([w])
        for w in (L.wo, L.down):
            if on_wgmma(w):
                add([w])
    return out

"""Prefill attention microbenchmark (issue 14): ops.attention.attention_prefill on random f16
queries and cache for the 7B head layouts at long context, each kernel variant side by side
(median ms of --reps between CUDA events after a warm-up), with the causal TFLOP/s
(4 * H * hd * sum over queries of their key count) and the largest |difference| from the first
variant's float32 output as a fraction of max|V| (the kernels' bound is 2^-9 = 0.00195).

    python -m dev.attn_bench [--cases 4096@0,4096@4096,3314@0] [--heads 32/32,28/4,32/8]
                             [--variants default,...] [--defines "SET;SET;..."] [--reps N] [--json F]

A case n@start: n queries at positions start..start+n-1 over keys 0..start+n-1 (the second
ubatch of an 8,192-token prompt is 4096@4096). --defines: GGUF_PREFILL_KERNEL_DEFINES sets
(';'-separated, an empty entry = none) timed one after the other on each case in this one process
(engine.gpu.kernels keeps one build per set).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from dev.op_bench import time_run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="4096@0,4096@4096,3314@0")
    ap.add_argument("--heads", default="32/32,28/4,32/8", help="H/KVH per layout (llama2, qwen2, llama3)")
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--variants", default="", help="comma-separated attention_prefill variants "
                    "(default: every one of ops.attention.PREFILL_VARIANTS)")
    ap.add_argument("--defines", default=None, help="';'-separated GGUF_PREFILL_KERNEL_DEFINES sets "
                    "(default: the environment's)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)

    import cupy as cp

    from engine.gpu import kernels
    from engine.gpu.ops import attention as att

    variants = [v for v in a.variants.split(",") if v] or list(att.PREFILL_VARIANTS)
    env = kernels.DEFINES_ENV
    dsets = [d.strip() for d in a.defines.split(";")] if a.defines is not None else [os.environ.get(env, "")]
    runs = [(d, v) for d in dsets for v in variants]
    rng = np.random.default_rng(5)
    rows = []
    for heads in a.heads.split(","):
        H, KVH = (int(x) for x in heads.split("/"))
        for case in a.cases.split(","):
            n, start = (int(x) for x in case.split("@"))
            L, hd = start + n, a.hd
            qh = cp.asarray((rng.standard_normal((H, n, hd), dtype=np.float32) * (np.log2(np.e) / np.sqrt(hd)))
                            .astype(np.float16))
            kc = cp.asarray(rng.standard_normal((KVH, L, hd), dtype=np.float32).astype(np.float16))
            vc = cp.asarray(rng.standard_normal((KVH, L, hd), dtype=np.float32).astype(np.float16))
            vmax = float(cp.abs(vc).max())
            flop = 4.0 * H * hd * (n * start + n * (n + 1) / 2)
            ref = None
            for d, v in runs:
                os.environ[env] = d
                out = cp.empty((n, H * hd), dtype=cp.float32)

                def run():
                    att.attention_prefill(qh, kc, vc, start, out_f32=out, variant=v)

                ms = time_run(cp, run, a.reps, 2)
                if ref is None:
                    ref = out.copy()
                err = float(cp.abs(out - ref).max()) / vmax
                rec = dict(H=H, KVH=KVH, hd=hd, n=n, start=start, variant=v, defines=d, ms=ms,
                           tflops=flop / (ms * 1e9), err=err)
                rows.append(rec)
                print(f"attn H={H:2d}/{KVH:2d} hd={hd} n={n:5d} start={start:5d} {v:10s} {ms:8.3f} ms "
                      f"{rec['tflops']:6.1f} TFLOP/s  err/maxV {err:.2e}" + (f"  [{d}]" if len(dsets) > 1 else ""),
                      flush=True)
            del qh, kc, vc
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

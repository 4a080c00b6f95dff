"""Small-batch MMQ grids: the production plan (choose_variant + split_plan) against every tile
split into P K-parts (split0 = 0), for its tile config and the --alt ones, on the 7B shapes at small T, graph timing over weight copies
larger than L2 (dev/gemm_bench.GraphTimer). One line per (shape, T): the production time, the
best forced plan, and every P tried.

    python -m dev.split_sweep [--tokens 16,32,64] [--parts 1,2,3,4,6,8,12,16] [--json OUT]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from dev.gemm_bench import SHAPES_7B, GraphTimer
from engine.reference.mmq import random_blocks


def main(argv=None) -> int:
    import cupy as cp

    from engine.gpu import kernels
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu.weights import DeviceWeight, upload_weight

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,32,64")
    ap.add_argument("--parts", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--alt", default="q4_k:m16n128tc_k256,q6_k:m16n128",
                    help="KIND:VARIANT,..: tile configs swept besides the production one")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    parts = [int(p) for p in a.parts.split(",")]
    rng = np.random.default_rng(7)
    gt = GraphTimer(cp, reps=a.reps)
    out = []
    for kind, N, K in SHAPES_7B:
        wd = upload_weight(random_blocks(rng, kind, N, K, special=False), kind.upper())
        copies = [wd] + [DeviceWeight(wd.ggml_type, wd.rows, wd.cols, wd.data.copy(), wd.padded)
                         for _ in range(gt.copies(wd.nbytes) - 1)]
        for T in tokens:
            act = gpu_ops.quantize_q8_1(cp.random.standard_normal((T, K), dtype=cp.float32))
            y = cp.empty((T, N), dtype=cp.float32)
            prod = gpu_ops.choose_variant(kind, T, N)
            base = kernels.mmq_split_name(prod)[0]
            t_prod = gt(lambda c: gpu_ops.mmq(copies[c], act, out=y, variant=prod), len(copies))["median_ms"]
            ref = cp.asnumpy(y)
            alts = [v.split(":", 1)[1] for v in a.alt.split(",") if v.startswith(kind + ":")]
            tried = {}
            for cfg in dict.fromkeys([base] + alts):
                if cfg not in kernels.mmq_variants(kind):
                    continue
                stages = K // kernels.mmq_config(kind, cfg)[5]
                for P in parts:
                    if P > stages:
                        continue
                    var = cfg + "+split"
                    t = gt(lambda c: gpu_ops.mmq(copies[c], act, out=y, variant=var, split=(0, P)),
                           len(copies))["median_ms"]
                    err = float(np.max(np.abs(cp.asnumpy(y) - ref)) / (np.max(np.abs(ref)) + 1e-30))
                    tried[f"{cfg}/{P}" if cfg != base else P] = (t, err)
            best = min(tried.items(), key=lambda kv: kv[1][0]) if tried else (None, (float("nan"), 0.0))
            rec = {"kind": kind, "N": N, "K": K, "T": T, "production": prod, "prod_ms": t_prod,
                   "prod_gbs": wd.nbytes / t_prod * 1e-6, "best_parts": best[0], "best_ms": best[1][0],
                   "tried": {p: v[0] for p, v in tried.items()}, "max_rel_diff": max((v[1] for v in tried.values()), default=0.0)}
            out.append(rec)
            print(f"{kind} {N:5d}x{K:5d} T={T:3d} prod {prod:24s} {t_prod * 1e3:7.1f} us {rec['prod_gbs']:6.0f} GB/s | "
                  f"best P={best[0]} {best[1][0] * 1e3:7.1f} us {wd.nbytes / best[1][0] * 1e-6:6.0f} GB/s | "
                  + " ".join(f"{p}:{v[0] * 1e3:.1f}" for p, v in tried.items())
                  + f" | rel diff {rec['max_rel_diff']:.1e}", flush=True)
        del copies, wd
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Hopper f16 GEMMs (kernels_cu/wgmma_q4_k.cu, wgmma_q6_k.cu) beside the production MMQ and cuBLAS f16, same run.

    python -m dev.hopper_bench [--tokens 512,3314] [--configs auto,128x4,256x4,32x4k4,..] [--shapes q4_k:NxK,..]
                               [--reps 20] [--json OUT] [--wgmma-only] [--pairs 8192+4096x4096,..]

Per q4_K / q6_K shape and T: graph timing as dev.gemm_bench (back-to-back launches over weight copies
that exceed the L2 4x): wgmma_q4k / wgmma_q6k per config BTxSTAGES[kKP|sk] ("auto": registry.wgmma_config; kKP: K in KP
parts; sk: the stream-K form, kernels_cu/wgmma_streamk.cuh), its activation
tiling (a stand-in for the producer that will write f16 directly), the production MMQ variant (choose_variant) plus its
q8_1 quantization, and cupy.matmul on f16 weights (cuBLAS, launched from the host: it refuses capture). Each wgmma output is checked on 16
sampled rows against engine.reference.wgmma (stated bound). Ratios are same-run: cuBLAS ms / ms; GB/s:
the weight bytes (q6_K padded) over the time, the small-batch figure of merit.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from dev.gemm_bench import GraphTimer, parse_shapes
from engine.reference.mmq import random_blocks
from engine.reference.wgmma import dequant_f16, wgmma_abs, wgmma_error_bound, wgmma_reference

SHAPES = [("q4_k", 4096, 4096), ("q4_k", 11008, 4096), ("q4_k", 4096, 11008),
          ("q4_k", 12288, 4096), ("q4_k", 22016, 4096), ("q6_k", 4096, 4096), ("q6_k", 4096, 11008),
          ("q6_k", 32000, 4096)]


def parse_config(cfg: str) -> tuple[int | None, int | None, int | None]:
    """"128x4" -> (128, 4, 1); "32x4k4" -> (32, 4, 4); "32x8sk" -> (32, 8, STREAMK), the stream-K
    form; "auto" -> (None, None, None): the production choice."""
    from engine.gpu.registry import STREAMK

    if cfg == "auto":
        return None, None, None
    if cfg.endswith("sk"):
        bt, st = (int(v) for v in cfg[:-2].split("x"))
        return bt, st, STREAMK
    head, _, kp = cfg.partition("k")
    bt, st = (int(v) for v in head.split("x"))
    return bt, st, int(kp or 1)


def run(tokens, configs, shapes, reps=20, seed=7, log=print, baselines=True):
    import cupy as cp

    from engine.gpu.ops import mmq as gpu_mmq
    from engine.gpu.ops.wgmma import tile_x16, wgmma_q4k, wgmma_q6k
    from engine.gpu.weights import DeviceWeight, upload_weight

    rng = np.random.default_rng(seed)
    gt = GraphTimer(cp, reps=reps)
    rows = []
    for kind, N, K in shapes:
        w = random_blocks(rng, kind, N, K, special=False)
        wd = upload_weight(w, kind.upper())                 # q6_K: padded (the production layout)
        gemm = wgmma_q4k if kind == "q4_k" else wgmma_q6k
        copies = [wd] + [DeviceWeight(wd.ggml_type, N, K, wd.data.copy(), wd.padded)
                         for _ in range(gt.copies(wd.nbytes) - 1)]
        w16_h = dequant_f16(w, kind)
        w16 = cp.asarray(w16_h)
        w16c = [w16] + [w16.copy() for _ in range(max(1, gt.copies(w16.nbytes)) - 1)]
        sample = np.sort(rng.choice(N, size=16, replace=False))
        for T in tokens:
            x = cp.random.standard_normal((T, K), dtype=cp.float32)
            x16 = x.astype(cp.float16)
            xt = tile_x16(x)
            act = gpu_mmq.quantize_q8_1(x)
            y = cp.empty((T, N), dtype=cp.float32)
            y16 = cp.empty((T, N), dtype=cp.float16)
            flops = 2.0 * T * N * K
            v = gpu_mmq.choose_variant(kind, T, N)
            t_cub = t_mmq = t_q8 = t_tile = float("nan")
            if baselines:
                t_cub = gt(lambda c: cp.matmul(x16, w16c[c % len(w16c)].T, out=y16), len(w16c),
                           capture=False)["median_ms"]   # cuBLAS refuses stream capture
                t_mmq = gt(lambda c: gpu_mmq.mmq(copies[c], act, out=y, variant=v), len(copies))["median_ms"]
                t_q8 = gt(lambda c: gpu_mmq.quantize_q8_1(x, out=act), 4)["median_ms"]
                t_tile = gt(lambda c: tile_x16(x, out=xt), 4)["median_ms"]
            base = {"kind": kind, "N": N, "K": K, "T": T, "cublas_ms": t_cub, "mmq_variant": v,
                    "mmq_ms": t_mmq, "q8_ms": t_q8, "tile_ms": t_tile, "weight_bytes": wd.nbytes,
                    "mmq_gbs": wd.nbytes / t_mmq * 1e-6}
            log(f"{kind} {N}x{K} T={T}: cuBLAS f16 {t_cub:.3f} ms ({flops / t_cub * 1e-9:.0f} TFLOP/s), "
                f"MMQ {v} {t_mmq:.3f} ms (ratio {t_cub / t_mmq:.2f}) + q8_1 {t_q8:.3f}, tile {t_tile:.3f}")
            x16_h = cp.asnumpy(x16)
            ref = wgmma_reference(w16_h[sample], x16_h)
            bound = wgmma_error_bound(K, wgmma_abs(w16_h[sample], x16_h))
            for cfg in configs:
                bt, st, kp = parse_config(cfg)
                if kp and kp > K // 256:
                    continue
                y.fill(np.nan)
                gemm(wd, xt, T, out=y, bt=bt, stages=st, kp=kp)
                got = cp.asnumpy(y[:, cp.asarray(sample)]).astype(np.float64)
                ok = bool(np.all(np.isfinite(got)) and np.all(np.abs(got - ref) <= bound))
                worst = float(np.max(np.abs(got - ref) / np.maximum(bound, 1e-300)))
                t = gt(lambda c: gemm(copies[c], xt, T, out=y, bt=bt, stages=st, kp=kp),
                       len(copies))["median_ms"]
                row = dict(base, config=cfg, wgmma_ms=t, ratio=t_cub / t, vs_mmq=t_mmq / t,
                           tflops=flops / t * 1e-9, gbs=wd.nbytes / t * 1e-6, ok=ok, worst_over_bound=worst)
                rows.append(row)
                log(f"    wgmma {cfg}: {t:.3f} ms  {row['tflops']:.0f} TFLOP/s  cuBLAS ratio {row['ratio']:.2f}"
                    f"  vs MMQ x{row['vs_mmq']:.2f}  ok={ok} (worst err/bound {worst:.2e})")
            del x, x16, xt, act, y, y16
        del wd, copies, w16, w16c
    return rows


def run_pairs(tokens, configs, pairs, reps=20, seed=7, log=print):
    """wgmma_pair (q4_K Na rows + q6_K Nb rows, one K) per config beside the two single
    launches at their production configs, graph timing; rows as run()'s with kind "pair",
    N = Na + Nb and "two_ms" (the two launches)."""
    import cupy as cp

    from engine.gpu.ops.wgmma import tile_x16, wgmma_pair, wgmma_q4k, wgmma_q6k
    from engine.gpu.weights import DeviceWeight, upload_weight

    rng = np.random.default_rng(seed)
    gt = GraphTimer(cp, reps=reps)
    rows = []
    for Na, Nb, K in pairs:
        wa = upload_weight(random_blocks(rng, "q4_k", Na, K, special=False), "Q4_K")
        wb = upload_weight(random_blocks(rng, "q6_k", Nb, K, special=False), "Q6_K")
        n = gt.copies(wa.nbytes + wb.nbytes)
        ca = [wa] + [DeviceWeight(wa.ggml_type, Na, K, wa.data.copy(), wa.padded) for _ in range(n - 1)]
        cb = [wb] + [DeviceWeight(wb.ggml_type, Nb, K, wb.data.copy(), wb.padded) for _ in range(n - 1)]
        nbytes = wa.nbytes + wb.nbytes
        for T in tokens:
            xt = tile_x16(cp.random.standard_normal((T, K), dtype=cp.float32))
            ya, yb = cp.empty((T, Na), dtype=cp.float32), cp.empty((T, Nb), dtype=cp.float32)

            def two(c):
                wgmma_q4k(ca[c], xt, T, out=ya)
                wgmma_q6k(cb[c], xt, T, out=yb)
            t_two = gt(two, n)["median_ms"]
            for cfg in configs:
                bt, st, kp = parse_config(cfg)
                if kp and kp > K // 256:
                    continue
                t = gt(lambda c: wgmma_pair(ca[c], cb[c], xt, T, ya, yb, bt=bt, stages=st, kp=kp), n)["median_ms"]
                rows.append({"kind": "pair", "N": Na + Nb, "Na": Na, "Nb": Nb, "K": K, "T": T, "config": cfg,
                             "wgmma_ms": t, "two_ms": t_two, "gbs": nbytes / t * 1e-6, "ok": True})
                log(f"pair {Na}+{Nb}x{K} T={T} {cfg}: {t * 1e3:.1f} us ({nbytes / t * 1e-6:.0f} GB/s), "
                    f"two launches {t_two * 1e3:.1f} us, x{t_two / t:.2f}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,3314")
    ap.add_argument("--configs", default="auto,128x4,256x4")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--wgmma-only", action="store_true", help="skip cuBLAS, MMQ and the activation passes")
    ap.add_argument("--pairs", default=None, help="NA+NBxK,..: time wgmma_pair (q4_K NA rows, q6_K NB) instead")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    configs = a.configs.split(",")
    if a.pairs:
        pairs = [(int(na), int(nb), int(k)) for na, nb, k in
                 (p.replace("+", "x").split("x") for p in a.pairs.split(","))]
        rows = run_pairs(tokens, configs, pairs, reps=a.reps)
    else:
        rows = run(tokens, configs, parse_shapes(a.shapes) if a.shapes else SHAPES, reps=a.reps,
                   baselines=not a.wgmma_only)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.pairs:
        return 0                        # run_pairs logged its rows; the table below is run()'s
    print(f"\n{'shape':>14s} {'T':>5s} {'cfg':>7s} {'wgmma ms':>9s} {'GB/s':>6s} {'MMQ ms':>8s} {'GB/s':>6s} "
          f"{'cuBLAS':>8s} {'/cuBLAS':>8s} {'xMMQ':>6s} ok")
    for r in rows:
        print(f"{r['kind']} {r['N']:>7d}x{r['K']:<6d} {r['T']:5d} {r['config']:>7s} {r['wgmma_ms']:9.4f} {r['gbs']:6.0f} "
              f"{r['mmq_ms']:8.4f} {r['mmq_gbs']:6.0f} {r['cublas_ms']:8.3f} {r['ratio']:8.2f} {r['vs_mmq']:6.2f} {r['ok']}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

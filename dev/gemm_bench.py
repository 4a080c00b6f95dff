"""GEMM microbenchmark: the MMQ kernels on the 7B shapes against cuBLAS on f16 weights.

    python -m dev.gemm_bench [--tokens 512,3314] [--variants all|default|NAME,..] [--reps 20]
                                [--shapes 7b|sweep|KIND:NxK,..] [--json OUT.json]

For each (kind, N x K) and token count T: random valid blocks (random bytes, sane f16 scales),
x ~ N(0, 1) quantized on the device; times (CUDA events, median of --reps after 3 warm-ups,
L2 flushed by a 256 MB memset before every timed run) of
  - quantize_q8_1 of x [T, K],
  - mmq for each tile variant (a NAME+split variant: the same instance with the tail split,
    engine.gpu.ops.mmq.split_plan; the `waves` column is gpu_ops.mmq_grid's predicted duration in
    whole-tile waves),
  - cupy.matmul(x16 [T, K], W16^T) with W16 the host-dequantized weights in f16 (cuBLAS),
and the same-run ratio = cuBLAS ms / MMQ ms (the MMQ rate as a fraction of cuBLAS's).
Each MMQ output is checked on 16 sampled weight rows against engine.reference.mmq's float64 oracle
(error_bound: |y - ref| <= (K/16 + 4) 2^-24 S, S the sum of term magnitudes).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from engine.formats import quants as Q
from engine.gpu.launch import capture_graph
from engine.reference.mmq import abs_terms, error_bound, mmq_reference, random_blocks

# (kind, N, K): llama2-7b linear layers (q4_K_M puts q6_K on attn_v / ffn_down in some layers
# and on output.weight).
SHAPES_7B = [
    ("q4_k", 4096, 4096),      # attn_q/k/v/output
    ("q4_k", 11008, 4096),     # ffn_gate / ffn_up
    ("q4_k", 4096, 11008),     # ffn_down
    ("q6_k", 4096, 4096),      # attn_v (q6_K layers)
    ("q6_k", 4096, 11008),     # ffn_down (q6_K layers)
    ("q6_k", 32000, 4096),     # output
    ("q4_k", 12288, 4096),     # attn_q/k/v fused (one GEMM when the three share a type)
    ("q4_k", 22016, 4096),     # ffn_gate + ffn_up fused
]


# token sweep of the production variants (gpu_ops.choose_variant) on the two largest shapes
SHAPES_SWEEP = [("q4_k", 11008, 4096), ("q6_k", 4096, 11008)]


def parse_shapes(spec: str) -> list[tuple[str, int, int]]:
    """'7b' | 'sweep' | 'q6_k:4096x4096,q4_k:4096x11008' -> [(kind, N, K)]."""
    if spec == "7b":
        return SHAPES_7B
    if spec == "sweep":
        return SHAPES_SWEEP
    out = []
    for item in spec.split(","):
        kind, _, nk = item.partition(":")
        n, _, k = nk.partition("x")
        if kind not in ("q4_k", "q6_k") or not (n.isdigit() and k.isdigit()) or int(k) % 256:
            raise ValueError(f"--shapes: bad item {item!r} (want q4_k|q6_k:NxK, K % 256 == 0)")
        out.append((kind, int(n), int(k)))
    return out


class Timer:
    def __init__(self, cp, reps: int = 20, warmup: int = 3, flush_mb: int = 256):
        self.cp = cp
        self.reps, self.warmup = reps, warmup
        self.flush = cp.empty(flush_mb << 20, dtype=cp.uint8)
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()

    def __call__(self, fn) -> dict:
        cp = self.cp
        for _ in range(self.warmup):
            fn()
        ts = []
        for r in range(self.reps):
            self.flush.fill(r & 0xFF)
            self.e0.record()
            fn()
            self.e1.record()
            self.e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(self.e0, self.e1))
        ts.sort()
        return {"median_ms": ts[len(ts) // 2], "min_ms": ts[0], "max_ms": ts[-1]}


class GraphTimer:
    """Back-to-back launches as in a forward: `launch(copy)` over weight copies that together
    exceed the L2 several times (every launch reads its weights from HBM, L2 lines clean),
    captured once in a CUDA graph (no host time between launches); per-launch ms = graph time
    / launches, median of `reps` replays. The cold timer above flushes L2 with a 256 MB
    memset instead, so each run also pays the write-back of dirty lines (and the launch)."""

    def __init__(self, cp, reps: int = 20, l2_multiple: int = 4, max_copies: int = 32):
        self.cp = cp
        self.reps = reps
        self.l2 = int(cp.cuda.Device().attributes["L2CacheSize"])
        self.l2_multiple, self.max_copies = l2_multiple, max_copies
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()

    def copies(self, nbytes: int) -> int:
        return max(2, min(self.max_copies, -(-self.l2_multiple * self.l2 // max(1, nbytes))))

    def __call__(self, launch, n_copies: int, capture: bool = True) -> dict:
        """capture=False replays the launches from the host instead (for libraries such as
        cuBLAS that refuse stream capture); fine where one launch outlasts its host cost."""
        cp = self.cp
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            for c in range(n_copies):            # compile, workspaces
                launch(c)
            s.synchronize()
            replay = (capture_graph(s, lambda: [launch(c) for c in range(n_copies)]).launch if capture
                      else lambda _s: [launch(c) for c in range(n_copies)])
            ts = []
            for r in range(self.reps + 1):
                self.e0.record(s)
                replay(s)
                self.e1.record(s)
                self.e1.synchronize()
                if r:
                    ts.append(cp.cuda.get_elapsed_time(self.e0, self.e1) / n_copies)
        ts.sort()
        return {"median_ms": ts[len(ts) // 2], "min_ms": ts[0], "max_ms": ts[-1]}


def run(tokens=(512, 3314), variants=None, reps: int = 20, shapes=None, seed: int = 1234,
        verify_rows: int = 16, log=print, timing: str = "graph") -> list[dict]:
    import cupy as cp

    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu import kernels
    from engine.gpu.weights import upload_weight

    shapes = shapes or SHAPES_7B
    rng = np.random.default_rng(seed)
    timer = Timer(cp, reps=reps)
    gtimer = GraphTimer(cp, reps=reps)
    rows: list[dict] = []
    cublas_cache: dict[tuple[int, int, int], dict] = {}
    w16_cache: dict[tuple[int, int], object] = {}
    for kind, N, K in shapes:
        t0 = time.time()
        w = random_blocks(rng, kind, N, K, special=False)
        wd = upload_weight(w, kind.upper())
        if (N, K) not in w16_cache:
            deq = Q.dequantize_q4_k(w) if kind == "q4_k" else Q.dequantize_q6_k(w)
            w16_cache.clear()
            w16_cache[(N, K)] = cp.asarray(deq.astype(np.float16))
            del deq
        w16 = w16_cache[(N, K)]
        copies = [wd]
        if timing == "graph":
            from engine.gpu.weights import DeviceWeight

            copies += [DeviceWeight(wd.ggml_type, wd.rows, wd.cols, wd.data.copy(), wd.padded)
                       for _ in range(gtimer.copies(wd.nbytes) - 1)]
        log(f"# {kind} {N}x{K}: weights ready in {time.time() - t0:.1f}s")
        sample = np.sort(rng.choice(N, size=min(verify_rows, N), replace=False))
        for T in tokens:
            x = cp.random.standard_normal((T, K), dtype=cp.float32)
            act = gpu_ops.quantize_q8_1(x)
            tq = timer(lambda: gpu_ops.quantize_q8_1(x, out=act))
            key = (T, N, K)
            if key not in cublas_cache:
                x16 = x.astype(cp.float16)
                y16 = cp.empty((T, N), dtype=cp.float16)
                cublas_cache[key] = timer(lambda: cp.matmul(x16, w16.T, out=y16))
                del x16, y16
            tc = cublas_cache[key]
            q_h = cp.asnumpy(act.q)
            ds_h = cp.asnumpy(act.ds)
            d_h, s_h = ds_h[..., 0], ds_h[..., 1]
            ref = S = S_min = None
            vlist = []
            for v in variants or kernels.mmq_variants(kind):     # "default" / "small" expand per (kind, T)
                vlist += ([gpu_ops.choose_variant(kind, T, N)] if v == "default"
                          else small_candidates(kind, T) if v == "small" else [v])
            vlist = list(dict.fromkeys(vlist))
            for v in vlist:
                if (kernels.mmq_split_name(v)[0] != kernels.MMVQ_VARIANT and not kernels.is_mmsb(v)
                        and kernels.mmq_split_name(v)[0] not in kernels.mmq_variants(kind)):
                    continue
                y = cp.empty((T, N), dtype=cp.float32)
                if timing == "graph":
                    tm = gtimer(lambda c: gpu_ops.mmq(copies[c], act, out=y, variant=v), len(copies))
                else:
                    tm = timer(lambda: gpu_ops.mmq(wd, act, out=y, variant=v))
                y.fill(np.nan)
                gpu_ops.mmq(wd, act, out=y, variant=v)
                ys = cp.asnumpy(y[:, cp.asarray(sample)]).astype(np.float64)
                if ref is None:
                    ws = w[sample]
                    ref = mmq_reference(kind, ws, q_h, d_h, s_h)
                    S, S_min = abs_terms(kind, ws, q_h, d_h, s_h)
                err = np.abs(ys - ref)
                ok = bool(np.all(np.isfinite(ys)) and np.all(err <= error_bound(kind, K, S, S_min, kernels.mmq_uses_tc(kind, v))))
                ops = 2.0 * T * N * K
                grid = (gpu_ops.MmqGrid(0, 0, 1, 0, float("nan"))
                        if kernels.mmq_split_name(v)[0] == kernels.MMVQ_VARIANT or kernels.is_mmsb(v)
                        else gpu_ops.mmq_grid(kind, v, T, N, K))
                row = {
                    "kind": kind, "N": N, "K": K, "T": T, "variant": v,
                    "tiles": grid.tiles, "split0": grid.split0, "parts": grid.parts,
                    "waves": grid.waves,
                    "mmq_ms": tm["median_ms"], "mmq_min_ms": tm["min_ms"], "mmq_max_ms": tm["max_ms"],
                    "mmq_tops": ops / tm["median_ms"] * 1e-9,
                    "cublas_ms": tc["median_ms"], "cublas_tflops": ops / tc["median_ms"] * 1e-9,
                    "ratio": tc["median_ms"] / tm["median_ms"],
                    "quant_ms": tq["median_ms"], "verified": ok,
                    "weight_bytes": wd.nbytes, "weight_gbs": wd.nbytes / tm["median_ms"] * 1e-6,
                }
                rows.append(row)
                log(fmt_row(row))
                del y
            del x, act
        del wd, copies
    return rows


HEADER = (f"{'kind':5s} {'N x K':>11s} {'T':>5s} {'variant':23s} {'waves':>6s} {'mmq ms':>8s} "
          f"{'GB/s':>6s} {'TOP/s':>7s} {'cuBLAS ms':>9s} {'TFLOP/s':>7s} {'ratio':>6s} {'q8 ms':>6s} ok")


def small_candidates(kind: str, T: int) -> list[str]:
    """--variants small: the decode GEMV at T = 1, then every tile config with split plans of up
    to 4, 8 and 16 parts (the small-batch tiers of registry.SMALL_BATCH_TIERS are picked from
    these rows)."""
    from engine.gpu import kernels

    out = [kernels.MMVQ_VARIANT] if T == 1 else []
    if T <= kernels.MMSB_MAX_TOKENS:
        out += [kernels.MMSB_VARIANT + s for s in ("", "+split2", "+split4", "+split8")]
    for c in kernels.mmq_variants(kind):
        out += [c, c + "+split", c + "+split8", c + "+split16"]
    return out


def fmt_row(r: dict) -> str:
    return (f"{r['kind']:5s} {r['N']:>5d}x{r['K']:<5d} {r['T']:>5d} {r['variant']:23s} "
            f"{r.get('waves', float('nan')):6.2f} "
            f"{r['mmq_ms']:8.3f} {r['weight_gbs']:6.0f} {r['mmq_tops']:7.1f} {r['cublas_ms']:9.3f} {r['cublas_tflops']:7.1f} "
            f"{r['ratio']:6.3f} {r['quant_ms']:6.3f} {'yes' if r['verified'] else 'NO'}")


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [fmt_row(r) for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,3314")
    ap.add_argument("--variants", default="all",
                    help="all | NAME,NAME,.. where a NAME may be default (gpu_ops.choose_variant per T) "
                         "or small (small_candidates)")
    ap.add_argument("--shapes", default="7b",
                    help="7b (SHAPES_7B) | sweep (SHAPES_SWEEP) | KIND:NxK,.. (e.g. q6_k:4096x4096)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--timing", choices=("graph", "cold"), default="graph",
                    help="graph: back-to-back launches over weight copies > L2 in a CUDA graph (GraphTimer); "
                         "cold: one launch after a 256 MB memset (Timer)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    variants = None if a.variants == "all" else a.variants.split(",")
    try:
        shapes = parse_shapes(a.shapes)
    except ValueError as e:
        ap.error(str(e))
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"# device {name} sm_{props['major']}{props['minor']}, "
          f"{props['multiProcessorCount']} SMs; cupy {cp.__version__}")
    from engine.gpu import kernels
    for kind in ("q4_k", "q6_k"):
        if kind not in {sk for sk, _, _ in shapes}:
            continue
        names = [kernels.mmq_split_name(v)[0] for v in (variants or kernels.mmq_variants(kind))
                 if kernels.mmq_split_name(v)[0] != kernels.MMVQ_VARIANT and not kernels.is_mmsb(v)]
        for v in dict.fromkeys(names):
            if v not in kernels.mmq_variants(kind):
                continue
            k = kernels.get_kernel(f"mmq_{kind}.cu", kernels.mmq_instance(kind, v),
                                   dynamic_smem=kernels.mmq_smem_bytes(kind, v))
            print(f"# {kind} {v:11s} {kernels.mmq_instance(kind, v):26s} regs {k.num_regs} "
                  f"local {k.local_size_bytes} B smem {kernels.mmq_smem_bytes(kind, v)} B")
    from engine.gpu import registry
    from engine.gpu.ops.mmsb import KERNEL_FILE
    sb_ntts = sorted({registry.mmsb_ntt(t) for t in tokens if t <= registry.MMSB_MAX_TOKENS})
    for v in [v for v in dict.fromkeys(variants or ()) if kernels.is_mmsb(v)]:
        for kind in sorted({sk for sk, _, _ in shapes}):
            for ntt in sb_ntts:
                name = registry.mmsb_instance(kind, ntt, True, v)
                k = kernels.get_kernel(KERNEL_FILE[kind], name)
                print(f"# {kind} {v:11s} {name:26s} regs {k.num_regs} local {k.local_size_bytes} B")
    print(HEADER, flush=True)
    rows = run(tokens=tokens, variants=variants, reps=a.reps, shapes=shapes,
               log=lambda s: print(s, flush=True), timing=a.timing)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n# GEMM microbenchmark (median ms; ratio = cuBLAS f16 ms / MMQ ms, same run)")
    print(table(rows))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

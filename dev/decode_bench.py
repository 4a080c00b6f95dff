"""Decode microbenchmarks (not part of the product): tg rows at several depths, graph vs
kernel-by-kernel, the host time to enqueue one step, launches per step and each GEMV alone.

    python -m dev.decode_bench --model M [-n 128] [-d 0,3314] [-r 5] [--eager] [--kernels] [--json F]

Everything runs on engine.gpu.model.GPUModel and its decode sessions (engine.gpu.session), the
same weights and graph as `gguf-prefill bench -n`. The decode variants of perf-log decode runs
1-2 (rows per warp, load batches, fused combine / norm) are retired: production is one row per
warp, run 1's loop, separate combine and norm (docs/perf-log.md, decode run 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _cp():
    import cupy

    return cupy


def host_overhead_us(model, n: int = 64) -> dict:
    """Python-side cost of enqueueing one step: graph replay vs kernel-by-kernel (median us
    over n steps each), the kernels a step launches and the graph build time."""
    from engine.gpu.session import GPUSession

    sess = GPUSession(model, n + 4)
    step = sess.decode
    step.chain(1, 0, 2)                      # kernels loaded, graph captured
    res = {}
    for mode in ("graph", "eager"):
        ts = []
        with step.stream:
            step.set_state(1, 0)             # positions 0..n-1 stay inside the cache
            for i in range(n):
                t0 = time.perf_counter()
                if mode == "graph":
                    step.graph.launch(step.stream)
                else:
                    step.enqueue()
                ts.append((time.perf_counter() - t0) * 1e6)
                if i % 8 == 7:
                    step.stream.synchronize()     # keep the launch queue from filling
            step.stream.synchronize()
        res[mode + "_us"] = float(np.median(ts))
    res["kernels_per_step"] = count_launches(step)
    res["graph_build_ms"] = step.times.graph_build_ms
    return res


def count_launches(step) -> int:
    """Kernels one step launches (by counting kernel calls of DecodeStep.enqueue())."""
    from engine.gpu import kernels

    n = [0]
    orig = kernels.get_kernel

    class Counting:
        def __init__(self, k):
            self.k = k

        def __call__(self, *a, **kw):
            n[0] += 1

    def fake(fname, name, dynamic_smem=0):
        return Counting(orig(fname, name, dynamic_smem))

    kernels.get_kernel = fake
    try:
        step.enqueue()
    finally:
        kernels.get_kernel = orig
    return n[0]


def mmvq_microbench(model, iters: int = 50) -> list:
    """Each GEMV of one decode step, alone: (what, N, K, weight bytes, us, GB/s); median of
    `iters` timed launches after a warm-up. The layer-0 (and, if different, layer 4's or the
    last layer's) matrices and the output matrix."""
    cp = _cp()
    from engine.gpu.decode import same_launch
    from engine.gpu.ops.mmvq import mmvq_launch
    from engine.gpu.ops.q8 import Q8Act

    cfg = model.config
    out = []

    def act(K):
        x = cp.asarray(np.random.default_rng(0).integers(-127, 128, K).astype(np.int8))
        ds = cp.asarray(np.tile(np.array([[0.01, 0.0]], np.float32), (K // 32, 1)))
        return Q8Act(x, ds)

    def time_it(what, ws, mode):
        K = int(ws[0].cols)
        a = act(K)
        ys = [cp.zeros(int(w.rows), dtype=np.float32) for w in ws] if mode == "store" else \
            [cp.zeros(int(ws[0].rows), dtype=np.float32)]
        for _ in range(3):
            mmvq_launch(ws, ys, a.q, a.ds, mode)
        ts = []
        for _ in range(iters):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            mmvq_launch(ws, ys, a.q, a.ds, mode)
            e1.record()
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        us = float(np.median(ts))
        nbytes = sum(int(w.data.nbytes) for w in ws)
        out.append({"what": what, "N": sum(int(w.rows) for w in ws), "K": K, "bytes": nbytes, "us": us,
                    "GB_s": nbytes / us / 1e3})

    def layout(w):
        return "" if w.kind == "q4_k" else (" pad" if w.padded else " raw")

    layers = [0] if cfg.n_layers == 1 else [0, 4 if cfg.n_layers > 4 else cfg.n_layers - 1]
    for i in layers:
        L = model.layers[i]
        W = L.roles
        tag = f"L{i} "
        if same_launch(W["attn_q"], W["attn_v"]):
            time_it(tag + f"qkv {W['attn_q'].kind}", [W["attn_q"], W["attn_k"], W["attn_v"]], "store")
        else:
            time_it(tag + f"qk {W['attn_q'].kind}", [W["attn_q"], W["attn_k"]], "store")
            time_it(tag + f"v {W['attn_v'].kind}", [W["attn_v"]], "store")
        time_it(tag + f"o {L.wo.kind}", [L.wo], "add")
        time_it(tag + f"gate+up swiglu {W['ffn_gate'].kind}", [W["ffn_gate"], W["ffn_up"]], "swiglu")
        time_it(tag + f"down {L.down.kind}{layout(L.down)}", [L.down], "add")
    o = model.output_w
    time_it(f"output {o.kind}{layout(o)}", [o], "store")
    return out


def main(argv=None) -> int:
    from engine.gpu.decode import bench_decode
    from engine.gpu.model import GPUModel

    p = argparse.ArgumentParser(prog="python -m dev.decode_bench")
    p.add_argument("--model", required=True)
    p.add_argument("-n", type=int, default=128)
    p.add_argument("-d", default="0")
    p.add_argument("-r", type=int, default=5)
    p.add_argument("--raw-q6k", action="store_true", help="keep q6_K rows raw (210 B)")
    p.add_argument("--eager", action="store_true", help="also time tg at the first depth without the graph")
    p.add_argument("--kernels", action="store_true", help="time each GEMV of a step alone")
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = {"model": a.model, "size": os.path.getsize(a.model), "rows": [], "kernels": []}

    def dump():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)

    model = GPUModel.from_path(a.model, pad_q6k=not a.raw_q6k, progress=True)
    res["resident_bytes"] = model.resident_bytes
    depths = [int(x) for x in a.d.split(",")]

    def row(depth, graph):
        ts = bench_decode(model, a.n, depth, a.r if graph else 2, use_graph=graph)
        r = {"test": f"tg{a.n}" + (f" @ d{depth}" if depth else ""), "graph": graph,
             "tok_s": float(np.mean(ts)), "sd": float(np.std(ts, ddof=1)) if len(ts) > 1 else 0.0,
             "reps": ts, "q6k": "raw" if a.raw_q6k else "padded"}
        res["rows"].append(r)
        print(f"{r['test']:14s} graph={str(graph):5s} {r['tok_s']:9.1f} ± {r['sd']:.1f} tok/s", flush=True)
        dump()

    for depth in depths:
        row(depth, True)
    if a.eager:
        row(depths[0], False)
    res["host"] = h = host_overhead_us(model)
    print(f"host time per step: graph {h['graph_us']:.1f} us, eager {h['eager_us']:.1f} us "
          f"({h['kernels_per_step']} kernels), graph build {h['graph_build_ms']:.1f} ms", flush=True)
    dump()
    if a.kernels:
        for k in mmvq_microbench(model):
            res["kernels"].append(k)
            print(f"  {k['what']:28s} {k['N']:6d}x{k['K']:<6d} {k['bytes'] / 2**20:8.1f} MiB "
                  f"{k['us']:8.1f} us {k['GB_s']:7.0f} GB/s", flush=True)
        dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())

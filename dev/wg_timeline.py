"""Where a small-T wgmma GEMM's time goes, block by block (kernels_cu/wgmma_common.cuh WG_TIMELINE).

    python -m dev.wg_timeline [--shapes q4_k:22016x4096,..] [--tokens 32] [--configs auto,32x16,..]
                              [--swiglu] [--reps 10] [--json OUT]

The build is the define set WG_TIMELINE=1 (added to GGUF_PREFILL_KERNEL_DEFINES for this process):
thread 0 of every block stamps %globaltimer at the GEMM's phases (entry, PDL wait done, first
activation stages issued, first weights in use, stage 0 landed, first super-block done, K loop
done, exit), plus clock64 and %smid. Each (shape, T, config) runs as dev.hopper_bench times it:
back-to-back launches over weight copies beyond the L2, one CUDA graph with PDL, so the record
the global holds afterwards is the last launch's, with a predecessor in front of it as in a
forward. --swiglu runs the gate|up kernel with SwiGLU fused (N = 2 F rows) instead of the plain
q4_K one.

The summary (summarize(), numpy only) answers the T = 32 question of issue 12 (docs/perf-log.md
Session 31: with no weight loads at all the GEMMs keep 84% of their time): how much of a
launch is the blocks' start (the PDL wait, the first weights' and the first stage's latency),
how much the super-blocks (us each, by blocks resident on the SM), how much the epilogue, and
how far apart the blocks start and end (the wave's skew and tail).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import numpy as np

SLOTS = 24            # wgmma_common.cuh WG_TL_SLOTS
MAX_BLOCKS = 8192     # WG_TL_BLOCKS
PHASES = ("ENTRY", "PDL", "ISSUED", "WEIGHTS0", "STAGE0", "SB0", "LOOP", "EPI_SYNC", "EPI_SUM", "EXIT")
SPLIT_ONLY = ("EPI_SYNC", "EPI_SUM")    # stamped by K-split (KP > 1) blocks only
S = {name: i for i, name in enumerate(PHASES)}
NPH = len(PHASES)     # slot p: %globaltimer of phase p; NPH + p: its clock64; 2 NPH: %smid
SMID = 2 * NPH


def source_phases() -> tuple[str, ...]:
    """The WG_TL_* phases of kernels_cu/wgmma_common.cuh, in order (tests hold PHASES to it)."""
    text = (Path(__file__).resolve().parents[1] / "kernels_cu" / "wgmma_common.cuh").read_text()
    body = re.search(r"enum\s*\{\s*(WG_TL_ENTRY[^}]*)\}", text).group(1)
    names = [w.strip()[len("WG_TL_"):] for w in body.split(",") if w.strip()]
    return tuple(n for n in names if n != "PHASES")


def block_super_blocks(n_blocks: int, grid: tuple[int, int, int], K: int) -> np.ndarray:
    """Super-blocks each block runs: part z of KP runs nsb z / KP .. nsb (z + 1) / KP - 1
    (wgmma_gemm), the block id linear in (x, y, z)."""
    gx, gy, kp = grid
    nsb = K // 256
    z = np.arange(n_blocks) // (gx * gy)
    return (z + 1) * nsb // kp - z * nsb // kp


def _q(a) -> dict:
    a = np.asarray(a, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "min": float(a.min()), "median": float(np.median(a)),
            "p90": float(np.quantile(a, 0.9)), "max": float(a.max())}


def summarize(rec: np.ndarray, nsb: np.ndarray) -> dict:
    """rec: uint64 [blocks, SLOTS] (one launch's wg_timeline rows), nsb: super-blocks per block.

    Across blocks (%globaltimer, us from the launch's first entry): entry, exit, span, the gap
    before a block that starts where an earlier block of the launch left its SM (refill_gap), and
    the blocks resident on a block's SM at its K loop's midpoint. Within a block (clock64 at the
    SM clock, pooled cycles / ns of all blocks): pdl (entry -> wait done), setup (-> the first
    stages issued), weights0 (-> the first super-block's weights in use), stage0 (-> its first
    activation stage landed, after the weights), sb0 (-> the first super-block done), per_sb
    (each later super-block); with a K split epi_wait (K loop done -> every part's partial tile
    visible) and epi_sum (-> this part's sums stored); epilogue (-> exit; unsplit: from the K
    loop's end)."""
    rec = np.asarray(rec, dtype=np.uint64)
    if rec.ndim != 2 or rec.shape[1] != SLOTS or len(rec) != len(nsb):
        raise ValueError(f"wg_timeline: want [blocks, {SLOTS}] rows and one super-block count a block")
    gt = rec[:, :NPH].astype(np.int64)
    clk = rec[:, NPH:2 * NPH].astype(np.int64)
    for a in (gt, clk):                 # an unsplit block's K-split phases: at its loop's end
        for name in SPLIT_ONLY:
            a[:, S[name]] = np.where(a[:, S[name]] == 0, a[:, S["LOOP"]], a[:, S[name]])
    if not np.all(gt[:, 0] > 0) or np.any(np.diff(gt, axis=1) < 0) or np.any(np.diff(clk, axis=1) < 0):
        raise ValueError("wg_timeline: a block's stamps are missing or out of order (was the "
                         "WG_TIMELINE build the one launched?)")
    ns = gt[:, S["EXIT"]] - gt[:, S["ENTRY"]]
    cyc = clk[:, S["EXIT"]] - clk[:, S["ENTRY"]]
    ghz = float(cyc.sum() / ns.sum()) if ns.sum() > 0 else float("nan")
    t0 = int(gt[:, S["ENTRY"]].min())
    at = {name: (gt[:, S[name]] - t0) / 1e3 for name in PHASES}             # us, launch-wide
    dur = {name: clk[:, S[name]] / (ghz * 1e3) for name in PHASES}          # us, one block's own
    nsb = np.asarray(nsb)
    phases = {
        "pdl": dur["PDL"] - dur["ENTRY"],
        "setup": dur["ISSUED"] - dur["PDL"],
        "weights0": dur["WEIGHTS0"] - dur["ISSUED"],
        "stage0": dur["STAGE0"] - dur["WEIGHTS0"],
        "sb0": dur["SB0"] - dur["STAGE0"],
        "per_sb": np.where(nsb > 1, (dur["LOOP"] - dur["SB0"]) / np.maximum(nsb - 1, 1), 0.0),
        "epi_wait": dur["EPI_SYNC"] - dur["LOOP"],
        "epi_sum": dur["EPI_SUM"] - dur["EPI_SYNC"],
        "epilogue": dur["EXIT"] - dur["EPI_SUM"],
    }
    sm = rec[:, SMID].astype(np.int64)
    per_sm = np.bincount(sm)
    mid = (at["SB0"] + at["LOOP"]) / 2
    same = sm[:, None] == sm[None, :]
    resident = np.sum(same & (at["ENTRY"][None, :] <= mid[:, None]) & (at["EXIT"][None, :] >= mid[:, None]), axis=1)
    # a block entering after another block of this launch left its SM: the gap since that exit
    left = np.where(same & (at["EXIT"][None, :] <= at["ENTRY"][:, None]), at["EXIT"][None, :], -np.inf).max(axis=1)
    refill_gap = (at["ENTRY"] - left)[np.isfinite(left)]
    last = int(np.argmax(at["EXIT"]))
    loop = nsb > 1
    return {
        "blocks": int(len(rec)),
        "sms": int(np.count_nonzero(per_sm)),
        "blocks_per_sm": {int(k): int(v) for k, v in zip(*np.unique(per_sm[per_sm > 0], return_counts=True))},
        "span_us": float(at["EXIT"].max()),
        "span_from_pdl_us": float(at["EXIT"].max() - at["PDL"].min()),
        "sm_ghz": ghz,
        "entry_us": _q(at["ENTRY"]),
        "exit_us": _q(at["EXIT"]),
        "refill_gap_us": _q(refill_gap),
        "phases_us": {k: _q(v) for k, v in phases.items()},
        "per_sb_by_resident": {int(r): float(np.median(phases["per_sb"][(resident == r) & loop]))
                               for r in np.unique(resident[loop])},
        "last_block": {"id": last, "sm": int(sm[last]), "super_blocks": int(nsb[last]),
                       "resident": int(resident[last]),
                       **{k: float(v[last]) for k, v in phases.items()},
                       "entry": float(at["ENTRY"][last]), "exit": float(at["EXIT"][last])},
    }


def format_summary(label: str, s: dict, ms: float | None = None) -> str:
    head = (f"{label}: {s['blocks']} blocks on {s['sms']} SMs {s['blocks_per_sm']}, span {s['span_us']:.1f} us "
            f"({s['span_from_pdl_us']:.1f} from the first PDL release)")
    if ms is not None:
        head += f", graph {ms * 1e3:.1f} us a launch"
    lines = [head + f", SM clock {s['sm_ghz']:.2f} GHz",
             f"  {'us':<10s} {'min':>7s} {'median':>7s} {'p90':>7s} {'max':>7s}   last block"]
    lb = s["last_block"]
    rows = [("entry", s["entry_us"]), ("exit", s["exit_us"]), ("refill_gap", s["refill_gap_us"])]
    for name, q in rows + list(s["phases_us"].items()):
        if not q.get("n"):
            continue
        tail = f"{lb[name]:7.2f}" if name in lb else ""
        lines.append(f"  {name:<10s} {q['min']:7.2f} {q['median']:7.2f} {q['p90']:7.2f} {q['max']:7.2f}   {tail}")
    lines.append("  per super-block by blocks resident on the SM: "
                 + ", ".join(f"{r}: {v:.3f} us" for r, v in s["per_sb_by_resident"].items())
                 + f"; last block: SM {lb['sm']}, {lb['super_blocks']} super-blocks, {lb['resident']} resident")
    return "\n".join(lines)


def run(shapes, tokens, configs, swiglu: bool = False, reps: int = 10, seed: int = 7, log=print) -> list[dict]:
    from engine.gpu import kernels

    defs = os.environ.get(kernels.DEFINES_ENV, "")
    if "WG_TIMELINE" not in defs:
        os.environ[kernels.DEFINES_ENV] = (defs + ",WG_TIMELINE=1").strip(",")
    import cupy as cp

    from dev.gemm_bench import GraphTimer
    from dev.hopper_bench import parse_config
    from engine.gpu import registry
    from engine.gpu.ops import wgmma as W
    from engine.gpu.weights import DeviceWeight, upload_weight
    from engine.reference.mmq import random_blocks

    rng = np.random.default_rng(seed)
    gt = GraphTimer(cp, reps=reps)
    rows = []
    for kind, N, K in shapes:
        if swiglu and kind != "q4_k":
            raise SystemExit("--swiglu: q4_k shapes only")
        w = upload_weight(random_blocks(rng, kind, N, K, special=False), kind.upper())
        copies = [w] + [DeviceWeight(w.ggml_type, N, K, w.data.copy(), w.padded) for _ in range(gt.copies(w.nbytes) - 1)]
        for T in tokens:
            xt = W.tile_x16(cp.random.standard_normal((T, K), dtype=cp.float32))
            out = W.tiled_buffer(T, N // 2) if swiglu else cp.empty((T, N), dtype=cp.float32)
            for cfg in configs:
                bt, st, kp = parse_config(cfg)
                if kp == W.STREAMK:
                    raise SystemExit(f"{cfg}: the stream-K form has no timeline stamps")
                bt, st, kp, _ = W._config("wg_timeline", T, N, K, bt, st, kp)
                if swiglu:
                    fname, inst = W.FILE, registry.wgmma_swiglu_instance(bt, st, kp)
                    gemm = lambda c: W.wgmma_swiglu(copies[c], xt, T, out, bt=bt, stages=st, kp=kp)  # noqa: E731
                elif kind == "q4_k":
                    fname, inst = W.FILE, registry.wgmma_instance(bt, st, kp)
                    gemm = lambda c: W.wgmma_q4k(copies[c], xt, T, out, bt=bt, stages=st, kp=kp)  # noqa: E731
                else:
                    fname, inst = W.Q6_FILE, registry.wgmma_q6_instance(w.padded, bt, st, kp)
                    gemm = lambda c: W.wgmma_q6k(copies[c], xt, T, out, bt=bt, stages=st, kp=kp)  # noqa: E731
                ms = gt(gemm, len(copies))["median_ms"]
                cp.cuda.Device().synchronize()
                grid = (-(-T // bt), N // W.ROWS, kp)
                n = grid[0] * grid[1] * grid[2]
                if n > MAX_BLOCKS:
                    raise SystemExit(f"{n} blocks: the timeline holds {MAX_BLOCKS}")
                ptr = kernels.get_module(fname, inst).get_global("wg_timeline")
                rec = cp.ndarray((MAX_BLOCKS, SLOTS), dtype=cp.uint64, memptr=ptr)[:n].get()
                s = summarize(rec, block_super_blocks(n, grid, K))
                label = f"{'swiglu' if swiglu else kind} {N}x{K} T={T} {cfg} ({inst})"
                log(format_summary(label, s, ms))
                rows.append({"kind": kind, "swiglu": swiglu, "N": N, "K": K, "T": T, "config": cfg,
                             "instance": inst, "graph_ms": ms, **s})
    return rows


def main(argv=None) -> int:
    from dev.gemm_bench import parse_shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="q4_k:22016x4096,q4_k:4096x4096,q6_k:4096x11008")
    ap.add_argument("--tokens", default="32")
    ap.add_argument("--configs", default="auto")
    ap.add_argument("--swiglu", action="store_true", help="the gate|up kernel with SwiGLU fused (q4_k shapes)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = run(parse_shapes(a.shapes), [int(t) for t in a.tokens.split(",")], a.configs.split(","),
               swiglu=a.swiglu, reps=a.reps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

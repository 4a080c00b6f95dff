"""Print the short summary of a scripts/gpu_check.sh run from the files in OUT."""
from __future__ import annotations

import glob
import json
import os
import sys


def main(out: str) -> int:
    rep = os.path.join(out, "gpu_report.jsonl")
    recs = []
    if os.path.exists(rep):
        recs = [json.loads(line) for line in open(rep) if line.strip()]
    by = {}
    for r in recs:
        by.setdefault(r["test"], []).append(r)
    if "quantize_q8_1" in by:
        rs = by["quantize_q8_1"]
        print(f"q8_1: {len(rs)} shapes, {sum(r['blocks'] for r in rs)} blocks, mismatches "
              f"q/d/s = {sum(r['q_mismatches'] for r in rs)}/{sum(r['d_mismatches'] for r in rs)}/"
              f"{sum(r['s_mismatches'] for r in rs)}")
    for r in by.get("q6k_expand", []):
        print(f"q6_K expansion: {r['elements']} elements, mismatches closed-form (padded) vs raw arm "
              f"{r['closed_vs_raw_arm_mismatches']}, closed-form vs numpy {r['closed_vs_numpy_mismatches']}, "
              f"raw arm vs numpy {r['raw_arm_vs_numpy_mismatches']}")
    if "q6k_raw_vs_padded" in by:
        rs = by["q6k_raw_vs_padded"]
        print(f"q6_K raw vs padded: {len(rs)} runs, {sum(r['elements'] for r in rs)} outputs, "
              f"bit mismatches {sum(r['bit_mismatches'] for r in rs)}")
    if "mmq" in by:
        groups = {}
        for r in by["mmq"]:
            groups.setdefault((r["kind"], r["layout"], r["variant"]), []).append(r)
        print(f"{'kind':5s} {'layout':6s} {'variant':11s} {'runs':>4s} {'bad':>4s} {'worst/uS':>9s} "
              f"{'bound/uS':>12s} {'max rel_l2':>10s}  shapes (T,N,K)")
        for (kind, layout, v), rs in groups.items():
            shapes = " ".join(f"{r['T']},{r['N']},{r['K']}" for r in rs)
            print(f"{kind:5s} {layout:6s} {v:11s} {len(rs):4d} {sum(r['bad'] for r in rs):4d} "
                  f"{max(r['worst_err_over_uS'] for r in rs):9.2f} "
                  f"{min(r['bound_over_uS'] for r in rs):5.0f}..{max(r['bound_over_uS'] for r in rs):<5.0f} "
                  f"{max(r['rel_l2'] for r in rs):10.2e}  {shapes}")
    bj = os.path.join(out, "gemm_bench.json")
    if os.path.exists(bj):
        from dev.gemm_bench import table
        print("\n# GEMM microbenchmark (median ms; ratio = cuBLAS f16 ms / MMQ ms, same run)")
        print(table(json.load(open(bj))))
    sw = os.path.join(out, "gemm_sweep.json")
    if os.path.exists(sw):
        from dev.gemm_bench import table
        print("\n# production variants across token counts")
        print(table(json.load(open(sw))))
    aj = os.path.join(out, "attn.json")
    if os.path.exists(aj):
        rows = json.load(open(aj))
        print("\n# prefill attention (median ms, causal TFLOP/s; err: max |diff| / max|V| against the first variant)")
        for r in rows:
            print(f"H={r['H']}/{r['KVH']} hd={r['hd']} {r['n']}@{r['start']} {r['variant']:9s} {r['ms']:8.3f} ms "
                  f"{r['tflops']:6.1f} TFLOP/s err {r['err']:.1e}")
    for tj in sorted(glob.glob(os.path.join(out, "timeline*.json"))):
        print(f"\n# {os.path.basename(tj)}: wgmma blocks phase by phase (us; medians over the blocks, per super-block by blocks resident)")
        for r in json.load(open(tj)):
            ph = {k: v.get("median", 0.0) for k, v in r["phases_us"].items()}
            print(f"{r['kind']} {r['N']}x{r['K']} T={r['T']} {r['config']:>7s}: graph {r['graph_ms'] * 1e3:6.1f}, "
                  f"span {r['span_us']:6.1f}, exits {r['exit_us']['min']:.1f}..{r['exit_us']['max']:.1f}; pdl {ph['pdl']:.2f} "
                  f"fill {ph['weights0'] + ph['stage0']:.2f} sb {r['per_sb_by_resident']} "
                  f"epi {ph['epi_wait'] + ph['epi_sum'] + ph['epilogue']:.2f}")
    for gj in sorted(glob.glob(os.path.join(out, "graph_tl_*.json"))):
        from dev.graph_timeline import format_shares
        g = json.load(open(gj))
        print(f"\n# {os.path.basename(gj)}")
        print(format_shares(g["label"], g, top=10))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu_out"))

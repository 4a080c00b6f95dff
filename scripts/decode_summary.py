"""Print the short table of a scripts/decode_check.sh run from the files in OUT."""
from __future__ import annotations

import json
import os
import re
import sys


def main(out: str) -> int:
    rep = os.path.join(out, "gpu_report.jsonl")
    recs = []
    if os.path.exists(rep):
        for line in open(rep):
            if line.strip():
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
    by: dict[str, list] = {}
    for r in recs:
        by.setdefault(r.get("test", "?"), []).append(r)
    print("\n# decode (issues 7, 11)")
    log = os.path.join(out, "decode_tests.log")
    if os.path.exists(log):
        tail = [ln.strip() for ln in open(log) if re.search(r"\d+ (passed|failed|error)", ln)]
        print("tests:", " | ".join(tail) if tail else "no pytest summary line")
    if "decode_mmvq" in by:
        rs = by["decode_mmvq"]
        print(f"MMVQ vs oracle: {len(rs)} layout/mode combos passed, worst |err|/bound "
              f"{max(r['worst_err_over_bound'] for r in rs):.3f}")
    if "decode_attention" in by:
        rs = by["decode_attention"]
        worst = max(rs, key=lambda r: r["max_err"] / r["tol"])
        print(f"attention vs float64: {len(rs)} runs (L up to {max(r['L'] for r in rs)}), worst err/tol "
              f"{worst['max_err'] / worst['tol']:.3f} (H{worst['H']} KV{worst['KVH']} {worst['kv']} L{worst['L']} "
              f"S{worst['splits']})")
    for r in by.get("decode_logits", []):
        print(f"logits vs reference: {r['model']} kv {r['kv']}: {r['steps']} steps, max rel L2 "
              f"{r['max_rel_l2']:.3g}, argmax agree {r['argmax_agree']}/{r['steps']} (margin>=1: {r['confident']})")
    for key in ("decode_greedy32", "decode_greedy32_gpu_model"):
        for r in by.get(key, []):
            who = "GPUModel sessions" if key == "decode_greedy32_gpu_model" else key
            print(f"greedy-32 {who:30s} {r['model']:5s} prompt {r['prompt_len']:5d}: free run "
                  f"{r['matched']}/{r['compared']} {'ok' if r['ok'] else 'FAIL'}, teacher-forced "
                  f"{r['teacher_matched']}/{r['teacher_compared']} (of {r['golden_tokens']})")
    bj = os.path.join(out, "decode_bench.json")
    if os.path.exists(bj):
        b = json.load(open(bj))
        print(f"tg on {os.path.basename(b['model'])} ({b['size'] / 2**30:.2f} GiB file, "
              f"{b.get('resident_bytes', 0) / 2**30:.2f} GiB resident):")
        for r in b["rows"]:
            print(f"  {r['test']:12s} {'graph' if r['graph'] else 'eager'}  "
                  f"{r['tok_s']:8.1f} ± {r['sd']:5.1f} tok/s")
        h = b.get("host")
        if h:
            print(f"  host time per step: graph {h['graph_us']:.1f} us, kernel by kernel {h['eager_us']:.1f} us "
                  f"({h['kernels_per_step']} kernels); graph build {h['graph_build_ms']:.1f} ms")
        ks = b.get("kernels") or []
        if ks:
            print("  GEMV                              us   GB/s")
            for k in ks:
                print(f"  {k['what']:28s} {k['us']:8.1f} {k['GB_s']:6.0f}")
    cl = os.path.join(out, "decode_cli_bench.log")
    if os.path.exists(cl):
        rows = [ln.rstrip() for ln in open(cl) if re.search(r"\b(pp|tg)\d+", ln)]
        if rows:
            print("bench verb (GPUModel):")
            for ln in rows:
                print("  " + ln[:150])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu_out"))

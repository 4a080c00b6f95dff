"""Print the short summary of a scripts/prefill_check.sh run from the files in OUT:
kernel checks, whole-model logits vs the reference, bench rows and the breakdown."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(out: str) -> int:
    rep = os.path.join(out, "prefill_report.jsonl")
    recs = [json.loads(line) for line in open(rep) if line.strip()] if os.path.exists(rep) else []
    by: dict[str, list] = {}
    for r in recs:
        by.setdefault(r["test"], []).append(r)
    for r in by.get("prefill_embed", []):
        print(f"embed {r['kind']}{' padded' if r['padded'] else ''}: {r['elements']} elements, mismatches {r['mismatches']}")
    for r in by.get("prefill_rmsnorm", []):
        print(f"rmsnorm+q8_1 K={r['K']} y={r['with_y']}: h max rel {r['h_max_rel']:.1e}, q/d/s mismatches "
              f"{r['q_mismatches']}/{r['d_mismatches']}/{r['s_mismatches']}")
    for r in by.get("prefill_rope", []):
        print(f"rope {r['rope_type']} hd={r['hd']} bias={r['bias']}: f16 mismatches {r['mismatches']}, "
              f"cache rows outside touched {r['outside_touched']}")
    for r in by.get("prefill_swiglu", []):
        print(f"swiglu+q8_1 fused={r['fused']}: excess over d/2 {r['excess_over_half_step']:.1e}, d rel {r['d_max_rel']:.1e}, "
              f"s mismatches {r.get('s_mismatches')}")
    for r in by.get("prefill_attention", []):
        print(f"attention hd={r['hd']} H={r['H']} KVH={r['KVH']} n={r['n']} start={r['start']} big={r['big']}: "
              f"max err / bound {r['max_err_over_bound']:.3f}, q8 excess {r['q8_excess']:.1e}, s mismatches {r.get('s_mismatches')}")
    for r in by.get("prefill_resident", []):
        print(f"resident {r['model']}: {r['resident_bytes']} B = {r['ratio']:.4f}x file, load {r['load_seconds']:.2f} s")
    rows = by.get("prefill_model", [])
    if rows:
        print("\n| case | positions | rel err | bound | top-1 agree | viol (margin>=0.5) | worst disagreeing margin | last margin | last agree |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['positions']} | {r['rel_err']:.2e} | {r['bound']:.1e} | {r['top1_agree']:.4f} | "
                  f"{r['viol_margin_ge_0_5']} | {r['worst_disagreeing_margin']:.2f} | {r['last_margin']:.2f} | {r['last_agree']} |")
    bj = os.path.join(out, "bench.json")
    if os.path.exists(bj) and os.path.getsize(bj):
        from engine.tools.bench import Breakdown, ModelInfo, Row, format_breakdown, format_rows

        try:
            d = json.load(open(bj))
        except ValueError:
            print("bench.json unreadable")
            return 1
        info = ModelInfo(d["model_filename"], d["model_type"], d["model_size"], d["model_n_params"])
        keys = Row.__dataclass_fields__.keys()
        rows = [Row(**{k: r[k] for k in keys}) for r in d["rows"]]
        print()
        print(format_rows(info, rows))
        for b in d["breakdown"]:
            print(format_breakdown(Breakdown(b["test"], b["total_ms"], b["plain_ms"], b["ops"], b["launches"])))
        rb = d.get("resident_bytes")
        if rb:
            print(f"\nresident weights {rb / 2**30:.3f} GiB = {rb / d['model_size']:.4f}x the tensor data "
                  f"({d['model_size'] / 2**30:.3f} GiB); load {d.get('load_seconds') or 0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu_out"))

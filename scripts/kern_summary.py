"""Kernel time of profiled steps from Nsight Compute's CSV (`ncu --csv --metrics
gpu__time_duration.sum --print-units base`: one row per kernel launch, ns), divided by the
number of steps: the kernels of one step, largest first, with a family roll-up.

    python3 scripts/kern_summary.py kern.csv STEPS [LABEL]
"""
import csv
import re
import sys

FAMILIES = ((r"wgmma_pair", "q4_K + q6_K GEMM"),
            (r"mmq_q4_k|mmsb_q4_k|mmvq_q4_k|wgmma_q4_k", "q4_K GEMM"),
            (r"mmq_q6_k|mmsb_q6_k|mmvq_q6_k|wgmma_q6_k", "q6_K GEMM"),
            (r"attn", "attention"),
            (r"split|reduce", "split reduce"), (r"rope", "rope"),
            (r"rmsnorm|gather", "norm"), (r"swiglu", "swiglu"), (r"embed", "embed"),
            (r"argmax|record_last|resolve_follow", "tokens"), (r"tile|x16", "f16 operand tiles"))


def family(name: str) -> str:
    for pat, fam in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def main() -> int:
    path, steps = sys.argv[1], int(sys.argv[2])
    label = sys.argv[3] if len(sys.argv) > 3 else ""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    per: dict[str, list[float]] = {}
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r.get("Kernel Name", "?")
        per.setdefault(name, []).append(float(r["Metric Value"].replace(",", "")) / 1e3 / steps)
    rows = sorted(((sum(v), len(v) / steps, k) for k, v in per.items()), reverse=True)
    fams: dict[str, float] = {}
    for t, _, n in rows:
        fams[family(n)] = fams.get(family(n), 0.0) + t
    tot = sum(t for t, _, _ in rows) or 1.0
    print(f"--- kernels per step {label}: {tot / 1e3:.3f} ms of kernel time, "
          f"{sum(n for _, n, _ in rows):.0f} launches")
    for fam, t in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"  {fam:14s} {t / 1e3:7.3f} ms {100 * t / tot:5.1f}%")
    for t, n, name in rows[:16]:
        print(f"  {t:8.1f} us x{n:4.0f}  {t / n:7.2f} us each  {name[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

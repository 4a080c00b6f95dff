"""The fastest verified variant per (kind, N x K, T) of a gemm_bench JSON, beside the production
choice (engine.gpu.ops.mmq.choose_variant) and its time: the table the small-batch tiers of
engine.gpu.registry.SMALL_BATCH_TIERS are read from.

    python -m dev.gemm_pick gemm_small.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def pick(rows: list[dict], choose=None) -> list[dict]:
    """One line per (kind, N, K, T): best = the verified row of least median ms; chosen = the
    row of `choose(kind, T, N)`'s variant, when it was measured."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["kind"], r["N"], r["K"], r["T"])].append(r)
    out = []
    for (kind, n, k, t), rs in sorted(groups.items()):
        ok = [r for r in rs if r["verified"]]
        best = min(ok, key=lambda r: r["mmq_ms"]) if ok else None
        chosen = None
        if choose is not None:
            want = choose(kind, t, n)
            chosen = next((r for r in rs if r["variant"] == want), None)
        out.append({"kind": kind, "N": n, "K": k, "T": t, "best": best, "chosen": chosen,
                    "unverified": len(rs) - len(ok)})
    return out


def fmt(line: dict) -> str:
    b, c = line["best"], line["chosen"]
    head = f"{line['kind']:5s} {line['N']:>5d}x{line['K']:<5d} {line['T']:>4d}"
    best = f"{b['variant']:24s} {b['mmq_ms'] * 1e3:8.1f} {b['weight_gbs']:6.0f}" if b else f"{'-':24s} {'':8s} {'':6s}"
    if c:
        chosen = f"{c['variant']:24s} {c['mmq_ms'] * 1e3:8.1f} {c['weight_gbs']:6.0f} {c['mmq_ms'] / b['mmq_ms']:5.2f}x"
    else:
        chosen = "(not measured)"
    bad = f"  UNVERIFIED {line['unverified']}" if line["unverified"] else ""
    return f"{head}  {best}   {chosen}{bad}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m dev.gemm_pick GEMM_BENCH.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        rows = json.load(f)
    try:
        from engine.gpu.ops.mmq import choose_variant
    except Exception:                   # noqa: BLE001 - the table is still useful without it
        choose_variant = None
    lines = pick(rows, choose_variant)
    print(f"{'kind':5s} {'N x K':>11s} {'T':>4s}  {'best variant':24s} {'us':>8s} {'GB/s':>6s}   "
          f"{'production choice':24s} {'us':>8s} {'GB/s':>6s} {'/best':>6s}")
    for line in lines:
        print(fmt(line))
    return 1 if any(line["unverified"] for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())

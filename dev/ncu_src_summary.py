"""Where a kernel's warps wait, per SASS instruction: a summary of an Nsight Compute source page
exported as CSV (scripts/gpu_check.sh step ncu with NCU_SOURCE=1 writes ncu_src_<i>.csv:
`ncu -i REP --page source --csv --print-source sass`).

    python -m dev.ncu_src_summary ncu_src_1.csv [--top 25]

Printed: the total stall samples; the instructions holding the most (address, share, SASS text,
and the largest per-reason columns when the export has them); the samples summed per opcode
(the SASS mnemonic without its modifiers); the per-reason totals. The export's columns are found
by name, not position: the instruction text in "Source", the samples in the first column whose
name starts with "Warp Stall Sampling (All" (else the first holding "Sampling"), and any other
numeric column naming a stall reason ("stall" in its name) as a reason. Lines before the header
(ncu's own messages) are skipped.
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import defaultdict


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text:
        return 0.0
    try:
        return float(text)
    except ValueError:
        return None


def read_rows(text: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the export; ValueError when no header with a Source column is found."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if '"Source"' in line or line.startswith("Source,") or ",Source," in line:
            reader = csv.reader(io.StringIO("\n".join(lines[i:])))
            header = next(reader)
            return header, [r for r in reader if len(r) == len(header)]
    raise ValueError("no header row with a 'Source' column (is this ncu --page source --csv output?)")


def columns(header: list[str]) -> tuple[int, int, list[int]]:
    """(source column, samples column, reason columns)."""
    src = header.index("Source")
    samples = next((i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All")), None)
    if samples is None:
        samples = next((i for i, h in enumerate(header) if "Sampling" in h), None)
    if samples is None:
        raise ValueError(f"no stall-sampling column among {header}")
    reasons = [i for i, h in enumerate(header) if i not in (src, samples) and "stall" in h.lower()
               and "Sampling" not in h]
    return src, samples, reasons


def opcode(sass: str) -> str:
    """The mnemonic of a SASS line without predicate and modifiers: '@!P0 HFMA2.MMA R1, ..' -> HFMA2."""
    words = sass.strip().split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return re.split(r"[.\s]", words[0])[0] if words else "?"


def summarize(text: str, top: int = 25) -> str:
    header, rows = read_rows(text)
    src, col, reasons = columns(header)
    insts = []
    for r in rows:
        n = _number(r[col])
        if n is None:
            continue
        per = {header[i]: v for i in reasons if (v := _number(r[i]))}
        insts.append((n, r[0] if src != 0 else "", r[src], per))
    total = sum(i[0] for i in insts)
    if not total:
        return f"{len(insts)} instructions, no stall samples"
    out = [f"{len(insts)} instructions, {total:,.0f} stall samples"]
    out.append(f"top {top} instructions (share of all samples):")
    for n, addr, sass, per in sorted(insts, key=lambda i: -i[0])[:top]:
        why = ", ".join(f"{k} {v / n:.0%}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:3])
        out.append(f"  {n / total:6.1%}  {addr:>8}  {sass.strip()[:70]}" + (f"  [{why}]" if why else ""))
    by_op: dict[str, float] = defaultdict(float)
    for n, _, sass, _ in insts:
        by_op[opcode(sass)] += n
    out.append("per opcode: " + "  ".join(f"{op} {n / total:.1%}"
                                          for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:16]))
    if reasons:
        sums = {header[i]: sum(_number(r[i]) or 0.0 for r in rows) for i in reasons}
        out.append("per reason: " + "  ".join(f"{k} {v / total:.1%}"
                                               for k, v in sorted(sums.items(), key=lambda kv: -kv[1]) if v))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    with open(a.csv, errors="replace") as f:
        text = f.read()
    try:
        print(summarize(text, a.top))
    except ValueError as e:
        print(f"ncu_src_summary: {a.csv}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

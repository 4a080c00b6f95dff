"""Per-op microbenchmark over the op table (engine/reference/op_table.py) and the test launchers
(tests/test_ops.py LAUNCH): for each row and shape case, build the inputs once, time the
launcher's run() with CUDA events (median of --reps after warm-up), print ms and the effective
GB/s of the bytes the op reads (the table's nbytes). No correctness checks here: that is
tests/test_ops.py.

    python -m dev.op_bench [--ops a,b] [--reps N] [--warmup N] [--json F]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from engine.reference import op_table


def time_run(cp, run, reps: int, warmup: int) -> float:
    """Median ms of `reps` launches of run(), each between two CUDA events, after `warmup`."""
    for _ in range(warmup):
        run()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(ts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="comma-separated op names (default: every table row)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="", help="write the results (a list of records) to this file")
    a = ap.parse_args(argv)

    import cupy as cp

    from tests.test_ops import LAUNCH

    names = [n for n in a.ops.split(",") if n] or list(op_table.OPS)
    unknown = [n for n in names if n not in op_table.OPS]
    if unknown:
        ap.error(f"unknown ops {unknown}; known: {', '.join(op_table.OPS)}")
    rows = []
    for name in names:
        op = op_table.OPS[name]
        for case in op.cases:
            inp = op.inputs(np.random.default_rng(11), **case)
            run, _ = LAUNCH[name](cp, inp, case)
            ms = time_run(cp, run, a.reps, a.warmup)
            nbytes = int(op.nbytes(inp, **case))
            rec = {"op": name, "case": case, "ms": ms, "bytes": nbytes, "gb_s": nbytes / (ms * 1e6)}
            rows.append(rec)
            print(f"{name:26s} {' '.join(f'{k}={v}' for k, v in case.items()):48s} "
                  f"{ms:9.4f} ms {rec['gb_s']:8.1f} GB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

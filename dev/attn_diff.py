"""Where two prefill attention variants differ (a debugging aid for a failing case): for one
shape, the largest |difference| of their float32 outputs per query tile of 64 and per head, and
the first differing (row, column)s.

    python -m dev.attn_diff --hd 64 --heads 2/2 --n 70 --start 61 [--variants fa2,wgmma]
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hd", type=int, default=64)
    ap.add_argument("--heads", default="2/2")
    ap.add_argument("--n", type=int, default=70)
    ap.add_argument("--start", type=int, default=61)
    ap.add_argument("--variants", default="fa2,wgmma")
    a = ap.parse_args(argv)
    import cupy as cp

    from engine.gpu.ops import attention as att

    H, KVH = (int(x) for x in a.heads.split("/"))
    rng = np.random.default_rng(1)
    L, hd, n = a.start + a.n, a.hd, a.n
    qh = cp.asarray((rng.standard_normal((H, n, hd)) * (np.log2(np.e) / np.sqrt(hd))).astype(np.float16))
    kc = cp.asarray(rng.standard_normal((KVH, L, hd)).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((KVH, L, hd)).astype(np.float16))
    outs = []
    for v in a.variants.split(","):
        o = cp.full((n, H * hd), np.nan, dtype=cp.float32)
        att.attention_prefill(qh, kc, vc, a.start, out_f32=o, variant=v)
        outs.append(cp.asnumpy(o).reshape(n, H, hd))
    d = np.abs(outs[0] - outs[1])
    d[np.isnan(d)] = np.inf
    for h in range(H):
        print(f"head {h}: " + " ".join(f"rows {t}..{min(t + 63, n - 1)} max {d[t:t + 64, h].max():.3g}"
                                        for t in range(0, n, 64)))
    bad = np.argwhere(d > 1e-3)
    print(f"{len(bad)} of {d.size} differ by > 1e-3; first: {bad[:12].tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

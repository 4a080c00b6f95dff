"""Each kernel's share of a captured graph as it runs (kernels_cu/common.cuh KERNEL_TIMELINE): the
prompt forward's graph (`bench -p T`) or the single-stream decode step's (`bench -n`), replayed
back to back, timed on the device with the launches' PDL overlap in place.

    python -m dev.graph_timeline MODEL.gguf [--mode pp|tg] [--tokens 32] [--depth 256] [--replays 20] [--json OUT]

The build is the define set KERNEL_TIMELINE=1 (added to GGUF_PREFILL_KERNEL_DEFINES for this
process): block (0, 0, 0) of every kernel of ours stamps %globaltimer once its PDL wait returns,
i.e. once its predecessor has completed. In a chain the i-th stamp of a replay is the i-th
launch's start, so start[i + 1] - start[i] is launch i's share of the graph: its own time on the
critical path, whatever part of its start the PDL overlap hid. Summed over a replay the shares
are the graph's time (the last launch's share runs to the next replay's first stamp, so it also
holds the gap between two graph launches). CuPy's own kernels (copies, fills) do not stamp:
their time falls into the share of the launch before them. ncu's per-kernel durations
(dev/step_profile) are serialized and carry a launch floor of about 2 us each, which is why the
decode step's kernels sum to 2.50 ms under ncu where the graph takes 2.09 (docs/perf-log.md
Session 28 Run 3).

Stamps are matched to the launches that capture_graph recorded (engine.gpu.launch
captured_launches) by order and checked by their grid / block signature.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import numpy as np


def signature(grid, block) -> int:
    """common.cuh kernel_tl_stamp's launch signature of a (grid, block)."""
    gx, gy, gz = grid
    return (gx & 0xFFFFF) | (gy & 0xFFF) << 20 | (gz & 0xFF) << 32 | (block[0] & 0x7FF) << 40


def shares(stamps: np.ndarray, launches, replays: int) -> dict:
    """stamps: uint64 [n, 2] (ns, signature) of `replays` back-to-back replays of a graph whose
    launches are `launches` [(name, grid, block)]. Per launch position its share (us, median over
    the replays), the replay's time (median of first stamp to first stamp), and the shares summed
    by kernel name."""
    L = len(launches)
    stamps = np.asarray(stamps, dtype=np.uint64).reshape(-1, 2)
    if L == 0 or replays < 2:
        raise ValueError("graph_timeline: need the graph's launches and at least 2 replays")
    if len(stamps) != replays * L:
        raise ValueError(f"graph_timeline: {len(stamps)} stamps for {replays} replays of {L} launches "
                         f"(a kernel that does not stamp, or launches outside the graph?)")
    want = np.array([signature(g, b) for _, g, b in launches] * replays, dtype=np.uint64)
    bad = np.nonzero(stamps[:, 1] != want)[0]
    if bad.size:
        i = int(bad[0]) % L
        raise ValueError(f"graph_timeline: stamp {int(bad[0])} (launch {i}, {launches[i][0]} grid {launches[i][1]} "
                         f"block {launches[i][2]}) has another launch's signature")
    t = stamps[:, 0].astype(np.int64)
    share = np.diff(t).astype(np.float64) / 1e3                       # us; launch j's: t[j + 1] - t[j]
    per_pos = np.full((replays, L), np.nan)
    per_pos.ravel()[:-1] = share
    pos_us = np.nanmedian(per_pos, axis=0)
    step_us = float(np.median(np.diff(t.reshape(replays, L)[:, 0]))) / 1e3
    by_name: dict[str, dict] = defaultdict(lambda: {"launches": 0, "us": 0.0})
    for (name, _, _), us in zip(launches, pos_us):
        by_name[name]["launches"] += 1
        by_name[name]["us"] += float(us)
    kernels = sorted(({"name": k, **v, "us_each": v["us"] / v["launches"]} for k, v in by_name.items()),
                     key=lambda r: -r["us"])
    return {"launches": L, "replays": replays, "step_us": step_us, "sum_us": float(np.sum(pos_us)),
            "positions": [{"i": i, "name": n, "grid": list(g), "us": float(u)}
                          for i, ((n, g, _), u) in enumerate(zip(launches, pos_us))],
            "kernels": kernels}


def format_shares(label: str, s: dict, top: int = 25) -> str:
    lines = [f"{label}: {s['launches']} launches, {s['step_us']:.1f} us a replay (median of {s['replays'] - 1}), "
             f"shares sum {s['sum_us']:.1f} us",
             f"  {'kernel':<44s} {'n':>4s} {'us each':>8s} {'us':>8s} {'share':>6s}"]
    for r in s["kernels"][:top]:
        lines.append(f"  {r['name'][:44]:<44s} {r['launches']:4d} {r['us_each']:8.2f} {r['us']:8.1f} "
                     f"{r['us'] / s['step_us']:6.1%}")
    return "\n".join(lines)


def record(replay, n: int, sync) -> np.ndarray:
    """The stamps of n calls of replay() (the device idle before and after)."""
    from engine.gpu import kernels

    sync()
    buf = kernels.timeline_buffer()
    buf[0] = 0
    sync()
    for _ in range(n):
        replay()
    sync()
    count = int(buf[0].get())
    if count > kernels.TIMELINE_CAP:
        raise SystemExit(f"{count} stamps: the buffer holds {kernels.TIMELINE_CAP}; fewer replays")
    return buf[1:1 + 2 * count].get().reshape(count, 2)


def run(path: str, mode: str, tokens: int, depth: int, replays: int, seed: int = 0) -> dict:
    from engine.gpu import kernels

    defs = os.environ.get(kernels.DEFINES_ENV, "")
    if "KERNEL_TIMELINE" not in defs:
        os.environ[kernels.DEFINES_ENV] = (defs + ",KERNEL_TIMELINE=1").strip(",")
    import cupy as cp

    from engine.gpu import launch
    from engine.loader import load_model

    model = load_model(path, device="gpu")
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    sync = cp.cuda.runtime.deviceSynchronize
    if mode == "pp":
        from engine.gpu.prefill_graph import cache_graph

        ids = rng.integers(0, V, tokens).tolist()
        cache = model.new_cache(tokens)
        for _ in range(2):                             # kernels loaded, the prefill graph recorded
            cache.length = 0
            model.forward_device(ids, cache)
        launches = list(launch.captured_launches)
        pg = cache_graph(model, cache, tokens)
        if pg.graph is None or pg.T != tokens:
            raise SystemExit(f"no prefill graph of {tokens} tokens (graphs serve up to 128 tokens)")
        stream = cp.cuda.get_current_stream()
        stamps = record(lambda: pg.graph.launch(stream), replays, sync)
        label = f"pp{tokens} graph"
    else:
        from engine.gpu.decode import DecodeStep

        cache = model.new_cache(depth + replays + 8)
        if depth:
            model.forward_device(rng.integers(0, V, depth).tolist(), cache)
        step = DecodeStep(model, cache)
        step.chain(1, depth, 2)                        # kernels loaded, the step's graph recorded
        launches = list(launch.captured_launches)
        with step.stream:
            step.set_state(1, depth)
        stamps = record(lambda: step.graph.launch(step.stream), replays, sync)
        label = f"decode step at depth {depth}"
    return {"mode": mode, "label": label, **shares(stamps, launches, replays)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--mode", choices=("pp", "tg"), default="tg")
    ap.add_argument("--tokens", type=int, default=32, help="pp: the prompt (a graph size: a power of two <= 128)")
    ap.add_argument("--depth", type=int, default=256, help="tg: tokens of context before the steps")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    s = run(a.model, a.mode, a.tokens, a.depth, a.replays)
    print(format_shares(s["label"], s, a.top))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prompt ubatch sizes side by side on one loaded model (issue 14's pp8192 / pp3314): for each
round, for each ubatch size U, the `bench` pp rows with GPUModel.ubatch = U (a prompt of n tokens
runs in ubatches of at most U), so every size runs in one process, on the same weights,
interleaved in time.

    python -m dev.ubatch_bench --model M -u 4096,3584,3072 -p 3314,8192 [-r 3] [--rounds 3]

Printed per size: the median tok/s of every pp row over all rounds' repetitions, its ratio to the
first size's, and the last-over-first pp quotient.
"""
from __future__ import annotations

import argparse
import statistics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("-u", default="4096,3584", help="ubatch sizes (the first is the baseline)")
    ap.add_argument("-p", default="3314,8192", help="prompt lengths")
    ap.add_argument("-r", type=int, default=3, help="repetitions per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)

    from engine.loader import load_model
    from engine.tools.bench import bench_pp, parse_int_list

    sizes = parse_int_list(a.u, "-u")
    prompts = parse_int_list(a.p, "-p")
    model = load_model(a.model, device="gpu", progress=False)
    samples: dict[tuple[int, int], list[float]] = {}
    for rnd in range(a.rounds):
        for u in sizes:
            model.ubatch = u
            for p in prompts:
                samples.setdefault((u, p), []).extend(bench_pp(model, p, 0, a.r).samples_ts)
        print(f"round {rnd + 1} done", flush=True)
    print(f"--- {a.model}\n| ubatch | " + " | ".join(f"pp{p}" for p in prompts) + " | last / first |")
    print("|---" * (len(prompts) + 2) + "|")
    base = {p: statistics.median(samples[(sizes[0], p)]) for p in prompts}
    for u in sizes:
        med = {p: statistics.median(samples[(u, p)]) for p in prompts}
        cells = [f"{med[p]:,.0f} ({med[p] / base[p]:.3f})" for p in prompts]
        print(f"| {u} | " + " | ".join(cells) + f" | {med[prompts[-1]] / med[prompts[0]]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

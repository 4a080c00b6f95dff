"""Kernel define sets side by side on one loaded model (issue 14's ratio, issue 12's rows): for
each round, for each set of GGUF_PREFILL_KERNEL_DEFINES, the `bench` rows (engine.tools.bench:
bench_pp after one warm-up, bench_tg), so every set runs in the same process, on the same
weights, interleaved in time (clock and thermal drift fall on all sets alike) and the model
loads once (a 7B synth takes ~15 s to load, a define set's kernels ~5 s to compile).

    python -m dev.ab_bench --model M[,M2,..] --sets ";AW_PROD=1;AW_PROD=1,AW_MHA_GROUP=4" -p 3314,8192 \
        [-n 128] [-r 3] [--rounds 2] [--json F]

--sets: ';'-separated define sets, "" (an empty entry) = no defines; the first is the baseline.
Entries of HOST_ENTRIES in a set are not defines but GPUModel attributes for that set's rows:
UBATCH=N the prompt ubatch (tokens per forward, engine.gpu.ubatch_plan), ATTN_X16=1 the attention
writing the Wo GEMM's tiled f16 operand itself (GGUF_PREFILL_ATTN_X16). PP=a:b (':'-separated
prompt lengths) limits a set to those pp rows and no tg rows, for a form that cannot change the
others; e.g. --sets ";UBATCH=8192,PP=8192"; TG=1 limits it to the tg rows (a decode-only form,
e.g. ";MMVQ_UNROLL=4,TG=1"). A set's missing rows get no ratio and no quotient.
`--keep-tested FILE --sets S` prints the sets that the GPU test groups of FILE leave (kept_sets).
Several models (comma-separated) run one after the other in this process (the Hopper GEMMs'
kernels compile once).
Printed per set and test: the median tok/s over every round's repetitions, its ratio to the
baseline's, and with two or more -p values each set's quotient of its last two pp rows (issue 14's
pp8192 / pp3314). The kernels module keeps one build per define set, and each row makes its own
cache (so no CUDA graph of one set is replayed under another).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

from engine.gpu.kernels import DEFINES_ENV as ENV, parse_defines


def summarize(samples: dict[str, dict[str, list[float]]], sets: list[str], tests: list[str],
              pp_tests: list[str]) -> list[dict]:
    """Rows {set, test, median, ratio} from samples[set][test] = tok/s values; ratio = this
    set's median over the first set's; with two or more pp tests, a row test="<last>/<one
    before>" per set holding the quotient of their medians (-p 32,..,3314,8192: pp8192 / pp3314)."""
    rows = []
    for s in sets:
        med = {t: statistics.median(samples[s][t]) for t in tests if samples[s].get(t)}
        for t in tests:
            if t not in med:
                continue
            base = statistics.median(samples[sets[0]][t]) if samples[sets[0]].get(t) else None
            rows.append(dict(set=s, test=t, median=med[t], ratio=None if base is None else med[t] / base,
                             n=len(samples[s][t])))
        if len(pp_tests) >= 2 and pp_tests[-1] in med and pp_tests[-2] in med:
            rows.append(dict(set=s, test=f"{pp_tests[-1]}/{pp_tests[-2]}", median=med[pp_tests[-1]] / med[pp_tests[-2]],
                             ratio=None, n=None))
    return rows


def format_rows(rows: list[dict]) -> str:
    out = [f"| defines | test | tok/s median | vs first |", "|---|---|---|---|"]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        value = f"{r['median']:.3f}" if "/" in r["test"] else f"{r['median']:,.1f}"
        out.append(f"| {r['set'] or '(none)'} | {r['test']} | {value} | {ratio} |")
    return "\n".join(out)


def kept_sets(sets: list[str], groups: list[tuple[bool, str]]) -> tuple[list[str], list[str]]:
    """(kept, dropped) define sets after the GPU test groups `groups` = [(passed, their defines)]:
    a set is dropped when a failed group ran every define of it and no passed group did (so a form
    whose tests hung or failed is not timed, where a hang would take every set's rows with it).
    The first set (the baseline) is always kept."""
    kept, dropped = [], []
    for i, s in enumerate(sets):
        mine = set(parse_defines(host_entries(s)[0]))     # the set's kernel defines (not UBATCH, PP, ..)
        covering = [ok for ok, g in groups if mine <= set(parse_defines(g))]
        if i > 0 and mine and covering and not any(covering):
            dropped.append(s)
        else:
            kept.append(s)
    return kept, dropped


def read_groups(path: str) -> list[tuple[bool, str]]:
    """Lines "pass DEFINES" / "fail DEFINES" (scripts/gpu_check.sh step tests)."""
    out = []
    with open(path) as f:
        for line in f:
            word, _, rest = line.strip().partition(" ")
            if word in ("pass", "fail"):
                out.append((word == "pass", rest.strip()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep-tested", default="", metavar="FILE",
                    help="print the --sets that the test groups of FILE leave (kept_sets) and exit")
    ap.add_argument("--model", default="", help="GGUF file(s), comma-separated")
    ap.add_argument("--sets", required=True, help="';'-separated define sets (first = baseline)")
    ap.add_argument("-p", default="3314,8192", help="prompt lengths")
    ap.add_argument("-n", default="0", help="generated lengths (tg rows)")
    ap.add_argument("-r", type=int, default=3, help="repetitions per row and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    sets = [s.strip() for s in a.sets.split(";")]
    if a.keep_tested:
        kept, dropped = kept_sets(sets, read_groups(a.keep_tested))
        for s in dropped:
            print(f"dropped (its GPU tests failed): {s}", file=sys.stderr)
        print(";".join(kept))
        return 0
    if not a.model:
        ap.error("--model is required")

    from engine.loader import load_model
    from engine.tools.bench import bench_pp, bench_tg, parse_int_list

    for s in sets:                                     # malformed entries fail before the load
        parse_defines(host_entries(s)[0])
    prompts = [p for p in parse_int_list(a.p, "-p") if p > 0]
    gens = [n for n in parse_int_list(a.n, "-n") if n > 0]
    results = {}
    for path in a.model.split(","):
        model = load_model(path, device="gpu", progress=False)
        samples, tests = run_sets(model, sets, prompts, gens, a.r, a.rounds, bench_pp, bench_tg)
        del model
        out = summarize(samples, sets, tests, [f"pp{p}" for p in prompts])
        print(f"--- {path}\n" + format_rows(out), flush=True)
        results[path] = dict(samples=samples, rows=out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(sets=sets, models=results), f, indent=1)
    return 0


# set entry -> (GPUModel attribute, its value from the entry's text)
HOST_ENTRIES = {"UBATCH": ("ubatch", int), "ATTN_X16": ("attn_x16", lambda v: v == "1")}


def host_entries(s: str) -> tuple[str, dict]:
    """A set -> (its kernel defines, {GPUModel attribute: value} of its HOST_ENTRIES; its PP=a:b
    entry, if any, as attrs["pp"] = [a, b]; TG=1 as attrs["pp"] = [] (no pp rows, the tg rows))."""
    defines, attrs = [], {}
    for item in re.split(r"[\s,]+", s.strip()):
        key, _, value = item.partition("=")
        if key == "PP":
            if not re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)*", value):
                raise ValueError(f"PP={value!r}: prompt lengths >= 1 separated by ':'")
            attrs["pp"] = [int(v) for v in value.split(":")]
        elif key == "TG":
            if value != "1":
                raise ValueError(f"TG={value!r}: TG=1 (the tg rows alone)")
            attrs["pp"] = []
        elif key in HOST_ENTRIES:
            if key == "UBATCH" and (not value.isdigit() or int(value) < 1):
                raise ValueError(f"UBATCH={value!r}: a token count >= 1")
            attr, parse = HOST_ENTRIES[key]
            attrs[attr] = parse(value)
        elif item:
            defines.append(item)
    return ",".join(defines), attrs


def run_sets(model, sets, prompts, gens, reps, rounds, bench_pp, bench_tg):
    """samples[set][test] (tok/s of every repetition of every round) and the tests in order."""
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in sets}
    tests: list[str] = []
    saved = os.environ.get(ENV)
    saved_attrs = {attr: getattr(model, attr) for attr, _ in HOST_ENTRIES.values() if hasattr(model, attr)}
    try:
        for rnd in range(rounds):
            for s in sets:
                defines, attrs = host_entries(s)
                only_pp = attrs.pop("pp", None)
                os.environ[ENV] = defines
                for attr, value in {**saved_attrs, **attrs}.items():
                    setattr(model, attr, value)
                rows = ([bench_pp(model, p, 0, reps) for p in (prompts if only_pp is None else only_pp)] +
                        [bench_tg(model, n, 0, reps) for n in (gens if not only_pp else [])])   # None or TG=1's []
                for row in rows:
                    samples[s].setdefault(row.test, []).extend(row.samples_ts)
                    if row.test not in tests:
                        tests.append(row.test)
                print(f"round {rnd + 1} [{s or '(none)'}]: " +
                      ", ".join(f"{r.test} {r.median:,.1f}" for r in rows), flush=True)
    finally:
        for attr, value in saved_attrs.items():
            setattr(model, attr, value)
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
    return samples, tests


if __name__ == "__main__":
    raise SystemExit(main())

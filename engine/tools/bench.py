"""`gguf-prefill bench`: llama-bench style throughput rows, and a per-op prefill breakdown.

    gguf-prefill bench --model M -p 512,3314 [-n 0] [-d 0] [-r 5] [--json] [--breakdown] [--device gpu]

Rows (one per test): model, size (GiB of tensor data), params, backend, test (pp<N>, tg<N>,
"@ d<D>" with a depth), tok/s as mean ± sample standard deviation over the repetitions, and the
median. A pp test processes N random token ids (fixed seed) after D tokens of context from an
empty cache; one warm-up repetition runs first and is excluded. On the GPU each repetition is
timed with CUDA events around the forward (logits of the last token left on the device); on the
CPU with the host clock.

--breakdown (GPU): one more, instrumented, run of each pp test with a CUDA event pair around
every launch; the time is summed per op kind (ms and % of the instrumented forward) and rolled
up into q4_K GEMMs, q6_K GEMMs, attention, norms/rope/rest, activation producers. The
rmsnorm and SwiGLU kernels write their own output as q8_1 or tiled f16 (fused), so "activation
producers" is those fused kernels plus tile_x16; attention's q8_1 output is inside "attention".
tg rows (-n, GPU): engine.gpu.decode.bench_decode, back-to-back replays of the decode graph of
one session sized depth + n + 1, timed with CUDA events (only token ids come back).

Arguments are checked before the model loads (a CPU run asking for -n or --breakdown fails at
once); the load time printed is the wall time of loading the backend.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from engine.errors import UsageError

FILE_TYPES = {0: "F32", 1: "F16", 7: "Q8_0", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K"}

# op kind (engine.gpu.model spans) -> issue category
PAIR = "q4_K + q6_K GEMMs in one launch (wgmma_pair)"
ACTIVATIONS = "activation producers (rmsnorm / swiglu fused with q8_1 or f16; tile_x16)"
CATEGORIES = {
    "gemm_q4_k": "q4_K GEMMs",
    "gemm_q6_k": "q6_K GEMMs",
    "gemm_q4_k+q6_k": PAIR,
    "gemm_q4_k_swiglu": "q4_K GEMMs",         # the gate|up GEMM with SwiGLU fused
    "gemm_q4_k_rope": "q4_K GEMMs",           # the q|k|v GEMMs with bias + RoPE fused (T <= 32)
    "gemm_q4_k+q6_k_rope": PAIR,
    "gemm_output_q6_k": "q6_K GEMMs",
    "gemm_output_q4_k": "q4_K GEMMs",
    "attention": "attention",
    "rmsnorm_q8": ACTIVATIONS,
    "swiglu_q8": ACTIVATIONS,
    "rmsnorm_x16": ACTIVATIONS,
    "swiglu_x16": ACTIVATIONS,
    "tile_x16": ACTIVATIONS,
    "rope_kv": "norms/rope/rest",
    "embed": "norms/rope/rest",
}
CATEGORY_ORDER = ("q4_K GEMMs", "q6_K GEMMs", PAIR, "attention", "norms/rope/rest",
                  ACTIVATIONS, "unattributed (gaps between launches)")


@dataclass
class ModelInfo:
    path: str
    label: str
    size_bytes: int
    n_params: int

    @property
    def size_str(self) -> str:
        if self.size_bytes >= 2**30:
            return f"{self.size_bytes / 2**30:.2f} GiB"
        return f"{self.size_bytes / 2**20:.2f} MiB"

    @property
    def params_str(self) -> str:
        if self.n_params >= 1e9:
            return f"{self.n_params / 1e9:.2f} B"
        return f"{self.n_params / 1e6:.2f} M"


@dataclass
class Row:
    test: str
    n_prompt: int
    n_gen: int
    n_depth: int
    samples_ts: list[float]
    samples_ms: list[float]
    backend: str
    ubatch: int | None = None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ts)


@dataclass
class Breakdown:
    test: str
    total_ms: float                      # instrumented forward, first to last event
    plain_ms: float                      # the same test's median time without instrumentation
    ops: dict[str, float] = field(default_factory=dict)        # kind -> ms
    launches: dict[str, int] = field(default_factory=dict)     # kind -> count

    def categories(self) -> dict[str, float]:
        out = {c: 0.0 for c in CATEGORY_ORDER}
        for k, ms in self.ops.items():
            out[CATEGORIES.get(k, "norms/rope/rest")] += ms
        out["unattributed (gaps between launches)"] = max(0.0, self.total_ms - sum(self.ops.values()))
        return out


# ----------------------------------------------------------------------------- parsing

def parse_int_list(text: str, what: str, minimum: int = 0) -> list[int]:
    try:
        vals = [int(v) for v in str(text).replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise UsageError(f"{what}: no values given")
    bad = [v for v in vals if v < minimum]
    if bad:
        raise UsageError(f"{what}: {bad[0]} is below {minimum}")
    return vals


def model_info(path: str) -> ModelInfo:
    from engine.formats.gguf_file import open_gguf
    from engine.formats.metadata import Metadata

    gf = open_gguf(path)
    size = sum(t.n_bytes for t in gf.tensors.values())
    params = sum(int(np.prod(t.shape)) for t in gf.tensors.values())
    md = Metadata(gf.metadata, str(path))
    arch = md.string("general.architecture", default="?")
    ft = md.integer("general.file_type", default=None)
    ftype = FILE_TYPES.get(ft, f"ftype {ft}") if ft is not None else "?"
    scale = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return ModelInfo(path, f"{arch} {scale} {ftype}", size, params)


# ----------------------------------------------------------------------------- timing

class _Clock:
    """CUDA events on a GPU backend, the host clock otherwise; ms()."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        if gpu:
            import cupy

            self.cp = cupy

    def start(self):
        if self.gpu:
            self.a = self.cp.cuda.Event()
            self.b = self.cp.cuda.Event()
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.gpu:
            self.b.record()
            self.b.synchronize()
            return float(self.cp.cuda.get_elapsed_time(self.a, self.b))
        return (time.perf_counter() - self.t0) * 1e3


def _run_prompt(model, ids, cache):
    if getattr(model, "device", "cpu") == "gpu":
        return model.forward_device(ids, cache)
    return model.forward(ids, cache)


def _prompt_after_depth(model, n_prompt: int, depth: int, seed: int):
    """Random ids for depth + n_prompt tokens and a cache holding the first `depth` of them."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.config.vocab_size, depth + n_prompt).tolist()
    cache = model.new_cache(depth + n_prompt)
    if depth:
        model.forward(ids[:depth], cache)
    return ids, cache


def bench_pp(model, n_prompt: int, depth: int = 0, reps: int = 5, seed: int = 0) -> Row:
    """pp row: `reps` timed prefills of n_prompt random ids after `depth` tokens (one warm-up)."""
    gpu = getattr(model, "device", "cpu") == "gpu"
    ids, cache = _prompt_after_depth(model, n_prompt, depth, seed)
    clock = _Clock(gpu)
    ms = []
    for r in range(reps + 1):
        cache.length = depth
        clock.start()
        _run_prompt(model, ids[depth:], cache)
        t = clock.stop()
        if r:
            ms.append(t)
    test = f"pp{n_prompt}" + (f" @ d{depth}" if depth else "")
    return Row(test, n_prompt, 0, depth, [n_prompt / (t / 1e3) for t in ms], ms,
               _backend(model), getattr(model, "ubatch", None))


def bench_tg(model, n_gen: int, depth: int = 0, reps: int = 5) -> Row:
    if getattr(model, "device", "cpu") != "gpu":
        raise UsageError("tg rows (-n) need the GPU decode path (--device gpu)")
    from engine.gpu.decode import bench_decode

    ts = [float(v) for v in bench_decode(model, n_gen=n_gen, depth=depth, reps=reps)]
    test = f"tg{n_gen}" + (f" @ d{depth}" if depth else "")
    return Row(test, 0, n_gen, depth, ts, [n_gen / t * 1e3 for t in ts], _backend(model))


def breakdown_pp(model, n_prompt: int, depth: int = 0, plain_ms: float = 0.0, seed: int = 0) -> Breakdown:
    """One instrumented prefill (after the timed ones): per-op-kind CUDA event totals."""
    from engine.gpu.profiler import OpTimer

    ids, cache = _prompt_after_depth(model, n_prompt, depth, seed)
    clock = _Clock(True)
    timer = OpTimer()
    model.profile(timer)
    try:
        clock.start()
        model.forward_device(ids[depth:], cache)
        total = clock.stop()
    finally:
        model.profile(None)
    test = f"pp{n_prompt}" + (f" @ d{depth}" if depth else "")
    return Breakdown(test, total, plain_ms, timer.totals_ms(), timer.counts())


def _backend(model) -> str:
    return "CUDA (CuPy/NVRTC)" if getattr(model, "device", "cpu") == "gpu" else "CPU (numpy)"


# ----------------------------------------------------------------------------- output

def format_rows(info: ModelInfo, rows: list[Row]) -> str:
    head = ["model", "size", "params", "backend", "ubatch", "test", "t/s", "median t/s"]
    body = [[info.label, info.size_str, info.params_str, r.backend, str(r.ubatch or "-"), r.test,
             f"{r.mean:.2f} ± {r.sd:.2f}", f"{r.median:.2f}"] for r in rows]
    return _table(head, body, right={"size", "params", "ubatch", "test", "t/s", "median t/s"})


def format_breakdown(b: Breakdown) -> str:
    lines = [f"\nbreakdown {b.test}: one instrumented forward {b.total_ms:.2f} ms "
             f"(uninstrumented median {b.plain_ms:.2f} ms); CUDA events around every launch"]
    tot = b.total_ms or 1.0
    body = [[k, str(b.launches.get(k, 0)), f"{ms:.2f}", f"{100 * ms / tot:.1f}"]
            for k, ms in sorted(b.ops.items(), key=lambda kv: -kv[1])]
    lines.append(_table(["op kind", "launches", "ms", "%"], body, right={"launches", "ms", "%"}))
    body = [[c, f"{ms:.2f}", f"{100 * ms / tot:.1f}"] for c, ms in b.categories().items()]
    lines.append("")
    lines.append(_table(["category", "ms", "%"], body, right={"ms", "%"}))
    return "\n".join(lines)


def _table(head: list[str], body: list[list[str]], right: set[str]) -> str:
    w = [max(len(head[i]), *(len(r[i]) for r in body)) if body else len(head[i]) for i in range(len(head))]

    def line(cells):
        return "| " + " | ".join(c.rjust(w[i]) if head[i] in right else c.ljust(w[i])
                                 for i, c in enumerate(cells)) + " |"

    sep = "| " + " | ".join(("-" * (w[i] - 1) + ":") if head[i] in right else "-" * w[i]
                            for i in range(len(head))) + " |"
    return "\n".join([line(head), sep] + [line(r) for r in body])


def to_json(info: ModelInfo, rows: list[Row], breakdowns: list[Breakdown], extra: dict) -> str:
    out = {"model_filename": info.path, "model_type": info.label, "model_size": info.size_bytes,
           "model_n_params": info.n_params, **extra, "rows": [], "breakdown": []}
    for r in rows:
        d = asdict(r)
        d.update(avg_ts=r.mean, stddev_ts=r.sd, median_ts=r.median)
        out["rows"].append(d)
    for b in breakdowns:
        d = asdict(b)
        d["categories"] = b.categories()
        out["breakdown"].append(d)
    return json.dumps(out, indent=1)


# ----------------------------------------------------------------------------- main

def _will_use_gpu(device: str) -> bool:
    """Whether load_model(path, device) picks the GPU backend (engine.loader's rule)."""
    if device == "gpu":
        return True
    if device == "cpu":
        return False
    from engine.loader import gpu_available

    return gpu_available()


def main(args) -> int:
    if getattr(args, "batched", None):
        return main_batched(args)
    from engine.tools.fetch import resolve_model
    from engine.loader import load_model

    prompts = [p for p in parse_int_list(args.p, "-p") if p > 0]
    gens = [n for n in parse_int_list(args.n, "-n") if n > 0]
    depths = parse_int_list(args.d, "-d")
    if args.r < 1:
        raise UsageError(f"-r must be >= 1, got {args.r}")
    if not prompts and not gens:
        raise UsageError("nothing to run: give -p and/or -n with a value > 0")
    device = getattr(args, "device", "auto") or "auto"
    if (args.breakdown or gens) and not _will_use_gpu(device):
        what = "--breakdown needs the GPU backend (CUDA events around every launch)" if args.breakdown \
            else "tg rows (-n) need the GPU decode path (--device gpu)"
        raise UsageError(what + ("" if device == "cpu" else "; no GPU found"))
    path = resolve_model(args.model)
    info = model_info(path)
    t0 = time.perf_counter()
    model = load_model(path, device=device, progress=True)
    load_s = time.perf_counter() - t0
    rows: list[Row] = []
    breakdowns: list[Breakdown] = []
    for d in depths:
        for p in prompts:
            row = bench_pp(model, p, d, args.r)
            rows.append(row)
            print(f"{row.test}: {row.mean:.2f} ± {row.sd:.2f} tok/s", file=sys.stderr, flush=True)
            if args.breakdown:
                breakdowns.append(breakdown_pp(model, p, d, plain_ms=statistics.median(row.samples_ms)))
        for n in gens:
            rows.append(bench_tg(model, n, d, args.r))
    extra = {"backend": _backend(model), "reps": args.r,
             "load_seconds": load_s,
             "resident_bytes": getattr(model, "resident_bytes", None)}
    if args.json:
        print(to_json(info, rows, breakdowns, extra))
    else:
        print(format_rows(info, rows))
        for b in breakdowns:
            print(format_breakdown(b))
        rb = extra["resident_bytes"]
        if rb:
            print(f"\nresident weights {rb / 2**30:.3f} GiB = {rb / info.size_bytes:.3f}x the file's "
                  f"tensor data ({info.size_str}); load {extra['load_seconds']:.2f} s")
    return 0


def main_batched(args) -> int:
    """--batched NPL,...: engine.tools.bench_batched rows (and a decode-step breakdown)."""
    from engine.loader import load_model
    from engine.tools import bench_batched as bb
    from engine.tools.fetch import resolve_model

    npls = parse_int_list(args.batched, "--batched", minimum=1)
    for name in ("npp", "ntg", "max_batch_tokens", "r"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = getattr(args, "device", "auto") or "auto"
    if args.breakdown and not _will_use_gpu(device):
        raise UsageError("--breakdown needs the GPU backend (CUDA events around every launch)"
                         + ("" if device == "cpu" else "; no GPU found"))
    path = resolve_model(args.model)
    info = model_info(path)
    model = load_model(path, device=device, progress=True)
    rows, breakdowns = [], []
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.overlap]
    for npl in npls:
        npl_rows = [bb.bench_batched(model, npl, args.npp, args.ntg, args.r, args.max_batch_tokens, overlap=o)
                    for o in modes]
        for row in npl_rows:
            print(f"{row.test}: S_TG {row.s_tg:.1f} tok/s, S {row.s_total:.1f} tok/s", file=sys.stderr, flush=True)
        rows += npl_rows
        if args.breakdown:            # beside the first mode's uninstrumented step time
            total, ops, counts = bb.breakdown_batched(model, npl, args.npp)
            wall, _ = npl_rows[0].step_ms()
            breakdowns.append(Breakdown(f"decode step x{npl} @ d{args.npp}", total, wall, ops, counts))
    if args.json:
        out = {"model_filename": info.path, "model_type": info.label, "backend": _backend(model),
               "reps": args.r, "batched": [bb.batched_json(r) for r in rows],
               "breakdown": [dict(asdict(b), categories=b.categories()) for b in breakdowns]}
        print(json.dumps(out, indent=1))
    else:
        print(f"{info.label}, {_backend(model)}, max batch tokens {args.max_batch_tokens}, medians of {args.r}")
        print(bb.format_batched(rows))
        for b in breakdowns:
            print(format_breakdown(b))
    return 0

"""`gguf-prefill bench --batched 1,8,32`: many sequences at once through the continuous-batching
scheduler (engine.scheduler), with no HTTP in between: llama-batched-bench's rows.

For each npl: npl sequences of --npp random prompt ids (fixed seed), each generating --ntg
tokens greedily (no end-of-generation token), added together to a Scheduler over
model.batch(npl, npp + ntg) with --max-batch-tokens; one warm-up round of the same shape runs
first and is excluded. Per npl, medians over the -r repetitions:

    PP s     wall until every sequence has its first token; S_PP = npl * npp / PP s
    TG s     the rest (decode-only steps: every sequence's next token); S_TG = npl * (ntg - 1) / TG s
    S        npl * ntg / (PP s + TG s): the load script's aggregate generated tok/s without HTTP
    step     medians over decode-only steps: wall ms (one Scheduler.step: plan, launch, collect,
             delivery) and device ms (CUDA events around the step's kernels; GPU only), and
             their difference, the host time the device waits for

--overlap both: each npl with the overlapped scheduler and without it (collect before the
next plan), same call, same prompts.

S_TG counts ntg - 1 tokens: each sequence's first token comes out of its last prefill step, as
in the server. --breakdown (GPU): one instrumented, eager, decode-only step of npl tokens at
depth npp: ms per op kind (engine.gpu.profiler.OpTimer).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from engine.scheduler import BatchEntry, Scheduler, Sequence


@dataclass
class BatchedRow:
    npl: int
    npp: int
    ntg: int
    overlap: bool = True
    pp_s: list[float] = field(default_factory=list)
    tg_s: list[float] = field(default_factory=list)
    step_wall_ms: list[float] = field(default_factory=list)
    step_device_ms: list[float] = field(default_factory=list)

    @property
    def test(self) -> str:
        return f"pp{self.npp}+tg{self.ntg} x{self.npl}" + ("" if self.overlap else " (no overlap)")

    @property
    def s_pp(self) -> float:
        return self.npl * self.npp / statistics.median(self.pp_s)

    @property
    def s_tg(self) -> float:
        return self.npl * (self.ntg - 1) / statistics.median(self.tg_s) if self.ntg > 1 else 0.0

    @property
    def s_total(self) -> float:
        return self.npl * self.ntg / statistics.median([a + b for a, b in zip(self.pp_s, self.tg_s)])

    def step_ms(self) -> tuple[float, float | None]:
        wall = statistics.median(self.step_wall_ms) if self.step_wall_ms else 0.0
        dev = statistics.median(self.step_device_ms) if self.step_device_ms else None
        return wall, dev


def _prompts(vocab: int, npl: int, npp: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, npp).tolist() for _ in range(npl)]


def _round(batch, prompts: list[list[int]], ntg: int, max_batch_tokens: int, row: BatchedRow | None,
           overlap: bool) -> None:
    """One round: every prompt at once through a fresh Scheduler until all sequences end."""
    sched = Scheduler(batch, max_batch_tokens, overlap)   # a fresh slot table: no prefix reuse
    seqs = [Sequence(p, ntg, on_token=lambda step: True, on_finish=lambda res: None) for p in prompts]
    for s in seqs:
        sched.add(s)
    t0 = time.perf_counter()
    t_first = None
    while sched.busy:
        st = sched.step()
        if t_first is None and all(s.t_first for s in seqs):
            t_first = time.perf_counter()
        elif t_first is not None and row is not None and st.decode == st.sequences == len(prompts):
            row.step_wall_ms.append(st.seconds * 1e3)
            if st.device_seconds is not None:
                row.step_device_ms.append(st.device_seconds * 1e3)
    t_end = time.perf_counter()
    bad = [s.result.stop_reason for s in seqs if s.result.stop_reason != "length"]
    if bad:
        raise RuntimeError(f"batched bench: sequences ended {sorted(set(bad))}, not by length")
    if row is not None:
        t_first = t_first if t_first is not None else t_end
        row.pp_s.append(t_first - t0)
        row.tg_s.append(t_end - t_first)


def bench_batched(model, npl: int, npp: int, ntg: int, reps: int = 3, max_batch_tokens: int = 512,
                  seed: int = 0, overlap: bool = True) -> BatchedRow:
    if npl < 1 or npp < 1 or ntg < 1:
        raise ValueError(f"batched bench: npl {npl}, npp {npp}, ntg {ntg} must be >= 1")
    batch = model.batch(npl, npp + ntg)
    row = BatchedRow(npl, npp, ntg, overlap)
    for r in range(reps + 1):
        prompts = _prompts(model.config.vocab_size, npl, npp, seed + r)
        _round(batch, prompts, ntg, max_batch_tokens, row if r else None, overlap)
    return row


def breakdown_batched(model, npl: int, npp: int, seed: int = 0):
    """One instrumented decode-only step of npl sequences at depth npp (their slots hold npp
    random tokens): (device ms of the step, {op kind: ms}, {op kind: launches})."""
    from engine.gpu.profiler import OpTimer

    batch = model.batch(npl, npp + 1)
    prompts = _prompts(model.config.vocab_size, npl, npp, seed)
    for i, p in enumerate(prompts):                  # fill the slots, one sequence per step
        batch.run([BatchEntry(i, p, 0, None)])
    entries = [BatchEntry(i, [p[-1]], npp, "argmax") for i, p in enumerate(prompts)]
    timer = OpTimer()
    batch.run(entries, timer=timer)
    return batch.last_device_seconds * 1e3, timer.totals_ms(), timer.counts()


def format_batched(rows: list[BatchedRow]) -> str:
    from engine.tools.bench import _table

    head = ["test", "PP s", "S_PP t/s", "TG s", "S_TG t/s", "S t/s", "step ms", "device ms", "host ms"]
    body = []
    for r in rows:
        wall, dev = r.step_ms()
        body.append([r.test, f"{statistics.median(r.pp_s):.3f}", f"{r.s_pp:.1f}",
                     f"{statistics.median(r.tg_s):.3f}", f"{r.s_tg:.1f}", f"{r.s_total:.1f}",
                     f"{wall:.2f}", "-" if dev is None else f"{dev:.2f}",
                     "-" if dev is None else f"{wall - dev:.2f}"])
    return _table(head, body, right=set(head) - {"test"})


def batched_json(r: BatchedRow) -> dict:
    wall, dev = r.step_ms()
    return {"test": r.test, "npl": r.npl, "npp": r.npp, "ntg": r.ntg, "overlap": r.overlap, "pp_s": r.pp_s, "tg_s": r.tg_s,
            "s_pp": r.s_pp, "s_tg": r.s_tg, "s_total": r.s_total, "step_wall_ms": wall,
            "step_device_ms": dev}

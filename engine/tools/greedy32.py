"""The greedy-32 regression: goldens in, verdict out.

A golden file holds, per prompt, `prompt_ids`, the greedy `tokens` (up to 32; fewer when an
end-of-generation token ended the run, which is not listed) and, per step, `top_logit` and
`margin` (chosen logit minus runner-up).

- free run: decode from the prompt and compare ids. Without a minimum margin every golden step
  must match, and a golden that stopped early must stop at the same step. With `min_margin` X only
  the steps before the first golden step whose margin is below X are compared (past a near-tie two
  correct engines may part).
- teacher forced: one prefill of prompt + golden tokens, argmax at every step whose golden margin
  is at least X.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from engine.errors import UsageError
from engine.generate import generate


@dataclass
class Row:
    prompt: str
    compared: int
    matched: int
    first_divergence: int | None  # step index of the first mismatch, None when all matched
    ok: bool


def load_goldens(path: str | os.PathLike) -> list[dict]:
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read goldens: {e}") from None
    cases = data.get("greedy") if isinstance(data, dict) else None
    if not isinstance(cases, list) or not cases:
        raise UsageError(f"{path}: no 'greedy' list of cases")
    for i, c in enumerate(cases):
        for key in ("prompt_ids", "tokens", "margin"):
            v = c.get(key) if isinstance(c, dict) else None
            if not isinstance(v, list) or not all(isinstance(x, (int, float)) for x in v):
                raise UsageError(f"{path}: case {i}: field '{key}' must be a list of numbers")
        if not c["prompt_ids"]:
            raise UsageError(f"{path}: case {i}: field 'prompt_ids' is empty")
        if len(c["margin"]) != len(c["tokens"]) or len(c["tokens"]) > 32:
            raise UsageError(f"{path}: case {i}: 'tokens' and 'margin' must have the same length (<= 32)")
    return cases


def _label(case: dict) -> str:
    text = case.get("prompt") or str(case["prompt_ids"][:6])
    return text.replace("\n", "\\n")[:40]


def _compare(got: list[int], want: list[int], steps: list[int], case: dict) -> Row:
    matched = sum(1 for s in steps if s < len(got) and got[s] == want[s])
    bad = [s for s in steps if not (s < len(got) and got[s] == want[s])]
    return Row(_label(case), len(steps), matched, bad[0] if bad else None, not bad)


def free_run(model, case: dict, eog_ids, min_margin: float | None) -> Row:
    want, margins = case["tokens"], case["margin"]
    limit = len(want)
    if min_margin is not None:
        low = [i for i, m in enumerate(margins) if m < min_margin]
        limit = low[0] if low else len(want)
    must_stop = min_margin is None or limit == len(want)
    must_stop = must_stop and len(want) < 32
    gen = generate(model, case["prompt_ids"], limit + (1 if must_stop else 0), eog_ids)
    row = _compare(gen.tokens, want, list(range(limit)), case)
    if must_stop and row.ok and gen.stop_reason != "eog":
        row = Row(row.prompt, row.compared + 1, row.matched, limit, False)
    elif must_stop:
        row = Row(row.prompt, row.compared + 1, row.matched + (gen.stop_reason == "eog"),
                  row.first_divergence, row.ok and gen.stop_reason == "eog")
    return row


def teacher_forced(model, case: dict, min_margin: float | None) -> Row:
    prompt, want = case["prompt_ids"], case["tokens"]
    ids = prompt + want[:-1] if want else prompt
    cache = model.new_cache(len(ids))
    logits = model.forward(ids, cache, all_logits=True)
    got = [int(t) for t in np.argmax(logits[len(prompt) - 1:], axis=-1)]
    threshold = -np.inf if min_margin is None else min_margin
    steps = [i for i, m in enumerate(case["margin"]) if m >= threshold]
    return _compare(got, want, steps, case)


def run(model, cases: list[dict], eog_ids, min_margin: float | None = None,
        teacher: bool = False) -> list[Row]:
    return [teacher_forced(model, c, min_margin) if teacher else free_run(model, c, eog_ids, min_margin)
            for c in cases]


def record(model, cases: list[dict], eog_ids, out_path: str | os.PathLike, source: str) -> None:
    """Write goldens in the same format from this engine's own free-run decoding."""
    greedy = []
    for c in cases:
        gen = generate(model, c["prompt_ids"], 32, eog_ids, need_logits=True)   # margins
        greedy.append({"prompt": c.get("prompt", ""), "prompt_ids": list(c["prompt_ids"]),
                       "tokens": gen.tokens, "top_logit": [round(x, 4) for x in gen.top_logits],
                       "margin": [round(x, 4) for x in gen.margins]})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"source": source, "greedy": greedy}, f, indent=1)


def format_rows(rows: list[Row]) -> str:
    lines = [f"{'prompt':42s} {'compared':>8s} {'matched':>8s} {'first divergence':>16s}"]
    for r in rows:
        div = "-" if r.first_divergence is None else str(r.first_divergence)
        lines.append(f"{r.prompt:42s} {r.compared:8d} {r.matched:8d} {div:>16s}")
    ok = sum(r.ok for r in rows)
    lines.append(f"{ok}/{len(rows)} prompts match")
    return "\n".join(lines)


def rows_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows])

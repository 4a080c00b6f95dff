"""The fuzzer as a test (issue 15): a few hundred seeded mutations of the synthetic models through
engine.cli.main in-process (worker processes under an 8 GiB address-space cap, a per-case CPU
deadline): no traceback, exactly one stderr line on exit 2, no hang, nothing over the cap.

The long run is the same code: python -m engine.tools.fuzz --count 20000 --seed S --jobs 2.
GGUF_PREFILL_FUZZ_SEED / GGUF_PREFILL_FUZZ_COUNT change this test's seed and size.
"""
from __future__ import annotations

import os

import pytest

from engine.tools import fuzz
from engine.tools.fuzz_mutate import make_bases, make_case

SEED = int(os.environ.get("GGUF_PREFILL_FUZZ_SEED", "0"))
COUNT = int(os.environ.get("GGUF_PREFILL_FUZZ_COUNT", "300"))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return make_bases(str(tmp_path_factory.mktemp("fuzz-bases")))


def failures_text(s: dict) -> str:
    return "\n".join(f"{f['kind']} case {f['case']} ({'; '.join(f['mutations'] or [])}): {f['detail'][-800:]}"
                     for f in s["failures"])


def test_fuzz_cases_through_the_cli(tmp_path):
    s = fuzz.fuzz(COUNT, SEED, jobs=2, directory=str(tmp_path))
    assert s["cases"] == COUNT
    assert {k: s[k] for k in fuzz.KINDS} == {k: 0 for k in fuzz.KINDS}, failures_text(s)
    # the mutations bite: most files are rejected, some still run
    assert set(s["exit"]) <= {"0", "2"}
    assert s["exit"].get("2", 0) > s["runs"] // 2 and s["exit"].get("0", 0) > 0


def test_harness_catches_hang_crash_and_over_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("GGUF_PREFILL_FUZZ_SELFTEST", "hang:1,crash:2,alloc:3")
    s = fuzz.fuzz(6, SEED, jobs=2, timeout=0.5, directory=str(tmp_path))
    assert (s["cases"], s["hang"], s["crash"], s["over_cap"], s["traceback"], s["multiline"]) == (6, 1, 1, 1, 0, 0)
    assert {f["case"] for f in s["failures"]} == {1, 2, 3}


def test_cases_are_reproducible(bases):
    a, b = make_case(bases, 7, 42), make_case(bases, 7, 42)
    assert a.data == b.data and a.mutations == b.mutations and a.commands == b.commands
    others = {make_case(bases, 7, i).data for i in range(20)}
    assert len(others) >= 18


def test_every_mutation_kind_is_drawn(bases):
    seen = set()
    for i in range(400):
        for m in make_case(bases, SEED, i).mutations:
            seen.add(m.split(" ")[0].split("=")[0].split("[")[0])
    for word in ("flip", "truncate", "chat_template", "delete", "duplicate", "tensor"):
        assert word in seen, sorted(seen)
    assert any("array count" in w or "kv_count" in w or "tensor_count" in w or "length" in w for w in seen)


def test_classify():
    ok = {"rc": 2, "stderr": "gguf-prefill generate: error: x\n", "traceback": None}
    assert fuzz.classify(ok) is None
    assert fuzz.classify({**ok, "stderr": "a\nb\n"}) == "multiline"
    assert fuzz.classify({**ok, "stderr": ""}) == "multiline"
    assert fuzz.classify({**ok, "rc": 1}) == "bad_exit"
    assert fuzz.classify({**ok, "rc": 1, "traceback": "Traceback ...\nKeyError"}) == "traceback"
    assert fuzz.classify({**ok, "rc": 1, "traceback": "MemoryError\n"}) == "over_cap"
    assert fuzz.classify({**ok, "stderr": "gguf-prefill generate: error: out of memory (x)\n"}) == "over_cap"
    assert fuzz.classify({"rc": 0, "stderr": "", "traceback": None}) is None
    assert fuzz.classify({"rc": 0, "stderr": "gguf-prefill generate: warning: W: w\n", "traceback": None}) is None
    assert fuzz.classify({"rc": 0, "stderr": "x.py:1: UserWarning: w\n  warn()\n", "traceback": None}) == "multiline"


def test_write_reproduces_a_case(tmp_path, capsys, bases):
    out = tmp_path / "case.gguf"
    assert fuzz.main(["--seed", str(SEED), "--case", "11", "--write", str(out)]) == 0
    assert out.read_bytes() == make_case(bases, SEED, 11).data
    printed = capsys.readouterr().out
    assert f"case 11 (seed {SEED})" in printed and "gguf-prefill generate --model" in printed

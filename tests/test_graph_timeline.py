"""CPU-only: the KERNEL_TIMELINE diagnostic (kernels_cu/common.cuh) and its reader
dev/graph_timeline.py: the launch signature is the kernel's, a known record's shares are right, a
record that does not match the captured launches is refused, capture_graph logs the launches it
records, and the define's build stamps where the production build does not."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from dev import graph_timeline as gt
from engine.gpu import kernels, launch
from tests.test_kernels_compile import _require_nvrtc

LAUNCHES = [("rmsnorm_q8", (4, 1, 1), (1024, 1, 1)), ("mmvq_q4_k_store", (3072, 1, 1), (128, 1, 1)),
            ("mmvq_q4_k_add", (1024, 1, 1), (128, 1, 1))]


def test_signature_matches_kernel_formula():
    text = (Path(kernels.__file__).resolve().parents[2] / "kernels_cu" / "common.cuh").read_text()
    body = text[text.index("const unsigned long long sig"):text.index("const unsigned long long i =")]
    # the fields and shifts the kernel packs: grid x 20 bits, y 12 bits at 20, z 8 bits at 32, block x 11 bits at 40
    assert re.findall(r"0x([0-9A-F]+)u", body) == ["FFFFF", "FFF", "FF", "7FF"]
    assert re.findall(r"<< (\d+)", body) == ["20", "32", "40"]
    assert gt.signature((3072, 2, 4), (128, 1, 1)) == 3072 | 2 << 20 | 4 << 32 | 128 << 40


def _stamps(step_us, replays, gap_us=1.0, t0=10**12):
    """Stamps of `replays` replays whose launch j takes step_us[j] (the last one plus gap_us)."""
    out, t = [], t0
    for _ in range(replays):
        for (_, g, b), us in zip(LAUNCHES, step_us):
            out.append((t, gt.signature(g, b)))
            t += int(us * 1e3)
        t += int(gap_us * 1e3)
    return np.array(out, dtype=np.uint64)


def test_shares_of_known_record():
    s = gt.shares(_stamps([4.0, 14.0, 9.0], replays=5), LAUNCHES, 5)
    assert s["step_us"] == pytest.approx(28.0)
    assert [p["us"] for p in s["positions"]] == pytest.approx([4.0, 14.0, 10.0])   # the last holds the gap
    assert s["sum_us"] == pytest.approx(28.0)
    assert [k["name"] for k in s["kernels"]] == ["mmvq_q4_k_store", "mmvq_q4_k_add", "rmsnorm_q8"]
    text = gt.format_shares("decode step", s)
    assert "28.0 us a replay" in text and "50.0%" in text


def test_shares_refuses_mismatch():
    st = _stamps([4.0, 14.0, 9.0], replays=3)
    with pytest.raises(ValueError, match="8 stamps for 3 replays of 3 launches"):
        gt.shares(st[:-1], LAUNCHES, 3)
    bad = st.copy()
    bad[4, 1] = gt.signature((1, 1, 1), (32, 1, 1))
    with pytest.raises(ValueError, match="launch 1, mmvq_q4_k_store"):
        gt.shares(bad, LAUNCHES, 3)


class _Raw:
    def __init__(self, name):
        self.name = name
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block))


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def begin_capture(self):
        pass

    def end_capture(self):
        return type("G", (), {"upload": lambda self, s: None})()

    def synchronize(self):
        pass


def test_capture_graph_logs_launches():
    a, b = launch.Kernel(_Raw("embed")), launch.Kernel(_Raw("rmsnorm_q8"))
    a((2,), (256,), ())                                  # outside a capture: not logged
    launch.capture_graph(_Stream(), lambda: (a((8, 2), 256, ()), b(4, (1024,), ())))
    assert launch.captured_launches == [("embed", (8, 2, 1), (256, 1, 1)), ("rmsnorm_q8", (4, 1, 1), (1024, 1, 1))]
    assert launch._state["log"] is None


def test_timeline_build_stamps_and_production_does_not(monkeypatch):
    _require_nvrtc()
    monkeypatch.delenv(kernels.DEFINES_ENV, raising=False)
    prod, _ = kernels.nvrtc_ptx("decode_fused.cu", ["rmsnorm_q8"], arch="compute_90")
    assert "globaltimer" not in prod and "ggp_tl_buf" not in prod
    monkeypatch.setenv(kernels.DEFINES_ENV, "KERNEL_TIMELINE=1")
    assert "-DKERNEL_TIMELINE=1" in kernels.file_defines("decode_fused.cu")
    diag, low = kernels.nvrtc_ptx("decode_fused.cu", ["rmsnorm_q8"], arch="compute_90")
    entry = diag[diag.index(f".entry {low['rmsnorm_q8']}"):]
    assert "ggp_tl_buf" in diag and entry.index("griddepcontrol.wait") < entry.index("%globaltimer")

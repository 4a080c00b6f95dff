"""CPU-only: the WG_TIMELINE diagnostic of the wgmma GEMMs (kernels_cu/wgmma_common.cuh) and its
reader dev/wg_timeline.py: the reader's slots are the kernel's, its summary of a known record is
right, the define's build stamps the timer and the production build has no trace of it; and the
deeper activation rings (STAGES 12 / 16 at token tiles <= 64) are accepted and compile."""
from __future__ import annotations

import numpy as np
import pytest

from dev import wg_timeline as tl
from engine.gpu import kernels, registry
from tests.test_kernels_compile import _require_nvrtc


def test_slots_match_kernel():
    assert tl.PHASES == tl.source_phases()
    assert tl.SMID < tl.SLOTS


def test_block_super_blocks_kp3():
    # K = 4096: 16 super-blocks in 3 parts of 5, 5, 6; grid 2 x 2 x 3: z = id // 4
    nsb = tl.block_super_blocks(12, (2, 2, 3), 4096)
    assert nsb.tolist() == [5] * 4 + [5] * 4 + [6] * 4
    assert tl.block_super_blocks(3, (1, 3, 1), 4096).tolist() == [16, 16, 16]


def _record(stamps_us, sm, epi_us=None, ghz=1.98, clk0=5_000_000):
    """One block's row: entry .. loop and exit (8 times, us), with a K split also the two epilogue
    phases (epi_us), as %globaltimer ns and as clock64 at `ghz`; unsplit, those slots stay 0."""
    names = ["ENTRY", "PDL", "ISSUED", "WEIGHTS0", "STAGE0", "SB0", "LOOP", "EXIT"]
    times = list(stamps_us)
    if epi_us is not None:
        names[7:7] = ["EPI_SYNC", "EPI_SUM"]
        times[7:7] = list(epi_us)
    row = np.zeros(tl.SLOTS, dtype=np.uint64)
    for name, us in zip(names, times):
        row[tl.S[name]] = 10**12 + int(round(us * 1e3))
        row[tl.NPH + tl.S[name]] = clk0 + int(round((us - times[0]) * 1e3 * ghz))
    row[tl.SMID] = sm
    return row


def test_summarize_known_record():
    # two blocks share SM 0 through their loops; on SM 1 one block, then a second after it left
    rec = np.stack([
        _record((0.0, 1.0, 1.2, 2.0, 2.5, 4.0, 19.0, 19.5), sm=0),   # 16 sb: (19 - 4) / 15 = 1.0 us each
        _record((0.1, 1.0, 1.3, 2.1, 2.6, 4.1, 19.1, 19.4), sm=0),
        _record((0.2, 1.1, 1.3, 2.0, 2.4, 3.4, 21.4, 22.0), sm=1),   # alone: 18 / 15 = 1.2 us each
        _record((22.5, 22.6, 22.7, 23.7, 24.0, 25.0, 25.0, 25.2), sm=1),   # 1 sb, after a 0.5 us gap
    ])
    s = tl.summarize(rec, np.array([16, 16, 16, 1]))
    assert s["blocks"] == 4 and s["sms"] == 2 and s["blocks_per_sm"] == {2: 2}
    assert s["span_us"] == pytest.approx(25.2) and s["span_from_pdl_us"] == pytest.approx(24.2)
    assert s["sm_ghz"] == pytest.approx(1.98, rel=1e-3)
    assert s["phases_us"]["pdl"]["max"] == pytest.approx(1.0, abs=1e-3)
    assert s["phases_us"]["weights0"]["median"] == pytest.approx(0.8, abs=1e-3)
    assert s["phases_us"]["stage0"]["max"] == pytest.approx(0.5, abs=1e-3)
    assert s["refill_gap_us"]["n"] == 1 and s["refill_gap_us"]["max"] == pytest.approx(0.5)
    assert s["per_sb_by_resident"] == pytest.approx({1: 1.2, 2: 1.0}, abs=1e-3)
    lb = s["last_block"]
    assert lb["id"] == 3 and lb["sm"] == 1 and lb["resident"] == 1 and lb["super_blocks"] == 1
    assert lb["epilogue"] == pytest.approx(0.2, abs=1e-3)
    assert s["phases_us"]["epi_wait"]["max"] == 0 and s["phases_us"]["epi_sum"]["max"] == 0
    text = tl.format_summary("q4_k 22016x4096 T=32 auto", s, ms=0.0305)
    assert "span 25.2 us" in text and "2: 1.000 us" in text and "refill_gap" in text


def test_summarize_k_split_epilogue():
    # two parts of a cluster: the first waits 1.5 us at the barrier for the second
    rec = np.stack([
        _record((0.0, 0.5, 0.6, 1.5, 2.0, 3.0, 6.0, 9.0), sm=0, epi_us=(7.5, 8.5)),
        _record((0.0, 0.5, 0.6, 1.6, 2.1, 3.5, 7.4, 9.0), sm=1, epi_us=(7.5, 8.6)),
    ])
    s = tl.summarize(rec, np.array([4, 4]))
    assert s["phases_us"]["epi_wait"]["max"] == pytest.approx(1.5, abs=1e-3)
    assert s["phases_us"]["epi_wait"]["min"] == pytest.approx(0.1, abs=1e-3)
    assert s["phases_us"]["epi_sum"]["median"] == pytest.approx(1.05, abs=1e-3)
    assert s["phases_us"]["epilogue"]["max"] == pytest.approx(0.5, abs=1e-3)


def test_summarize_rejects_missing_or_unordered():
    good = _record((0.0, 1.0, 1.2, 2.0, 2.5, 4.0, 19.0, 19.5), sm=0)
    missing = good.copy()
    missing[tl.S["ENTRY"]] = 0
    with pytest.raises(ValueError, match="missing or out of order"):
        tl.summarize(np.stack([good, missing]), np.array([16, 16]))
    swapped = good.copy()
    a, b = tl.NPH + tl.S["SB0"], tl.NPH + tl.S["LOOP"]
    swapped[[a, b]] = swapped[[b, a]]
    with pytest.raises(ValueError, match="missing or out of order"):
        tl.summarize(swapped[None], np.array([16]))


def test_timeline_build_stamps_and_production_does_not(monkeypatch):
    _require_nvrtc()
    from dev.sass_dump import ptx

    inst = "wgmma_q4_k_kp<32, 8, 4>"
    monkeypatch.delenv(kernels.DEFINES_ENV, raising=False)
    prod, _ = ptx("wgmma_q4_k.cu", inst)
    assert "globaltimer" not in prod and "wg_timeline" not in prod
    monkeypatch.setenv(kernels.DEFINES_ENV, "WG_TIMELINE=1")
    diag, _ = ptx("wgmma_q4_k.cu", inst)
    assert diag.count("%globaltimer") == 10 and diag.count("%clock64") == 10 and ".global .align 8 .b8 wg_timeline" in diag


def test_deep_stages_accepted_and_compile():
    assert registry.wgmma_instance(32, 16, 1) == "wgmma_q4_k<32, 16>"
    assert registry.wgmma_q6_instance(True, 64, 12, 2) == "wgmma_q6_k_kp<true, 64, 12, 2>"
    for bt, st in ((128, 16), (32, 10), (32, 20)):
        with pytest.raises(ValueError, match="not supported"):
            registry.wgmma_instance(bt, st, 1)
    _require_nvrtc()
    from dev.sass_dump import ptx

    for inst in ("wgmma_q4_k<32, 16>", "wgmma_q4_k_swiglu<32, 16>"):
        text, lowered = ptx("wgmma_q4_k.cu", inst)
        assert f".entry {lowered}" in text

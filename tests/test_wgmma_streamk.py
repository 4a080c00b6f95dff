"""CPU-only: the stream-K form of the small-batch Hopper GEMMs (kernels_cu/wgmma_streamk.cuh, an A/B):
its deal of (tile, super-block) units holds the invariants the kernel's owner / partial protocol
rests on for every grid it may get, its instances are named, chosen and compiled, and a launch's
grid fits the GPU at once. The GPU checks are in tests/test_gpu_wgmma.py (test_wgmma_streamk_*)."""
from __future__ import annotations

import pytest

from engine.gpu import kernels, registry
from engine.gpu.ops import wgmma as W
from engine.gpu.registry import STREAMK
from tests.test_kernels_compile import _require_nvrtc


@pytest.mark.parametrize("tiles,nsb", [(172, 16), (32, 16), (32, 43), (296, 14), (1, 1), (3, 5), (4, 16)])
@pytest.mark.parametrize("blocks", [1, 7, 132, 264, 1000])
def test_deal_invariants(tiles, nsb, blocks):
    U = tiles * nsb
    G = W.streamk_grid(U, 2, blocks // 2 if blocks > 1 else 1) if blocks > 1 else 1
    segs = W.streamk_segments(U, G, nsb)
    covered = sorted((q, sb) for block in segs for q, a, e in block for sb in range(a, e))
    assert covered == [(q, sb) for q in range(tiles) for sb in range(nsb)]     # every unit once
    assert all(block for block in segs)                                         # G <= U: none idle
    owners, partials = {}, {}
    for b, block in enumerate(segs):
        for i, (q, a, e) in enumerate(block):
            if a == 0:
                assert q not in owners
                owners[q] = b
                # the owner's segment is its block's last but for whole tiles after it
                assert all(s[1] == 0 for s in block[i:])
            else:
                assert i == 0, "a continuation is always its block's first segment (one partial a block)"
                partials.setdefault(q, []).append(b)
    assert sorted(owners) == list(range(tiles))
    for q, b in owners.items():
        last = W.streamk_block_of((q + 1) * nsb - 1, U, G)
        assert W.streamk_block_of(q * nsb, U, G) == b
        assert partials.get(q, []) == list(range(b + 1, last + 1))             # what the owner waits for


def test_grid_fits_and_refuses():
    assert W.streamk_grid(2752, 2, 132) == 264
    assert W.streamk_grid(100, 2, 132) == 100
    with pytest.raises(ValueError, match="does not fit"):
        W.streamk_grid(100, 0, 132)


def test_names_and_limits():
    assert registry.wgmma_instance(32, None, STREAMK) == "wgmma_q4_k_sk<32, 8>"
    assert registry.wgmma_swiglu_instance(32, 16, STREAMK) == "wgmma_q4_k_swiglu_sk<32, 16>"
    assert registry.wgmma_q6_instance(True, 64, None, STREAMK) == "wgmma_q6_k_sk<true, 64, 8>"
    with pytest.raises(ValueError, match="no stream-K form"):
        registry.wgmma_instance(128, 4, STREAMK)
    with pytest.raises(ValueError, match="no stream-K form"):
        registry.wgmma_rope_instance(32, None, STREAMK)


def test_define_chooses_streamk_where_allowed(monkeypatch):
    monkeypatch.delenv(kernels.DEFINES_ENV, raising=False)
    assert W._config("x", 32, 22016, 4096, None, None, None, streamk_ok=True)[2] == 1
    monkeypatch.setenv(kernels.DEFINES_ENV, "WG_STREAMK=1")
    bt, stages, kp, smem = W._config("x", 32, 22016, 4096, None, None, None, streamk_ok=True)
    assert (bt, stages, kp, smem) == (32, 8, STREAMK, W.smem_bytes(32, 8, 1))
    assert W._config("x", 32, 22016, 4096, None, None, None)[2] == 1               # a pair / rope launch
    assert W._config("x", 512, 22016, 4096, None, None, None, streamk_ok=True)[2] == 1   # bt > 64
    assert W._config("x", 32, 4096, 4096, None, None, 2, streamk_ok=True)[2] == 2        # kp given


def test_instances_compile():
    _require_nvrtc()
    for fname, names in (("wgmma_q4_k.cu", ["wgmma_q4_k_sk<32, 8>", "wgmma_q4_k_swiglu_sk<32, 8>",
                                            "wgmma_q4_k_sk<64, 16>"]),
                         ("wgmma_q6_k.cu", ["wgmma_q6_k_sk<true, 32, 8>", "wgmma_q6_k_sk<false, 64, 8>"])):
        ptx, lowered = kernels.nvrtc_ptx(fname, names)
        for n in names:
            entry = ptx[ptx.index(f".entry {lowered[n]}"):]
            assert "griddepcontrol.wait" in entry and "red.release.gpu" in entry and "ld.acquire.gpu" in entry

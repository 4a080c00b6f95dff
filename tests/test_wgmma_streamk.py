"""CPU-only: the stream-K form of the small-batch Hopper GEMMs (kernels_cu/wgmma_streamk.cuh, an A/B):
its deal of (tile, super-block) units holds the invariants the kernel's owner / partial protocol
rests on for every grid it may get, the kernel's loop (transliterated: no CPU runs the kernel)
copies, waits and loads what each unit needs, its instances are named, chosen and compiled, and a
launch's grid fits the GPU at once. The GPU checks are in tests/test_gpu_wgmma.py
(test_wgmma_streamk_*)."""
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
    assert registry.wgmma_rope_instance(32, None, STREAMK) == "wgmma_q4_k_rope_sk<32, 8>"
    assert registry.wgmma_pair_rope_instance(True, 32, None, STREAMK) == "wgmma_pair_rope_sk<true, 32, 8>"
    assert registry.wgmma_pair_instance(False, 64, None, STREAMK) == "wgmma_pair_sk<false, 64, 8>"


def test_define_chooses_streamk_where_allowed(monkeypatch):
    monkeypatch.delenv(kernels.DEFINES_ENV, raising=False)
    assert W._config("x", 32, 22016, 4096, None, None, None)[2] == 1
    monkeypatch.setenv(kernels.DEFINES_ENV, "WG_STREAMK=1")
    bt, stages, kp, smem = W._config("x", 32, 22016, 4096, None, None, None)
    assert (bt, stages, kp, smem) == (32, 8, STREAMK, W.smem_bytes(32, 8, 1))
    assert W._config("x", 512, 22016, 4096, None, None, None)[2] == 1         # bt > 64
    assert W._config("x", 32, 4096, 4096, None, None, 2)[2] == 2              # kp given
    assert W._config("x", 32, 4096, 4096, 32, None, None)[2] == 1             # bt given


@pytest.mark.parametrize("ua,ub,blocks", [(1024, 256, 264), (1, 1, 2), (3, 1000, 264), (1000, 3, 264), (5, 5, 7)])
def test_pair_split(ua, ub, blocks):
    ga = W.streamk_split(ua, ub, blocks)
    assert 1 <= ga <= ua and 1 <= blocks - ga <= ub
    if ua >= blocks and ub >= blocks:
        assert abs(ga / blocks - ua / (ua + ub)) <= 1 / blocks


def test_instances_compile():
    _require_nvrtc()
    for fname, names in (("wgmma_q4_k.cu", ["wgmma_q4_k_sk<32, 8>", "wgmma_q4_k_swiglu_sk<32, 8>",
                                            "wgmma_q4_k_rope_sk<32, 8>", "wgmma_q4_k_sk<64, 16>"]),
                         ("wgmma_q6_k.cu", ["wgmma_q6_k_sk<true, 32, 8>", "wgmma_q6_k_sk<false, 64, 8>"]),
                         ("wgmma_pair.cu", ["wgmma_pair_sk<true, 32, 8>", "wgmma_pair_rope_sk<true, 32, 8>"])):
        ptx, lowered = kernels.nvrtc_ptx(fname, names)
        for n in names:
            entry = ptx[ptx.index(f".entry {lowered[n]}"):]
            assert "griddepcontrol.wait" in entry and "red.release.gpu" in entry and "ld.acquire.gpu" in entry


def _trace_block(T, BT, N, K, G, STAGES, b):
    """wgmma_streamk.cuh's control flow for block b, transliterated (thread 0's copy cursor, the
    segment / unit loop, the refills, the weights one unit ahead): checks each stage's copy source
    and size against its unit, that a buffer is refilled only after its stage was consumed and in
    stage order, that every stage is copied once and waited once, and that each unit computes with
    its own weights. It mirrors the kernel's loop and must change with it."""
    ngroups, ntok, nsb = (T + 7) // 8, -(-T // BT), K // 256
    U = ntok * (N // 128) * nsb
    rb = 4 if STAGES >= 8 else 1
    u0, nu = b * U // G, (b + 1) * U // G - b * U // G
    nst = 4 * nu

    def g0_of(q):
        return (q % ntok) * (BT // 8)

    fq, fsb = divmod(u0, nsb)
    c = {"src": 4 * fsb * ngroups * 1024 + g0_of(fq) * 1024, "bytes": min(BT // 8, ngroups - g0_of(fq)) * 1024,
         "left": 4 * (nsb - fsb), "q": fq}
    issued: dict[int, tuple[int, int]] = {}

    def copy_next(L):
        assert L == len(issued), "copies out of order"
        issued[L] = (c["src"], c["bytes"])
        c["src"] += ngroups * 1024
        c["left"] -= 1
        if c["left"] == 0:
            c["left"], c["q"] = 4 * nsb, c["q"] + 1
            g0 = 0 if ntok == 1 else (c["q"] % ntok) * (BT // 8)
            c["src"], c["bytes"] = g0 * 1024, min(BT // 8, ngroups - g0) * 1024

    for L in range(min(STAGES, nst)):
        copy_next(L)
    consumed, cur, k, seg_q, seg_sb = set(), (fq, fsb), 0, fq, fsb
    owners = []
    while k < nu:
        q, sb_end = seg_q, seg_sb + min(nsb - seg_sb, nu - k)
        L0 = 4 * (k - seg_sb)
        for sb in range(seg_sb, sb_end):
            nxt = (q, sb + 1) if sb + 1 < sb_end else ((q + 1, 0) if sb_end - seg_sb + k < nu else None)
            assert cur == divmod(u0 + L0 // 4 + sb, nsb)
            for jj in range(4):
                L = L0 + 4 * sb + jj
                eq, esb = divmod(u0 + L // 4, nsb)
                assert issued[L] == ((4 * esb + L % 4) * ngroups * 1024 + g0_of(eq) * 1024,
                                     min(BT // 8, ngroups - g0_of(eq)) * 1024)
                consumed.add(L)
                if rb == 1 and L >= 1 and L - 1 + STAGES < nst:
                    copy_next(L - 1 + STAGES)
                elif rb == 4 and jj == 0 and L >= 4 and L + STAGES - 4 < nst:
                    for Ln in range(L + STAGES - 4, min(L + STAGES, nst)):
                        assert Ln - STAGES in consumed
                        copy_next(Ln)
            cur = nxt
        k += sb_end - seg_sb
        owners.append((q, seg_sb == 0))
        seg_q, seg_sb = q + 1, 0
    assert sorted(consumed) == sorted(issued) == list(range(nst))
    return owners


@pytest.mark.parametrize("T,BT", [(32, 32), (20, 32), (100, 32), (130, 64), (7, 32)])
@pytest.mark.parametrize("stages", [4, 8, 16])
def test_kernel_loop_trace(T, BT, stages):
    for N, K in ((128, 256), (384, 4096), (1024, 2816)):
        U = -(-T // BT) * (N // 128) * (K // 256)
        for G in sorted({1, 3, 7, min(U, 132), min(U, 264)}):
            segs = W.streamk_segments(U, G, K // 256)
            for b in range(G):
                owners = _trace_block(T, BT, N, K, G, stages, b)
                assert owners == [(q, a == 0) for q, a, _ in segs[b]]    # the host's deal, segment by segment

"""CPU-only: every kernels_cu/*.cu compiles for sm_90 with NVRTC, with the same source
assembly, options and template instances as at run time (engine.gpu.kernels), and the ptxas
resource usage of each instance is printed (registers, stack frame, spill bytes).

Without NVRTC the test skips, except with the environment variable CI set: then it fails.
"""
from __future__ import annotations

import os

import pytest

from engine.gpu import kernels


def _require_nvrtc():
    try:
        kernels._nvrtc()
    except kernels.NVRTCMissing as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and NVRTC is missing: {e}")
        pytest.skip(f"NVRTC not available: {e}")


def test_instance_count(capsys):
    """The registry lists only production instances; print how many compile, per file."""
    with capsys.disabled():
        print()
        print("  " + kernels.count_line())
    counts = kernels.instance_count()
    assert set(counts) == set(kernels.kernel_files()), "every kernel file has its instances in the registry"
    assert sum(counts.values()) == 183, counts


def test_kernel_files_found():
    assert "mmq_q4_k.cu" in kernels.kernel_files()
    for f in ("quantize_q8_1.cu", "mmq_q4_k.cu", "mmq_q6_k.cu", "q6k_expand_check.cu"):
        assert kernels.INSTANCES.get(f), f"{f} has no instances listed in engine.gpu.kernels.INSTANCES"


def test_source_has_line_directives():
    src = kernels.source("mmq_q4_k.cu")
    assert '#line 1 "' in src and "common.cuh" in src
    assert not any(line.strip().startswith('#include "common.cuh"') for line in src.splitlines())


@pytest.mark.parametrize("fname", kernels.kernel_files())
def test_compiles_for_sm90(fname, capsys):
    _require_nvrtc()
    res = kernels.compile_for_check("sm_90", files=[fname])
    listed = kernels.INSTANCES.get(fname)
    if listed:
        assert {r.name for r in res} == set(listed)
    else:   # extern "C" kernels only: at least one entry function must have been built
        assert res, f"{fname}: no instances listed and no entry function in the ptxas log"
    with capsys.disabled():
        print()
        for r in res:
            print("  " + r.line())
    for r in res:
        # SM90A_FILES: NVRTC builds PTX only; registers come from a ptxas when one is found
        assert r.registers > 0 or fname in kernels.SM90A_FILES
        # launched programmatically in captured graphs (engine/gpu/launch.py): every entry must
        # wait for its predecessor grid before it touches global memory (common.cuh pdl_entry)
        assert r.pdl_wait, f"{fname}: {r.name} has no griddepcontrol.wait (pdl_entry() missing)"


def test_smem_fits_sm90():
    # 227 KB per block on sm_90
    for kind in ("q4_k", "q6_k"):
        for v in kernels.mmq_variants(kind):
            assert kernels.mmq_smem_bytes(kind, v) <= 227 * 1024, (kind, v)


def test_choose_variant_rule():
    from engine.gpu.ops import mmq as gpu_ops
    # one token: the decode GEMV; then the small-batch tiers (mmsb, MMQ tiles with the K split)
    from engine.gpu import registry
    for kind in ("q4_k", "q6_k"):
        assert gpu_ops.choose_variant(kind, 1, 4096, sm_count=132) == gpu_ops.MMVQ_VARIANT
        assert gpu_ops.choose_variant(kind, 2, 4096, sm_count=132) == gpu_ops.MMSB_VARIANT
        tiers = registry.SMALL_BATCH_TIERS[kind]
        assert [t for t, _ in tiers] == sorted(t for t, _ in tiers) and tiers[-1][0] == 128
        for T in range(1, 129):
            v = gpu_ops.choose_variant(kind, T, 4096, sm_count=132)
            name, _ = kernels.mmq_split_name(v)
            if name == gpu_ops.MMSB_VARIANT:
                assert T <= registry.MMSB_MAX_TOKENS
            elif name != gpu_ops.MMVQ_VARIANT:
                assert (name, False) in registry.mmq_launched(kind), v
                assert T <= kernels.mmq_tile(kind, v)[0] or name == gpu_ops.DEFAULT_VARIANT[kind]
    # wide matrices at 17..32 tokens: the small-batch kernel (registry.SMALL_BATCH_WIDE)
    assert gpu_ops.choose_variant("q4_k", 32, 22016, sm_count=132) == gpu_ops.MMSB_VARIANT
    assert gpu_ops.choose_variant("q4_k", 17, 12288, sm_count=132) == gpu_ops.MMSB_VARIANT
    assert gpu_ops.choose_variant("q4_k", 32, 4096, sm_count=132) == "m32n128tc_k256+split"
    assert gpu_ops.choose_variant("q4_k", 16, 22016, sm_count=132) == "m16n128tc_k256+split8"
    assert gpu_ops.choose_variant("q4_k", 33, 22016, sm_count=132) == "m64n128tc_k256+split"
    assert gpu_ops.choose_variant("q6_k", 32, 32000, sm_count=132) == gpu_ops.MMSB_VARIANT
    assert gpu_ops.choose_variant("q6_k", 32, 4096, sm_count=132) == "m32n128+split8"
    # then: 64-token grid fits on the SMs -> the 64x128 tile, split; otherwise the 128x128 one
    small = {k: gpu_ops.SMALL_VARIANT[k] + kernels.MMQ_SPLIT_SUFFIX for k in ("q4_k", "q6_k")}
    assert gpu_ops.choose_variant("q6_k", 256, 4096, sm_count=132) == small["q6_k"]
    big = {k: gpu_ops.DEFAULT_VARIANT[k] + (kernels.MMQ_SPLIT_SUFFIX if gpu_ops.DEFAULT_SPLIT[k] else "")
           for k in ("q4_k", "q6_k")}
    assert gpu_ops.choose_variant("q6_k", 512, 4096, sm_count=132) == big["q6_k"]
    assert gpu_ops.choose_variant("q4_k", 200, 4096, sm_count=132) == small["q4_k"]
    assert gpu_ops.choose_variant("q4_k", 3314, 11008, sm_count=132) == big["q4_k"]
    for kind in ("q4_k", "q6_k"):
        for v in (gpu_ops.SMALL_VARIANT[kind], gpu_ops.DEFAULT_VARIANT[kind]):
            assert v in kernels.mmq_variants(kind)


def test_split_variant_names():
    for kind in ("q4_k", "q6_k"):
        for v in kernels.mmq_variants(kind):
            sv = v + kernels.MMQ_SPLIT_SUFFIX
            assert kernels.mmq_split_name(sv) == (v, True) and kernels.mmq_split_name(v) == (v, False)
            assert kernels.mmq_instance(kind, sv) == kernels.mmq_instance(kind, v)
            assert kernels.mmq_smem_bytes(kind, sv) == kernels.mmq_smem_bytes(kind, v)
    with pytest.raises(KeyError):
        kernels.mmq_config("q6_k", "m128n128w8_k256+splat")


def test_split_plan():
    from engine.gpu.ops import mmq as gpu_ops
    # no partial wave, or a tail too large to cut: no split
    assert gpu_ops.split_plan(264, 132, 16) == (264, 1)
    assert gpu_ops.split_plan(2236, 132, 16) == (2236, 1)        # tail 124: 2 parts > 132 slots
    assert gpu_ops.split_plan(128, 132, 16) == (128, 1)
    assert gpu_ops.split_plan(832, 132, 1) == (832, 1)           # one stage: nothing to cut
    # N = 4096, T = 3314 on 132 SMs, 128x128 tiles: 832 = 6 x 132 + 40 -> 3 parts of 40 tiles
    assert gpu_ops.split_plan(832, 132, 16) == (792, 3)
    assert gpu_ops.split_plan(832, 132, 2) == (792, 2)           # parts <= stages
    assert gpu_ops.split_plan(6500, 132, 16) == (6468, 4)        # parts <= SPLIT_MAX_PARTS
    for tiles in range(1, 700):
        for stages in (1, 2, 3, 16, 43):
            split0, parts = gpu_ops.split_plan(tiles, 132, stages)
            if parts > 1:
                assert split0 % 132 == 0 and 0 < (tiles - split0) * parts <= 132 and parts <= stages
            else:
                assert split0 == tiles


def test_mmq_grid():
    from engine.gpu.ops import mmq as gpu_ops
    g = gpu_ops.mmq_grid("q6_k", "m128n128w8_k256", 3314, 4096, 4096, sm_count=132)
    assert g == gpu_ops.MmqGrid(832, 832, 1, 832, 7.0)
    g = gpu_ops.mmq_grid("q6_k", "m128n128w8_k256+split", 3314, 4096, 4096, sm_count=132)
    assert (g.tiles, g.split0, g.parts, g.blocks) == (832, 792, 3, 792 + 3 * 40)
    assert g.waves == 6 + 6 / 16                                 # stages 5, 5, 6 of 16
    # 2 blocks per SM (m64n128): slots = 264
    g = gpu_ops.mmq_grid("q6_k", "m64n128+split", 3314, 4096, 4096, sm_count=132)
    assert (g.tiles, g.split0, g.parts) == (1664, 1584, 3)
    # forced plans (tests): every tile split; out-of-range plans refused
    g = gpu_ops.mmq_grid("q4_k", "m64n128tc_k256", 130, 129, 768, sm_count=132, split=(0, 3))
    assert (g.tiles, g.split0, g.parts, g.blocks) == (6, 0, 3, 18)
    with pytest.raises(ValueError):
        gpu_ops.mmq_grid("q4_k", "m64n128tc_k256", 130, 129, 768, sm_count=132, split=(0, 4))
    with pytest.raises(ValueError):
        gpu_ops.mmq_grid("q4_k", "m64n128tc_k256", 130, 129, 768, sm_count=132, split=(7, 2))


def test_choose_variant_split_flag(monkeypatch):
    from engine.gpu.ops import mmq as gpu_ops
    monkeypatch.setitem(gpu_ops.DEFAULT_SPLIT, "q6_k", True)
    monkeypatch.setitem(gpu_ops.DEFAULT_SPLIT, "q4_k", False)
    assert gpu_ops.choose_variant("q6_k", 3314, 4096, sm_count=132) == \
        gpu_ops.DEFAULT_VARIANT["q6_k"] + kernels.MMQ_SPLIT_SUFFIX
    assert gpu_ops.choose_variant("q6_k", 200, 4096, sm_count=132) == \
        gpu_ops.SMALL_VARIANT["q6_k"] + kernels.MMQ_SPLIT_SUFFIX
    assert gpu_ops.choose_variant("q4_k", 3314, 4096, sm_count=132) == gpu_ops.DEFAULT_VARIANT["q4_k"]


@pytest.mark.parametrize("fname,instance", [
    ("wgmma_q4_k.cu", "wgmma_q4_k_kp<32, 8, 4>"),
    ("wgmma_pair.cu", "wgmma_pair_kp<true, 32, 8, 2>"),
])
def test_weights_before_wait(fname, instance):
    """wgmma_common.cuh wgmma_gemm: a wgmma GEMM's first weight loads (ld.global.nc) come before
    its griddepcontrol.wait (a weight: no predecessor writes it), and it does not trigger its
    successor early (no launch_dependents: PDL_EARLY, retired)."""
    from dev.sass_dump import ptx

    text, lowered = ptx(fname, instance)
    body = text[text.index(f".entry {lowered}"):]              # the file's only entry (templates)
    assert "griddepcontrol.launch_dependents" not in body
    wait, load = body.index("griddepcontrol.wait"), body.find("ld.global.nc")
    assert 0 <= load < wait, (instance, load, wait)      # (the pair: one wait in each matrix's branch)


"""CPU-only: every kernels_cu/*.cu compiles for sm_90 with NVRTC, with the same source
assembly, options and template instances as at run time (engine.kernels), and the ptxas
resource usage of each instance is printed (registers, stack frame, spill bytes).

Without NVRTC the test skips, except with the environment variable CI set: then it fails.
"""
from __future__ import annotations

import os

import pytest

from engine import kernels


def _require_nvrtc():
    try:
        kernels._nvrtc()
    except kernels.NVRTCMissing as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and NVRTC is missing: {e}")
        pytest.skip(f"NVRTC not available: {e}")


def test_kernel_files_found():
    assert "mmq_q4_k.cu" in kernels.kernel_files()
    for f in ("quantize_q8_1.cu", "mmq_q4_k.cu", "mmq_q6_k.cu", "q6k_expand_check.cu"):
        assert kernels.INSTANCES.get(f), f"{f} has no instances listed in engine.kernels.INSTANCES"


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
        assert r.registers > 0


def test_smem_fits_sm90():
    # 227 KB per block on sm_90
    for kind in ("q4_k", "q6_k"):
        for v in kernels.mmq_variants(kind):
            assert kernels.mmq_smem_bytes(kind, v) <= 227 * 1024, (kind, v)


def test_choose_variant_rule():
    from engine import gpu_ops
    # 64-token grid fits on the SMs -> the 64x128 tile; otherwise the 128x128 one
    assert gpu_ops.choose_variant("q6_k", 256, 4096, sm_count=132) == gpu_ops.SMALL_VARIANT["q6_k"]
    assert gpu_ops.choose_variant("q6_k", 512, 4096, sm_count=132) == gpu_ops.DEFAULT_VARIANT["q6_k"]
    assert gpu_ops.choose_variant("q4_k", 64, 11008, sm_count=132) == gpu_ops.SMALL_VARIANT["q4_k"]
    assert gpu_ops.choose_variant("q4_k", 3314, 11008, sm_count=132) == gpu_ops.DEFAULT_VARIANT["q4_k"]
    for kind in ("q4_k", "q6_k"):
        for v in (gpu_ops.SMALL_VARIANT[kind], gpu_ops.DEFAULT_VARIANT[kind]):
            assert v in kernels.mmq_variants(kind)

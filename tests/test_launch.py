"""engine/gpu/launch.py on the CPU: the driver structs' layout and the kernel-argument marshalling
(the launches themselves run in the GPU suites, inside every captured graph)."""
import ctypes

import numpy as np
import pytest

from engine.gpu import launch


def test_driver_struct_layout():
    # cuda.h (CUDA 12+): CUlaunchAttribute {id; pad[4]; value (64-byte union)}, CUlaunchConfig
    # {gridDim xyz, blockDim xyz, sharedMemBytes, hStream, attrs, numAttrs}
    assert ctypes.sizeof(launch._AttrValue) == 64
    assert ctypes.sizeof(launch._Attr) == 72 and launch._Attr.value.offset == 8
    assert launch._Config.shared_mem.offset == 24
    assert launch._Config.stream.offset == 32
    assert launch._Config.attrs.offset == 40
    assert launch._Config.n_attrs.offset == 48
    assert ctypes.sizeof(launch._Config) == 56


def test_dims():
    assert launch._dims(7) == (7, 1, 1)
    assert launch._dims((3, 4)) == (3, 4, 1)
    assert launch._dims(np.int64(5)) == (5, 1, 1)
    with pytest.raises(ValueError):
        launch._dims(())


def test_scalar_arguments_keep_their_width():
    pytest.importorskip("cupy")
    cases = [(np.int32(-3), ctypes.c_int32, -3), (np.int64(1 << 40), ctypes.c_int64, 1 << 40),
             (np.uint32(7), ctypes.c_uint32, 7), (np.float32(1.5), ctypes.c_float, 1.5),
             (np.uintp(0), ctypes.c_size_t, 0), (5, ctypes.c_int64, 5), (2.5, ctypes.c_double, 2.5)]
    for value, ctype, expect in cases:
        v = launch.c_arg(value)
        assert ctypes.sizeof(v) == ctypes.sizeof(ctype), value
        assert v.value == expect
    with pytest.raises(TypeError, match="kernel argument of type str"):
        launch.c_arg("x")


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("GGUF_PREFILL_PDL", "0")
    assert launch.pdl_enabled() is False


def test_kernel_defines(monkeypatch):
    from engine.gpu import kernels

    monkeypatch.delenv("GGUF_PREFILL_KERNEL_DEFINES", raising=False)
    assert kernels.kernel_defines() == ()
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "MMVQ_UNROLL=4 GGP_FLAG")
    assert kernels.kernel_defines() == ("-DMMVQ_UNROLL=4", "-DGGP_FLAG")
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "AW_BK=128,AW_STAGES=3")
    assert kernels.kernel_defines() == ("-DAW_BK=128", "-DAW_STAGES=3")
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "X=1;rm")
    with pytest.raises(ValueError, match="GGUF_PREFILL_KERNEL_DEFINES: 'X=1;rm'"):
        kernels.kernel_defines()


def test_file_defines(monkeypatch):
    """A define set reaches only the files that name its macros (their builds change; every
    other kernel keeps its build and its compile cache)."""
    from engine.gpu import kernels

    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "AW_PROD=1,MMVQ_NW=8 AT_LSUM4=1 NO_SUCH_MACRO")
    assert kernels.file_defines("attention_wgmma.cu") == ("-DAW_PROD=1", "-DAT_LSUM4=1")
    assert kernels.file_defines("attention_prefill.cu") == ("-DAT_LSUM4=1",)     # via attention_common.cuh
    assert kernels.file_defines("mmvq_q4_k.cu") == ("-DMMVQ_NW=8",)
    assert kernels.file_defines("rmsnorm.cu") == ()
    monkeypatch.delenv("GGUF_PREFILL_KERNEL_DEFINES")
    assert kernels.file_defines("attention_wgmma.cu") == ()


def test_define_value(monkeypatch):
    """A launcher's reading of a define: its integer, the default when absent, a named error."""
    from engine.gpu import kernels
    from engine.gpu.ops.attention import attention_smem_bytes, wgmma_block_threads, wgmma_warpgroups
    from engine.gpu.ops.mmvq import mmvq_warps

    monkeypatch.delenv("GGUF_PREFILL_KERNEL_DEFINES", raising=False)
    assert kernels.define_value("AW_NWG", 2) == 2 == wgmma_warpgroups()
    assert wgmma_block_threads() == 384                                    # 2 consumer warpgroups, a producer
    assert attention_smem_bytes(128, "wgmma") == 224 * 1024 + 3 * 16      # tiles, then mbarriers
    assert mmvq_warps() == 4
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "MMVQ_UNROLL=4 AW_NWG=3,MMVQ_NW=8 AW_BK=64,AW_STAGES=4 AW_PROD=0")
    assert wgmma_warpgroups() == 3 and attention_smem_bytes(128, "wgmma") == 176 * 1024 + 4 * 16
    assert wgmma_block_threads() == 384
    assert mmvq_warps() == 8
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "AW_SPLIT=1")     # 3 K + 3 V tiles, 12 mbarriers
    assert attention_smem_bytes(128, "wgmma") == 224 * 1024 + 12 * 8
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "AW_PROD=0")      # no producer warpgroup
    assert wgmma_block_threads() == 256 and attention_smem_bytes(128, "wgmma") == 224 * 1024 + 3 * 16
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "AW_NWG=3")
    with pytest.raises(ValueError, match="240 KB of shared memory"):
        attention_smem_bytes(128, "wgmma")
    monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "AW_NWG=x3")
    with pytest.raises(ValueError, match="AW_NWG='x3' is not an integer"):
        wgmma_warpgroups()

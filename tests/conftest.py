"""Shared fixtures: the tiny synthetic model, the default model, GPU detection."""
from __future__ import annotations

import os

import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cp():
    """CuPy (or the CPU emulator standing in for it) with a device; skip without one."""
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device")
    return cupy


def default_model_file() -> str:
    """Path of the default model; skip (or fail, with GGUF_PREFILL_REQUIRE_MODEL=1) when absent."""
    from engine.tools.fetch import default_model_path

    path = default_model_path()
    if not os.path.exists(path):
        if os.environ.get("GGUF_PREFILL_REQUIRE_MODEL") == "1":
            pytest.fail(f"default model missing at {path} (run gguf-prefill fetch-model)")
        pytest.skip(f"default model not cached at {path}")
    return path


@pytest.fixture(scope="session")
def default_model_path() -> str:
    return default_model_file()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from engine.tools.synth import write_synthetic

    path = str(tmp_path_factory.mktemp("models") / "tiny.gguf")
    write_synthetic(path, "tiny")
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_model_path(tmp_path_factory) -> str:
    from engine.tools.synth import write_synthetic

    path = str(tmp_path_factory.mktemp("models") / "tiny-qwen2.gguf")
    write_synthetic(path, "tiny-qwen2")
    return path

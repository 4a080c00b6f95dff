"""load_model's backend choice: `--device gpu` on a machine without CuPy, without a usable CUDA
driver or without a GPU is one stderr line naming which, exit 2 (CuPy faked by monkeypatching,
so this runs on a CPU-only machine)."""
from __future__ import annotations

import contextlib
import io
import sys
import types

import pytest

from engine import loader
from engine.errors import GGUFError


class FakeCUDARuntimeError(RuntimeError):
    """Like cupy_backends.cuda.api.runtime.CUDARuntimeError: the cudaError_t in .status."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def fake_cupy(device_count=None, status=None, msg=""):
    def get_device_count():
        if status is not None:
            raise FakeCUDARuntimeError(status, msg)
        return device_count

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count))
    return cupy


CASES = {
    # name: (sys.modules["cupy"], words the error line must hold)
    "no-cupy": (None, ("CuPy is not installed", "cuda12")),
    "no-driver": (fake_cupy(status=35, msg="cudaErrorInsufficientDriver: CUDA driver version is "
                                           "insufficient for CUDA runtime version"),
                  ("no usable CUDA driver", "cudaErrorInsufficientDriver")),
    "no-libcuda": (fake_cupy(status=34, msg="cudaErrorStubLibrary: CUDA driver is a stub library"),
                   ("no usable CUDA driver",)),
    "no-gpu-status": (fake_cupy(status=100, msg="cudaErrorNoDevice: no CUDA-capable device is detected"),
                      ("no GPU",)),
    "no-gpu-zero": (fake_cupy(device_count=0), ("no GPU", "0 devices")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_problem_names_what_is_missing(monkeypatch, name):
    module, words = CASES[name]
    monkeypatch.setitem(sys.modules, "cupy", module)
    problem = loader.gpu_problem()
    assert problem is not None and "\n" not in problem
    for w in words:
        assert w in problem, problem
    assert loader.gpu_available() is False


def test_gpu_present(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(device_count=1))
    assert loader.gpu_problem() is None


@pytest.mark.parametrize("name", ["no-cupy", "no-driver", "no-gpu-zero"])
def test_load_model_device_gpu_is_a_gguf_error(monkeypatch, tiny_model_path, name):
    module, words = CASES[name]
    monkeypatch.setitem(sys.modules, "cupy", module)
    with pytest.raises(GGUFError) as e:
        loader.load_model(tiny_model_path, device="gpu")
    assert "--device gpu" in str(e.value) and words[0] in str(e.value)


@pytest.mark.parametrize("name", ["no-cupy", "no-driver", "no-gpu-zero"])
def test_auto_falls_back_to_cpu(monkeypatch, tiny_model_path, name):
    monkeypatch.setitem(sys.modules, "cupy", CASES[name][0])
    m = loader.load_model(tiny_model_path, device="auto")
    assert type(m).__name__ == "ReferenceModel"


@pytest.mark.parametrize("name", ["no-cupy", "no-driver", "no-gpu-zero"])
def test_cli_device_gpu_one_line_exit_2(monkeypatch, tiny_model_path, name):
    from engine.cli import main

    module, words = CASES[name]
    monkeypatch.setitem(sys.modules, "cupy", module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", "--model", tiny_model_path, "--device", "gpu", "--prompt-ids", "1,2", "-n", "1"])
    lines = err.getvalue().splitlines()
    assert rc == 2 and len(lines) == 1, err.getvalue()
    assert lines[0].startswith("gguf-prefill generate: error: ") and words[0] in lines[0]


def test_gpu_backend_start_failure_is_one_line(monkeypatch, tiny_model_path):
    """CuPy sees a GPU but the backend cannot start (e.g. NVRTC missing): GGUFError, not a traceback."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(device_count=1))
    import engine.gpu.model as gm

    class Broken:
        def __init__(self, *a, **k):
            raise ImportError("libnvrtc.so.12: cannot open shared object file\nsecond line")

    monkeypatch.setattr(gm, "GPUModel", Broken)
    with pytest.raises(GGUFError) as e:
        loader.load_model(tiny_model_path, device="gpu")
    assert "GPU backend cannot start" in str(e.value) and "\n" not in str(e.value)


def test_bad_device_name():
    with pytest.raises(ValueError):
        loader.load_model("x.gguf", device="tpu")

"""load_model(path, device): pick the backend. "auto" takes the GPU when CuPy sees one."""
from __future__ import annotations

import os

from engine.errors import GGUFError
from engine.formats.weights import open_model


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def load_model(path: str | os.PathLike, device: str = "auto", progress: bool = False):
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, not {device!r}")
    model_file = open_model(path)
    if device == "gpu" or (device == "auto" and gpu_available()):
        try:
            from engine.gpu.model import GPUModel
        except ImportError as e:
            if device == "gpu":
                raise GGUFError(f"{model_file.path}: the GPU backend is not available ({e})") from None
        else:
            return GPUModel(model_file, progress=progress)
    from engine.reference.model import ReferenceModel

    return ReferenceModel(model_file)

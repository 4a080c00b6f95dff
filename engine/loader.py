"""load_model(path, device): pick the backend. "auto" takes the GPU when CuPy sees one.

`--device gpu` on a machine that cannot run it is a GGUFError naming which part is missing
(`gpu_problem()`): CuPy not installed, no usable CUDA driver, or no GPU.
"""
from __future__ import annotations

import os

from engine.errors import GGUFError
from engine.formats.weights import ModelFile, open_model

# cudaError_t values that mean "there is no GPU" rather than "the driver is missing or broken"
_NO_DEVICE_STATUS = {100}  # cudaErrorNoDevice


def _brief(e: BaseException) -> str:
    """An exception as one short line (CuPy's import errors run to several paragraphs)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def gpu_problem() -> str | None:
    """None when CuPy sees at least one GPU; else one line saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        return (f"CuPy is not installed ({_brief(e)}); install the cuda12 or cuda13 extra, "
                f"e.g. pip install -e '.[cuda12]'")
    except Exception as e:  # a broken CuPy install
        return f"CuPy failed to import ({type(e).__name__}: {_brief(e)})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError carries the cudaError_t in .status
        if getattr(e, "status", None) in _NO_DEVICE_STATUS:
            return f"no GPU: the CUDA driver finds no device ({_brief(e)})"
        return f"no usable CUDA driver ({type(e).__name__}: {_brief(e)})"
    if n <= 0:
        return "no GPU: the CUDA driver reports 0 devices"
    return None


def gpu_available() -> bool:
    return gpu_problem() is None


def load_model(path: str | os.PathLike | ModelFile, device: str = "auto", progress: bool = False):
    """The model on the chosen backend; `path` may be an already validated ModelFile."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, not {device!r}")
    model_file = path if isinstance(path, ModelFile) else open_model(path)
    use_gpu = device == "gpu"
    if device != "cpu":
        problem = gpu_problem()
        if problem is not None and device == "gpu":
            raise GGUFError(f"{model_file.path}: --device gpu: {problem}")
        use_gpu = problem is None
    if use_gpu:
        from engine.gpu.model import GPUModel

        try:
            return GPUModel(model_file, progress=progress)
        except (ImportError, OSError) as e:  # e.g. NVRTC or a CUDA library missing
            raise GGUFError(f"{model_file.path}: the GPU backend cannot start "
                            f"({type(e).__name__}: {_brief(e)})") from None
    from engine.reference.model import ReferenceModel

    return ReferenceModel(model_file)

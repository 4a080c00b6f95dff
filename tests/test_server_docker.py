"""The Dockerfile, as far as it can be checked without a Docker engine: parsed by the official
parser (the `dockerfile` package wraps moby/buildkit's), its properties asserted, and its install
step run in a fresh virtual environment from exactly the files its COPY lines put in the image."""

from __future__ import annotations

import fnmatch
import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_fixtures import free_port

REPO = Path(__file__).resolve().parents[1]
dockerfile = pytest.importorskip("dockerfile")


@pytest.fixture(scope="module")
def commands():
    return dockerfile.parse_file(str(REPO / "Dockerfile"))


def only(commands, cmd):
    found = [c for c in commands if c.cmd.upper() == cmd]
    assert len(found) == 1, f"expected one {cmd}, found {len(found)}"
    return found[0]


def test_base_is_cuda12_runtime(commands):
    assert commands[0].cmd.upper() == "FROM"
    (image,) = [c for c in commands if c.cmd.upper() == "FROM"]
    name = image.value[0]
    assert name.startswith("nvidia/cuda:12."), name
    assert "-runtime-" in name, name


def test_installs_package_with_cuda12_extra(commands):
    runs = [" ".join(c.value) for c in commands if c.cmd.upper() == "RUN"]
    assert any("pip install" in r and ".[cuda12]" in r for r in runs), runs
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("cupy-cuda12x") for d in extras["cuda12"])


def test_runs_as_non_root(commands):
    users = [c for c in commands if c.cmd.upper() == "USER"]
    assert users, "no USER: the server would run as root"
    last_user = users[-1]
    assert last_user.value[0] not in ("root", "0", "0:0")
    entry = only(commands, "ENTRYPOINT")
    assert last_user.start_line < entry.start_line
    # the user is created before it is used
    runs = " ".join(" ".join(c.value) for c in commands if c.cmd.upper() == "RUN" and c.start_line < last_user.start_line)
    assert f"useradd" in runs and last_user.value[0] in runs


def test_expose_healthcheck_entrypoint_cmd(commands):
    assert only(commands, "EXPOSE").value == ("8080",)
    hc = only(commands, "HEALTHCHECK")
    assert hc.value[0] == "CMD" and hc.json
    assert any("http://127.0.0.1:8080/health" in v for v in hc.value)
    entry = only(commands, "ENTRYPOINT")
    assert entry.json and list(entry.value) == ["gguf-prefill", "serve"]
    cmd = only(commands, "CMD")
    assert cmd.json
    args = list(cmd.value)
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--port") + 1] == "8080"


def test_models_volume(commands):
    vol = only(commands, "VOLUME")
    assert "/models" in vol.value
    env = {}
    for c in commands:
        if c.cmd.upper() == "ENV":
            env.update(dict(zip(c.value[0::2], c.value[1::2])))
    assert env["GGUF_PREFILL_HOME"] == "/models"  # the default model is looked up there
    assert env["GGUF_PREFILL_HOST"] == "0.0.0.0" and env["GGUF_PREFILL_PORT"] == "8080"


def copied_paths(commands) -> list[str]:
    out = []
    for c in commands:
        if c.cmd.upper() == "COPY":
            assert not any(f.startswith("--from") for f in c.flags)
            out.extend(c.value[:-1])
    return out


def test_copy_sources_exist_and_are_not_dockerignored(commands):
    ignore = [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
              if l.strip() and not l.startswith("#")]
    paths = copied_paths(commands)
    assert {"pyproject.toml", "README.md", "engine", "server", "kernels_cu"} <= set(paths)
    for p in paths:
        assert (REPO / p).exists(), p
        assert not any(fnmatch.fnmatch(p, pat) for pat in ignore), (p, "is in .dockerignore")


@pytest.mark.slow
def test_install_step_in_fresh_venv(commands, tmp_path, tiny_model_path):
    """The image's `pip install .` on exactly the COPY'd files, in a fresh venv: the package
    builds (isolated build, as in the image), the console script exists, and the INSTALLED
    `gguf-prefill serve` (run outside the source tree) answers /health.

    --no-deps with --system-site-packages: the runtime dependencies come from this machine
    (CuPy for [cuda12] can't be installed here); our own package is built and installed for real.
    """
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for p in copied_paths(commands):
        src = REPO / p
        if src.is_dir():
            shutil.copytree(src, ctx / p, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, ctx / p)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    # --system-site-packages reaches the BASE interpreter's packages; when pytest itself runs in a
    # venv, the runtime dependencies are in that venv's site-packages: list them in a .pth file
    # (plain path lines: the outer venv's own .pth files, e.g. our editable install, stay inactive).
    if sys.prefix != sys.base_prefix:
        new_site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        Path(new_site, "_outer_venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-deps", "--disable-pip-version-check",
                          "-q", str(ctx)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    script = venv / "bin" / "gguf-prefill"
    assert script.exists()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GGUF_PREFILL_API_KEY")}
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import engine, server, kernels_cu, os; "
                            "print(os.path.dirname(server.__file__)); "
                            "print(sorted(f for f in os.listdir(os.path.dirname(kernels_cu.__file__)) if f.endswith('.cu')))"],
                           cwd=outside, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert where.stdout.splitlines()[0].startswith(str(venv))
    assert where.stdout.splitlines()[1] == str(sorted(p.name for p in (REPO / "kernels_cu").glob("*.cu")))
    port = free_port()
    proc = subprocess.Popen([str(script), "serve", "-m", tiny_model_path, "--host", "127.0.0.1",
                             "--port", str(port), "--device", "cpu"], cwd=outside, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        ok = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            if ok:
                break
            time.sleep(0.1)
        assert ok, f"installed server never became healthy (exit {proc.poll()})"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0

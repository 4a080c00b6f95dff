"""Helpers for the server tests: start a REAL server process (uvicorn) on 127.0.0.1 and talk
to it. Every wait is bounded in time; all traffic stays on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m engine serve ...` (or `python -m server ...`) in a subprocess, output to a
    log file. `url` is http://127.0.0.1:PORT."""

    def __init__(self, model: str | None, args: list[str] = (), env: dict[str, str] | None = None,
                 log_dir: Path | None = None, via_cli: bool = True, device: str = "cpu",
                 script: str | os.PathLike | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if script is not None:  # a test's own entry point, given the same flags
            cmd = [sys.executable, str(script)]
        else:
            cmd = [sys.executable, "-m", "engine", "serve"] if via_cli else [sys.executable, "-m", "server"]
        if model is not None:
            cmd += ["-m", model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--device", device, *args]
        self.cmd = cmd
        full_env = dict(os.environ)
        full_env.pop("GGUF_PREFILL_API_KEY", None)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        log_dir = log_dir or Path("/tmp")
        self.log_path = log_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = START_TIMEOUT_S, headers: dict | None = None) -> list[int]:
        """Poll /health until 200; returns every status it answered on the way."""
        deadline = time.monotonic() + timeout
        seen: list[int] = []
        with httpx.Client(timeout=2.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    status = c.get(self.url + "/health").status_code
                    seen.append(status)
                    if status == 200:
                        return seen
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log()}")

    def terminate(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """Parse `data: ...` lines of an SSE stream; yields dicts, and the string "[DONE]"."""
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as written, sorted)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    if labels:
        lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return m.get(f"{name}{{{lab}}}", 0.0)
    return m.get(name, 0.0)

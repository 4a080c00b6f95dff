"""On the default model, CPU backend: a completion over HTTP returns the same tokens (and text)
as `gguf-prefill generate`. Slow (two loads of a 1.5B model on numpy: ~2 minutes, ~7 GB each,
one after the other)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from server_fixtures import REPO, ServerProcess

PROMPT = "def fibonacci(n):"
N = 8


@pytest.mark.model
@pytest.mark.slow
def test_http_completion_equals_cli_generate(default_model_path, tmp_path):
    cli = subprocess.run([sys.executable, "-m", "engine", "generate", "-m", default_model_path, "--device", "cpu",
                          "--prompt", PROMPT, "-n", str(N), "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-2000:]
    want = json.loads(cli.stdout.strip().splitlines()[-1])
    with ServerProcess(default_model_path, ["--ctx-size", "512"], log_dir=tmp_path) as s:
        s.wait_ready(timeout=600)
        with httpx.Client(base_url=s.url, timeout=600) as c:
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "return_tokens": True})
            assert r.status_code == 200, r.text
            body = r.json()
            toks = c.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    assert toks == want["prompt_ids"]
    choice = body["choices"][0]
    assert choice["tokens"] == want["tokens"]
    assert choice["text"] == want["text"]
    assert body["usage"]["prompt_tokens"] == len(want["prompt_ids"])
    assert body["timings"]["predicted_n"] == len(want["tokens"])

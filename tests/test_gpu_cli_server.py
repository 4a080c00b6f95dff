"""The user-facing verbs on the GPU backend, on the real-weight slice (.gpu_data/slice.gguf):
`greedy32 --device gpu` against the goldens the numpy reference recorded (tests/goldens,
margin rule, free run and teacher-forced), and the HTTP server started with `--device gpu`
answering a completion with exactly the tokens of `generate --device gpu` (same backend, same
greedy path), plus the prefill probe and its metrics. Marker `gpu`; the server part needs
fastapi/uvicorn/httpx (carried as wheels to the device, see scripts/gpu_check.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLICE = ROOT / ".gpu_data" / "slice.gguf"
GOLDEN = ROOT / "tests" / "goldens" / "decode_slice.json"
PROMPT_IDS = [785, 11, 1879, 0, 576, 3974, 315, 279, 1156, 374, 220, 17]   # < 4096: the slice's vocab
N = 16

pytestmark = pytest.mark.gpu


def _slice() -> str:
    if not SLICE.exists():
        pytest.skip(f"{SLICE} missing (python -m engine slice ..., see tests/goldens/README.md)")
    return str(SLICE)


def _engine(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("teacher", [False, True], ids=["free-run", "teacher-forced"])
def test_cli_greedy32_on_gpu_matches_reference_goldens(teacher):
    args = ["greedy32", "-m", _slice(), "--device", "gpu", "--golden", str(GOLDEN), "--min-margin", "1.0"]
    r = _engine(*args, *(["--teacher-forced"] if teacher else []))
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_gpu_server_completion_equals_cli_generate(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from server_fixtures import ServerProcess, metric, parse_metrics

    model = _slice()
    ids = ",".join(map(str, PROMPT_IDS))
    cli = _engine("generate", "-m", model, "--device", "gpu", "--prompt-ids", ids, "-n", str(N), "--json")
    assert cli.returncode == 0, cli.stderr[-3000:]
    want = json.loads(cli.stdout.strip().splitlines()[-1])
    with ServerProcess(model, ["--ctx-size", "4096"], log_dir=tmp_path, device="gpu") as s:
        s.wait_ready(timeout=300)
        with httpx.Client(base_url=s.url, timeout=300) as c:
            models = c.get("/v1/models").json()
            r = c.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": N, "return_tokens": True})
            assert r.status_code == 200, r.text
            body = r.json()
            probe = c.post("/v1/prefill", json={"n_tokens": 2048})
            assert probe.status_code == 200, probe.text
            timings = probe.json()["timings"]
            m = parse_metrics(c.get("/metrics").text)
    assert models["data"][0]["meta"]["device"] == "gpu", models
    assert body["choices"][0]["tokens"] == want["tokens"]
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert timings["prompt_n"] == 2048 and timings["prompt_per_second"] > 0
    assert metric(m, "gguf_prefill_prompt_tokens_total") >= 2048 + len(PROMPT_IDS)
    print(json.dumps({"test": "gpu_server", "tokens": N, "prefill_2048_tok_s": timings["prompt_per_second"],
                      "completion_timings": body["timings"]}))

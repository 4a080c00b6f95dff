"""The CLI end to end on the tiny synthetic model (subprocesses, as a user runs it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, timeout=180):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_tokenize_detokenize_round_trip(tiny_model_path):
    r = cli("tokenize", "--model", tiny_model_path, "--text", "the cat sat")
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout.strip().splitlines()[-1])
    assert ids and all(isinstance(i, int) for i in ids)
    r = cli("detokenize", "--model", tiny_model_path, "--ids", ",".join(map(str, ids)))
    assert r.returncode == 0 and r.stdout.rstrip("\n") == "the cat sat"


def test_generate_json(tiny_model_path):
    r = cli("generate", "--model", tiny_model_path, "--device", "cpu", "--prompt", "hello", "-n", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) <= 5 and out["timings"]["prompt_n"] == len(out["prompt_ids"])


def test_greedy32_record_replay_and_mismatch(tiny_model_path, tmp_path):
    src = tmp_path / "prompts.json"
    src.write_text(json.dumps({"greedy": [
        {"prompt": "a", "prompt_ids": [5, 6, 7], "tokens": [], "margin": []},
        {"prompt": "b", "prompt_ids": [100, 3], "tokens": [], "margin": []}]}))
    rec = tmp_path / "rec.json"
    r = cli("greedy32", "--model", tiny_model_path, "--device", "cpu", "--golden", str(src), "--record", str(rec))
    assert r.returncode == 0, r.stderr
    golden = json.loads(rec.read_text())
    assert all(len(c["tokens"]) == len(c["margin"]) > 0 for c in golden["greedy"])
    for extra in ([], ["--teacher-forced"], ["--min-margin", "0.5"]):
        r = cli("greedy32", "--model", tiny_model_path, "--device", "cpu", "--golden", str(rec), *extra)
        assert r.returncode == 0, (extra, r.stdout, r.stderr)
        assert "2/2 prompts match" in r.stdout
    # a changed golden token is a mismatch: exit 1, first divergence reported
    golden["greedy"][0]["tokens"][0] = (golden["greedy"][0]["tokens"][0] + 1) % 256
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(golden))
    r = cli("greedy32", "--model", tiny_model_path, "--device", "cpu", "--golden", str(bad))
    assert r.returncode == 1 and "1/2 prompts match" in r.stdout


def test_greedy32_bad_goldens_exit_2(tiny_model_path, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"greedy": [{"prompt_ids": "nope"}]}')
    r = cli("greedy32", "--model", tiny_model_path, "--device", "cpu", "--golden", str(bad))
    assert r.returncode == 2 and "prompt_ids" in r.stderr and "Traceback" not in r.stderr


def test_bad_ids_exit_2(tiny_model_path):
    r = cli("detokenize", "--model", tiny_model_path, "--ids", "1,x")
    assert r.returncode == 2 and "--ids" in r.stderr and "Traceback" not in r.stderr
    r = cli("generate", "--model", tiny_model_path, "--device", "cpu", "--prompt-ids", "999999", "-n", "1")
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr


def test_synth_and_slice(tmp_path, tiny_model_path):
    out = tmp_path / "t.gguf"
    r = cli("synth", "--shape", "tiny-qwen2", str(out))
    assert r.returncode == 0 and out.exists(), r.stderr
    sl = tmp_path / "s.gguf"
    r = cli("slice", "--model", tiny_model_path, "--layers", "1,3", "--vocab", "300", "--ffn", "256", str(sl))
    assert r.returncode == 0, r.stderr
    from engine.formats.weights import open_model

    src, cut = open_model(tiny_model_path), open_model(str(sl))
    assert (cut.config.n_layers, cut.config.vocab_size, cut.config.d_ff) == (2, 300, 256)
    # bytes copied: layer 1 of the source is layer 0 of the slice; first rows of the embedding
    import numpy as np

    a = src.tensor("blk.1.attn_q.weight").data
    b = cut.tensor("blk.0.attn_q.weight").data
    assert np.array_equal(a, b)
    assert np.array_equal(src.tensor("token_embd.weight").data[:300], cut.tensor("token_embd.weight").data)
    down_src, down_cut = src.tensor("blk.3.ffn_down.weight"), cut.tensor("blk.1.ffn_down.weight")
    assert np.array_equal(down_src.data[:, : down_cut.data.shape[1]], down_cut.data)

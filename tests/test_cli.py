"""The CLI end to end on the tiny synthetic model (subprocesses, as a user runs it), and every bad
input as one stderr line with exit status 2 (in-process through engine.cli.main)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


# ----------------------------------------------------------------------------- bad input: one line, exit 2

def run_main(*argv):
    """engine.cli.main in-process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    from engine.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def one_error_line(rc, err, *words):
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and err.endswith("\n"), (rc, err)
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_generate_n_capped_by_context(tiny_model_path):
    rc, _, err = run_main("generate", "--model", tiny_model_path, "--device", "cpu", "--prompt", "hi",
                          "-n", "1000000000")
    one_error_line(rc, err, "-n 1000000000", "context of 2048 tokens", "at most")
    rc, _, err = run_main("generate", "--model", tiny_model_path, "--device", "cpu", "--prompt-ids", "1,2",
                          "-n", "2047")
    one_error_line(rc, err, "at most 2046")
    rc, _, err = run_main("generate", "--model", tiny_model_path, "--device", "cpu", "--prompt-ids", "1",
                          "-n", "-1")
    one_error_line(rc, err, "-n must be >= 0")


@pytest.mark.parametrize("ids,words", [
    ("1e30", ("--prompt-ids", "1e30")),
    ("100000000000000000000000", ("outside the vocabulary",)),
    ("9" * 5000, ("outside the vocabulary",)),
    ("-1", ("outside the vocabulary",)),
    ("1,,2", ("empty entry",)),
    (",", ("--prompt-ids",)),
    ("", ("no token ids",)),
    ("1,\x1b[2J\n", ("\\x1b",)),
    ("999999", ("outside the vocabulary (0..511)",)),
])
def test_generate_bad_prompt_ids(tiny_model_path, ids, words):
    rc, _, err = run_main("generate", "--model", tiny_model_path, "--device", "cpu", "--prompt-ids", ids, "-n", "1")
    line = one_error_line(rc, err, *words)
    assert len(line) < 2100


def test_undecodable_prompt_in_process(tiny_model_path):
    # Python hands undecodable argv bytes over as lone surrogates (surrogateescape)
    for argv in (("generate", "--device", "cpu", "--prompt", "\udcff", "-n", "1"),
                 ("tokenize", "--text", "a\udcffb")):
        rc, _, err = run_main(argv[0], "--model", tiny_model_path, *argv[1:])
        one_error_line(rc, err, "not valid UTF-8", "0xff")


def test_undecodable_prompt_argv_bytes(tiny_model_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", tiny_model_path, "--device", "cpu",
                        "--prompt", b"\xff", "-n", "1"], capture_output=True, timeout=180, env=env, cwd=ROOT)
    err = r.stderr.decode("utf-8", "replace")
    one_error_line(r.returncode, err, "--prompt", "not valid UTF-8", "byte 0xff")


def test_detokenize_id_past_vocab(tiny_model_path):
    rc, _, err = run_main("detokenize", "--model", tiny_model_path, "--ids", "512")
    one_error_line(rc, err, "--ids", "512", "outside the vocabulary (0..511)")
    rc, out, err = run_main("detokenize", "--model", tiny_model_path, "--ids", "511")
    assert rc == 0, err


def test_usage_errors_are_one_line(tiny_model_path):
    rc, _, err = run_main("generate", "--model", tiny_model_path, "-n", "abc", "--prompt", "x")
    one_error_line(rc, err, "gguf-prefill generate: error:", "invalid int value")
    rc, _, err = run_main("nosuchverb")
    one_error_line(rc, err, "invalid choice")
    rc, _, err = run_main("generate", "--model", tiny_model_path, "--device", "cpu", "--prompt", "x",
                          "--prompt-ids", "1")
    one_error_line(rc, err, "exactly one of")


def test_version():
    from importlib.metadata import version

    rc, out, err = run_main("--version")
    assert rc == 0 and out.strip() == f"gguf-prefill {version('gguf-prefill')}"


def test_every_help_shows_defaults():
    import argparse

    from engine.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert "serve" in p.format_help()
    checked = 0
    for name, sp in sub.choices.items():
        text = " ".join(sp.format_help().split())
        for a in sp._actions:
            if a.help == argparse.SUPPRESS or a.default in (None, False, argparse.SUPPRESS) or a.nargs == 0:
                continue
            assert f"(default: {a.default})" in text, (name, a.dest, text)
            checked += 1
    assert checked >= 9


def test_serve_goes_to_the_servers_entry_point(monkeypatch):
    import server.main

    seen = []
    monkeypatch.setattr(server.main, "main", lambda argv=None: seen.append(argv) or 0)
    rc, _, _ = run_main("serve", "--port", "8081", "-m", "x.gguf")
    assert rc == 0 and seen == [["--port", "8081", "-m", "x.gguf"]]


def test_cli_does_not_import_the_server():
    code = ("import sys, engine.cli as c; c.build_parser().parse_args(['tokenize', '--text', 'x']); "
            "bad = [m for m in sys.modules if m == 'server' or m.startswith('server.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_warnings_are_one_line_each_after_success(tiny_model_path, monkeypatch):
    import warnings

    import engine.cli as cli

    def noisy(args):
        warnings.warn("first\nsecond", UserWarning)
        warnings.warn("first\nsecond", UserWarning)
        return 0

    def noisy_fail(args):
        warnings.warn("ignored after an error")
        raise cli.UsageError("boom")

    monkeypatch.setattr(cli, "cmd_tokenize", noisy)
    rc, _, err = run_main("tokenize", "--text", "x")
    assert rc == 0 and err == "gguf-prefill tokenize: warning: UserWarning: first\\nsecond\n"
    monkeypatch.setattr(cli, "cmd_tokenize", noisy_fail)
    rc, _, err = run_main("tokenize", "--text", "x")
    one_error_line(rc, err, "boom")

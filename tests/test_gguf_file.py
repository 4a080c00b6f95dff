"""Loader validation: corrupt and inconsistent files give GGUFError naming file and field/tensor,
and the CLI turns that into one stderr line with exit status 2."""
from __future__ import annotations

import os
import random
import struct
import subprocess
import sys

import numpy as np
import pytest

from engine.errors import GGUFError
from engine.formats.gguf_file import _Cursor, _read_value, open_gguf, read_metadata
from engine.formats.weights import open_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout(data: bytes):
    """Byte positions of the header counts and of each tensor info's fields."""
    cur = _Cursor(data, "mem")
    cur.pos = 8
    n_tensors, n_kv = cur.unpack("Q", "t"), cur.unpack("Q", "k")
    kv = {}
    for _ in range(n_kv):
        key = cur.string("key").decode()
        start = cur.pos
        vtype = cur.unpack("I", "type")
        _read_value(cur, vtype, key)
        kv[key] = start
    tensors = {}
    for _ in range(n_tensors):
        name_pos = cur.pos
        name = cur.string("name").decode()
        n_dims = cur.unpack("I", "n_dims")
        dims_pos = cur.pos
        cur.pos += 8 * n_dims
        type_pos = cur.pos
        cur.pos += 4
        offset_pos = cur.pos
        cur.pos += 8
        tensors[name] = {"name": name_pos, "dims": dims_pos, "type": type_pos, "offset": offset_pos}
    return {"tensor_count": 8, "kv_count": 16, "kv": kv, "tensors": tensors}


@pytest.fixture(scope="module")
def tiny_bytes(tiny_model_path) -> bytes:
    with open(tiny_model_path, "rb") as f:
        return f.read()


def write(tmp_path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def patched(data: bytes, pos: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, pos, value)
    return bytes(b)


def expect_error(path: str, *words: str) -> str:
    with pytest.raises(GGUFError) as e:
        open_model(path)
    msg = str(e.value)
    assert path in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_valid_tiny_model_opens(tiny_model_path):
    m = open_model(tiny_model_path)
    assert m.config.n_layers >= 1
    assert read_metadata(tiny_model_path)["general.architecture"] == m.config.arch


def test_truncated_file(tmp_path, tiny_bytes):
    for cut in (3, 20, 200, len(tiny_bytes) // 2, len(tiny_bytes) - 1):
        msg = expect_error(write(tmp_path, f"trunc{cut}.gguf", tiny_bytes[:cut]))
        assert "truncated" in msg or "past the end" in msg or "bad magic" in msg


def test_empty_file(tmp_path):
    expect_error(write(tmp_path, "empty.gguf", b""), "empty")


def test_bad_magic(tmp_path, tiny_bytes):
    expect_error(write(tmp_path, "magic.gguf", b"GGML" + tiny_bytes[4:]), "bad magic")


def test_wrong_version(tmp_path, tiny_bytes):
    for v in (1, 4, 0xFFFFFFFF):
        expect_error(write(tmp_path, f"v{v}.gguf", patched(tiny_bytes, 4, "I", v)), "version")


def test_huge_counts(tmp_path, tiny_bytes):
    lay = layout(tiny_bytes)
    expect_error(write(tmp_path, "tc.gguf", patched(tiny_bytes, lay["tensor_count"], "Q", 1 << 62)),
                 "tensor_count")
    expect_error(write(tmp_path, "kc.gguf", patched(tiny_bytes, lay["kv_count"], "Q", 1 << 62)), "kv_count")
    # an array count inside the metadata (the vocabulary) claims billions of entries
    tok_pos = lay["kv"]["tokenizer.ggml.tokens"]
    expect_error(write(tmp_path, "arr.gguf", patched(tiny_bytes, tok_pos + 8, "Q", 1 << 40)),
                 "tokenizer.ggml.tokens")
    # a string length past the end of the file
    expect_error(write(tmp_path, "str.gguf", patched(tiny_bytes, 24, "Q", 1 << 50)), "truncated")


def test_tensor_data_past_end(tmp_path, tiny_bytes):
    lay = layout(tiny_bytes)
    pos = lay["tensors"]["output.weight"]["offset"]
    expect_error(write(tmp_path, "past.gguf", patched(tiny_bytes, pos, "Q", 1 << 40)),
                 "output.weight", "past the end")


def test_shape_disagrees_with_bytes(tmp_path, tiny_bytes):
    lay = layout(tiny_bytes)
    pos = lay["tensors"]["blk.0.ffn_up.weight"]["dims"]
    (ne0,) = struct.unpack_from("<Q", tiny_bytes, pos)
    # a row length that is not a whole number of blocks
    expect_error(write(tmp_path, "rows.gguf", patched(tiny_bytes, pos, "Q", ne0 + 3)), "blk.0.ffn_up.weight")
    # a shape the metadata does not allow (fewer rows: bytes fit, shape is wrong)
    (ne1,) = struct.unpack_from("<Q", tiny_bytes, pos + 8)
    expect_error(write(tmp_path, "shape.gguf", patched(tiny_bytes, pos + 8, "Q", ne1 - 1)),
                 "blk.0.ffn_up.weight", "shape")


def test_unknown_and_unsupported_type(tmp_path, tiny_bytes):
    lay = layout(tiny_bytes)
    pos = lay["tensors"]["blk.0.attn_q.weight"]["type"]
    expect_error(write(tmp_path, "t99.gguf", patched(tiny_bytes, pos, "I", 99)),
                 "blk.0.attn_q.weight", "unknown type id 99")
    expect_error(write(tmp_path, "q80.gguf", patched(tiny_bytes, pos, "I", 8)),
                 "blk.0.attn_q.weight", "Q8_0")


def test_missing_tensor(tmp_path, tiny_bytes):
    lay = layout(tiny_bytes)
    pos = lay["tensors"]["blk.0.ffn_up.weight"]["name"] + 8
    b = bytearray(tiny_bytes)
    b[pos:pos + len("blk.0.ffn_up")] = b"blk.0.ffn_uX"  # same length, different name
    expect_error(write(tmp_path, "missing.gguf", bytes(b)), "missing tensor 'blk.0.ffn_up.weight'")


def test_bad_architecture(tmp_path, tiny_bytes, tiny_model_path):
    arch = read_metadata(tiny_model_path)["general.architecture"]
    lay = layout(tiny_bytes)
    pos = lay["kv"]["general.architecture"] + 4 + 8
    b = bytearray(tiny_bytes)
    b[pos:pos + len(arch)] = b"x" * len(arch)
    expect_error(write(tmp_path, "arch.gguf", bytes(b)), "general.architecture")


def test_random_mutations_only_raise_gguf_error(tmp_path, tiny_bytes):
    """Random byte corruption of the header and tables: GGUFError or success, nothing else."""
    lay = layout(tiny_bytes)
    header_end = max(p["offset"] for p in lay["tensors"].values()) + 8
    rng = random.Random(1234)
    path = str(tmp_path / "mut.gguf")
    outcomes = {"error": 0, "ok": 0}
    for _ in range(150):
        b = bytearray(tiny_bytes)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(header_end)] = rng.randrange(256)
        with open(path, "wb") as f:
            f.write(b)
        try:
            open_model(path)
            outcomes["ok"] += 1
        except GGUFError as e:
            assert path in str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 0


def run_cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def corrupt_variants(data: bytes) -> dict[str, bytes]:
    """One file per kind of corruption the loader must report."""
    lay = layout(data)
    t = lay["tensors"]
    renamed = bytearray(data)
    pos = t["blk.0.ffn_up.weight"]["name"] + 8
    renamed[pos:pos + len("blk.0.ffn_up")] = b"blk.0.ffn_uX"
    (rows,) = struct.unpack_from("<Q", data, t["blk.0.ffn_up.weight"]["dims"] + 8)
    return {
        "truncated": data[: len(data) // 2],
        "bad-magic": b"XXXX" + data[4:],
        "wrong-version": patched(data, 4, "I", 7),
        "data-past-end": patched(data, t["output.weight"]["offset"], "Q", 1 << 40),
        "huge-tensor-count": patched(data, lay["tensor_count"], "Q", 1 << 62),
        "huge-kv-count": patched(data, lay["kv_count"], "Q", 1 << 62),
        "huge-array-count": patched(data, lay["kv"]["tokenizer.ggml.tokens"] + 8, "Q", 1 << 40),
        "shape-vs-bytes": patched(data, t["blk.0.ffn_up.weight"]["dims"] + 8, "Q", rows - 1),
        "unknown-type": patched(data, t["blk.0.attn_q.weight"]["type"], "I", 99),
        "missing-tensor": bytes(renamed),
    }


def test_cli_reports_every_corruption_with_exit_2(tmp_path, tiny_bytes):
    for name, data in corrupt_variants(tiny_bytes).items():
        path = write(tmp_path, name + ".gguf", data)
        r = run_cli("generate", "--model", path, "--device", "cpu", "--prompt-ids", "1,2", "-n", "1")
        assert r.returncode == 2, (name, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and path in lines[0] and "Traceback" not in r.stderr, (name, r.stderr)


def test_cli_missing_file_exit_2(tmp_path):
    r = run_cli("tokenize", "--model", str(tmp_path / "nope.gguf"), "--text", "hi")
    assert r.returncode == 2 and "nope.gguf" in r.stderr and "Traceback" not in r.stderr


def test_tensor_views_match_reader(tiny_model_path):
    gf = open_gguf(tiny_model_path)
    t = gf.tensors["blk.0.attn_q.weight"]
    assert t.data.dtype == np.uint8 and t.data.shape[0] == t.shape[0]

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
from engine.formats.gguf_file import encode_field, encode_string, open_gguf, read_header, read_metadata
from engine.formats.weights import open_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout(data: bytes):
    """Byte positions of the header counts and of each tensor info's fields (read_header spans)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        h = read_header(f.name)
    kv = {e.key: e.value_start for e in h.fields}
    tensors = {}
    for t in h.tensors:
        dims_pos = t.start + 8 + len(t.name.encode()) + 4
        type_pos = dims_pos + 8 * len(t.dims)
        tensors[t.name] = {"name": t.start, "dims": dims_pos, "type": type_pos, "offset": type_pos + 4}
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


# ----------------------------------------------------------------------------- metadata of the wrong kind

def rebuilt(path: str, fields: dict | None = None, drop=(), tensor_names: dict | None = None) -> bytes:
    """The file with metadata entries replaced/added (key -> (vtype, value[, etype])), dropped,
    or tensors renamed, re-encoded through gguf_file's public writer helpers."""
    h = read_header(path)
    raw = open(path, "rb").read()
    fields = dict(fields or {})
    out = bytearray(raw[:8])
    body = bytearray()
    n_kv = 0
    for e in h.fields:
        if e.key in drop:
            continue
        if e.key in fields:
            body += encode_field(e.key, *fields.pop(e.key))
        else:
            body += raw[e.start:e.end]
        n_kv += 1
    for key, spec in fields.items():
        body += encode_field(key, *spec)
        n_kv += 1
    for t in h.tensors:
        name = (tensor_names or {}).get(t.name, t.name)
        body += encode_string(name) + raw[t.start + 8 + len(t.name.encode()):t.end]
    out += struct.pack("<QQ", len(h.tensors), n_kv) + body
    out += b"\0" * ((-len(out)) % h.alignment)
    return bytes(out) + raw[h.data_start:]


NAN, INF = float("nan"), float("inf")
# (key suffix or full key, (vtype, value[, etype]), words the error must hold)
WRONG_KIND = {
    "block_count-inf": ("block_count", (6, INF), ("is not an integer",)),
    "block_count-nan": ("block_count", (12, NAN), ("is not an integer",)),
    "block_count-neg-inf": ("block_count", (6, -INF), ("is not an integer",)),
    "context_length-nan": ("context_length", (6, NAN), ("is not an integer",)),
    "context_length-inf": ("context_length", (12, INF), ("is not an integer",)),
    "context_length-huge": ("context_length", (10, 2**63), ("out of range",)),
    "context_length-zero": ("context_length", (4, 0), ("out of range",)),
    "key_length-float": ("attention.key_length", (6, 64.0), ("is not an integer",)),
    "key_length-array": ("attention.key_length", (9, [64], 4), ("an array of 1", "is not an integer")),
    "key_length-wrong": ("attention.key_length", (4, 32), ("key_length",)),
    "value_length": ("attention.value_length", (4, 32), ("value_length", "not supported")),
    "rope_dims": ("rope.dimension_count", (4, 32), ("partial RoPE",)),
    "rope_scaling-array": ("rope.scaling.type", (9, ["linear"], 8), ("an array of 1", "is not a string")),
    "rope_scaling-linear": ("rope.scaling.type", (8, "linear"), ("not supported",)),
    "head_count-string": ("attention.head_count", (8, "4"), ("is not an integer",)),
    "head_count-bool": ("attention.head_count", (7, True), ("is not an integer",)),
    "freq_base-nan": ("rope.freq_base", (6, NAN), ("is not finite",)),
    "freq_base-neg": ("rope.freq_base", (6, -1.0), ("must be positive",)),
    "eps-inf": ("attention.layer_norm_rms_epsilon", (12, INF), ("is not finite",)),
    "eps-array": ("attention.layer_norm_rms_epsilon", (9, [1e-5], 6), ("is not a number",)),
    "arch-array": ("general.architecture", (9, ["llama"], 8), ("an array of 1", "is not a string")),
    "arch-int": ("general.architecture", (4, 1), ("is not a string",)),
    "tokens-scalar": ("tokenizer.ggml.tokens", (4, 512), ("is not an array",)),
}


@pytest.mark.parametrize("case", list(WRONG_KIND))
def test_metadata_of_the_wrong_kind_names_the_key(tmp_path, tiny_model_path, case):
    suffix, spec, words = WRONG_KIND[case]
    arch = read_metadata(tiny_model_path)["general.architecture"]
    key = suffix if "." in suffix and suffix.split(".")[0] in ("general", "tokenizer") else f"{arch}.{suffix}"
    path = write(tmp_path, f"{case}.gguf", rebuilt(tiny_model_path, {key: spec}))
    msg = expect_error(path, key, *words)
    assert "\n" not in msg


def test_defaults_still_apply_when_fields_are_absent(tmp_path, tiny_model_path):
    arch = read_metadata(tiny_model_path)["general.architecture"]
    drop = [f"{arch}.attention.head_count_kv", f"{arch}.rope.freq_base", f"{arch}.rope.dimension_count",
            f"{arch}.attention.layer_norm_rms_epsilon"]
    path = write(tmp_path, "defaults.gguf", rebuilt(tiny_model_path, drop=drop))
    with pytest.raises(GGUFError, match="shape"):  # head_count_kv defaults to head_count (4, not 2)
        open_model(path)
    path = write(tmp_path, "defaults2.gguf", rebuilt(tiny_model_path, drop=drop[1:]))
    cfg = open_model(path).config
    assert cfg.rope_base == 10000.0 and cfg.rms_eps == 1e-5


def test_duplicate_key(tmp_path, tiny_model_path):
    arch = read_metadata(tiny_model_path)["general.architecture"]
    h = read_header(tiny_model_path)
    raw = open(tiny_model_path, "rb").read()
    e = next(f for f in h.fields if f.key == f"{arch}.block_count")
    dup = raw[:16] + struct.pack("<Q", len(h.fields) + 1) + raw[24:e.end] + raw[e.start:e.end] + raw[e.end:]
    with pytest.raises(GGUFError, match=f"'{arch}.block_count' appears twice"):
        read_metadata(write(tmp_path, "dup.gguf", dup))


ESCAPES = "a\x00b\nc\r\x1b[31mred\x1b[0m\u202e" + "x" * 5000


def test_error_lines_escape_file_supplied_names(tmp_path, tiny_model_path):
    # a tensor name with NUL, newline, CR, terminal escapes and 5000 more characters
    # (output.weight renamed: the model is tied, and the odd name is an unexpected tensor)
    path = write(tmp_path, "tname.gguf", rebuilt(tiny_model_path, tensor_names={"output.weight": ESCAPES}))
    msg = expect_error(path, "unexpected tensor", f"({len(ESCAPES)} characters)")
    assert "\n" not in msg and "\x00" not in msg and "\x1b" not in msg and "\r" not in msg
    assert "\\x00" in msg and "\\n" in msg and "\\x1b" in msg
    assert len(msg) < 600, len(msg)
    # an odd key whose value is wrong (the key is named, escaped and cut)
    arch = read_metadata(tiny_model_path)["general.architecture"]
    path = write(tmp_path, "arch.gguf", rebuilt(tiny_model_path, {"general.architecture": (8, ESCAPES)}))
    msg = expect_error(path, "general.architecture")
    assert "\x1b" not in msg and "\n" not in msg and len(msg) < 600
    assert arch  # the original was valid


def test_cli_error_line_for_escaped_names(tmp_path, tiny_model_path):
    path = write(tmp_path, "tname.gguf", rebuilt(tiny_model_path, tensor_names={"output.weight": ESCAPES}))
    r = run_cli("generate", "--model", path, "--device", "cpu", "--prompt-ids", "1", "-n", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "\x1b" not in r.stderr, r.stderr


def test_read_header_spans(tiny_model_path):
    h = read_header(tiny_model_path)
    raw = open(tiny_model_path, "rb").read()
    assert h.fields[0].start == 24 and h.kv_end == h.fields[-1].end == h.tensors[0].start
    for e in h.fields:  # every entry re-encodes to its own bytes
        etype = struct.unpack_from("<I", raw, e.value_start + 4)[0] if e.vtype == 9 else None
        assert raw[e.start:e.end] == encode_field(e.key, e.vtype, e.value, etype), e.key
    assert h.data_start % h.alignment == 0 and h.data_start >= h.info_end
    assert list(h.metadata) == list(read_metadata(tiny_model_path))


def test_printable():
    from engine.errors import printable

    assert printable("blk.0.attn_q.weight") == "blk.0.attn_q.weight"
    assert printable("a\x00b\nc\x1b[2J") == "a\\x00b\\nc\\x1b[2J"
    assert printable(b"\xff\x07") == "\\xff\\x07"
    assert printable(float("nan")) == "nan"
    big = printable("x" * 10_000_000, limit=50)
    assert big == "x" * 50 + "... (10000000 characters)"

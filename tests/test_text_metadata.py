"""Bad tokenizer metadata (issue 15): every value read through engine.formats.metadata.Metadata,
each failure a one-line GGUFError naming the file and the key, file strings printable-escaped."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from engine.errors import GGUFError
from engine.formats.gguf_file import VALUE_TYPE_IDS, encode_field
from engine.text.bpe import BYTE_ENCODER
from engine.text.tokenizer import Tokenizer, load_tokenizer

K = "tokenizer.ggml."


def bpe_md(**extra):
    toks = [BYTE_ENCODER[b] for b in range(256)] + ["ab", "<|endoftext|>"]
    md = {K + "model": "gpt2", K + "pre": "qwen2", K + "tokens": toks,
          K + "token_type": [1] * 257 + [3], K + "merges": ["a b"], K + "eos_token_id": 257}
    md.update(extra)
    return {k: v for k, v in md.items() if v is not None}


def spm_md(**extra):
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581a"]
    md = {K + "model": "llama", K + "tokens": toks, K + "scores": [0.0] * 259 + [-1.0],
          K + "token_type": [2, 3, 3] + [6] * 256 + [1]}
    md.update(extra)
    return {k: v for k, v in md.items() if v is not None}


def fails(md, key, problem, source="bad.gguf"):
    """Tokenizer.from_metadata raises one GGUFError line: '<file>: ... '<key>' ... <problem>'."""
    with pytest.raises(GGUFError) as ei:
        Tokenizer.from_metadata(md, source)
    msg = str(ei.value)
    assert "\n" not in msg and "\r" not in msg, msg
    assert msg.startswith(f"{source}: "), msg
    assert f"'{key}'" in msg, msg
    assert problem in msg, msg
    return msg


def test_good_metadata_builds():
    assert Tokenizer.from_metadata(bpe_md(), "ok.gguf").encode("ab") == [256]
    assert Tokenizer.from_metadata(spm_md(), "ok.gguf").encode("a") == [1, 259]
    # numpy arrays and numpy scalars, as the GGUF reader returns them, are accepted
    md = bpe_md(**{K + "token_type": np.array([1] * 257 + [3], dtype=np.int32),
                   K + "eos_token_id": np.uint32(257), K + "add_bos_token": np.bool_(False)})
    assert Tokenizer.from_metadata(md, "ok.gguf").eos_id == 257


# ------------------------------------------------------------------- integers: ±inf, NaN, floats

@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id", "unknown_token_id", "eot_token_id",
                                 "eom_token_id", "padding_token_id", "fim_pre_token_id",
                                 "prefix_token_id", "fim_sep_token_id"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 5.0, np.float32("inf"), "5", [5]])
def test_non_integer_token_id(key, value):
    fails(bpe_md(**{K + key: value}), K + key, "is not an integer")


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                                 "fim_mid_token_id"])
@pytest.mark.parametrize("value", ["n", 1 << 40, -1, np.uint32(4294967295)])
def test_token_id_outside_vocabulary(key, value):
    for md, n in ((bpe_md(), 258), (spm_md(), 260)):
        md[K + key] = n if value == "n" else value
        fails(md, K + key, f"is outside the vocabulary (0..{n - 1})")


# ------------------------------------------------------------------- booleans: arrays, numbers

@pytest.mark.parametrize("key", ["add_bos_token", "add_eos_token", "add_space_prefix"])
@pytest.mark.parametrize("value", [[True], np.array([1, 0], dtype=np.uint8), 2, 0.5, "true", math.nan])
def test_non_boolean_flag(key, value):
    fails(bpe_md(**{K + key: value}), K + key, "is not a bool")


def test_flag_without_its_id():
    fails(bpe_md(**{K + "add_bos_token": True}), K + "add_bos_token", "bos_token_id is not set")
    fails(bpe_md(**{K + "add_eos_token": True, K + "eos_token_id": None}), K + "add_eos_token",
          "eos_token_id is not set")


# ------------------------------------------------------------------- strings

@pytest.mark.parametrize("key, md", [
    (K + "model", bpe_md(**{K + "model": ["gpt2"]})),
    (K + "model", bpe_md(**{K + "model": 2})),
    (K + "pre", bpe_md(**{K + "pre": ["qwen2"]})),
    (K + "pre", bpe_md(**{K + "pre": 7})),
    ("tokenizer.chat_template", bpe_md(**{"tokenizer.chat_template": ["{{ x }}"]})),
    ("tokenizer.chat_template", bpe_md(**{"tokenizer.chat_template": 1.5})),
])
def test_non_string(key, md):
    fails(md, key, "is not a string")


def test_unknown_values():
    fails(bpe_md(**{K + "model": "bert"}), K + "model", "is not a supported tokenizer model")
    fails(bpe_md(**{K + "model": "no_vocab"}), K + "model", "the file has no vocabulary")
    fails(bpe_md(**{K + "pre": "nonesuch"}), K + "pre", "unknown pre-tokenizer type")


# ------------------------------------------------------------------- arrays: scalars, element types

@pytest.mark.parametrize("key", ["tokens", "merges", "scores", "token_type"])
@pytest.mark.parametrize("value", ["abc", 5, 1.0, True])
def test_scalar_where_an_array_belongs(key, value):
    md = bpe_md(**{K + key: value}) if key != "scores" else spm_md(**{K + key: value})
    fails(md, K + key, "is not an array")


def test_tokens_missing_empty_or_duplicate():
    fails(bpe_md(**{K + "tokens": None}), K + "tokens", "missing")
    fails(bpe_md(**{K + "tokens": []}), K + "tokens", "is empty")
    toks = bpe_md()[K + "tokens"]
    fails(bpe_md(**{K + "tokens": toks[:-1] + ["ab"]}), K + "tokens", "duplicate token 'ab' at ids 256 and 257")


@pytest.mark.parametrize("key, bad, kind", [
    ("tokens", 5, "str"),
    ("tokens", None, "str"),
    ("tokens", ["x"], "str"),
    ("merges", 3, "str"),
    ("token_type", "1", "int"),
    ("token_type", 1.0, "int"),
    ("token_type", math.inf, "int"),
    ("scores", "0.5", "float"),
    ("scores", math.nan, "float"),
    ("scores", -math.inf, "float"),
])
def test_wrong_element_type(key, bad, kind):
    if key == "scores":
        md = spm_md()
    else:
        md = bpe_md()
    arr = list(md[K + key])
    arr[0] = bad
    md[K + key] = arr
    fails(md, K + key, "entry 0 = ")
    fails(md, K + key, kind)


def test_per_token_arrays_too_short():
    fails(bpe_md(**{K + "token_type": [1] * 3}), K + "token_type", "has 3 entries, fewer than the 258 tokens")
    fails(spm_md(**{K + "scores": [0.0] * 3}), K + "scores", "has 3 entries, fewer than the 260 tokens")


def test_malformed_merge():
    fails(bpe_md(**{K + "merges": ["ab"]}), K + "merges", "entry 0 = 'ab' is not 'left right'")
    fails(bpe_md(**{K + "merges": None}), K + "merges", "missing")


# ------------------------------------------------------------------- printable, bounded error text

def test_file_strings_are_escaped_and_cut():
    evil = "\x1b[31mred\n\x00" + "x" * 5000
    msg = fails(bpe_md(**{K + "pre": evil}), K + "pre", "unknown pre-tokenizer type")
    assert "\x1b" not in msg and "\x00" not in msg and "\\x1b[31mred\\n\\x00" in msg
    assert "x" * 200 not in msg and "characters)" in msg  # cut, with the full length noted
    toks = bpe_md()[K + "tokens"]
    msg = fails(bpe_md(**{K + "tokens": toks[:-2] + ["\u202e\r", "\u202e\r"]}), K + "tokens",
                "duplicate token")
    assert "\r" not in msg and "\u202e" not in msg
    msg = fails(bpe_md(**{K + "merges": ["\x07bell"]}), K + "merges", "is not 'left right'")
    assert "\x07" not in msg


# ------------------------------------------------------------------- through a file and the CLI

def _write_gguf(path, fields):
    """A vocabulary-only GGUF v3 file: (key, type name, value[, element type name]) fields."""
    body = b"".join(encode_field(k, VALUE_TYPE_IDS[t], v, *(VALUE_TYPE_IDS[e] for e in rest))
                    for k, t, v, *rest in fields)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + body)
    return path


def _vocab_fields(**override):
    toks = [BYTE_ENCODER[b] for b in range(256)] + ["ab", "<|endoftext|>"]
    f = {K + "model": ("string", "gpt2"), K + "pre": ("string", "qwen2"),
         K + "tokens": ("array", toks, "string"),
         K + "token_type": ("array", np.array([1] * 257 + [3], dtype=np.int32)),
         K + "merges": ("array", ["a b"], "string"), K + "eos_token_id": ("uint32", 257)}
    f.update(override)
    return [(k, *v) for k, v in f.items()]


@pytest.mark.parametrize("name, override, key, problem", [
    ("inf-bos", {K + "bos_token_id": ("float32", math.inf)}, K + "bos_token_id", "is not an integer"),
    ("nan-eos", {K + "eos_token_id": ("float64", math.nan)}, K + "eos_token_id", "is not an integer"),
    ("array-add-bos", {K + "add_bos_token": ("array", np.array([1], dtype=np.uint8))},
     K + "add_bos_token", "is not a bool"),
    ("scalar-tokens", {K + "tokens": ("string", "abc")}, K + "tokens", "is not an array"),
    ("int-tokens", {K + "tokens": ("array", np.arange(258, dtype=np.int32))}, K + "tokens", "is not a str"),
    ("float-types", {K + "token_type": ("array", np.ones(258, dtype=np.float32))}, K + "token_type",
     "is not a int"),
    ("id-outside", {K + "eos_token_id": ("uint32", 4000000000)}, K + "eos_token_id", "outside the vocabulary"),
])
def test_bad_file_through_load_tokenizer_and_cli(tmp_path, capsys, name, override, key, problem):
    p = _write_gguf(tmp_path / f"{name}.gguf", _vocab_fields(**override))
    with pytest.raises(GGUFError) as ei:
        load_tokenizer(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ") and f"'{key}'" in msg and problem in msg and "\n" not in msg

    from engine.cli import main

    capsys.readouterr()
    assert main(["tokenize", "--model", str(p), "--text", "ab"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(p) in lines[0] and key in lines[0] and problem in lines[0], err


def test_good_file_through_the_cli(tmp_path, capsys):
    p = _write_gguf(tmp_path / "ok.gguf", _vocab_fields())
    from engine.cli import main

    assert main(["tokenize", "--model", str(p), "--text", "ab"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "[256]"

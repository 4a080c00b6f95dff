"""engine/text's layout (issue 11): one module per responsibility, each under 500 lines; the
GPT-2 byte table defined once; the pre-tokenizer registry; the facade's public API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "engine" / "text"


def test_modules_by_responsibility_and_size():
    names = {p.stem for p in TEXT.glob("*.py")} - {"__init__"}
    assert {"vocab", "bpe", "spm", "pretokenizers", "streaming", "tokenizer", "chat"} <= names
    for p in TEXT.glob("*.py"):
        assert len(p.read_text("utf-8").splitlines()) <= 500, p


def test_bytes_to_unicode_defined_once():
    defs = []
    for p in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text("utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name in ("bytes_to_unicode", "_bytes_to_unicode"):
                defs.append(p.relative_to(ROOT).as_posix())
    assert defs == ["engine/text/bpe.py"]
    from engine.text.bpe import BYTE_ENCODER, bytes_to_unicode
    from engine.tools import synth

    assert synth.bytes_to_unicode is bytes_to_unicode
    assert sorted(BYTE_ENCODER) == list(range(256)) and len(set(BYTE_ENCODER.values())) == 256


def test_pre_tokenizer_registry():
    from engine.text.pretokenizers import PRE_TOKENIZER_REGEXES, pre_tokenizer

    assert pre_tokenizer("qwen2").family == "qwen2" and not pre_tokenizer("qwen2").clean_spaces
    llama = pre_tokenizer("llama-bpe")
    assert llama.family == "llama3" and llama.ignore_merges and llama.add_bos
    assert pre_tokenizer("gpt-2").family == "gpt2"
    assert pre_tokenizer("nonesuch") is None
    for name in ("qwen2", "llama-bpe", "gpt-2", "default"):
        assert pre_tokenizer(name).regexes == PRE_TOKENIZER_REGEXES[pre_tokenizer(name).family]


def test_public_api():
    from engine.text import tokenizer as tk
    from engine.text.streaming import StreamDecoder

    assert tk.StreamDecoder is StreamDecoder
    assert callable(tk.load_tokenizer)
    for name in ("encode", "decode", "token_to_bytes", "render_chat", "stream_decoder"):
        assert callable(getattr(tk.Tokenizer, name))
    with pytest.raises(TypeError):
        tk.Tokenizer()


def test_stream_decoder_never_splits_a_character():
    from engine.text.bpe import BYTE_ENCODER
    from engine.text.tokenizer import Tokenizer

    toks = [BYTE_ENCODER[b] for b in range(256)]
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                                   "tokenizer.ggml.tokens": toks, "tokenizer.ggml.merges": []}, "t")
    text = "日本 ✓ é"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one byte per token
    dec = tok.stream_decoder()
    pieces = [dec.feed(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    dec = tok.stream_decoder()
    assert dec.feed(ids[0]) == "" and dec.flush() == "\ufffd"  # a cut character at the end

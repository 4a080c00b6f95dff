"""Tokenizer vs llama.cpp goldens (BPE on the default model, SentencePiece on a vocab-only file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.errors import GGUFError
from engine.text.bpe import BYTE_ENCODER as _BYTE_ENCODER
from engine.text.tokenizer import Tokenizer, load_tokenizer

MODEL_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
ROOT = Path(__file__).resolve().parent.parent


def goldens_dir() -> Path:
    cands = [os.environ.get("GGUF_PREFILL_GOLDENS"), ROOT / "tests" / "goldens" / "llamacpp"]
    for c in cands:
        if c and (Path(c) / "spm-vocab-32k.gguf").exists():
            return Path(c)
    pytest.fail("goldens directory tests/goldens/llamacpp not found")


def model_path() -> Path:
    home = os.environ.get("GGUF_PREFILL_HOME") or os.path.expanduser("~/.cache/gguf-prefill")
    return Path(home) / MODEL_FILE


def _load_json(name: str):
    with open(goldens_dir() / name, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def qwen():
    p = model_path()
    if not p.exists():
        if os.environ.get("GGUF_PREFILL_REQUIRE_MODEL") == "1":
            pytest.fail(f"default model missing at {p} (GGUF_PREFILL_REQUIRE_MODEL=1)")
        pytest.skip(f"default model not found at {p}")
    return load_tokenizer(p)


@pytest.fixture(scope="module")
def spm():
    return load_tokenizer(goldens_dir() / "spm-vocab-32k.gguf")


def _cases(name, key):
    try:
        return _load_json(name)[key]
    except BaseException:  # goldens absent at collection: one skipped placeholder
        return []


QWEN_JSON = "qwen2.5-coder-1.5b-q4_k_m.json"
LLAMA_JSON = "qwen-as-llama-1.5b-q4_k_m.json"
SPM_JSON = "spm-vocab-32k.tokenize.json"

# --------------------------------------------------------------------------- BPE (default model)


@pytest.mark.model
@pytest.mark.parametrize("case", _cases(QWEN_JSON, "tokenize"), ids=lambda c: repr(c["text"])[:40])
def test_qwen_tokenize_goldens(qwen, case):
    assert qwen.encode(case["text"]) == case["ids"]


@pytest.mark.model
@pytest.mark.parametrize("case", _cases(QWEN_JSON, "greedy") + _cases(LLAMA_JSON, "greedy"),
                         ids=lambda c: repr(c["prompt"])[:40])
def test_greedy_prompt_ids(qwen, case):
    # the llama relabel keeps the same vocabulary, so both goldens files tokenize alike
    assert qwen.encode(case["prompt"]) == case["prompt_ids"]


@pytest.mark.model
def test_qwen_golden_counts(qwen):
    assert len(_cases(QWEN_JSON, "tokenize")) >= 14
    assert len(_cases(QWEN_JSON, "greedy")) >= 8 and len(_cases(LLAMA_JSON, "greedy")) >= 4


@pytest.mark.model
@pytest.mark.parametrize("case", _cases(QWEN_JSON, "tokenize"), ids=lambda c: repr(c["text"])[:40])
def test_qwen_round_trip(qwen, case):
    # every case round-trips (byte-level BPE is lossless; this model adds no BOS)
    assert qwen.decode(case["ids"]) == case["text"]
    assert qwen.decode(qwen.encode(case["text"])) == case["text"]


@pytest.mark.model
def test_qwen_properties(qwen):
    assert qwen.kind == "bpe" and qwen.pre == "qwen2"
    assert qwen.vocab_size == 151936
    assert qwen.add_bos is False
    assert qwen.eos_id == 151645 and qwen.tokens[qwen.eos_id] == "<|im_end|>"
    assert qwen.bos_id == 151643
    eog = {qwen.tokens[i] for i in qwen.eog_ids}
    assert {"<|im_end|>", "<|endoftext|>"} <= eog
    # llama.cpp also stops on Qwen's FIM pad / repo / file-separator tokens
    assert eog <= {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    assert qwen.chat_template and "<|im_start|>" in qwen.chat_template


@pytest.mark.model
def test_qwen_parse_special(qwen):
    text = "<|im_start|>user\nhi<|im_end|>"
    assert qwen.encode(text) == [151644, 872, 198, 6023, 151645]
    plain = qwen.encode(text, parse_special=False)
    assert 151644 not in plain and 151645 not in plain
    assert qwen.decode(plain) == text  # as plain text it still round-trips
    # user-defined tokens (type 4) are split out even without parse_special, as llama.cpp does
    assert qwen.encode("<tool_call>", parse_special=False) == [qwen.token_to_id("<tool_call>")]
    # skip_special drops control tokens from the text
    assert qwen.decode([151644, 872, 198, 6023, 151645], skip_special=True) == "user\nhi"


@pytest.mark.model
def test_qwen_streaming_bytes(qwen):
    text = "中文 ok ✓ 日本語"
    ids = qwen.encode(text)
    assert b"".join(qwen.token_to_bytes(i) for i in ids) == text.encode()
    dec = qwen.stream_decoder()
    pieces = [dec.feed(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # a lone continuation byte decodes with a replacement character
    byte_tok = qwen.token_to_id(_BYTE_ENCODER[0xE6])
    assert qwen.decode([byte_tok]) == "\ufffd"


@pytest.mark.model
def test_qwen_load_fast_and_cached(qwen):
    import time

    from engine.text import tokenizer as tk

    tk._CACHE.clear()
    t = time.perf_counter()
    tok = load_tokenizer(model_path())
    assert time.perf_counter() - t < 5.0
    assert load_tokenizer(model_path()) is tok


@pytest.mark.model
def test_qwen_decode_rejects_bad_ids(qwen):
    with pytest.raises(ValueError):
        qwen.decode([qwen.vocab_size])
    with pytest.raises(ValueError):
        qwen.decode([-1])


# --------------------------------------------------------------------------- SentencePiece

def test_spm_is_vocab_only_file():
    from engine.formats.gguf_file import read_metadata

    p = goldens_dir() / "spm-vocab-32k.gguf"
    with open(p, "rb") as f:
        head = f.read(24)
    assert head[:4] == b"GGUF" and int.from_bytes(head[8:16], "little") == 0  # no tensors
    md = read_metadata(p)
    tok = Tokenizer.from_metadata(md, str(p))
    assert tok.kind == "spm" and tok.vocab_size == 32000
    assert tok.encode("x") == [1, 985]


@pytest.mark.parametrize("case", _cases(SPM_JSON, "tokenize"), ids=lambda c: repr(c["text"])[:40])
def test_spm_tokenize_goldens(spm, case):
    assert spm.encode(case["text"]) == case["ids"]


def test_spm_golden_count():
    assert len(_cases(SPM_JSON, "tokenize")) >= 18


# "▁already▁marked": the input already holds U+2581, SentencePiece's own space marker, so
# its pieces ("▁already", ...) decode to spaces; no decoder can tell it from " already marked".
SPM_RT_EXCLUDED = {"\u2581already\u2581marked": "input contains U+2581, which decodes as a space"}


@pytest.mark.parametrize("case", _cases(SPM_JSON, "tokenize"), ids=lambda c: repr(c["text"])[:40])
def test_spm_round_trip(spm, case):
    text = case["text"]
    if text in SPM_RT_EXCLUDED:
        pytest.skip(SPM_RT_EXCLUDED[text])
    ids = case["ids"]
    assert ids[0] == spm.bos_id  # the BOS encode adds (add_special); not part of the text
    assert spm.decode(ids[1:]) == text
    assert spm.decode(spm.encode(text, add_special=False)) == text
    # with the BOS: skipped as special, the leading space prefix still removed
    if "<s>" not in text and "</s>" not in text:
        assert spm.decode(ids, skip_special=True) == text


def test_spm_properties(spm):
    assert spm.add_bos and spm.add_space_prefix
    assert spm.bos_id == 1 and spm.eos_id == 2 and spm.unk_id == 0
    assert 2 in spm.eog_ids
    assert spm.chat_template is None
    # parse_special=False: "<s>" is plain text
    assert 1 not in spm.encode("<s>hi", add_special=False, parse_special=False)
    assert spm.encode("", add_special=True) == [1]
    assert spm.encode("", add_special=False) == []


def test_spm_no_chat_template(spm):
    with pytest.raises(GGUFError, match="has no tokenizer.chat_template; chat is not available"):
        spm.render_chat([{"role": "user", "content": "hi"}])


def _spm_md(pieces: dict[str, float], **extra):
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + list(pieces.values())
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types}
    md.update(extra)
    return md


def test_spm_merges_through_non_piece_halves():
    # "▁Ü" is a piece but "Ü" is not: llama.cpp merges ▁+Ü by the pair's score first, then
    # falls back to bytes only for what is left ("x" is no piece here either).
    tok = Tokenizer.from_metadata(_spm_md({"\u2581": -1.0, "\u2581\u00dc": -2.0}), "crafted")
    ids = tok.encode("Üx")
    assert ids == [1, tok.token_to_id("\u2581\u00dc"), tok.token_to_id("<0x78>")]
    assert tok.decode(ids, skip_special=True) == "Üx"
    # a character no piece covers becomes its UTF-8 bytes
    ids = tok.encode("é", add_special=False)
    assert ids == [tok.token_to_id("\u2581")] + [tok.token_to_id(f"<0x{b:02X}>") for b in "é".encode()]
    assert tok.decode(ids) == "é"


def test_spm_score_order_and_leftmost_ties():
    # "abc": pieces ab (-1) and bc (-0.5): bc has the higher score and wins
    tok = Tokenizer.from_metadata(_spm_md({"\u2581": -9.0, "a": -3.0, "b": -3.0, "c": -3.0,
                                           "ab": -1.0, "bc": -0.5}), "crafted")
    assert [tok.tokens[i] for i in tok.encode("abc", add_special=False, parse_special=False)] \
        == ["\u2581", "a", "bc"]
    # equal scores: the leftmost pair merges first
    tok = Tokenizer.from_metadata(_spm_md({"\u2581": -9.0, "a": -3.0, "b": -3.0, "c": -3.0,
                                           "ab": -1.0, "bc": -1.0}), "crafted")
    assert [tok.tokens[i] for i in tok.encode("abc", add_special=False)] == ["\u2581", "ab", "c"]


def test_spm_add_space_prefix_off():
    tok = Tokenizer.from_metadata(_spm_md({"\u2581": -9.0, "a": -3.0},
                                          **{"tokenizer.ggml.add_space_prefix": False}), "crafted")
    assert [tok.tokens[i] for i in tok.encode("a a", add_special=False)] == ["a", "\u2581", "a"]
    assert tok.decode(tok.encode("a a")) == "<s>a a"
    assert tok.decode(tok.encode("a a"), skip_special=True) == "a a"


# --------------------------------------------------------------------------- BPE on crafted vocab

def _bpe_md(pre, extra_tokens=(), merges=(), **extra):
    toks = [_BYTE_ENCODER[b] for b in range(256)] + list(extra_tokens)
    toks += ["<|begin_of_text|>", "<|eot_id|>"]
    types = [1] * (len(toks) - 2) + [3, 3]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": toks,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(merges),
          "tokenizer.ggml.bos_token_id": len(toks) - 2}
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    md.update(extra)
    return md


def _texts(tok, ids):
    return [tok.tokens[i] for i in ids]


def test_llama_bpe_pre_tokenizer():
    extra = ["12", "123", "xyz", "ab"]
    merges = ["1 2", "12 3", "a b"]
    llama = Tokenizer.from_metadata(_bpe_md("llama-bpe", extra, merges), "crafted-llama")
    qwen = Tokenizer.from_metadata(_bpe_md("qwen2", extra, merges), "crafted-qwen")
    assert llama.pre_family == "llama3" and qwen.pre_family == "qwen2"
    # Llama-3 groups digits by up to three; Qwen2 splits every digit
    assert _texts(llama, llama.encode("1234", add_special=False)) == ["123", "4"]
    assert _texts(qwen, qwen.encode("1234", add_special=False)) == ["1", "2", "3", "4"]
    # llama-bpe ignores merges when the whole word is a token
    assert _texts(llama, llama.encode("xyz", add_special=False)) == ["xyz"]
    assert _texts(qwen, qwen.encode("xyz", add_special=False)) == ["x", "y", "z"]
    # llama-bpe adds BOS by default (llama.cpp), qwen2 does not
    assert llama.add_bos and llama.encode("ab")[0] == llama.bos_id
    assert not qwen.add_bos and qwen.encode("ab") == [qwen.token_to_id("ab")]
    # metadata overrides the default
    off = Tokenizer.from_metadata(_bpe_md("llama-bpe", extra, merges,
                                          **{"tokenizer.ggml.add_bos_token": False}), "crafted")
    assert off.encode("ab") == [off.token_to_id("ab")]
    # case-insensitive contractions in the Llama-3 regex: "'S" is one word (GPT-2's: two)
    ex = extra + ["'S"]
    mg = merges + ["' S"]
    llama_c = Tokenizer.from_metadata(_bpe_md("llama-bpe", ex, mg), "crafted")
    gpt2_c = Tokenizer.from_metadata(_bpe_md("gpt-2", ex, mg), "crafted")
    assert _texts(llama_c, llama_c.encode("'S", add_special=False)) == ["'S"]
    assert _texts(gpt2_c, gpt2_c.encode("'S", add_special=False)) == ["'", "S"]
    # <|eot_id|> is end-of-generation; special tokens are parsed
    eot = llama.token_to_id("<|eot_id|>")
    assert eot in llama.eog_ids
    assert llama.encode("ab<|eot_id|>", add_special=False) == [llama.token_to_id("ab"), eot]
    # llama-bpe cleans tokenization spaces on decode (llama.cpp clean_spaces), qwen2 does not
    ids = llama.encode("a .", add_special=False)
    assert llama.decode(ids) == "a."
    assert qwen.decode(qwen.encode("a .")) == "a ."


def test_default_and_gpt2_pre():
    for pre in ("default", "gpt-2"):
        tok = Tokenizer.from_metadata(_bpe_md(pre, ["ab"], ["a b"]), "crafted")
        assert tok.decode(tok.encode("ab cd", add_special=False)) == "ab cd"
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre missing"):
        tok = Tokenizer.from_metadata(_bpe_md(None), "crafted")
    assert tok.pre == "default"


def test_unknown_pre_is_an_error():
    with pytest.raises(GGUFError, match=r"crafted\.gguf: metadata field 'tokenizer\.ggml\.pre' .*'nonesuch'"):
        Tokenizer.from_metadata(_bpe_md("nonesuch"), "crafted.gguf")


def test_metadata_errors():
    with pytest.raises(GGUFError, match="f.gguf: missing metadata field 'tokenizer.ggml.model'"):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]}, "f.gguf")
    with pytest.raises(GGUFError, match="metadata field 'tokenizer.ggml.model' = 'bert' is not a supported tokenizer model"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "f")
    with pytest.raises(GGUFError, match="f.gguf: missing metadata field 'tokenizer.ggml.tokens'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama"}, "f.gguf")
    with pytest.raises(GGUFError, match="missing metadata field 'tokenizer.ggml.merges'"):
        md = _bpe_md("qwen2")
        del md["tokenizer.ggml.merges"]
        Tokenizer.from_metadata(md, "f")
    with pytest.raises(GGUFError, match="metadata field 'tokenizer.ggml.tokens' has duplicate token"):
        Tokenizer.from_metadata(_bpe_md("qwen2", ["a"]), "f")
    with pytest.raises(GGUFError, match="metadata field 'tokenizer.ggml.eos_token_id' = token id 99999"):
        Tokenizer.from_metadata(_bpe_md("qwen2", **{"tokenizer.ggml.eos_token_id": 99999}), "f")
    with pytest.raises(GGUFError, match="metadata field 'tokenizer.ggml.scores' has 3 entries"):
        md = _spm_md({})
        md["tokenizer.ggml.scores"] = [0.0] * 3
        Tokenizer.from_metadata(md, "f")


def test_load_tokenizer_accepts_metadata_and_bad_path(tmp_path):
    tok = load_tokenizer(_bpe_md("qwen2", ["ab"], ["a b"]))
    assert tok.encode("ab") == [tok.token_to_id("ab")]
    with pytest.raises(GGUFError, match="nope.gguf"):
        load_tokenizer(tmp_path / "nope.gguf")

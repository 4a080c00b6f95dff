"""The vocabulary out of GGUF metadata: tokens, scores, token types, merges, special ids and flags,
as llama.cpp's ``llama_vocab::impl::load`` reads them.

Every value is read through engine.formats.metadata.Metadata, so a value of the wrong type,
a non-finite number, an array where a scalar belongs (or the reverse) or an id outside the
vocabulary is a one-line GGUFError naming the file and the key. Only the vocabulary is needed:
vocabulary-only GGUF files work.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.errors import printable
from engine.formats.metadata import Metadata
from engine.text.pretokenizers import PRE_TOKENIZERS, PreTokenizer, pre_tokenizer

__all__ = ["Vocab", "read_vocab", "TOKEN_TYPE_UNDEFINED", "TOKEN_TYPE_NORMAL", "TOKEN_TYPE_UNKNOWN",
           "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_USER_DEFINED", "TOKEN_TYPE_UNUSED", "TOKEN_TYPE_BYTE",
           "ATTR_UNKNOWN", "ATTR_NORMAL", "ATTR_CONTROL", "ATTR_USER_DEFINED", "ATTR_BYTE",
           "SPECIAL_ATTRS"]

# GGUF tokenizer.ggml.token_type values (llama_token_type)
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama_token_attr bits (llama.cpp)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
    TOKEN_TYPE_UNDEFINED: ATTR_UNDEFINED,
}

SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # cache_special_tokens

# token texts llama.cpp recognises (llama_vocab::impl::load, "auto-detect special tokens by text").
# Deliberately left out of the EOG list: "</s>" (added upstream for paddleocr): in byte-level BPE
# vocabularies such as Qwen2's it is an ordinary token (HTML's strike-through close tag), and
# promoting it to a control token would both stop generation on it and parse it out of prompts.
# SentencePiece files name "</s>" as their EOS id, which makes it end-of-generation anyway.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                  "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                  "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                  "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
              "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
              "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")

_FIM_KEYS = (("pre", ("fim_pre_token_id", "prefix_token_id")),
             ("suf", ("fim_suf_token_id", "suffix_token_id")),
             ("mid", ("fim_mid_token_id", "middle_token_id")),
             ("pad", ("fim_pad_token_id",)), ("rep", ("fim_rep_token_id",)),
             ("sep", ("fim_sep_token_id",)))

_K = "tokenizer.ggml."


@dataclass
class Vocab:
    """What the tokenizer needs from the file. ``kind``: "bpe" | "spm"; ids are ints or None."""
    source: str
    model: str
    kind: str
    tokens: list[str]
    token_to_id: dict[str, int]
    scores: list[float]
    attrs: list[int]
    pre: PreTokenizer | None = None
    add_space_prefix: bool = False
    clean_spaces: bool = False
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    pad_id: int | None = None
    fim_ids: dict[str, int | None] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False
    eog_ids: set[int] = field(default_factory=set)
    special_ids: list[int] = field(default_factory=list)  # longest text first
    chat_template: str | None = None
    merges: list[tuple[str, str]] | None = None           # BPE only


def _read_tokens(m: Metadata) -> list[str]:
    key = _K + "tokens"
    raw = m.array(key, of=(str, bytes), required=True)
    if not raw:
        raise m.error(key, "is empty: the file has no vocabulary")
    toks: list[str] = []
    for i, t in enumerate(raw):
        if isinstance(t, bytes):
            t = t.decode("utf-8", "surrogateescape")
        toks.append(t if t != "" else f"[EMPTY_{i}]")  # as llama.cpp
    return toks


def _per_token(m: Metadata, name: str, of, n: int) -> list | None:
    key = _K + name
    v = m.array(key, default=None, of=of)
    if v is not None and len(v) < n:
        raise m.error(key, f"has {len(v)} entries, fewer than the {n} tokens")
    return None if v is None else v[:n]


def read_vocab(md: Mapping[str, Any], source: str) -> Vocab:
    """The vocabulary of `md` (a GGUF metadata mapping); GGUFError naming `source` and the key."""
    m = md if isinstance(md, Metadata) else Metadata(md, source)
    key = _K + "model"
    model = m.string(key, required=True)
    if model in ("no_vocab", "none"):
        raise m.error(key, f"= {printable(repr(model))}: the file has no vocabulary")
    if model not in ("gpt2", "llama"):
        raise m.error(key, f"= {printable(repr(model))} is not a supported tokenizer model "
                           "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    kind = "bpe" if model == "gpt2" else "spm"

    toks = _read_tokens(m)
    n = len(toks)
    token_to_id: dict[str, int] = {t: i for i, t in enumerate(toks)}
    if len(token_to_id) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(toks):
            if t in seen:
                raise m.error(_K + "tokens", f"has duplicate token {printable(repr(t))} at ids "
                                             f"{seen[t]} and {i}")
            seen[t] = i
    scores = _per_token(m, "scores", (float, int), n)
    ttypes = _per_token(m, "token_type", int, n)
    v = Vocab(source=m.source, model=model, kind=kind, tokens=toks, token_to_id=token_to_id,
              scores=[float(s) for s in scores] if scores is not None else [0.0] * n,
              attrs=[_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in ttypes] if ttypes is not None
              else [ATTR_NORMAL] * n)

    # --- flags and defaults per vocabulary kind (llama_vocab::impl::load)
    if kind == "bpe":
        key = _K + "pre"
        name = m.string(key, default=None)
        if name is None:
            warnings.warn(f"{m.source}: {key} missing; using llama.cpp's 'default' "
                          "pre-tokenizer (generation quality may degrade)")
            name = "default"
        pre = pre_tokenizer(name)
        if pre is None:
            raise m.error(key, f"= {printable(repr(name))} is an unknown pre-tokenizer type (known: "
                               f"{', '.join(sorted(PRE_TOKENIZERS))})")
        v.pre = pre
        v.add_space_prefix, v.clean_spaces = False, pre.clean_spaces
        add_bos = pre.add_bos
        # llama.cpp's BPE defaults (bos = eos = 11) are GPT-2 leftovers; unset unless given.
        bos_default = eos_default = unk_default = None
    else:
        v.add_space_prefix, v.clean_spaces = True, False
        add_bos = True
        bos_default, eos_default, unk_default = 1, 2, 0
    v.add_space_prefix = m.boolean(_K + "add_space_prefix", default=v.add_space_prefix)

    def special(name: str, default: int | None) -> int | None:
        if default is not None and default >= n:
            default = None
        key = _K + name
        i = m.integer(key, default=None)
        if i is None:
            return default
        if not 0 <= i < n:
            raise m.error(key, f"= token id {i} is outside the vocabulary (0..{n - 1})")
        return i

    v.bos_id = special("bos_token_id", bos_default)
    v.eos_id = special("eos_token_id", eos_default)
    v.unk_id = special("unknown_token_id", unk_default)
    v.eot_id = special("eot_token_id", None)
    v.eom_id = special("eom_token_id", None)
    v.pad_id = special("padding_token_id", None)
    fim: dict[str, int | None] = {}
    for name, keys in _FIM_KEYS:
        fim[name] = None
        for k in keys:
            i = special(k, None)
            if i is not None:
                fim[name] = i

    v.add_bos = m.boolean(_K + "add_bos_token", default=add_bos)
    v.add_eos = m.boolean(_K + "add_eos_token", default=False)
    if v.add_bos and v.bos_id is None:
        raise m.error(_K + "add_bos_token", f"is true, but {_K}bos_token_id is not set")
    if v.add_eos and v.eos_id is None:
        raise m.error(_K + "add_eos_token", f"is true, but {_K}eos_token_id is not set")

    _detect_specials(v, fim)
    v.chat_template = m.string("tokenizer.chat_template", default=None)
    if kind == "bpe":
        from engine.text.bpe import read_merges

        v.merges = read_merges(m)
    return v


def _detect_specials(v: Vocab, fim: dict[str, int | None]) -> None:
    """Auto-detect special tokens by text, promoting them to control, and collect the
    end-of-generation set and the special-token partition order (as llama.cpp)."""
    attrs, toks, token_to_id = v.attrs, v.tokens, v.token_to_id

    def detect(current, texts):
        if current is not None:
            return current
        for t in texts:
            i = token_to_id.get(t)
            if i is not None:
                attrs[i] |= ATTR_CONTROL
                return i
        return None

    v.eot_id = detect(v.eot_id, _EOT_TEXTS)
    v.eom_id = detect(v.eom_id, _EOM_TEXTS)
    for name, texts in (("pre", _FIM_PRE_TEXTS), ("suf", _FIM_SUF_TEXTS), ("mid", _FIM_MID_TEXTS),
                        ("pad", _FIM_PAD_TEXTS), ("rep", _FIM_REP_TEXTS), ("sep", _FIM_SEP_TEXTS)):
        fim[name] = detect(fim[name], texts)
    v.fim_ids = fim

    eog: set[int] = {fim[k] for k in ("pad", "rep", "sep") if fim[k] is not None}
    for t in _EOG_TEXTS:
        i = token_to_id.get(t)
        if i is not None:
            eog.add(i)
            attrs[i] |= ATTR_CONTROL
    # gpt-oss: always render these
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        i = token_to_id.get(t)
        if i is not None:
            attrs[i] = ATTR_USER_DEFINED
    for i in (v.eos_id, v.eot_id, v.eom_id):
        if i is not None:
            eog.add(i)
    # o200k_harmony / solar-open: <|end|> is not end-of-generation there
    texts = {toks[i] for i in eog}
    if (("<|return|>" in texts and "<|call|>" in texts) or
            ({"<|call|>", "<|calls|>"} & texts and "<|flush|>" in texts)) and "<|end|>" in texts:
        i = token_to_id["<|end|>"]
        eog.discard(i)
        attrs[i] = ATTR_USER_DEFINED
    if "<|tool_response>" in texts and "</s>" in texts:
        i = token_to_id["</s>"]
        eog.discard(i)
        attrs[i] = ATTR_NORMAL
    v.eog_ids = eog

    # special tokens cache: longest text first (ties by id)
    special_ids = [i for i in range(len(toks)) if attrs[i] & SPECIAL_ATTRS]
    special_ids.sort(key=lambda i: -len(toks[i].encode("utf-8", "surrogateescape")))
    v.special_ids = special_ids

"""Tokenizer built from GGUF metadata, reproducing llama.cpp's tokenization.

Two vocabulary kinds (``tokenizer.ggml.model``):

* ``gpt2`` -- byte-level BPE. Built with the ``tokenizers`` library: ``models.BPE`` from the
  file's tokens and merges, pre-tokenizer ``Sequence[Split(regex, isolated)..., ByteLevel]``
  with the regexes llama.cpp uses for the file's ``tokenizer.ggml.pre``.
* ``llama`` -- SentencePiece, as llama.cpp's ``llm_tokenizer_spm``: spaces escaped as U+2581,
  a space prefix, the bigram merge loop by piece score over UTF-8 characters (a pair is merged
  whenever its concatenation is a piece, even if a half is not), then ``<0xNN>`` byte pieces
  for what is left.

Special tokens are split out of the text first, as llama.cpp's ``tokenizer_st_partition`` does:
control and unknown tokens only with ``parse_special=True``, user-defined tokens always; longest
token text first.

Only the vocabulary is needed: vocabulary-only GGUF files work.
"""

from __future__ import annotations

import codecs
import heapq
import os
import threading
import warnings
from typing import Any, Iterable, Mapping, Sequence

from engine.errors import GGUFError

__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "load_tokenizer",
    "PRE_TOKENIZER_REGEXES",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

# GGUF tokenizer.ggml.token_type values (llama_token_type)
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama_token_attr bits (llama.cpp)
_ATTR_UNDEFINED = 0
_ATTR_UNKNOWN = 1 << 0
_ATTR_UNUSED = 1 << 1
_ATTR_NORMAL = 1 << 2
_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4
_ATTR_BYTE = 1 << 5

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: _ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: _ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: _ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: _ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: _ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: _ATTR_BYTE,
    TOKEN_TYPE_UNDEFINED: _ATTR_UNDEFINED,
}

_SPECIAL_ATTRS = _ATTR_CONTROL | _ATTR_USER_DEFINED | _ATTR_UNKNOWN  # cache_special_tokens

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, copied from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe).
# Each entry is the list of regexes llama.cpp applies in sequence (each splits the pieces the
# previous one left, keeping matches and the text between them).
# ---------------------------------------------------------------------------------------------

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT
    "default": [
        r"[\p{P}\$\+<=>\^~\|]+",
        _RE_GPT2,
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ],
    "gpt2": [_RE_GPT2],
    "llama3": [_RE_LLAMA3],
    "qwen2": [_RE_QWEN2],
    "starcoder": [r"\p{N}", _RE_GPT2],
}

# tokenizer.ggml.pre value -> (regex family, flags), as llama_vocab::impl::load maps them.
# flags: ignore_merges, add_bos default, clean_spaces (clean_up_tokenization_spaces)
_PRE_TYPES: dict[str, tuple[str, bool, bool, bool]] = {}


def _reg(names: Iterable[str], family: str, *, ignore_merges=False, add_bos=False, clean_spaces=True):
    for n in names:
        _PRE_TYPES[n] = (family, ignore_merges, add_bos, clean_spaces)


_reg(["default"], "default")
_reg(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
     "llama3", ignore_merges=True, add_bos=True)
_reg(["dbrx", "smaug-bpe"], "llama3")
_reg(["gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], "gpt2")
_reg(["trillion", "granite-docling"], "gpt2", clean_spaces=False)
_reg(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"], "qwen2", clean_spaces=False)
_reg(["stablelm2", "megrez"], "qwen2")
_reg(["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"], "starcoder")
_reg(["command-r", "smollm"], "starcoder", clean_spaces=False)

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

_SPACE_ESC = "\u2581"

_K = "tokenizer.ggml."


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (ByteLevel)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


# ---------------------------------------------------------------------------------------------
# metadata access
# ---------------------------------------------------------------------------------------------

def _as_list(v) -> list:
    if isinstance(v, list):
        return v
    if hasattr(v, "tolist"):
        return v.tolist()
    return list(v)


class _Meta:
    def __init__(self, md: Mapping[str, Any], source: str):
        self.md = md
        self.source = source

    def err(self, field: str, msg: str) -> GGUFError:
        return GGUFError(f"{self.source}: {field}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.md and self.md[key] is not None

    def str(self, key: str, default=None, required=False):
        if not self.has(key):
            if required:
                raise self.err(key, "missing (required to build the tokenizer)")
            return default
        v = self.md[key]
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        if not isinstance(v, str):
            raise self.err(key, f"expected a string, got {type(v).__name__}")
        return v

    def int(self, key: str, default=None):
        if not self.has(key):
            return default
        v = self.md[key]
        try:
            if isinstance(v, bool) or float(v) != int(v):
                raise ValueError
            return int(v)
        except (TypeError, ValueError):
            raise self.err(key, f"expected an integer, got {v!r}") from None

    def bool(self, key: str, default=None):
        if not self.has(key):
            return default
        v = self.md[key]
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, bool) or v in (0, 1):
            return bool(v)
        raise self.err(key, f"expected a bool, got {v!r}")

    def array(self, key: str, n: int | None = None, required=False):
        if not self.has(key):
            if required:
                raise self.err(key, "missing (required to build the tokenizer)")
            return None
        v = self.md[key]
        if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
            raise self.err(key, f"expected an array, got {type(v).__name__}")
        v = _as_list(v)
        if n is not None and len(v) < n:
            raise self.err(key, f"has {len(v)} entries, fewer than the {n} tokens")
        return v


# ---------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------

class Tokenizer:
    """Encode/decode exactly as llama.cpp does for the GGUF's vocabulary.

    Attributes: ``kind`` ("bpe" | "spm"), ``vocab_size``, ``bos_id``, ``eos_id``, ``eot_id``,
    ``unk_id`` (ints or None), ``eog_ids`` (set), ``add_bos``, ``add_eos``, ``add_space_prefix``,
    ``chat_template`` (str | None), ``tokens`` (list of token texts), ``pre`` (BPE pre-tokenizer
    name), ``source``.
    """

    def __init__(self):  # use from_metadata / load_tokenizer
        raise TypeError("use Tokenizer.from_metadata(md, source) or load_tokenizer(path)")

    # ----------------------------------------------------------------------------- building
    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str = "<metadata>") -> "Tokenizer":
        self = object.__new__(cls)
        self._build(_Meta(md, source))
        return self

    def _build(self, m: _Meta) -> None:
        self.source = m.source
        model = m.str(_K + "model", required=True)
        if model in ("no_vocab", "none"):
            raise m.err(_K + "model", f"{model!r}: the file has no vocabulary")
        if model == "gpt2":
            self.kind = "bpe"
        elif model == "llama":
            self.kind = "spm"
        else:
            raise m.err(_K + "model", f"unsupported tokenizer model {model!r} "
                                      "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
        self.model = model

        tokens = m.array(_K + "tokens", required=True)
        n = len(tokens)
        if n == 0:
            raise m.err(_K + "tokens", "empty vocabulary")
        toks: list[str] = []
        for i, t in enumerate(tokens):
            if isinstance(t, bytes):
                t = t.decode("utf-8", "surrogateescape")
            if not isinstance(t, str):
                raise m.err(_K + "tokens", f"entry {i} is not a string")
            if t == "":
                t = f"[EMPTY_{i}]"  # as llama.cpp
            toks.append(t)
        token_to_id: dict[str, int] = {t: i for i, t in enumerate(toks)}
        if len(token_to_id) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(toks):
                if t in seen:
                    raise m.err(_K + "tokens", f"duplicate token {t!r} has ids {seen[t]} and {i}")
                seen[t] = i
        self.tokens = toks
        self.vocab_size = n
        self._token_to_id = token_to_id

        scores = m.array(_K + "scores", n)
        if scores is not None:
            try:
                self.scores = [float(s) for s in scores[:n]]
            except (TypeError, ValueError):
                raise m.err(_K + "scores", "non-numeric entry") from None
        else:
            self.scores = [0.0] * n
        ttypes = m.array(_K + "token_type", n)
        if ttypes is not None:
            try:
                attrs = [_TYPE_TO_ATTR.get(int(t), _ATTR_UNDEFINED) for t in ttypes[:n]]
            except (TypeError, ValueError):
                raise m.err(_K + "token_type", "non-integer entry") from None
        else:
            attrs = [_ATTR_NORMAL] * n
        self._attrs = attrs

        # --- flags and defaults per vocabulary kind (llama_vocab::impl::load)
        self.pre = None
        self.ignore_merges = False
        if self.kind == "bpe":
            self.add_space_prefix = False
            self.clean_spaces = True
            pre = m.str(_K + "pre")
            if pre is None:
                warnings.warn(f"{m.source}: {_K}pre missing; using llama.cpp's 'default' "
                              "pre-tokenizer (generation quality may degrade)")
                pre = "default"
            if pre not in _PRE_TYPES:
                raise m.err(_K + "pre", f"unknown pre-tokenizer type {pre!r} (known: "
                                        f"{', '.join(sorted(_PRE_TYPES))})")
            family, self.ignore_merges, add_bos_default, self.clean_spaces = _PRE_TYPES[pre]
            self.pre = pre
            self.pre_family = family
            add_bos = add_bos_default
            # llama.cpp's BPE defaults (bos = eos = 11) are GPT-2 leftovers; unset unless given.
            bos_default = eos_default = None
            unk_default = None
        else:
            self.add_space_prefix = True
            self.clean_spaces = False
            add_bos = True
            bos_default, eos_default, unk_default = 1, 2, 0
        self.add_space_prefix = bool(m.bool(_K + "add_space_prefix", self.add_space_prefix))

        def special(key: str, default):
            if default is not None and default >= n:
                default = None
            v = m.int(_K + key)
            if v is None:
                return default
            if not 0 <= v < n:
                raise m.err(_K + key, f"token id {v} is outside the vocabulary (0..{n - 1})")
            return v

        self.bos_id = special("bos_token_id", bos_default)
        self.eos_id = special("eos_token_id", eos_default)
        self.unk_id = special("unknown_token_id", unk_default)
        self.eot_id = special("eot_token_id", None)
        self.eom_id = special("eom_token_id", None)
        self.pad_id = special("padding_token_id", None)
        fim = {}
        for name, keys in (("pre", ("fim_pre_token_id", "prefix_token_id")),
                           ("suf", ("fim_suf_token_id", "suffix_token_id")),
                           ("mid", ("fim_mid_token_id", "middle_token_id")),
                           ("pad", ("fim_pad_token_id",)), ("rep", ("fim_rep_token_id",)),
                           ("sep", ("fim_sep_token_id",))):
            v = None
            for k in keys:
                v2 = special(k, None)
                if v2 is not None:
                    v = v2
            fim[name] = v

        self.add_bos = bool(m.bool(_K + "add_bos_token", add_bos))
        self.add_eos = bool(m.bool(_K + "add_eos_token", False))
        if self.add_bos and self.bos_id is None:
            raise m.err(_K + "add_bos_token", f"is true, but {_K}bos_token_id is not set")
        if self.add_eos and self.eos_id is None:
            raise m.err(_K + "add_eos_token", f"is true, but {_K}eos_token_id is not set")

        # --- auto-detect special tokens by text, promoting them to control (as llama.cpp)
        def detect(current, texts):
            if current is not None:
                return current
            for t in texts:
                i = token_to_id.get(t)
                if i is not None:
                    attrs[i] |= _ATTR_CONTROL
                    return i
            return None

        self.eot_id = detect(self.eot_id, _EOT_TEXTS)
        self.eom_id = detect(self.eom_id, _EOM_TEXTS)
        for name, texts in (("pre", _FIM_PRE_TEXTS), ("suf", _FIM_SUF_TEXTS), ("mid", _FIM_MID_TEXTS),
                            ("pad", _FIM_PAD_TEXTS), ("rep", _FIM_REP_TEXTS), ("sep", _FIM_SEP_TEXTS)):
            fim[name] = detect(fim[name], texts)
        self.fim_ids = fim

        eog: set[int] = {fim[k] for k in ("pad", "rep", "sep") if fim[k] is not None}
        for t in _EOG_TEXTS:
            i = token_to_id.get(t)
            if i is not None:
                eog.add(i)
                attrs[i] |= _ATTR_CONTROL
        # gpt-oss: always render these
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            i = token_to_id.get(t)
            if i is not None:
                attrs[i] = _ATTR_USER_DEFINED
        for i in (self.eos_id, self.eot_id, self.eom_id):
            if i is not None:
                eog.add(i)
        # o200k_harmony / solar-open: <|end|> is not end-of-generation there
        texts = {toks[i] for i in eog}
        if (("<|return|>" in texts and "<|call|>" in texts) or
                ({"<|call|>", "<|calls|>"} & texts and "<|flush|>" in texts)) and "<|end|>" in texts:
            i = token_to_id["<|end|>"]
            eog.discard(i)
            attrs[i] = _ATTR_USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:
            i = token_to_id["</s>"]
            eog.discard(i)
            attrs[i] = _ATTR_NORMAL
        self.eog_ids = eog

        # special tokens cache: longest text first (ties by id)
        special_ids = [i for i in range(n) if attrs[i] & _SPECIAL_ATTRS]
        special_ids.sort(key=lambda i: -len(toks[i].encode("utf-8", "surrogateescape")))
        self._special_ids = special_ids

        self.chat_template = m.str("tokenizer.chat_template")
        self._piece_cache: list[bytes] | None = None

        if self.kind == "bpe":
            merges = m.array(_K + "merges", required=True)
            self._build_bpe(m, merges)
        else:
            self._spm_vocab = {t: (i, self.scores[i]) for i, t in enumerate(toks)}
            self._byte_ids: dict[int, int] = {}

    def _build_bpe(self, m: _Meta, merges: list) -> None:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        pairs = []
        for i, w in enumerate(merges):
            if isinstance(w, bytes):
                w = w.decode("utf-8", "surrogateescape")
            if not isinstance(w, str):
                raise m.err(_K + "merges", f"entry {i} is not a string")
            pos = w.find(" ", 1)
            if pos < 0:
                raise m.err(_K + "merges", f"entry {i} {w!r} is not 'left right'")
            pairs.append((w[:pos], w[pos + 1:]))
        try:
            bpe = models.BPE(vocab=self._token_to_id, merges=pairs, ignore_merges=self.ignore_merges)
            tk = HFTokenizer(bpe)
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated")
                 for r in PRE_TOKENIZER_REGEXES[self.pre_family]]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tk.decoder = decoders.ByteLevel()
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise m.err(_K + "merges", f"cannot build the BPE model: {e}") from None
        self._hf = tk

    # ----------------------------------------------------------------------------- encode
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split special-token texts out of `text` (llama.cpp tokenizer_st_partition)."""
        frags: list[str | int] = [text]
        toks = self.tokens
        attrs = self._attrs
        for sid in self._special_ids:
            if not parse_special and attrs[sid] & (_ATTR_CONTROL | _ATTR_UNKNOWN):
                continue
            st = toks[sid]
            if not any(isinstance(f, str) and st in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or st not in f:
                    out.append(f)
                    continue
                parts = f.split(st)
                for j, p in enumerate(parts):
                    if j:
                        out.append(sid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, as llama.cpp's llama_tokenize(add_special, parse_special)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if self.kind == "spm":
            is_prev_special = True
            if add_special and self.add_bos:
                out.append(self.bos_id)
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    is_prev_special = True
                    continue
                if self.add_space_prefix and is_prev_special:
                    f = " " + f
                self._spm_session(f.replace(" ", _SPACE_ESC), out)
                is_prev_special = False
            if add_special and self.add_eos:
                out.append(self.eos_id)
        else:
            if add_special and self.add_bos:
                out.append(self.bos_id)
            raw = [f for f in frags if isinstance(f, str)]
            encs = iter(self._hf.encode_batch(raw, add_special_tokens=False)) if raw else iter(())
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    out.extend(next(encs).ids)
            if add_special and self.add_eos:
                out.append(self.eos_id)
        return out

    def _spm_byte_token(self, b: int) -> int:
        i = self._byte_ids.get(b)
        if i is None:
            i = self._token_to_id.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = self._token_to_id.get(chr(b))
            if i is None:
                raise GGUFError(f"{self.source}: {_K}tokens: no byte piece <0x{b:02X}> for a "
                                "character the vocabulary does not cover")
            self._byte_ids[b] = i
        return i

    def _spm_session(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize over UTF-8 characters (Python str chars)."""
        n = len(text)
        if n == 0:
            return
        vocab = self._spm_vocab
        start = list(range(n))
        length = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        push = heapq.heappush
        pop = heapq.heappop

        # seed with all 2-character pieces; ties: leftmost first (llm_bigram_spm::comparator)
        for i in range(1, n):
            e = vocab.get(text[i - 1:i + 1])
            if e is not None:
                heap.append((-e[1], i - 1, i, 2))
        heapq.heapify(heap)

        while heap:
            _, left, right, size = pop(heap)
            nl = length[left]
            nr = length[right]
            if nl == 0 or nr == 0 or nl + nr != size:
                continue
            length[left] = nl + nr
            length[right] = 0
            r_next = nxt[right]
            nxt[left] = r_next
            if r_next >= 0:
                prev[r_next] = left
            # find more substitutions
            p = prev[left]
            if p >= 0:
                s = start[p]
                sz = length[p] + length[left]
                e = vocab.get(text[s:s + sz])
                if e is not None:
                    push(heap, (-e[1], p, left, sz))
            if r_next >= 0:
                s = start[left]
                sz = length[left] + length[r_next]
                e = vocab.get(text[s:s + sz])
                if e is not None:
                    push(heap, (-e[1], left, r_next, sz))

        # resegment: pieces emit their id, the rest falls back to <0xNN> bytes
        tid_of = self._token_to_id
        i = 0
        while i != -1:
            s = text[start[i]:start[i] + length[i]]
            tid = tid_of.get(s)
            if tid is not None:
                out.append(tid)
            else:
                for b in s.encode("utf-8", "surrogatepass"):
                    out.append(self._spm_byte_token(b))
            i = nxt[i]

    # ----------------------------------------------------------------------------- decode
    def _check_id(self, i) -> int:
        try:
            ii = int(i)
        except (TypeError, ValueError):
            raise ValueError(f"token id {i!r} is not an integer") from None
        if not 0 <= ii < self.vocab_size:
            raise ValueError(f"token id {ii} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ii

    def _piece(self, i: int) -> bytes:
        """llama.cpp token_to_piece(special=True), cached for the whole vocabulary."""
        cache = self._piece_cache
        if cache is None:
            cache = self._piece_cache = [self._make_piece(j) for j in range(self.vocab_size)]
        return cache[i]

    def _make_piece(self, i: int) -> bytes:
        a = self._attrs[i]
        text = self.tokens[i]
        if a & (_ATTR_UNKNOWN | _ATTR_CONTROL | _ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if a & _ATTR_NORMAL:
            if self.kind == "spm":
                return text.replace(_SPACE_ESC, " ").encode("utf-8", "surrogateescape")
            dec = _BYTE_DECODER
            try:
                return bytes(dec[c] for c in text)
            except KeyError:
                out = bytearray()
                for c in text:
                    b = dec.get(c)
                    if b is not None:
                        out.append(b)
                    else:
                        u = c.encode("utf-8", "surrogateescape")
                        out += b"[UNK_BYTE_0x" + u.hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
                return bytes(out)
        if a & _ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token (rendered only when special tokens are rendered)."""
        return bool(self._attrs[self._check_id(token_id)] & (_ATTR_CONTROL | _ATTR_UNKNOWN))

    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The raw bytes of one token (llama.cpp token_to_piece): for streaming.

        A byte-level or byte-fallback token may be part of a multi-byte UTF-8 character: buffer
        the bytes (see ``stream_decoder``) rather than decoding each piece alone. Control tokens
        give their text when `special`, else b"".
        """
        i = self._check_id(token_id)
        if not special and self._attrs[i] & (_ATTR_CONTROL | _ATTR_UNKNOWN):
            return b""
        return self._piece(i)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        special = not skip_special
        attrs = self._attrs
        parts: list[bytes] = []
        # SentencePiece: the space prefix that encode() adds at the start and after each special
        # token is dropped again (one leading space of the next text piece).
        strip_next = self.add_space_prefix
        for t in ids:
            i = self._check_id(t)
            a = attrs[i]
            if a & _SPECIAL_ATTRS:
                if special or not a & (_ATTR_CONTROL | _ATTR_UNKNOWN):
                    parts.append(self._piece(i))
                strip_next = self.add_space_prefix
                continue
            p = self._piece(i)
            if strip_next and a & _ATTR_NORMAL and p.startswith(b" "):
                p = p[1:]
            if p or a & _ATTR_NORMAL:
                strip_next = False
            parts.append(p)
        data = b"".join(parts)
        if self.clean_spaces:
            data = _clean_spaces(data)
        return data

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text for `ids`; bytes reassembled, invalid UTF-8 replaced by U+FFFD.

        `skip_special` leaves out control/unknown tokens (llama.cpp unparse_special=False).
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    # ----------------------------------------------------------------------------- chat
    def render_chat(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        """Render `messages` with the file's tokenizer.chat_template (see engine.text.chat)."""
        from engine.text import chat

        if not self.chat_template:
            raise GGUFError(f"{self.source}: has no tokenizer.chat_template; chat is not available")
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        try:
            return chat.render_chat(self.chat_template, messages, add_generation_prompt,
                                    bos_token=bos, eos_token=eos, **extra)
        except chat.ChatTemplateError as e:
            raise GGUFError(f"{self.source}: tokenizer.chat_template: {e}") from None

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, source={self.source!r}, vocab_size={self.vocab_size}, "
                f"pre={self.pre!r}, bos={self.bos_id}, eos={self.eos_id}, add_bos={self.add_bos})")


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp detokenize's clean_spaces passes (clean_up_tokenization_spaces), ported
    literally (in place, as the C++ does)."""
    text = bytearray(data)
    total = len(text)
    if total == 0:
        return b""
    # first pass: " ?", " !", " .", " ,"
    total1 = total
    total = 1
    for i in range(1, total1):
        x = text[i]
        if text[i - 1] == 0x20 and x in (0x3F, 0x21, 0x2E, 0x2C):
            total -= 1
        text[total] = x
        total += 1
    # second pass: strip single apostrophe between spaces
    total2 = total
    total = 1
    i = 1
    while i < total2:
        x = text[i]
        if x == 0x27 and i + 1 < total2 and text[i - 1] == 0x20 and text[i + 1] == 0x20:
            total -= 1
            i += 1
            text[i] = 0
        text[total] = x
        total += 1
        i += 1
    # third pass: apostrophe contractions " 's", " 'm", " 're", " 've"
    total3 = total
    total = 1
    for i in range(1, total3):
        x = text[i]
        if text[i - 1] == 0x20 and x == 0x27 and i + 1 < total3:
            x1 = text[i + 1]
            if x1 in (0x73, 0x6D):
                total -= 1
            elif x1 not in (0x74, 0x64) and i + 2 < total3:
                x2 = text[i + 2]
                if (x1 == 0x72 and x2 == 0x65) or (x1 == 0x76 and x2 == 0x65):
                    total -= 1
        text[total] = x
        total += 1
    return bytes(text[:total])


class StreamDecoder:
    """Incremental detokenizer: feed token ids, get text that never splits a UTF-8 character."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self._tok = tok
        self._special = not skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_to_bytes(token_id, self._special))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

def _read_metadata(path: str) -> dict[str, Any]:
    from engine.formats.gguf_file import read_metadata  # metadata only: vocabulary-only files work

    return read_metadata(path)


_CACHE: dict[tuple, Tokenizer] = {}
_CACHE_LOCK = threading.Lock()


def load_tokenizer(path_or_metadata, source: str | None = None) -> Tokenizer:
    """Tokenizer for a GGUF path (cached per file within the process), a metadata dict, or an
    object with ``.metadata`` (and ``.path``), e.g. engine.formats.gguf_file.GGUFFile."""
    if isinstance(path_or_metadata, Mapping):
        return Tokenizer.from_metadata(path_or_metadata, source or "<metadata>")
    if hasattr(path_or_metadata, "metadata") and not isinstance(path_or_metadata, (str, os.PathLike)):
        src = source or str(getattr(path_or_metadata, "path", "<metadata>"))
        return Tokenizer.from_metadata(path_or_metadata.metadata, src)
    path = os.fspath(path_or_metadata)
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open: {e.strerror}") from None
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _CACHE_LOCK:
        tok = _CACHE.get(key)
        if tok is None:
            tok = Tokenizer.from_metadata(_read_metadata(path), source or path)
            _CACHE[key] = tok
    return tok

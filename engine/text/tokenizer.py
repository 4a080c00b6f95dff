"""Tokenizer built from GGUF metadata, reproducing llama.cpp's tokenization: the facade.

    tok = load_tokenizer("model.gguf")      # or a metadata mapping, or a GGUFFile
    ids = tok.encode("def f(x):")           # add_special=True, parse_special=True
    tok.decode(ids)                          # skip_special=False
    tok.render_chat([{"role": "user", "content": "hi"}])

Two vocabulary kinds (``tokenizer.ggml.model``), each in its own module:

* ``gpt2`` -- byte-level BPE through the ``tokenizers`` library (engine.text.bpe), with the
  pre-tokenizer regexes llama.cpp uses for the file's ``tokenizer.ggml.pre``
  (engine.text.pretokenizers).
* ``llama`` -- SentencePiece, as llama.cpp's ``llm_tokenizer_spm`` (engine.text.spm).

The vocabulary, special ids and flags are read and checked by engine.text.vocab; incremental
detokenization is engine.text.streaming; chat templates engine.text.chat.

Special tokens are split out of the text first, as llama.cpp's ``tokenizer_st_partition`` does:
control and unknown tokens only with ``parse_special=True``, user-defined tokens always; longest
token text first.

Errors: a bad file is a one-line GGUFError naming the file and the metadata key (at load). A
bad token id passed to decode/token_to_bytes is a ValueError. render_chat: see its docstring.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping, Sequence

from engine.errors import GGUFError
from engine.text.bpe import BPEEncoder, bpe_piece
from engine.text.pretokenizers import PRE_TOKENIZER_REGEXES
from engine.text.spm import SPACE_ESC, SPMEncoder, spm_piece
from engine.text.streaming import StreamDecoder
from engine.text.vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED,
                               SPECIAL_ATTRS, TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
                               TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_UNUSED, TOKEN_TYPE_USER_DEFINED, Vocab,
                               read_vocab)

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


class Tokenizer:
    """Encode/decode exactly as llama.cpp does for the GGUF's vocabulary.

    Attributes: ``kind`` ("bpe" | "spm"), ``vocab_size``, ``bos_id``, ``eos_id``, ``eot_id``,
    ``unk_id`` (ints or None), ``eog_ids`` (set), ``add_bos``, ``add_eos``, ``add_space_prefix``,
    ``chat_template`` (str | None), ``tokens`` (list of token texts), ``pre`` (BPE pre-tokenizer
    name), ``pre_family`` (its regex family), ``source``.
    """

    def __init__(self):  # use from_metadata / load_tokenizer
        raise TypeError("use Tokenizer.from_metadata(md, source) or load_tokenizer(path)")

    # ----------------------------------------------------------------------------- building
    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str = "<metadata>") -> "Tokenizer":
        self = object.__new__(cls)
        self._build(read_vocab(md, source))
        return self

    def _build(self, v: Vocab) -> None:
        self.source = v.source
        self.model = v.model
        self.kind = v.kind
        self.tokens = v.tokens
        self.vocab_size = len(v.tokens)
        self._token_to_id = v.token_to_id
        self.scores = v.scores
        self._attrs = v.attrs
        self.pre = v.pre.name if v.pre else None
        self.pre_family = v.pre.family if v.pre else None
        self.ignore_merges = v.pre.ignore_merges if v.pre else False
        self.add_space_prefix = v.add_space_prefix
        self.clean_spaces = v.clean_spaces
        self.bos_id, self.eos_id, self.unk_id = v.bos_id, v.eos_id, v.unk_id
        self.eot_id, self.eom_id, self.pad_id = v.eot_id, v.eom_id, v.pad_id
        self.fim_ids = v.fim_ids
        self.add_bos, self.add_eos = v.add_bos, v.add_eos
        self.eog_ids = v.eog_ids
        self._special_ids = v.special_ids
        self.chat_template = v.chat_template
        self._piece_cache: list[bytes] | None = None
        if self.kind == "bpe":
            self._bpe = BPEEncoder(v.token_to_id, v.merges or [], v.pre.regexes, self.ignore_merges,
                                   v.source)
        else:
            self._spm = SPMEncoder(v.tokens, v.token_to_id, v.scores, v.source)

    # ----------------------------------------------------------------------------- encode
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split special-token texts out of `text` (llama.cpp tokenizer_st_partition)."""
        frags: list[str | int] = [text]
        toks = self.tokens
        attrs = self._attrs
        for sid in self._special_ids:
            if not parse_special and attrs[sid] & (ATTR_CONTROL | ATTR_UNKNOWN):
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
        if add_special and self.add_bos:
            out.append(self.bos_id)
        if self.kind == "spm":
            is_prev_special = True
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    is_prev_special = True
                    continue
                if self.add_space_prefix and is_prev_special:
                    f = " " + f
                self._spm.encode(f.replace(" ", SPACE_ESC), out)
                is_prev_special = False
        else:
            encs = iter(self._bpe.encode_fragments([f for f in frags if isinstance(f, str)]))
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    out.extend(next(encs))
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # ----------------------------------------------------------------------------- decode
    def _check_id(self, i) -> int:
        try:
            ii = int(i)
        except (TypeError, ValueError, OverflowError):
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
        if a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if a & ATTR_NORMAL:
            return spm_piece(text) if self.kind == "spm" else bpe_piece(text)
        if a & ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token (rendered only when special tokens are rendered)."""
        return bool(self._attrs[self._check_id(token_id)] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The raw bytes of one token (llama.cpp token_to_piece): for streaming.

        A byte-level or byte-fallback token may be part of a multi-byte UTF-8 character: buffer
        the bytes (see ``stream_decoder``) rather than decoding each piece alone. Control tokens
        give their text when `special`, else b"".
        """
        i = self._check_id(token_id)
        if not special and self._attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN):
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
            if a & SPECIAL_ATTRS:
                if special or not a & (ATTR_CONTROL | ATTR_UNKNOWN):
                    parts.append(self._piece(i))
                strip_next = self.add_space_prefix
                continue
            p = self._piece(i)
            if strip_next and a & ATTR_NORMAL and p.startswith(b" "):
                p = p[1:]
            if p or a & ATTR_NORMAL:
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

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    # ----------------------------------------------------------------------------- chat
    def render_chat(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        """Render `messages` with the file's tokenizer.chat_template (engine.text.chat).

        Raises GGUFError ("<file>: tokenizer.chat_template: <problem>", one line) when the file
        has no template or its template is broken: it does not compile, raises an error while
        rendering, recurses too deep, overflows, or exceeds the work/output bounds. Raises a
        plain ValueError when the messages are at fault (malformed, or the template's
        raise_exception() rejected them). Both are one-line messages for the caller's 400 / exit 2.
        """
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

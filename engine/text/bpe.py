"""Byte-level BPE (``tokenizer.ggml.model = "gpt2"``) through the ``tokenizers`` library.

``models.BPE`` from the file's tokens and merges; pre-tokenizer ``Sequence[Split(regex,
isolated)..., ByteLevel]`` with the regexes llama.cpp uses for the file's ``tokenizer.ggml.pre``
(engine.text.pretokenizers). GPT-2's byte <-> printable character table lives here, once.
"""

from __future__ import annotations

from typing import Sequence

from engine.errors import printable
from engine.formats.metadata import Metadata

__all__ = ["bytes_to_unicode", "BYTE_ENCODER", "BYTE_DECODER", "BPEEncoder", "bpe_piece",
           "read_merges"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (ByteLevel)."""
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


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}

_MERGES = "tokenizer.ggml.merges"


def read_merges(m: Metadata) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as (left, right) pairs: a required array of 'left right' strings."""
    merges = m.array(_MERGES, of=(str, bytes), required=True)
    pairs = []
    for i, w in enumerate(merges):
        if isinstance(w, bytes):
            w = w.decode("utf-8", "surrogateescape")
        pos = w.find(" ", 1)
        if pos < 0:
            raise m.error(_MERGES, f"entry {i} = {printable(repr(w))} is not 'left right'")
        pairs.append((w[:pos], w[pos + 1:]))
    return pairs


class BPEEncoder:
    """Encodes pre-split text fragments (no special tokens in them) to ids."""

    def __init__(self, token_to_id: dict[str, int], merges: list[tuple[str, str]],
                 regexes: Sequence[str], ignore_merges: bool, source: str):
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        try:
            bpe = models.BPE(vocab=token_to_id, merges=merges, ignore_merges=ignore_merges)
            tk = HFTokenizer(bpe)
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tk.decoder = decoders.ByteLevel()
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise Metadata({}, source).error(
                _MERGES, f"cannot build the BPE model: {printable(str(e))}") from None
        self._hf = tk

    def encode_fragments(self, fragments: list[str]) -> list[list[int]]:
        if not fragments:
            return []
        return [e.ids for e in self._hf.encode_batch(fragments, add_special_tokens=False)]


def bpe_piece(text: str) -> bytes:
    """The bytes of a normal byte-level token (llama.cpp token_to_piece): each character through
    the byte decoder; a character outside the table as llama.cpp writes it ([UNK_BYTE_0x..])."""
    dec = BYTE_DECODER
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

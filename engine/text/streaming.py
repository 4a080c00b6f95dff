"""Incremental detokenization: token ids in, text out that never splits a UTF-8 character.

A byte-level or byte-fallback token may carry part of a multi-byte character; the bytes are
buffered in an incremental UTF-8 decoder until the character is complete. Invalid UTF-8 becomes
U+FFFD, as in Tokenizer.decode.
"""

from __future__ import annotations

import codecs
from typing import Protocol

__all__ = ["StreamDecoder"]


class _TokenBytes(Protocol):
    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes: ...


class StreamDecoder:
    """Feed token ids one at a time; ``flush()`` at the end returns what is left."""

    def __init__(self, tok: _TokenBytes, skip_special: bool = False):
        self._tok = tok
        self._special = not skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_to_bytes(token_id, self._special))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

"""SentencePiece (``tokenizer.ggml.model = "llama"``), as llama.cpp's ``llm_tokenizer_spm``.

Spaces are escaped as U+2581 by the caller; here: the bigram merge loop by piece score over
UTF-8 characters (a pair is merged whenever its concatenation is a piece, even if a half is not;
ties: leftmost first), then ``<0xNN>`` byte pieces for what is left.
"""

from __future__ import annotations

import heapq

from engine.errors import GGUFError

__all__ = ["SPACE_ESC", "SPMEncoder", "spm_piece"]

SPACE_ESC = "\u2581"


class SPMEncoder:
    def __init__(self, tokens: list[str], token_to_id: dict[str, int], scores: list[float], source: str):
        self._token_to_id = token_to_id
        self._vocab = {t: (i, scores[i]) for i, t in enumerate(tokens)}
        self._byte_ids: dict[int, int] = {}
        self._source = source

    def _byte_token(self, b: int) -> int:
        i = self._byte_ids.get(b)
        if i is None:
            i = self._token_to_id.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = self._token_to_id.get(chr(b))
            if i is None:
                raise GGUFError(f"{self._source}: metadata field 'tokenizer.ggml.tokens' has no byte "
                                f"piece <0x{b:02X}> for a character the vocabulary does not cover")
            self._byte_ids[b] = i
        return i

    def encode(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize over UTF-8 characters (Python str chars): appends
        the ids of `text` (spaces already escaped) to `out`."""
        n = len(text)
        if n == 0:
            return
        vocab = self._vocab
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
                    out.append(self._byte_token(b))
            i = nxt[i]


def spm_piece(text: str) -> bytes:
    """The bytes of a normal SentencePiece token: U+2581 back to a space."""
    return text.replace(SPACE_ESC, " ").encode("utf-8", "surrogateescape")

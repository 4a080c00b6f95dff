"""Structured output (response_format json_object / json_schema) through llguidance.

llguidance (guidance-ai, MIT; the constrained-decoding library llama.cpp and vLLM use) compiles
a JSON schema into a grammar and, per step, gives the bitmask of the tokens that keep the
output valid; server.sampling.TokenChooser sets every other logit to -inf and feeds the chosen
token back. llguidance is an optional extra (`pip install 'gguf-prefill[structured]'`, no
dependencies of its own); without it a request that asks for structured output is a 400 that
says so.

Its tokenizer is built from the engine's own vocabulary: every token's bytes (what the
server decodes), control/special tokens marked with a 0xFF prefix so the grammar never
produces them as text, the end-of-generation ids as its EOS set, and the GGUF tokenizer
(engine.text.tokenizer) for the few places llguidance re-tokenizes text. Built once per
loaded model (lazily, on the first structured request) and shared.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from server.errors import APIError

EXTRA_HINT = "pip install 'gguf-prefill[structured]' (llguidance)"
MAX_SCHEMA_CHARS = 100_000

_lock = threading.Lock()


def _llguidance():
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise APIError(400, "response_format: structured output needs the optional "
                            f"'structured' extra, which is not installed here: {EXTRA_HINT}",
                       param="response_format") from None
    return llguidance


def grammar_for(response_format) -> str | None:
    """The llguidance grammar for a request's response_format (None: plain text)."""
    if response_format is None or response_format.type == "text":
        return None
    llg = _llguidance()
    if response_format.type == "json_object":
        schema: Any = {"type": "object"}
    else:
        schema = response_format.json_schema.schema_
        if schema is None:
            schema = {}  # OpenAI: a missing schema means any JSON value
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise APIError(400, f"response_format.json_schema.schema: {e}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise APIError(400, f"response_format.json_schema.schema: over {MAX_SCHEMA_CHARS} "
                            "characters")
    try:
        # compact JSON (no free whitespace): the output ends as soon as the value is complete
        return llg.LLMatcher.grammar_from_json_schema(text, overrides={"whitespace_flexible": False})
    except ValueError as e:
        raise APIError(400, f"response_format.json_schema.schema: {_short(e)}") from None


def _short(e: Any, limit: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= limit else s[:limit] + "..."


def lltokenizer(eng):
    """The engine's llguidance tokenizer (built once, cached on the Engine)."""
    cached = getattr(eng, "_lltokenizer", None)
    if cached is not None:
        return cached
    llg = _llguidance()
    with _lock:
        cached = getattr(eng, "_lltokenizer", None)
        if cached is None:
            cached = llg.LLTokenizer(llg.TokenizerWrapper(_VocabView(eng)),
                                     n_vocab=eng.vocab_size, eos_token=_eos_ids(eng))
            eng._lltokenizer = cached
    return cached


def _eos_ids(eng) -> list[int]:
    ids = sorted(eng.eog_ids())
    if not ids:
        raise APIError(400, "response_format: the model has no end-of-generation token, so a "
                            "constrained output could not end")
    return ids


class _VocabView:
    """What llguidance.TokenizerWrapper reads: token bytes, specials, EOS/BOS, encode()."""

    def __init__(self, eng):
        tok = eng.tokenizer
        n_tok = int(getattr(tok, "vocab_size", eng.vocab_size))
        is_special = tok.is_special  # control tokens must never be produced as text
        tokens: list[bytes] = []
        specials: list[int] = []
        for i in range(eng.vocab_size):
            if i >= n_tok:
                tokens.append(b"")  # padding rows of the output matrix: never allowed
                continue
            b = eng.token_bytes(i)
            if is_special(i):
                specials.append(i)
                b = b"\xff" + b
            tokens.append(b)
        self.tokens = tokens
        self.special_token_ids = specials
        self.eos_token_id = _eos_ids(eng)[0]
        self.bos_token_id = getattr(tok, "bos_id", None)
        self._encode = eng.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special=False, parse_special=False)


def new_matcher(eng, grammar: str):
    """A fresh matcher for one request (CPU work: call it off the event loop). A grammar that
    does not compile is the request's 400 with llguidance's reason."""
    llg = _llguidance()
    matcher = llg.LLMatcher(lltokenizer(eng), grammar, log_level=0)
    if matcher.is_error():
        raise APIError(400, f"response_format: {_short(matcher.get_error())}",
                       param="response_format")
    return matcher

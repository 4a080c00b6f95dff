"""The byte-level BPE pre-tokenizer registry: ``tokenizer.ggml.pre`` -> llama.cpp's regexes and flags.

Every name llama.cpp's ``llama_vocab::impl::load`` maps onto one of the regex families below is
registered (``qwen2``, ``llama-bpe``, ``gpt-2``, ... ); an unknown name is an error, never a
silent fallback. A missing ``tokenizer.ggml.pre`` means llama.cpp's ``default`` (the caller warns).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

__all__ = ["PRE_TOKENIZER_REGEXES", "PreTokenizer", "PRE_TOKENIZERS", "pre_tokenizer"]

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


class PreTokenizer(NamedTuple):
    """One ``tokenizer.ggml.pre`` value as llama.cpp configures it."""
    name: str
    family: str            # key of PRE_TOKENIZER_REGEXES
    ignore_merges: bool    # a whole pre-tokenized word that is a token is taken as is
    add_bos: bool          # add_bos_token default when the file does not say
    clean_spaces: bool     # clean_up_tokenization_spaces on decode

    @property
    def regexes(self) -> list[str]:
        return PRE_TOKENIZER_REGEXES[self.family]


PRE_TOKENIZERS: dict[str, PreTokenizer] = {}


def _reg(names: Iterable[str], family: str, *, ignore_merges=False, add_bos=False, clean_spaces=True):
    for n in names:
        PRE_TOKENIZERS[n] = PreTokenizer(n, family, ignore_merges, add_bos, clean_spaces)


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


def pre_tokenizer(name: str) -> PreTokenizer | None:
    """The registered pre-tokenizer `name`, or None when llama.cpp does not know it either."""
    return PRE_TOKENIZERS.get(name)

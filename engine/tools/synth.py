"""Synthetic GGUF writer: real model shapes with the llama.cpp q4_K_M tensor-type layout.

    write_synthetic(path, "tiny")                          # Gaussian weights, quantized here
    write_synthetic(path, "llama2-7b", random_blocks=True) # random valid blocks, streamed (seconds)
    tensor_plan("qwen2-7b")                                # [(name, ggml type, numpy shape)]

q4_K_M layout (llama.cpp llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M):
    output.weight                      q6_K
    blk.i.attn_v / blk.i.ffn_down      q6_K if i in q6_layers(shape) else q4_K
    every other 2-D weight (incl. token_embd)  q4_K
    norms, biases                      f32
    use_more_bits(i, n) = i < n//8 or i >= 7*n//8 or (i - n//8) % 3 == 2
(llama.cpp's i is a counter of attn_v / ffn_down tensors in source-file order: q6_layers gives
the layer index for numerically listed layers; the default qwen2.5 model was quantized from a
name-sorted file (blk.0, blk.1, blk.10, ...), so its q6_K layers, and those of the
"qwen2.5-1.5b" shape (name_sorted_layers), are 0,1,5-10,13,16,19,21,24,27.)

A weight of numpy shape [out_rows, in_cols] is stored with ggml ne = [in_cols, out_rows].

Default weights are Gaussian and scaled so that the residual stream stays O(1) and the logits
are peaked (output.weight rows have std LOGIT_STD / sqrt(d_model), so the logits have std about
LOGIT_STD and clear top-1 margins). random_blocks=True writes random bytes as blocks and
overwrites the f16 scale fields with small values chosen per tensor so that the dequantized
weights have mean ~0 and std ~1/sqrt(in_cols) (output.weight: LOGIT_STD/sqrt(in_cols)); a 7B
file is written in seconds by streaming row chunks (never the whole tensor in memory).

The vocabulary is a byte-level BPE (tokenizer.ggml.model = "gpt2", pre = "qwen2"): ids 0..255
are the 256 GPT-2 byte characters in byte order, then tokens made by merges learned on a small
built-in English corpus, then (large vocabularies) "<unused_N>" fillers (token type 5), then
"<|endoftext|>", "<|im_start|>", "<|im_end|>" (control, type 3) as the last three ids.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as GQ
from gguf import GGUFWriter

from engine.formats import quants

LOGIT_STD = 16.0          # target std of the logits (peaked: mean top-1 margin ~ LOGIT_STD/3.5)
FILE_TYPE_Q4_K_M = 15
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_MERGES = 2000

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SynthShape:
    arch: str
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    rope_base: float
    rms_eps: float = 1e-5
    n_ctx: int = 4096
    qkv_bias: bool = False
    # llama.cpp picks q6_K attn_v / ffn_down by a counter over the tensors in the order of the
    # file it quantized; True: that file listed layers by name (blk.0, blk.1, blk.10, ...), as
    # the default model's did; False: numerically.
    name_sorted_layers: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


SHAPES: dict[str, SynthShape] = {
    "llama2-7b": SynthShape("llama", 4096, 11008, 32, 32, 32, 32000, 1e4, 1e-5, 4096),
    "llama3-8b": SynthShape("llama", 4096, 14336, 32, 32, 8, 128256, 5e5, 1e-5, 8192),
    "qwen2-7b": SynthShape("qwen2", 3584, 18944, 28, 28, 4, 152064, 1e6, 1e-6, 32768, qkv_bias=True),
    # 4 layers: use_more_bits(i, 4) is true for i = 2, 3 -> attn_v/ffn_down are q4_K in layers
    # 0-1 and q6_K in layers 2-3. GQA 4 heads / 2 KV heads, head_dim 64.
    # The default model's shapes (Qwen2.5-Coder-1.5B-Instruct q4_K_M, read from its header):
    # 28 layers, d 1536, ffn 8960, 12 heads / 2 KV heads of 128, vocab 151936, context 32768,
    # rope base 1e6, eps 1e-6, q/k/v biases; q6_K attn_v/ffn_down in layers 0,1,5-10,13,16,19,
    # 21,24,27 (name-sorted counter), token_embd q4_K, output q6_K.
    "qwen2.5-1.5b": SynthShape("qwen2", 1536, 8960, 28, 12, 2, 151936, 1e6, 1e-6, 32768, qkv_bias=True,
                               name_sorted_layers=True),
    "tiny": SynthShape("llama", 256, 512, 4, 4, 2, 512, 1e4, 1e-5, 2048),
    "tiny-qwen2": SynthShape("qwen2", 256, 512, 4, 4, 2, 512, 1e6, 1e-6, 2048, qkv_bias=True),
}


class PlannedTensor(NamedTuple):
    name: str
    ggml_type: GQ
    shape: tuple[int, ...]          # numpy order: (out_rows, in_cols) or (n,)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits (integer division)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q6_layers(shape: str | SynthShape) -> set[int]:
    """Layers whose attn_v and ffn_down are q6_K: use_more_bits over llama.cpp's counter of those
    tensors in the quantized file's order (by layer number, or by name: name_sorted_layers)."""
    s = _shape(shape)
    n = s.n_layers
    order = sorted(range(n), key=str) if s.name_sorted_layers else range(n)
    return {layer for k, layer in enumerate(order) if use_more_bits(k, n)}


def _shape(shape: str | SynthShape) -> SynthShape:
    if isinstance(shape, SynthShape):
        return shape
    try:
        return SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown synthetic shape {shape!r} (known: {', '.join(SHAPES)})") from None


def tensor_plan(shape_name: str | SynthShape) -> list[PlannedTensor]:
    """Every tensor of the synthetic model in file order: (name, ggml type, numpy shape)."""
    s = _shape(shape_name)
    d, ff, hd = s.d_model, s.d_ff, s.head_dim
    q_dim, kv_dim = s.n_heads * hd, s.n_kv_heads * hd
    plan = [PlannedTensor("token_embd.weight", GQ.Q4_K, (s.vocab_size, d))]
    q6 = q6_layers(s)
    for i in range(s.n_layers):
        more = GQ.Q6_K if i in q6 else GQ.Q4_K
        p = f"blk.{i}."
        plan.append(PlannedTensor(p + "attn_norm.weight", GQ.F32, (d,)))
        plan.append(PlannedTensor(p + "attn_q.weight", GQ.Q4_K, (q_dim, d)))
        if s.qkv_bias:
            plan.append(PlannedTensor(p + "attn_q.bias", GQ.F32, (q_dim,)))
        plan.append(PlannedTensor(p + "attn_k.weight", GQ.Q4_K, (kv_dim, d)))
        if s.qkv_bias:
            plan.append(PlannedTensor(p + "attn_k.bias", GQ.F32, (kv_dim,)))
        plan.append(PlannedTensor(p + "attn_v.weight", more, (kv_dim, d)))
        if s.qkv_bias:
            plan.append(PlannedTensor(p + "attn_v.bias", GQ.F32, (kv_dim,)))
        plan.append(PlannedTensor(p + "attn_output.weight", GQ.Q4_K, (d, q_dim)))
        plan.append(PlannedTensor(p + "ffn_norm.weight", GQ.F32, (d,)))
        plan.append(PlannedTensor(p + "ffn_gate.weight", GQ.Q4_K, (ff, d)))
        plan.append(PlannedTensor(p + "ffn_up.weight", GQ.Q4_K, (ff, d)))
        plan.append(PlannedTensor(p + "ffn_down.weight", more, (d, ff)))
    plan.append(PlannedTensor("output_norm.weight", GQ.F32, (d,)))
    plan.append(PlannedTensor("output.weight", GQ.Q6_K, (s.vocab_size, d)))
    for t in plan:
        if len(t.shape) == 2 and t.shape[1] % quants.QK_K:
            raise ValueError(f"{t.name}: {t.shape[1]} columns are not whole {quants.QK_K}-blocks")
    return plan


def _row_bytes(t: PlannedTensor) -> int:
    if t.ggml_type == GQ.F32:
        return 4 * t.shape[-1]
    bb = quants.Q4_K_BYTES if t.ggml_type == GQ.Q4_K else quants.Q6_K_BYTES
    return t.shape[1] // quants.QK_K * bb


def tensor_nbytes(t: PlannedTensor) -> int:
    return _row_bytes(t) * (t.shape[0] if len(t.shape) == 2 else 1)


# ----------------------------------------------------------------------------- vocabulary

from engine.text.bpe import bytes_to_unicode  # noqa: E402  (GPT-2's byte table: one definition)


_CORPUS = """\
The quick brown fox jumps over the lazy dog. A synthetic model has no knowledge of the world,
but its tokenizer should still split ordinary English text into sensible pieces. Once upon a
time there was a little girl who lived in a village near the forest. Whenever she went out, the
little girl wore a red riding cloak, so everyone in the village called her Little Red Riding
Hood. Write a function that returns the sum of two numbers. The function should take two
arguments and return their sum. What is the capital of France? The capital of France is Paris.
Hello world! How are you today? I am fine, thank you. Please explain how a transformer language
model processes a prompt: every token is embedded, the layers apply attention and feed forward
networks, and the final layer predicts the next token. Prefill processes the whole prompt at
once, while decoding generates one token after another. def main(): print("hello") return None
import numpy as np; for i in range(10): if x is not None and y == 0: continue else: break
class Model: self.weight = weight; self.bias = bias; while True: yield value from the generator
In the beginning the universe was created. This has made a lot of people very angry and been
widely regarded as a bad move. It was the best of times, it was the worst of times, it was the
age of wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of
incredulity, it was the season of light, it was the season of darkness, it was the spring of
hope, it was the winter of despair. We have everything before us, we have nothing before us.
"""


@lru_cache(maxsize=8)
def _learn_merges(n_merges: int) -> tuple[tuple[str, str], ...]:
    """Deterministic byte-level BPE training on the built-in corpus (pieces never cross the
    qwen2 pre-tokenizer's boundaries: an optional leading space plus a run of letters)."""
    enc = bytes_to_unicode()
    words = Counter("".join(enc[b] for b in w.encode()) for w in re.findall(r" ?[A-Za-z]+", _CORPUS))
    seqs = {w: list(w) for w in words}
    known = {enc[b] for b in range(256)}
    merges: list[tuple[str, str]] = []
    banned: set[tuple[str, str]] = set()
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                if (a, b) not in banned:
                    pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        new = best[0] + best[1]
        if new in known:                    # would duplicate a token: never merge this pair
            banned.add(best)
            continue
        known.add(new)
        merges.append(best)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return tuple(merges)


def make_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges "a b") for a vocabulary of exactly vocab_size tokens."""
    n_special = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size {vocab_size} < {256 + n_special}")
    enc = bytes_to_unicode()
    tokens = [enc[b] for b in range(256)]
    merges = _learn_merges(min(vocab_size - 256 - n_special, MAX_MERGES))
    tokens += [a + b for a, b in merges]
    types = [TOKEN_NORMAL] * len(tokens)
    n_fill = vocab_size - n_special - len(tokens)
    tokens += [f"<unused_{i}>" for i in range(n_fill)]
    types += [TOKEN_UNUSED] * n_fill
    tokens += list(SPECIAL_TOKENS)
    types += [TOKEN_CONTROL] * n_special
    assert len(tokens) == vocab_size and len(set(tokens)) == vocab_size
    return tokens, types, [f"{a} {b}" for a, b in merges]


# ----------------------------------------------------------------------------- weights

def _std_for(t: PlannedTensor, s: SynthShape) -> float:
    """Std of the Gaussian weights: O(1) residual stream, peaked logits."""
    name = t.name
    if name == "token_embd.weight":
        return 1.0
    if name == "output.weight":
        return LOGIT_STD / np.sqrt(t.shape[1])
    if name.endswith("attn_output.weight") or name.endswith("ffn_down.weight"):
        return 0.5 / np.sqrt(t.shape[1])
    return 1.0 / np.sqrt(t.shape[1])


def _vector(t: PlannedTensor, rng: np.random.Generator, random_blocks: bool) -> np.ndarray:
    n = t.shape[0]
    if t.name.endswith("norm.weight"):
        if random_blocks:
            return np.ones(n, np.float32)
        return (1.0 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)
    # qkv bias
    return (rng.standard_normal(n) * 0.1).astype(np.float32)


def _f16_field(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _random_block_rows(t: PlannedTensor, rows: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """rows x row_bytes of random valid blocks whose dequantized values have mean ~0, std ~std."""
    rb = _row_bytes(t)
    raw = rng.integers(0, 256, rows * rb, dtype=np.uint8)
    if t.ggml_type == GQ.Q4_K:
        b = raw.reshape(-1, quants.Q4_K_BYTES)
        # value = d*sc*q - dmin*m, sc, m ~ U{0..63}, q ~ U{0..15}, dmin = 7.5 d: std ~ 257 d;
        # the 7.5 cancels the mean (E[sc q] = 7.5 E[m]).
        d = std / 257.0 * rng.uniform(0.75, 1.25, b.shape[0])
        b[:, 0:2] = _f16_field(d)
        b[:, 2:4] = _f16_field(d * 7.5)
    else:
        b = raw.reshape(-1, quants.Q6_K_BYTES)
        # value = d*sc*(q-32), sc ~ U{-128..127}, q-32 ~ U{-32..31}: std(sc*(q-32)) ~ 1370
        d = std / 1370.0 * rng.uniform(0.75, 1.25, b.shape[0])
        b[:, 208:210] = _f16_field(d)
    return raw.reshape(rows, rb)


def _tensor_chunks(t: PlannedTensor, s: SynthShape, rng: np.random.Generator,
                   random_blocks: bool, chunk_elems: int):
    """Yield the tensor's bytes in row chunks (uint8 or float32 arrays)."""
    if len(t.shape) == 1:
        yield _vector(t, rng, random_blocks)
        return
    rows, cols = t.shape
    step = max(1, chunk_elems // cols)
    std = _std_for(t, s)
    quant = quants.quantize_q4_k if t.ggml_type == GQ.Q4_K else quants.quantize_q6_k
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if random_blocks:
            yield _random_block_rows(t, n, std, rng)
        else:
            x = (rng.standard_normal((n, cols), dtype=np.float32) * np.float32(std))
            yield quant(x)


# ----------------------------------------------------------------------------- writer

def _add_metadata(w: GGUFWriter, s: SynthShape, shape_name: str) -> None:
    a = s.arch
    w.add_string("general.name", f"synthetic-{shape_name}")
    w.add_uint32("general.file_type", FILE_TYPE_Q4_K_M)
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{a}.block_count", s.n_layers)
    w.add_uint32(f"{a}.context_length", s.n_ctx)
    w.add_uint32(f"{a}.embedding_length", s.d_model)
    w.add_uint32(f"{a}.feed_forward_length", s.d_ff)
    w.add_uint32(f"{a}.attention.head_count", s.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_kv_heads)
    w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", float(s.rope_base))
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", float(s.rms_eps))

    tokens, types, merges = make_vocab(s.vocab_size)
    eot = tokens.index("<|endoftext|>")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", eot)
    w.add_uint32("tokenizer.ggml.bos_token_id", eot)
    w.add_uint32("tokenizer.ggml.padding_token_id", eot)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHATML_TEMPLATE)


def write_synthetic(path, shape: str, random_blocks: bool = False, seed: int = 0,
                    chunk_elems: int = 1 << 22) -> Path:
    """Write a synthetic q4_K_M GGUF of the named shape (see SHAPES) to path; returns the path.

    Tensors are generated and written one row-chunk at a time (chunk_elems weights), so memory
    stays small even for 7B shapes. Deterministic for a given (shape, random_blocks, seed).
    """
    s = _shape(shape)
    shape_name = shape if isinstance(shape, str) else "custom"
    path = Path(path)
    plan = tensor_plan(s)
    w = GGUFWriter(path, s.arch)
    _add_metadata(w, s, shape_name)
    for t in plan:
        nbytes = tensor_nbytes(t)
        if t.ggml_type == GQ.F32:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes)
        else:
            byte_shape = (t.shape[0], _row_bytes(t))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=t.ggml_type)
    try:
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        # Same byte stream as GGUFWriter.write_tensor_data, but each tensor arrives in chunks.
        w.write_padding(fout, fout.tell())
        for idx, t in enumerate(plan):
            rng = np.random.default_rng([seed, idx, int(random_blocks)])
            written = 0
            for chunk in _tensor_chunks(t, s, rng, random_blocks, chunk_elems):
                chunk.tofile(fout)
                written += chunk.nbytes
            assert written == tensor_nbytes(t), t.name
            w.write_padding(fout, written)
        w.tensors = [{}]
        w.state = type(w.state).WEIGHTS
        w.flush()
    finally:
        w.close()
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.synth", description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--random-blocks", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_synthetic(args.path, args.shape, random_blocks=args.random_blocks, seed=args.seed)
    print(args.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

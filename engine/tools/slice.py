"""Cut a small real-weight GGUF out of a big one, copying whole blocks byte for byte.

- `layers`: the layers kept, renumbered 0..n-1 in the order given.
- `vocab`: the first `vocab` rows of token_embd / output (and the vocabulary trimmed to match:
  merges whose pieces fall outside it are dropped, special ids outside it are removed).
- `ffn`: optionally the first `ffn` FFN columns (a multiple of 256): the first rows of
  ffn_gate / ffn_up, and the first ffn/256 blocks of every ffn_down row.

Every kept block is the real one, so a slice checks GPU kernels against real weight statistics
(e.g. Qwen2's large layer-0 k bias) in a file small enough to carry to the GPU.
"""
from __future__ import annotations

import os

import numpy as np

from engine.errors import UsageError
from engine.formats.metadata import Metadata
from engine.formats.qtypes import QTYPES
from engine.formats.weights import layer_name, open_model

_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "padding_token_id",
                    "unknown_token_id", "sep_token_id", "eom_token_id")


def _trimmed_vocab(md: Metadata, vocab: int) -> dict:
    """Tokenizer metadata restricted to the first `vocab` tokens."""
    out = {}
    tokens = md.array("tokenizer.ggml.tokens", default=None, of=str)
    if tokens is None:
        return out
    kept = tokens[:vocab]
    out["tokenizer.ggml.tokens"] = kept
    for key, kind in (("tokenizer.ggml.token_type", int), ("tokenizer.ggml.scores", (int, float))):
        if md.has(key):
            out[key] = md.array(key, of=kind)[:vocab]
    merges_in = md.array("tokenizer.ggml.merges", default=None, of=str)
    if merges_in is not None:
        pieces = set(kept)
        merges = []
        for m in merges_in:
            a, _, b = m.partition(" ")
            if a in pieces and b in pieces and a + b in pieces:
                merges.append(m)
        out["tokenizer.ggml.merges"] = merges
    return out


def slice_model(src: str, dst: str, layers: list[int], vocab: int, ffn: int | None = None) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    mf = open_model(src)
    cfg = mf.config
    bad = [i for i in layers if not 0 <= i < cfg.n_layers]
    if bad or not layers:
        raise UsageError(f"--layers: {bad or 'none'} not in 0..{cfg.n_layers - 1}")
    if not 0 < vocab <= cfg.vocab_size:
        raise UsageError(f"--vocab: {vocab} not in 1..{cfg.vocab_size}")
    if ffn is not None and (ffn <= 0 or ffn % 256 or ffn > cfg.d_ff):
        raise UsageError(f"--ffn: {ffn} must be a positive multiple of 256 up to {cfg.d_ff}")

    arch = cfg.arch
    checked = Metadata(mf.metadata, mf.path)
    md = dict(mf.metadata)
    md.update(_trimmed_vocab(checked, vocab))
    md[f"{arch}.block_count"] = len(layers)
    if ffn is not None:
        md[f"{arch}.feed_forward_length"] = ffn
    for k in _SPECIAL_ID_KEYS:
        key = f"tokenizer.ggml.{k}"
        if checked.integer(key, default=None) is not None and md[key] >= vocab:
            del md[key]
    name = checked.string("general.name", default="model")
    md["general.name"] = f"{name} (slice: layers {layers}, vocab {vocab}, ffn {ffn or cfg.d_ff})"

    reader = GGUFReader(src, "r")
    types = {name: f.types for name, f in reader.fields.items()}
    writer = GGUFWriter(dst + ".tmp", arch)  # writes general.architecture itself
    for key, value in md.items():
        if key == "general.architecture":
            continue
        t = types.get(key, [GGUFValueType.STRING])
        if t[0] == GGUFValueType.ARRAY:
            sub = t[-1]
            value = list(value) if not isinstance(value, list) else value
            if sub != GGUFValueType.STRING:
                value = [v.item() if hasattr(v, "item") else v for v in value]
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, value, t[0])

    def add(name: str, data: np.ndarray, ggml_type: int) -> None:
        data = np.ascontiguousarray(data)
        if QTYPES[ggml_type].kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType(ggml_type))

    def rows(name: str, n: int | None = None):
        t = mf.tensor(name)
        return (t.data if n is None else t.data[:n]), t.ggml_type

    add("token_embd.weight", *rows("token_embd.weight", vocab))
    add("output_norm.weight", *rows("output_norm.weight"))
    if not cfg.tied_output:
        add("output.weight", *rows("output.weight", vocab))
    for new_i, old_i in enumerate(layers):
        for name, t in mf.gguf.tensors.items():
            prefix = f"blk.{old_i}."
            if not name.startswith(prefix):
                continue
            role, kind = name[len(prefix):].rsplit(".", 1)
            data, ggml_type = rows(name)
            if ffn is not None and role in ("ffn_gate", "ffn_up"):
                data = data[:ffn]
            elif ffn is not None and role == "ffn_down":
                block_elems, block_bytes = QTYPES[ggml_type].block_elems, QTYPES[ggml_type].block_bytes
                data = data[:, : ffn // block_elems * block_bytes]
            add(layer_name(new_i, role, kind), data, ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dst + ".tmp", dst)
    open_model(dst)  # the slice must itself be a valid model

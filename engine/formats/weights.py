"""Model tensors by role: the GGUF name table, the expected shapes and types, and validation.

A weight of numpy shape [out, in] multiplies activations as y = x @ W.T.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.formats.config import ModelConfig
from engine.errors import GGUFError, printable
from engine.formats.gguf_file import GGUFFile, TensorInfo, open_gguf
from engine.formats.metadata import Metadata

MATRIX_TYPES = ("Q4_K", "Q6_K", "F16", "F32")
VECTOR_TYPES = ("F32",)
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NORMS = ("attn_norm", "ffn_norm")
QKV_BIASES = ("attn_q", "attn_k", "attn_v")


def layer_name(layer: int, role: str, kind: str = "weight") -> str:
    return f"blk.{layer}.{role}.{kind}"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    types: tuple[str, ...]
    required: bool = True


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    d, ff, q, kv, vocab = cfg.d_model, cfg.d_ff, cfg.q_dim, cfg.kv_dim, cfg.vocab_size
    spec = {
        "token_embd.weight": TensorSpec((vocab, d), MATRIX_TYPES),
        "output_norm.weight": TensorSpec((d,), VECTOR_TYPES),
        "output.weight": TensorSpec((vocab, d), MATRIX_TYPES, required=False),
    }
    shapes = {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
              "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    for i in range(cfg.n_layers):
        for role in LAYER_NORMS:
            spec[layer_name(i, role)] = TensorSpec((d,), VECTOR_TYPES)
        for role, shape in shapes.items():
            spec[layer_name(i, role)] = TensorSpec(shape, MATRIX_TYPES)
        for role in QKV_BIASES:
            spec[layer_name(i, role, "bias")] = TensorSpec(
                (shapes[role][0],), VECTOR_TYPES, required=cfg.has_qkv_bias)
    return spec


@dataclass
class ModelFile:
    """A validated GGUF model: its container, its config, its tensors by name."""

    gguf: GGUFFile
    config: ModelConfig

    @property
    def path(self) -> str:
        return self.gguf.path

    @property
    def metadata(self) -> dict:
        return self.gguf.metadata

    def tensor(self, name: str) -> TensorInfo:
        return self.gguf.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    @property
    def output_tensor(self) -> TensorInfo:
        return self.tensor("token_embd.weight" if self.config.tied_output else "output.weight")

    def check_ids(self, ids: Sequence[int], length: int, capacity: int) -> np.ndarray:
        """Token ids of a forward at cache position `length` (of `capacity`), checked against
        the vocabulary and the cache: int64 [n]; GGUFError naming the file otherwise. The one
        input check of both backends' forward."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GGUFError(f"{self.path}: forward needs at least one token")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise GGUFError(f"{self.path}: token id {int(bad[0])} is outside the vocabulary "
                            f"(0..{self.config.vocab_size - 1})")
        if length + ids.size > capacity:
            raise GGUFError(f"{self.path}: {length + ids.size} tokens exceed the KV cache size {capacity}")
        return ids


def open_model(path: str | os.PathLike) -> ModelFile:
    """Open a GGUF model file and validate every tensor's name, type and shape against its config."""
    gf = open_gguf(path)
    embd = gf.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{gf.path}: missing tensor 'token_embd.weight'")
    if len(embd.shape) != 2:
        raise GGUFError(f"{gf.path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, want 2-D")
    vocab = embd.shape[0]
    md = Metadata(gf.metadata, gf.path)
    tokens = md.array("tokenizer.ggml.tokens", default=None)
    if tokens is not None and len(tokens) != vocab:
        raise GGUFError(f"{gf.path}: field 'tokenizer.ggml.tokens' has {len(tokens)} entries but "
                        f"tensor 'token_embd.weight' has {vocab} rows")
    cfg = ModelConfig.from_metadata(md, set(gf.tensors), vocab, gf.path)
    spec = expected_tensors(cfg)
    for name, s in spec.items():
        t = gf.tensors.get(name)
        if t is None:
            if s.required:
                raise GGUFError(f"{gf.path}: missing tensor '{name}'")
            continue
        if t.type_name not in s.types:
            raise GGUFError(f"{gf.path}: tensor '{name}' has type {t.type_name}; "
                            f"expected one of {', '.join(s.types)}")
        if t.shape != s.shape:
            raise GGUFError(f"{gf.path}: tensor '{name}' has shape {list(t.shape)}; "
                            f"expected {list(s.shape)} from the metadata")
    for name in gf.tensors:
        if name not in spec:
            raise GGUFError(f"{gf.path}: unexpected tensor '{printable(name)}' for architecture {cfg.arch} "
                            f"with {cfg.n_layers} layers")
    return ModelFile(gf, cfg)

"""numpy reference forward for llama and qwen2 (the CPU backend and the whole-model oracle) and its
KV cache; the float ops it runs are in engine/reference/ops.py.

Float32 throughout (RoPE angles in float64, then rounded). Each weight is dequantized once at load;
token embeddings are dequantized per token (one row block each), so only one copy of the model is
in memory.

    x = embed(ids)                                        # [n, d]
    per layer:
        h = rmsnorm(x) * attn_norm
        q, k, v = h @ Wq.T (+bq), h @ Wk.T (+bk), h @ Wv.T (+bv)
        q, k = rope(q, pos), rope(k, pos)                 # normal: pairs (2i, 2i+1); neox: (i, i+hd/2)
        a = softmax(q k^T / sqrt(hd) + causal mask) v     # GQA: head h reads KV head h // (H / KVH)
        x = x + a @ Wo.T
        h = rmsnorm(x) * ffn_norm
        x = x + (silu(h @ Wg.T) * (h @ Wu.T)) @ Wd.T
    logits = rmsnorm(x) * output_norm @ Wout.T
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.errors import GGUFError
from engine.formats.config import ModelConfig
from engine.formats.rope import rope_tables
from engine.formats.weights import LAYER_MATRICES, LAYER_NORMS, QKV_BIASES, ModelFile, layer_name, open_model
from engine.reference.ops import apply_rope, causal_attention, dequantize_rows, rms_norm, silu

__all__ = ["KVCache", "ReferenceModel"]


class KVCache:
    """K and V per layer: [n_layers, max_tokens, n_kv_heads, head_dim] float32."""

    def __init__(self, cfg: ModelConfig, max_tokens: int):
        shape = (cfg.n_layers, max_tokens, cfg.n_kv_heads, cfg.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.max_tokens = max_tokens
        self.length = 0


class ReferenceModel:
    """The numpy backend. See the module docstring for the forward."""

    device = "cpu"

    def __init__(self, model: ModelFile):
        self.file = model
        self.config = cfg = model.config
        self.embd = model.tensor("token_embd.weight")
        self.output_norm = np.asarray(model.tensor("output_norm.weight").data, dtype=np.float32)
        self.layers = []
        for i in range(cfg.n_layers):
            layer = {role: dequantize_rows(model.tensor(layer_name(i, role))) for role in LAYER_MATRICES}
            for role in LAYER_NORMS:
                layer[role] = np.asarray(model.tensor(layer_name(i, role)).data, dtype=np.float32)
            for role in QKV_BIASES:
                name = layer_name(i, role, "bias")
                layer[role + "_bias"] = (np.asarray(model.tensor(name).data, dtype=np.float32)
                                         if model.has(name) else None)
            self.layers.append(layer)
        self.output = dequantize_rows(model.output_tensor)
        self.resident_bytes = sum(a.nbytes for layer in self.layers for a in layer.values()
                                  if a is not None) + self.output.nbytes

    @classmethod
    def from_path(cls, path) -> "ReferenceModel":
        return cls(open_model(path))

    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(self.config, max_tokens)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        if self.config.tied_output:
            return self.output[ids]
        return dequantize_rows(self.embd, ids)

    def check_ids(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GGUFError(f"{self.file.path}: forward needs at least one token")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise GGUFError(f"{self.file.path}: token id {int(bad[0])} is outside the vocabulary "
                            f"(0..{self.config.vocab_size - 1})")
        if cache.length + ids.size > cache.max_tokens:
            raise GGUFError(f"{self.file.path}: {cache.length + ids.size} tokens exceed the KV cache "
                            f"size {cache.max_tokens}")
        return ids

    def hidden(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Final-normed hidden states [n, d] of ids appended at cache.length."""
        cfg = self.config
        ids = self.check_ids(ids, cache)
        n, start = ids.size, cache.length
        positions = np.arange(start, start + n)
        cos, sin = rope_tables(cfg, positions)
        x = self.embed(ids)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
            q, k, v = h @ w["attn_q"].T, h @ w["attn_k"].T, h @ w["attn_v"].T
            if w["attn_q_bias"] is not None:
                q += w["attn_q_bias"]
                k += w["attn_k_bias"]
                v += w["attn_v_bias"]
            q = apply_rope(q.reshape(n, cfg.n_heads, cfg.head_dim), cos, sin, cfg.rope_type)
            k = apply_rope(k.reshape(n, cfg.n_kv_heads, cfg.head_dim), cos, sin, cfg.rope_type)
            cache.k[i, start:start + n] = k
            cache.v[i, start:start + n] = v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
            a = causal_attention(q, cache.k[i, :start + n], cache.v[i, :start + n], start)
            x = x + a @ w["attn_output"].T
            h = rms_norm(x, w["ffn_norm"], cfg.rms_eps)
            x = x + (silu(h @ w["ffn_gate"].T) * (h @ w["ffn_up"].T)) @ w["ffn_down"].T
        cache.length = start + n
        return rms_norm(x, self.output_norm, cfg.rms_eps)

    def forward(self, ids: Sequence[int], cache: KVCache, all_logits: bool = False) -> np.ndarray:
        h = self.hidden(ids, cache)
        if all_logits:
            return h @ self.output.T
        return h[-1] @ self.output.T

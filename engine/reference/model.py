"""numpy reference forward for llama and qwen2 (the CPU backend and the whole-model oracle) and its
KV cache; the float ops it runs are in engine/reference/ops.py.

Float32 throughout (RoPE angles in float64, then rounded). Weight matrices are held one of three
ways (Matrix):
- resident float32, dequantized once at load (the file's pages of it are then dropped): models
  whose float32 matrices fit in AUTO_F32_MAX (the tests' synthetic models), or up to an explicit
  f32_bytes / GGUF_PREFILL_CPU_F32_GIB budget;
- quantized: q4_K / q6_K matrices through the compiled kernels of engine/reference/qmatmul.py
  (numba; q4_K read from the file's blocks, q6_K from an int8 copy of its quants), a fused
  product for steps of up to FUSED_MAX_T tokens, chunks dequantized to the same float32 values
  and a BLAS product above that. The default for models past AUTO_F32_MAX (the default model:
  RSS 1.5x the file instead of 5.7x, faster decode);
- past an explicit budget, or without numba: dequantized per forward in row chunks by numpy
  (same values, less memory, much slower).
Token embeddings are dequantized per token at lookup, so no [vocab, d] float32 table is held.

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

import ctypes
import importlib
import math
import mmap
import os
import sys
import threading
import warnings
from typing import Sequence

import numpy as np

from engine.errors import GGUFError
from engine.formats.config import ModelConfig
from engine.formats.gguf_file import TensorInfo
from engine.formats.qtypes import qtype
from engine.formats.rope import rope_tables
from engine.formats.weights import LAYER_MATRICES, LAYER_NORMS, QKV_BIASES, ModelFile, layer_name, open_model
from engine.reference.ops import ROW_CHUNK, apply_rope, causal_attention, dequantize_rows, rms_norm, silu

__all__ = ["KVCache", "Matrix", "ReferenceModel", "AUTO_F32_MAX", "FUSED_MAX_T", "default_quantized"]

AUTO_F32_MAX = 2**30        # float32 matrix bytes a model keeps resident by default; past it: quantized
FUSED_MAX_T = 6             # steps of up to this many tokens take the fused kernel (measured, perf log)
QUANT_CHUNK_BYTES = 4 << 20  # float32 rows dequantized at a time above FUSED_MAX_T (stays in cache)


class KVCache:
    """K and V per layer: [n_layers, max_tokens, n_kv_heads, head_dim] float32."""

    def __init__(self, cfg: ModelConfig, max_tokens: int):
        shape = (cfg.n_layers, max_tokens, cfg.n_kv_heads, cfg.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.max_tokens = max_tokens
        self.length = 0


def _page_out(a: np.ndarray) -> None:
    """Drop the process's resident pages of a read-only file mapping under `a` (Linux madvise
    MADV_DONTNEED: the bytes stay in the file and page back in if touched again)."""
    global _libc
    if sys.platform != "linux" or a.nbytes == 0:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    start = a.ctypes.data // page * page
    end = -(-(a.ctypes.data + a.nbytes) // page) * page
    _libc.madvise(start, end - start, 4)  # MADV_DONTNEED; a failure only leaves the pages resident


_libc = None


class Matrix:
    """One weight W [out, in] of the model, multiplied as h @ W.T.

    Resident (`w`): its float32 rows, dequantized once at load (the file's pages of it are then
    dropped from the process). Quantized (`q`, an engine.reference.qmatmul.QuantMatrix; the
    file's pages are dropped when it holds its own copy of the quants): steps of up to
    FUSED_MAX_T tokens through the fused kernel (the weights never written out; a token's results
    have the same bits whatever the step's size), larger ones through chunks of QUANT_CHUNK_BYTES
    dequantized to the same float32 values as dequantize_rows and a BLAS product. Neither: the
    file's blocks, dequantized per call by numpy ROW_CHUNK rows at a time (same W rows, same BLAS
    product as resident, slow).
    """

    def __init__(self, t: TensorInfo, resident: bool, quant=None):
        self.tensor = t
        self.shape = t.shape
        self.w = dequantize_rows(t) if resident else None
        self.q = None if resident else quant
        if resident or (quant is not None and not quant.reads_file):
            _page_out(t.data)

    @property
    def nbytes(self) -> int:
        if self.w is not None:
            return self.w.nbytes
        return self.q.nbytes if self.q is not None else self.tensor.n_bytes

    def matmul_t(self, h: np.ndarray) -> np.ndarray:
        """h [n, in] @ W.T -> float32 [n, out]."""
        if self.w is not None:
            return h @ self.w.T
        if self.q is not None:
            return self.q.matmul_t(h) if h.shape[0] <= FUSED_MAX_T else self._chunks_t(h)
        rows, cols = self.shape
        out = np.empty((h.shape[0], rows), dtype=np.float32)
        scratch = np.empty((min(ROW_CHUNK, rows), cols), dtype=np.float32)
        for r in range(0, rows, ROW_CHUNK):
            w = dequantize_rows(self.tensor, slice(r, r + ROW_CHUNK), out=scratch[:min(ROW_CHUNK, rows - r)])
            np.matmul(h, w.T, out=out[:, r:r + w.shape[0]])
        return out

    def _chunks_t(self, h: np.ndarray) -> np.ndarray:
        """Quantized, many tokens: chunks of QUANT_CHUNK_BYTES rows dequantized (the float32
        values of dequantize_rows) and multiplied as w @ h.T into [rows, n] (OpenBLAS is ~30%
        faster that way round than h @ w.T at prompt sizes, which pays for the dequantization)."""
        rows, cols = self.shape
        chunk = min(rows, max(64, QUANT_CHUNK_BYTES // (4 * cols)))
        ht = np.ascontiguousarray(h.T, dtype=np.float32)
        out_t = np.empty((rows, h.shape[0]), dtype=np.float32)
        scratch = _scratch(chunk * cols).reshape(chunk, cols)
        for r in range(0, rows, chunk):
            w = self.q.dequantize(r, scratch[:min(chunk, rows - r)])
            np.matmul(w, ht, out=out_t[r:r + w.shape[0]])
        return np.ascontiguousarray(out_t.T)


_SCRATCH = threading.local()


def _scratch(n: int) -> np.ndarray:
    """This thread's float32 scratch of at least n elements, kept between calls: a fresh 4 MB
    buffer per call is fresh pages from the kernel, and touching them cost more than the
    dequantization (measured: 0.2 s -> 1.3 s a prompt in some processes)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < n:
        buf = _SCRATCH.buf = np.empty(n, dtype=np.float32)
    return buf[:n]


def default_quantized(f32_matrix_bytes: int, budget: int | None) -> bool:
    """The default way to hold the matrices: quantized (True) when no float32 budget was given
    and the model's matrices as float32 would take more than AUTO_F32_MAX bytes."""
    return budget is None and f32_matrix_bytes > AUTO_F32_MAX


def quant_kernels():
    """engine.reference.qmatmul (imports numba), or None with one warning when numba is missing."""
    try:
        return importlib.import_module("engine.reference.qmatmul")
    except ImportError as e:
        warnings.warn(f"CPU backend: numba is not importable ({e}); quantized matrices are "
                      "dequantized per forward by numpy instead (same results, much slower; "
                      "pip install numba)", RuntimeWarning, stacklevel=3)
        return None


def f32_budget_from_env() -> int | None:
    """GGUF_PREFILL_CPU_F32_GIB: GiB of dequantized float32 weights the CPU backend keeps
    (unset: all of them, the fastest; 0: none, the least memory)."""
    v = os.environ.get("GGUF_PREFILL_CPU_F32_GIB", "").strip()
    if not v:
        return None
    try:
        gib = float(v)
    except ValueError:
        raise GGUFError(f"GGUF_PREFILL_CPU_F32_GIB={v[:40]!r} is not a number of GiB") from None
    if not math.isfinite(gib) or gib < 0:
        raise GGUFError(f"GGUF_PREFILL_CPU_F32_GIB={v[:40]!r} must be a finite number >= 0")
    return int(gib * 2**30)


class ReferenceModel:
    """The numpy backend. See the module docstring for the forward.

    quantized: hold the q4_K / q6_K matrices quantized behind the compiled kernels of
    engine/reference/qmatmul.py (None: default_quantized, i.e. when no budget is given and the
    float32 matrices would pass AUTO_F32_MAX). Otherwise f32_bytes bounds the dequantized
    float32 weights kept in memory (None: read from GGUF_PREFILL_CPU_F32_GIB; unset there: every
    matrix); matrices past the budget, the last layers' first, are dequantized per forward
    instead (same values, slower).
    """

    device = "cpu"

    def __init__(self, model: ModelFile, f32_bytes: int | None = None, quantized: bool | None = None):
        self.file = model
        self.config = cfg = model.config
        budget = f32_budget_from_env() if f32_bytes is None else f32_bytes
        if quantized is None:
            mats = [model.output_tensor] + [model.tensor(layer_name(i, role))
                                            for i in range(cfg.n_layers) for role in LAYER_MATRICES]
            quantized = default_quantized(sum(t.shape[0] * t.shape[1] * 4 for t in mats), budget)
        kernels = quant_kernels() if quantized else None
        if quantized and kernels is None:
            budget = 0                      # numba missing: today's per-forward numpy path
        self.quantized = kernels is not None
        left = [float("inf") if budget is None or self.quantized else budget]

        def matrix(t: TensorInfo) -> Matrix:
            kind = qtype(t.type_name).kind
            if self.quantized and kind in kernels.KINDS:
                return Matrix(t, False, kernels.QuantMatrix(kind, t.data))
            need = t.shape[0] * t.shape[1] * 4
            keep = need <= left[0]
            if keep:
                left[0] -= need
            return Matrix(t, keep)

        self.embd = model.tensor("token_embd.weight")
        self.output_norm = np.asarray(model.tensor("output_norm.weight").data, dtype=np.float32)
        # the output matrix first: it is read for every token's logits
        self.output = matrix(model.output_tensor)
        self.layers = []
        for i in range(cfg.n_layers):
            layer = {role: matrix(model.tensor(layer_name(i, role))) for role in LAYER_MATRICES}
            for role in LAYER_NORMS:
                layer[role] = np.asarray(model.tensor(layer_name(i, role)).data, dtype=np.float32)
            for role in QKV_BIASES:
                name = layer_name(i, role, "bias")
                layer[role + "_bias"] = (np.asarray(model.tensor(name).data, dtype=np.float32)
                                         if model.has(name) else None)
            self.layers.append(layer)
        self.resident_bytes = self.output.nbytes + sum(
            a.nbytes for layer in self.layers for a in layer.values() if a is not None)

    @classmethod
    def from_path(cls, path) -> "ReferenceModel":
        return cls(open_model(path))

    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(self.config, max_tokens)

    def batch(self, n_slots: int, slot_capacity: int, fit_memory: bool = False):
        """The batched-step backend over this model (engine.reference.batch.ReferenceBatch;
        its slots grow on demand, so fit_memory has nothing to shrink)."""
        from engine.reference.batch import ReferenceBatch

        return ReferenceBatch(self, n_slots, slot_capacity)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Rows of the token embedding, dequantized at lookup (the tied output's f32 rows when held)."""
        if self.config.tied_output and self.output.w is not None:
            return self.output.w[ids]
        return dequantize_rows(self.embd, ids)

    def check_ids(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        return self.file.check_ids(ids, cache.length, cache.max_tokens)

    def hidden(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Final-normed hidden states [n, d] of ids appended at cache.length."""
        return self.hidden_batch([(ids, cache)])

    def hidden_batch(self, parts: Sequence[tuple[Sequence[int], KVCache]]) -> np.ndarray:
        """One forward over several sequences: parts = [(ids, cache)], each ids appended at its
        own cache.length (distinct caches). The GEMMs run over all rows at once, attention per
        sequence over its own cache. Returns the final-normed hidden states [sum n, d], the
        parts' rows in order."""
        cfg = self.config
        if len({id(c) for _, c in parts}) != len(parts):
            raise ValueError("hidden_batch: a cache appears twice in one batch")
        checked = [(self.check_ids(ids, cache), cache) for ids, cache in parts]
        spans, r = [], 0
        for ids, cache in checked:
            spans.append((r, r + ids.size, cache.length))
            r += ids.size
        positions = np.concatenate([np.arange(st, st + (e - s)) for s, e, st in spans])
        cos, sin = rope_tables(cfg, positions)
        x = self.embed(np.concatenate([ids for ids, _ in checked]))
        n = x.shape[0]
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
            q, k, v = w["attn_q"].matmul_t(h), w["attn_k"].matmul_t(h), w["attn_v"].matmul_t(h)
            if w["attn_q_bias"] is not None:
                q += w["attn_q_bias"]
                k += w["attn_k_bias"]
                v += w["attn_v_bias"]
            q = apply_rope(q.reshape(n, cfg.n_heads, cfg.head_dim), cos, sin, cfg.rope_type)
            k = apply_rope(k.reshape(n, cfg.n_kv_heads, cfg.head_dim), cos, sin, cfg.rope_type)
            v = v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
            a = np.empty((n, cfg.q_dim), dtype=np.float32)
            for (s, e, st), (_, cache) in zip(spans, checked):
                end = st + (e - s)
                cache.k[i, st:end] = k[s:e]
                cache.v[i, st:end] = v[s:e]
                a[s:e] = causal_attention(q[s:e], cache.k[i, :end], cache.v[i, :end], st)
            x = x + w["attn_output"].matmul_t(a)
            h = rms_norm(x, w["ffn_norm"], cfg.rms_eps)
            x = x + w["ffn_down"].matmul_t(silu(w["ffn_gate"].matmul_t(h)) * w["ffn_up"].matmul_t(h))
        for (s, e, st), (_, cache) in zip(spans, checked):
            cache.length = st + (e - s)
        return rms_norm(x, self.output_norm, cfg.rms_eps)

    def logits_of(self, h: np.ndarray) -> np.ndarray:
        """Output projection of final-normed rows h [m, d] -> float32 [m, vocab]."""
        if self.output.w is not None:
            return h @ self.output.w.T
        return self.output.matmul_t(h)

    def forward(self, ids: Sequence[int], cache: KVCache, all_logits: bool = False) -> np.ndarray:
        h = self.hidden(ids, cache)
        if all_logits:
            return self.output.matmul_t(h)
        if self.output.w is not None:
            return h[-1] @ self.output.w.T
        return self.output.matmul_t(h[-1:])[0]

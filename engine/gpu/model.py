"""The GPU backend: the forward of engine/reference/model.py over CUDA kernels, KV cache on the device.

Same interface as engine.reference.model.ReferenceModel (docs/ARCHITECTURE.md, Backend protocol):
`config`, `device = "gpu"`, `new_cache(max_tokens)`, `forward(ids, cache, all_logits=False)`
-> numpy float32 logits ([vocab] for the last token, [n, vocab] with all_logits).

A prompt runs in ubatches of at most `ubatch` tokens (default 4096); per ubatch of T tokens
at positions start.. (x: [T, d] float32 residual stream, A: q8_1 activations):

    x = embed(ids)                                     embed.cu (q4_K / q6_K rows, per token)
    per layer i:
        A = q8_1(rmsnorm(x (+= y)) * attn_norm)        rmsnorm.cu (add fused: y = the previous
                                                       layer's ffn_down output)
        qkv = A . [Wq; Wk; Wv]^T                       mmq (one GEMM when the three share a
                                                       type: rows concatenated at load)
        q, K[start..], V[start..] = rope(qkv + b)      rope.cu (f16; K/V into the cache)
        A = q8_1(attention(q, K, V))                   attention_prefill.cu (flash, f16 mma)
        y = A . Wo^T                                   mmq
        A = q8_1(rmsnorm(x += y) * ffn_norm)           rmsnorm.cu
        gu = A . [Wg; Wu]^T                            mmq (one GEMM, [T, 2 d_ff])
        A = q8_1(silu(g) * u)                          swiglu.cu
        y = A . Wd^T                                   mmq
    logits = q8_1(rmsnorm(x += y) * output_norm) . Wout^T   last row only, or all rows

Numerics: weights are the GGUF blocks (no dequantized copies); every GEMM input is q8_1
(int8 + per-32 scale, like llama.cpp's MMQ); Q, K, V and P are f16 in attention with f32
accumulation and an f32 online softmax; everything else is float32. The KV cache is f16
[n_layers, n_kv_heads, max_tokens, head_dim] (cache.k / cache.v).

Timing: `profile(kinds)` attaches an OpTimer that records CUDA events around every launch
(bench --breakdown); without it nothing is recorded.
"""
from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.gpu import ops
from engine.formats.config import ModelConfig
from engine.errors import GGUFError
from engine.formats.weights import LAYER_MATRICES, ModelFile, layer_name, open_model

DEFAULT_UBATCH = 4096
_NULL = nullcontext()


def _cp():
    import cupy

    return cupy


# ----------------------------------------------------------------------------- KV cache

class GPUKVCache:
    """K and V on the device: f16 [n_layers, n_kv_heads, max_tokens, head_dim] each; the
    first `length` tokens are filled."""

    def __init__(self, cfg: ModelConfig, max_tokens: int):
        cp = _cp()
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        shape = (cfg.n_layers, cfg.n_kv_heads, max_tokens, cfg.head_dim)
        self.k = cp.zeros(shape, dtype=cp.float16)
        self.v = cp.zeros(shape, dtype=cp.float16)
        self.max_tokens = max_tokens
        self.length = 0
        self.plan = None          # engine.gpu.decode attaches its decode plan here

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def decode_kv(self):
        """(k_layers, v_layers, tok_stride, head_stride, kv_dtype, max_tokens) for
        engine.gpu.decode.decode_plan: element (t, kvh, i) at t*tok_stride + kvh*head_stride + i."""
        hd = int(self.k.shape[3])
        return ([self.k[i] for i in range(self.k.shape[0])], [self.v[i] for i in range(self.v.shape[0])],
                hd, self.max_tokens * hd, "f16", self.max_tokens)


# ----------------------------------------------------------------------------- op timing

class OpTimer:
    """CUDA events around every launch, summed per op kind after a synchronize."""

    def __init__(self):
        self.spans: list[tuple[str, object, object]] = []

    def span(self, kind: str):
        return _Span(self, kind)

    def totals_ms(self) -> dict[str, float]:
        cp = _cp()
        if self.spans:
            self.spans[-1][2].synchronize()
        out: dict[str, float] = {}
        for kind, a, b in self.spans:
            out[kind] = out.get(kind, 0.0) + cp.cuda.get_elapsed_time(a, b)
        return out

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, _, _ in self.spans:
            out[kind] = out.get(kind, 0) + 1
        return out


class _Span:
    __slots__ = ("timer", "kind", "a")

    def __init__(self, timer: OpTimer, kind: str):
        self.timer, self.kind = timer, kind

    def __enter__(self):
        cp = _cp()
        self.a = cp.cuda.Event()
        self.a.record()
        return self

    def __exit__(self, *exc):
        cp = _cp()
        b = cp.cuda.Event()
        b.record()
        self.timer.spans.append((self.kind, self.a, b))
        return False


# ----------------------------------------------------------------------------- weights

@dataclass
class _Seg:
    """One GEMM of a fused group: its weight and the roles (in row order) it computes."""
    w: object                  # DeviceWeight
    roles: tuple[str, ...]


@dataclass
class _Layer:
    attn_norm: object
    ffn_norm: object
    qkv: list                  # [_Seg] covering attn_q, attn_k, attn_v in order
    bq: object
    bk: object
    bv: object
    wo: object
    gate_up: list              # [_Seg] covering ffn_gate, ffn_up
    down: object


def _groups(roles, types):
    """Consecutive roles of one type -> [(type, roles)]."""
    out = []
    for r, t in zip(roles, types):
        if out and out[-1][0] == t:
            out[-1][1].append(r)
        else:
            out.append((t, [r]))
    return out


class GPUModel:
    """The GPU backend (see the module docstring)."""

    device = "gpu"
    decode_graph = True       # single-token forwards go through engine.gpu.decode's graph

    def __init__(self, model: ModelFile, progress: bool = False, ubatch: int = DEFAULT_UBATCH,
                 pad_q6k: bool = True):
        cp = _cp()
        from engine.gpu.weights import upload_weight

        self.file = model
        self.config = cfg = model.config
        self.ubatch = int(ubatch)
        if self.ubatch < 1:
            raise ValueError(f"ubatch must be >= 1, got {ubatch}")
        if cfg.head_dim not in ops.attention.ATT_HEAD_DIMS:
            raise GGUFError(f"{model.path}: head size {cfg.head_dim} is not supported on the GPU "
                            f"(supported: {', '.join(map(str, ops.attention.ATT_HEAD_DIMS))})")
        if cfg.d_model % 256 or cfg.d_model > ops.norm.RMSNORM_MAX_K or cfg.d_ff % 256:
            raise GGUFError(f"{model.path}: d_model {cfg.d_model} / d_ff {cfg.d_ff} not supported on "
                            f"the GPU (multiples of 256, d_model <= {ops.norm.RMSNORM_MAX_K})")
        names = ["token_embd.weight"] + [layer_name(i, r) for i in range(cfg.n_layers) for r in LAYER_MATRICES]
        if not cfg.tied_output:
            names.append("output.weight")
        for name in names:
            t = model.tensor(name)
            if t.type_name not in ("Q4_K", "Q6_K"):
                raise GGUFError(f"{model.path}: tensor '{name}' is {t.type_name}; the GPU backend "
                                f"multiplies Q4_K and Q6_K matrices only")
        total_bytes = sum(model.tensor(n).n_bytes for n in names)
        t0 = time.perf_counter()
        self.resident_bytes = 0
        done = [0]

        def tick(nbytes: int):
            done[0] += nbytes
            if progress:
                frac = done[0] / max(1, total_bytes)
                bar = "#" * int(30 * frac)
                print(f"\rloading {model.path} to the GPU [{bar:<30s}] {100 * frac:5.1f}% "
                      f"({done[0] / 2**30:.2f}/{total_bytes / 2**30:.2f} GiB)", end="", file=sys.stderr,
                      flush=True)

        def mat(roles_names: list[str]):
            ts = [model.tensor(n) for n in roles_names]
            raw = ts[0].data if len(ts) == 1 else np.concatenate([np.asarray(t.data) for t in ts], axis=0)
            w = upload_weight(raw, ts[0].type_name, pad_q6k=pad_q6k)
            self.resident_bytes += w.nbytes
            tick(sum(t.n_bytes for t in ts))
            return w

        def vec(name: str):
            a = cp.asarray(np.asarray(model.tensor(name).data, dtype=np.float32))
            self.resident_bytes += int(a.nbytes)
            return a

        def segs(i: int, roles: tuple[str, ...]) -> list[_Seg]:
            types = [model.tensor(layer_name(i, r)).type_name for r in roles]
            return [_Seg(mat([layer_name(i, r) for r in rs]), tuple(rs)) for _, rs in _groups(roles, types)]

        self.embed_w = mat(["token_embd.weight"])
        self.layers: list[_Layer] = []
        for i in range(cfg.n_layers):
            biases = {}
            for r in ("attn_q", "attn_k", "attn_v"):
                name = layer_name(i, r, "bias")
                biases[r] = vec(name) if model.has(name) else None
            self.layers.append(_Layer(
                attn_norm=vec(layer_name(i, "attn_norm")), ffn_norm=vec(layer_name(i, "ffn_norm")),
                qkv=segs(i, ("attn_q", "attn_k", "attn_v")),
                bq=biases["attn_q"], bk=biases["attn_k"], bv=biases["attn_v"],
                wo=mat([layer_name(i, "attn_output")]),
                gate_up=segs(i, ("ffn_gate", "ffn_up")),
                down=mat([layer_name(i, "ffn_down")])))
        self.output_norm = vec("output_norm.weight")
        self.output_w = self.embed_w if cfg.tied_output else mat(["output.weight"])
        cp.cuda.Device().synchronize()
        self.load_seconds = time.perf_counter() - t0
        self.file_bytes = total_bytes
        self._rope_cos = self._rope_sin = None
        self._timer: OpTimer | None = None
        self._decode_weights = None
        if progress:
            print(f"\rloaded {model.path} to the GPU in {self.load_seconds:.1f} s: "
                  f"{self.resident_bytes / 2**30:.3f} GiB resident "
                  f"({self.resident_bytes / max(1, total_bytes):.3f}x the {total_bytes / 2**30:.3f} GiB "
                  f"of weights in the file)" + " " * 10, file=sys.stderr, flush=True)

    @classmethod
    def from_path(cls, path, **kw) -> "GPUModel":
        return cls(open_model(path), **kw)

    # ------------------------------------------------------------------ protocol

    def new_cache(self, max_tokens: int) -> GPUKVCache:
        return GPUKVCache(self.config, max_tokens)

    def check_ids(self, ids: Sequence[int], cache: GPUKVCache) -> np.ndarray:
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

    def forward(self, ids: Sequence[int], cache: GPUKVCache, all_logits: bool = False) -> np.ndarray:
        if len(ids) == 1 and not all_logits and self.decode_graph:   # a decode step: CUDA graph
            from engine.gpu.decode import decode_step

            return decode_step(self, ids, cache)
        out = self.forward_device(ids, cache, all_logits)
        return _cp().asnumpy(out)

    def forward_device(self, ids: Sequence[int], cache: GPUKVCache, all_logits: bool = False):
        """forward() with the logits left on the device (cupy float32 [vocab] or [n, vocab])."""
        cp = _cp()
        if not isinstance(cache, GPUKVCache):
            raise TypeError(f"GPUModel.forward needs a cache from GPUModel.new_cache, got {type(cache).__name__}")
        ids = self.check_ids(ids, cache)
        n, start = int(ids.size), cache.length
        self._ensure_rope(start + n)
        ids_dev = cp.asarray(ids.astype(np.int32))
        logits = cp.empty((n, self.config.vocab_size), dtype=cp.float32) if all_logits else None
        last = None
        for u0 in range(0, n, self.ubatch):
            u1 = min(n, u0 + self.ubatch)
            res = self._ubatch(ids_dev[u0:u1], start + u0, cache, all_rows=all_logits)
            if all_logits:
                logits[u0:u1] = res
            else:
                last = res
            cache.length = start + u1
        return logits if all_logits else last[0]

    # ------------------------------------------------------------------ profiling

    def profile(self, timer: OpTimer | None) -> None:
        """Attach (or detach, with None) an OpTimer: every launch is then bracketed by events."""
        self._timer = timer

    def _span(self, kind: str):
        return _NULL if self._timer is None else self._timer.span(kind)

    # ------------------------------------------------------------------ the forward

    def _ensure_rope(self, n_pos: int) -> None:
        from engine.formats.rope import rope_tables

        have = 0 if self._rope_cos is None else int(self._rope_cos.shape[0])
        if have >= n_pos:
            return
        cp = _cp()
        n_new = max(n_pos, 2 * have, 4096)
        cos, sin = rope_tables(self.config, np.arange(n_new))
        self._rope_cos, self._rope_sin = cp.asarray(cos), cp.asarray(sin)

    def _gemm(self, w, act, out=None):
        from engine.gpu.ops.mmq import mmq

        with self._span("gemm_" + w.kind):
            return mmq(w, act, out=out)

    def _ubatch(self, ids_dev, start: int, cache: GPUKVCache, all_rows: bool):
        cp = _cp()
        from engine.gpu.ops.q8 import Q8Act

        cfg = self.config
        T = int(ids_dev.shape[0])
        d, qd, kvd, ff = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        eps = cfg.rms_eps
        f32 = cp.float32

        def act(K):
            return Q8Act(cp.empty((T, K), dtype=cp.int8), cp.empty((T, K // 32, 2), dtype=f32))

        x = cp.empty((T, d), dtype=f32)
        y = cp.empty((T, d), dtype=f32)
        a_d, a_q, a_f = act(d), act(qd), act(ff)
        qh = cp.empty((H, T, hd), dtype=cp.float16)
        cos = self._rope_cos[start:start + T]
        sin = self._rope_sin[start:start + T]
        neox = cfg.rope_type == "neox"
        role_cols = {"attn_q": qd, "attn_k": kvd, "attn_v": kvd, "ffn_gate": ff, "ffn_up": ff}

        with self._span("embed"):
            ops.embed.embed(self.embed_w, ids_dev, x)
        for i, L in enumerate(self.layers):
            with self._span("rmsnorm_q8"):
                ops.norm.add_rmsnorm_q8_1(x, y if i else None, L.attn_norm, eps, a_d)
            views = self._seg_views(L.qkv, a_d, role_cols)
            (qv, ldq), (kv, ldk), (vv, ldv) = views["attn_q"], views["attn_k"], views["attn_v"]
            with self._span("rope_kv"):
                ops.rope.qkv_rope(qv, kv, vv, (ldq, ldk, ldv), L.bq, L.bk, L.bv, cos, sin, qh,
                           cache.k[i], cache.v[i], start, neox, H, KVH, hd)
            with self._span("attention"):
                ops.attention.attention_prefill(qh, cache.k[i], cache.v[i], start, out_act=a_q)
            self._gemm(L.wo, a_q, out=y)
            with self._span("rmsnorm_q8"):
                ops.norm.add_rmsnorm_q8_1(x, y, L.ffn_norm, eps, a_d)
            views = self._seg_views(L.gate_up, a_d, role_cols)
            (gv, ldg), (uv, ldu) = views["ffn_gate"], views["ffn_up"]
            if ldg != ldu:      # gate and up in separate buffers of one shape: ld == ff for both
                raise AssertionError("gate/up row strides differ")
            with self._span("swiglu_q8"):
                ops.activation.swiglu_q8_1(gv, uv, ldg, ff, a_f)
            self._gemm(L.down, a_f, out=y)
        if all_rows:
            xr, yr, R = x, y, T
        else:
            xr, yr, R = x[T - 1:T], y[T - 1:T], 1
        a_o = Q8Act(cp.empty((R, d), dtype=cp.int8), cp.empty((R, d // 32, 2), dtype=f32))
        with self._span("rmsnorm_q8"):
            ops.norm.add_rmsnorm_q8_1(xr, yr, self.output_norm, eps, a_o)
        with self._span("gemm_output_" + self.output_w.kind):
            from engine.gpu.ops.mmq import mmq

            return mmq(self.output_w, a_o)

    def _seg_views(self, segs: list[_Seg], a, role_cols: dict[str, int]):
        """Run the GEMMs of a fused group; role -> (float32 view [T, cols], row stride)."""
        out = {}
        for s in segs:
            y = self._gemm(s.w, a)
            ld = int(y.shape[1])
            c = 0
            for r in s.roles:
                out[r] = (y[:, c:c + role_cols[r]], ld)
                c += role_cols[r]
        return out

    # ------------------------------------------------------------------ decode hand-off

    def decode_weights(self):
        """engine.gpu.decode.DecodeWeights over this model's device weights (views, no copies)."""
        if self._decode_weights is None:
            from engine.gpu import decode as GD
            from engine.gpu.weights import DeviceWeight

            cfg = self.config

            def role_weights(segs):
                out = {}
                for s in segs:
                    r0 = 0
                    for r in s.roles:
                        rows = {"attn_q": cfg.q_dim, "attn_k": cfg.kv_dim, "attn_v": cfg.kv_dim,
                                "ffn_gate": cfg.d_ff, "ffn_up": cfg.d_ff}[r]
                        out[r] = DeviceWeight(s.w.ggml_type, rows, s.w.cols, s.w.data[r0:r0 + rows], s.w.padded)
                        r0 += rows
                return out

            cp = _cp()
            layers = []
            for L in self.layers:
                rw = role_weights(L.qkv)
                rw.update(role_weights(L.gate_up))
                bias = None if L.bq is None else cp.concatenate([L.bq, L.bk, L.bv])
                layers.append(GD.DecodeLayer(attn_norm=L.attn_norm, ffn_norm=L.ffn_norm,
                                             attn_q=rw["attn_q"], attn_k=rw["attn_k"], attn_v=rw["attn_v"],
                                             attn_output=L.wo, ffn_gate=rw["ffn_gate"], ffn_up=rw["ffn_up"],
                                             ffn_down=L.down, qkv_bias=bias))
            e = self.embed_w
            embed = GD.EmbedTable(e.data, e.type_name, e.cols, e.block_stride)
            self._decode_weights = GD.DecodeWeights(cfg, embed, layers, self.output_norm, self.output_w,
                                                    self.resident_bytes)
        return self._decode_weights

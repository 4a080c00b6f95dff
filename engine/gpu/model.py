"""The GPU backend: the forward of engine/reference/model.py over CUDA kernels, KV cache on the device.

One weight set on the device serves both modes:
- prefill (this module): `forward(ids, cache, all_logits=False)` -> numpy float32 logits
  ([vocab] for the last token, [n, vocab] with all_logits), `forward_device` (the same, left
  on the device); any number of tokens, always these kernels; prompts of up to
  prefill_graph.GRAPH_MAX_TOKENS replay a CUDA graph of the layers (engine/gpu/prefill_graph.py);
- decode (engine/gpu/decode.py): one token per step through a CUDA graph, driven by a
  generation session, `session(n_tokens)` -> engine.gpu.session.GPUSession (the Session
  protocol of engine/session.py), taken from a pool of sessions by size bucket.
`new_cache(max_tokens)` -> engine.gpu.kv_cache.GPUKVCache, the one KV cache class of both.

A prompt runs in ubatches of at most `ubatch` tokens (default 8192); per ubatch of T tokens
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

Hopper (sm_90) ubatches of T >= wgmma_min_tokens run the layers' q4_K and q6_K GEMMs on wgmma
instead (engine/gpu/ops/wgmma.py: weights dequantized to f16 in registers, f32 accumulation): their
input is the same float32 activation rounded to f16 in a tiled layout, written by the producers
(rmsnorm.cu add_rmsnorm_x16, swiglu.cu swiglu_x16; the attention output through float32 and
wgmma_act.cu); a producer whose consumers mix both paths writes both forms. A q4_K gate|up
GEMM writes the down GEMM's operand itself (ops.wgmma.wgmma_swiglu: no [T, 2 d_ff] f32, no
swiglu_x16; WG_SWIGLU_EPI=0 in GGUF_PREFILL_KERNEL_DEFINES: the unfused pair, for A/B runs).
Ubatches of at most 32 tokens run the q|k|v GEMMs and rope.cu as one launch
(ops.wgmma.wgmma_qkv_rope, qkv_rope_wanted; WG_QKV_EPI=0 / 2: never / always, for A/B runs).

Numerics: weights are the GGUF blocks (no dequantized copies); every MMQ GEMM input is q8_1
(int8 + per-32 scale, like llama.cpp's MMQ), every wgmma GEMM input f16; Q, K, V and P are f16
in attention with f32 accumulation and an f32 online softmax; everything else is float32. The
KV cache is f16 [n_layers, n_kv_heads, max_tokens, head_dim] (engine/gpu/kv_cache.py).

Weights: each fused group (_Seg) is one device matrix; `_Layer.roles` holds per-role views
into them (no copies) for the decode GEMVs, and the q/k/v biases are one array
(`qkv_bias`, decode) with `bq`/`bk`/`bv` views of it (prefill).

Timing: `profile(timer)` attaches an engine.gpu.profiler.OpTimer that records CUDA events
around every launch (bench --breakdown); without it nothing is recorded.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.gpu import kernels, ops
from engine.errors import GGUFError
from engine.formats.weights import LAYER_MATRICES, ModelFile, layer_name, open_model
from engine.gpu.kv_cache import GPUKVCache
from engine.gpu.prefill_graph import cache_graph, graph_tokens
from engine.gpu.profiler import OpTimer
from engine.gpu.ubatch_plan import bounds, default_ubatch, layer_launches, plan_ubatches
from engine.gpu.weights import role_views


def wgmma_default_min_tokens() -> int | None:
    """The ubatch size from which the layer GEMMs take the Hopper path: registry.WGMMA_MIN_TOKENS
    on an sm_90 GPU, None (never) elsewhere or with GGUF_PREFILL_WGMMA=0; GGUF_PREFILL_WGMMA=N
    (N >= 2) sets it for A/B runs."""
    from engine.gpu import registry

    env = os.environ.get("GGUF_PREFILL_WGMMA", "1").strip()
    if env == "0":
        return None
    if not env.isdigit():
        raise GGUFError(f"GGUF_PREFILL_WGMMA={env!r}: 0 (off), 1 (default) or a token count >= 2")
    cc = getattr(_cp().cuda.Device(), "compute_capability", "")
    if cc != "90":
        return None
    return registry.WGMMA_MIN_TOKENS if int(env) == 1 else int(env)


_NULL = nullcontext()


def _cp():
    import cupy

    return cupy


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
    bq: object                 # views of qkv_bias (or None)
    bk: object
    bv: object
    wo: object
    gate_up: list              # [_Seg] covering ffn_gate, ffn_up
    down: object
    roles: dict                # attn_q/k/v, ffn_gate/up -> DeviceWeight views into the _Segs
    qkv_bias: object = None    # float32 [q_dim + 2 kv_dim] or None


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

    def __init__(self, model: ModelFile, progress: bool = False, ubatch: int | None = None,
                 pad_q6k: bool = True, graph_prefill: bool = True):
        cp = _cp()
        from engine.gpu.weights import upload_weight

        self.file = model
        self.config = cfg = model.config
        self.ubatch = default_ubatch() if ubatch is None else int(ubatch)
        self.graph_prefill = bool(graph_prefill)     # prompts of <= GRAPH_MAX_TOKENS: prefill_graph.py
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

        def qkv_bias(i: int):
            """One float32 array [q_dim + 2 kv_dim] (a missing part: zeros) and its three views."""
            names = [layer_name(i, r, "bias") for r in ("attn_q", "attn_k", "attn_v")]
            if not any(model.has(n) for n in names):
                return None, (None, None, None)
            parts = [np.asarray(model.tensor(n).data, dtype=np.float32) if model.has(n)
                     else np.zeros(c, np.float32) for n, c in zip(names, (cfg.q_dim, cfg.kv_dim, cfg.kv_dim))]
            b = cp.asarray(np.concatenate(parts))
            self.resident_bytes += int(b.nbytes)
            qd, kvd = cfg.q_dim, cfg.kv_dim
            return b, (b[:qd], b[qd:qd + kvd], b[qd + kvd:])

        self.embed_w = mat(["token_embd.weight"])
        self.layers: list[_Layer] = []
        for i in range(cfg.n_layers):
            bias, (bq, bk, bv) = qkv_bias(i)
            qkv, gate_up = segs(i, ("attn_q", "attn_k", "attn_v")), segs(i, ("ffn_gate", "ffn_up"))
            self.layers.append(_Layer(
                attn_norm=vec(layer_name(i, "attn_norm")), ffn_norm=vec(layer_name(i, "ffn_norm")),
                qkv=qkv, bq=bq, bk=bk, bv=bv,
                wo=mat([layer_name(i, "attn_output")]),
                gate_up=gate_up,
                down=mat([layer_name(i, "ffn_down")]),
                roles=role_views(qkv + gate_up, self._role_rows()), qkv_bias=bias))
        self.output_norm = vec("output_norm.weight")
        self.output_w = self.embed_w if cfg.tied_output else mat(["output.weight"])
        cp.cuda.Device().synchronize()
        self.load_seconds = time.perf_counter() - t0
        self.file_bytes = total_bytes
        self._rope_cos = self._rope_sin = None
        self._timer: OpTimer | None = None
        self._sessions = None     # engine.gpu.session.SessionPool, made on the first session()
        self.wgmma_min_tokens = wgmma_default_min_tokens()     # tests may set it (None: never)
        self.wgmma_kinds = frozenset({"q4_k", "q6_k"})         # weight kinds with a Hopper GEMM
        # q4_K and q6_K matrices of one fused group in one launch: wgmma_pair (prefill) and
        # mmvq_mixed (decode q / k / v); GGUF_PREFILL_MIXED_LAUNCH=0: one launch per type, for
        # A/B runs (tests may set it)
        self.mixed_launch = os.environ.get("GGUF_PREFILL_MIXED_LAUNCH", "1").strip() != "0"
        # the attention writing the Hopper Wo GEMM's f16 operand directly (out_x16, the bits
        # tile_x16 makes): GGUF_PREFILL_ATTN_X16=1; off until measured on the device (tests may set it)
        self.attn_x16 = os.environ.get("GGUF_PREFILL_ATTN_X16", "0").strip() == "1"
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

    def batch(self, n_slots: int, slot_capacity: int, fit_memory: bool = False):
        """The batched-step backend over this model (engine.gpu.batch.GPUBatch: one shared KV
        cache of n_slots slots); fit_memory shrinks the slots to what free memory holds."""
        from engine.gpu.batch import GPUBatch

        return GPUBatch(self, n_slots, slot_capacity, fit_memory=fit_memory)

    def session(self, n_tokens: int):
        """A generation session (engine.gpu.session.GPUSession) holding at least n_tokens,
        from the model's pool: its decode graph is captured once and reused; close() (or a
        `with` block) gives it back."""
        if self._sessions is None:
            from engine.gpu.session import SessionPool

            self._sessions = SessionPool(self)
        return self._sessions.take(n_tokens)

    def rope_tables(self, n_pos: int):
        """Device cos, sin float32 [>= n_pos, head_dim/2] (engine.formats.rope). A longer table
        replaces them later; holders of the old arrays keep valid ones."""
        self._ensure_rope(n_pos)
        return self._rope_cos, self._rope_sin

    def _role_rows(self) -> dict[str, int]:
        cfg = self.config
        return {"attn_q": cfg.q_dim, "attn_k": cfg.kv_dim, "attn_v": cfg.kv_dim,
                "ffn_gate": cfg.d_ff, "ffn_up": cfg.d_ff}

    def check_ids(self, ids: Sequence[int], cache: GPUKVCache) -> np.ndarray:
        return self.file.check_ids(ids, cache.length, cache.max_tokens)

    def forward(self, ids: Sequence[int], cache: GPUKVCache, all_logits: bool = False) -> np.ndarray:
        """Prefill kernels for any number of tokens (decoding goes through session())."""
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
        T = graph_tokens(n, start, cache.capacity) if self.graph_prefill and self._timer is None else None
        if T is not None and n <= self.ubatch:
            pg = cache_graph(self, cache, T)
            pg.run(ids.astype(np.int32), start)
            out = self.run_head(pg.bufs, n, all_logits)
            cache.length = start + n
            return out if all_logits else out[0]
        ids_dev = cp.asarray(ids.astype(np.int32))
        logits = cp.empty((n, self.config.vocab_size), dtype=cp.float32) if all_logits else None
        last = None
        for u0, u1 in self.ubatch_bounds(n):
            res = self._ubatch(ids_dev[u0:u1], start + u0, cache, all_rows=all_logits)
            if all_logits:
                logits[u0:u1] = res
            else:
                last = res
            cache.length = start + u1
        return logits if all_logits else last[0]

    def ubatch_bounds(self, n: int) -> list[tuple[int, int]]:
        """An n-token prompt's ubatches (<= `ubatch` tokens; Hopper: engine.gpu.ubatch_plan)."""
        big = max(self.ubatch, self.wgmma_min_tokens or 0)      # the launches only where a split is made
        launches = layer_launches(self.layers, lambda w: self._on_wgmma(w, big),
                                  lambda ws: self.mixed_launch and ops.wgmma.pairs(ws)) if n > self.ubatch else None
        return bounds(plan_ubatches(n, self.ubatch, launches))

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

    def _on_wgmma(self, w, T: int) -> bool:
        """Whether this ubatch's GEMM of w runs on the Hopper path (module docstring)."""
        return (self.wgmma_min_tokens is not None and T >= self.wgmma_min_tokens and w.kind in self.wgmma_kinds
                and w.rows % ops.wgmma.ROWS == 0)

    def _gemm(self, w, act, out, xt=None):
        """out[T, w.rows] = act . w^T: q8_1 `act` through MMQ, or the tiled f16 `xt` through wgmma."""
        with self._span("gemm_" + w.kind):
            if xt is not None and self._on_wgmma(w, int(out.shape[0])):
                return ops.wgmma.wgmma(w, xt, int(out.shape[0]), out=out)
            return ops.mmq.mmq(w, act, out=out)

    def _norm(self, x, y, norm_w, act, bufs, weights):
        """add_rmsnorm into what the GEMMs of `weights` read: q8_1 `act`, the tiled f16 operand
        (returned), or both (the add done once); None when no GEMM takes the Hopper path."""
        eps = self.config.rms_eps
        on = [self._on_wgmma(w, bufs.T) for w in weights]
        xt = None
        if any(on):
            xt = bufs.xt(int(x.shape[1]))
            with self._span("rmsnorm_x16"):
                ops.norm.add_rmsnorm_x16(x, y, norm_w, eps, xt)
            y = None
        if not all(on):
            with self._span("rmsnorm_q8"):
                ops.norm.add_rmsnorm_q8_1(x, y, norm_w, eps, act)
        return xt

    def _ubatch(self, ids_dev, start: int, cache: GPUKVCache, all_rows: bool):
        """One ubatch, eager: its logits (all rows, or the last)."""
        from engine.gpu.prefill_graph import UbatchBuffers

        bufs = UbatchBuffers(self, int(ids_dev.shape[0]))
        self.run_layers(bufs, ids_dev, start, cache)
        return self.run_head(bufs, int(ids_dev.shape[0]), all_rows)

    def run_layers(self, bufs, ids_dev, start: int, cache: GPUKVCache, start_dev=None, varlen=None) -> None:
        """embed + every layer for the bufs.T tokens ids_dev (int32 on the device) at positions
        start.. (+ start_dev[0] when given: a graph-captured prefill); leaves the residual
        stream in bufs.x + bufs.y. No allocation, no host synchronization.
        varlen = (pos_dev, rows_dev, tiles_dev, decode): a batched step mixing sequences
        (engine.gpu.batch): token t at RoPE position pos_dev[t], its K/V at cache row rows_dev[t],
        attention by the tiles of ops.attention.varlen_plan and its decode rows (an
        ops.attention.VarlenDecode, or None: every tile in tiles_dev) (start must be 0)."""
        cfg = self.config
        qd, kvd, ff = cfg.q_dim, cfg.kv_dim, cfg.d_ff
        x, y, a_d, a_q, a_f, qh = bufs.x, bufs.y, bufs.a_d, bufs.a_q, bufs.a_f, bufs.qh
        T = bufs.T
        role_cols = {"attn_q": qd, "attn_k": kvd, "attn_v": kvd, "ffn_gate": ff, "ffn_up": ff}

        with self._span("embed"):
            ops.embed.embed(self.embed_w, ids_dev, x)
        for i, L in enumerate(self.layers):
            xt = self._norm(x, y if i else None, L.attn_norm, a_d, bufs, [s.w for s in L.qkv])
            self._qkv_rope(L, i, a_d, xt, bufs, cache, start, start_dev, varlen, role_cols)
            wo_x16 = self._on_wgmma(L.wo, T)
            # the attention writes the Wo GEMM's tiled operand itself (no tile_x16) where it can:
            # not with decode rows in a batched step (attention_decode.cu writes f32 / q8_1)
            fused_x16 = wo_x16 and self.attn_x16 and (varlen is None or varlen[3] is None)
            out = (dict(out_x16=bufs.xt(qd)) if fused_x16 else dict(out_f32=bufs.attn_f32()) if wo_x16
                   else dict(out_act=a_q))
            with self._span("attention"):
                if varlen is None:
                    ops.attention.attention_prefill(qh, cache.k_layer(i), cache.v_layer(i), start,
                                                    start_dev=start_dev, **out)
                else:
                    ops.attention.attention_varlen(qh, cache.k_layer(i), cache.v_layer(i), varlen[2],
                                                   decode=varlen[3], **out)
            xt = None
            if wo_x16:
                xt = bufs.xt(qd)
                if not fused_x16:
                    with self._span("tile_x16"):
                        ops.wgmma.tile_x16(out["out_f32"], out=xt)
            self._gemm(L.wo, a_q, out=y, xt=xt)
            xt = self._norm(x, y, L.ffn_norm, a_d, bufs, [s.w for s in L.gate_up])
            self._gemm(L.down, a_f, out=y, xt=self._ffn_act(L, xt, bufs, role_cols))

    def _qkv_rope(self, L, i, a_d, xt, bufs, cache, start, start_dev, varlen, role_cols) -> None:
        """Layer i's q|k|v GEMMs, then bias + RoPE + f16 into bufs.qh and the K/V cache
        (ops.rope.qkv_rope); one launch doing both (ops.wgmma.wgmma_qkv_rope) where the group
        fuses and the ubatch is short (ops.wgmma.qkv_rope_wanted)."""
        cfg = self.config
        ws = [s.w for s in L.qkv]
        rope = (L.bq, L.bk, L.bv, self._rope_cos, self._rope_sin, bufs.qh, cache.k_layer(i), cache.v_layer(i),
                start, cfg.rope_type == "neox", cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        rows = None if varlen is None else varlen[:2]
        if (xt is not None and ops.wgmma.qkv_rope_wanted(bufs.T) and (len(ws) == 1 or self.mixed_launch)
                and all(self._on_wgmma(w, bufs.T) for w in ws)
                and ops.wgmma.qkv_rope_fusable(ws, bufs.T, cfg.q_dim, cfg.kv_dim, cfg.head_dim)):
            with self._span("gemm_q4_k_rope" if len(ws) == 1 else "gemm_q4_k+q6_k_rope"):
                ops.wgmma.wgmma_qkv_rope(ws, xt, bufs.T, *rope, start_dev=start_dev, rows=rows)
            return
        views = self._seg_views(L.qkv, a_d, role_cols, bufs, xt)
        (qv, ldq), (kv, ldk), (vv, ldv) = views["attn_q"], views["attn_k"], views["attn_v"]
        with self._span("rope_kv"):
            ops.rope.qkv_rope(qv, kv, vv, (ldq, ldk, ldv), *rope, start_dev, rows=rows)

    def _ffn_act(self, L, xt, bufs, role_cols):
        """silu(gate) * up of the ubatch into what the down GEMM reads: its tiled f16 operand
        (returned; straight from the gate|up GEMM's epilogue where ops.wgmma.swiglu_fusable, unless
        GGUF_PREFILL_KERNEL_DEFINES has WG_SWIGLU_EPI=0, for A/B runs), or bufs.a_f."""
        T, ff, segs, w = bufs.T, self.config.d_ff, L.gate_up, L.gate_up[0].w
        down_x16 = self._on_wgmma(L.down, T)
        if (down_x16 and len(segs) == 1 and self._on_wgmma(w, T) and ops.wgmma.swiglu_fusable(w, T)
                and kernels.define_value("WG_SWIGLU_EPI", 1)):
            out = bufs.xt(ff, slot=int(ff == w.cols))         # never the buffer it reads
            with self._span("gemm_q4_k_swiglu"):
                return ops.wgmma.wgmma_swiglu(w, xt, T, out=out)
        views = self._seg_views(segs, bufs.a_d, role_cols, bufs, xt)
        (gv, ldg), (uv, ldu) = views["ffn_gate"], views["ffn_up"]
        if ldg != ldu:      # gate and up in separate buffers of one shape: ld == ff for both
            raise AssertionError("gate/up row strides differ")
        if down_x16:
            with self._span("swiglu_x16"):
                ops.activation.swiglu_x16(gv, uv, ldg, ff, xo := bufs.xt(ff), T)
            return xo
        with self._span("swiglu_q8"):
            ops.activation.swiglu_q8_1(gv, uv, ldg, ff, bufs.a_f)
        return None

    def run_head(self, bufs, n: int, all_rows: bool):
        """Logits after run_layers: float32 [n, vocab] for rows 0..n-1 of bufs, or [1, vocab] for
        row n-1 (a new array)."""
        cp = _cp()
        from engine.gpu.ops.mmq import mmq
        from engine.gpu.ops.q8 import Q8Act

        d = self.config.d_model
        x, y = bufs.x, bufs.y
        xr, yr, R = (x[:n], y[:n], n) if all_rows else (x[n - 1:n], y[n - 1:n], 1)
        a_o = Q8Act(cp.empty((R, d), dtype=cp.int8), cp.empty((R, d // 32, 2), dtype=cp.float32))
        with self._span("rmsnorm_q8"):
            ops.norm.add_rmsnorm_q8_1(xr, yr, self.output_norm, self.config.rms_eps, a_o)
        with self._span("gemm_output_" + self.output_w.kind):
            return mmq(self.output_w, a_o)

    def _seg_views(self, segs: list[_Seg], a, role_cols: dict[str, int], bufs, xt=None):
        """Run the GEMMs of a fused group (q8_1 `a`, or the tiled f16 `xt` where _on_wgmma; a
        q4_K and a q6_K matrix both on wgmma in one launch, ops.wgmma.wgmma_pair);
        role -> (float32 view [T, cols], row stride)."""
        ws = [s.w for s in segs]
        outs = [bufs.gemm_out(w.rows, i) for i, w in enumerate(ws)]
        if (xt is not None and self.mixed_launch and ops.wgmma.pairs(ws)
                and all(self._on_wgmma(w, bufs.T) for w in ws)):
            with self._span("gemm_q4_k+q6_k"):
                ys = ops.wgmma.wgmma_pair(ws[0], ws[1], xt, bufs.T, outs[0], outs[1])
        else:
            ys = [self._gemm(w, a, out=o, xt=xt) for w, o in zip(ws, outs)]
        out = {}
        for s, y in zip(segs, ys):
            ld = int(y.shape[1])
            c = 0
            for r in s.roles:
                out[r] = (y[:, c:c + role_cols[r]], ld)
                c += role_cols[r]
        return out

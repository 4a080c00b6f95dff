"""Greedy decoding on the GPU: one token per step, the whole step captured once in a CUDA graph.

A decode step (one token at position p = KV length before it) is:

    x = embed(token)                                   decode_fused.cu  decode_embed
    per layer:
        a = q8_1(rmsnorm(x) * attn_norm)               decode_fused.cu  rmsnorm_q8
        qkv = [Wq; Wk; Wv] a                           mmvq_q4_k.cu / mmvq_q6_k.cu (store, 1-2 launches)
        q, K[p], V[p] = rope(qkv + bias)               decode_fused.cu  qkv_post
        o = attention(q, K[0..p], V[0..p])             attention_decode.cu split + combine (-> q8_1)
        x += Wo o                                      mmvq (add)
        a = q8_1(rmsnorm(x) * ffn_norm)                rmsnorm_q8
        h = silu(Wg a) * (Wu a)                        mmvq (swiglu: gate and up in one launch)
        x += Wd q8_1(h)                                quantize_row_q8 + mmvq (add)
    logits = Wout q8_1(rmsnorm(x) * output_norm)       rmsnorm_q8 + mmvq (store)
    token = argmax(logits); p += 1                     argmax.cu  (writes the next step's input)

The token and the position live in device memory (`state` int32 [4]: token, position, count of
emitted tokens), so the same launches serve every step: `DecodePlan` records them once into a
CUDA graph (CuPy stream capture) and replays it. Per step, the host either writes the state
(one tiny kernel, `set_state`) and copies the logits back (the Backend protocol), or replays the
graph back to back with the token chained on the device and reads the emitted ids at the end
(`DecodePlan.chain`, the benchmark path: only token ids come back).

Backends:
- `DecodeModel`: a self-contained GPU backend (Backend protocol of docs/ARCHITECTURE.md) that
  uploads the weights itself (engine.gpu.weights) and feeds a prompt through decode steps.
- `attach(gpu_model)` / `DecodePlan.for_cache(...)`: the same plan over weights and a KV cache
  that another module owns (engine.gpu.model's prefill), given per-layer K/V views and strides.

`bench_decode(model, n_gen, depth, reps)` measures tg rows (tok/s per rep), llama-bench style.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from engine.gpu import decode_instances as DK
from engine.gpu import kernels
from engine.formats.config import ModelConfig
from engine.errors import GGUFError
from engine.gpu.ops.attention import attention_launch, attention_splits
from engine.gpu.ops.mmvq import DEFAULT_ROWS_PER_WARP, DEFAULT_UNROLL, NORM_MAX, mmvq_launch

# Step variant, from the measured grid (docs/perf-log.md, decode run 2): 1 row per warp with
# run 1's loop is the fastest now (tg128 409-410 tok/s); batched loads (U > 0), the fused
# combine (no gain) and the fused norm tail (274 tok/s: one block normalizes serially) stay
# selectable but off.
FUSE_COMBINE = False      # attention combine in the split kernel's last block
FUSE_NORM = False         # rmsnorm + q8_1 in the residual-add GEMV's last block

_WTYPE = {"F32": 0, "F16": 1, "Q4_K": 12, "Q6_K": 14}


def _cp():
    import cupy

    return cupy


def _null():
    return np.uint64(0)


def _k(fname: str, name: str):
    return kernels.get_kernel(fname, name)


# ----------------------------------------------------------------------------- weights

@dataclass
class EmbedTable:
    """token_embd on the device as raw rows: uint8 [vocab, row_bytes] + how to decode a row."""
    data: object
    type_name: str            # F32 | F16 | Q4_K | Q6_K
    cols: int
    block_stride: int = 0     # bytes per 256-block (144, 210 or 224); 0 for F32/F16

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])


@dataclass
class DecodeLayer:
    attn_norm: object
    ffn_norm: object
    attn_q: object            # engine.gpu.weights.DeviceWeight
    attn_k: object
    attn_v: object
    attn_output: object
    ffn_gate: object
    ffn_up: object
    ffn_down: object
    qkv_bias: object = None   # float32 [q_dim + 2 kv_dim] or None


@dataclass
class DecodeWeights:
    config: ModelConfig
    embed: EmbedTable
    layers: list[DecodeLayer]
    output_norm: object
    output: object            # DeviceWeight
    resident_bytes: int = 0

    @classmethod
    def upload(cls, model_file, pad_q6k: bool = True, progress: bool = False) -> "DecodeWeights":
        """Every tensor of a validated engine.formats.weights.ModelFile to the current device."""
        cp = _cp()
        from engine.gpu.weights import upload_tensor
        from engine.formats.weights import layer_name

        cfg = model_file.config
        total = [0]

        def mat(name):
            t = model_file.tensor(name)
            if t.type_name not in ("Q4_K", "Q6_K"):
                raise GGUFError(f"{model_file.path}: tensor '{name}' is {t.type_name}; the GPU decode "
                                f"path multiplies Q4_K and Q6_K matrices only")
            w = upload_tensor(t, pad_q6k=pad_q6k)
            total[0] += w.nbytes
            return w

        def vec(name):
            a = cp.asarray(np.asarray(model_file.tensor(name).data, dtype=np.float32))
            total[0] += a.nbytes
            return a

        t0 = time.perf_counter()
        layers = []
        for i in range(cfg.n_layers):
            bias = None
            if cfg.has_qkv_bias or model_file.has(layer_name(i, "attn_q", "bias")):
                parts = [np.asarray(model_file.tensor(layer_name(i, r, "bias")).data, dtype=np.float32)
                         for r in ("attn_q", "attn_k", "attn_v")]
                bias = cp.asarray(np.concatenate(parts))
                total[0] += bias.nbytes
            layers.append(DecodeLayer(
                attn_norm=vec(layer_name(i, "attn_norm")), ffn_norm=vec(layer_name(i, "ffn_norm")),
                attn_q=mat(layer_name(i, "attn_q")), attn_k=mat(layer_name(i, "attn_k")),
                attn_v=mat(layer_name(i, "attn_v")), attn_output=mat(layer_name(i, "attn_output")),
                ffn_gate=mat(layer_name(i, "ffn_gate")), ffn_up=mat(layer_name(i, "ffn_up")),
                ffn_down=mat(layer_name(i, "ffn_down")), qkv_bias=bias))
            if progress:
                print(f"\rdecode weights: layer {i + 1}/{cfg.n_layers}", end="", flush=True)
        output = mat("token_embd.weight" if cfg.tied_output else "output.weight")
        embed = embed_table(model_file.tensor("token_embd.weight"), output if cfg.tied_output else None,
                            pad_q6k=pad_q6k)
        if not cfg.tied_output:
            total[0] += int(embed.data.nbytes)
        w = cls(cfg, embed, layers, vec("output_norm.weight"), output, total[0])
        if progress:
            print(f"\rdecode weights: {total[0] / 2**30:.2f} GiB on the GPU in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        return w


def embed_table(info, shared=None, pad_q6k: bool = True) -> EmbedTable:
    """token_embd as an EmbedTable; `shared` (a DeviceWeight of the same tensor) is reused."""
    cp = _cp()
    tn = info.type_name
    if tn not in _WTYPE:
        raise GGUFError(f"token_embd.weight: type {tn} is not supported by the GPU decode path")
    cols = int(info.shape[-1])
    if shared is not None:
        return EmbedTable(shared.data, shared.type_name, shared.cols, shared.block_stride)
    if tn in ("Q4_K", "Q6_K"):
        from engine.gpu.weights import upload_tensor

        w = upload_tensor(info, pad_q6k=pad_q6k)
        return EmbedTable(w.data, tn, cols, w.block_stride)
    raw = np.ascontiguousarray(np.asarray(info.data)).view(np.uint8).reshape(info.shape[0], -1)
    return EmbedTable(cp.asarray(raw), tn, cols, 0)


# ----------------------------------------------------------------------------- KV cache

class DeviceKVCache:
    """K and V on the device: [n_layers, max_tokens, n_kv_heads, head_dim], float16 (default)
    or float32; `length` tokens are filled."""

    def __init__(self, cfg: ModelConfig, max_tokens: int, dtype: str = "f16"):
        cp = _cp()
        if dtype not in DK.KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {DK.KV_DTYPES}")
        shape = (cfg.n_layers, max_tokens, cfg.n_kv_heads, cfg.head_dim)
        np_dtype = np.float16 if dtype == "f16" else np.float32
        self.k = cp.zeros(shape, dtype=np_dtype)
        self.v = cp.zeros(shape, dtype=np_dtype)
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.length = 0
        self.plan = None          # DecodePlan bound to these buffers (built on first use)

    def layer_views(self):
        return [self.k[i] for i in range(self.k.shape[0])], [self.v[i] for i in range(self.v.shape[0])]

    @property
    def tok_stride(self) -> int:
        return int(self.k.shape[2] * self.k.shape[3])

    @property
    def head_stride(self) -> int:
        return int(self.k.shape[3])


# ----------------------------------------------------------------------------- the step

@dataclass
class StepTimes:
    graph_build_ms: float = 0.0
    host_us_graph: list = field(default_factory=list)   # host time to enqueue one step, graph
    host_us_eager: list = field(default_factory=list)   # the same, kernel by kernel


class DecodePlan:
    """All launches of one decode step over given weights and KV buffers, and its CUDA graph."""

    def __init__(self, weights: DecodeWeights, k_layers, v_layers, tok_stride: int, head_stride: int,
                 kv_dtype: str, max_tokens: int, rows_per_warp: int = DEFAULT_ROWS_PER_WARP,
                 n_split: int | None = None, hist_cap: int = 4096,
                 unroll: int | None = None, fuse_combine: bool | None = None, fuse_norm: bool | None = None):
        cp = _cp()
        from engine.gpu.ops.q8 import Q8Act
        from engine.formats.rope import rope_tables

        self.w = weights
        cfg = self.cfg = weights.config
        self.k_layers, self.v_layers = list(k_layers), list(v_layers)
        self.tok_stride, self.head_stride = int(tok_stride), int(head_stride)
        self.kv_dtype = kv_dtype
        self.max_tokens = int(max_tokens)
        self.rows_per_warp = rows_per_warp
        self.unroll = DEFAULT_UNROLL if unroll is None else int(unroll)
        DK.mmvq_name("q4_k", rows_per_warp, "store", unroll=self.unroll)      # a compiled variant?
        self.fuse_combine = FUSE_COMBINE if fuse_combine is None else bool(fuse_combine)
        self.fuse_norm = (FUSE_NORM if fuse_norm is None else bool(fuse_norm)) and cfg.d_model <= NORM_MAX
        self.n_split = n_split or attention_splits(self.max_tokens, cfg.n_kv_heads)
        d, qd, kvd, ff = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
        f32 = np.float32
        self.state = cp.zeros(4, dtype=np.int32)
        self.hist_cap = hist_cap
        self.hist = cp.zeros(hist_cap, dtype=np.int32)
        self.best = cp.zeros(1, dtype=f32)
        self.x = cp.zeros(d, dtype=f32)
        self.qkv = cp.zeros(qd + 2 * kvd, dtype=f32)
        self.qrot = cp.zeros(qd, dtype=f32)
        self.part_o = cp.zeros((cfg.n_heads, self.n_split, cfg.head_dim), dtype=f32)
        self.part_ml = cp.zeros((cfg.n_heads, self.n_split, 2), dtype=f32)
        self.act_d = Q8Act(cp.zeros((1, d), dtype=np.int8), cp.zeros((1, d // 32, 2), dtype=f32))
        self.act_q = Q8Act(cp.zeros((1, qd), dtype=np.int8), cp.zeros((1, qd // 32, 2), dtype=f32))
        self.act_ff = Q8Act(cp.zeros((1, ff), dtype=np.int8), cp.zeros((1, ff // 32, 2), dtype=f32))
        self.hff = cp.zeros((1, ff), dtype=f32)
        self.ffa = self.ffb = None
        if any(not self._same_launch(L.ffn_gate, L.ffn_up) for L in weights.layers):
            self.ffa = cp.zeros(ff, dtype=f32)
            self.ffb = cp.zeros(ff, dtype=f32)
        self.logits = cp.zeros(cfg.vocab_size, dtype=f32)
        self.norm_counter = cp.zeros(1, dtype=np.uint32)          # self-re-arming (kernels)
        self.att_counters = cp.zeros(cfg.n_kv_heads, dtype=np.uint32)
        cos, sin = rope_tables(cfg, np.arange(self.max_tokens))
        self.rcos, self.rsin = cp.asarray(cos), cp.asarray(sin)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = None
        self.times = StepTimes()
        self.eps = np.float32(cfg.rms_eps)
        cp.cuda.Device().synchronize()        # uploads / zero fills ran on the legacy stream

    @classmethod
    def for_cache(cls, weights: DecodeWeights, cache: DeviceKVCache, **kw) -> "DecodePlan":
        kl, vl = cache.layer_views()
        return cls(weights, kl, vl, cache.tok_stride, cache.head_stride, cache.dtype, cache.max_tokens, **kw)

    @property
    def variant(self) -> str:
        return (f"R{self.rows_per_warp}U{self.unroll}" + ("+combine" if self.fuse_combine else "")
                + ("+norm" if self.fuse_norm else ""))

    @staticmethod
    def _same_launch(a, b) -> bool:
        return a.kind == b.kind and bool(getattr(a, "padded", False)) == bool(getattr(b, "padded", False))

    # -- the launches of one step (current stream) ------------------------------------------
    def enqueue(self) -> None:
        cfg, w, R, U = self.cfg, self.w, self.rows_per_warp, self.unroll
        d, qd, kvd = cfg.d_model, cfg.q_dim, cfg.kv_dim
        e = w.embed
        _k("decode_fused.cu", "decode_embed")((-(-d // 256),), (256,), (
            e.data, np.int64(e.row_bytes), np.int32(_WTYPE[e.type_name]), np.int32(e.block_stride),
            self.state, self.x, np.int32(d)))
        rms = _k("decode_fused.cu", "rmsnorm_q8")
        qrow = _k("decode_fused.cu", "quantize_row_q8")
        post = _k("decode_fused.cu", "qkv_post_" + self.kv_dtype)
        n_post = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim // 2 + kvd
        q_out, k_out, v_out = self.qkv[:qd], self.qkv[qd:qd + kvd], self.qkv[qd + kvd:]

        def norm(nw):            # rmsnorm(x) * nw -> act_d
            rms((1,), (1024,), (self.x, nw, self.eps, np.int32(d), self.act_d.q, self.act_d.ds, _null()))

        def add_norm(wt, act, nw):   # x += W act, then act_d = q8_1(rmsnorm(x) * nw)
            if self.fuse_norm:
                mmvq_launch([wt], [self.x], act.q, act.ds, "addnorm", R, U,
                            norm=(nw, self.eps, self.act_d.q, self.act_d.ds, self.norm_counter))
            else:
                mmvq_launch([wt], [self.x], act.q, act.ds, "add", R, U)
                norm(nw)

        norm(w.layers[0].attn_norm)
        for i, L in enumerate(w.layers):
            # q, k, v: one launch per run of matrices that share kind and layout
            groups: list[tuple[list, list]] = []
            for wt, out in ((L.attn_q, q_out), (L.attn_k, k_out), (L.attn_v, v_out)):
                if groups and self._same_launch(groups[-1][0][0], wt):
                    groups[-1][0].append(wt)
                    groups[-1][1].append(out)
                else:
                    groups.append(([wt], [out]))
            for ws, outs in groups:
                mmvq_launch(ws, outs, self.act_d.q, self.act_d.ds, "store", R, U)
            post((-(-n_post // 256),), (256,), (
                self.qkv, L.qkv_bias if L.qkv_bias is not None else _null(), self.rcos, self.rsin,
                self.state, self.qrot, self.k_layers[i], self.v_layers[i], np.int64(self.tok_stride),
                np.int64(self.head_stride), np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads),
                np.int32(cfg.head_dim), np.int32(cfg.rope_type == "neox")))
            attention_launch(self.qrot, self.k_layers[i], self.v_layers[i], self.tok_stride, self.head_stride,
                             self.state[1:2], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.kv_dtype,
                             self.n_split, self.part_o, self.part_ml, self.act_q.q, self.act_q.ds,
                             counters=self.att_counters if self.fuse_combine else None)
            add_norm(L.attn_output, self.act_q, L.ffn_norm)
            if self._same_launch(L.ffn_gate, L.ffn_up):
                mmvq_launch([L.ffn_gate, L.ffn_up], [self.hff], self.act_d.q, self.act_d.ds, "swiglu", R, U)
            else:
                mmvq_launch([L.ffn_gate], [self.ffa], self.act_d.q, self.act_d.ds, "store", R, U)
                mmvq_launch([L.ffn_up], [self.ffb], self.act_d.q, self.act_d.ds, "store", R, U)
                ff = cfg.d_ff
                _k("decode_fused.cu", "swiglu_mul")((-(-ff // 256),), (256,), (self.ffa, self.ffb, self.hff,
                                                                               np.int32(ff)))
            qrow((-(-cfg.d_ff // 256),), (256,), (self.hff, self.act_ff.q, self.act_ff.ds,
                                                  np.int32(cfg.d_ff // 32)))
            nxt = w.layers[i + 1].attn_norm if i + 1 < len(w.layers) else w.output_norm
            add_norm(L.ffn_down, self.act_ff, nxt)
        mmvq_launch([w.output], [self.logits], self.act_d.q, self.act_d.ds, "store", R, U)
        _k("argmax.cu", "argmax_step")((1,), (1024,), (self.logits, np.int32(cfg.vocab_size), self.state,
                                                       self.hist, np.int32(self.hist_cap), self.best))

    def set_state(self, token: int, pos: int, count: int = 0) -> None:
        k = _k("decode_fused.cu", "set_state")
        k((1,), (32,), (self.state, np.int32(token), np.int32(pos), np.int32(count)))

    def _check(self, token: int, pos: int) -> None:
        if not 0 <= pos < self.max_tokens:
            raise GGUFError(f"decode: position {pos} is outside the KV cache (size {self.max_tokens})")
        if not 0 <= token < self.cfg.vocab_size:
            raise GGUFError(f"decode: token id {token} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")

    def capture(self) -> None:
        """Record enqueue() into a CUDA graph (kernels must already be loaded: run one eager
        step first, which `step` does)."""
        t0 = time.perf_counter()
        s = self.stream
        with s:
            s.begin_capture()
            try:
                self.enqueue()
            finally:
                g = s.end_capture()
        g.upload(s)
        s.synchronize()
        self.graph = g
        self.times.graph_build_ms = (time.perf_counter() - t0) * 1e3

    def step(self, token: int, pos: int, use_graph: bool = True) -> None:
        """Launch one step for `token` at `pos` (asynchronous; logits in self.logits, the argmax
        in state[0] / hist). The first call runs eagerly (loads the kernels) and then captures."""
        self._check(token, pos)
        self._after_legacy_stream()
        with self.stream:
            self.set_state(token, pos)
            t0 = time.perf_counter()
            if use_graph and self.graph is not None:
                self.graph.launch(self.stream)
                self.times.host_us_graph.append((time.perf_counter() - t0) * 1e6)
            else:
                self.enqueue()
                self.times.host_us_eager.append((time.perf_counter() - t0) * 1e6)
        if use_graph and self.graph is None:
            self.stream.synchronize()
            self.capture()

    def _after_legacy_stream(self) -> None:
        """Order this step after work queued on the legacy default stream (a prefill, uploads):
        the plan's stream is non-blocking, so it does not wait for it by itself."""
        cp = _cp()
        self.stream.wait_event(cp.cuda.Stream.null.record())

    def logits_host(self) -> np.ndarray:
        out = self.logits.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def chain(self, token: int, pos: int, n: int, use_graph: bool = True) -> np.ndarray:
        """n steps with the token chained on the device (argmax -> next input): returns the n
        emitted ids (host), after one synchronization. Needs a captured graph for use_graph."""
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        self._check(token, pos)
        if pos + n > self.max_tokens:
            raise GGUFError(f"decode: {pos + n} tokens exceed the KV cache size {self.max_tokens}")
        if n > self.hist_cap:
            raise ValueError(f"chain: at most {self.hist_cap} steps per call")
        if use_graph and self.graph is None:
            self.step(token, pos)            # eager first step + capture
            first = 1
        else:
            self._after_legacy_stream()
            with self.stream:
                self.set_state(token, pos)
            first = 0
        with self.stream:
            for _ in range(first, n):
                if use_graph:
                    self.graph.launch(self.stream)
                else:
                    self.enqueue()
        out = self.hist[:n].get(stream=self.stream)
        self.stream.synchronize()
        return out


# ----------------------------------------------------------------------------- a backend

class DecodeModel:
    """GPU backend on the decode path alone: prompts go through decode steps one token at a
    time (the KV cache is filled by the same kernels); logits come back as numpy float32."""

    device = "gpu"

    def __init__(self, model_file, pad_q6k: bool = True, kv_dtype: str = "f16",
                 use_graph: bool = True, progress: bool = False, **plan_kw):
        """plan_kw: DecodePlan options (rows_per_warp, unroll, fuse_combine, fuse_norm)
        for the plans of new caches."""
        self.file = model_file
        self.config = model_file.config
        self.weights = DecodeWeights.upload(model_file, pad_q6k=pad_q6k, progress=progress)
        self.resident_bytes = self.weights.resident_bytes
        self.kv_dtype = kv_dtype
        self.use_graph = use_graph
        self.plan_kw = plan_kw

    @classmethod
    def from_path(cls, path, **kw) -> "DecodeModel":
        from engine.formats.weights import open_model

        return cls(open_model(path), **kw)

    def new_cache(self, max_tokens: int) -> DeviceKVCache:
        return DeviceKVCache(self.config, max_tokens, self.kv_dtype)

    def plan(self, cache: DeviceKVCache) -> DecodePlan:
        if cache.plan is None:
            cache.plan = DecodePlan.for_cache(self.weights, cache, **self.plan_kw)
        return cache.plan

    def forward(self, ids: Sequence[int], cache: DeviceKVCache, all_logits: bool = False) -> np.ndarray:
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        if not ids:
            raise GGUFError(f"{self.file.path}: forward needs at least one token")
        if cache.length + len(ids) > cache.max_tokens:
            raise GGUFError(f"{self.file.path}: {cache.length + len(ids)} tokens exceed the KV cache "
                            f"size {cache.max_tokens}")
        plan = self.plan(cache)
        rows = []
        for j, t in enumerate(ids):
            plan.step(t, cache.length, use_graph=self.use_graph)
            cache.length += 1
            if all_logits or j == len(ids) - 1:
                rows.append(plan.logits_host())
        return np.stack(rows) if all_logits else rows[-1]

    def greedy(self, prompt_ids: Sequence[int], n: int, cache: DeviceKVCache | None = None) -> list[int]:
        """Greedy ids with the token chained on the device (only ids come back)."""
        prompt_ids = [int(t) for t in prompt_ids]
        cache = cache or self.new_cache(len(prompt_ids) + n)
        if len(prompt_ids) > 1:
            self.forward(prompt_ids[:-1], cache)
        plan = self.plan(cache)
        out = plan.chain(prompt_ids[-1], cache.length, n, use_graph=self.use_graph)
        cache.length += n
        return [int(t) for t in out]


# ----------------------------------------------------------------------------- benchmark

def _plan_for(model, cache):
    if hasattr(model, "plan"):
        return model.plan(cache)
    return decode_plan(model, cache)


def decode_plan(gpu_model, cache) -> DecodePlan:
    """The DecodePlan of a cache of another backend (engine.gpu.model.GPUModel): it must expose
    `decode_weights()` -> DecodeWeights and the cache `decode_kv()` -> (k_layers, v_layers,
    tok_stride, head_stride, kv_dtype, max_tokens)."""
    plan = getattr(cache, "plan", None)
    if plan is None:
        kl, vl, ts, hs, dt, mt = cache.decode_kv()
        plan = DecodePlan(gpu_model.decode_weights(), kl, vl, ts, hs, dt, mt)
        cache.plan = plan
    return plan


def decode_step(model, ids, cache) -> np.ndarray:
    """One token through the decode graph for another backend (GPUModel.forward's hook):
    logits [vocab] as numpy float32; cache.length advances by one."""
    ids = model.check_ids(ids, cache)
    plan = decode_plan(model, cache)
    plan.step(int(ids[0]), cache.length)
    cache.length += 1
    return plan.logits_host()


def bench_decode(model, n_gen: int = 128, depth: int = 0, reps: int = 5, use_graph: bool = True,
                 seed: int = 0) -> list[float]:
    """tg rows: tok/s of `n_gen` greedy steps after `depth` tokens of context, per rep (one
    warm-up rep excluded), timed with CUDA events around back-to-back graph replays."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    cfg = model.config
    cache = model.new_cache(depth + n_gen + 1)
    if depth:
        ids = rng.integers(0, cfg.vocab_size, depth).tolist()
        model.forward(ids, cache)
    plan = _plan_for(model, cache)
    tok = int(rng.integers(0, cfg.vocab_size))
    plan.chain(tok, depth, 2, use_graph=use_graph)      # load kernels, capture
    out = []
    for r in range(reps + 1):
        s = plan.stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        with s:
            plan.set_state(tok, depth)
            e0.record(s)
            for _ in range(n_gen):
                if use_graph:
                    plan.graph.launch(s)
                else:
                    plan.enqueue()
            e1.record(s)
        e1.synchronize()
        ms = cp.cuda.get_elapsed_time(e0, e1)
        if r:
            out.append(n_gen / (ms / 1e3))
    return out


def host_overhead_us(model, n: int = 64) -> dict:
    """Python-side cost of enqueueing one step: graph replay vs kernel-by-kernel (median us
    over n steps each), the kernels a step launches and the graph build time."""
    cache = model.new_cache(n + 4)
    plan = _plan_for(model, cache)
    plan.chain(1, 0, 2)                      # kernels loaded, graph captured
    res = {}
    for mode in ("graph", "eager"):
        ts = []
        with plan.stream:
            plan.set_state(1, 0)             # positions 0..n-1 stay inside the cache
            for i in range(n):
                t0 = time.perf_counter()
                if mode == "graph":
                    plan.graph.launch(plan.stream)
                else:
                    plan.enqueue()
                ts.append((time.perf_counter() - t0) * 1e6)
                if i % 8 == 7:
                    plan.stream.synchronize()     # keep the launch queue from filling
            plan.stream.synchronize()
        res[mode + "_us"] = float(np.median(ts))
    res["kernels_per_step"] = count_launches(plan)
    res["graph_build_ms"] = plan.times.graph_build_ms
    return res


def count_launches(plan: DecodePlan) -> int:
    """Kernels one step launches (by counting RawKernel calls of enqueue())."""
    n = [0]
    orig = kernels.get_kernel

    class Counting:
        def __init__(self, k):
            self.k = k

        def __call__(self, *a, **kw):
            n[0] += 1

    def fake(fname, name, dynamic_smem=0):
        return Counting(orig(fname, name, dynamic_smem))

    kernels.get_kernel = fake
    try:
        plan.enqueue()
    finally:
        kernels.get_kernel = orig
    return n[0]


def mmvq_microbench(weights: DecodeWeights, rows_per_warp: int = DEFAULT_ROWS_PER_WARP, iters: int = 50,
                    unroll: int = DEFAULT_UNROLL) -> list:
    """Each GEMV of one decode step, alone: (what, N, K, weight bytes, us, GB/s); median of
    `iters` timed launches after a warm-up. The layer-0 (and, if different, the last layer's)
    matrices and the output matrix."""
    cp = _cp()
    from engine.gpu.ops.q8 import Q8Act

    cfg = weights.config
    out = []

    def act(K):
        x = cp.asarray(np.random.default_rng(0).integers(-127, 128, K).astype(np.int8))
        ds = cp.asarray(np.tile(np.array([[0.01, 0.0]], np.float32), (K // 32, 1)))
        return Q8Act(x, ds)

    def time_it(what, ws, mode):
        K = int(ws[0].cols)
        a = act(K)
        n_out = int(ws[0].rows)
        ys = [cp.zeros(int(w.rows), dtype=np.float32) for w in ws] if mode == "store" else \
            [cp.zeros(n_out, dtype=np.float32)]
        for _ in range(3):
            mmvq_launch(ws, ys, a.q, a.ds, mode, rows_per_warp, unroll)
        ts = []
        for _ in range(iters):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            mmvq_launch(ws, ys, a.q, a.ds, mode, rows_per_warp, unroll)
            e1.record()
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        us = float(np.median(ts))
        nbytes = sum(int(w.data.nbytes) for w in ws)
        out.append({"what": what, "N": sum(int(w.rows) for w in ws), "K": K, "bytes": nbytes, "us": us,
                    "GB_s": nbytes / us / 1e3, "rows_per_warp": rows_per_warp, "unroll": unroll})

    layers = [0] if cfg.n_layers == 1 else [0, 4 if cfg.n_layers > 4 else cfg.n_layers - 1]
    for i in layers:
        L = weights.layers[i]
        tag = f"L{i} "
        if DecodePlan._same_launch(L.attn_q, L.attn_v):
            time_it(tag + f"qkv {L.attn_q.kind}", [L.attn_q, L.attn_k, L.attn_v], "store")
        else:
            time_it(tag + f"qk {L.attn_q.kind}", [L.attn_q, L.attn_k], "store")
            time_it(tag + f"v {L.attn_v.kind}", [L.attn_v], "store")
        time_it(tag + f"o {L.attn_output.kind}", [L.attn_output], "add")
        time_it(tag + f"gate+up swiglu {L.ffn_gate.kind}", [L.ffn_gate, L.ffn_up], "swiglu")
        time_it(tag + f"down {L.ffn_down.kind}{'' if L.ffn_down.kind == 'q4_k' else (' pad' if L.ffn_down.padded else ' raw')}",
                [L.ffn_down], "add")
    o = weights.output
    time_it(f"output {o.kind}{'' if o.kind == 'q4_k' else (' pad' if o.padded else ' raw')}", [o], "store")
    return out


def parse_variant(text: str) -> dict:
    """'R2U0+combine+norm' -> DecodePlan options."""
    import re

    parts = text.split("+")
    m = re.fullmatch(r"R(\d+)U(\d+)", parts[0])
    if not m or any(p not in ("combine", "norm") for p in parts[1:]):
        raise ValueError(f"variant {text!r}: expected R<rows>U<unroll>[+combine][+norm]")
    return {"rows_per_warp": int(m.group(1)), "unroll": int(m.group(2)),
            "fuse_combine": "combine" in parts[1:], "fuse_norm": "norm" in parts[1:]}


def main(argv=None) -> int:
    """python -m engine.gpu.decode --model M [-n 128] [-d 0,3314] [-r 5] [--variants ...] [--json F]"""
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(prog="python -m engine.gpu.decode")
    p.add_argument("--model", required=True)
    p.add_argument("-n", type=int, default=128)
    p.add_argument("-d", default="0")
    p.add_argument("-r", type=int, default=5)
    p.add_argument("--variants", default=f"R{DEFAULT_ROWS_PER_WARP}U{DEFAULT_UNROLL}",
                   help="comma-separated R<rows>U<unroll>[+combine][+norm]; "
                        "the first depth runs every variant, the other depths the fastest")
    p.add_argument("--raw-q6k", action="store_true", help="keep q6_K rows raw (210 B)")
    p.add_argument("--kv", default="f16", choices=DK.KV_DTYPES)
    p.add_argument("--eager", action="store_true", help="also time tg at depth 0 without the graph")
    p.add_argument("--kernels", default="", help="variants (R<rows>U<unroll>) for the GEMV microbenchmark")
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = {"model": a.model, "size": os.path.getsize(a.model), "rows": [], "kernels": []}

    def dump():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)

    model = DecodeModel.from_path(a.model, pad_q6k=not a.raw_q6k, kv_dtype=a.kv, progress=True)
    res["resident_bytes"] = model.resident_bytes
    variants = a.variants.split(",")
    depths = [int(x) for x in a.d.split(",")]

    def row(v, depth, graph):
        model.plan_kw = parse_variant(v)
        ts = bench_decode(model, a.n, depth, a.r if graph else 2, use_graph=graph)
        r = {"test": f"tg{a.n}" + (f" @ d{depth}" if depth else ""), "variant": v, "graph": graph,
             "tok_s": float(np.mean(ts)), "sd": float(np.std(ts, ddof=1)) if len(ts) > 1 else 0.0,
             "reps": ts, "q6k": "raw" if a.raw_q6k else "padded", "kv": a.kv}
        res["rows"].append(r)
        print(f"{r['test']:14s} {v:22s} graph={str(graph):5s} {r['tok_s']:9.1f} ± {r['sd']:.1f} tok/s", flush=True)
        dump()

    for v in variants:
        row(v, depths[0], True)
    best = max(res["rows"], key=lambda r: r["tok_s"])["variant"]
    res["best_variant"] = best
    for depth in depths[1:]:
        row(best, depth, True)
    if a.eager:
        row(best, depths[0], False)
    model.plan_kw = parse_variant(best)
    res["host"] = host_overhead_us(model)
    h = res["host"]
    print(f"host time per step ({best}): graph {h['graph_us']:.1f} us, eager {h['eager_us']:.1f} us "
          f"({h['kernels_per_step']} kernels), graph build {h['graph_build_ms']:.1f} ms", flush=True)
    dump()
    for v in [x for x in a.kernels.split(",") if x]:
        kw = parse_variant(v)
        for k in mmvq_microbench(model.weights, kw["rows_per_warp"], unroll=kw["unroll"]):
            k["variant"] = v
            res["kernels"].append(k)
            print(f"  {v:6s} {k['what']:28s} {k['N']:6d}x{k['K']:<6d} {k['bytes'] / 2**20:8.1f} MiB "
                  f"{k['us']:8.1f} us {k['GB_s']:7.0f} GB/s", flush=True)
        dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

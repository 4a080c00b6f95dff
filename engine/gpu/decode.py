"""Decode mode of the GPU model: one token per step over GPUModel's own device weights and one
GPUKVCache, the whole step captured once in a CUDA graph.

A decode step (one token at position p = the cache length before it) is:

    x = embed(token)                                   decode_fused.cu  decode_embed
    per layer:
        a = q8_1(rmsnorm(x) * attn_norm)               decode_fused.cu  rmsnorm_q8
        qkv = [Wq; Wk; Wv] a                           mmvq_q4_k.cu / mmvq_q6_k.cu (store; one launch,
                                                       mmvq_mixed.cu where q4_K and q6_K mix)
        q, K[p], V[p] = rope(qkv + bias)               decode_fused.cu  qkv_post_f16
        o = attention(q, K[0..p], V[0..p])             attention_decode.cu split + combine (-> q8_1)
        x += Wo o                                      mmvq (add)
        a = q8_1(rmsnorm(x) * ffn_norm)                rmsnorm_q8
        h = silu(Wg a) * (Wu a)                        mmvq (swiglu: gate and up in one launch)
        x += Wd q8_1(h)                                quantize_row_q8 + mmvq (add)
    logits = Wout q8_1(rmsnorm(x) * output_norm)       rmsnorm_q8 + mmvq (store)
    token = argmax(logits); p += 1                     argmax.cu  (writes the next step's input)

The token and the position live in device memory (`state` int32 [4]: token, position, count of
emitted tokens; `best` float32: the chosen logit; both in one 8-word buffer `io`, so one small
copy brings both back), so the same launches serve every step: `DecodeStep` records them once
into a CUDA graph (CuPy stream capture) on its own stream and replays it. The host writes the
state (one tiny kernel, `set_state`) only when the next token is not the one the graph's argmax
already left there (a sampler chose another); a greedy step is a graph replay plus a 32-byte
copy. `chain` replays back to back with the token chained on the device and reads the emitted
ids at the end (the benchmark path).

Who uses it: engine.gpu.session.GPUSession (a generation: cache + DecodeStep, pooled by the
model) and `bench_decode` (tg rows of `gguf-prefill bench`). This module imports no model or
session code: it is handed the model (its `config`, `embed_w`, `layers[i].roles / qkv_bias /
attn_norm / ffn_norm / wo / down`, `output_norm`, `output_w`, `rope_tables(n)`) and the cache. Microbenchmarks of the step
(host overhead, launches per step, each GEMV alone) are in dev/decode_bench.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from engine.errors import GGUFError
from engine.gpu import kernels
from engine.gpu.launch import capture_graph
from engine.gpu.ops.attention import attention_launch, attention_splits
from engine.gpu.ops.mmvq import mixes, mmvq_launch, mmvq_mixed_launch

HIST_CAP = 4096           # emitted ids `chain` can return per call


def _cp():
    import cupy

    return cupy


def _null():
    return np.uint64(0)


def _k(fname: str, name: str):
    return kernels.get_kernel(fname, name)


def same_launch(a, b) -> bool:
    """Two matrices one MMVQ launch can take together: same kind and row layout."""
    return a.kind == b.kind and bool(getattr(a, "padded", False)) == bool(getattr(b, "padded", False))


@dataclass
class StepTimes:
    graph_build_ms: float = 0.0     # eager first step excluded: capture + upload
    captures: int = 0               # graphs recorded (1 for the life of a session)


class DecodeStep:
    """All launches of one decode step over `model`'s weights (engine.gpu.model.GPUModel) and
    `cache` (engine.gpu.kv_cache.GPUKVCache), their work buffers and their CUDA graph."""

    def __init__(self, model, cache, hist_cap: int = HIST_CAP):
        cp = _cp()
        from engine.gpu.ops.q8 import Q8Act

        self.model = model
        self.cache = cache
        cfg = self.cfg = model.config
        self.max_tokens = int(cache.capacity)
        self.n_split = attention_splits(self.max_tokens, cfg.n_kv_heads)
        d, qd, kvd, ff = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
        f32 = np.float32
        self.io = cp.zeros(8, dtype=np.int32)           # state [0:4], best [4]
        self.state = self.io[0:4]
        self.best = self.io[4:5].view(f32)
        self.hist_cap = hist_cap
        self.hist = cp.zeros(hist_cap, dtype=np.int32)
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
        if any(not same_launch(L.roles["ffn_gate"], L.roles["ffn_up"]) for L in model.layers):
            self.ffa = cp.zeros(ff, dtype=f32)
            self.ffb = cp.zeros(ff, dtype=f32)
        self.logits = cp.zeros(cfg.vocab_size, dtype=f32)
        self.rcos, self.rsin = model.rope_tables(self.max_tokens)   # held: the graph reads them
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = None
        self.times = StepTimes()
        self.eps = np.float32(cfg.rms_eps)
        cp.cuda.Device().synchronize()        # zero fills ran on the legacy stream

    @property
    def nbytes(self) -> int:
        bufs = (self.io, self.hist, self.x, self.qkv, self.qrot, self.part_o, self.part_ml, self.hff,
                self.logits, *self.act_d, *self.act_q, *self.act_ff)
        return int(sum(b.nbytes for b in bufs) + (0 if self.ffa is None else self.ffa.nbytes * 2))

    # -- the launches of one step (current stream) ------------------------------------------
    def enqueue(self) -> None:
        m, cfg, cache = self.model, self.cfg, self.cache
        d, qd, kvd = cfg.d_model, cfg.q_dim, cfg.kv_dim
        e = m.embed_w
        _k("decode_fused.cu", "decode_embed")((-(-d // 256),), (256,), (
            e.data, np.int64(e.data.shape[1]), np.int32(e.ggml_type), np.int32(e.block_stride),
            self.state, self.x, np.int32(d)))
        rms = _k("decode_fused.cu", "rmsnorm_q8")
        qrow = _k("decode_fused.cu", "quantize_row_q8")
        post = _k("decode_fused.cu", "qkv_post_" + cache.dtype)
        n_post = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim // 2 + kvd
        q_out, k_out, v_out = self.qkv[:qd], self.qkv[qd:qd + kvd], self.qkv[qd + kvd:]
        ts, hs = cache.tok_stride, cache.head_stride

        def norm(nw):            # rmsnorm(x) * nw -> act_d: one block per 1024 values (RMS_NT)
            rms((-(-d // 1024),), (1024,), (self.x, nw, self.eps, np.int32(d), self.act_d.q, self.act_d.ds,
                                            _null()))

        layers = m.layers
        norm(layers[0].attn_norm)
        for i, L in enumerate(layers):
            W = L.roles
            # q, k, v: one launch (mmvq_mixed where q4_K and q6_K mix), else one launch per run
            # of matrices that share kind and layout
            qkv_w, qkv_y = [W["attn_q"], W["attn_k"], W["attn_v"]], [q_out, k_out, v_out]
            if m.mixed_launch and mixes(qkv_w):
                mmvq_mixed_launch(qkv_w, qkv_y, self.act_d.q, self.act_d.ds)
            else:
                groups: list[tuple[list, list]] = []
                for wt, out in zip(qkv_w, qkv_y):
                    if groups and same_launch(groups[-1][0][0], wt):
                        groups[-1][0].append(wt)
                        groups[-1][1].append(out)
                    else:
                        groups.append(([wt], [out]))
                for ws, outs in groups:
                    mmvq_launch(ws, outs, self.act_d.q, self.act_d.ds, "store")
            kl, vl = cache.k_layer(i), cache.v_layer(i)
            post((-(-n_post // 256),), (256,), (
                self.qkv, L.qkv_bias if L.qkv_bias is not None else _null(), self.rcos, self.rsin,
                self.state, self.qrot, kl, vl, np.int64(ts), np.int64(hs), np.int32(cfg.n_heads),
                np.int32(cfg.n_kv_heads), np.int32(cfg.head_dim), np.int32(cfg.rope_type == "neox")))
            attention_launch(self.qrot, kl, vl, ts, hs, self.state[1:2], cfg.n_heads, cfg.n_kv_heads,
                             cfg.head_dim, cache.dtype, self.n_split, self.part_o, self.part_ml,
                             self.act_q.q, self.act_q.ds)
            mmvq_launch([L.wo], [self.x], self.act_q.q, self.act_q.ds, "add")
            norm(L.ffn_norm)
            if same_launch(W["ffn_gate"], W["ffn_up"]):
                mmvq_launch([W["ffn_gate"], W["ffn_up"]], [self.hff], self.act_d.q, self.act_d.ds, "swiglu")
            else:
                mmvq_launch([W["ffn_gate"]], [self.ffa], self.act_d.q, self.act_d.ds, "store")
                mmvq_launch([W["ffn_up"]], [self.ffb], self.act_d.q, self.act_d.ds, "store")
                ff = cfg.d_ff
                _k("decode_fused.cu", "swiglu_mul")((-(-ff // 256),), (256,), (self.ffa, self.ffb, self.hff,
                                                                               np.int32(ff)))
            qrow((-(-cfg.d_ff // 256),), (256,), (self.hff, self.act_ff.q, self.act_ff.ds,
                                                  np.int32(cfg.d_ff // 32)))
            mmvq_launch([L.down], [self.x], self.act_ff.q, self.act_ff.ds, "add")
            norm(layers[i + 1].attn_norm if i + 1 < len(layers) else m.output_norm)
        mmvq_launch([m.output_w], [self.logits], self.act_d.q, self.act_d.ds, "store")
        self.argmax_into_state(self.logits)

    def argmax_into_state(self, logits) -> None:
        """argmax.cu over `logits` float32 [vocab] (current stream): state[0] = the id,
        state[1] += 1, hist[state[2]++] = the id, best = its logit."""
        _k("argmax.cu", "argmax_step")((1,), (1024,), (logits, np.int32(self.cfg.vocab_size), self.state,
                                                       self.hist, np.int32(self.hist_cap), self.best))

    def set_state(self, token: int, pos: int, count: int = 0) -> None:
        """state = (token, pos, count) by one tiny launch on the current stream."""
        k = _k("decode_fused.cu", "set_state")
        k((1,), (32,), (self.state, np.int32(token), np.int32(pos), np.int32(count)))

    def check(self, token: int, pos: int) -> None:
        if not 0 <= pos < self.max_tokens:
            raise GGUFError(f"decode: position {pos} is outside the KV cache (size {self.max_tokens})")
        if not 0 <= token < self.cfg.vocab_size:
            raise GGUFError(f"decode: token id {token} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")

    # -- graph -------------------------------------------------------------------------------
    def capture(self) -> None:
        """Record enqueue() into a CUDA graph (kernels must already be loaded: one eager step
        first, which `launch` does)."""
        t0 = time.perf_counter()
        self.graph = capture_graph(self.stream, self.enqueue)
        self.times.graph_build_ms = (time.perf_counter() - t0) * 1e3
        self.times.captures += 1

    def launch(self, use_graph: bool = True) -> None:
        """One step with the state already on the device (asynchronous, on self.stream).
        Without a graph yet, the step runs kernel by kernel (loading the kernels) and the
        graph is captured after it."""
        with self.stream:
            if use_graph and self.graph is not None:
                self.graph.launch(self.stream)
                return
            self.enqueue()
        if use_graph:
            self.stream.synchronize()
            self.capture()

    def after_legacy_stream(self) -> None:
        """Order what follows on self.stream after the work queued on the legacy default
        stream (a prefill, uploads): self.stream is non-blocking, it does not wait by itself."""
        cp = _cp()
        self.stream.wait_event(cp.cuda.Stream.null.record())

    def before_legacy_stream(self) -> None:
        """Order what follows on the legacy stream (a prefill into the cache) after self.stream."""
        cp = _cp()
        cp.cuda.Stream.null.wait_event(self.stream.record())

    def read_io(self) -> np.ndarray:
        """(state[0:4], best as int32 bits) on the host, after self.stream's work."""
        out = self.io.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def logits_host(self, logits=None) -> np.ndarray:
        out = (self.logits if logits is None else logits).get(stream=self.stream)
        self.stream.synchronize()
        return out

    def chain(self, token: int, pos: int, n: int, use_graph: bool = True) -> np.ndarray:
        """n steps with the token chained on the device (argmax -> next input): returns the n
        emitted ids (host), after one synchronization."""
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        self.check(token, pos)
        if pos + n > self.max_tokens:
            raise GGUFError(f"decode: {pos + n} tokens exceed the KV cache size {self.max_tokens}")
        if n > self.hist_cap:
            raise ValueError(f"chain: at most {self.hist_cap} steps per call")
        self.after_legacy_stream()
        with self.stream:
            self.set_state(token, pos)
        for _ in range(n):
            self.launch(use_graph)
        out = self.hist[:n].get(stream=self.stream)
        self.stream.synchronize()
        return out


# ----------------------------------------------------------------------------- benchmark

def bench_decode(model, n_gen: int = 128, depth: int = 0, reps: int = 5, use_graph: bool = True,
                 seed: int = 0) -> list[float]:
    """tg rows: tok/s of `n_gen` greedy steps after `depth` tokens of context, per rep (one
    warm-up rep excluded), timed with CUDA events around back-to-back graph replays. The
    cache is sized exactly (depth + n_gen + 1), outside the model's session pool; the
    context is written by the prefill kernels."""
    cp = _cp()

    rng = np.random.default_rng(seed)
    cfg = model.config
    cache = model.new_cache(depth + n_gen + 1)
    if depth:
        model.forward_device(rng.integers(0, cfg.vocab_size, depth).tolist(), cache)
    step = DecodeStep(model, cache)
    tok = int(rng.integers(0, cfg.vocab_size))
    step.chain(tok, depth, 2, use_graph=use_graph)      # load kernels, capture
    out = []
    for r in range(reps + 1):
        s = step.stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        with s:
            step.set_state(tok, depth)
            e0.record(s)
            for _ in range(n_gen):
                if use_graph:
                    step.graph.launch(s)
                else:
                    step.enqueue()
            e1.record(s)
        e1.synchronize()
        ms = cp.cuda.get_elapsed_time(e0, e1)
        if r:
            out.append(n_gen / (ms / 1e3))
    return out

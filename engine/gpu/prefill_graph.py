"""Short prompts through a CUDA graph: a prefill of up to GRAPH_MAX_TOKENS tokens replays the
launches of GPUModel.run_layers (embed + every layer, ~10 launches a layer) recorded once, so
a chat-sized prompt pays no per-launch host time (eager, the host needs ~11 ms to issue a 7B
forward whatever its length; the GPU work of 32 tokens is a few ms).

    pg = PrefillGraph(model, cache, T)      # buffers for T tokens over this cache
    pg.run(ids, start)                      # ids: T int32 (host), positions start..start+T-1

One graph serves every position: the ids and the start position are read on the device
(`ids`, `pos`: this object's buffers, written before each replay on the current stream), rope.cu
and attention_prefill.cu add `pos` to their start. What a replay touches is owned here or by
the cache and the model: the ubatch buffers (UbatchBuffers), the cache's K/V, the model's
weights and the RoPE tables (held, so a later, longer table of the model cannot free them)
and the GEMMs' split workspace (engine.gpu.ops.mmq, grown only before a capture). The graph
is recorded on a private stream after one eager run (which loads the kernels and sizes the
workspace) and replayed on the caller's stream.

Who uses it: GPUModel.forward_device, for one-ubatch prompts of n <= GRAPH_MAX_TOKENS, with
T = the power of two >= n when the cache has room for it (the padding rows hold token 0; they
write K/V past the prompt, where nothing reads before the next tokens overwrite them, and
their rows of the residual stream are never read), else T = n. Each cache keeps up to
GRAPHS_PER_CACHE of them (least recently used out).
"""
from __future__ import annotations

import numpy as np

from engine.gpu.launch import capture_graph

GRAPH_MAX_TOKENS = 128
GRAPHS_PER_CACHE = 8


def _cp():
    import cupy

    return cupy


class UbatchBuffers:
    """The work buffers of one ubatch of T tokens: x, y float32 [T, d] (residual stream and the
    last GEMM's output), q8_1 activations a_d [T, d], a_q [T, q_dim], a_f [T, d_ff], rotated
    queries qh f16 [H, T, hd], and one output [T, rows] per GEMM of a fused group (gemm_out: by
    its position in the group and its row count, so the GEMMs of one group never share one);
    for the Hopper GEMMs (made on first use, i.e. in the eager run before a capture) one tiled
    f16 operand per K (xt) and the float32 attention output (attn_f32)."""

    def __init__(self, model, T: int):
        cp = _cp()
        from engine.gpu.ops.q8 import Q8Act

        cfg = model.config
        self.T = T
        f32 = cp.float32

        def act(K):
            return Q8Act(cp.empty((T, K), dtype=cp.int8), cp.empty((T, K // 32, 2), dtype=f32))

        self.x = cp.empty((T, cfg.d_model), dtype=f32)
        self.y = cp.empty((T, cfg.d_model), dtype=f32)
        self.a_d, self.a_q, self.a_f = act(cfg.d_model), act(cfg.q_dim), act(cfg.d_ff)
        self.qh = cp.empty((cfg.n_heads, T, cfg.head_dim), dtype=cp.float16)
        self._gemm = {}
        self._xt = {}
        self._attn_f32 = None
        self._q_dim = cfg.q_dim

    def gemm_out(self, rows: int, seg: int = 0):
        out = self._gemm.get((seg, rows))
        if out is None:
            out = self._gemm[seg, rows] = _cp().empty((self.T, rows), dtype=_cp().float32)
        return out

    def xt(self, K: int, slot: int = 0):
        """The tiled f16 GEMM operand for K columns (engine.gpu.ops.wgmma.tiled_buffer: zero
        past T, which no producer writes). Producers of one K share it: each is read by its
        GEMMs before the next producer of that K runs, in stream order; slot 1 is a second
        buffer, for a GEMM writing an operand of its own input's K (the gate|up GEMM's SwiGLU
        epilogue where d_ff == d_model)."""
        from engine.gpu.ops.wgmma import tiled_buffer

        out = self._xt.get((K, slot))
        if out is None:
            out = self._xt[K, slot] = tiled_buffer(self.T, K)
        return out

    def attn_f32(self):
        if self._attn_f32 is None:
            self._attn_f32 = _cp().empty((self.T, self._q_dim), dtype=_cp().float32)
        return self._attn_f32


class PrefillGraph:
    """run_layers for T tokens over one cache, recorded once (module docstring)."""

    def __init__(self, model, cache, T: int):
        cp = _cp()
        self.model, self.cache, self.T = model, cache, int(T)
        self.bufs = UbatchBuffers(model, self.T)
        self.ids = cp.zeros(self.T, dtype=cp.int32)
        self.pos = cp.zeros(1, dtype=cp.int32)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = None
        self.tables = None       # the RoPE tables the graph reads

    def run(self, ids: np.ndarray, start: int) -> None:
        """Positions start..start+len(ids)-1 (len(ids) <= T; the rest padded with token 0)
        through every layer; the result is in self.bufs (GPUModel.run_head reads it)."""
        cp = _cp()
        n = int(ids.size)
        if not 1 <= n <= self.T or start + self.T > self.cache.capacity:
            raise ValueError(f"prefill graph: {n} tokens at {start} do not fit T={self.T} "
                             f"in a cache of {self.cache.capacity}")
        padded = np.zeros(self.T, dtype=np.int32)
        padded[:n] = ids
        self.ids.set(padded)
        self.pos.set(np.array([start], dtype=np.int32))
        m = self.model
        m._ensure_rope(self.cache.capacity)
        if self.graph is None or self.tables[0] is not m._rope_cos:
            # eager once (kernels loaded, split workspace sized), then record the same launches
            m.run_layers(self.bufs, self.ids, 0, self.cache, start_dev=self.pos)
            self._capture()
            return
        self.graph.launch(cp.cuda.get_current_stream())

    def _capture(self) -> None:
        cp = _cp()
        m, s = self.model, self.stream
        s.wait_event(cp.cuda.get_current_stream().record())
        self.graph = capture_graph(s, lambda: m.run_layers(self.bufs, self.ids, 0, self.cache, start_dev=self.pos))
        self.tables = (m._rope_cos, m._rope_sin)


def graph_tokens(n: int, start: int, capacity: int) -> int | None:
    """T of the graph that takes n tokens at `start`: the power of two >= n when the cache has
    room, else n; None when n is over GRAPH_MAX_TOKENS (eager)."""
    if not 1 <= n <= GRAPH_MAX_TOKENS or start + n > capacity:
        return None
    t = 1 << (n - 1).bit_length()
    return t if start + t <= capacity else n


def cache_graph(model, cache, T: int) -> PrefillGraph:
    """The cache's graph for T tokens (made on first use; GRAPHS_PER_CACHE kept, LRU)."""
    graphs = cache.prefill_graphs
    pg = graphs.get(T)
    if pg is None:
        pg = graphs[T] = PrefillGraph(model, cache, T)
        while len(graphs) > GRAPHS_PER_CACHE:
            graphs.popitem(last=False)
    else:
        graphs.move_to_end(T)
    return pg

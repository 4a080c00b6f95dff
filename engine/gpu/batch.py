"""The GPU backend's batched step (the BatchBackend contract of engine/scheduler.py): one
forward over the tokens of several sequences, each in its own slot of ONE shared KV cache.

Cache: GPUKVCache of n_slots * slot_capacity + PAD_ROWS positions; slot s holds its sequence's
position p at row s * slot_capacity + p; the last PAD_ROWS rows take the K/V of padding tokens.

A step of N tokens (entries in order: each entry's ids at positions start..) runs as T tokens,
T = the power of two >= N up to GRAPH_MAX_TOKENS (padding: token 0 at position 0, K/V into the
pad rows, never attended, never read by the head), else T = N:

    tiles [n_tiles, 4]          ops.attention.varlen_tiles (zero tiles up to the fixed grid)
    ids, pos, rows [T]          per token: id, RoPE position, cache row
    sel [S]                     the batch row of each wanted entry's last token (S = min(T, n_slots))
    GPUModel.run_layers(varlen=(pos, rows, tiles))      every layer, the model's own kernels
    out = gather(x + y)[sel] -> rmsnorm q8_1 -> output GEMM -> logits [S, vocab]
    argmax_rows(logits) -> ids, best [S]                 one 8*S-byte copy back per step

The per-step inputs travel in one int32 buffer (one host-to-device copy), the results in one
(one copy back, the step's only synchronization). Steps of T <= GRAPH_MAX_TOKENS replay a CUDA
graph per T, recorded on first use after one eager run; longer steps (prompt chunks over
GRAPH_MAX_TOKENS) run eagerly. Logits of entries that want them (a sampler, logprobs) are
copied to the host row by row.
"""
from __future__ import annotations

import numpy as np

from engine.errors import GGUFError
from engine.gpu import ops
from engine.gpu.kv_cache import GPUKVCache
from engine.gpu.prefill_graph import GRAPH_MAX_TOKENS, UbatchBuffers

PAD_ROWS = GRAPH_MAX_TOKENS         # cache rows for padding tokens (at most T - 1 of them)
FIT_FRACTION = 0.85                 # of free device memory the cache may take (fit_memory)
FIT_RESERVE = 2 << 30               # bytes left for work buffers, graphs, the allocator
SLOT_ALIGN = 256


def _cp():
    import cupy

    return cupy


def step_tokens(n: int) -> int:
    """T for a step of n tokens: the power of two >= n up to GRAPH_MAX_TOKENS, else n."""
    if n <= GRAPH_MAX_TOKENS:
        return 1 << max(0, (n - 1).bit_length())
    return n


def kv_bytes_per_token(cfg) -> int:
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2       # K and V, f16


def fit_slot_capacity(cfg, n_slots: int, slot_capacity: int, free_bytes: int) -> int:
    """The slot size the cache can take from free_bytes (multiples of SLOT_ALIGN, at most
    slot_capacity); GGUFError when not even SLOT_ALIGN positions per slot fit."""
    per_slot_tok = kv_bytes_per_token(cfg) * n_slots
    budget = int(free_bytes * FIT_FRACTION) - FIT_RESERVE - PAD_ROWS * kv_bytes_per_token(cfg)
    fit = max(0, budget // per_slot_tok)
    if fit >= slot_capacity:
        return slot_capacity
    fit = fit // SLOT_ALIGN * SLOT_ALIGN
    if fit < SLOT_ALIGN:
        raise GGUFError(f"KV cache: {n_slots} slots of even {SLOT_ALIGN} tokens need "
                        f"{n_slots * SLOT_ALIGN * kv_bytes_per_token(cfg) / 2**30:.2f} GiB, "
                        f"{free_bytes / 2**30:.2f} GiB of device memory is free; lower --parallel")
    return fit


class StepBuffers:
    """Everything one step of T tokens touches besides the weights and the cache."""

    def __init__(self, batch: "GPUBatch", T: int):
        cp = _cp()
        from engine.gpu.ops.q8 import Q8Act

        m, cfg = batch.model, batch.model.config
        self.T = T
        self.S = S = min(T, batch.n_slots)
        self.n_tiles = ops.attention.varlen_max_tiles(T, S)
        self.bufs = UbatchBuffers(m, T)
        for a in (self.bufs.x, self.bufs.y, self.bufs.a_d.q, self.bufs.a_d.ds, self.bufs.a_q.q,
                  self.bufs.a_q.ds, self.bufs.a_f.q, self.bufs.a_f.ds):
            a.fill(0)                  # padding rows stay finite
        # inputs: tiles [n_tiles, 4] first (the kernel reads int4: 16-byte aligned), then
        # ids [T], pos [T], rows [T], sel [S]
        nt4 = 4 * self.n_tiles
        self.meta = cp.zeros(nt4 + 3 * T + S, dtype=cp.int32)
        self.tiles = self.meta[:nt4].reshape(self.n_tiles, 4)
        self.ids, self.pos = self.meta[nt4:nt4 + T], self.meta[nt4 + T:nt4 + 2 * T]
        self.rows, self.sel = self.meta[nt4 + 2 * T:nt4 + 3 * T], self.meta[nt4 + 3 * T:]
        d = cfg.d_model
        self.head_x = cp.zeros((S, d), dtype=cp.float32)
        self.head_a = Q8Act(cp.zeros((S, d), dtype=cp.int8), cp.zeros((S, d // 32, 2), dtype=cp.float32))
        self.logits = cp.zeros((S, cfg.vocab_size), dtype=cp.float32)
        self.out = cp.zeros(2 * S, dtype=cp.int32)          # ids [S], then best (float32 bits)
        self.graph = None
        self.tables = None         # the RoPE tables the graph reads (held: the model may replace them)

    def enqueue(self, batch: "GPUBatch") -> None:
        from engine.gpu.ops.mmq import mmq

        m = batch.model
        m.run_layers(self.bufs, self.ids, 0, batch.cache, varlen=(self.pos, self.rows, self.tiles))
        ops.norm.gather_add_rows(self.bufs.x, self.bufs.y, self.sel, self.head_x)
        ops.norm.add_rmsnorm_q8_1(self.head_x, None, m.output_norm, m.config.rms_eps, self.head_a)
        mmq(m.output_w, self.head_a, out=self.logits)
        ops.argmax.argmax_rows(self.logits, self.out[:self.S], self.out[self.S:].view(np.float32))


class GPUBatch:
    device = "gpu"

    def __init__(self, model, n_slots: int, slot_capacity: int, fit_memory: bool = False):
        cp = _cp()
        if n_slots < 1 or slot_capacity < 1:
            raise ValueError(f"batch: {n_slots} slots of {slot_capacity} tokens")
        cfg = model.config
        if fit_memory:
            slot_capacity = fit_slot_capacity(cfg, n_slots, slot_capacity, cp.cuda.runtime.memGetInfo()[0])
        self.model = model
        self.n_slots = int(n_slots)
        self.slot_capacity = int(slot_capacity)
        self.pad_row0 = self.n_slots * self.slot_capacity
        try:
            self.cache = GPUKVCache(cfg, self.pad_row0 + PAD_ROWS)
        except Exception as e:  # noqa: BLE001 - out of device memory: say which flag sizes it
            if type(e).__name__ != "OutOfMemoryError":
                raise
            need = (self.pad_row0 + PAD_ROWS) * kv_bytes_per_token(cfg)
            raise GGUFError(f"KV cache: {n_slots} slots x {slot_capacity} tokens need "
                            f"{need / 2**30:.2f} GiB of device memory, which is not free; lower "
                            f"--kv-cache-tokens or --parallel") from None
        self.tables = model.rope_tables(self.slot_capacity)      # held: graphs read them
        self._steps: dict[int, StepBuffers] = {}
        self.graph_steps = 0
        self.eager_steps = 0

    # ------------------------------------------------------------------ the contract
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n-1 of slot src into slot dst (every layer and KV head)."""
        if n <= 0 or src == dst:
            return
        a, b = src * self.slot_capacity, dst * self.slot_capacity
        for buf in (self.cache.k, self.cache.v):
            buf[:, :, b:b + n] = buf[:, :, a:a + n]

    def run(self, entries) -> list:
        """One forward over the entries (module docstring); per entry None, (id, logit, nan)
        for want == "argmax", or the float32 [vocab] logits (host) for want == "logits"."""
        cp = _cp()
        host, T, wanted = self._plan(entries)
        sb = self._buffers(T)
        sb.meta[...] = cp.asarray(host)          # one host-to-device copy
        if T <= GRAPH_MAX_TOKENS:
            self._replay(sb)
            self.graph_steps += 1
        else:
            sb.enqueue(self)
            self.eager_steps += 1
        res = cp.asnumpy(sb.out)
        best = res[sb.S:].view(np.float32)
        out: list = [None] * len(entries)
        for j, i in enumerate(wanted):
            if entries[i].want == "logits":
                out[i] = cp.asnumpy(sb.logits[j])
            else:
                out[i] = (int(res[j]), float(best[j]), float("nan"))
        return out

    # ------------------------------------------------------------------ internals
    def _plan(self, entries):
        """The step's int32 inputs (StepBuffers.meta layout), T, and the wanted entries."""
        n = sum(len(e.ids) for e in entries)
        if n == 0:
            raise ValueError("batch: a step needs at least one token")
        T = step_tokens(n)
        S = min(T, self.n_slots)
        n_tiles = ops.attention.varlen_max_tiles(T, S)
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        rows = self.pad_row0 + np.arange(T, dtype=np.int32)
        sel = np.zeros(S, np.int32)
        seqs, wanted, r = [], [], 0
        used = set()
        for i, e in enumerate(entries):
            k = len(e.ids)
            if not 0 <= e.slot < self.n_slots or e.slot in used:
                raise ValueError(f"batch: slot {e.slot} is out of range or twice in one step")
            used.add(e.slot)
            a = self.model.file.check_ids(e.ids, e.start, self.slot_capacity)
            base = e.slot * self.slot_capacity
            ids[r:r + k] = a
            pos[r:r + k] = np.arange(e.start, e.start + k)
            rows[r:r + k] = base + pos[r:r + k]
            seqs.append((r, k, e.start, base))
            if e.want is not None:
                sel[len(wanted)] = r + k - 1
                wanted.append(i)
            r += k
        tiles = ops.attention.varlen_tiles(seqs, n_tiles)
        host = np.concatenate([tiles.reshape(-1), ids, pos, rows, sel]).astype(np.int32)
        return host, T, wanted

    def _buffers(self, T: int) -> StepBuffers:
        sb = self._steps.get(T)
        if sb is None:
            if T > GRAPH_MAX_TOKENS:               # eager sizes: keep only the latest
                for t in [t for t in self._steps if t > GRAPH_MAX_TOKENS]:
                    del self._steps[t]
            sb = self._steps[T] = StepBuffers(self, T)
        return sb

    def _replay(self, sb: StepBuffers) -> None:
        cp = _cp()
        if sb.graph is None:
            sb.enqueue(self)                       # loads the kernels, sizes the split workspace
            s = cp.cuda.Stream(non_blocking=True)
            s.wait_event(cp.cuda.get_current_stream().record())
            with s:
                s.begin_capture()
                try:
                    sb.enqueue(self)
                finally:
                    g = s.end_capture()
            g.upload(s)
            s.synchronize()
            sb.graph, sb.tables = g, (self.model._rope_cos, self.model._rope_sin)
            return                                 # the eager run already computed this step
        sb.graph.launch(cp.cuda.get_current_stream())

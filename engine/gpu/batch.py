"""The GPU backend's batched step (the BatchBackend contract of engine/scheduler.py): one
forward over the tokens of several sequences, each in its own slot of ONE shared KV cache.

Cache: GPUKVCache of n_slots * slot_capacity + PAD_ROWS positions; slot s holds its sequence's
position p at row s * slot_capacity + p; the last PAD_ROWS rows take the K/V of padding tokens.

A step of N tokens (entries in order: each entry's ids at positions start..) runs as T tokens,
T = the power of two >= N up to GRAPH_MAX_TOKENS (padding: token 0 at position 0, K/V into the
pad rows, never attended, never read by the head), else T = N:

    tiles [n_tiles, 4]          ops.attention.varlen_plan: tiles of 2+ queries (zero tiles up to
    drows [S, 4]                the fixed grid) and the one-query tiles as decode rows (zero rows)
    ids, pos, rows [T]          per token: id, RoPE position, cache row
    sel [S]                     the batch row of each wanted entry's last token (S = min(T, n_slots))
    GPUModel.run_layers(varlen=(pos, rows, tiles, VarlenDecode(drows)))   every layer
    out = gather(x + y)[sel] -> rmsnorm q8_1 -> output GEMM -> logits [S, vocab]
    argmax_rows(logits) -> ids, best [S]                 one 8*S-byte copy back per step

The per-step inputs travel in one int32 buffer (one host-to-device copy), the results in one
(one copy back). Steps of T <= GRAPH_MAX_TOKENS replay a CUDA graph per T, recorded on first
use after one eager run; longer steps (prompt chunks over GRAPH_MAX_TOKENS) run eagerly. Logits
of entries that want them (a sampler, logprobs) are gathered on the device at launch and copied
to the host row by row at collect.

Overlap (engine/scheduler.py): launch() enqueues a step and returns at once; collect() waits for
its results. Both copies go through pinned host buffers (a ring of IN_FLIGHT), so the host plans
and launches step N+1 while the device still runs step N. A decoder's entry may then say
ids == [FOLLOW]: its token is the one step N chose for its slot, which the host has not seen:

    record_last(out ids, sel_slot) -> last [n_slots]     at the end of every step (graph)
    resolve_follow(ids, last)                           at the start of every step (graph):
                                                        ids[t] = -(slot + 1) reads last[slot]
"""
from __future__ import annotations

import numpy as np

from engine.errors import GGUFError
from engine.gpu import ops
from engine.gpu.kv_cache import GPUKVCache
from engine.gpu.launch import capture_graph
from engine.gpu.prefill_graph import GRAPH_MAX_TOKENS, UbatchBuffers

PAD_ROWS = GRAPH_MAX_TOKENS         # cache rows for padding tokens (at most T - 1 of them)
IN_FLIGHT = 2                       # steps launched and not yet collected, at most
FIT_FRACTION = 0.85                 # of free device memory the cache may take (fit_memory)
FIT_RESERVE = 2 << 30               # bytes left for work buffers, graphs, the allocator
SLOT_ALIGN = 256


def _cp():
    import cupy

    return cupy


def pinned_int32(n: int) -> np.ndarray:
    """A page-locked host int32 buffer of n (the asynchronous copies need one)."""
    mem = _cp().cuda.alloc_pinned_memory(n * 4)
    return np.frombuffer(mem, dtype=np.int32, count=n)


def upload_async(dst, host: np.ndarray, stream) -> None:
    """dst (device, contiguous) <- host (pinned, same bytes), in stream order."""
    dst.data.copy_from_host_async(host.ctypes.data, host.nbytes, stream)


def download_async(src, host: np.ndarray, stream) -> None:
    """host (pinned) <- src (device, contiguous), in stream order."""
    src.get(stream=stream, out=host, blocking=False)


def meta_layout(T: int, S: int) -> list[tuple[str, tuple[int, ...]]]:
    """The step's int32 inputs in their order in one buffer: the int4 arrays first (the kernels
    read them 16-byte aligned), then the per-token and per-wanted-row arrays."""
    return [("tiles", (ops.attention.varlen_max_multi_tiles(T, S), 4)), ("drows", (S, 4)),
            ("ids", (T,)), ("pos", (T,)), ("rows", (T,)), ("sel", (S,)), ("sel_slot", (S,))]


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
        self.bufs = UbatchBuffers(m, T)
        for a in (self.bufs.x, self.bufs.y, self.bufs.a_d.q, self.bufs.a_d.ds, self.bufs.a_q.q,
                  self.bufs.a_q.ds, self.bufs.a_f.q, self.bufs.a_f.ds):
            a.fill(0)                  # padding rows stay finite
        # the inputs (meta_layout): one buffer, one copy in per step; a view per array
        layout = meta_layout(T, S)
        self.meta = cp.zeros(sum(int(np.prod(shape)) for _, shape in layout), dtype=cp.int32)
        views, o = {}, 0
        for name, shape in layout:
            views[name] = self.meta[o:o + int(np.prod(shape))].reshape(shape)
            o += int(np.prod(shape))
        self.tiles, self.ids, self.pos, self.rows = views["tiles"], views["ids"], views["pos"], views["rows"]
        self.sel, self.sel_slot = views["sel"], views["sel_slot"]
        self.decode = ops.attention.VarlenDecode(views["drows"], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
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
        ops.argmax.resolve_follow(self.ids, batch.last_tokens)
        m.run_layers(self.bufs, self.ids, 0, batch.cache, varlen=(self.pos, self.rows, self.tiles, self.decode))
        with m._span("head_norm"):
            ops.norm.gather_add_rows(self.bufs.x, self.bufs.y, self.sel, self.head_x)
            ops.norm.add_rmsnorm_q8_1(self.head_x, None, m.output_norm, m.config.rms_eps, self.head_a)
        with m._span(f"gemm_output_{m.output_w.kind}"):
            mmq(m.output_w, self.head_a, out=self.logits)
        with m._span("argmax"):
            ops.argmax.argmax_rows(self.logits, self.out[:self.S], self.out[self.S:].view(np.float32))
            ops.argmax.record_last(self.out[:self.S], self.sel_slot, batch.last_tokens)


class _Launched:
    """A step launched and not yet collected: its ring slot, buffers, and what to hand back."""
    __slots__ = ("ring", "sb", "wanted", "logits", "n_entries", "collected")

    def __init__(self, ring, sb, wanted, logits, n_entries):
        self.ring, self.sb, self.wanted, self.logits = ring, sb, wanted, logits
        self.n_entries, self.collected = n_entries, False


class _RingSlot:
    """Pinned host buffers and events of one step in flight."""

    def __init__(self, cp):
        self.host_in = self.host_out = None
        self.events = (cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event(disable_timing=True))
        self.busy = False

    def pinned(self, which: str, n: int) -> np.ndarray:
        """This slot's pinned int32 buffer `which` ("host_in" | "host_out") of at least n."""
        a = getattr(self, which)
        if a is None or a.size < n:
            a = pinned_int32(max(n, 1024))
            setattr(self, which, a)
        return a[:n]


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
        self.last_tokens = cp.zeros(self.n_slots, dtype=cp.int32)   # each slot's latest greedy token
        self._ring = [_RingSlot(cp) for _ in range(IN_FLIGHT)]
        self._next_ring = 0
        self.last_device_seconds: float | None = None

    # ------------------------------------------------------------------ the contract
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n-1 of slot src into slot dst (every layer and KV head)."""
        if n <= 0 or src == dst:
            return
        a, b = src * self.slot_capacity, dst * self.slot_capacity
        for buf in (self.cache.k, self.cache.v):
            buf[:, :, b:b + n] = buf[:, :, a:a + n]

    def run(self, entries, timer=None) -> list:
        """One forward over the entries, waited for: collect(launch(entries, timer))."""
        return self.collect(self.launch(entries, timer))

    def launch(self, entries, timer=None) -> _Launched:
        """Enqueue one forward over the entries (module docstring) and return at once.
        timer (an engine.gpu.profiler.OpTimer): run eagerly with every launch timed."""
        cp = _cp()
        ring = self._ring[self._next_ring]
        if ring.busy:
            raise RuntimeError(f"batch: {IN_FLIGHT} steps in flight already; collect one first")
        host, T, wanted = self._plan(entries)
        sb = self._buffers(T)
        stream = cp.cuda.get_current_stream()
        h_in = ring.pinned("host_in", host.size)
        h_in[...] = host
        upload_async(sb.meta, h_in, stream)
        ring.events[0].record(stream)
        if timer is not None:
            self.model.profile(timer)
            try:
                sb.enqueue(self)
            finally:
                self.model.profile(None)
        elif T <= GRAPH_MAX_TOKENS:
            self._replay(sb)
            self.graph_steps += 1
        else:
            sb.enqueue(self)
            self.eager_steps += 1
        ring.events[1].record(stream)
        rows = [j for j, i in enumerate(wanted) if entries[i].want == "logits"]
        logits = sb.logits[np.array(rows, dtype=np.int64)] if rows else None   # a copy, in order
        download_async(sb.out, ring.pinned("host_out", 2 * sb.S), stream)
        ring.events[2].record(stream)
        ring.busy = True
        self._next_ring = (self._next_ring + 1) % IN_FLIGHT
        return _Launched(ring, sb, [(i, entries[i].want) for i in wanted], logits, len(entries))

    def collect(self, h: _Launched) -> list:
        """Wait for a launched step; per entry None, (id, logit, nan) for want == "argmax", or
        the float32 [vocab] logits (host) for want == "logits". last_device_seconds: CUDA
        events around the step's kernels."""
        cp = _cp()
        if h.collected:
            raise RuntimeError("batch: this step was collected already")
        ring = h.ring
        try:
            ring.events[2].synchronize()
            res = ring.host_out[:2 * h.sb.S].copy()
            self.last_device_seconds = cp.cuda.get_elapsed_time(ring.events[0], ring.events[1]) / 1e3
            host_logits = cp.asnumpy(h.logits) if h.logits is not None else None
        finally:
            ring.busy, h.collected = False, True
        best = res[h.sb.S:].view(np.float32)
        out: list = [None] * h.n_entries
        k = 0
        for j, (i, want) in enumerate(h.wanted):
            if want == "logits":
                out[i] = host_logits[k]
                k += 1
            else:
                out[i] = (int(res[j]), float(best[j]), float("nan"))
        return out

    # ------------------------------------------------------------------ internals
    def _plan(self, entries):
        """The step's int32 inputs (meta_layout), T, and the wanted entries."""
        n = sum(len(e.ids) for e in entries)
        if n == 0:
            raise ValueError("batch: a step needs at least one token")
        T = step_tokens(n)
        S = min(T, self.n_slots)
        layout = dict(meta_layout(T, S))
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        rows = self.pad_row0 + np.arange(T, dtype=np.int32)
        sel = np.zeros(S, np.int32)
        sel_slot = np.full(S, -1, np.int32)
        seqs, wanted, r = [], [], 0
        used = set()
        for i, e in enumerate(entries):
            k = len(e.ids)
            if not 0 <= e.slot < self.n_slots or e.slot in used:
                raise ValueError(f"batch: slot {e.slot} is out of range or twice in one step")
            used.add(e.slot)
            if e.follows:                                   # resolve_follow reads last_tokens
                if not 0 <= e.start < self.slot_capacity:
                    raise ValueError(f"batch: position {e.start} is outside the slot ({self.slot_capacity})")
                ids[r] = -(e.slot + 1)
            else:
                ids[r:r + k] = self.model.file.check_ids(e.ids, e.start, self.slot_capacity)
            base = e.slot * self.slot_capacity
            pos[r:r + k] = np.arange(e.start, e.start + k)
            rows[r:r + k] = base + pos[r:r + k]
            seqs.append((r, k, e.start, base))
            if e.want is not None:
                sel[len(wanted)] = r + k - 1
                sel_slot[len(wanted)] = e.slot
                wanted.append(i)
            r += k
        tiles, drows = ops.attention.varlen_plan(seqs, layout["tiles"][0], S)
        arrays = {"tiles": tiles, "drows": drows, "ids": ids, "pos": pos, "rows": rows, "sel": sel,
                  "sel_slot": sel_slot}
        host = np.concatenate([arrays[name].reshape(-1) for name in layout]).astype(np.int32)
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
            sb.graph = capture_graph(s, lambda: sb.enqueue(self))
            sb.tables = (self.model._rope_cos, self.model._rope_sin)
            return                                 # the eager run already computed this step
        sb.graph.launch(cp.cuda.get_current_stream())

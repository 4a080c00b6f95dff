"""The KV cache of the GPU backend: one class for prefill and decode.

K and V are f16 [n_layers, n_kv_heads, capacity, head_dim] on the device; the first `length`
positions are filled. Every kernel that touches the cache is handed per-layer views and
explicit strides (elements), never the whole array, so the layout can change (a slot or a
paged cache for batching) by changing this class and its stride properties:

    k_layer(i), v_layer(i)     the layer's K / V: element (kvh, t, i) of head kvh, position t
                               at kvh * head_stride + t * tok_stride + i
    tok_stride, head_stride    elements between positions / between KV heads
    capacity (= max_tokens)    positions the cache holds
    length                     positions filled (prefill and decode both advance it)

The prefill kernels (engine.gpu.ops) take the layer views [KVH, capacity, hd] as arrays; the
decode step (engine.gpu.decode) takes the views' pointers plus the two strides.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.formats.config import ModelConfig

KV_DTYPE = "f16"          # the only cache element type the GPU model writes


def _cp():
    import cupy

    return cupy


class GPUKVCache:
    """K and V f16 [n_layers, n_kv_heads, capacity, head_dim] (see the module docstring)."""

    dtype = KV_DTYPE

    def __init__(self, cfg: ModelConfig, capacity: int):
        cp = _cp()
        capacity = int(capacity)
        if capacity < 1:
            raise ValueError(f"max_tokens must be >= 1, got {capacity}")
        shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = cp.zeros(shape, dtype=cp.float16)
        self.v = cp.zeros(shape, dtype=cp.float16)
        self.n_layers = cfg.n_layers
        self.capacity = capacity
        self.length = 0
        self.prefill_graphs = OrderedDict()   # T -> engine.gpu.prefill_graph.PrefillGraph over this cache

    @property
    def max_tokens(self) -> int:
        """Same as capacity (the Backend protocol's name)."""
        return self.capacity

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    @property
    def tok_stride(self) -> int:
        """Elements between consecutive positions of one KV head."""
        return int(self.k.shape[3])

    @property
    def head_stride(self) -> int:
        """Elements between consecutive KV heads of one layer."""
        return int(self.k.shape[2] * self.k.shape[3])

    def k_layer(self, i: int):
        return self.k[i]

    def v_layer(self, i: int):
        return self.v[i]

    def reset(self) -> None:
        """Forget the contents (the next token goes to position 0); the buffers stay."""
        self.length = 0

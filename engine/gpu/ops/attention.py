"""Attention launchers.

Prefill (attention_prefill.cu): causal GQA flash attention of a ubatch of queries (f16 [H, n, hd],
rope.cu's output) over the layer's f16 cache, q8_1 or float32 output.

Decode (attention_decode.cu): one query row per head over keys 0..pos (pos read on the device),
split over keys then combined, q8_1 output for the Wo GEMV.
"""
from __future__ import annotations

import numpy as np

from engine.errors import GGUFError
from engine.gpu import kernels, registry
from engine.gpu.ops._util import ptr, contig, null

# prefill
ATT_BQ = 64                 # queries per attention block (attention_prefill.cu AT_BQ)
ATT_THREADS = 128
ATT_HEAD_DIMS = registry.ATT_PREFILL_HEAD_DIMS   # instantiated head sizes
# decode
ATT_TK = 64                 # keys per attention tile (attention_decode.cu)


def _cupy():
    import cupy as cp

    return cp


def attention_smem_bytes(head_dim: int) -> int:
    return 5 * 64 * head_dim * 2


def attention_prefill(qh, kc, vc, start: int, out_act=None, out_f32=None, start_dev=None) -> None:
    """Causal GQA attention of the ubatch queries qh f16 [H, n, hd] (rope.cu's output) over the
    layer's cache kc/vc f16 [KVH, maxT, hd] (keys 0..start+n-1). Output: out_act (Q8Act
    [n, H*hd], the attn_output GEMM's input) or out_f32 (float32 [n, H*hd]); exactly one.
    start_dev (int32 [1] on the device, or None) is added to start in the kernel."""
    H, n, hd = map(int, qh.shape)
    KVH, maxT = int(kc.shape[0]), int(kc.shape[1])
    if hd not in ATT_HEAD_DIMS:
        raise ValueError(f"attention_prefill: head size {hd} not instantiated ({ATT_HEAD_DIMS})")
    if H % KVH:
        raise ValueError(f"attention_prefill: {H} heads over {KVH} KV heads")
    if (out_act is None) == (out_f32 is None):
        raise ValueError("attention_prefill: give exactly one of out_act, out_f32")
    contig(qh, np.float16, (H, n, hd), "attention q")
    contig(kc, np.float16, (KVH, maxT, hd), "attention kc")
    contig(vc, np.float16, (KVH, maxT, hd), "attention vc")
    if start + n > maxT:
        raise ValueError(f"attention_prefill: tokens {start}..{start + n} exceed the cache ({maxT})")
    QD = H * hd
    if out_act is not None:
        contig(out_act.q, np.int8, (n, QD), "attention out q")
        contig(out_act.ds, np.float32, (n, QD // 32, 2), "attention out ds")
        name, o, oq, ods = registry.attn_prefill_name(hd, True), null(), out_act.q, out_act.ds
    else:
        contig(out_f32, np.float32, (n, QD), "attention out")
        name, o, oq, ods = registry.attn_prefill_name(hd, False), out_f32, null(), null()
    if n == 0:
        return
    smem = attention_smem_bytes(hd)
    k = kernels.get_kernel("attention_prefill.cu", name, dynamic_smem=smem)
    k(((n + ATT_BQ - 1) // ATT_BQ, H), (ATT_THREADS,),
      (qh, kc, vc, o, oq, ods, np.int32(n), np.int32(H), np.int32(KVH), ptr(start_dev), np.int32(start),
       np.int32(maxT)), shared_mem=smem)


# ----------------------------------------------------------------------------- decode

def attention_splits(max_tokens: int, n_kv_heads: int, n_sm: int | None = None) -> int:
    """Splits over keys: enough blocks to fill the GPU (about 4 per SM) at the longest context,
    but at least a tile of keys per split."""
    if n_sm is None:
        n_sm = _cupy().cuda.Device().attributes["MultiProcessorCount"]
    return max(1, min(-(-max_tokens // ATT_TK), -(-4 * n_sm // n_kv_heads)))


def attention_launch(q, k_layer, v_layer, tok_stride: int, head_stride: int, pos_dev,
                     n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype: str, n_split: int,
                     part_o, part_ml, oq, ods, out=None) -> None:
    """Decode attention of q [H, hd] (float32) over keys 0..pos (pos read on the device):
    split kernel, then combine kernel; writes q8_1 (oq, ods) and, if given, float32 `out`."""
    group = n_heads // n_kv_heads
    if group not in registry.ATTN_GROUPS or head_dim not in registry.ATTN_HEAD_DIMS:
        raise GGUFError(f"decode attention: {n_heads} heads / {n_kv_heads} KV heads, head size {head_dim} "
                        f"is not compiled (groups {registry.ATTN_GROUPS}, head sizes {registry.ATTN_HEAD_DIMS})")
    scale = np.float32(1.0 / np.sqrt(head_dim))
    o = out if out is not None else null()
    ks = kernels.get_kernel("attention_decode.cu", registry.attn_split_name(head_dim, group, kv_dtype))
    ks((n_split, n_kv_heads), (128,), (q, k_layer, v_layer, np.int64(tok_stride), np.int64(head_stride),
                                       pos_dev, scale, part_o, part_ml))
    kc = kernels.get_kernel("attention_decode.cu", registry.attn_combine_name(head_dim))
    kc((n_heads,), (head_dim,), (part_o, part_ml, np.int32(n_split), o, oq, ods))

"""Decode attention: one query row per head over keys 0..pos, split over keys then combined
(attention_decode.cu), q8_1 output for the Wo GEMV."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.errors import GGUFError
from engine.gpu import decode_instances as DK
from engine.gpu import kernels

ATT_TK = 64               # keys per attention tile (attention_decode.cu)


def _cp():
    import cupy

    return cupy


def _null():
    return np.uint64(0)


def _k(fname: str, name: str):
    return kernels.get_kernel(fname, name)


def attention_splits(max_tokens: int, n_kv_heads: int, n_sm: int | None = None) -> int:
    """Splits over keys: enough blocks to fill the GPU (about 4 per SM) at the longest context,
    but at least a tile of keys per split."""
    if n_sm is None:
        n_sm = _cp().cuda.Device().attributes["MultiProcessorCount"]
    return max(1, min(-(-max_tokens // ATT_TK), -(-4 * n_sm // n_kv_heads)))


def attention_launch(q, k_layer, v_layer, tok_stride: int, head_stride: int, pos_dev,
                     n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype: str, n_split: int,
                     part_o, part_ml, oq, ods, out=None, counters=None) -> None:
    """Decode attention of q [H, hd] (float32) over keys 0..pos (pos read on the device):
    split kernel + combine kernel (or, with `counters` uint32 [KVH] zeroed, the combine fused
    into the split kernel's last block per KV head); writes q8_1 (oq, ods) and, if given,
    float32 `out`."""
    group = n_heads // n_kv_heads
    if group not in DK.ATTN_GROUPS or head_dim not in DK.ATTN_HEAD_DIMS:
        raise GGUFError(f"decode attention: {n_heads} heads / {n_kv_heads} KV heads, head size {head_dim} "
                        f"is not compiled (groups {DK.ATTN_GROUPS}, head sizes {DK.ATTN_HEAD_DIMS})")
    scale = np.float32(1.0 / np.sqrt(head_dim))
    o = out if out is not None else _null()
    ks = _k("attention_decode.cu", DK.attn_split_name(head_dim, group, kv_dtype))
    if counters is not None:
        ks((n_split, n_kv_heads), (128,), (q, k_layer, v_layer, np.int64(tok_stride), np.int64(head_stride),
                                           pos_dev, scale, part_o, part_ml, counters, o, oq, ods))
        return
    ks((n_split, n_kv_heads), (128,), (q, k_layer, v_layer, np.int64(tok_stride), np.int64(head_stride),
                                       pos_dev, scale, part_o, part_ml, _null(), _null(), _null(), _null()))
    kc = _k("attention_decode.cu", DK.attn_combine_name(head_dim))
    kc((n_heads,), (head_dim,), (part_o, part_ml, np.int32(n_split), o, oq, ods))

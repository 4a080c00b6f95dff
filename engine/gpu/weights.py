"""Quantized weight matrices on the GPU.

A `DeviceWeight` is one GGUF matrix [rows = N outputs, cols = K inputs] resident on the device
as rows of whole blocks (uint8 [rows, row_bytes]); the MMQ kernels multiply it as
y[T, N] = x[T, K] . W^T. q4_K rows are the GGUF bytes unchanged (144-byte blocks, 16-byte
aligned). q6_K rows are repacked 210 -> 224 bytes per block at load by default (each block
followed by 14 zero bytes, so every block is 16-byte aligned and the kernel's uint4 arm
opens); `pad_q6k=False` keeps the raw 210-byte rows (the per-byte arm, for parity runs).
The repack runs on the device: raw bytes are uploaded once and copied into the padded
layout there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.formats.qtypes import MATRIX_TYPES, QTYPES, Q4_K, Q6_K, QuantType, qtype

GGML_Q4_K = Q4_K.ggml_id
GGML_Q6_K = Q6_K.ggml_id
_GPU_TYPES = ", ".join(f"{t.name}={t.ggml_id}" for t in MATRIX_TYPES)


@dataclass
class DeviceWeight:
    ggml_type: int          # a ggml id of engine.formats.qtypes.MATRIX_TYPES (Q4_K, Q6_K)
    rows: int               # N (output features)
    cols: int               # K (input features), multiple of 256
    data: object            # cupy.ndarray uint8 [rows, (cols/256) * block_stride]
    padded: bool = False    # padded layout (q6_K: 224-byte blocks)

    @property
    def qtype(self) -> QuantType:
        return QTYPES[self.ggml_type]

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def kind(self) -> str:
        """Kernel family: 'q4_k' or 'q6_k'."""
        return self.qtype.kind

    @property
    def block_stride(self) -> int:
        return self.qtype.device_stride(self.padded)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _matrix_type(ggml_type) -> QuantType:
    try:
        t = qtype(ggml_type)
    except ValueError as e:
        raise ValueError(f"{e} (the GPU kernels handle {_GPU_TYPES})") from None
    if t.kind is None:
        raise ValueError(f"unsupported weight type {t.name} (the GPU kernels handle {_GPU_TYPES})")
    return t


def upload_weight(blocks, ggml_type, pad_q6k: bool = True) -> DeviceWeight:
    """numpy uint8 [rows, row_bytes] (GGUF rows of blocks; a TensorInfo.data memmap works) ->
    DeviceWeight on the current device. `ggml_type`: a ggml id (12 / 14) or name ('Q4_K' / 'Q6_K').
    Types with a padded layout (q6_K) are padded on the device unless pad_q6k=False."""
    import cupy as cp

    t = _matrix_type(ggml_type)
    b = np.asarray(blocks)
    if b.dtype != np.uint8 or b.ndim != 2:
        raise ValueError(f"expected uint8 [rows, row_bytes], got {b.dtype} {b.shape}")
    raw_bs = t.block_bytes
    rows, row_bytes = b.shape
    if row_bytes % raw_bs:
        raise ValueError(f"row of {row_bytes} bytes is not whole {t.name} blocks")
    nb = row_bytes // raw_bs
    raw = cp.asarray(np.ascontiguousarray(b))
    if t.padded_bytes != t.block_bytes and pad_q6k:
        pb = t.padded_bytes
        data = cp.zeros((rows, nb * pb), dtype=cp.uint8)
        data.reshape(rows * nb, pb)[:, :raw_bs] = raw.reshape(rows * nb, raw_bs)
        del raw
        return DeviceWeight(t.ggml_id, rows, nb * t.block_elems, data, padded=True)
    return DeviceWeight(t.ggml_id, rows, nb * t.block_elems, raw, padded=False)


def upload_tensor(info, pad_q6k: bool = True) -> DeviceWeight:
    """engine.formats.gguf_file.TensorInfo (a Q4_K / Q6_K matrix) -> DeviceWeight."""
    return upload_weight(info.data, info.ggml_type, pad_q6k=pad_q6k)


def role_views(segs, rows: dict[str, int]) -> dict:
    """role -> DeviceWeight over that role's rows of its fused group (views, no copies); segs:
    the groups, each with .w (the fused DeviceWeight) and .roles (its roles in row order)."""
    out = {}
    for s in segs:
        r0 = 0
        for r in s.roles:
            n = rows[r]
            out[r] = DeviceWeight(s.w.ggml_type, n, s.w.cols, s.w.data[r0:r0 + n], s.w.padded)
            r0 += n
    return out

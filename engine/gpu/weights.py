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

from engine.formats.quants import Q4_K_BYTES, Q6_K_BYTES, Q6_K_PADDED_BYTES, QK_K

GGML_Q4_K = 12
GGML_Q6_K = 14
_TYPE_IDS = {"Q4_K": GGML_Q4_K, "Q6_K": GGML_Q6_K}
_TYPE_NAMES = {v: k for k, v in _TYPE_IDS.items()}


@dataclass
class DeviceWeight:
    ggml_type: int          # GGML_Q4_K or GGML_Q6_K
    rows: int               # N (output features)
    cols: int               # K (input features), multiple of 256
    data: object            # cupy.ndarray uint8 [rows, (cols/256) * block_stride]
    padded: bool = False    # q6_K only: 224-byte blocks

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES[self.ggml_type]

    @property
    def kind(self) -> str:
        """Kernel family: 'q4_k' or 'q6_k'."""
        return self.type_name.lower()

    @property
    def block_stride(self) -> int:
        if self.ggml_type == GGML_Q4_K:
            return Q4_K_BYTES
        return Q6_K_PADDED_BYTES if self.padded else Q6_K_BYTES

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _type_id(ggml_type) -> int:
    if isinstance(ggml_type, str):
        key = ggml_type.upper()
        if key not in _TYPE_IDS:
            raise ValueError(f"unsupported weight type {ggml_type!r} (MMQ handles Q4_K, Q6_K)")
        return _TYPE_IDS[key]
    t = int(ggml_type)
    if t not in _TYPE_NAMES:
        raise ValueError(f"unsupported ggml type id {t} (MMQ handles Q4_K=12, Q6_K=14)")
    return t


def upload_weight(blocks, ggml_type, pad_q6k: bool = True) -> DeviceWeight:
    """numpy uint8 [rows, row_bytes] (GGUF rows of blocks; a TensorInfo.data memmap works) ->
    DeviceWeight on the current device. `ggml_type`: 12 / 14 or 'Q4_K' / 'Q6_K'."""
    import cupy as cp

    t = _type_id(ggml_type)
    b = np.asarray(blocks)
    if b.dtype != np.uint8 or b.ndim != 2:
        raise ValueError(f"expected uint8 [rows, row_bytes], got {b.dtype} {b.shape}")
    raw_bs = Q4_K_BYTES if t == GGML_Q4_K else Q6_K_BYTES
    rows, row_bytes = b.shape
    if row_bytes % raw_bs:
        raise ValueError(f"row of {row_bytes} bytes is not whole {_TYPE_NAMES[t]} blocks")
    nb = row_bytes // raw_bs
    raw = cp.asarray(np.ascontiguousarray(b))
    if t == GGML_Q6_K and pad_q6k:
        data = cp.zeros((rows, nb * Q6_K_PADDED_BYTES), dtype=cp.uint8)
        data.reshape(rows * nb, Q6_K_PADDED_BYTES)[:, :Q6_K_BYTES] = raw.reshape(rows * nb, Q6_K_BYTES)
        del raw
        return DeviceWeight(t, rows, nb * QK_K, data, padded=True)
    return DeviceWeight(t, rows, nb * QK_K, raw, padded=False)


def upload_tensor(info, pad_q6k: bool = True) -> DeviceWeight:
    """engine.formats.gguf_file.TensorInfo (a Q4_K / Q6_K matrix) -> DeviceWeight."""
    return upload_weight(info.data, info.ggml_type, pad_q6k=pad_q6k)

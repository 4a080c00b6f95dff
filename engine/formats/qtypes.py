"""One table of the ggml tensor types this engine reads: id, name, block geometry, the padded
device stride, the numpy dequantizer and the GPU kernel family.

Everything that asks "what is this type" asks here (the GGUF validator, the CPU dequantizer,
the GPU upload and the kernel dispatch), so adding a type is one row.

    QTYPES[id].block_elems / .block_bytes      bytes of a row = cols / block_elems * block_bytes
    .device_stride(padded)                     bytes per block on the GPU (q6_K 210 -> 224 padded)
    .dequantize(rows uint8 [n, row_bytes])     -> float32 [n, cols]
    .kind                                      kernel family ("q4_k", "q6_k") or None for F32/F16
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.formats import quants


@dataclass(frozen=True)
class QuantType:
    ggml_id: int
    name: str                 # GGUF / ggml spelling: "Q4_K"
    block_elems: int          # weights per block
    block_bytes: int          # bytes per block in the file
    padded_bytes: int         # bytes per block in the GPU's padded layout (== block_bytes: none)
    dequantize: Callable[[np.ndarray], np.ndarray]
    kind: str | None          # GPU GEMM / GEMV kernel family; None: not a quantized matrix type

    def device_stride(self, padded: bool) -> int:
        return self.padded_bytes if padded else self.block_bytes

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_elems * self.block_bytes


def _f32(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows).view(np.float32).astype(np.float32, copy=False)


def _f16(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows).view(np.float16).astype(np.float32)


F32 = QuantType(0, "F32", 1, 4, 4, _f32, None)
F16 = QuantType(1, "F16", 1, 2, 2, _f16, None)
Q4_K = QuantType(12, "Q4_K", quants.QK_K, quants.Q4_K_BYTES, quants.Q4_K_BYTES, quants.dequantize_q4_k, "q4_k")
Q6_K = QuantType(14, "Q6_K", quants.QK_K, quants.Q6_K_BYTES, quants.Q6_K_PADDED_BYTES, quants.dequantize_q6_k,
                 "q6_k")

QTYPES: dict[int, QuantType] = {t.ggml_id: t for t in (F32, F16, Q4_K, Q6_K)}
BY_NAME: dict[str, QuantType] = {t.name: t for t in QTYPES.values()}
MATRIX_TYPES = tuple(t for t in QTYPES.values() if t.kind)      # what the GPU GEMMs multiply

# Known to ggml but not read here: named in the error for them.
KNOWN_UNSUPPORTED: dict[int, str] = {
    2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    13: "Q5_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
    21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


def qtype(key: int | str) -> QuantType:
    """The QuantType of a ggml id or a type name ("Q6_K", case-insensitive); ValueError naming
    the type otherwise."""
    if isinstance(key, str):
        t = BY_NAME.get(key.upper())
        if t is None:
            raise ValueError(f"unsupported tensor type {key!r} (supported: {', '.join(BY_NAME)})")
        return t
    t = QTYPES.get(int(key))
    if t is None:
        name = KNOWN_UNSUPPORTED.get(int(key), "unknown")
        raise ValueError(f"unsupported ggml type {int(key)} ({name}; supported: {', '.join(BY_NAME)})")
    return t

"""Token embedding rows (embed.cu): x[t] = dequant(table)[ids[t]], q4_K or q6_K (raw / padded)."""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import contig


def embed(table, ids, x) -> None:
    """x[t] = dequant(table)[ids[t]]: table a DeviceWeight (q4_K, or q6_K raw/padded) [V, K];
    ids int32 [n] on the device (checked on the host beforehand); x float32 [n, K]."""
    n = int(ids.shape[0])
    K = table.cols
    contig(x, np.float32, (n, K), "embed x")
    if n == 0:
        return
    if table.kind not in ("q4_k", "q6_k"):  # pragma: no cover - DeviceWeight holds only these
        raise ValueError(f"embed: unsupported table type {table.type_name}")
    k = kernels.get_kernel("embed.cu", f"embed_{table.kind}")
    args = (table.data, ids, x, np.int32(K))
    if table.qtype.padded_bytes != table.qtype.block_bytes:    # two layouts (q6_K): the kernel takes the stride
        args += (np.int32(table.block_stride),)
    k((K // 256, n), (256,), args)

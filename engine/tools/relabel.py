"""Relabel a GGUF's architecture (e.g. qwen2 -> llama) without touching its tensors.

`general.architecture` is set to the new name and every `<old>.*` metadata key is renamed
`<new>.*`; the tensor-info table and the tensor bytes are copied unchanged. This is how the
goldens' "qwen-as-llama" model is made: the same weights run through llama's normal RoPE.
"""
from __future__ import annotations

import os
import shutil
import struct

from engine.formats.gguf_file import _Cursor, _open_mapped, _read_value, _scan_container


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def relabel_architecture(src: str | os.PathLike, dst: str | os.PathLike, new_arch: str = "llama") -> None:
    src, dst = os.fspath(src), os.fspath(dst)
    buf = _open_mapped(src)
    try:
        version, metadata, _, data_start = _scan_container(buf, src)
        old_arch = metadata["general.architecture"]
        alignment = metadata.get("general.alignment", 32)
        cur = _Cursor(buf, src)
        cur.pos = 8
        n_tensors, n_kv = cur.unpack("Q", "tensor_count"), cur.unpack("Q", "kv_count")
        out = bytearray(buf[0:24])
        for _ in range(n_kv):
            key = cur.string("key").decode("utf-8")
            vstart = cur.pos
            vtype = cur.unpack("I", "type")
            _read_value(cur, vtype, key)
            value = bytes(buf[vstart:cur.pos])
            if key == "general.architecture":
                value = struct.pack("<I", 8) + _string(new_arch)
            elif key.startswith(old_arch + "."):
                key = new_arch + key[len(old_arch):]
            out += _string(key) + value
        # The tensor-info table follows the metadata unchanged (offsets are data-relative).
        info_start = cur.pos
        info_end = info_start
        for _ in range(n_tensors):
            cur.skip_string("tensor name")
            n_dims = cur.unpack("I", "n_dims")
            cur.pos += 8 * n_dims + 4 + 8
            info_end = cur.pos
        out += buf[info_start:info_end]
        out += b"\0" * ((-len(out)) % alignment)
        with open(dst + ".tmp", "wb") as f:
            f.write(out)
            with open(src, "rb") as s:
                s.seek(data_start)
                shutil.copyfileobj(s, f, 16 << 20)
        os.replace(dst + ".tmp", dst)
    finally:
        buf.close()

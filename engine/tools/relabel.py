"""Relabel a GGUF's architecture (e.g. qwen2 -> llama) without touching its tensors.

`general.architecture` is set to the new name and every `<old>.*` metadata key is renamed
`<new>.*`; the tensor-info table and the tensor bytes are copied unchanged. This is how the
goldens' "qwen-as-llama" model is made: the same weights run through llama's normal RoPE.
"""
from __future__ import annotations

import os
import shutil

from engine.errors import GGUFError, UsageError, printable
from engine.formats.gguf_file import encode_field, encode_string, read_header
from engine.formats.metadata import Metadata


def relabel_architecture(src: str | os.PathLike, dst: str | os.PathLike, new_arch: str = "llama") -> None:
    src, dst = os.fspath(src), os.fspath(dst)
    if not new_arch or not new_arch.isprintable() or "." in new_arch:
        raise UsageError(f"--arch: {printable(new_arch)} is not an architecture name")
    header = read_header(src)
    old_arch = Metadata(header.metadata, src).string("general.architecture")
    with open(src, "rb") as f:
        raw = f.read(header.data_start)
    out = bytearray(raw[0:24])
    keys: set[str] = set()
    for e in header.fields:
        key, value = e.key, raw[e.value_start:e.end]
        if key == "general.architecture":
            out += encode_field(key, 8, new_arch)
            keys.add(key)
            continue
        if key.startswith(old_arch + "."):
            key = new_arch + key[len(old_arch):]
        if key in keys:
            raise UsageError(f"{src}: relabelled key '{printable(key)}' would appear twice")
        keys.add(key)
        out += encode_string(key) + value
    # The tensor-info table follows the metadata unchanged (offsets are data-relative).
    out += raw[header.kv_end:header.info_end]
    out += b"\0" * ((-len(out)) % header.alignment)
    tmp = dst + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(out)
            with open(src, "rb") as s:
                s.seek(header.data_start)
                shutil.copyfileobj(s, f, 16 << 20)
        os.replace(tmp, dst)
    except OSError as e:
        raise GGUFError(f"{dst}: cannot write: {e.strerror or e}") from None

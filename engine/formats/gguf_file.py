"""Open and validate a GGUF file.

Validation happens in two passes, both before any tensor data is touched:

1. `_scan_container` walks the raw header, metadata and tensor-info table with explicit bounds
   checks (every count and length is checked against the bytes that remain), so a corrupt file can
   neither make us allocate memory sized by an unchecked field nor loop for billions of steps.
2. `gguf.GGUFReader` (memory-mapped) then parses the same file; anything it raises is wrapped.

Every problem raises `GGUFError` whose message names the file and the field or tensor.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import GGUFError
from engine.formats.qtypes import KNOWN_UNSUPPORTED, QTYPES

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 40  # far above any 7B-class tensor, far below overflow

# GGUF metadata value types: id -> (name, fixed size or None)
_VALUE_TYPES = {
    0: ("uint8", 1), 1: ("int8", 1), 2: ("uint16", 2), 3: ("int16", 2), 4: ("uint32", 4),
    5: ("int32", 4), 6: ("float32", 4), 7: ("bool", 1), 8: ("string", None), 9: ("array", None),
    10: ("uint64", 8), 11: ("int64", 8), 12: ("float64", 8),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. `shape` is in numpy order (rows, cols): the reverse of ggml's ne."""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray  # uint8 memmap view [rows, row_bytes] for quantized, typed view otherwise

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata field '{key}'")
        return self.metadata[key]


class _Cursor:
    """Bounds-checked little-endian reader over the mapped file."""

    def __init__(self, buf, path: str):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"{self.path}: truncated file: {what} needs {n} bytes at offset {self.pos}, "
                f"file has {self.size}")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return vals[0] if len(vals) == 1 else vals

    def string(self, what: str) -> bytes:
        n = self.unpack("Q", what + " length")
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def skip_string(self, what: str) -> None:
        n = self.unpack("Q", what + " length")
        self.need(n, what)
        self.pos += n


_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                10: "<u8", 11: "<i8", 12: "<f8"}


def _read_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    """Read one metadata value with bounds checks: scalars as Python values, strings as str,
    string arrays as lists, numeric arrays as numpy arrays."""
    if vtype not in _VALUE_TYPES:
        raise GGUFError(f"{cur.path}: metadata field '{what}' has unknown value type {vtype}")
    name, size = _VALUE_TYPES[vtype]
    if size is not None:
        cur.need(size, f"metadata field '{what}'")
        value = np.frombuffer(cur.buf, dtype=_NUMPY_TYPES[vtype], count=1, offset=cur.pos)[0]
        cur.pos += size
        return bool(value) if name == "bool" else value.item()
    if name == "string":
        return cur.string(f"metadata field '{what}'").decode("utf-8", errors="replace")
    if depth > 2:
        raise GGUFError(f"{cur.path}: metadata field '{what}' nests arrays too deeply")
    etype = cur.unpack("I", f"metadata field '{what}' array type")
    count = cur.unpack("Q", f"metadata field '{what}' array count")
    if etype not in _VALUE_TYPES:
        raise GGUFError(f"{cur.path}: metadata field '{what}' has unknown array type {etype}")
    esize = _VALUE_TYPES[etype][1]
    min_size = esize if esize is not None else 8  # strings/arrays take at least 8 bytes each
    if count * min_size > cur.size - cur.pos:
        raise GGUFError(
            f"{cur.path}: metadata field '{what}' claims {count} elements, more than the "
            f"{cur.size - cur.pos} bytes left in the file")
    if esize is not None:
        arr = np.frombuffer(cur.buf, dtype=_NUMPY_TYPES[etype], count=count, offset=cur.pos).copy()
        cur.pos += count * esize
        return arr.astype(bool) if etype == 7 else arr
    if etype == 8:
        buf, pos, end = cur.buf, cur.pos, cur.size
        out = []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"{cur.path}: truncated file inside metadata field '{what}'")
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > end:
                raise GGUFError(f"{cur.path}: truncated file inside metadata field '{what}'")
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        cur.pos = pos
        return out
    return [_read_value(cur, etype, what, depth + 1) for _ in range(count)]


def _scan_container(buf, path: str):
    """Validate the container structure and read the metadata.

    Returns (version, metadata dict, tensor infos [(name, ggml dims, type id, offset)], data start).
    """
    cur = _Cursor(buf, path)
    cur.need(4, "magic")
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: bad magic {magic!r}: not a GGUF file")
    cur.pos = 4
    version = cur.unpack("I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.unpack("Q", "tensor_count")
    n_kv = cur.unpack("Q", "kv_count")
    remaining = cur.size - cur.pos
    if n_kv * 13 > remaining:  # a key-value pair takes at least 8 + 1 + 4 bytes
        raise GGUFError(f"{path}: field kv_count = {n_kv} is impossible for a file of {cur.size} bytes")
    if n_tensors * 24 > remaining:  # a tensor info takes at least 8 + 4 + 4 + 8 bytes
        raise GGUFError(
            f"{path}: field tensor_count = {n_tensors} is impossible for a file of {cur.size} bytes")

    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key_bytes = cur.string(f"metadata key #{i}")
        try:
            key = key_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{path}: metadata key #{i} is not valid UTF-8") from None
        vtype = cur.unpack("I", f"metadata field '{key}' type")
        value = _read_value(cur, vtype, key)
        metadata[key] = value
        if key == "general.alignment":
            if vtype != 4 or not value or value & (value - 1) or value > 1 << 16:
                raise GGUFError(f"{path}: metadata field 'general.alignment' = {value} is not a power of two")
            alignment = value

    tensors = []
    seen = set()
    for i in range(n_tensors):
        raw_name = cur.string(f"tensor #{i} name")
        name = raw_name.decode("utf-8", errors="replace")
        if name in seen:
            raise GGUFError(f"{path}: tensor '{name}' appears twice")
        seen.add(name)
        n_dims = cur.unpack("I", f"tensor '{name}' n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor '{name}' has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        dims = [cur.unpack("Q", f"tensor '{name}' dims") for _ in range(n_dims)]
        ttype = cur.unpack("I", f"tensor '{name}' type")
        offset = cur.unpack("Q", f"tensor '{name}' offset")
        tensors.append((name, dims, ttype, offset))

    data_start = (cur.pos + alignment - 1) // alignment * alignment
    data_size = cur.size - data_start
    for name, dims, ttype, offset in tensors:
        if ttype not in QTYPES:
            known = KNOWN_UNSUPPORTED.get(ttype)
            what = f"type {known} (id {ttype}) is not supported" if known else f"unknown type id {ttype}"
            raise GGUFError(f"{path}: tensor '{name}': {what}; supported: F32, F16, Q4_K, Q6_K")
        qt = QTYPES[ttype]
        tname, block, block_bytes = qt.name, qt.block_elems, qt.block_bytes
        n_elem = 1
        for d in dims:
            if d == 0 or d > MAX_ELEMENTS:
                raise GGUFError(f"{path}: tensor '{name}' has dimension {d}")
            n_elem *= d
            if n_elem > MAX_ELEMENTS:
                raise GGUFError(f"{path}: tensor '{name}' has {n_elem}+ elements, over the limit")
        if dims[0] % block:
            raise GGUFError(
                f"{path}: tensor '{name}' ({tname}) row length {dims[0]} is not a multiple of {block}")
        n_bytes = n_elem // block * block_bytes
        if offset % alignment:
            raise GGUFError(f"{path}: tensor '{name}' offset {offset} is not aligned to {alignment}")
        if offset + n_bytes > data_size:
            raise GGUFError(
                f"{path}: tensor '{name}' data ({n_bytes} bytes at offset {offset}) runs past the "
                f"end of the file (data section holds {max(data_size, 0)} bytes)")
    return version, metadata, tensors, data_start


def _open_mapped(path: str):
    try:
        size = os.path.getsize(path)
        if size == 0:
            raise GGUFError(f"{path}: empty file: not a GGUF file")
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except GGUFError:
        raise
    except OSError as e:
        raise GGUFError(f"{path}: cannot open: {e.strerror or e}") from None


def _scan_file(path: str):
    buf = _open_mapped(path)
    try:
        return _scan_container(buf, path)
    finally:
        buf.close()


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Validated metadata only, without mapping tensors (vocabulary-only files work)."""
    return _scan_file(os.fspath(path))[1]


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Validate the whole container, then map the tensors through gguf.GGUFReader."""
    path = os.fspath(path)
    version, metadata, scanned, _ = _scan_file(path)
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader's own checks: wrap, naming the file
        raise GGUFError(f"{path}: GGUF reader failed: {type(e).__name__}: {e}") from None

    tensors: dict[str, TensorInfo] = {}
    expected = {name: (dims, ttype) for name, dims, ttype, _ in scanned}
    for t in reader.tensors:
        dims, ttype = expected[t.name]
        qt = QTYPES[ttype]
        tname, block, block_bytes = qt.name, qt.block_elems, qt.block_bytes
        shape = tuple(int(d) for d in reversed(dims))
        n_bytes = int(np.prod(dims)) // block * block_bytes
        if int(t.n_bytes) != n_bytes or t.data.nbytes != n_bytes:
            raise GGUFError(f"{path}: tensor '{t.name}' byte size {t.n_bytes} disagrees with its "
                            f"shape {list(shape)} and type {tname} ({n_bytes} bytes)")
        tensors[t.name] = TensorInfo(t.name, ttype, tname, shape, n_bytes, t.data)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)

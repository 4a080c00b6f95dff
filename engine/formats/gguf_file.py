"""Open and validate a GGUF file.

Validation happens in two passes, both before any tensor data is touched:

1. `_scan_container` walks the raw header, metadata and tensor-info table with explicit bounds
   checks (every count and length is checked against the bytes that remain), so a corrupt file can
   neither make us allocate memory sized by an unchecked field nor loop for billions of steps.
2. `gguf.GGUFReader` (memory-mapped) then parses the same file; anything it raises is wrapped.

Every problem raises `GGUFError` whose message names the file and the field or tensor; every
file-supplied name or value in a message goes through `engine.errors.printable`.

Public API:
    open_gguf(path) -> GGUFFile            validated container, tensors mapped
    read_metadata(path) -> dict            validated metadata only (vocabulary-only files work)
    read_header(path) -> GGUFHeader        the validated header with the byte span of every
                                           metadata entry and tensor info (tools that rewrite a
                                           file's header: relabel, the fuzzer)
    encode_string(s), encode_field(key, vtype, value)   GGUF serialisation of one entry
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import GGUFError, printable
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
            raise GGUFError(f"{self.path}: missing metadata field '{printable(key)}'")
        return self.metadata[key]


@dataclass(frozen=True)
class FieldEntry:
    """One metadata entry of the header: file bytes [start, end) hold the key string, the
    value type and the value; [value_start, end) is the type and the value."""

    key: str
    vtype: int
    value: Any
    start: int
    value_start: int
    end: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor-info record: name, ggml dims (ne order), type id, data-relative offset and
    its byte span [start, end) in the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    start: int
    end: int


@dataclass(frozen=True)
class GGUFHeader:
    """The validated header of a GGUF file (nothing mapped)."""

    path: str
    version: int
    fields: list[FieldEntry]
    tensors: list[TensorEntry]
    alignment: int
    data_start: int        # first byte of the (aligned) tensor data section

    @property
    def metadata(self) -> dict[str, Any]:
        return {f.key: f.value for f in self.fields}

    @property
    def kv_end(self) -> int:
        """End of the metadata section = start of the tensor-info table."""
        return self.fields[-1].end if self.fields else 24

    @property
    def info_end(self) -> int:
        return self.tensors[-1].end if self.tensors else self.kv_end


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
    string arrays as lists, numeric arrays as numpy arrays. `what` is the key, already made
    printable by the caller."""
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


def _scan_container(buf, path: str) -> GGUFHeader:
    """Validate the container structure and read the metadata and the tensor-info table."""
    cur = _Cursor(buf, path)
    cur.need(4, "magic")
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: bad magic {printable(magic)}: not a GGUF file")
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
    fields: list[FieldEntry] = []
    seen_keys: set[str] = set()
    for i in range(n_kv):
        start = cur.pos
        key_bytes = cur.string(f"metadata key #{i}")
        try:
            key = key_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{path}: metadata key #{i} ({printable(key_bytes)}) is not valid UTF-8") from None
        shown = printable(key)
        if key in seen_keys:
            raise GGUFError(f"{path}: metadata field '{shown}' appears twice")
        seen_keys.add(key)
        value_start = cur.pos
        vtype = cur.unpack("I", f"metadata field '{shown}' type")
        value = _read_value(cur, vtype, shown)
        fields.append(FieldEntry(key, vtype, value, start, value_start, cur.pos))
        if key == "general.alignment":
            if vtype != 4 or not value or value & (value - 1) or value > 1 << 16:
                raise GGUFError(f"{path}: metadata field 'general.alignment' = "
                                f"{printable(value)} is not a power of two (uint32)")
            alignment = value

    infos = []
    seen = set()
    for i in range(n_tensors):
        start = cur.pos
        raw_name = cur.string(f"tensor #{i} name")
        name = raw_name.decode("utf-8", errors="replace")
        shown = printable(name)
        if name in seen:
            raise GGUFError(f"{path}: tensor '{shown}' appears twice")
        seen.add(name)
        n_dims = cur.unpack("I", f"tensor '{shown}' n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor '{shown}' has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        dims = tuple(cur.unpack("Q", f"tensor '{shown}' dims") for _ in range(n_dims))
        ttype = cur.unpack("I", f"tensor '{shown}' type")
        offset = cur.unpack("Q", f"tensor '{shown}' offset")
        infos.append(TensorEntry(name, dims, ttype, offset, start, cur.pos))

    data_start = (cur.pos + alignment - 1) // alignment * alignment
    data_size = cur.size - data_start
    for t in infos:
        shown, dims, ttype, offset = printable(t.name), t.dims, t.ggml_type, t.offset
        if ttype not in QTYPES:
            known = KNOWN_UNSUPPORTED.get(ttype)
            what = f"type {known} (id {ttype}) is not supported" if known else f"unknown type id {ttype}"
            raise GGUFError(f"{path}: tensor '{shown}': {what}; supported: F32, F16, Q4_K, Q6_K")
        qt = QTYPES[ttype]
        tname, block, block_bytes = qt.name, qt.block_elems, qt.block_bytes
        n_elem = 1
        for d in dims:
            if d == 0 or d > MAX_ELEMENTS:
                raise GGUFError(f"{path}: tensor '{shown}' has dimension {d}")
            n_elem *= d
            if n_elem > MAX_ELEMENTS:
                raise GGUFError(f"{path}: tensor '{shown}' has {n_elem}+ elements, over the limit")
        if dims[0] % block:
            raise GGUFError(
                f"{path}: tensor '{shown}' ({tname}) row length {dims[0]} is not a multiple of {block}")
        n_bytes = n_elem // block * block_bytes
        if offset % alignment:
            raise GGUFError(f"{path}: tensor '{shown}' offset {offset} is not aligned to {alignment}")
        if offset + n_bytes > data_size:
            raise GGUFError(
                f"{path}: tensor '{shown}' data ({n_bytes} bytes at offset {offset}) runs past the "
                f"end of the file (data section holds {max(data_size, 0)} bytes)")
    return GGUFHeader(path, version, fields, infos, alignment, data_start)


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


def _scan_file(path: str) -> GGUFHeader:
    buf = _open_mapped(path)
    try:
        return _scan_container(buf, path)
    finally:
        buf.close()


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The validated header: metadata entries and tensor infos with their byte spans."""
    return _scan_file(os.fspath(path))


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Validated metadata only, without mapping tensors (vocabulary-only files work)."""
    return _scan_file(os.fspath(path)).metadata


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Validate the whole container, then map the tensors through gguf.GGUFReader."""
    path = os.fspath(path)
    header = _scan_file(path)
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader's own checks: wrap, naming the file
        raise GGUFError(f"{path}: GGUF reader failed: {type(e).__name__}: {printable(str(e))}") from None

    tensors: dict[str, TensorInfo] = {}
    expected = {t.name: (t.dims, t.ggml_type) for t in header.tensors}
    for t in reader.tensors:
        if t.name not in expected or t.name in tensors:
            raise GGUFError(f"{path}: tensor '{printable(t.name)}' is read differently by the GGUF reader")
        dims, ttype = expected[t.name]
        qt = QTYPES[ttype]
        tname, block, block_bytes = qt.name, qt.block_elems, qt.block_bytes
        shape = tuple(int(d) for d in reversed(dims))
        n_bytes = int(np.prod(dims)) // block * block_bytes
        if int(t.n_bytes) != n_bytes or t.data.nbytes != n_bytes:
            raise GGUFError(f"{path}: tensor '{printable(t.name)}' byte size {t.n_bytes} disagrees with its "
                            f"shape {list(shape)} and type {tname} ({n_bytes} bytes)")
        tensors[t.name] = TensorInfo(t.name, ttype, tname, shape, n_bytes, t.data)
    if len(tensors) != len(expected):
        raise GGUFError(f"{path}: the GGUF reader found {len(tensors)} tensors, the header lists {len(expected)}")
    return GGUFFile(path=path, version=header.version, metadata=header.metadata, tensors=tensors)


# ----------------------------------------------------------------------------- writing

VALUE_TYPE_IDS = {name: vid for vid, (name, _) in _VALUE_TYPES.items()}
_STRUCT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def encode_string(s: str | bytes) -> bytes:
    """A GGUF string: uint64 length + the bytes (str encoded as UTF-8)."""
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def encode_value(vtype: int, value: Any, etype: int | None = None) -> bytes:
    """The bytes of one metadata value of type `vtype` (without the type id). Arrays take the
    element type `etype` (default: strings for lists of str, else the numpy dtype's type)."""
    if vtype == 8:
        return encode_string(value)
    if vtype == 9:
        items = list(value.tolist() if isinstance(value, np.ndarray) else value)
        if etype is None:
            if isinstance(value, np.ndarray):
                etype = {v: k for k, v in _NUMPY_TYPES.items() if k != 7}.get(value.dtype.str, 11)
                if value.dtype == bool:
                    etype = 7
            else:
                etype = 8 if all(isinstance(x, str) for x in items) else 11
        out = struct.pack("<IQ", etype, len(items))
        return out + b"".join(encode_value(etype, x) for x in items)
    return struct.pack("<" + _STRUCT[vtype], value)


def encode_field(key: str | bytes, vtype: int, value: Any, etype: int | None = None) -> bytes:
    """One metadata entry: key string, uint32 value type, value."""
    return encode_string(key) + struct.pack("<I", vtype) + encode_value(vtype, value, etype)

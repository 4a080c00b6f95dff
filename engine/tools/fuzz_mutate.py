"""The fuzzer's mutator (engine.tools.fuzz runs it): seeded corruptions of the synthetic models.

    make_case(make_bases(dir), seed, index) -> Case(data=<the mutated file>, commands=[argv...])

(seed, index) fixes everything. Byte mutations (flips, truncation, inflated counts and lengths)
edit the encoded file; structured ones edit a `Doc` (the header as entries, re-encoded with
engine.formats.gguf_file.encode_field): wrong value types, NaN/inf, arrays for scalars and
scalars for arrays, odd array entries, missing/duplicate/odd keys, tensor-info changes, broken
chat templates.
"""
from __future__ import annotations

import os
import random
import struct
from dataclasses import dataclass

BASE_SHAPES = ("tiny", "tiny-qwen2")
PROMPTS = ("hello world", "<|im_start|>user\nhi<|im_end|>", "ünïcödé \U0001f642\t\n x", " ", "the " * 40)
MESSAGES = '[{"role": "user", "content": "hi"}]'

# ----------------------------------------------------------------------------- the base files


@dataclass
class Base:
    name: str
    raw: bytes
    header: object           # engine.formats.gguf_file.GGUFHeader


def make_bases(directory: str) -> list[Base]:
    from engine.formats.gguf_file import read_header
    from engine.tools.synth import write_synthetic

    bases = []
    for shape in BASE_SHAPES:
        path = os.path.join(directory, f"base-{shape}.gguf")
        if not os.path.exists(path):
            write_synthetic(path + ".tmp", shape)
            os.replace(path + ".tmp", path)
        with open(path, "rb") as f:
            raw = f.read()
        bases.append(Base(shape, raw, read_header(path)))
    return bases


# ----------------------------------------------------------------------------- a mutable header

class Doc:
    """A base file as a list of (key, vtype, value, etype) entries + tensor infos + data, which
    structured mutations edit and `encode()` serialises again (data offsets are data-relative)."""

    def __init__(self, base: Base):
        h = base.header
        self.version = h.version
        self.fields = [[f.key, f.vtype, f.value, None] for f in h.fields]
        for f, e in zip(self.fields, h.fields):
            if e.vtype == 9:  # keep the element type
                f[3] = struct.unpack_from("<I", base.raw, e.value_start + 4)[0]
        self.tensors = [[t.name, list(t.dims), t.ggml_type, t.offset] for t in h.tensors]
        self.alignment = h.alignment
        self.data = base.raw[h.data_start:]
        self.raw_fields = {i: base.raw[e.start:e.end] for i, e in enumerate(h.fields)}
        self.touched: set[int] = set()

    def find(self, key: str) -> int | None:
        for i, f in enumerate(self.fields):
            if f[0] == key:
                return i
        return None

    def set(self, i: int, vtype: int, value, etype=None) -> None:
        self.fields[i][1:] = [vtype, value, etype]
        self.touched.add(i)

    def encode(self) -> bytes:
        from engine.formats.gguf_file import encode_field, encode_string

        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.fields)))
        for i, (key, vtype, value, etype) in enumerate(self.fields):
            if i in self.raw_fields and i not in self.touched:
                out += self.raw_fields[i]
            else:
                out += encode_field(key, vtype, value, etype)
        for name, dims, ttype, offset in self.tensors:
            out += encode_string(name) + struct.pack("<I", len(dims))
            out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in dims)
            out += struct.pack("<IQ", ttype & 0xFFFFFFFF, offset & (2**64 - 1))
        out += b"\0" * ((-len(out)) % self.alignment)
        return bytes(out + self.data)


# ----------------------------------------------------------------------------- value pools

NAN, INF = float("nan"), float("inf")
ODD_STRINGS = ("", "llama", "qwen2", "gpt2", "64", "none", "linear", "\x00", "a\nb", "\x1b[31mred\x1b[0m",
               "\r\n\t\x07\x08", "\u202e\u2028\ufeff", "x" * 5000, "\udcff".encode("utf-8", "surrogatepass"))
SCALARS = [(4, 0), (4, 1), (4, 3), (4, 7), (4, 64), (4, 2**31), (4, 2**32 - 1), (5, -1), (5, -2**31),
           (10, 2**64 - 1), (11, -2**63), (11, 2**62), (11, 1 << 40), (2, 65535), (0, 255), (1, -128),
           (6, NAN), (6, INF), (6, -INF), (6, 64.0), (6, 0.5), (6, -1.0), (6, 1e-45), (6, 3e38),
           (12, NAN), (12, -INF), (12, 1e308), (12, 2.0**70), (12, -0.0), (7, True), (7, False)] + \
          [(8, s) for s in ODD_STRINGS]
ARRAYS = [([], 4), ([0], 4), ([1, 2, 3], 4), ([64], 5), ([NAN], 6), ([64.0], 12), (["a"], 8),
          (["qwen2"], 8), ([""] * 3, 8), ([True], 7), ([[1, 2]], 9)]

TEMPLATES = (
    "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}",                         # recursion
    "{% for i in range(10**9) %}x{% endfor %}",                                   # runaway loop
    "{{ 'a' * 10**10 }}",                                                         # huge string
    "{{ (10**1000) * (10**1000) }}",                                              # big ints
    "{% for %}",                                                                  # syntax error
    "{{ undefined_function() }}",
    "{{ raise_exception('template says no') }}",
    "{{ messages[0]['content'].__class__.__mro__ }}",                             # sandbox
    "{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}",                                # deep nesting
    "{% set ns = namespace(x=[]) %}{% for i in range(10**7) %}{% set ns.x = ns.x + [i] %}{% endfor %}",
    "{{ messages | tojson(indent=10**9) }}",
    "{{ '%s' % messages }}{{ ''.join(['x'] * 10**8) }}",
    "{% include 'other.html' %}",
    "\x00\x1b[2J{{ messages }}",
    "{{ 1/0 }}",
    "{{ messages[10] }}",
    "{% for m in messages %}{{ m.content|int // 0 }}{% endfor %}",
    "{{ range(10**12)|list }}",
    "{{ 'x'|center(10**10) }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ messages|selectattr('x'|wordwrap(10**9)) }}",
)

MODEL_KEY_SUFFIXES = ("block_count", "context_length", "embedding_length", "feed_forward_length",
                      "attention.head_count", "attention.head_count_kv", "attention.key_length",
                      "attention.value_length", "rope.freq_base", "rope.dimension_count",
                      "attention.layer_norm_rms_epsilon", "rope.scaling.type")
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
                  "tokenizer.chat_template", "general.architecture", "general.alignment")


def _interesting_key(rng: random.Random, doc: Doc) -> str:
    arch = next((f[2] for f in doc.fields if f[0] == "general.architecture" and isinstance(f[2], str)), "llama")
    if rng.random() < 0.5:
        return f"{arch}.{rng.choice(MODEL_KEY_SUFFIXES)}"
    if rng.random() < 0.8:
        return rng.choice(TOKENIZER_KEYS)
    return rng.choice(doc.fields)[0] if doc.fields else "general.name"


def _set_key(doc: Doc, key: str, vtype: int, value, etype=None) -> None:
    i = doc.find(key)
    if i is None:
        doc.fields.append([key, vtype, value, etype])
        doc.touched.add(len(doc.fields) - 1)
    else:
        doc.set(i, vtype, value, etype)


# ----------------------------------------------------------------------------- mutations
# Structured mutations edit a Doc; byte mutations edit the encoded bytes.

def m_wrong_value(rng, doc):
    key = _interesting_key(rng, doc)
    vtype, value = rng.choice(SCALARS)
    _set_key(doc, key, vtype, value)
    return f"{key}=({vtype}){_short(value)}"


def m_nan_inf(rng, doc):
    key = _interesting_key(rng, doc)
    value = rng.choice((NAN, INF, -INF, 64.0, 2.0**64, -0.0))
    vtype = rng.choice((6, 12))
    _set_key(doc, key, vtype, value)
    return f"{key}=({vtype}){value}"


def m_array_for_scalar(rng, doc):
    key = _interesting_key(rng, doc)
    value, etype = rng.choice(ARRAYS)   # etype 9: nested (inner lists are int64 arrays)
    _set_key(doc, key, 9, value, etype)
    return f"{key}=array{_short(value)}"


def m_scalar_for_array(rng, doc):
    arrays = [f[0] for f in doc.fields if f[1] == 9]
    key = rng.choice(arrays)
    vtype, value = rng.choice(SCALARS)
    _set_key(doc, key, vtype, value)
    return f"{key}=({vtype}){_short(value)}"


def m_array_elements(rng, doc):
    """Change entries inside an array: odd strings in tokens/merges, bad token types."""
    arrays = [i for i, f in enumerate(doc.fields) if f[1] == 9]
    i = rng.choice(arrays)
    key, _, value, etype = doc.fields[i]
    items = list(value.tolist() if hasattr(value, "tolist") else value)
    how = rng.randrange(5)
    if how == 0 and items:                                    # duplicate entries
        j, k = rng.randrange(len(items)), rng.randrange(len(items))
        items[j] = items[k]
    elif how == 1:                                            # shorter / longer
        items = items[: rng.randrange(len(items) + 1)] if rng.random() < 0.5 else items + items[:3]
    elif how == 2 and items and etype == 8:
        for _ in range(rng.randint(1, 5)):
            items[rng.randrange(len(items))] = rng.choice([s for s in ODD_STRINGS if isinstance(s, str)])
    elif how == 3 and items and etype != 8:
        for _ in range(rng.randint(1, 5)):
            items[rng.randrange(len(items))] = rng.choice((-1, 0, 7, 255, 2**31 - 1))
        etype = 5
    else:
        rng.shuffle(items)
    doc.set(i, 9, items, etype)
    return f"{key}[{how}] ({len(items)} entries)"


def m_template(rng, doc):
    t = rng.choice(TEMPLATES)
    _set_key(doc, "tokenizer.chat_template", 8, t)
    return f"chat_template={_short(t)}"


def m_delete_key(rng, doc):
    i = rng.randrange(len(doc.fields))
    key = doc.fields[i][0]
    del doc.fields[i]
    doc.raw_fields = {(j if j < i else j - 1): v for j, v in doc.raw_fields.items() if j != i}
    doc.touched = {(j if j < i else j - 1) for j in doc.touched if j != i}
    return f"delete {key}"


def m_odd_key(rng, doc):
    how = rng.randrange(3)
    if how == 0:     # a duplicate
        f = rng.choice(doc.fields)
        doc.fields.append(list(f))
        doc.touched.add(len(doc.fields) - 1)
        return f"duplicate {f[0]}"
    key = rng.choice(("\x00", "a\nb\r\x1b[2J", "\u202eevil", "k" * 100000, "general.name\x00x",
                      "tokenizer.ggml.tokens\n"))
    if how == 1:
        doc.fields.append([key, 8, "v\x00\n\x1b[31m", None])
    else:
        i = rng.randrange(len(doc.fields))
        doc.fields[i][0] = key
    doc.touched.add(len(doc.fields) - 1 if how == 1 else i)
    return f"odd key {_short(key)}"


def m_tensor(rng, doc):
    t = rng.choice(doc.tensors)
    how = rng.randrange(6)
    if how == 0:
        t[2] = rng.choice((0, 1, 2, 8, 12, 14, 15, 30, 39, 99, 2**31))
    elif how == 1:
        j = rng.randrange(len(t[1]))
        t[1][j] = rng.choice((0, 1, 255, 256, 257, t[1][j] * 2, t[1][j] // 2, 2**32, 2**63))
    elif how == 2:
        t[1] = t[1] + [1] if rng.random() < 0.5 else t[1][:1]
    elif how == 3:
        t[3] = rng.choice((0, 1, 31, 32, t[3] + 32, 2**40, 2**64 - 32))
    elif how == 4:
        t[0] = rng.choice(("", "blk.0.attn_q.weight", "blk.99.attn_q.weight", "x\x00\n\x1b[31m",
                           "output.weight", "t" * 10000, "blk.-1.ffn_up.weight"))
    else:
        u = rng.choice(doc.tensors)
        t[3], u[3] = u[3], t[3]
    return f"tensor {_short(t[0])} change {how}"


def m_truncate(rng, data: bytes, header_end: int):
    cut = rng.randrange(header_end + 64) if rng.random() < 0.8 else rng.randrange(len(data))
    return data[:cut], f"truncate at {cut}"


def m_flip(rng, data: bytes, header_end: int):
    b = bytearray(data)
    n = rng.choice((1, 1, 2, 4, 16))
    if not b:
        return data, "flip nothing (empty)"
    for _ in range(n):
        pos = rng.randrange(min(header_end, len(b))) if rng.random() < 0.9 else rng.randrange(len(b))
        b[pos] = rng.randrange(256) if rng.random() < 0.5 else b[pos] ^ (1 << rng.randrange(8))
    return bytes(b), f"flip {n} bytes"


def m_inflate(rng, data: bytes, header, scanned):
    """A count or length field set to a huge or off-by-some value."""
    spots = [(8, "Q", "tensor_count"), (16, "Q", "kv_count")]
    for e in header.fields:
        spots.append((e.start, "Q", f"key length {e.key}"))
        if e.vtype == 8:
            spots.append((e.value_start + 4, "Q", f"string length {e.key}"))
        if e.vtype == 9:
            spots.append((e.value_start + 8, "Q", f"array count {e.key}"))
            spots.append((e.value_start + 4, "I", f"array type {e.key}"))
        spots.append((e.value_start, "I", f"value type {e.key}"))
    for t in header.tensors:
        spots.append((t.start, "Q", f"name length {t.name}"))
        n_pos = t.start + 8 + len(t.name.encode())
        spots.append((n_pos, "I", f"n_dims {t.name}"))
    pos, fmt, what = rng.choice(spots)
    old = struct.unpack_from("<" + fmt, data, pos)[0]
    top = 2**64 - 1 if fmt == "Q" else 2**32 - 1
    new = rng.choice((old + 1, old * 2 + 1, old - 1 if old else 1, 2**31, 2**32 - 1, 2**40, 2**62, top, 13))
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, pos, new & top)
    return bytes(b), f"{what}: {old} -> {new & top}"


STRUCTURED = (m_wrong_value, m_nan_inf, m_array_for_scalar, m_scalar_for_array, m_array_elements,
              m_template, m_delete_key, m_odd_key, m_tensor)
STRUCTURED_WEIGHTS = (6, 3, 3, 1, 3, 2, 1, 1, 2)


def _short(v, n: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


@dataclass
class Case:
    index: int
    base: str
    mutations: list[str]
    data: bytes
    commands: list[list[str]]


def make_case(bases: list[Base], seed: int, index: int) -> Case:
    rng = random.Random(f"gguf-prefill-fuzz:{seed}:{index}")
    base = rng.choice(bases)
    doc = Doc(base)
    muts: list[str] = []
    n = rng.choice((1, 1, 1, 2, 3))
    kinds = [rng.choices(("structured", "flip", "truncate", "inflate"), (6, 2, 1, 2))[0] for _ in range(n)]
    template = False
    for kind in kinds:
        if kind == "structured":
            fn = rng.choices(STRUCTURED, STRUCTURED_WEIGHTS)[0]
            template |= fn is m_template
            muts.append(fn(rng, doc))
    data = doc.encode()
    header_end = len(data) - len(doc.data)
    for kind in kinds:
        if kind == "flip":
            data, d = m_flip(rng, data, header_end)
        elif kind == "truncate":
            data, d = m_truncate(rng, data, header_end)
        elif kind == "inflate":
            if any(k != "inflate" for k in kinds):
                continue  # spans are those of the base file: inflate only unedited files
            data, d = m_inflate(rng, data, base.header, None)
        else:
            continue
        muts.append(d)
    if not muts:
        data, d = m_flip(rng, data, header_end)
        muts.append(d)
    prompt = rng.choice(PROMPTS)
    commands = [["generate", "--device", "cpu", "--prompt", prompt, "-n", "2", "--json"],
                ["tokenize", "--text", prompt]]
    if template or rng.random() < 0.1:
        commands.append(["chat-template", "--messages", MESSAGES])
    return Case(index, base.name, muts, data, commands)

"""Typed reads of GGUF metadata: every value a model's code uses passes through here, which
checks its type, finiteness and range and names the key (and the file) when it is wrong.

    md = Metadata(gguf.metadata, source=path)
    md.integer("llama.block_count", lo=1, hi=512)            # required int in [lo, hi]
    md.integer("tokenizer.ggml.bos_token_id", default=None)  # optional
    md.number("llama.rope.freq_base", default=10000.0, positive=True)
    md.string("general.architecture", choices=("llama", "qwen2"))
    md.boolean("tokenizer.ggml.add_bos_token", default=True)
    md.array("tokenizer.ggml.tokens", of=str, min_len=1)

A float that is a whole number (64.0) is not an integer here: GGUF writers store integers as
integer types, and a float where one is expected is a corrupt or foreign file. Errors are
GGUFError("<source>: metadata field '<key>' ...") with the value printable-escaped and cut.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from engine.errors import GGUFError, printable

_MISSING = object()


def _scalar(v):
    """numpy scalars and 0-d arrays as Python values; anything else unchanged."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and v.ndim == 0:
        return v.item()
    return v


def _is_array(v) -> bool:
    return isinstance(v, (list, tuple, np.ndarray)) and not (isinstance(v, np.ndarray) and v.ndim == 0)


class Metadata:
    """A GGUF metadata mapping with checked accessors (see the module docstring)."""

    def __init__(self, md: Mapping[str, Any], source: str):
        self.md = md
        self.source = source

    def error(self, key: str, msg: str) -> GGUFError:
        return GGUFError(f"{self.source}: metadata field '{printable(key)}' {msg}")

    def has(self, key: str) -> bool:
        return self.md.get(key) is not None

    def _get(self, key: str, default, required: bool):
        v = self.md.get(key)
        if v is None:
            if required or default is _MISSING:
                raise GGUFError(f"{self.source}: missing metadata field '{printable(key)}'")
            return _MISSING
        return v

    def _shown(self, v) -> str:
        if _is_array(v):
            return f"an array of {len(v)}"
        return printable(repr(v) if isinstance(v, str) else v)

    def integer(self, key: str, default: Any = _MISSING, lo: int | None = None, hi: int | None = None,
                required: bool = False) -> Any:
        v = self._get(key, default, required)
        if v is _MISSING:
            return default
        v = _scalar(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"= {self._shown(v)} is not an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"{'' if lo is None else lo}..{'' if hi is None else hi}"
            raise self.error(key, f"= {v} is out of range ({rng})")
        return v

    def number(self, key: str, default: Any = _MISSING, positive: bool = False, lo: float | None = None,
               hi: float | None = None, required: bool = False) -> Any:
        v = self._get(key, default, required)
        if v is _MISSING:
            return default
        v = _scalar(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(key, f"= {self._shown(v)} is not a number")
        v = float(v)
        if not math.isfinite(v):
            raise self.error(key, f"= {v} is not finite")
        if positive and not v > 0:
            raise self.error(key, f"= {v} must be positive")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.error(key, f"= {v} is out of range ({lo}..{hi})")
        return v

    def string(self, key: str, default: Any = _MISSING, choices: Sequence[str] | None = None,
               required: bool = False) -> Any:
        v = self._get(key, default, required)
        if v is _MISSING:
            return default
        v = _scalar(v)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        if not isinstance(v, str):
            raise self.error(key, f"= {self._shown(v)} is not a string")
        if choices is not None and v not in choices:
            raise self.error(key, f"= {printable(repr(v))} is not supported (supported: {', '.join(choices)})")
        return v

    def boolean(self, key: str, default: Any = _MISSING, required: bool = False) -> Any:
        v = self._get(key, default, required)
        if v is _MISSING:
            return default
        v = _scalar(v)
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        raise self.error(key, f"= {self._shown(v)} is not a bool")

    def array(self, key: str, default: Any = _MISSING, of: type | tuple | None = None, min_len: int = 0,
              required: bool = False) -> Any:
        """A list (numpy arrays as lists); `of` checks every element's type (str, int, float)."""
        v = self._get(key, default, required)
        if v is _MISSING:
            return default
        if not _is_array(v):
            raise self.error(key, f"= {self._shown(_scalar(v))} is not an array")
        items = v.tolist() if isinstance(v, np.ndarray) else list(v)
        if len(items) < min_len:
            raise self.error(key, f"has {len(items)} entries, fewer than {min_len}")
        if of is not None:
            kinds = of if isinstance(of, tuple) else (of,)
            for i, x in enumerate(items):
                ok = isinstance(x, kinds) and not (isinstance(x, bool) and bool not in kinds)
                if float in kinds and isinstance(x, float) and not math.isfinite(x):
                    ok = False
                if not ok:
                    raise self.error(key, f"entry {i} = {self._shown(x)} is not a {'/'.join(k.__name__ for k in kinds)}")
        return items

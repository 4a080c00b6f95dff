"""Chat template rendering, as Hugging Face transformers renders ``chat_template`` (jinja2).

Environment as transformers' ``_compile_jinja_template``: ``ImmutableSandboxedEnvironment``
with ``trim_blocks=True``, ``lstrip_blocks=True``, the ``loopcontrols`` extension, a
``raise_exception(message)`` global, a ``strftime_now(format)`` global and a ``tojson`` filter
that keeps non-ASCII characters (``ensure_ascii=False``).

The template comes from the model file, so it is untrusted code: besides the sandbox (no
attribute access to internals, no mutation of the inputs), the work of one render is bounded
(``Limits``): steps (every call, attribute/item access and loop iteration), wall-clock time, the
nesting of calls (recursive macros), ``range()`` sizes, the size of every string or list an
operator, ``~`` or filter builds, integer sizes (``**``, ``*``), and the output length.

Error contract of ``render_chat``:

* ``ChatTemplateError`` (a ValueError subclass) -- the template is at fault: it does not compile,
  it fails while rendering (any exception from the template's own code: undefined calls,
  SecurityError, RecursionError, OverflowError, MemoryError, ...), or it exceeds a limit. The
  message is one printable line naming the problem.
* plain ``ValueError`` -- the messages are at fault: malformed, or the template's
  ``raise_exception()`` refused them.

Tokenizer.render_chat turns ChatTemplateError into GGUFError("<file>: tokenizer.chat_template: ...").
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from engine.errors import printable

__all__ = ["render_chat", "validate_messages", "ChatTemplateError", "Limits", "LIMITS"]


class ChatTemplateError(ValueError):
    """The template itself is broken (does not compile, fails while rendering, or exceeds the
    bounds of one render)."""


@dataclass(frozen=True)
class Limits:
    """Bounds on one render. ``output`` grows with the input: base + per_input_char x (template +
    message characters), so long conversations render while a template cannot blow up."""
    steps: int = 2_000_000         # calls + attribute/item reads + loop iterations
    seconds: float = 10.0          # wall clock
    depth: int = 48                # nested calls (macros calling macros, recursive loops)
    range_len: int = 100_000       # longest range()
    int_bits: int = 8192           # largest integer an operator may produce (~2,466 digits)
    output_base: int = 1 << 20     # characters
    output_per_input_char: int = 8


LIMITS = Limits()


class _RaisedByTemplate(Exception):
    """raise_exception() called by the template: the messages are at fault."""


def _raise_exception(message):
    raise _RaisedByTemplate(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


# ------------------------------------------------------------------------------------ budget

class _Budget:
    """The running render's counters (one per render, found through a thread-local)."""

    def __init__(self, limits: Limits, input_chars: int):
        self.limits = limits
        self.steps = 0
        self.depth = 0
        self.deadline = time.monotonic() + limits.seconds
        self.max_len = limits.output_base + limits.output_per_input_char * input_chars

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.limits.steps:
            raise ChatTemplateError(f"exceeds the work limit ({self.limits.steps} steps)")
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise ChatTemplateError(f"exceeds the time limit ({self.limits.seconds:g} s)")

    def size(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > self.max_len:
            raise ChatTemplateError(f"{what} builds a value of {len(value)} items, over the "
                                    f"limit of {self.max_len}")
        if isinstance(value, int) and not isinstance(value, bool) \
                and value.bit_length() > self.limits.int_bits:
            raise ChatTemplateError(f"{what} overflows: an integer over {self.limits.int_bits} bits")
        return value

    def check_args(self, args, kwargs, what: str) -> None:
        """An integer argument (a width, a count) beyond the output limit can only make a value
        over the limit: refuse it before the builtin allocates."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_len:
                raise ChatTemplateError(f"{what} called with {printable(a, 40)}, over the size "
                                        f"limit of {self.max_len}")


_local = threading.local()


def _budget() -> _Budget | None:
    return getattr(_local, "budget", None)


def _bounded_iter(iterable):
    """Every for-loop iterates through this (the template is rewritten so): one step an item."""
    b = _budget()
    if b is None:
        yield from iterable
        return
    for x in iterable:
        b.tick()
        yield x


def _bounded_concat(*parts):
    """The ``~`` operator (nodes.Concat), with the result size checked."""
    b = _budget()
    if b is not None:
        total = 0
        for p in parts:
            if isinstance(p, str):
                total += len(p)
        if total > b.max_len:
            raise ChatTemplateError(f"'~' builds a string of {total} characters, over the limit "
                                    f"of {b.max_len}")
    return "".join(str(p) for p in parts)


def _range(*args):
    b = _budget()
    limit = b.limits.range_len if b is not None else LIMITS.range_len
    r = range(*args)
    if len(r) > limit:
        raise ChatTemplateError(f"range() of {len(r)} items, over the limit of {limit}")
    return r


_range.__name__ = "range"
_ITER, _CONCAT = "__gguf_bounded_iter__", "__gguf_bounded_concat__"


class _Bound(NodeTransformer):
    """Rewrite the parsed template: for-loops iterate through _bounded_iter, '~' is _bounded_concat."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name(_ITER, "load"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Call(nodes.Name(_CONCAT, "load"), list(node.nodes), [], None, None,
                          lineno=node.lineno)


def _bounded_filter(name, f):
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # context/environment first

    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment markers
    def run(*args, **kwargs):
        b = _budget()
        if b is None:
            return f(*args, **kwargs)
        b.tick()
        value = args[skip:]
        b.check_args(value[1:], kwargs, f"filter '{name}'")
        if name == "format" and value and isinstance(value[0], str):
            _check_format(b, value[0], False, "filter 'format'")
        _estimate(b, name, value, kwargs, f"filter '{name}'")
        return b.size(f(*args, **kwargs), f"filter '{name}'")
    return run


class _Env(ImmutableSandboxedEnvironment):
    """The sandbox with every call, attribute/item read and operator counted and size-checked."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

    def _parse(self, source, name, filename):
        return _Bound().visit(super()._parse(source, name, filename))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        b = _budget()
        if b is None:
            return super().call(__context, __obj, *args, **kwargs)
        b.tick()
        if not any(__obj is f for f in (_bounded_iter, _bounded_concat, _range)):
            name = printable(getattr(__obj, "__name__", "a function"), 40)
            b.check_args(args, kwargs, f"{name}()")
            if isinstance(getattr(__obj, "__self__", None), str):  # str.replace / str.join
                _estimate(b, __obj.__name__, (__obj.__self__, *args), kwargs, f"str.{name}()")
        if b.depth >= b.limits.depth:
            raise ChatTemplateError(f"calls nest deeper than {b.limits.depth} (runaway recursion?)")
        b.depth += 1
        try:
            return b.size(super().call(__context, __obj, *args, **kwargs), "a call")
        finally:
            b.depth -= 1

    def wrap_str_format(self, value):
        fmt = super().wrap_str_format(value)
        b = _budget()
        if fmt is not None and b is not None:
            _check_format(b, value.__self__, True, f"str.{value.__name__}()")
        return fmt

    def getattr(self, obj, attribute):
        b = _budget()
        if b is not None:
            b.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        b = _budget()
        if b is not None:
            b.tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        b = _budget()
        if b is not None:
            b.tick()
            _precheck_binop(b, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return b.size(result, f"'{operator}'") if b is not None else result


def _estimate(b: _Budget, name: str, args, kwargs, what: str) -> None:
    """Builtins whose output can be far larger than their inputs: estimate the result's size
    from the arguments and refuse it before it is built."""
    if not args:
        return
    s = args[0]
    est = 0
    if name == "replace" and isinstance(s, str) and len(args) >= 3 and isinstance(args[1], str) \
            and isinstance(args[2], str):
        old, new = args[1], args[2]
        n = len(s) + 1 if old == "" else s.count(old)
        est = len(s) + n * max(0, len(new) - len(old))
    elif name == "join" and len(args) >= 2:
        seq, sep = (args[0], args[1]) if isinstance(args[1], str) else (args[1], args[0])
        if isinstance(sep, str) and isinstance(seq, (list, tuple, str)):
            est = sum(len(x) for x in seq if isinstance(x, str)) + len(seq) * len(sep)
    elif name == "indent" and isinstance(s, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width
        if _is_int(width):
            est = len(s) + (s.count("\n") + 1) * width
    elif name == "tojson":
        indent = args[2] if len(args) > 2 else kwargs.get("indent")
        if _is_int(indent) and indent > 64:
            raise ChatTemplateError(f"{what} with indent={indent}, over 64")
    if est > b.max_len:
        raise ChatTemplateError(f"{what} would build a value of {est} items, over the limit of {b.max_len}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _precheck_binop(b: _Budget, op: str, left, right) -> None:
    """Refuse an operation whose result is over the limits before Python computes it."""
    if op == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0:
        if right * max(1, abs(left).bit_length() - 1) > b.limits.int_bits:
            raise ChatTemplateError(f"'**' overflows: {printable(left, 20)} ** {printable(right, 20)} "
                                    f"is over {b.limits.int_bits} bits")
    elif op == "*":
        if _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > b.limits.int_bits + 1:
                raise ChatTemplateError(f"'*' overflows: the product is over {b.limits.int_bits} bits")
            return
        seq, n = (left, right) if _is_int(right) else (right, left)
        if _is_int(n) and isinstance(seq, (str, list, tuple)) and len(seq) * n > b.max_len:
            raise ChatTemplateError(f"'*' builds a value of {len(seq) * n} items, over the limit "
                                    f"of {b.max_len}")
    elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        if len(left) + len(right) > b.max_len:
            raise ChatTemplateError(f"'+' builds a value of {len(left) + len(right)} items, over "
                                    f"the limit of {b.max_len}")
    elif op == "%" and isinstance(left, str):
        b.check_args(right if isinstance(right, tuple) else (right,), {}, "'%' formatting")
        _check_format(b, left, False, "'%' formatting")


_PERCENT_FIELD = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _format_widths(fmt: str, brace: bool) -> int:
    """An upper bound of the padding the width/precision fields of `fmt` ask for."""
    if brace:
        return sum(int(d) for m in _BRACE_SPEC.finditer(fmt) for d in re.findall(r"\d+", m[1]))
    return sum(int(w or 0) + int(p or 0) for w, p in _PERCENT_FIELD.findall(fmt))


def _check_format(b: _Budget, fmt: str, brace: bool, what: str) -> None:
    if len(fmt) <= b.max_len and _format_widths(fmt, brace) > b.max_len:
        raise ChatTemplateError(f"{what} asks for field widths over the size limit of {b.max_len}")


# ------------------------------------------------------------------------------------ compile

@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters = {k: _bounded_filter(k, f) for k, f in env.filters.items()}
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.globals.pop("lipsum", None)  # generates text in a loop the budget cannot see
    env.globals["range"] = _range
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals[_ITER] = _bounded_iter
    env.globals[_CONCAT] = _bounded_concat
    outer = _budget()
    # jinja folds constant expressions (filters too) while compiling: bound that work as well
    # (a fold that fails is left to run, and fail, at render time)
    _local.budget = _Budget(LIMITS, len(template))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"does not compile: line {e.lineno}: {printable(e.message)}") from None
    except RecursionError:
        raise ChatTemplateError("does not compile: nested too deeply") from None
    except MemoryError:
        raise ChatTemplateError("does not compile: out of memory") from None
    except Exception as e:  # the parser/compiler on hostile input: any failure is the template's
        raise ChatTemplateError(f"does not compile: {type(e).__name__}: {printable(str(e))}") from None
    finally:
        _local.budget = outer


def validate_messages(messages: Any) -> list[dict]:
    """Check `messages` is a non-empty list of {role: str, content: str} (extra keys allowed).

    Raises ValueError naming the problem; returns plain dict copies.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{role, content}} objects, "
                         f"got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with role and content, "
                             f"got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'")
        if not isinstance(m["role"], str) or not m["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string, "
                             f"got {printable(repr(m['role']), 40)}")
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string, "
                             f"got {type(m['content']).__name__}")
        out.append(dict(m))
    return out


def _input_chars(template: str, msgs: list[dict], extra: dict) -> int:
    n = len(template)
    for m in msgs:
        n += sum(len(v) for v in m.values() if isinstance(v, str))
    n += sum(len(v) for v in extra.values() if isinstance(v, str))
    return n


def render_chat(template: str, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                limits: Limits = LIMITS, **extra) -> str:
    """Render `messages` with a jinja chat `template` (HF semantics), within `limits`.

    ValueError for bad messages (including a template's raise_exception); ChatTemplateError
    (a ValueError) when the template does not compile, fails to render or exceeds a limit.
    """
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("empty chat template")
    msgs = validate_messages(messages)
    tmpl = _compile(template)
    budget = _Budget(limits, _input_chars(template, msgs, extra))
    outer = _budget()
    _local.budget = budget
    try:
        out: list[str] = []
        n = 0
        for chunk in tmpl.generate(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                                   bos_token=bos_token, eos_token=eos_token, **extra):
            n += len(chunk)
            if n > budget.max_len:
                raise ChatTemplateError(f"output exceeds the limit of {budget.max_len} characters")
            out.append(chunk)
        return "".join(out)
    except _RaisedByTemplate as e:
        raise ValueError(f"chat template rejected the messages: {printable(str(e))}") from None
    except ChatTemplateError:
        raise
    except RecursionError:
        raise ChatTemplateError("failed to render: recursion too deep") from None
    except MemoryError:
        raise ChatTemplateError("failed to render: out of memory") from None
    except Exception as e:  # any other exception is raised by the template's own code
        raise ChatTemplateError(f"failed to render: {type(e).__name__}: {printable(str(e))}") from None
    finally:
        _local.budget = outer

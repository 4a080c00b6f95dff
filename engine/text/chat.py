"""Chat template rendering, as Hugging Face transformers renders ``chat_template`` (jinja2).

Environment as transformers' ``_compile_jinja_template``: ``ImmutableSandboxedEnvironment``
with ``trim_blocks=True``, ``lstrip_blocks=True``, the ``loopcontrols`` extension, a
``raise_exception(message)`` global, a ``strftime_now(format)`` global and a ``tojson`` filter
that keeps non-ASCII characters (``ensure_ascii=False``).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat", "validate_messages", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template itself is broken (does not compile, or fails while rendering)."""


class _RaisedByTemplate(Exception):
    """raise_exception() called by the template: the messages are at fault."""


def _raise_exception(message):
    raise _RaisedByTemplate(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"does not compile: line {e.lineno}: {e.message}") from None


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
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {m['role']!r}")
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string, "
                             f"got {type(m['content']).__name__}")
        out.append(dict(m))
    return out


def render_chat(template: str, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                **extra) -> str:
    """Render `messages` with a jinja chat `template` (HF semantics).

    ValueError for bad messages (including a template's raise_exception); ChatTemplateError
    (a ValueError) when the template does not compile or fails to render.
    """
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("empty chat template")
    msgs = validate_messages(messages)
    tmpl = _compile(template)
    try:
        return tmpl.render(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                           bos_token=bos_token, eos_token=eos_token, **extra)
    except _RaisedByTemplate as e:
        raise ValueError(f"chat template rejected the messages: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"failed to render: {type(e).__name__}: {e}") from None
    except (TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError) as e:
        raise ChatTemplateError(f"failed to render: {type(e).__name__}: {e}") from None

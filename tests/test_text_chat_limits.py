"""A broken or hostile chat template (issue 15): one clean error, never a traceback or a hang.

engine.text.chat.render_chat raises ChatTemplateError (a ValueError) for every template fault
and a plain ValueError when the messages are at fault; Tokenizer.render_chat turns the first into
GGUFError("<file>: tokenizer.chat_template: ..."); the CLI prints one line (exit 2) and the
server answers 400.
"""

from __future__ import annotations

import json
import struct
import threading
import time

import jinja2
import jinja2.ext
import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import GGUFError
from engine.formats.gguf_file import VALUE_TYPE_IDS, encode_field
from engine.text.bpe import BYTE_ENCODER
from engine.text.chat import ChatTemplateError, Limits, render_chat
from engine.text.tokenizer import Tokenizer

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]

HOSTILE = {
    # infinite / exponential recursion
    "macro-recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "calls nest deeper"),
    "macro-fork-bomb": ("{% macro f() %}{{ f() ~ f() }}{% endmacro %}{{ f() }}", "calls nest deeper"),
    "recursive-loop": ("{% for m in [[1]] recursive %}{{ loop([m, m]) }}{% endfor %}", "calls nest deeper"),
    # integer overflow
    "pow": ("{{ 2 ** 100000 }}", "'**' overflows"),
    "pow-chain": ("{{ (10 ** 1000) ** 1000 }}", "'**' overflows"),
    "square-loop": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                    "{% endfor %}{{ ns.x }}", "'*' overflows"),
    "huge-range": ("{% for i in range(10 ** 12) %}{% endfor %}", "range()"),
    "range-limit": ("{% for i in range(200000) %}{% endfor %}", "range() of 200000 items"),
    "int-to-float": ("{{ (2 ** 2000) | float }}", "failed to render: OverflowError"),
    # huge output or values
    "nested-loops-output": ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                            "{% endfor %}", "output exceeds the limit"),
    "string-times": ("{{ 'x' * 10 ** 10 }}", "'*' builds a value"),
    "list-times": ("{{ ([1] * 100000) * 100000 }}", "'*' builds a value"),
    "concat-doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "'~' builds a string"),
    "plus-doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", "'+' builds a value"),
    "center-filter": ("{{ 'x' | center(10 ** 10) }}", "filter 'center' called with"),
    "ljust-method": ("{{ 'x'.ljust(10 ** 10) }}", "ljust() called with"),
    "percent-width": ("{{ '%099999999999d' % 1 }}", "field widths"),
    "format-width": ("{{ '{:>9999999999}'.format(1) }}", "field widths"),
    "format-filter": ("{{ '%0999999999d' | format(1) }}", "field widths"),
    "indent-blowup": ("{{ ('a\\n' * 1000) | indent(100000) }}", "filter 'indent' would build a value"),
    "replace-filter": ("{{ ('x' * 100000) | replace('', 'y' * 100000) }}", "filter 'replace' would build"),
    "replace-method": ("{{ ('x' * 100000).replace('x', 'y' * 100000) }}", "str.replace() would build"),
    "join-filter": ("{{ ('a' * 100000) | list | join('b' * 100000) }}", "filter 'join' would build"),
    "join-method": ("{{ ('b' * 100000).join(['a'] * 100000) }}", "str.join() would build"),
    "tojson-indent": ("{{ messages | tojson(indent=100000) }}", "indent=100000, over 64"),
    # endless work without output
    "nested-loops-silent": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                            "{% endfor %}", "exceeds the work limit"),
    # does not compile
    "syntax": ("{% if %}", "does not compile: line 1"),
    "unclosed": ("{% for m in messages %}", "does not compile"),
    "deep-nesting": ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "does not compile"),
    "unknown-filter": ("{{ 1 | nosuchfilter }}", "does not compile"),
    "huge-literal": ("{{ " + "9" * 5000 + " }}", "does not compile"),
    # raises while rendering
    "undefined-call": ("{{ nosuch() }}", "failed to render: UndefinedError"),
    "zero-division": ("{{ 1 // 0 }}", "failed to render: ZeroDivisionError"),
    "index": ("{{ messages[99]['x'] }}", "failed to render"),
    "str-index": ("{{ 'abc'.index('z') }}", "failed to render: ValueError"),
    "mutation": ("{{ messages.append(1) }}", "failed to render: SecurityError"),
    "internals": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed to render"),
    "lipsum": ("{{ lipsum(10 ** 6) }}", "failed to render: UndefinedError"),
}


def _one_line(msg: str) -> None:
    assert msg and "\n" not in msg and "\r" not in msg and "\x1b" not in msg, msg
    assert len(msg) < 400, msg


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_one_clean_error(name):
    template, problem = HOSTILE[name]
    t = time.perf_counter()
    with pytest.raises(ChatTemplateError) as ei:
        render_chat(template, MSGS)
    assert time.perf_counter() - t < 10.0
    assert isinstance(ei.value, ValueError)
    assert problem in str(ei.value), str(ei.value)
    _one_line(str(ei.value))
    assert ei.value.__cause__ is None


def test_time_limit():
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    t = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=r"exceeds the time limit \(0\.2 s\)"):
        render_chat(slow, MSGS, limits=Limits(steps=10 ** 12, seconds=0.2))
    assert time.perf_counter() - t < 5.0


def test_limits_are_parameters():
    loop = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert render_chat(loop, MSGS) == "Shi"
    with pytest.raises(ChatTemplateError, match=r"work limit \(3 steps\)"):
        render_chat(loop, MSGS, limits=Limits(steps=3))
    # the output limit grows with the input: here 1 x (template + message characters)
    small = Limits(output_base=0, output_per_input_char=1)
    many = "{% for i in range(100) %}x{% endfor %}"
    n_in = len(many) + len("systemShiuser")
    with pytest.raises(ChatTemplateError, match=f"output exceeds the limit of {n_in} characters"):
        render_chat(many, MSGS, limits=small)
    with pytest.raises(ChatTemplateError, match=f"'\\*' builds a value of 100 items, over the limit of"):
        render_chat("{{ 'x' * 100 }}", MSGS, limits=small)
    macro = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{% endif %}.{% endmacro %}{{ f(5) }}"
    assert render_chat(macro, MSGS) == "......"
    with pytest.raises(ChatTemplateError, match="calls nest deeper than 3"):
        render_chat(macro, MSGS, limits=Limits(depth=3))


def test_template_rejecting_messages_is_a_plain_value_error():
    tmpl = "{{ raise_exception('no system message\\x1b[2J\\n' ~ 'x' * 1000) }}"
    with pytest.raises(ValueError, match="chat template rejected the messages: no system message") as ei:
        render_chat(tmpl, MSGS)
    assert not isinstance(ei.value, ChatTemplateError)
    _one_line(str(ei.value))


def test_a_failed_render_leaves_no_state_behind():
    with pytest.raises(ChatTemplateError):
        render_chat("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                    MSGS, limits=Limits(steps=1000))
    assert render_chat("{% for m in messages %}{{ m.role }}{% endfor %}", MSGS) == "systemuser"


def test_renders_in_threads_have_their_own_budget():
    loop = "{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": str(i)} for i in range(2000)]
    want = "".join(str(i) for i in range(2000))
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(render_chat(loop, msgs) == want)
        except Exception as e:  # pragma: no cover - shown on failure
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 20 and all(results)


# --------------------------------------------------------------------------- same output as HF's

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
LOOPY = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}{{ loop.revindex }}"
         "{{ loop.previtem.role if loop.previtem }}{{ loop.nextitem.role if loop.nextitem }}"
         "{{ loop.cycle('x', 'y') }};{% endfor %}"
         "{% for m in messages if m.role == 'user' %}[{{ m.content }}{{ loop.length }}]{% else %}none{% endfor %}"
         "{% for m in [] %}x{% else %}empty{% endfor %}{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}"
         "{% for i in range(messages | length - 1, -1, -1) %}{{ i }}{% endfor %}"
         "{{ messages[-1]['content'] ~ '!' ~ 3 }}{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
         "{% set ns = namespace(found=false) %}{% for m in messages %}{% if m.role == 'system' %}"
         "{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.found }}"
         "{% for m in messages recursive %}{% if loop.depth == 1 and m.role == 'user' %}{{ loop([]) }}{% endif %}"
         "{% endfor %}{{ '%s-%05d' % ('a', 3) }}{{ '{:>4}'.format('z') }}{{ 'ab' * 2 }}{{ 2 ** 10 }}"
         "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}")


def _hf_render(template, messages, **kw):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(template).render(messages=messages, **kw)


@pytest.mark.parametrize("template", [CHATML, LOOPY], ids=["chatml", "loop-features"])
def test_bounded_render_matches_the_plain_sandbox(template):
    msgs = [{"role": r, "content": c} for r, c in
            [("system", "S"), ("user", "a é"), ("assistant", "b"), ("user", "c")]]
    assert render_chat(template, msgs) == _hf_render(template, msgs, add_generation_prompt=True,
                                                     bos_token="", eos_token="")


def test_long_conversation_is_within_the_limits():
    msgs = [{"role": ("user", "assistant")[i % 2], "content": f"{i} " + "word " * 200} for i in range(3000)]
    msgs.append({"role": "user", "content": "z" * 3_000_000})  # one 3 MB message
    t = time.perf_counter()
    out = render_chat(CHATML, msgs)
    assert time.perf_counter() - t < 10.0
    assert out == _hf_render(CHATML, msgs, add_generation_prompt=True)


# --------------------------------------------------------------------------- file, CLI, server

def _bpe_md(template):
    toks = [BYTE_ENCODER[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": toks,
            "tokenizer.ggml.token_type": [1] * 256 + [3, 3], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 257, "tokenizer.chat_template": template}


FILE_CASES = {
    "recursion": HOSTILE["macro-recursion"],
    "overflow": HOSTILE["pow"],
    "huge-output": HOSTILE["nested-loops-output"],
    "syntax": HOSTILE["syntax"],
    "raising": HOSTILE["undefined-call"],
}


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_file_template_errors_are_gguf_errors(name):
    template, problem = FILE_CASES[name]
    tok = Tokenizer.from_metadata(_bpe_md(template), "bad.gguf")
    with pytest.raises(GGUFError) as ei:
        tok.render_chat(MSGS)
    msg = str(ei.value)
    assert msg.startswith("bad.gguf: tokenizer.chat_template: ") and problem in msg, msg
    _one_line(msg)


def _write_gguf(path, md):
    fields = []
    for k, v in md.items():
        if isinstance(v, str):
            fields.append(encode_field(k, VALUE_TYPE_IDS["string"], v))
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):
            fields.append(encode_field(k, VALUE_TYPE_IDS["array"], v, VALUE_TYPE_IDS["string"]))
        elif isinstance(v, list):
            fields.append(encode_field(k, VALUE_TYPE_IDS["array"], np.array(v, dtype=np.int32)))
        else:
            fields.append(encode_field(k, VALUE_TYPE_IDS["uint32"], v))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + b"".join(fields))
    return path


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_cli_chat_template_verb_prints_one_line(tmp_path, capsys, name):
    from engine.cli import main

    template, problem = FILE_CASES[name]
    p = _write_gguf(tmp_path / f"{name}.gguf", _bpe_md(template))
    capsys.readouterr()
    t = time.perf_counter()
    rc = main(["chat-template", "--model", str(p), "--messages", '[{"role": "user", "content": "hi"}]'])
    assert time.perf_counter() - t < 15.0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert str(p) in lines[0] and "tokenizer.chat_template" in lines[0] and problem in lines[0], err


def test_cli_template_rejecting_messages(tmp_path, capsys):
    from engine.cli import main

    p = _write_gguf(tmp_path / "picky.gguf", _bpe_md("{{ raise_exception('needs a system message') }}"))
    capsys.readouterr()
    assert main(["chat-template", "--model", str(p), "--messages", '[{"role": "user", "content": "hi"}]']) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs a system message" in lines[0]


@pytest.mark.parametrize("name", sorted(FILE_CASES) + ["rejects"])
def test_server_chat_prompt_is_a_400(name):
    from server.errors import APIError
    from server.runner import Engine

    template = FILE_CASES[name][0] if name != "rejects" else "{{ raise_exception('no') }}"
    tok = Tokenizer.from_metadata(_bpe_md(template), "bad.gguf")
    eng = Engine(model=None, tokenizer=tok, n_ctx=64, model_id="bad.gguf")
    with pytest.raises(APIError) as ei:
        eng.chat_prompt(MSGS)
    assert ei.value.status == 400
    _one_line(ei.value.message)
    assert "chat template" in ei.value.message

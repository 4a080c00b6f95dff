"""Chat template rendering (HF semantics) and the default model's ChatML template."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from engine.text.chat import ChatTemplateError, render_chat, validate_messages
from engine.errors import GGUFError
from engine.text.tokenizer import load_tokenizer

MODEL_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
ROOT = Path(__file__).resolve().parent.parent

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chatml_render():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat(CHATML, msgs) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(CHATML, msgs, add_generation_prompt=False).endswith("U<|im_end|>\n")


def test_trim_and_lstrip_blocks():
    tmpl = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    assert render_chat(tmpl, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) \
        == "[a]\n[b]\n"


def test_bos_eos_and_extra_variables():
    tmpl = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}{{ who }}"
    out = render_chat(tmpl, [{"role": "user", "content": "x"}], bos_token="<s>", eos_token="</s>",
                      who="!")
    assert out == "<s>x</s>!"


def test_loopcontrols_and_tojson_non_ascii():
    tmpl = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
            "{{ m | tojson }}{% endfor %}")
    out = render_chat(tmpl, [{"role": "user", "content": "héllo ✓"}, {"role": "user", "content": "z"}])
    assert json.loads(out) == {"role": "user", "content": "héllo ✓"}
    assert "héllo ✓" in out  # ensure_ascii=False, as transformers' tojson


def test_raise_exception_is_a_value_error():
    tmpl = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    with pytest.raises(ValueError, match="need a system message") as ei:
        render_chat(tmpl, [{"role": "user", "content": "x"}])
    assert not isinstance(ei.value, ChatTemplateError)


def test_broken_template():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", [{"role": "user", "content": "x"}])
    # sandboxed and immutable: a template cannot mutate the messages
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, problem", [
    ("hi", "must be a list"),
    ({"role": "user", "content": "x"}, "must be a list"),
    ([], "empty"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\] has no 'role'"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role must be a non-empty string"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": None}],
     r"messages\[1\]\.content must be a string"),
])
def test_message_validation(messages, problem):
    with pytest.raises(ValueError, match=problem):
        validate_messages(messages)
    with pytest.raises(ValueError, match=problem):
        render_chat(CHATML, messages)


# --------------------------------------------------------------------------- file templates

def _goldens_dir() -> Path | None:
    for c in (os.environ.get("GGUF_PREFILL_GOLDENS"), ROOT / "tests" / "goldens" / "llamacpp"):
        if c and (Path(c) / "qwen2.5-coder-1.5b-q4_k_m.json").exists():
            return Path(c)
    return None


@pytest.fixture(scope="module")
def qwen():
    home = os.environ.get("GGUF_PREFILL_HOME") or os.path.expanduser("~/.cache/gguf-prefill")
    p = Path(home) / MODEL_FILE
    if not p.exists():
        if os.environ.get("GGUF_PREFILL_REQUIRE_MODEL") == "1":
            pytest.fail(f"default model missing at {p} (GGUF_PREFILL_REQUIRE_MODEL=1)")
        pytest.skip(f"default model not found at {p}")
    return load_tokenizer(p)


CHATML_PROMPT = re.compile(
    r"<\|im_start\|>system\n(?P<system>.*?)<\|im_end\|>\n"
    r"<\|im_start\|>user\n(?P<user>.*?)<\|im_end\|>\n<\|im_start\|>assistant\n\Z", re.S)


@pytest.mark.model
def test_default_model_template_renders_golden_chat_prompt(qwen):
    g = _goldens_dir()
    if g is None:
        pytest.skip("goldens directory not found")
    greedy = json.loads((g / "qwen2.5-coder-1.5b-q4_k_m.json").read_text("utf-8"))["greedy"]
    chats = [c for c in greedy if CHATML_PROMPT.match(c["prompt"])]
    assert chats, "the goldens hold a system + user ChatML prompt"
    for c in chats:
        m = CHATML_PROMPT.match(c["prompt"])
        messages = [{"role": "system", "content": m["system"]},
                    {"role": "user", "content": m["user"]}]
        text = qwen.render_chat(messages, add_generation_prompt=True)
        assert text == c["prompt"]
        assert qwen.encode(text) == c["prompt_ids"]


@pytest.mark.model
def test_default_model_template_default_system(qwen):
    text = qwen.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_no_template_is_a_gguf_error():
    g = _goldens_dir()
    p = (g / "spm-vocab-32k.gguf") if g else None
    if p is None or not p.exists():
        pytest.skip("goldens directory not found")
    tok = load_tokenizer(p)
    with pytest.raises(GGUFError, match=r"spm-vocab-32k\.gguf: has no tokenizer\.chat_template; "
                                         r"chat is not available"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_broken_file_template_is_a_gguf_error():
    from engine.text.bpe import BYTE_ENCODER as _BYTE_ENCODER
    from engine.text.tokenizer import Tokenizer

    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
          "tokenizer.ggml.tokens": [_BYTE_ENCODER[b] for b in range(256)],
          "tokenizer.ggml.merges": [], "tokenizer.chat_template": "{% if %}"}
    tok = Tokenizer.from_metadata(md, "broken.gguf")
    with pytest.raises(GGUFError, match=r"broken\.gguf: tokenizer\.chat_template: does not compile"):
        tok.render_chat([{"role": "user", "content": "hi"}])

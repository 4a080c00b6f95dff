"""The OpenAI request fields, turned into one generation plan, and the logprobs shapes.

What each field does (every other field is a 400 naming it: see server.schemas):

- max_tokens / max_completion_tokens / n_predict (llama.cpp; -1 = to the end of the context):
  the cap on generated tokens; two of them with different values is a 400. None given:
  completions 16 (OpenAI's default), chat up to the end of the context.
- temperature unset or 0: greedy (argmax, ties to the lowest id), the engine's own loop;
  > 0: the seeded Sampler with top_k / top_p. seed: the sampler's generator (same seed, same
  request, same output).
- presence_penalty / frequency_penalty / logit_bias: on the logits before the choice
  (sampling.TokenChooser), greedy or not.
- response_format json_object / json_schema: the output held to the schema by llguidance
  (server.structured).
- logprobs (completions: int = top-k; chat: bool + top_logprobs), echo (completions: the
  prompt before the completion, with the prompt's logprobs when logprobs is set).
- stream_options.include_usage: a last chunk with `choices: []` and the usage.
- model: the served id or its stem (Engine.names()), else 404 model_not_found.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from server.errors import APIError
from server.sampling import Sampler, TokenChooser, TokenLogprob

MAX_PROMPT_LOGPROB_FLOATS = 1 << 29  # echo + logprobs: [n_prompt, vocab] float32 logits (2 GiB)


def model_not_found(name: str, eng) -> APIError:
    shown = name if len(name) <= 80 else name[:80] + "..."
    return APIError(404, f"The model {shown!r} does not exist; this server serves "
                         f"{eng.model_id!r}", type="model_not_found", param="model")


def check_model(eng, req) -> None:
    if req.model and req.model not in eng.names():
        raise model_not_found(req.model, eng)


def refuse(req) -> None:
    """400 naming every field this server does not do (the first one in `param`)."""
    bad = req.refusals()
    if bad:
        msg = "; ".join(f"{f}: {why}" for f, why in bad)
        raise APIError(400, msg, param=bad[0][0])


def max_new_tokens(req, chat: bool, n_prompt: int, n_ctx: int) -> int:
    caps = {f: getattr(req, f) for f in ("max_tokens", "max_completion_tokens", "n_predict")
            if getattr(req, f, None) is not None}
    if len(set(caps.values())) > 1:
        raise APIError(400, f"{', '.join(caps)}: give one token cap (they differ: "
                            f"{', '.join(f'{k}={v}' for k, v in caps.items())})",
                       param=next(iter(caps)))
    cap = next(iter(caps.values()), None)
    if cap is None:
        # OpenAI: completions default to 16 tokens; chat runs to the end of the context
        return 16 if not chat else max(n_ctx - n_prompt, 1)
    if cap == -1:  # n_predict -1: no cap but the context
        return max(n_ctx - n_prompt, 1)
    return cap


@dataclass
class Plan:
    max_tokens: int
    sampler: Any = None
    top_logprobs: int | None = None       # per generated token (None: no logprobs)
    prompt_logprobs: int | None = None    # echo + logprobs (completions)
    echo: str | None = None               # the echoed prompt text (completions)
    echo_skip: int = 0                    # leading prompt tokens not in the echo (auto BOS)
    include_usage: bool = False


async def plan_generation(eng, req, ids: list[int], chat: bool, max_tokens: int) -> Plan:
    from server import structured

    plan = Plan(max_tokens=max_tokens)
    plan.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    if chat:
        plan.top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        plan.top_logprobs = req.logprobs
        if req.echo:
            if isinstance(req.prompt, str):
                plan.echo = req.prompt
                bos = getattr(eng.tokenizer, "bos_id", None)
                if bos is not None and ids and ids[0] == bos and not req.prompt.startswith(
                        eng.decode([bos])):
                    plan.echo_skip = 1
            else:
                plan.echo = eng.decode(ids)
            if req.logprobs is not None:
                if len(ids) * eng.vocab_size > MAX_PROMPT_LOGPROB_FLOATS:
                    raise APIError(400, f"logprobs with echo: a prompt of {len(ids)} tokens is too "
                                        "long to score (at most "
                                        f"{MAX_PROMPT_LOGPROB_FLOATS // eng.vocab_size})",
                                   param="logprobs")
                plan.prompt_logprobs = req.logprobs
    bias = None
    if req.logit_bias:
        bias = {}
        for k, v in req.logit_bias.items():
            t = int(k)
            if not 0 <= t < eng.vocab_size:
                raise APIError(400, f"logit_bias: token id {t} is out of range for the "
                                    f"vocabulary (0..{eng.vocab_size - 1})", param="logit_bias")
            bias[t] = v
    matcher = None
    grammar = structured.grammar_for(req.response_format)
    if grammar is not None:
        matcher = await run_in_threadpool(structured.new_matcher, eng, grammar)
    sampler = None
    if req.temperature:
        sampler = Sampler(req.temperature, req.top_k or 0,
                          1.0 if req.top_p is None else req.top_p, req.seed)
    extra = (bias or req.presence_penalty or req.frequency_penalty or matcher is not None
             or plan.top_logprobs is not None)
    if extra:
        sampler = TokenChooser(sampler, logit_bias=bias, presence_penalty=req.presence_penalty or 0.0,
                               frequency_penalty=req.frequency_penalty or 0.0, matcher=matcher,
                               top_logprobs=plan.top_logprobs,
                               eog_ids=() if req.ignore_eos else eng.eog_ids())
    plan.sampler = sampler
    return plan


# ---- logprobs in the OpenAI shapes ------------------------------------------------------------

def token_text(b: bytes) -> str:
    """A token as a key: its text, or 'bytes:\\xe2\\x80' when it is not whole UTF-8 (as OpenAI)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


class CompletionLogprobs:
    """Legacy completions shape: tokens, token_logprobs, top_logprobs (dicts), text_offset.
    Offsets are character positions in the returned text, kept across stream chunks."""

    def __init__(self, token_bytes, offset: int = 0):
        self._bytes = token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.offset = offset

    def restart(self, offset: int) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.offset = offset

    def block(self, entries: list[TokenLogprob | None], ids: list[int] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for j, e in enumerate(entries):
            tid = e.token if e is not None else ids[j]
            b = self._bytes(tid)
            out["tokens"].append(token_text(b))
            out["text_offset"].append(self.offset)
            self.offset += len(self._dec.decode(b))
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(e.logprob)
            top = {token_text(self._bytes(t)): lp for t, lp in e.top}
            top.setdefault(token_text(b), e.logprob)
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(token_bytes, entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(t: int, lp: float) -> dict[str, Any]:
        b = token_bytes(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries],
            "refusal": None}


def merge_blocks(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}

"""Request / response models (OpenAI shapes plus llama-server's `timings`).

Requests are strict (no "5" -> 5, no true -> 1) so a wrong type is a 422 that names the field.
`model` is never used as a file path: it is checked against the served id (404 otherwise).

No field is silently ignored. On the OpenAI routes (/v1/completions, /v1/chat/completions)
every field is either implemented or refused with a 400 naming it (`refusals()`); a field
the server does not know at all is a 400 "unrecognized request argument" naming it, as
OpenAI answers (the models keep unknown fields with extra="allow" so that the route can name
them, nested ones included: `messages.0.tool_calls`). A few fields that only identify the
caller and change nothing in the output are accepted and ignored on purpose
(HARMLESS_FIELDS). The other routes (/v1/prefill, /tokenize, /detokenize) forbid unknown
fields outright (extra="forbid": a 422 naming the field).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      field_validator, model_validator)

MAX_TOKENS_LIMIT = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

# accepted and ignored on purpose: they identify the caller (abuse tracking, caching keys,
# tags) and change nothing in what is generated
HARMLESS_FIELDS = ("user", "safety_identifier", "prompt_cache_key", "metadata")


def _check_text(value: str, field: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} contains an unpaired UTF-16 surrogate (not valid Unicode)") from None
    return value


class _Request(BaseModel):
    """Non-OpenAI routes: unknown fields are a 422 naming them."""
    model_config = ConfigDict(strict=True, extra="forbid")


class _OpenAIModel(BaseModel):
    """OpenAI routes: unknown fields are kept so the route can refuse them by name (400)."""
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    def unknown_fields(self, prefix: str = "") -> list[str]:
        out = [prefix + k for k in (self.model_extra or {})]
        for name in type(self).model_fields:
            v = getattr(self, name)
            alias = type(self).model_fields[name].alias or name
            if isinstance(v, _OpenAIModel):
                out += v.unknown_fields(f"{prefix}{alias}.")
            elif isinstance(v, list):
                for i, item in enumerate(v):
                    if isinstance(item, _OpenAIModel):
                        out += item.unknown_fields(f"{prefix}{alias}.{i}.")
        return out


class StreamOptions(_OpenAIModel):
    include_usage: Optional[StrictBool] = None


class JSONSchemaFormat(_OpenAIModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None  # the output is always held to the schema


class ResponseFormat(_OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema: required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("response_format.json_schema: only allowed when type is 'json_schema'")
        return self


class _SamplingFields(_OpenAIModel):
    model: Optional[StrictStr] = None
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]] = None
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]] = None
    n_predict: Optional[Annotated[StrictInt, Field(ge=-1, le=MAX_TOKENS_LIMIT)]] = None  # llama.cpp
    temperature: Optional[Annotated[float, Field(ge=0.0, le=100.0)]] = None  # unset/0: greedy
    top_k: Optional[Annotated[StrictInt, Field(ge=0)]] = None  # 0: no top-k cut
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: Optional[StrictBool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[Annotated[StrictInt, Field(ge=1, le=1)]] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logit_bias: Optional[dict[StrictStr, Annotated[float, Field(ge=-100.0, le=100.0)]]] = None
    response_format: Optional[ResponseFormat] = None
    store: Optional[StrictBool] = None
    service_tier: Optional[StrictStr] = None
    user: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    metadata: Optional[dict[StrictStr, StrictStr]] = None
    ignore_eos: StrictBool = False  # llama-server extension: keep going past end-of-generation
    return_tokens: StrictBool = False  # llama-server extension: include generated token ids

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in stops:
            if s == "":
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
            _check_text(s, "stop")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for k in v:
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise ValueError(f"keys must be token ids written as decimal strings, not {k[:20]!r}")
        return v

    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    # ---- what the route refuses (400), by field name ------------------------------------
    def refusals(self) -> list[tuple[str, str]]:
        """(field, why) for every field that is set to something this server does not do."""
        out = [(f, "unrecognized request argument") for f in self.unknown_fields()]
        if self.store:
            out.append(("store", "this server stores nothing; only store: false is accepted"))
        if self.service_tier not in (None, "auto", "default"):
            out.append(("service_tier", "only 'auto' or 'default' (there is one tier)"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "only allowed when stream is true"))
        if self.response_format is not None and self.response_format.type != "text" and self.ignore_eos:
            out.append(("ignore_eos", "cannot be combined with a JSON response_format (the "
                                      "grammar ends the output)"))
        return out


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[TokenId]]
    # 0 only with echo: score the prompt, generate nothing (checked below)
    max_tokens: Optional[Annotated[StrictInt, Field(le=MAX_TOKENS_LIMIT)]] = None
    echo: Optional[StrictBool] = None
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if len(v) == 0:
            raise ValueError("must not be empty")
        if isinstance(v, str):
            _check_text(v, "prompt")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 0:
            raise ValueError("Input should be greater than or equal to 1")
        return v

    @model_validator(mode="after")
    def _zero_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo: true (prompt scoring); "
                             "otherwise it must be greater than or equal to 1")
        return self

    def refusals(self) -> list[tuple[str, str]]:
        out = super().refusals()
        if self.best_of not in (None, 1):
            out.append(("best_of", "only 1 (one candidate per request)"))
        if self.suffix:
            out.append(("suffix", "insertion (a suffix after the completion) is not supported"))
        return out


class TextPart(_OpenAIModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return _check_text(self.content, "messages.content")
        return "".join(_check_text(p.text, "messages.content") for p in self.content)


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage]
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[StrictBool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if len(v) == 0:
            raise ValueError("must not be empty")
        for m in v:
            m.text()  # surrogate check
        return v

    def refusals(self) -> list[tuple[str, str]]:
        out = super().refusals()
        why = "tool and function calling is not supported by this server"
        for f in ("tools", "functions"):
            if getattr(self, f):
                out.append((f, why))
        if self.tool_choice not in (None, "none"):
            out.append(("tool_choice", why + " (only 'none' is accepted)"))
        if self.function_call not in (None, "none"):
            out.append(("function_call", why + " (only 'none' is accepted)"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "needs logprobs: true"))
        return out


class PrefillRequest(_Request):
    model: Optional[StrictStr] = None
    prompt: Optional[Union[StrictStr, list[TokenId]]] = None
    n_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]] = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**32 - 1)] = 0  # for the synthetic ids

    @model_validator(mode="after")
    def _one_source(self):
        if (self.prompt is None) == (self.n_tokens is None):
            raise ValueError("prompt, n_tokens: give exactly one of prompt or n_tokens")
        if self.prompt is not None and len(self.prompt) == 0:
            raise ValueError("prompt: must not be empty")
        if isinstance(self.prompt, str):
            _check_text(self.prompt, "prompt")
        return self


class TokenizeRequest(_Request):
    content: StrictStr
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return _check_text(v, "content")


class DetokenizeRequest(_Request):
    tokens: list[TokenId]


# ---- responses (plain dicts are built in app.py; these document the shapes) ---------------

class Timings(BaseModel):
    prompt_n: int
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


def timings_dict(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict[str, Any]:
    def rate(n: int, ms: float) -> float:
        return n / (ms / 1000.0) if ms > 0 else 0.0

    return Timings(prompt_n=prompt_n, prompt_ms=prompt_ms,
                   prompt_per_second=rate(prompt_n, prompt_ms), predicted_n=predicted_n,
                   predicted_ms=predicted_ms,
                   predicted_per_second=rate(predicted_n, predicted_ms)).model_dump()


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache reused."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)).model_dump()

"""Request / response models (OpenAI shapes plus llama-server's `timings`).

Requests are strict (no "5" -> 5, no true -> 1) so a wrong type is a 422 that names the field;
unknown fields are ignored, as OpenAI clients send many. `model` is only echoed: no request
field is ever used as a file path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

MAX_TOKENS_LIMIT = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


def _check_text(value: str, field: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} contains an unpaired UTF-16 surrogate (not valid Unicode)") from None
    return value


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _SamplingFields(_Request):
    model: Optional[StrictStr] = None
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0  # 0: no top-k cut
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Optional[Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: bool = False
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    ignore_eos: bool = False  # llama-server extension: keep going past end-of-generation
    return_tokens: bool = False  # llama-server extension: include generated token ids

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

    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[TokenId]]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if len(v) == 0:
            raise ValueError("must not be empty")
        if isinstance(v, str):
            _check_text(v, "prompt")
        return v


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
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

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if len(v) == 0:
            raise ValueError("must not be empty")
        for m in v:
            m.text()  # surrogate check
        return v


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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def timings_dict(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict[str, Any]:
    def rate(n: int, ms: float) -> float:
        return n / (ms / 1000.0) if ms > 0 else 0.0

    return Timings(prompt_n=prompt_n, prompt_ms=prompt_ms,
                   prompt_per_second=rate(prompt_n, prompt_ms), predicted_n=predicted_n,
                   predicted_ms=predicted_ms,
                   predicted_per_second=rate(predicted_n, predicted_ms)).model_dump()


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens).model_dump()

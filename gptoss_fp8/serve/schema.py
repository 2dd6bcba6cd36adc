"""Request bodies of the OpenAI API this server takes (pydantic): unknown fields are refused, so
a misspelt parameter is a 400 rather than silently ignored. Fields the OpenAI API has but this
server does not implement are accepted only at their neutral value (``echo`` false)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gptoss_fp8.errors import GptOssFp8Error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)  # choices, each a sequence of its own (at most the server's slots)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id (a JSON key: its digits) -> -100 to 100
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)  # vLLM's extension (1: none)
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the stop tokens (benchmarks)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is not None and len(v) > 300:
            raise ValueError("at most 300 tokens")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        for i, m in enumerate(v):
            if "role" not in m:
                raise ValueError(f"message {i} has no role")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        for i, t in enumerate(v or []):
            if t.get("type") != "function" or not isinstance(t.get("function"), dict) or "name" not in t["function"]:
                raise ValueError(f"tool {i}: give {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        return v


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the chosen token's, and that many alternatives
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request (n prompts: n requests)")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v


def parse(cls: type[_Strict], body: bytes) -> _Strict:
    """The body as ``cls``, or GptOssFp8Error with one line: what is wrong, where."""
    import json

    try:
        obj = json.loads(body)
    except ValueError as e:
        raise GptOssFp8Error(f"the body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise GptOssFp8Error("the body must be a JSON object")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise GptOssFp8Error(f"{where}: {msg}{more}".replace("\n", " ")) from None

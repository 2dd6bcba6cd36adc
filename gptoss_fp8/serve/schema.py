"""Request bodies of the OpenAI API this server takes (pydantic): unknown fields are refused, so
a misspelt parameter is a 400 rather than silently ignored. Fields the OpenAI API has but this
server does not implement are accepted only at their neutral value (``echo`` false)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from gptoss_fp8.errors import GptOssFp8Error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # (JSON has no NaN; Python's reader takes one)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)  # (an int64; choice i draws with seed + i)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)  # choices, each a sequence of its own (at most the server's slots)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id (a JSON key: its digits) -> -100 to 100
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)  # vLLM's extension (1: none)
    user: str | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens whatever the stop tokens (benchmarks)

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
    # auto, none, required, or {"type": "function", "function": {"name": ...}} (serve/grammar.py)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        for i, m in enumerate(v):
            if "role" not in m:
                raise ValueError(f"message {i} has no role")
            if m["role"] in ("system", "developer", "user", "tool") and m.get("content") is None:
                raise ValueError(f"message {i} ({m['role']}) has no content")
            if m["role"] == "assistant" and not any(m.get(k) is not None for k in ("content", "tool_calls",
                                                                                  "reasoning_content")):
                raise ValueError(f"message {i} (assistant) has neither content nor tool_calls")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        for i, t in enumerate(v or []):
            if t.get("type") != "function" or not isinstance(t.get("function"), dict) or "name" not in t["function"]:
                raise ValueError(f"tool {i}: give {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        return v


class CompletionRequest(_Sampling):
    # OpenAI's legacy default (the chat APIs' is the rest of the context); null asks for the rest of the context
    max_tokens: int | None = Field(default=16, ge=1)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # (token ids: true is not 1)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the chosen token's, and that many alternatives
    echo: Literal[False] = False
    response_format: dict[str, Any] | None = None  # (vLLM's extension: the completion is that JSON, serve/grammar.py)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if not (isinstance(v, str) or ids(v) or (isinstance(v, list) and all(isinstance(x, str) or ids(x) for x in v))):
            raise ValueError("give a string or a list of token ids (integers), or a list holding one of those")
        return v

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


MAX_BODY = 16 << 20  # bytes: far more than any context's text (131072 tokens of prose are ~0.5 MB)
# The tokenizer (openai-harmony's tiktoken, which holds the GIL: the whole server waits) takes time in the square of a
# piece's bytes, a piece being a run of letters, of whitespace or of punctuation (64 KB of "a": 1.4 s on the 2-core
# box; ~1 MB: it panics). A request's runs of RUN_MIN or more characters may cost RUN_BUDGET bytes^2 in all (~1 s).
RUN_MIN, RUN_BUDGET = 1024, 3 << 30
TEXT_SLACK = 256 << 10  # (check_text's context rule)
# (each run matched from its first character only: the lookbehinds keep the scan linear)
_RUNS = re.compile(rf"(?<![^\W\d_])[^\W\d_]{{{RUN_MIN},}}|(?<!\s)\s{{{RUN_MIN},}}|(?<![^\w\s])[^\w\s]{{{RUN_MIN},}}")


def _long_runs(text: str):
    """(start, characters, bytes) of each run of RUN_MIN or more letters, whitespace or punctuation characters."""
    for m in _RUNS.finditer(text):
        yield m.start(), m.end() - m.start(), len(m.group().encode("utf-8", "surrogatepass"))


def check_text(obj, where: str = "", context: tuple[int, int] | None = None) -> None:
    """Every string of a request's JSON is text the tokenizer can take: valid Unicode (no lone UTF-16 surrogate, which
    JSON's \\ud800 escapes can make) and no runs of letters, whitespace or punctuation long enough to stall it
    (RUN_BUDGET); else one line naming the field. ``context``: (the server's context in tokens, the most bytes a token
    of its vocabulary holds): strings of more bytes than that many tokens can hold are refused before any tokenizing
    (beyond TEXT_SLACK bytes for what a prompt does not hold: the model's name, a schema, stop strings), whatever part of
    them the prompt would take: such a request cannot fit."""
    stack, texts, size = [(obj, where)], [], 0
    while stack:
        v, at = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, f"{at}.{k}" if at else str(k)) for k, x in v.items())
            stack.extend((k, f"{at or 'body'} (a key)") for k in v if isinstance(k, str))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, str):
            try:
                size += len(v.encode("utf-8"))
            except UnicodeEncodeError as e:
                raise GptOssFp8Error(f"{at or 'body'}: character {e.start} is a lone UTF-16 surrogate ({v[e.start]!r}), not "
                                     "Unicode text; send valid UTF-8") from None
            texts.append((v, at or "body"))
    if context is not None and size > context[0] * context[1] + TEXT_SLACK:  # (first: the cheap bound)
        raise GptOssFp8Error(f"the request holds {size} bytes of text, more than a context of {context[0]} tokens "
                             f"(--max-context) can: a token holds at most {context[1]} bytes (and {TEXT_SLACK} bytes "
                             "are allowed beside the prompt); send less")
    cost = 0
    for v, at in texts:
        for start, n, nbytes in _long_runs(v):
            cost += nbytes * nbytes
            if cost > RUN_BUDGET:
                raise GptOssFp8Error(f"{at}: runs of characters without a break too long for the tokenizer to take in "
                                     f"reasonable time (here {n} from character {start}; letters, spaces or "
                                     "punctuation alike); break them up (a space, a newline)")


def parse(cls: type[_Strict], body: bytes, context: tuple[int, int] | None = None) -> _Strict:
    """The body as ``cls``, or GptOssFp8Error with one line: what is wrong, where (``context``: ``check_text``'s)."""
    import json

    if len(body) > MAX_BODY:
        raise GptOssFp8Error(f"the body has {len(body)} bytes; this server takes at most {MAX_BODY} (16 MiB)")
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise GptOssFp8Error(f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise GptOssFp8Error("the body's JSON nests deeper than this server reads (about 1000 levels)") from None
    if not isinstance(obj, dict):
        raise GptOssFp8Error("the body must be a JSON object")
    check_text(obj, context=context)
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise GptOssFp8Error(f"{where}: {msg}{more}".replace("\n", " ")) from None


class Reasoning(_Strict):
    effort: Literal["low", "medium", "high"] | None = None
    # (accepted for the clients that send one, Codex among them: the model writes no summaries, so ``summary`` stays
    # [] and its raw reasoning comes as the reasoning item's ``content``, as OpenAI specifies for open-weight models)
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None  # (json_schema's)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None

    def as_dict(self) -> dict:
        return {"type": self.type, "schema": self.schema_}


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: StrictBool = True


INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: OpenAI's Responses API, the one gpt-oss was made for (serve/responses.py).
    Accepted at their neutral value only: ``background`` false, ``truncation`` disabled."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None  # or {"type": "function", "name"}
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    stream: StrictBool = False
    stream_options: ResponsesStreamOptions | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] = False
    service_tier: Literal["auto", "default"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # (the prefix cache needs no key: any earlier prompt's start is found)

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the input is empty")
            for i, item in enumerate(v):
                kind = item.get("type", "message")
                if kind == "message" and "role" not in item:
                    raise ValueError(f"item {i} is a message without a role")
                if kind not in ("message", "reasoning", "function_call", "function_call_output"):
                    raise ValueError(f"item {i} of type {kind!r}: give message, reasoning, function_call or "
                                     "function_call_output items")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        for i, t in enumerate(v or []):
            if t.get("type") != "function" or "name" not in t:
                raise ValueError(f"tool {i}: only function tools are served, as {{'type': 'function', 'name': ..., "
                                 "'parameters': ...}} (built-in tools such as web search run in the client)")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None and len(v) > 16:
            raise ValueError("at most 16 keys")
        return v

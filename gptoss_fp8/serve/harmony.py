"""Harmony for the chat API: OpenAI messages and tools -> prompt token ids, reply ids -> deltas.

Rendering (``render_chat_head``): the system message carries ``reasoning_effort``; the request's
system / developer messages become the developer message's instructions, and ``tools`` (function
definitions) its ``functions`` namespace; user turns as they are; an assistant turn's content on
the ``final`` channel, its reasoning (``reasoning_content``) on ``analysis``, each of its tool
calls a ``commentary`` message to ``functions.NAME`` (JSON arguments); a ``tool`` message is the
function's reply (author ``functions.NAME``, found from the call id), addressed to the assistant.

Parsing (``ReplyStream``): the generated ids through harmony's ``StreamableParser``, one at a
time, into deltas: text on the ``final`` channel (or no channel) is ``content``, the ``analysis``
channel is ``reasoning_content``, a message to ``functions.NAME`` is a tool call (its name, then
its arguments as they come). Ids that are not well-formed Harmony (synthetic weights give noise)
switch the stream to plain text: the rest is ``content`` as decoded.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from gptoss_fp8.errors import GptOssFp8Error

RETURN, CALL, ENDOFTEXT = 200002, 200012, 199999
STOP_IDS = (RETURN, CALL)  # harmony's stop_tokens_for_assistant_actions
EFFORTS = ("low", "medium", "high")


@lru_cache(maxsize=1)
def encoding():
    """The o200k_harmony encoding, offline (verify/prompt.py unpacks o200k from bpe-openai)."""
    from gptoss_fp8.verify.prompt import INSTALL, ensure_o200k

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(ensure_o200k())
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError:
        raise GptOssFp8Error(f"serve needs openai-harmony; run: {INSTALL}") from None
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _text(content) -> str:
    """An OpenAI message content: a string, None, or a list of parts (text parts only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise GptOssFp8Error("a message's content must be a string or a list of content parts ({'type': 'text', "
                             "'text': ...})")
    out = []
    for part in content:
        if part.get("type") != "text":
            raise GptOssFp8Error(f"message content part of type {part.get('type')!r}: only text is supported")
        if not isinstance(part.get("text", ""), str):
            raise GptOssFp8Error("a message's text content part has a text that is not a string")
        out.append(part.get("text", ""))
    return "".join(out)


def _calls(m: dict) -> list[dict]:
    """An assistant message's tool calls, checked: each {"id", "function": {"name", "arguments": the JSON text}}."""
    calls = m.get("tool_calls") or []
    for call in calls if isinstance(calls, list) else [None]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise GptOssFp8Error("an assistant message's tool_calls must be a list of {'id': ..., 'function': {'name': "
                                 "..., 'arguments': ...}}")
        if not isinstance(fn.get("arguments", ""), str):
            raise GptOssFp8Error(f"tool call of {fn['name']!r}: function.arguments must be a string (the arguments' JSON "
                                 f"text), got {type(fn['arguments']).__name__}")
    return calls


def render_chat_head(messages: list[dict], tools: list[dict] | None = None,
                     reasoning_effort: str | None = None) -> tuple[list[int], int]:
    """OpenAI chat messages (dicts) -> (prompt token ids ending with ``<|start|>assistant``, the length of its head: the
    system and developer messages, which requests with the same instructions and tools share; 0 if the rendering does
    not start with them on its own)."""
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    enc = encoding()
    system = SystemContent.new()
    if reasoning_effort is not None:
        system = system.with_reasoning_effort({"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
                                               "high": ReasoningEffort.HIGH}[reasoning_effort])
    instructions = [_text(m.get("content")) for m in messages if m["role"] in ("system", "developer")]
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools([ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                                               parameters=t["function"].get("parameters"))
                                           for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    out += _turns(messages, {})
    prompt = list(enc.render_conversation_for_completion(Conversation.from_messages(out), Role.ASSISTANT))
    head = list(enc.render_conversation(Conversation.from_messages(out[:2 if instructions or tools else 1])))
    return prompt, len(head) if prompt[:len(head)] == head else 0


def _turns(messages: list[dict], call_names: dict[str, str]) -> list:
    """The chat messages past the system and developer ones as Harmony messages (``call_names``: tool call id ->
    function name, filled from the assistant turns' calls, for the tool messages that answer them)."""
    from openai_harmony import Author, Message, Role

    out = []
    for m in messages:
        role = m["role"]
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(m.get("content"))))
        elif role == "assistant":
            if m.get("reasoning_content"):
                if not isinstance(m["reasoning_content"], str):
                    raise GptOssFp8Error("an assistant message's reasoning_content must be a string")
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"]).with_channel("analysis"))
            calls = _calls(m)
            text = _text(m.get("content"))
            # the text of a turn that calls a tool is the preamble the model wrote before its call (a reply ends at a
            # call, so no final answer comes with one): on the commentary channel, before the calls, as it came
            # (``channel``: the Responses API's message items say which)
            if text and calls:
                out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(m.get("channel", "commentary")))
            for call in calls:
                name = call["function"]["name"]
                call_names[call.get("id", "")] = name
                out.append(Message.from_role_and_content(Role.ASSISTANT, call["function"].get("arguments", ""))
                           .with_channel("commentary").with_recipient(f"functions.{name}")
                           .with_content_type("<|constrain|>json"))
            if text and not calls:
                out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(m.get("channel", "final")))
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id", ""))
            if name is None:
                raise GptOssFp8Error(f"a tool result for call id {m.get('tool_call_id')!r} (chat: a tool message's "
                                     "tool_call_id; Responses: a function_call_output's call_id) answers no tool call "
                                     "before it")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), _text(m.get("content")))
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise GptOssFp8Error(f"message role {role!r}: use system, developer, user, assistant or tool")
    return out


def call_names(messages: list[dict]) -> dict[str, str]:
    """Tool call id -> function name of the assistant turns' calls in chat messages."""
    return {call.get("id", ""): call["function"]["name"] for m in messages if m["role"] == "assistant"
            for call in _calls(m)}


def render_after_call(messages: list[dict], names: dict[str, str]) -> list[int]:
    """Token ids of chat messages that follow a reply the model ended with a tool call (``<|call|>``), then
    ``<|start|>assistant``: the next prompt is that prompt, the reply's own ids, then these (the Responses API's
    ``previous_response_id``; ``names``: the earlier calls' function names by id). Harmony keeps a tool chain's
    reasoning, so nothing before it changes; system or developer messages cannot come here (one line)."""
    if any(m["role"] in ("system", "developer") for m in messages):
        raise GptOssFp8Error("a system or developer message after a tool call: render the whole conversation")
    enc = encoding()
    ids = [t for m in _turns(messages, dict(names)) for t in enc.render(m)]
    return ids + enc.encode("<|start|>assistant", allowed_special="all")


@lru_cache(maxsize=1 << 16)
def token_bytes(tok: int) -> bytes:
    """The bytes of one token id (special tokens: their text), possibly part of a UTF-8 character."""
    return encoding().decode([tok], errors="surrogateescape").encode("utf-8", "surrogateescape")


@lru_cache(maxsize=1 << 16)
def token_text(tok: int) -> str:
    """One token id's text on its own (bytes that are part of a character: U+FFFD)."""
    return encoding().decode([tok])


def token_logprob(tok: int, lp: float, top: list[tuple[int, float]] = ()) -> dict:
    """The chat and Responses APIs' entry for one token: its text, log-probability and bytes (the token's own: part of
    a character too), with its alternatives the same way."""
    entry = _token_entry(tok, lp)
    entry["top_logprobs"] = [_token_entry(t, v) for t, v in top]
    return entry


def _token_entry(tok: int, lp: float) -> dict:
    return {"token": token_text(tok), "logprob": lp, "bytes": list(token_bytes(tok))}


class TextStream:
    """Generated ids -> text pieces, one id at a time, in O(1) per id: each id's bytes through an
    incremental UTF-8 decoder, so a character split across ids comes out with its last byte and
    bytes that are not UTF-8 come out as U+FFFD (the text of all pieces and ``flush`` is
    ``encoding().decode(ids)``). ``id_bytes``: another vocabulary's (serve/vocab.py)."""

    def __init__(self, id_bytes: Callable[[int], bytes] | None = None):
        self._bytes = id_bytes or token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, tok: int) -> str:
        return self._dec.decode(self._bytes(tok))

    def flush(self) -> str:
        return self._dec.decode(b"", True)


@dataclass
class Delta:
    """One piece of a reply: ``kind`` content / reasoning / tool_call (a new call: ``name``) /
    tool_args (more of call ``index``'s arguments) / end (the Harmony message the pieces before it belong to ended:
    the Responses API makes each message an output item of its own)."""

    kind: str
    text: str = ""
    index: int = 0
    name: str = ""
    channel: str | None = None  # content: the Harmony channel it came on (final, commentary; None: no channel)


@dataclass
class ReplyStream:
    """Reply ids -> Deltas, one id at a time (module docstring)."""

    parser: object = None
    raw: TextStream | None = None  # not Harmony: the ids since the switch, decoded as plain text
    calls: int = 0
    _in_call: bool = False
    _ended: int = 0  # Harmony messages ended so far
    _recipient: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments"} in order

    def __post_init__(self):
        from openai_harmony import Role, StreamableParser

        self.parser = StreamableParser(encoding(), Role.ASSISTANT)

    def push(self, tok: int) -> list[Delta]:
        if self.raw is not None:
            return self._raw(tok)
        from openai_harmony import HarmonyError

        try:
            self.parser.process(tok)
        except HarmonyError:
            self.raw = TextStream()
            return self._raw(tok)
        out: list[Delta] = []
        rec = self.parser.current_recipient
        if rec != self._recipient:  # a new message, or the header's recipient appeared
            self._recipient = rec
            self._in_call = bool(rec and rec.startswith("functions."))
            if self._in_call:
                name = rec.removeprefix("functions.")
                self.tool_calls.append({"name": name, "arguments": ""})
                out.append(Delta("tool_call", index=len(self.tool_calls) - 1, name=name))
        piece = self.parser.last_content_delta
        if piece:
            if self._in_call:
                self.tool_calls[-1]["arguments"] += piece
                out.append(Delta("tool_args", piece, index=len(self.tool_calls) - 1))
            elif self.parser.current_channel == "analysis":
                out.append(Delta("reasoning", piece))
            elif rec is None or rec == "assistant" or rec == "user":
                out.append(Delta("content", piece, channel=self.parser.current_channel))
        if len(self.parser.messages) > self._ended:
            self._ended = len(self.parser.messages)
            out.append(Delta("end"))
        return out

    def _raw(self, tok: int) -> list[Delta]:
        if tok in (RETURN, CALL, ENDOFTEXT):
            return []
        piece = self.raw.push(tok)
        return [Delta("content", piece)] if piece else []


class StopText:
    """Stop sequences on streamed text: ``push`` returns what may be shown now (holding back a
    tail that could start a stop sequence) and whether a stop sequence ended it."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        cut = max(0, len(self.buf) - self.keep)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out

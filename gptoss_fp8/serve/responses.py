"""OpenAI's Responses API (``POST /v1/responses``; ``GET`` / ``DELETE /v1/responses/{id}``): the API gpt-oss was
trained for, over the same engine as the chat API.

Input (``messages``): ``instructions`` become the developer message's, then a stored previous response's
conversation (``previous_response_id``: its input and output items; its ``instructions`` are not carried over, as
OpenAI's API does), then the request's items: messages (system / developer text joins the instructions), reasoning
items (their ``reasoning_text`` content, or the ``encrypted_content`` this server wrote), function calls and their
outputs. They become chat messages for ``harmony.render_chat_head``, so the prompt is the one a chat request with the
same conversation gets (and the prefix cache reuses a previous turn's prompt and reply the same way).

Output (``ResponseReply``): the reply's ids through Harmony (``harmony.ReplyStream``), each Harmony message an output
item: the ``analysis`` channel a ``reasoning`` item (its text as ``content`` of ``reasoning_text``: the model writes no
summaries, so ``summary`` is []), text on the ``final`` or ``commentary`` channel a ``message`` item (``phase``
``final_answer`` / ``commentary``: a preamble before tool calls), a message to ``functions.NAME`` a ``function_call``
item. Streamed, the events are OpenAI's: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its content part's ``added``, the text's ``delta`` events, their ``done``,
``response.output_item.done``, and at the end ``response.completed`` (``response.incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` at the token limit, ``response.failed`` if the engine failed the
request), each with a ``sequence_number``.

Stored responses (``store``, OpenAI's default true) are kept in this process's memory (``ResponseStore``: the latest
``STORED`` of them), not on disk: a restarted server has none, and an unknown ``previous_response_id`` is a 404.
A response the model ended with a tool call also keeps its prompt's and reply's token ids: a next request with the
same instructions, tools and effort then goes on from the model's own tokens (the call's header as the model wrote
it, which Harmony's renderer writes another way), so its prompt starts with the whole earlier prompt and reply and
the prefix cache gives all of it back (an agent's tool loop prefills only each tool's output).
"""

from __future__ import annotations

import base64
import copy
import json
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.serve import harmony

STORED = 4096  # responses kept for previous_response_id / GET, least recently stored dropped first
STORED_TOKENS = 1 << 25  # their token ids kept, in all (4 bytes each: 128 MiB)
_OPAQUE = "gptoss-fp8:"  # encrypted_content's prefix: the reasoning's text, base64, not encrypted (module docstring)


def _text(content, where: str, name: str = "content") -> str:
    """An item's content: a string or a list of text parts (input_text, output_text, text, refusal)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise GptOssFp8Error(f"{where}: {name} must be a string or a list of content parts (objects with a type)")
    out = []
    for part in content:
        kind = part.get("type")
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise GptOssFp8Error(f"{where}: a content part of type {kind!r}; only text is supported")
        out.append(part.get("refusal" if kind == "refusal" else "text") or "")
    return "".join(out)


def _reasoning(item: dict, where: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else the ``encrypted_content`` this server wrote,
    else its summary's text."""
    if item.get("content"):
        return "".join(_parts(item["content"], "content", where))
    sealed = item.get("encrypted_content")
    if sealed:
        if not isinstance(sealed, str):
            raise GptOssFp8Error(f"{where}: encrypted_content must be a string")
        if not sealed.startswith(_OPAQUE):
            raise GptOssFp8Error(f"{where}: encrypted_content this server did not write (another provider's): send "
                                 "the item's content instead, or leave the item out")
        try:
            return base64.b64decode(sealed[len(_OPAQUE):], validate=True).decode()
        except (ValueError, UnicodeDecodeError):  # (binascii.Error is a ValueError)
            raise GptOssFp8Error(f"{where}: encrypted_content is damaged (not this server's base64 text): send it as "
                                 "this server returned it, or leave the item out") from None
    return "".join(_parts(item.get("summary") or [], "summary", where))


def _strings(item: dict, keys: tuple[str, ...], where: str) -> None:
    bad = next((k for k in keys if k in item and not isinstance(item[k], str)), None)
    if bad is not None:
        raise GptOssFp8Error(f"{where} ({item.get('type')}): {bad} must be a string, got {type(item[bad]).__name__}")


def _parts(parts, name: str, where: str) -> list[str]:
    """A reasoning item's content or summary: a list of {"type", "text"} parts -> their texts."""
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts):
        raise GptOssFp8Error(f"{where}: {name} must be a list of parts with a text string each")
    return [p.get("text", "") for p in parts]


def input_messages(items: str | list[dict]) -> list[dict]:
    """A request's input (a string: one user message) -> chat messages (``harmony.render_chat_head``'s form); one line
    naming the item when one cannot be."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input item {i}"
        try:
            if kind == "message":
                if item["role"] not in ("user", "assistant", "system", "developer"):
                    raise GptOssFp8Error(f"{where}: role {item['role']!r}; use user, assistant, system or developer (a "
                                         "tool's result is a function_call_output item)")
                out.append({"role": item["role"], "content": _text(item.get("content"), where)})
                if item["role"] == "assistant" and item.get("phase") == "commentary":  # a preamble stays one
                    out[-1]["channel"] = "commentary"
            elif kind == "reasoning":
                text = _reasoning(item, where)
                if text:
                    out.append({"role": "assistant", "reasoning_content": text})
            elif kind == "function_call":
                _strings(item, ("call_id", "name", "arguments"), where)
                out.append({"role": "assistant", "tool_calls": [
                    {"id": item["call_id"], "function": {"name": item["name"], "arguments": item.get("arguments", "")}}]})
            else:  # function_call_output
                _strings(item, ("call_id",), where)
                output = item["output"]
                out.append({"role": "tool", "tool_call_id": item["call_id"],
                            "content": output if isinstance(output, str) else _text(output, where, "output")})
        except KeyError as e:
            raise GptOssFp8Error(f"{where} ({kind}) has no {e.args[0]!r}") from None
    return out


def input_items(items: str | list[dict]) -> list[dict]:
    """A request's input as the items ``GET /v1/responses/{id}/input_items`` lists: a string as one user message,
    a message's text content as a part, every item with an id."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for item in items:
        item = {"type": "message", **item} if "type" not in item else dict(item)
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", _id({"message": "msg", "reasoning": "rs", "function_call": "fc"}.get(item["type"], "fco")))
        out.append(item)
    return out


def page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """One page of a list endpoint (OpenAI's cursor form: ``after`` an item id, ``has_more``)."""
    items = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise GptOssFp8Error(f"after: no input item {after!r} in this response")
        items = items[at + 1:]
    got = items[:limit]
    return {"object": "list", "data": got, "first_id": got[0]["id"] if got else None,
            "last_id": got[-1]["id"] if got else None, "has_more": len(items) > limit}


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """The Responses API's function tools (flat) in the chat API's form (``{"function": {...}}``)."""
    if not tools:
        return None
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}
            for t in tools]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseReply:
    """One response under construction: ``feed`` each engine Event; ``take`` returns the stream events since the
    last take; ``finish`` closes the open item and returns the whole response. ``logprobs`` / ``top``: each output
    text token's log-probability and that many alternatives (``include`` message.output_text.logprobs)."""

    def __init__(self, response: dict, logprobs: bool, top: int, seal: bool):
        self.response, self.logprobs, self.top, self.seal = response, logprobs, top, seal
        self.reply = harmony.ReplyStream()
        self.items: list[dict] = []
        self.open: dict | None = None
        self.events: list[dict] = []
        self.seq = 0  # the next event's sequence_number
        self.n_out = self.reasoning_tokens = 0
        self.ids: list[int] = []  # the reply's token ids

    # --- events ---------------------------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1

    def take(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict) -> None:
        self._close()
        item["status"] = "in_progress"
        self.items.append(item)
        self.open = item
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))
        if item["type"] == "message":
            self.open["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        elif item["type"] == "reasoning":
            self.open["content"].append({"type": "reasoning_text", "text": ""})
        else:
            return
        self.emit("response.content_part.added", **self._where(), content_index=0,
                  part={**self.open["content"][0], "text": ""})

    def _close(self, status: str = "completed") -> None:
        item = self.open
        if item is None:
            return
        where = self._where()
        if item["type"] == "function_call":
            self.emit("response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self.emit("response.output_text.done", **where, content_index=0, text=part["text"],
                          logprobs=part["logprobs"])
            else:
                self.emit("response.reasoning_text.done", **where, content_index=0, text=part["text"])
                if self.seal:
                    item["encrypted_content"] = _OPAQUE + base64.b64encode(part["text"].encode()).decode()
            self.emit("response.content_part.done", **where, content_index=0, part=copy.deepcopy(part))
        item["status"] = status
        self.emit("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item))
        self.open = None

    def _is_open(self, kind: str, phase: str | None = None) -> bool:
        return self.open is not None and self.open["type"] == kind and self.open.get("phase") == phase

    # --- the engine's tokens --------------------------------------------------------------------
    def feed(self, ev) -> None:
        self.ids += ev.new
        for i, tok in enumerate(ev.new):
            self.n_out += 1
            lp = None
            if self.logprobs and ev.logprobs:
                lp = harmony.token_logprob(tok, ev.logprobs[i], (ev.top_logprobs[i] if ev.top_logprobs else [])[:self.top])
            for d in self.reply.push(tok):
                if d.kind == "reasoning":
                    if not self._is_open("reasoning"):
                        self._start({"type": "reasoning", "id": _id("rs"), "summary": [], "content": []})
                    self.open["content"][0]["text"] += d.text
                    self.reasoning_tokens += 1
                    self.emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=d.text)
                elif d.kind == "content":
                    phase = "commentary" if d.channel == "commentary" else "final_answer"
                    if not self._is_open("message", phase):
                        self._start({"type": "message", "id": _id("msg"), "role": "assistant", "phase": phase,
                                     "content": []})
                    part = self.open["content"][0]
                    part["text"] += d.text
                    if lp is not None:
                        part["logprobs"].append(lp)
                    self.emit("response.output_text.delta", **self._where(), content_index=0, delta=d.text,
                              logprobs=[lp] if lp is not None else [])
                    lp = None  # (a token's entry goes with its first piece)
                elif d.kind == "tool_call":
                    self._start({"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": d.name,
                                 "arguments": ""})
                elif d.kind == "tool_args":
                    self.open["arguments"] += d.text
                    self.emit("response.function_call_arguments.delta", **self._where(), delta=d.text)
                elif d.kind == "end":
                    self._close()

    def finish(self, ev, prompt_tokens: int, cached: int) -> dict:
        """The response once the engine finished the request (``ev``: its last Event): status completed, or
        incomplete at the token limit (its open item too), or failed; the closing event queued."""
        length = ev.finish == "length"
        self._close("incomplete" if length or ev.finish == "error" else "completed")
        r = self.response
        r["output"] = self.items
        r["completed_at"] = int(time.time())
        r["usage"] = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": self.n_out, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": prompt_tokens + self.n_out}
        if ev.finish == "error":
            r["status"], r["error"] = "failed", {"code": "server_error", "message": ev.error or "the request failed"}
            self.emit("response.failed", response=copy.deepcopy(r))
        elif length:
            r["status"], r["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            self.emit("response.incomplete", response=copy.deepcopy(r))
        else:
            r["status"] = "completed"
            self.emit("response.completed", response=copy.deepcopy(r))
        return r

    def conversation(self) -> list[dict]:
        """The output items as chat messages: what a next request with ``previous_response_id`` renders after the
        input."""
        out = []
        for item in self.items:
            if item["type"] == "reasoning":
                out.append({"role": "assistant", "reasoning_content": item["content"][0]["text"]})
            elif item["type"] == "message":
                out.append({"role": "assistant", "content": item["content"][0]["text"],
                            "channel": "commentary" if item["phase"] == "commentary" else "final"})
            else:
                out.append({"role": "assistant", "tool_calls": [
                    {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}]})
        return out


def new_response(req, model: str) -> dict:
    """A response object at its start (status in_progress, no output), echoing the request's settings."""
    return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text
                     else {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_logprobs": req.top_logprobs, "truncation": "disabled", "user": req.user, "background": False,
            "service_tier": "default", "usage": None}


@dataclass
class Stored:
    """A stored response: the response object, its whole conversation (chat messages, instructions left out), and
    when the model ended it with a tool call, the prompt's and the reply's token ids (``tokens``, int32) with the
    header they were rendered under (``header``: instructions, tools, effort) and its length (``keep``): a next
    request with the same header goes on from those very ids (``harmony.render_after_call``)."""

    response: dict
    conversation: list[dict]
    tokens: array | None = None
    header: tuple = ()
    keep: int = 0
    items: list[dict] = field(default_factory=list)  # the request's input items, each with an id (input_items)


def header_key(instructions: str | None, tools: list[dict] | None, effort: str | None) -> tuple:
    """What a request's system and developer messages are rendered from."""
    return instructions or "", json.dumps(tools or [], sort_keys=True), effort


class ResponseStore:
    """Stored responses by id (the event loop's thread only), the latest ``limit`` of them, and their token ids up to
    ``max_tokens`` in all (the oldest dropped first)."""

    def __init__(self, limit: int = STORED, max_tokens: int = STORED_TOKENS):
        self.limit, self.max_tokens = limit, max_tokens
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._tokens = 0

    def put(self, entry: Stored) -> None:
        self._kept[entry.response["id"]] = entry
        self._tokens += len(entry.tokens or ())
        while len(self._kept) > self.limit or self._tokens > self.max_tokens:
            _, old = self._kept.popitem(last=False)
            self._tokens -= len(old.tokens or ())

    def get(self, rid: str) -> Stored | None:
        return self._kept.get(rid)

    def pop(self, rid: str) -> bool:
        old = self._kept.pop(rid, None)
        self._tokens -= len(old.tokens or ()) if old is not None else 0
        return old is not None

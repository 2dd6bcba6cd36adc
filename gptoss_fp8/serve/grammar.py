"""Structured output: a grammar over the whole Harmony reply, enforced token by token with llguidance.

gpt-oss answers in Harmony: it may reason (``analysis``) and write preambles (``commentary``) first, then ends with
a ``final`` message or a tool call. So the rule a JSON schema sets is not on the reply's first token but on the
final message's body (or a call's arguments), and the grammar (Lark, llguidance's dialect: ``<|name|>`` is that
special token) covers the whole reply::

    start: pre* last                    pre: analysis | preamble (a preamble only where a call may come)
    analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"
    final:    <|channel|> "final" <|message|> (TEXT | %json SCHEMA) <|return|>
    call:     <|channel|> "commentary to=functions.NAME " <|constrain|> "json" <|message|> (%json ARGS) <|call|>

``last`` is the final message and / or the calls the request allows: ``response_format`` / ``text.format`` JSON sets
the final body (a ``json_object`` is any object), ``tool_choice`` ``required`` or one named function leaves out the
final message (a call must come), ``none`` the calls, and a tool whose definition says ``strict`` has its arguments
held to its parameters' schema (the others' arguments are free text, as without a grammar). The engine checks each
freely drawn token with the request's ``Grammar`` (``check``, ~1 us) and asks for the allowed next tokens only where it
is refused (``allow``: one packed bit per token id, runtime/sampling.py ``Constraint``; ~1 ms inside a JSON string,
microseconds elsewhere), then feeds it the chosen one (engine.py ``DefaultSampler``).
The tokenizer it needs is the o200k_harmony vocabulary's token bytes (``tokenizer``, made once, ~1 s). A byte-level
model (the trained fixture: serve/vocab.py) has no Harmony, so its only grammar is the completions API's raw JSON
(``Format.raw``), over its 256 byte ids and its three specials (``</s>`` ends the reply once the JSON is whole).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.serve import harmony

ENDOFTEXT = harmony.ENDOFTEXT
FIRST_SPECIAL = 199998  # o200k_harmony's ids from here on are special tokens (<|startoftext|>, ..., reserved ones)
INSTALL = "pip install -e '.[serve]'"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GptOssFp8Error(f"structured output (response_format, tool_choice required) needs llguidance; run: {INSTALL}"
                             ) from None
    return llguidance


@lru_cache(maxsize=2)
def tokenizer(vocab: int, name: str = "o200k_harmony"):
    """llguidance's tokenizer of the served vocabulary (``name``, serve/vocab.py; ``vocab`` ids: the model's): each
    id's bytes (the special tokens' names), the special ids, and the vocabulary's encoder for text."""
    llg = _llguidance()
    if name == "byte-level":
        return llg.LLTokenizer(llg.TokenizerWrapper(_byte_tokens(vocab)), n_vocab=vocab)
    if vocab < harmony.CALL + 1:
        raise GptOssFp8Error(f"structured output needs the o200k_harmony vocabulary (gpt-oss's 201088 ids); this model "
                             f"has {vocab}")
    enc = harmony.encoding()

    class _Vocab:
        eos_token_id = ENDOFTEXT  # (never reached here: a reply ends at <|return|> / <|call|>, stop tokens)
        bos_token_id = None
        tokens = [enc.decode([i], errors="surrogateescape").encode("utf-8", "surrogateescape") for i in range(vocab)]
        special_token_ids = list(range(FIRST_SPECIAL, vocab))

        def __call__(self, text):
            if not isinstance(text, str):
                raise TypeError("text only")
            return enc.encode(text, allowed_special=set())

    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=vocab)


def _byte_tokens(vocab: int):
    """The byte-level vocabulary (ByT5's convention, gptoss_fp8/tokenizer.py) as llguidance's TokenizerWrapper takes it."""
    from gptoss_fp8.tokenizer import BYT5_IDS, ByteTokenizer

    bt = ByteTokenizer()
    if vocab != bt.vocab_size:
        raise GptOssFp8Error(f"a byte-level vocabulary has {bt.vocab_size} ids; this model has {vocab}")
    off = BYT5_IDS["offset"]
    names = {i: k for k, i in BYT5_IDS.items() if k != "offset"}

    class _Bytes:
        eos_token_id = BYT5_IDS["eos"]
        bos_token_id = None
        tokens = [f"<{names[i]}>".encode() for i in range(off)] + [bytes([b]) for b in range(256)]
        special_token_ids = list(range(off))

        def __call__(self, text):
            if not isinstance(text, str):
                raise TypeError("text only")
            return bt.encode(text)

    return _Bytes()


def _compact(schema: dict) -> str:
    """A JSON schema for ``%json``, its JSON held to one compact form (no whitespace between tokens, ``,`` and ``:``
    bare) unless it says otherwise in its own ``x-guidance``: free whitespace lets a model pad without end."""
    if not isinstance(schema, dict):
        raise GptOssFp8Error(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}})


@lru_cache(maxsize=1)
def _executor():
    return _llguidance().LLExecutor()


def _quote(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's quoting is valid there


@dataclass(frozen=True)
class Format:
    """What a request holds its reply to: ``schema`` the final message's JSON schema (None: free text; ``{}`` or
    ``{"type": "object"}`` for any object), ``final`` whether a final message may end the reply, ``calls`` (name,
    schema or None: free arguments) the functions it may call instead; ``raw``: the reply is the JSON alone (the
    completions API, whose prompts are not Harmony conversations)."""

    schema: dict | None = None
    final: bool = True
    calls: tuple[tuple[str, str | None], ...] = ()
    raw: bool = False  # the completions API: the text itself is the JSON (no Harmony around it)

    @property
    def needed(self) -> bool:
        """Whether this rules anything out (else no grammar: the reply is free)."""
        return self.schema is not None or not self.final or any(s is not None for _, s in self.calls)

    def lark(self) -> str:
        if self.raw:  # (then the end: <|endoftext|>, the tokenizer's end, allowed once the JSON is whole)
            return f"start: %json {_compact(self.schema)}\n"
        body = "TEXT" if self.schema is None else f"%json {_compact(self.schema)}"
        last = []
        rules = ["start: pre* last", "pre: analysis | preamble" if self.calls else "pre: analysis",
                 'analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"',
                 "TEXT: /(?s:.*)/"]
        if self.calls:  # (a preamble is the model's word before its tool calls: with none, the answer is all the text)
            rules.append('preamble: <|channel|> "commentary" <|message|> TEXT <|end|> <|start|> "assistant"')
        if self.final:
            rules.append(f'final: <|channel|> "final" <|message|> {body} <|return|>')
            last.append("final")
        for i, (name, schema) in enumerate(self.calls):
            args = "TEXT" if schema is None else f"%json {schema}"
            rules.append(f'call{i}: <|channel|> {_quote(f"commentary to=functions.{name} ")} <|constrain|> "json" '
                         f"<|message|> {args} <|call|>")
            last.append(f"call{i}")
        if not last:
            raise GptOssFp8Error("the request allows neither a final message nor a tool call")
        rules.append("last: " + " | ".join(last))
        return "\n".join(rules) + "\n"


class Grammar:
    """One sequence's ``Constraint`` (runtime/sampling.py): an llguidance matcher over its reply."""

    def __init__(self, matcher):
        self.matcher = matcher

    def allow(self, row: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @staticmethod
    def allow_many(rules: list[Grammar], packed: torch.Tensor, at: list[int]) -> None:
        """Several sequences' masks in llguidance's threads (the GIL released): rules[k]'s into row at[k]."""
        if not packed.is_contiguous():
            raise GptOssFp8Error("allow_many: the packed masks must be contiguous")
        _executor().unsafe_compute_mask_ptr([(r.matcher, i) for r, i in zip(rules, at, strict=True)],
                                            packed.data_ptr(), packed.shape[1] * packed.element_size(), packed.shape[0])

    def check(self, tok: int) -> bool:
        return self.matcher.validate_tokens([tok]) == 1

    def consume(self, tok: int) -> bool:
        return self.matcher.consume_token(tok)

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def constraint(fmt: Format, vocab: int, name: str = "o200k_harmony"):
    """``SamplingParams.constraint`` for ``fmt`` over the vocabulary ``name`` of ``vocab`` ids (None where it rules
    nothing out): the grammar compiled and checked once here (one line if a schema cannot be: 400) into a matcher that
    each sequence's copies (the engine makes them as requests are added: a copy costs far less than a compile)."""
    if not fmt.needed:
        return None
    if name != "o200k_harmony" and not fmt.raw:
        raise GptOssFp8Error(f"the {name} vocabulary has no Harmony: its only output format is the completions API's "
                             "JSON")
    llg = _llguidance()
    tok = tokenizer(vocab, name)
    grammar = llg.LLMatcher.grammar_from_lark(fmt.lark())
    bad = llg.LLMatcher.validate_grammar(grammar, tok)
    if bad:
        raise GptOssFp8Error(f"the output format cannot be enforced: {bad.splitlines()[0]}")
    first = llg.LLMatcher(tok, grammar, log_level=0)
    if first.is_error():
        raise GptOssFp8Error(f"the output format cannot be enforced: {first.get_error().splitlines()[0]}")
    return lambda: Grammar(first.deep_copy())


def schema_of(fmt: dict | None, where: str) -> dict | None:
    """A chat ``response_format`` / a Responses ``text.format`` -> the final message's JSON schema (None: text)."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema", fmt)  # chat nests it, Responses does not
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise GptOssFp8Error(f"{where}: a json_schema format needs its schema, a JSON object")
        return schema
    raise GptOssFp8Error(f"{where}: type {fmt.get('type')!r}; give text, json_object or json_schema")


def request_format(schema: dict | None, tools: list[dict] | None, choice) -> Format:
    """A request's output format: the final body's ``schema``, its function ``tools`` (the chat API's form: {"type":
    "function", "function": {name, parameters, strict}}) and ``tool_choice`` (auto, none, required, or one named
    function: {"type": "function", "name"} or chat's {"type": "function", "function": {"name"}})."""
    tools = tools or []
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if name not in names:
            raise GptOssFp8Error(f"tool_choice names function {name!r}, which is not among the tools {names}")
        tools = [t for t in tools if t["function"]["name"] == name]
    elif choice == "none":
        tools = []
    elif choice == "required" and not tools:
        raise GptOssFp8Error("tool_choice 'required' needs tools")
    calls = tuple((t["function"]["name"], _compact(t["function"].get("parameters") or {"type": "object"})
                   if t["function"].get("strict") else None) for t in tools)
    return Format(schema, final=choice in (None, "auto", "none"), calls=calls)

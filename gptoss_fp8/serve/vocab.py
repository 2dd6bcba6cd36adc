"""The served model's text: how a completion's prompt becomes ids and its ids become text, and whether the chat
APIs (Harmony) can run on it.

Two vocabularies are served: the released models' o200k_harmony (201088 ids: chat, Responses and completions) and the
byte-level one of small models such as the trained fixture (golden/trained, ByT5's convention: gptoss_fp8/tokenizer.py),
which has no chat format, so only ``/v1/completions`` runs on it (text continued, as ``generate`` does). Any other
vocabulary (a synthetic checkpoint's) has no text at all: serve refuses it at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.serve import harmony
from gptoss_fp8.verify.prompt import HARMONY_VOCAB


@dataclass(frozen=True)
class Vocab:
    """``name``; ``chat``: Harmony's chat format (the chat and Responses APIs); ``encode`` text -> ids (a completion's
    prompt); ``token_bytes`` one id's bytes (part of a UTF-8 character, possibly); ``stops``: the ids that end a
    completion (not text)."""

    name: str
    chat: bool
    encode: Callable[[str], list[int]]
    token_bytes: Callable[[int], bytes]
    stops: frozenset[int]
    text_of: Callable[[int], str] | None = None  # (one id's text, when the vocabulary has a faster way)
    max_token_bytes: int = 128  # the most bytes one id's text holds (o200k_harmony: 128, a run of spaces; tested)

    def token_text(self, tok: int) -> str:
        """One id's text on its own (bytes that are part of a character: U+FFFD)."""
        if self.text_of is not None:
            return self.text_of(tok)
        return self.token_bytes(tok).decode("utf-8", errors="replace")

    def stream(self) -> harmony.TextStream:
        """Ids -> text pieces as they come (``harmony.TextStream`` over this vocabulary's bytes)."""
        return harmony.TextStream(self.token_bytes)


@lru_cache(maxsize=1)
def harmony_vocab() -> Vocab:
    enc = harmony.encoding()  # (a missing package: one line, before any weights load)
    return Vocab("o200k_harmony", True, lambda text: list(enc.encode(text, allowed_special="all")), harmony.token_bytes,
                 frozenset((harmony.RETURN, harmony.CALL, harmony.ENDOFTEXT)), harmony.token_text)


def byte_vocab() -> Vocab:
    from gptoss_fp8.tokenizer import BYT5_IDS, ByteTokenizer

    tok = ByteTokenizer()
    return Vocab("byte-level", False, tok.encode, lambda t: tok.decode_bytes([t]),
                 frozenset((BYT5_IDS["eos"],)), max_token_bytes=1)  # (text: one id a byte)


def vocab_of(path, vocab_size: int) -> Vocab:
    """The vocabulary a checkpoint's text is served with: its declared byte-level tokenizer, else o200k_harmony when
    it has 201088 ids; else one line (a synthetic checkpoint's ids have no text)."""
    from gptoss_fp8.tokenizer import ByteTokenizer, byte_tokenizer_of

    if byte_tokenizer_of(path) is not None and vocab_size == ByteTokenizer.vocab_size:
        return byte_vocab()
    if vocab_size == HARMONY_VOCAB:
        return harmony_vocab()
    raise GptOssFp8Error(f"{path}: vocab_size {vocab_size} is neither the o200k_harmony tokenizer's {HARMONY_VOCAB} nor "
                         "a declared byte-level one (tokenizer_config.json: ByT5Tokenizer, 259 ids); serve speaks text "
                         f"(for a synthetic one to try the APIs on: gptoss-fp8 synth DIR --vocab-size {HARMONY_VOCAB}, "
                         "then convert)")


def vocab_named(name: str) -> Vocab:
    """``Vocab.name`` -> the vocabulary (a sharded server's job carries the name)."""
    return {"o200k_harmony": harmony_vocab, "byte-level": byte_vocab}[name]()

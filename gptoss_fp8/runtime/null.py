"""A model that costs nothing: the host path of serving measured alone (``bench serve --null-model``).

``NullRunner`` has ``ModelRunner``'s interface (slots, ``prefill``, ``decode``, ``release``, the
prefix cache's ``snapshot`` / ``restore``) and
no weights: a decode step sleeps ``step_s`` seconds (``time.sleep`` lets go of the GIL, as a
host waiting on a GPU step does; 0: no sleep) and returns an empty [n, 0] tensor, and
``ScriptSampler`` gives every request the same preset reply, token by token (a request's i-th
token is ``ids[i % len(ids)]``), instantly. Everything else is the real thing: the engine, its
scheduler and thread, the HTTP app, Harmony, the SSE streams, so a load against a server over
this runner measures what the host spends per step and per token, and whether it overlaps a
GPU step of ``step_s``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from gptoss_fp8.runtime.sequence import Sequence

# The preset reply: English prose with punctuation and digits, so that detokenizing and the JSON
# of the SSE chunks cost what real text costs.
REPLY = ("The engine loop schedules every running request at each step: prompts go in chunk by chunk, "
         "and each decoding sequence gets one token. In 2026 a step of the 20b model at batch 64 took "
         "about 10.1 ms on one H200, so the host has that long to stream 64 tokens to their clients. ")


class NullRunner:
    """``slots`` sequences of up to ``max_context`` tokens over a vocabulary of ``vocab`` ids; a
    decode step costs ``step_s`` seconds of GIL-free sleep, a prompt chunk ``prefill_s``."""

    graphs = None

    def __init__(self, slots: int, max_context: int, *, vocab: int = 201088, step_s: float = 0.0,
                 prefill_s: float = 0.0, prefix_cache: bool = True):
        self.slots, self.max_context, self.step_s, self.prefill_s = slots, max_context, step_s, prefill_s
        self.prefix_cache = prefix_cache
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab))
        self.device = torch.device("cpu")
        self.buckets = list(range(1, slots + 1))
        self.lengths = [0] * slots
        self.decode_steps = 0
        self.rebuild = None  # (no model: a prompt is reused whole or not at all)

    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        if self.prefill_s:
            time.sleep(self.prefill_s)
        self.lengths[slot] = start + len(tokens)
        return torch.empty(1, 0)

    def prefill_many(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        for slot, tokens, start in chunks:
            self.prefill(slot, tokens, start)
        return torch.empty(len(chunks), 0)

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        if self.step_s:
            time.sleep(self.step_s)
        for s in slots:
            self.lengths[s] += 1
        self.decode_steps += 1
        return torch.empty(len(slots), 0)

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def snapshot(self, slots: list[int], kind: int = 0) -> None:
        pass

    def restore(self, slot: int, src: int, n: int, kind: int = 0, start: int | None = None) -> None:
        self.lengths[slot] = n if start is None else start


class ScriptSampler:
    """The engine's sampler for ``NullRunner``: request i's n-th token is ``ids[n % len(ids)]``
    (log-probabilities -1.0 when a request asks for them)."""

    def __init__(self, ids: list[int]):
        if not ids:
            raise ValueError("ScriptSampler needs at least one token id")
        self.ids = list(ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
        ids, n = self.ids, len(self.ids)
        toks = [ids[len(s.tokens) % n] for s in seqs]
        return toks, ([-1.0] * len(seqs) if any(s.params.logprobs for s in seqs) else None)

"""Prompt reuse across requests: a later prompt that starts with a whole earlier prompt skips it.

A slot's KV cache rows keep a prompt's keys after its sequence leaves (``release`` only sets the
length to 0), except where something writes over them: the sequence's own reply (positions from
the prompt's end on), the decode steps' riders (a free slot rides at length 0, so position 0 of
the full layers), and every later position of a sliding-window layer, whose ring of ``window``
rows holds only the last ones. So when a prompt's last chunk is in, the runner saves the slot's
rings and its full layers' position 0 (``ModelRunner.snapshot``: a few MB a slot, saved before
the step's decode writes anything), and the slot's prompt is an ``Entry`` here. A later request
whose prompt starts with that whole prompt (the next turn of a conversation, the same prompt
again, the other choices of an ``n`` request) then starts at its end: ``restore`` puts the
rings and position 0 back (and copies the full layers' rows when the entry's slot is not the
one the request gets), and prefill goes on from there.

The rings are saved at the prompt's end, so a prompt is reused whole or not at all: from position
P (the new prompt is longer) or P - 1 (it is as long: its last token is prefilled again, for its
logits). And at one more point a request may name, its ``keep`` (a chat's head: the system and
developer messages, which requests with the same instructions and tools share): its prefill cuts a
chunk there, the rings are saved in a second buffer (kind 1), and the head is an entry of its own,
so another conversation with the same head prefills only what follows it. Any other shared part
prefills in full. Reuse gives the same keys as a cold prefill (in the exact weights mode, the same
bits: a prompt prefilled in chunks gives the whole prefill's bits, tests/test_model_chunks.py).

An entry lives while its rows and its saved rings are intact: while its sequence runs, and after it
leaves until its slot is given to a request that does not start with it (a request that reuses a
slot's entry in place keeps that slot's entries no longer than what it reuses); free slots without
an entry go first, then the least recently used slot.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

HOLD_MIN = 64  # a request waits a step or more for a running prompt that gives it at least this many tokens


@dataclass
class Entry:
    """Slot ``slot`` holds the keys of ``tokens``, its rings saved at their end in the slot's buffer ``kind`` (0: a
    whole prompt, 1: a request's ``keep``, its head)."""

    slot: int
    tokens: list[int]
    used: int = 0  # the last time (PrefixCache's clock) it was made or reused
    kind: int = 0


@dataclass
class Placement:
    """Where a new request goes: ``slot``, and the keys it reuses: ``start`` prompt tokens from the
    entry of slot ``src`` (``src == slot``: in place; None: a cold prefill, start 0), its rings in buffer ``kind``."""

    slot: int
    start: int = 0
    src: int | None = None
    kind: int = 0


def reusable(tokens: list[int], prompt: list[int]) -> int:
    """How many of ``prompt``'s tokens an entry of ``tokens`` gives (0: none): all of them when
    ``prompt`` is longer and starts with them, all but the last when it is as long or longer and
    starts with all but the last (at least one prompt token is always prefilled)."""
    n = len(tokens)
    if n < 2 or len(prompt) < n or prompt[n - 2] != tokens[n - 2] or prompt[(n - 2) // 2] != tokens[(n - 2) // 2]:
        return 0  # (two tokens first: most prompts differ there, and a whole compare copies both slices)
    if prompt[:n - 1] != tokens[:n - 1]:
        return 0
    return n if len(prompt) > n and prompt[n - 1] == tokens[n - 1] else n - 1


@dataclass
class PrefixCache:
    """The entries by (slot, kind) (module docstring) and a clock for least-recently-used eviction."""

    entries: dict[tuple[int, int], Entry] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)

    def best(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry that gives ``prompt`` the most tokens -> (entry, tokens), (None, 0) if none."""
        best, most = None, 0
        for e in self.entries.values():
            n = reusable(e.tokens, prompt)
            if n > most:
                best, most = e, n
        return best, most

    def place(self, prompt: list[int], free: list[int]) -> Placement:
        """A slot among ``free`` (not empty) for ``prompt``: the best entry's own slot when it is free,
        else a free slot without an entry (lowest first), else the least recently used one. The slot's
        entries longer than what the request reuses there are dropped (its rows from there on will be
        overwritten)."""
        entry, n = self.best(prompt)
        if entry is not None:
            entry.used = next(self._clock)
            if entry.slot in free:  # in place: the new prompt writes from n on
                self._overwrite(entry.slot, n)
                return Placement(entry.slot, n, entry.slot, entry.kind)
        held = {s for s, _ in self.entries}
        empty = [s for s in free if s not in held]
        slot = min(empty) if empty else min(free, key=lambda s: max(e.used for e in self._of(s)))
        self._overwrite(slot, 0)
        return Placement(slot, n, entry.slot, entry.kind) if entry is not None else Placement(slot)

    def _of(self, slot: int) -> list[Entry]:
        return [e for (s, _), e in self.entries.items() if s == slot]

    def _overwrite(self, slot: int, n: int) -> None:
        """``slot``'s rows from n on will be written: its entries longer than n go."""
        for e in self._of(slot):
            if len(e.tokens) > n:
                del self.entries[(slot, e.kind)]

    def pending(self, prompt: list[int], prefilling: list[list[int]]) -> bool:
        """Whether a running prompt, not yet all in, would give ``prompt`` at least ``HOLD_MIN`` tokens
        once it is: then the request waits for it rather than prefilling the same tokens beside it."""
        return any(reusable(p, prompt) >= HOLD_MIN for p in prefilling)

    def record(self, slot: int, tokens: list[int], kind: int = 0) -> None:
        """``slot`` holds ``tokens`` (a whole prompt, kind 0; a head, kind 1) and its rings at their end are saved in
        its buffer ``kind``: an entry (replacing the slot's entry of that kind)."""
        self.entries[(slot, kind)] = Entry(slot, tokens, next(self._clock), kind)

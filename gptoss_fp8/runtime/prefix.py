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

The rings are saved at the prompt's end, so a prompt is reused whole from there: from position
P (the new prompt is longer) or P - 1 (it is as long: its last token is prefilled again, for its
logits). And at one more point a request may name, its ``keep`` (a chat's head: the system and
developer messages, which requests with the same instructions and tools share): its prefill cuts a
chunk there, the rings are saved in a second buffer (kind 1), and the head is an entry of its own,
so another conversation with the same head prefills only what follows it. And when a request ends
(finished or cancelled, after its prompt), its slot holds the keys of its prompt and all but the last
of its reply tokens: the rings are saved then too (kind 2, before a rider writes over them), so a
prompt that goes on from the reply (a completion continued, a tool call's result after its call, a
stopped reply sent back with the next message) prefills only what follows it.

Any other shared part: a prompt whose first S tokens are an entry's (a document asked about again
with another question, a conversation whose last message was edited, a prompt that is the start of
an earlier one) gets the full layers' rows of those S tokens, and its rings are rebuilt by
prefilling the last R of them again (``ModelRunner.rebuild``: R = the sum over sliding layers of
window - 1, 1524 tokens for the 20b, 2286 for the 120b) in one chunk that leaves the full layers'
rows as they are. Why R is enough: that chunk starts with wrong rings, so its first positions come
out wrong, but a sliding layer's output at position p reads only positions p - window + 1..p of the
layer below, and a full layer's reads its own row and the kept rows, which are right: each sliding
layer moves the first right position at most window - 1 further, so every position of the last
window - 1 before S is right in every layer, which is what the next query's window reads. The prompt
then starts at S - R (``Placement.kept``), or S - R - 1 when the shared part is the whole prompt
(its last row, which gives the first token's logits, reads one more), when that skips at least
``MIN_SHARED`` tokens and more than a whole entry would. Reuse gives the
same keys as a cold prefill (in the exact weights mode, the same bits: a prompt prefilled in chunks
gives the whole prefill's bits, tests/test_model_chunks.py).

An entry lives while its rows and its saved rings are intact: while its sequence runs, and after it
leaves until its slot is given to a request that does not start with it (a request that reuses a
slot's entry in place keeps that slot's entries no longer than what it reuses); free slots without
an entry go first, then the least recently used slot.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

PROMPT, HEAD, REPLY = 0, 1, 2  # the points a slot's rings are saved at (its buffers): a prompt's end, its head's, its reply's
KINDS = 3
HOLD_MIN = 64  # a request waits a step or more for a running prompt that gives it at least this many tokens
MIN_SHARED = 64  # a shared part that is not a whole entry is reused when that skips at least this many tokens


@dataclass
class Entry:
    """Slot ``slot`` holds the keys of ``tokens``, its rings saved at their end in the slot's buffer ``kind`` (PROMPT:
    a whole prompt, HEAD: a request's ``keep``, its head, REPLY: a prompt and all but the last token of its reply)."""

    slot: int
    tokens: list[int]
    used: int = 0  # the last time (PrefixCache's clock) it was made or reused
    kind: int = 0
    _array: np.ndarray | None = field(default=None, repr=False)

    def shared(self, prompt: np.ndarray) -> int:
        """How many first tokens ``prompt`` (an int64 array) has in common with this entry."""
        if self._array is None:
            self._array = np.asarray(self.tokens, dtype=np.int64)
        return common(prompt, self._array)


def common(a: np.ndarray, b: np.ndarray) -> int:
    """How many first tokens the int arrays a and b have in common."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


@dataclass
class Placement:
    """Where a new request goes: ``slot``, and the keys it reuses: ``start`` prompt tokens from the
    entry of slot ``src`` (``src == slot``: in place; None: a cold prefill, start 0), its rings in buffer ``kind``.
    ``kept`` > start: a shared part, not the whole entry: the full layers' rows of ``kept`` tokens, the rings rebuilt
    by prefilling start..kept - 1 in one chunk (module docstring)."""

    slot: int
    start: int = 0
    src: int | None = None
    kind: int = 0
    kept: int = 0


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
    """The entries by (slot, kind) (module docstring) and a clock for least-recently-used eviction. ``rebuild``:
    the tokens a shared part's ring rebuild prefills again (``ModelRunner.rebuild``; None: whole entries only)."""

    entries: dict[tuple[int, int], Entry] = field(default_factory=dict)
    rebuild: int | None = None
    _clock: itertools.count = field(default_factory=itertools.count)
    _arrays: dict[int, tuple[list[int], np.ndarray]] = field(default_factory=dict)  # (``pending``'s)

    def best(self, prompt: list[int]) -> tuple[Entry | None, int, int]:
        """The entry that lets ``prompt`` skip the most tokens -> (entry, tokens skipped, kept: the shared tokens
        when they are not the whole entry, else 0), (None, 0, 0) if none."""
        best, most, kept = None, 0, 0
        for e in self.entries.values():
            n = reusable(e.tokens, prompt)
            if n > most:
                best, most = e, n
        if self.rebuild is None:
            return best, most, kept
        array = None
        for e in self.entries.values():
            need = self.rebuild + max(most + 1, MIN_SHARED)  # shared tokens that would skip more
            if min(len(e.tokens), len(prompt)) < need or e.tokens[need - 1] != prompt[need - 1]:
                continue  # (one token first: most entries differ there, and a whole compare makes an array)
            if array is None:
                array = np.asarray(prompt, dtype=np.int64)
            shared = e.shared(array)
            skip = shared - self.rebuild - (shared == len(prompt))  # (the whole prompt: its last row reads one more)
            if skip > most and skip >= MIN_SHARED:
                best, most, kept = e, skip, shared
        return best, most, kept

    def place(self, prompt: list[int], free: list[int]) -> Placement:
        """A slot among ``free`` (not empty) for ``prompt``: the best entry's own slot when it is free and
        keeps its other entries there (or no free slot is without an entry), else a free slot without an entry
        (lowest first; the reused rows are copied, ~24.6 KB a token for the 20b, and the entry's slot keeps a longer
        prompt for its own next turn), else the least recently used one. The slot's entries longer than what the
        request reuses there are dropped (its rows from there on will be overwritten)."""
        entry, n, kept = self.best(prompt)
        held = {s for s, _ in self.entries}
        empty = [s for s in free if s not in held]
        if entry is not None:
            entry.used = next(self._clock)
            if entry.slot in free and (not empty or all(len(e.tokens) <= (kept or n) for e in self._of(entry.slot))):
                self._overwrite(entry.slot, kept or n)  # in place: the new prompt writes from n on (full layers: kept)
                return Placement(entry.slot, n, entry.slot, entry.kind, kept)
        slot = min(empty) if empty else min(free, key=lambda s: max(e.used for e in self._of(s)))
        self._overwrite(slot, 0)
        return Placement(slot, n, entry.slot, entry.kind, kept) if entry is not None else Placement(slot)

    def _of(self, slot: int) -> list[Entry]:
        return [e for (s, _), e in self.entries.items() if s == slot]

    def _overwrite(self, slot: int, n: int) -> None:
        """``slot``'s rows from n on will be written: its entries longer than n go."""
        for e in self._of(slot):
            if len(e.tokens) > n:
                del self.entries[(slot, e.kind)]

    def pending(self, prompt: list[int], prefilling: list[list[int]]) -> bool:
        """Whether a running prompt, not yet all in, would give ``prompt`` at least ``HOLD_MIN`` tokens
        once it is (whole, or a shared part past its ring rebuild): then the request waits for it rather than
        prefilling the same tokens beside it (a burst of requests with one document or system prompt)."""
        if any(reusable(p, prompt) >= HOLD_MIN for p in prefilling):
            return True
        if self.rebuild is None:
            return False
        need = self.rebuild + max(HOLD_MIN, MIN_SHARED) + 1  # (+1: the shared part may be the whole prompt)
        near = [p for p in prefilling if min(len(p), len(prompt)) >= need and p[need - 1] == prompt[need - 1]]
        if not near:
            return False
        mine = self._array(prompt)
        return any(common(self._array(p), mine) >= need for p in near)

    def _array(self, tokens: list[int]) -> np.ndarray:
        """``tokens`` as an int64 array, kept for the lists asked about lately (a waiting request is asked about at
        every step while it waits)."""
        got = self._arrays.get(id(tokens))
        if got is None or got[0] is not tokens:
            got = self._arrays[id(tokens)] = (tokens, np.asarray(tokens, dtype=np.int64))
            while len(self._arrays) > 256:
                del self._arrays[next(iter(self._arrays))]
        return got[1]

    def record(self, slot: int, tokens: list[int], kind: int = 0) -> None:
        """``slot`` holds ``tokens`` (a whole prompt, a head or a prompt and reply: ``kind``) and its rings at their end
        are saved in its buffer ``kind``: an entry (replacing the slot's entry of that kind)."""
        self.entries[(slot, kind)] = Entry(slot, tokens, next(self._clock), kind)

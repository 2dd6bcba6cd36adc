"""Who runs this step: continuous batching under a token budget.

Every step, every sequence past its prompt decodes one token; the rest of the step's token budget
goes to prompt chunks, oldest request first. A prompt is cut at fixed positions (multiples of
``chunk``), whatever else runs, so a request's arithmetic does not depend on its neighbours (the
CPU weights mode is batch-invariant bit for bit: tests/test_serve_invariance.py). Waiting requests
take a free slot as soon as one is free; a request leaves at the step it finishes or is
cancelled, and its slot is free for the next step. A long prompt therefore never freezes the
running streams: each step still decodes everyone, and carries at most ``budget - decodes``
prompt tokens (at least one chunk when nothing decodes).

With a prefix cache (runtime/prefix.py) a request taking a slot may start past its prompt's
beginning: the step's ``restores`` put the cached keys in place before its forwards, and a
request whose prompt a running prompt will give once it is in (the other choices of an ``n``
request) waits for it, while those behind it go on. A request that reuses a shared part rebuilds
its rings in its first chunk, which reaches the shared part's end (``kept``) whatever ``chunk`` is
(the prefix cache offers it only when that fits the budget's room beside a full decode step), and
the fixed cut after its start when that is further.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.runtime.prefix import PrefixCache
from gptoss_fp8.runtime.sequence import Sequence, State
from gptoss_fp8.runtime.slots import SlotManager


class QueueFull(GptOssFp8Error):
    """The waiting queue is at its bound (HTTP: 429)."""


@dataclass
class Step:
    """One step's work: the sequences that decode one token each (in slot order), the prompt
    chunks (sequence, start, end) to prefill, and before them the cached prompts to restore
    (sequence, the entry's slot, tokens, its buffer, the sequence's start: ``ModelRunner.restore``)."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int, int]] = field(default_factory=list)
    restores: list[tuple[Sequence, int, int, int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Waiting queue (bounded by ``max_waiting``) and running set over ``slots``; ``prefix``: the
    prompt cache that places requests (None: lowest free slot, every prompt prefilled whole)."""

    def __init__(self, slots: SlotManager, *, chunk: int, token_budget: int, max_waiting: int,
                 prefix: PrefixCache | None = None):
        if chunk < 1 or token_budget < 1 or max_waiting < 0:
            raise GptOssFp8Error(f"scheduler: chunk {chunk}, token budget {token_budget}, max waiting {max_waiting}: "
                                 "give positive numbers")
        self.slots, self.chunk, self.budget, self.max_waiting = slots, chunk, token_budget, max_waiting
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order

    def add(self, seq: Sequence) -> None:
        """Queue a request; QueueFull when ``max_waiting`` requests already wait beyond the free slots."""
        if len(self.waiting) >= self.max_waiting + self.slots.available:
            raise QueueFull(f"all {self.slots.total} KV slots are taken and {len(self.waiting) - self.slots.available} "
                            "requests are waiting (the bound); try again shortly")
        seq.state = State.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or cancelled) and free its slot at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None

    def schedule(self) -> Step:
        restores = self._admit() if self.waiting and self.slots.available else []
        step = Step(decodes=sorted((s for s in self.running if s.state is State.DECODE), key=lambda s: s.slot),
                    restores=restores)
        left = self.budget - len(step.decodes)
        for seq in self.running:
            if seq.state is not State.PREFILL:
                continue
            start = seq.prefilled
            end = min(len(seq.prompt), (start // self.chunk + 1) * self.chunk)
            if start < seq.kept:  # a shared part's ring rebuild: one chunk
                end = max(end, seq.kept)
            if max(start, seq.kept) < seq.keep < end:  # (one more cut, at the head the prefix cache keeps)
                end = seq.keep
            if end - start > left and not step.empty:
                break
            step.prefills.append((seq, start, end))
            left -= end - start
        return step

    def _admit(self) -> list[tuple[Sequence, int, int, int, int]]:
        """Waiting requests into free slots, oldest first -> the restores their placements need."""
        restores, held = [], deque()
        while self.waiting and self.slots.available:
            seq = self.waiting.popleft()
            if self.prefix is None:
                seq.slot = self.slots.alloc()
            else:
                if self.prefix.pending(seq.prompt, [s.prompt for s in self.running if s.state is State.PREFILL]):
                    held.append(seq)
                    continue
                place = self.prefix.place(seq.prompt, self.slots.free_slots)
                self.slots.take(place.slot)
                seq.slot = place.slot
                if place.start:
                    seq.prefilled = seq.cached = place.start
                    seq.kept = place.kept
                    if seq.keep <= place.kept:  # (a head inside the rebuilt part: its rings are never saved there)
                        seq.keep = 0
                    restores.append((seq, place.src, place.kept or place.start, place.kind, place.start))
            seq.state = State.PREFILL
            self.running.append(seq)
        self.waiting.extendleft(reversed(held))
        return restores

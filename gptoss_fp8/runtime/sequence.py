"""A request inside the runtime: its prompt and generated token ids, its slot, where it is."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gptoss_fp8.runtime.sampling import Constraint, SamplingParams

_ids = itertools.count()


class State(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    PREFILL = "prefill"  # holds a slot, its prompt going in chunk by chunk
    DECODE = "decode"  # prompt in, one token per step
    FINISHED = "finished"


# Finish reasons: "stop" (a stop token or rule), "length" (max_tokens), "cancelled", "error".
FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(eq=False)
class Sequence:
    """One request. ``tokens``: generated ids (the last one is not in the KV cache yet while
    decoding); ``prefilled``: prompt tokens in the cache; ``stop``: the stop token's name or rule's
    verdict; ``finish``: one of FINISH_REASONS once finished; ``error``: the message of a failure.
    ``on_event(seq, new_tokens)`` is called by the engine (its thread) after each step that gave
    the request tokens or finished it (then ``seq.finished``)."""

    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Sequence, list[int]], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # (params.top_logprobs > 0)
    state: State = State.WAITING
    slot: int | None = None
    prefilled: int = 0
    cached: int = 0  # prompt tokens whose keys came from the prefix cache (runtime/prefix.py), not prefilled
    keep: int = 0  # a prompt position whose keys the prefix cache keeps for other requests (a chat's head), 0: none
    kept: int = 0  # a shared part's end whose full layers came from the prefix cache, its rings rebuilt from cached
    finish: str | None = None
    stop: str | None = None
    error: str | None = None
    exception: BaseException | None = None
    generator: torch.Generator | None = None
    constraint: Constraint | None = None  # (params.constraint's, made when the request is added)
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def prompt_left(self) -> int:
        return len(self.prompt) - self.prefilled

"""Per-request sampling parameters and the batched sampler.

Greedy at temperature 0 (the argmax), else a sample from softmax(logits / T), restricted to the
smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus sampling), drawn
with the request's own seeded ``torch.Generator``: the same seed gives the same tokens whatever
else runs in the batch (each row draws from its own generator, in its own order). ``draw`` makes
the choice on the logits' device; one host read per step for the whole batch (``Drawn.get``:
tokens and, when asked, their log-probabilities).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gptoss_fp8.errors import GptOssFp8Error

# A stop rule: the tokens generated so far -> why the reply ends after the last one, or None.
StopRule = Callable[[list[int]], str | None]


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``stop_token_ids``: tokens that end the reply (kept as its last
    token); ``stop_rule``: a further rule on the generated ids (generate's Harmony ``<|end|>``
    rule); ``logprobs``: return each chosen token's log-probability (of the unscaled logits)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    stop_rule: StopRule | None = field(default=None, compare=False)

    def check(self) -> None:
        """One line per bad value."""
        if self.max_tokens < 1:
            raise GptOssFp8Error(f"max_tokens {self.max_tokens}: give at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GptOssFp8Error(f"temperature {self.temperature}: give a finite number >= 0 (0: greedy)")
        if not (0 < self.top_p <= 1):
            raise GptOssFp8Error(f"top_p {self.top_p}: give a number in (0, 1]")

    def generator(self, device: torch.device) -> torch.Generator | None:
        """This request's generator (None when greedy): seeded with ``seed``, or a fresh random seed."""
        if self.temperature == 0:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)))
        return torch.Generator(device=device).manual_seed(seed)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [V] (float32) restricted to the smallest most-likely set reaching top_p, renormalized.
    Ties at the edge are broken by the sort (stable: lower ids first)."""
    if top_p >= 1:
        return probs
    p, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(p, 0) - p  # mass of the tokens ranked above each one
    p = torch.where(before < top_p, p, 0.0)  # the first token is always kept
    out = torch.zeros_like(probs).scatter_(0, order, p)
    return out / out.sum()


class Drawn:
    """A step's chosen tokens (int64 [n]) and log-probabilities (float [n] or None) on their way to
    the host. On CUDA the copy into pinned memory is queued behind the step and an event recorded:
    ``get`` waits on the event with the GIL released (torch's ``Event.synchronize``), so the
    server's event-loop thread runs while the GPU finishes the step, then reads the pinned copy."""

    def __init__(self, toks: torch.Tensor, lps: torch.Tensor | None):
        both = toks.double()[None] if lps is None else torch.stack([toks.double(), lps.double()])  # ids exact
        self._logprobs, self.event = lps is not None, None
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            both = host
        self._both = both

    def get(self) -> tuple[list[int], list[float] | None]:
        """(tokens, log-probabilities or None) as host lists: the step's one host read."""
        if self.event is not None:
            self.event.synchronize()
        rows = self._both.tolist()
        return [int(t) for t in rows[0]], (rows[1] if self._logprobs else None)


def draw(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> Drawn:
    """Row i of logits [n, V] (bf16 or float32) -> row i's token by params[i] and gens[i]; and,
    if any row asked for them, every row's chosen-token log-probability. All on the logits' device,
    no host synchronisation: ``Drawn.get`` reads them."""
    rows = logits.float()
    toks = rows.argmax(dim=-1)  # [n]: the greedy rows' tokens, one launch for all of them
    for i, p in enumerate(params):
        if p.temperature > 0:
            probs = nucleus(torch.softmax(rows[i] / p.temperature, dim=-1), p.top_p)
            toks[i] = torch.multinomial(probs, 1, generator=gens[i])[0]
    lp = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(rows, dim=-1).gather(1, toks[:, None])[:, 0]
    return Drawn(toks, lp)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           gens: list[torch.Generator | None]) -> tuple[list[int], list[float] | None]:
    """``draw`` read at once: (tokens, log-probabilities or None) as host lists."""
    return draw(logits, params, gens).get()

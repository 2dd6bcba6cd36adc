"""Per-request sampling parameters and the batched sampler.

Greedy at temperature 0 (the argmax), else a sample from softmax(logits / T), restricted to the
smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus sampling), drawn
with the request's own seeded ``torch.Generator``: the same seed gives the same tokens whatever
else runs in the batch (each row draws from its own generator, in its own order). Presence and
frequency penalties (OpenAI's rule) first lower the logits of the tokens the request has generated so
far: ``logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)``, and a request's
``logit_bias`` adds its value to its tokens' logits (-100 bans a token, 100 all but forces it). A
``repetition_penalty`` r (vLLM's and transformers' rule, after the bias and before the other two) divides
the positive logits of every token in the prompt or the reply so far by r and multiplies the negative ones
by r. ``draw`` makes
the choice on the logits' device; one host read per step for the whole batch (``Drawn.get``:
tokens and, when asked, their log-probabilities and each row's most likely alternatives).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels import device_ints

# A stop rule: the tokens generated so far -> why the reply ends after the last one, or None.
StopRule = Callable[[list[int]], str | None]
# The most alternatives a step returns (OpenAI's limit for chat's top_logprobs).
MAX_TOP_LOGPROBS = 20
# A step's alternatives for one row: (token id, log-probability), most likely first.
TopLogprobs = list[tuple[int, float]]


class Constraint(Protocol):
    """One request's rule on which tokens may come next (structured output: serve/grammar.py's grammar over the
    reply). ``allow(row)``: write the next token's allowed ids into ``row`` (int32 [ceil(V / 32)] on the host, bit
    j % 32 of word j // 32 set for an allowed id j); ``consume(tok)``: the chosen token, False when it breaks the
    rule; ``error``: why it broke (empty when it did not). A kind may also have ``allow_many(rules, packed, at)``:
    rules[k]'s allowed ids into row at[k] of ``packed`` for every k, at once (``allowed_mask`` uses it for 2 or
    more), and ``check(tok)``: whether ``tok`` may come next, without taking it (``draw(lazy=)`` uses it: a check
    costs a grammar far less than a mask)."""

    def allow(self, row: torch.Tensor) -> None: ...

    def consume(self, tok: int) -> bool: ...

    @property
    def error(self) -> str: ...


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``stop_token_ids``: tokens that end the reply (kept as its last
    token); ``stop_rule``: a further rule on the generated ids (generate's Harmony ``<|end|>``
    rule); ``logprobs``: return each chosen token's log-probability, and ``top_logprobs`` (0 to
    MAX_TOP_LOGPROBS) the most likely tokens with theirs, at each step (the model's distribution:
    before temperature, penalties and top_p); ``presence_penalty`` / ``frequency_penalty`` (-2 to 2):
    the module docstring's rule over the generated tokens; ``logit_bias``: (token id, -100 to 100)
    pairs added to those logits at every step; ``repetition_penalty`` (0 to 2, 1: none): the module
    docstring's rule over the prompt's and the generated tokens."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    stop_rule: StopRule | None = field(default=None, compare=False)
    # structured output: makes each of the request's sequences its own ``Constraint`` (the engine calls it once a
    # sequence); every token is then chosen among the ones it allows
    constraint: Callable[[], Constraint] | None = field(default=None, compare=False)

    def check(self) -> None:
        """One line per bad value."""
        if self.max_tokens < 1:
            raise GptOssFp8Error(f"max_tokens {self.max_tokens}: give at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GptOssFp8Error(f"temperature {self.temperature}: give a finite number >= 0 (0: greedy)")
        if not (0 < self.top_p <= 1):
            raise GptOssFp8Error(f"top_p {self.top_p}: give a number in (0, 1]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise GptOssFp8Error(f"top_logprobs {self.top_logprobs}: give 0 to {MAX_TOP_LOGPROBS}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # (what torch.Generator.manual_seed takes)
            raise GptOssFp8Error(f"seed {self.seed}: give an integer that fits in 64 bits")
        if self.top_logprobs and not self.logprobs:
            raise GptOssFp8Error(f"top_logprobs {self.top_logprobs} needs logprobs: ask for both")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise GptOssFp8Error(f"{name} {v}: give a number in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise GptOssFp8Error(f"repetition_penalty {self.repetition_penalty}: give a number in (0, 2] (1: none)")
        for tok, v in self.logit_bias:
            if not (math.isfinite(v) and -100 <= v <= 100):
                raise GptOssFp8Error(f"logit_bias of token {tok}: {v}; give a number in [-100, 100]")

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or bool(self.logit_bias)
                or self.repetition_penalty != 1)

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
    """A step's chosen tokens (int64 [n]), log-probabilities (float [n] or None) and alternatives
    (ids int64 [n, k] and their log-probabilities [n, k], or None) on their way to the host. On CUDA
    the copy into pinned memory is queued behind the step and an event recorded: ``get`` waits on
    the event with the GIL released (torch's ``Event.synchronize``), so the server's event-loop
    thread runs while the GPU finishes the step, then reads the pinned copy."""

    def __init__(self, toks: torch.Tensor, lps: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None,
                 again: Callable[[list[int], list[float] | None], None] | None = None):
        cols = [toks.double()[:, None]]  # (ids exact in float64)
        if lps is not None:
            cols.append(lps.double()[:, None])
        if top is not None:
            cols += [top[0].double(), top[1].double()]
        both = torch.cat(cols, dim=1)
        self._logprobs, self._k, self.event = lps is not None, 0 if top is None else top[0].shape[1], None
        self._again = again  # draw's lazy rows: checked once read, a refused one's token drawn again
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            both = host
        self._both = both

    def get(self) -> tuple[list[int], list[float] | None, list[TopLogprobs] | None]:
        """(tokens, log-probabilities or None, each row's k alternatives or None) as host lists: the
        step's one host read (a second where a lazy row's rule refused its token: ``draw``)."""
        if self.event is not None:
            self.event.synchronize()
        rows, k = self._both.tolist(), self._k
        toks = [int(r[0]) for r in rows]
        lps = [r[1] for r in rows] if self._logprobs else None
        tops = [[(int(t), v) for t, v in zip(r[2:2 + k], r[2 + k:], strict=True)] for r in rows] if k else None
        if self._again is not None:
            self._again(toks, lps)
        return toks, lps, tops


class TokenCounts:
    """The penalties' counts of each running request's generated ids, on the device, one row per slot: each step
    counts only the ids a request got since its last step, so the host's work does not grow with the replies
    (building the counts from whole replies every step did, a penalized reply of L tokens costing O(L^2) in all)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.table: torch.Tensor | None = None  # float32 [slots, V] (counts are exact in float32 up to 2^24)
        self.owner: list[tuple[int, int] | None] = [None] * slots  # slot -> (request id, its ids counted)
        self.seen: TokenCounts | None = None  # the prompts' and replies' ids (repetition_penalty), as counts too

    def rows(self, requests: list[tuple[int, int, list[int]]], vocab: int, device: torch.device) -> torch.Tensor:
        """requests (slot, request id, its generated ids so far) -> float32 [len(requests), vocab]: row i request
        i's count of each id."""
        if self.table is None or self.table.shape[1] != vocab or self.table.device != device:
            self.table = torch.zeros(self.slots, vocab, dtype=torch.float32, device=device)
            self.owner = [None] * self.slots
        fresh, at, ids = [], [], []
        for slot, rid, out in requests:
            had = self.owner[slot]
            done = had[1] if had is not None and had[0] == rid and had[1] <= len(out) else None
            if done is None:  # the slot's first count for this request: its row starts from zero
                fresh.append(slot)
                done = 0
            at += [slot] * (len(out) - done)
            ids += out[done:]
            self.owner[slot] = (rid, len(out))
        if fresh:
            self.table.index_fill_(0, device_ints(fresh, device), 0.0)
        if ids:
            self.table.index_put_((device_ints(at, device), device_ints(ids, device)),
                                  torch.ones(len(ids), dtype=torch.float32, device=device), accumulate=True)
        return self.table.index_select(0, device_ints([slot for slot, _, _ in requests], device))

    def seen_rows(self, requests: list[tuple[int, int, list[int], list[int]]], vocab: int,
                  device: torch.device) -> torch.Tensor:
        """requests (slot, request id, its prompt, its generated ids so far) -> bool [len(requests), vocab]: whether
        each id is in the request's prompt or reply (its prompt counted once, at its first step)."""
        if self.seen is None:
            self.seen = TokenCounts(self.slots)
        # (a request's ids as one list: the prompt, then the reply; the prompt's copy made on its first step only)
        return self.seen.rows([(slot, rid, _Joined(prompt, out)) for slot, rid, prompt, out in requests],
                              vocab, device) > 0


class _Joined:
    """A prompt and a reply read as one list by ``TokenCounts.rows`` (its length and its tail), without a copy."""

    def __init__(self, head: list[int], tail: list[int]):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, s: slice) -> list[int]:
        a = s.start or 0
        return self.head[a:] + self.tail if a < len(self.head) else self.tail[a - len(self.head):]


def penalize(rows: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]] | None,
             counts: torch.Tensor | None = None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, V] float32 with each penalized row's presence / frequency penalty applied over the
    tokens in outputs[i] (its generated ids so far) and its logit_bias added; rows itself when no row
    asks for either. ``counts`` (instead of outputs): float32 [rows with a penalty, V], those rows' counts
    of each id in order (``TokenCounts``). ``seen``: bool [rows with a repetition_penalty, V], whether each id
    is in that row's prompt or reply (``TokenCounts.seen_rows``; needed for those rows)."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    which = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty)
             and (counts is not None or outputs[i])]
    again = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if again and (seen is None or seen.shape != (len(again), rows.shape[1])):
        raise GptOssFp8Error(f"penalize: {len(again)} rows ask for a repetition_penalty; pass seen, bool "
                             f"[{len(again)}, {rows.shape[1]}] (got {None if seen is None else tuple(seen.shape)})")
    if not biased and not which and not again:
        return rows
    out = rows.clone()
    if biased:
        at = torch.tensor([j for j in biased for _ in params[j].logit_bias], dtype=torch.int64)
        ids = torch.tensor([t for j in biased for t, _ in params[j].logit_bias], dtype=torch.int64)
        vals = torch.tensor([v for j in biased for _, v in params[j].logit_bias], dtype=torch.float32)
        if rows.is_cuda:
            at, ids, vals = (t.pin_memory().to(rows.device, non_blocking=True) for t in (at, ids, vals))
        out.index_put_((at, ids), vals, accumulate=True)
    if again:
        r = torch.tensor([[params[i].repetition_penalty] for i in again], dtype=torch.float32)
        sel = device_ints(again, rows.device)
        r = r.pin_memory().to(rows.device, non_blocking=True) if rows.is_cuda else r
        part = out.index_select(0, sel)
        out.index_copy_(0, sel, torch.where(seen, torch.where(part > 0, part / r, part * r), part))
    if which:
        pen = torch.tensor([[params[i].frequency_penalty, params[i].presence_penalty] for i in which],
                           dtype=torch.float32)
        if rows.is_cuda:
            pen = pen.pin_memory().to(rows.device, non_blocking=True)
        if counts is None:
            ids = device_ints([t for i in which for t in outputs[i]], rows.device)
            at = device_ints([j for j, i in enumerate(which) for _ in outputs[i]], rows.device)
            counts = torch.zeros(len(which), rows.shape[1], dtype=torch.float32, device=rows.device)
            counts.index_put_((at, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        elif counts.shape != (len(which), rows.shape[1]):
            raise GptOssFp8Error(f"penalize: counts {tuple(counts.shape)} for {len(which)} penalized rows of "
                                 f"{rows.shape[1]} logits")
        sel = torch.tensor(which, dtype=torch.int64, device=rows.device)
        out[sel] -= pen[:, :1] * counts + pen[:, 1:] * (counts > 0).float()
    return out


def allowed_mask(rows: list[Constraint], vocab: int, device: torch.device) -> torch.Tensor:
    """Each constraint's allowed next tokens -> bool [len(rows), vocab] on ``device``: the packed bits made on the
    host (``Constraint.allow``), one copy, unpacked there; a row that allows nothing comes back all True."""
    words = (vocab + 31) // 32
    packed = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=device.type == "cuda")
    kinds: dict[type, list[int]] = {}
    for i, c in enumerate(rows):
        kinds.setdefault(type(c), []).append(i)
    for kind, at in kinds.items():
        many = getattr(kind, "allow_many", None)  # (a kind that fills several rows at once: in parallel threads)
        if many is not None and len(at) > 1:
            many([rows[i] for i in at], packed, at)
        else:
            for i in at:
                rows[i].allow(packed[i])
    table = _BITS.get(device)
    if table is None:  # byte -> its 8 bits, lowest first (a little-endian int32's bytes hold bits 0-7, 8-15, ...)
        table = _BITS[device] = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)
    flat = packed.view(torch.uint8).to(device, non_blocking=True).long()  # [n, 4 * words]
    mask = table.index_select(0, flat.view(-1)).view(len(rows), words * 32)[:, :vocab]
    # a rule that allows nothing (broken) leaves its row free: its next token then breaks it and its request fails
    # alone, where an all -inf row would fail the whole step's sampling (no host read here)
    return mask | ~mask.any(dim=1, keepdim=True)


_BITS: dict[torch.device, torch.Tensor] = {}


def draw(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None],
         outputs: list[list[int]] | None = None, counts: torch.Tensor | None = None,
         seen: torch.Tensor | None = None, allowed: tuple[list[int], torch.Tensor] | None = None,
         lazy: tuple[list[int], list[Constraint]] | None = None,
         refused: Callable[[list[Constraint]], None] | None = None) -> Drawn:
    """Row i of logits [n, V] (bf16 or float32) -> row i's token by params[i] and gens[i] (after
    its penalties over outputs[i], its generated ids so far, or their ``counts``, and its repetition penalty over
    ``seen``: ``penalize``); and, if any row asked for them,
    every row's chosen-token log-probability and its k most likely tokens (k the largest
    top_logprobs asked; ``Drawn.get``'s rows hold k each, a request keeps its own first ones). ``allowed``: (rows,
    bool [len(rows), V]) those rows' tokens chosen among the allowed ones only (``allowed_mask``; the log-probabilities
    stay the model's). ``lazy``: (rows, their rules) held to their rules without a mask made first: each row draws
    freely, ``Drawn.get`` checks its token (``Constraint.check``), and only a refused row's mask is made and its token
    drawn again among the allowed ones (``refused`` is told which rules refused). That is the mask's choice: greedy,
    the allowed argmax; sampled, each allowed token with its probability over the allowed mass (a free draw kept with
    probability p, else one from the masked distribution: p + (1 - A) p / A = p / A). So only rows at top_p 1 may be
    lazy: a nucleus cut before the mask is not the cut after it. All on the logits' device, no host synchronisation:
    ``Drawn.get`` reads them (a refused lazy row costs its mask and a second read there)."""
    raw = logits.float()
    if any(p.penalized for p in params):
        if outputs is None and counts is None and any(p.presence_penalty or p.frequency_penalty for p in params):
            raise GptOssFp8Error("draw: a request asks for penalties; pass each row's generated ids (outputs)")
        rows = penalize(raw, params, outputs or [[] for _ in params], counts, seen)
    else:
        rows = raw
    if allowed is not None:
        sel = device_ints(allowed[0], rows.device)
        rows = rows.index_copy(0, sel, rows.index_select(0, sel).masked_fill(~allowed[1], float("-inf")))
    cut = [i for i in (lazy[0] if lazy else []) if params[i].top_p < 1]
    if cut:
        raise GptOssFp8Error(f"draw: row {cut[0]} has top_p {params[cut[0]].top_p}; a lazy rule needs top_p 1 (mask it)")
    toks = _choose(rows, params, gens)
    lp = top = logp = None
    if any(p.logprobs for p in params):
        logp = torch.log_softmax(raw, dim=-1)
        lp = logp.gather(1, toks[:, None])[:, 0]
        k = max(p.top_logprobs for p in params)
        if k:
            vals, ids = logp.topk(k, dim=-1)
            top = ids, vals
    again = _Recheck(lazy[0], lazy[1], rows, logp, params, gens, refused) if lazy and lazy[0] else None
    return Drawn(toks, lp, top, again)


def _choose(rows: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> torch.Tensor:
    """Row i's token of rows [n, V] (float32 logits, penalties and masks in) by params[i] with gens[i] -> int64 [n]."""
    toks = rows.argmax(dim=-1)  # [n]: the greedy rows' tokens, one launch for all of them
    for i, p in enumerate(params):
        if p.temperature > 0:
            probs = nucleus(torch.softmax(rows[i] / p.temperature, dim=-1), p.top_p)
            toks[i] = torch.multinomial(probs, 1, generator=gens[i])[0]
    return toks


class _Recheck:
    """``draw``'s lazy rows, checked once their tokens are on the host (``Drawn.get``): a refused row's token drawn
    again among its rule's allowed ones (its mask made only now), its log-probability the model's."""

    def __init__(self, at: list[int], rules: list[Constraint], rows: torch.Tensor, logp: torch.Tensor | None,
                 params: list[SamplingParams], gens: list[torch.Generator | None],
                 refused: Callable[[list[Constraint]], None] | None):
        self.at, self.rules, self.rows, self.logp = at, rules, rows, logp
        self.params, self.gens, self.refused = params, gens, refused

    def __call__(self, toks: list[int], lps: list[float] | None) -> None:
        """Mends toks (and lps) in place."""
        bad = [k for k, i in enumerate(self.at) if not self.rules[k].check(toks[i])]
        if not bad:
            return
        at, rules = [self.at[k] for k in bad], [self.rules[k] for k in bad]
        if self.refused is not None:
            self.refused(rules)
        sel = device_ints(at, self.rows.device)
        mask = allowed_mask(rules, self.rows.shape[1], self.rows.device)
        new = _choose(self.rows.index_select(0, sel).masked_fill(~mask, float("-inf")), [self.params[i] for i in at],
                      [self.gens[i] for i in at])
        cols = [new.double()[:, None]]  # (ids exact in float64)
        if self.logp is not None:
            cols.append(self.logp.index_select(0, sel).gather(1, new[:, None]).double())
        for i, row in zip(at, torch.cat(cols, dim=1).tolist(), strict=True):  # (the second read: refusals only)
            toks[i] = int(row[0])
            if lps is not None:
                lps[i] = row[1]


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None],
           outputs: list[list[int]] | None = None) -> tuple[list[int], list[float] | None, list[TopLogprobs] | None]:
    """``draw`` read at once: (tokens, log-probabilities or None, alternatives or None) as host lists."""
    return draw(logits, params, gens, outputs).get()

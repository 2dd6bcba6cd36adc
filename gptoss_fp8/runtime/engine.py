"""The engine loop: schedule -> run -> postprocess, one step at a time.

``Engine.step`` asks the scheduler for this step's work, runs the prompt chunks (in one forward;
if it raises, each alone, so one that raises fails its request only) and one decode step over every
decoding sequence, then samples each sequence's next token with its own parameters, applies the
stops and hands new tokens to the request's ``on_event``. Requests come and go between steps:
``add`` queues one (checked at once against the context and the queue bound), ``cancel`` marks one
and the next step boundary removes it and frees its slot. ``Engine`` is safe to call from other
threads; ``EngineThread`` runs the loop in a thread of its own so that an HTTP server never blocks a step.

Deferred delivery (``defer_events``, on by default on CUDA): a step's tokens are read and its stops
applied at once (the next step's inputs need them), but its ``on_event`` calls and ``after_step``
hooks run in the next step, after that step is launched, so a server's event loop formats and
writes the streams while the GPU runs, not while it waits for the host (its thread shares the GIL
with this one). The wait for a step's tokens releases the GIL (``sampling.Drawn``).
"""

from __future__ import annotations

import threading
import time
import traceback
import weakref
from collections.abc import Callable

import torch

from gptoss_fp8.errors import GptOssFp8Error, OutputFormatError
from gptoss_fp8.runtime.metrics import Metrics
from gptoss_fp8.runtime.prefix import HEAD, PROMPT, REPLY, PrefixCache
from gptoss_fp8.runtime.runner import ModelRunner
from gptoss_fp8.runtime.sampling import Drawn, SamplingParams, TokenCounts, allowed_mask, draw
from gptoss_fp8.runtime.scheduler import Scheduler, Step
from gptoss_fp8.runtime.sequence import Sequence, State
from gptoss_fp8.runtime.slots import SlotManager

# The batched token choice: (logits [n, V], the n sequences) -> (tokens, log-probabilities or None[, each
# row's alternatives or None]) as host lists, or a ``Drawn`` that reads them (the default: chosen on the
# device, read after a GIL-free wait).
Sampler = Callable[[torch.Tensor, list[Sequence]], "tuple | Drawn"]


class DefaultSampler:
    """Each request's SamplingParams (``draw``), the penalized ones' counts (and the ids a repetition penalty sees)
    kept per slot (``TokenCounts``).

    Structured output: a rule that can check a token (``Constraint.check``) on a row at top_p 1 is lazy (``draw``'s
    ``lazy``): its token drawn freely and checked, its mask made only when refused. A grammar's mask costs ~1 ms a
    sequence inside a JSON string (llguidance, BENCHMARKS.md), its check ~1 us, and a model that follows its format
    is rarely refused, so a step of many structured streams is not held up by their masks. A rule that refused draws
    through its mask for its next ``masked_after_refusal`` steps (refusals come in runs: a format the model does not
    take to), made while the step's forward runs. ``lazy=False``: every rule's mask first (the A/B's other side).
    ``metrics``: where the checked, refused and masked tokens are counted (the engine's)."""

    def __init__(self, slots: int, lazy: bool = True, masked_after_refusal: int = 8, metrics: Metrics | None = None):
        self.counts = TokenCounts(slots)
        self.lazy, self.masked_after_refusal = lazy, masked_after_refusal
        self.metrics = metrics or Metrics()
        self._masked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rule -> steps left to draw masked

    def _refused(self, rules: list) -> None:
        self.metrics.structured_refused += len(rules)
        for r in rules:
            self._masked[r] = self.masked_after_refusal

    def _is_lazy(self, seq: Sequence) -> bool:
        if not self.lazy or seq.params.top_p < 1 or not hasattr(seq.constraint, "check"):
            return False
        left = self._masked.get(seq.constraint, 0)
        if left:
            self._masked[seq.constraint] = left - 1
        return not left

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> Drawn:
        v, dev = logits.shape[1], logits.device
        pen = [(s.slot, s.id, s.tokens) for s in seqs if s.params.presence_penalty or s.params.frequency_penalty]
        again = [(s.slot, s.id, s.prompt, s.tokens) for s in seqs if s.params.repetition_penalty != 1]
        ruled = [i for i, s in enumerate(seqs) if s.constraint is not None]
        lazy = [i for i in ruled if self._is_lazy(seqs[i])]
        masked = sorted(set(ruled) - set(lazy))
        self.metrics.structured_checked += len(lazy)
        self.metrics.structured_masked += len(masked)
        return draw(logits, [s.params for s in seqs], [s.generator for s in seqs],
                    counts=self.counts.rows(pen, v, dev) if pen else None,
                    seen=self.counts.seen_rows(again, v, dev) if again else None,
                    allowed=(masked, allowed_mask([seqs[i].constraint for i in masked], v, dev)) if masked else None,
                    lazy=(lazy, [seqs[i].constraint for i in lazy]) if lazy else None, refused=self._refused)


class Engine:
    """Continuous batching over ``runner``'s slots (module docstring).

    ``chunk``: prompt tokens per prefill chunk (chunks cut at multiples of it); ``token_budget``:
    tokens per step (decodes + prompt chunks; default slots + chunk); ``max_waiting``: the waiting
    queue's bound; ``sampler``: the token choice (default: each request's SamplingParams);
    ``defer_events``: deliver a step's events after the next step's launch (module docstring;
    default: on CUDA)."""

    def __init__(self, runner: ModelRunner, *, chunk: int = 512, token_budget: int | None = None,
                 max_waiting: int = 256, sampler: Sampler | None = None, log_errors: bool = True,
                 defer_events: bool | None = None):
        self.runner = runner
        self.vocab = runner.model.cfg.vocab_size
        self.slots = SlotManager(runner.slots)
        # a runner made with prefix_cache keeps prompts for later requests (runtime/prefix.py); a shared part's ring
        # rebuild is one chunk (of up to rebuild + 1 tokens), offered when it fits beside a decode step of every slot
        budget = token_budget or runner.slots + chunk
        rebuild = getattr(runner, "rebuild", None)
        self.prefix = PrefixCache(rebuild=rebuild if rebuild is not None and rebuild < budget - runner.slots else None
                                  ) if getattr(runner, "prefix_cache", False) else None
        self.scheduler = Scheduler(self.slots, chunk=chunk, token_budget=budget, max_waiting=max_waiting,
                                   prefix=self.prefix)
        self.metrics = Metrics()
        self.sampler = sampler or DefaultSampler(runner.slots, metrics=self.metrics)
        self.log_errors = log_errors  # print the traceback of a failed request (a server's log)
        self.lock = threading.RLock()  # a listener may cancel from inside on_event
        self.wake = threading.Condition(self.lock)
        self._cancel: set[Sequence] = set()
        # called (engine thread) after each step's on_event calls: a listener that batches its
        # deliveries (serve/app.py's Outbox) sends the whole step's at once
        self.after_step: list[Callable[[], None]] = []
        self.defer_events = runner.device.type == "cuda" if defer_events is None else defer_events
        self._deferred: dict[Sequence, list[int]] | None = None  # the last step's events, not yet delivered

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    # --- requests (any thread) -------------------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """A request that can never run, as one line naming the limit."""
        params.check()
        if not prompt:
            raise GptOssFp8Error("the prompt is empty; give at least one token")
        # in C loops first (an 8k-token prompt in ~0.1 ms, on the HTTP thread), then the id to name
        fast = set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < self.vocab
        bad = None if fast else next((t for t in prompt if not (isinstance(t, int) and 0 <= t < self.vocab)), None)
        if bad is not None:
            raise GptOssFp8Error(f"prompt token id {bad} is outside the vocabulary (vocab_size {self.vocab})")
        bad = next((t for t, _ in params.logit_bias if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise GptOssFp8Error(f"logit_bias token id {bad} is outside the vocabulary (vocab_size {self.vocab})")
        ctx = self.max_context
        if len(prompt) >= ctx:
            raise GptOssFp8Error(f"the prompt has {len(prompt)} tokens; the context is {ctx} tokens "
                                 f"(--max-context): give at most {ctx - 1}")
        if len(prompt) + params.max_tokens > ctx:
            raise GptOssFp8Error(f"max_tokens {params.max_tokens}: the {len(prompt)}-token prompt plus that many exceed "
                                 f"the context of {ctx} tokens (--max-context); ask for at most {ctx - len(prompt)}")

    def add(self, prompt: list[int], params: SamplingParams,
            on_event: Callable[[Sequence, list[int]], None] | None = None, keep: int = 0) -> Sequence:
        """Queue a request -> its Sequence. One line (GptOssFp8Error) if it cannot fit; QueueFull
        when the waiting queue is at its bound. ``keep``: a prompt position whose keys the prefix
        cache keeps for other requests that start with the same tokens (a chat's head)."""
        self.check(prompt, params)
        seq = Sequence(list(prompt), params, on_event)
        seq.keep = keep if self.prefix is not None and 0 < keep < len(prompt) else 0
        seq.generator = params.generator(self.runner.device)
        seq.constraint = params.constraint() if params.constraint is not None else None
        with self.lock:
            self.scheduler.add(seq)
            self.wake.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop a request: removed, and its slot freed, at the next step boundary (at once if idle)."""
        with self.lock:
            if not seq.finished:
                self._cancel.add(seq)
                self.wake.notify_all()

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._cancel or self._deferred is not None)

    def stats(self) -> dict[str, int]:
        with self.lock:
            s = self.scheduler
            return {"running": len(s.running), "waiting": len(s.waiting), "slots_used": self.slots.used,
                    "slots_total": self.slots.total, "cached_prompts": len(self.prefix.entries) if self.prefix else 0}

    # --- the loop (one thread) -------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One step -> the sequences it gave tokens or finished (their on_event called, or with
        ``defer_events`` to be called early in the next step, after its launch)."""
        with self.lock:
            for seq in self._cancel:
                if self._deferred is not None and not seq.finished:
                    self._deferred.pop(seq, None)  # cancelled before its last tokens went out: they never do
                self._finish(seq, "cancelled")
            self._cancel.clear()
            work = self.scheduler.schedule()
        touched: dict[Sequence, list[int]] = {}
        launched = None
        if not work.empty:
            launched = self._launch(work, touched)
            self.metrics.steps += 1
        if self._deferred is not None:  # the last step's events, while the GPU runs this one
            self._deliver(self._deferred)
            self._deferred = None
        if launched is not None:
            self._collect(*launched, touched)
        with self.lock:
            for seq in self._cancel:  # cancelled during the step (unless it finished in it): no more tokens for it
                if not seq.finished:
                    touched.pop(seq, None)
                    self._finish(seq, "cancelled")
            self._cancel.clear()
        if self.defer_events and launched is not None:
            self._deferred = touched
        else:
            self._deliver(touched)
        return list(touched)

    def _deliver(self, touched: dict[Sequence, list[int]]) -> None:
        for seq, new in touched.items():
            self._emit(seq, new)
        self._after_step()

    def _after_step(self) -> None:
        for hook in self.after_step:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a listener's failure is not the engine's
                traceback.print_exc()

    def _launch(self, work: Step, touched: dict[Sequence, list[int]]):
        """The step's forwards and the token choice, queued on the device -> (seqs, the sampler's
        result, start time) or None when nothing is left to sample (every forward failed)."""
        t0 = time.perf_counter()  # the runner's calls and the sampler's: the model's time (metrics.model_seconds)
        seqs: list[Sequence] = []  # to sample for, in the order of the rows of their logits
        rows: list[torch.Tensor] = []  # logits [1, V] of each finished prompt, then the decode step's [B, V]
        for seq, src, n, kind, start in work.restores:
            try:
                self.runner.restore(seq.slot, src, n, kind, start)
            except Exception as e:  # noqa: BLE001 - its request fails, the step goes on
                self._fail(seq, e, touched)
            else:
                self.metrics.cached_tokens += start
        heads = []  # prefilled up to their keep in this step
        for seq, start, end, logits in self._prefill([p for p in work.prefills if not p[0].finished], touched):
            seq.prefilled = end
            self.metrics.prompt_tokens += end - start
            if end == seq.keep:
                heads.append(seq)
            if end == len(seq.prompt):
                seq.state = State.DECODE
                seqs.append(seq)
                rows.append(logits)
        if self.prefix is not None:  # the heads and prompts now in: saved before this step's decode writes
            for kind, done in ((HEAD, heads), (PROMPT, seqs)):
                if done:
                    self.runner.snapshot([s.slot for s in done], kind)
                    for seq in done:
                        self.prefix.record(seq.slot, seq.prompt if kind == PROMPT else seq.prompt[:seq.keep], kind)
        if work.decodes:
            try:
                logits = self.runner.decode([s.slot for s in work.decodes], [s.tokens[-1] for s in work.decodes])
            except Exception as e:  # noqa: BLE001 - a decode step is shared: its sequences fail, the server goes on
                for seq in work.decodes:
                    self._fail(seq, e, touched)
            else:
                seqs.extend(work.decodes)
                rows.append(logits)
        result = None
        if seqs:
            try:
                result = self.sampler(rows[0] if len(rows) == 1 else torch.cat(rows), seqs)
            except Exception as e:  # noqa: BLE001
                for seq in seqs:
                    self._fail(seq, e, touched)
        self.metrics.model_seconds += time.perf_counter() - t0
        return None if result is None else (seqs, result)

    def _collect(self, seqs: list[Sequence], result, touched: dict[Sequence, list[int]]) -> None:
        """Wait for the step's tokens (GIL released on CUDA), append them, apply the stops."""
        t0 = time.perf_counter()
        try:
            toks, lps, *tops = result.get() if isinstance(result, Drawn) else result
            tops = tops[0] if tops else None
        except Exception as e:  # noqa: BLE001 - the step failed on the device: its sequences fail
            for seq in seqs:
                self._fail(seq, e, touched)
            return
        finally:
            self.metrics.model_seconds += time.perf_counter() - t0
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            self._append(seq, toks[i], None if lps is None else lps[i], now, None if tops is None else tops[i])
            touched.setdefault(seq, []).append(toks[i])

    def _prefill(self, prefills: list[tuple[Sequence, int, int]], touched: dict):
        """The step's prompt chunks, all in one forward (``ModelRunner.prefill_many``) -> (seq, start,
        end, logits [1, V]) of each that ran. If that forward raises, each chunk runs alone (a chunk
        rewrites its own positions, so a retry is sound) and the one that raises fails alone."""
        if not prefills:
            return []
        try:
            logits = self.runner.prefill_many([(seq.slot, seq.prompt[a:b], a) for seq, a, b in prefills])
            return [(seq, a, b, logits[i:i + 1]) for i, (seq, a, b) in enumerate(prefills)]
        except Exception as e:  # noqa: BLE001 - find who raised: one at a time
            if len(prefills) == 1:
                self._fail(prefills[0][0], e, touched)
                return []
        done = []
        for seq, a, b in prefills:
            try:
                done.append((seq, a, b, self.runner.prefill(seq.slot, seq.prompt[a:b], a)))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(seq, e, touched)
        return done

    def _append(self, seq: Sequence, tok: int, lp: float | None, now: float, top: list | None = None) -> None:
        seq.tokens.append(tok)
        if seq.constraint is not None and not seq.constraint.consume(tok):  # (a sampler that ignored its mask)
            why = (seq.constraint.error or "not allowed there").strip().splitlines() or ["not allowed there"]
            self._fail(seq, OutputFormatError(f"the output format failed at token {tok}: {why[0][:300]}"), {})
            return
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.params.top_logprobs:
            seq.top_logprobs.append(top[:seq.params.top_logprobs] if top is not None else [])
        self.metrics.generated_tokens += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft.observe(now - seq.arrived)
        else:
            self.metrics.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        p = seq.params
        if tok in p.stop_token_ids:
            seq.stop = str(tok)
            reason = "stop"
        elif p.stop_rule is not None and (why := p.stop_rule(seq.tokens)) is not None:
            seq.stop = why
            reason = "stop"
        elif len(seq.tokens) >= p.max_tokens:
            reason = "length"
        else:
            return
        with self.lock:
            self._finish(seq, reason)

    def _fail(self, seq: Sequence, e: BaseException, touched: dict) -> None:
        seq.error = f"{type(e).__name__}: {e}" if not isinstance(e, GptOssFp8Error) else str(e)
        seq.exception = e
        if self.log_errors and not isinstance(e, GptOssFp8Error):
            traceback.print_exception(e)
        with self.lock:
            self._finish(seq, "error")
        touched.setdefault(seq, [])

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Under the lock: the request leaves, its slot freed now."""
        if seq.finished:
            return
        slot = seq.slot
        if (self.prefix is not None and slot is not None and reason != "error" and seq.state is State.DECODE
                and len(seq.tokens) > 1):  # its prompt and reply's keys (but the last token's), kept: runtime/prefix.py
            self.runner.snapshot([slot], REPLY)
            self.prefix.record(slot, seq.prompt + seq.tokens[:-1], REPLY)
        self.scheduler.remove(seq)
        if slot is not None:
            self.runner.release(slot)
        seq.state, seq.finish = State.FINISHED, reason
        self.metrics.requests_finished[reason] = self.metrics.requests_finished.get(reason, 0) + 1
        if reason == "cancelled" and seq.on_event is not None:
            self._emit(seq, [])

    def _emit(self, seq: Sequence, new: list[int]) -> None:
        if seq.on_event is None:
            return
        try:
            seq.on_event(seq, new)
        except Exception:  # noqa: BLE001 - a listener's failure is its request's, not the engine's
            traceback.print_exc()
            if not seq.finished:
                self.cancel(seq)

    def run_until_done(self) -> None:
        """Step until no request is left (one thread: generate, tests)."""
        while self.has_work():
            self.step()


class EngineThread:
    """``engine``'s loop in a daemon thread: steps while there is work, sleeps on the engine's
    condition otherwise (``add`` / ``cancel`` wake it). ``stop`` ends it after the current step."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="gptoss-fp8-engine", daemon=True)

    def start(self) -> EngineThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self.engine.lock:
            self._stop = True
            self.engine.wake.notify_all()
        self.thread.join(timeout)

    def _loop(self) -> None:
        e = self.engine
        try:
            while True:
                with e.lock:
                    while not self._stop and not e.has_work():
                        e.wake.wait()
                    if self._stop:
                        return
                with torch.inference_mode():
                    e.step()
        except BaseException as err:  # noqa: BLE001 - recorded for /health; the requests are failed
            self.error = err
            traceback.print_exc()
            with e.lock:
                left = [*e.scheduler.running, *e.scheduler.waiting]
                for seq in left:
                    seq.error = f"the engine stopped: {err}"
                    e._finish(seq, "error")
            for seq in left:  # their handlers hear it now
                e._emit(seq, [])
            e._after_step()

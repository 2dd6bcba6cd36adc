"""The host's cost of structured output per engine step: the allowed-token masks of B constrained sequences
(serve/grammar.py over the o200k_harmony vocabulary) as a reply goes on, each step at a state the matchers have not
seen (a mask at a state seen before is cheaper: llguidance keeps what it built), made one at a time
(``Grammar.allow``) and at once in llguidance's threads (``Grammar.allow_many``, what ``allowed_mask`` uses for 2 or
more), and the whole ``allowed_mask`` (the masks, the copy, the unpacking on the device). The B sequences walk the
same reply (reasoning, then a JSON answer), a fresh grammar each round.

Then the sampler's whole step, side by side (``--sampler``): ``DefaultSampler`` lazy (each token drawn freely and
checked, a mask made only when refused: the default) against ``lazy=False`` (every mask first), over B rows of random
logits [B, 201088] on the device with the reply's next token raised by ``--lead`` (20: a model that follows its format,
never refused; 0: random logits, refused wherever the grammar narrows), greedy, a fresh grammar each round; ms from the
call to the tokens read (``Drawn.get``), with the B checks alone beside them.

    python benchmarks/grammar_mask.py [--batch 1,8,64] [--device cpu|cuda] [--rounds 3] [--sampler] [--lead 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptoss_fp8.runtime.engine import DefaultSampler
from gptoss_fp8.runtime.sampling import SamplingParams, allowed_mask
from gptoss_fp8.runtime.sequence import Sequence
from gptoss_fp8.serve import grammar, harmony

V = 201088
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["answer", "score", "tags"], "additionalProperties": False}
REPLY = ('<|channel|>analysis<|message|>The user wants the capital of France with a score and tags, so the answer is '
         'Paris.<|end|><|start|>assistant<|channel|>final<|message|>{"answer":"The capital of France is Paris",'
         '"score":97,"tags":["geography","europe","capitals"]}<|return|>')


def _walk(rules, ids, how) -> list[float]:
    """ms of ``how(rules)`` at each token of ids (each rule then takes the token)."""
    times = []
    for tok in ids[:-1]:
        t0 = time.perf_counter()
        how(rules)
        times.append((time.perf_counter() - t0) * 1e3)
        for r in rules:
            assert r.consume(tok), r.error
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sampler", action="store_true", help="only the sampler's step, lazy beside masked first")
    ap.add_argument("--lead", type=float, default=20.0, help="logit lead of the reply's next token (0: none)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    ids = harmony.encoding().encode(REPLY, allowed_special="all")
    t0 = time.perf_counter()
    grammar.tokenizer(V)
    print(f"tokenizer: {time.perf_counter() - t0:.2f} s (once a server, off the event loop)")
    packed = torch.empty((max(int(b) for b in a.batch.split(",")), (V + 31) // 32), dtype=torch.int32)

    def one(rules):
        for i, r in enumerate(rules):
            r.allow(packed[i])

    def many(rules):
        grammar.Grammar.allow_many(rules, packed, list(range(len(rules))))

    def whole(rules):
        allowed_mask(rules, V, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if a.sampler:
        return sampler_steps(ids, [int(b) for b in a.batch.split(",")], dev, a.rounds, a.lead)
    print(f"{len(ids) - 1} steps a reply; ms per step, median / p90 / max over {a.rounds} rounds")
    print(f"{'B':>4s} {'compile ms':>10s} {'one at a time':>22s} {'at once':>22s} {'allowed_mask':>22s}")
    for b in (int(x) for x in a.batch.split(",")):
        cols, compiles = {"one": [], "many": [], "whole": []}, []
        for _ in range(a.rounds):
            for name, how in (("one", one), ("many", many), ("whole", whole)):
                schema = {**SCHEMA, "description": f"round {len(compiles)}"}  # (a new grammar: no state seen before)
                t0 = time.perf_counter()
                make = grammar.constraint(grammar.Format(schema), V)
                compiles.append((time.perf_counter() - t0) * 1e3)
                cols[name] += _walk([make() for _ in range(b)], ids, how)

        def fmt(xs):
            xs = sorted(xs)
            return f"{statistics.median(xs):.3f} / {xs[int(0.9 * len(xs))]:.3f} / {xs[-1]:.1f}"

        print(f"{b:4d} {statistics.median(compiles):10.1f} {fmt(cols['one']):>22s} {fmt(cols['many']):>22s} "
              f"{fmt(cols['whole']):>22s}")


def _fmt(xs) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.3f} / {xs[int(0.9 * len(xs))]:.3f} / {xs[-1]:.1f}"


def sampler_steps(ids: list[int], batches: list[int], dev: torch.device, rounds: int, lead: float) -> None:
    """The module docstring's second table."""
    print(f"sampler: {len(ids) - 1} steps a reply, the next token's lead {lead}; ms per step, median / p90 / max over "
          f"{rounds} rounds")
    print(f"{'B':>4s} {'checks alone':>22s} {'lazy (default)':>22s} {'masks first':>22s} {'refused of checked':>19s}")
    gen = torch.Generator(device=dev).manual_seed(0)
    for b in batches:
        cols, refused, drawn = {"check": [], True: [], False: []}, 0, 0
        for r in range(rounds):
            for lazy in (True, False) if r % 2 == 0 else (False, True):
                make = grammar.constraint(grammar.Format({**SCHEMA, "description": f"{b} {r} {lazy}"}), V)
                seqs = [Sequence([1], SamplingParams(temperature=0), slot=i, constraint=make()) for i in range(b)]
                sampler = DefaultSampler(b, lazy=lazy)
                for tok in ids[:-1]:
                    logits = torch.randn(b, V, device=dev, generator=gen)
                    logits[:, tok] += lead
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if lazy:
                        t0 = time.perf_counter()
                        [s.constraint.check(tok) for s in seqs]
                        cols["check"].append((time.perf_counter() - t0) * 1e3)
                    t0 = time.perf_counter()
                    got = sampler(logits, seqs).get()[0]
                    cols[lazy].append((time.perf_counter() - t0) * 1e3)
                    for s, t in zip(seqs, got, strict=True):  # (each rule takes its own token: the walk stays on
                        assert s.constraint.consume(t), s.constraint.error  # the reply only while lead rules)
                    if any(s.constraint.matcher.is_stopped() for s in seqs):
                        break  # (a reply of random tokens that ended early)
                if lazy:  # (its counters: the tokens checked, and refused)
                    drawn, refused = drawn + sampler.metrics.structured_checked, refused + sampler.metrics.structured_refused
        print(f"{b:4d} {_fmt(cols['check']):>22s} {_fmt(cols[True]):>22s} {_fmt(cols[False]):>22s} "
              f"{refused / max(drawn, 1):19.1%}")


if __name__ == "__main__":
    main()

"""The host's cost of structured output per engine step: the allowed-token masks of B constrained sequences
(serve/grammar.py over the o200k_harmony vocabulary) as a reply goes on, each step at a state the matchers have not
seen (a mask at a state seen before is cheaper: llguidance keeps what it built), made one at a time
(``Grammar.allow``) and at once in llguidance's threads (``Grammar.allow_many``, what ``allowed_mask`` uses for 2 or
more), and the whole ``allowed_mask`` (the masks, the copy, the unpacking on the device). The B sequences walk the
same reply (reasoning, then a JSON answer), a fresh grammar each round.

    python benchmarks/grammar_mask.py [--batch 1,8,64] [--device cpu|cuda] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptoss_fp8.runtime.sampling import allowed_mask
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


if __name__ == "__main__":
    main()

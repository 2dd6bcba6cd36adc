"""The host's cost of structured output per engine step: the allowed-token masks of B constrained sequences
(serve/grammar.py over the o200k_harmony vocabulary), made one at a time (``Grammar.allow``) and at once in
llguidance's threads (``Grammar.allow_many``, what ``allowed_mask`` uses for 2 or more), and the whole
``allowed_mask`` (the masks, the copy, the unpacking on the device), at states a reply passes through: reasoning text,
inside a JSON string, between JSON values.

    python benchmarks/grammar_mask.py [--batch 1,8,64] [--device cpu|cuda] [--rounds 20]
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
STATES = {
    "reasoning": "<|channel|>analysis<|message|>The user wants a short answer with a score, so",
    "json string": '<|channel|>final<|message|>{"answer":"The capital of France is',
    "json value": '<|channel|>final<|message|>{"answer":"Paris","score":',
}


def _ms(f, rounds: int) -> float:
    f()  # (warm: the lexer states these masks need)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device(a.device)
    enc = harmony.encoding()
    t0 = time.perf_counter()
    make = grammar.constraint(grammar.Format(SCHEMA), V)
    print(f"tokenizer + grammar: {time.perf_counter() - t0:.2f} s (once a server; a grammar once a request)")
    t0 = time.perf_counter()
    for _ in range(10):
        make()
    print(f"a sequence's matcher (a copy): {(time.perf_counter() - t0) * 100:.3f} ms")
    print(f"{'state':12s} {'B':>4s} {'one at a time ms':>17s} {'at once ms':>11s} {'allowed_mask ms':>16s}")
    for name, text in STATES.items():
        ids = enc.encode(text, allowed_special="all")
        for b in (int(x) for x in a.batch.split(",")):
            rules = [make() for _ in range(b)]
            for r in rules:
                assert all(r.consume(t) for t in ids), r.error
            packed = torch.empty((b, (V + 31) // 32), dtype=torch.int32)
            one = _ms(lambda: [r.allow(packed[i]) for i, r in enumerate(rules)], a.rounds)  # noqa: B023
            many = _ms(lambda: grammar.Grammar.allow_many(rules, packed, list(range(b))), a.rounds)  # noqa: B023
            whole = _ms(lambda: allowed_mask(rules, V, dev) if dev.type == "cpu"  # noqa: B023
                        else (allowed_mask(rules, V, dev), torch.cuda.synchronize()), a.rounds)  # noqa: B023
            print(f"{name:12s} {b:4d} {one:17.3f} {many:11.3f} {whole:16.3f}")


if __name__ == "__main__":
    main()

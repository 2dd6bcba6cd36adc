"""issue 35 on the GPU: the serving engine in kernels mode (decode steps replayed as CUDA graphs per
batch bucket) against ``generate`` alone, on the trained fixture (a model whose greedy replies are
text, so near ties are rare and a divergence means something).

Eight requests of different prompt lengths join the running batch at different steps; each greedy
reply is compared with the same prompt run alone (one slot, batch 1). The FP8 kernels are not batch
invariant bit for bit: a decode step at batch 8 runs the skinny GEMMs / MoE with other tiles and
split-K than at batch 1, and a prompt chunk of 64 tokens takes other GEMM tiles than the whole prompt,
so a logit may move by the accumulation order's rounding and a near tie may flip. What is asserted
is the issue's bound: over all requests, >= 99% of the tokens come before each request's first
divergence; every divergence is printed with its margin (the alone run's logit gap between the two
tokens, measured by a teacher-forced kernels forward), the reading that says whether it was a tie."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

NEW = 96
SOURCE = '''import os
import sys


def walk(root):
    """Yield every file under root."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, n=1):
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
'''
CUTS = [(0, 40), (15, 70), (100, 110), (200, 320), (260, 300), (330, 420), (380, 393), (120, 498)]


def test_kernels_greedy_under_concurrency_agree_with_alone(trained):
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.runtime.engine import Engine
    from gptoss_fp8.runtime.runner import ModelRunner
    from gptoss_fp8.runtime.sampling import SamplingParams
    from gptoss_fp8.tokenizer import ByteTokenizer
    from gptoss_fp8.verify import generate as gen
    from gptoss_fp8.verify.backends import ops_for

    dst = trained[0]
    model = load_model(dst, device="cuda")
    ops = ops_for("kernels")
    tok = ByteTokenizer()
    prompts = [tok.encode(SOURCE[a:b]) for a, b in CUTS]
    runner = ModelRunner(model, ops, len(prompts), 1024)
    assert runner.graphs is not None  # decode steps replay CUDA graphs per bucket
    engine = Engine(runner, chunk=64)
    seqs, batches = [], []
    for i, p in enumerate(prompts):  # two join at once, the next two steps later, ...
        seqs.append(engine.add(p, SamplingParams(max_tokens=NEW)))
        if i % 2:
            for _ in range(3):
                engine.step()
                batches.append(sum(s.slot is not None for s in seqs))
    while engine.has_work():
        engine.step()
    assert max(batches) >= 4
    together = [list(s.tokens) for s in seqs]
    alone = [gen.generate(model, p, ops, max_new_tokens=NEW).tokens for p in prompts]

    agreed, total, lines = 0, 0, []
    for p, t, a in zip(prompts, together, alone, strict=True):
        assert len(t) == len(a) == NEW
        d = next((j for j, (x, y) in enumerate(zip(t, a, strict=True)) if x != y), NEW)
        agreed, total = agreed + d, total + NEW
        if d < NEW:
            logits = model.forward(torch.tensor(p + a[:d], device="cuda"), ops, last_only=True)[0].float()
            top2 = logits.topk(2).values
            lines.append(f"prompt {len(p)} tokens: first divergence at {d}: alone {a[d]} (logit {logits[a[d]]:.3f}), "
                         f"together {t[d]} (logit {logits[t[d]]:.3f}); alone's top-2 gap {top2[0] - top2[1]:.3f}")
    print(f"\nkernels, cuda graphs, 8 requests x {NEW} tokens, batches up to {max(batches)}: "
          f"{agreed} of {total} tokens ({agreed / total:.1%}) before each request's first divergence")
    print("\n".join(lines) or "no divergence: every reply equal to its run alone")
    assert agreed >= 0.99 * total, lines


def test_sampler_on_cuda_matches_the_cpu():
    """The batched sampler's device path (penalties, logit_bias, alternatives, seeded samples through pinned
    copies) gives the CPU path's choices on the same logits."""
    from gptoss_fp8.runtime.sampling import SamplingParams, sample

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 1000, generator=g) * 3  # (float32: no ties among the alternatives)
    params = [SamplingParams(logprobs=True, top_logprobs=4, frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(logit_bias=((17, 100.0),)), SamplingParams(logprobs=True, logit_bias=((3, -100.0),)),
              SamplingParams(temperature=0.9, seed=3, presence_penalty=2.0)]
    outputs = [[int(logits[0].argmax())] * 3, [], [1, 2], [int(logits[3].argmax())]]
    got = {}
    for dev in ("cpu", "cuda"):
        gens = [p.generator(torch.device(dev)) for p in params]
        got[dev] = sample(logits.to(dev), params, gens, outputs)
    (tc, lc, kc), (tg, lg, kg) = got["cpu"], got["cuda"]
    assert tc[:3] == tg[:3] and tg[1] == 17 and tg[0] != outputs[0][0]  # greedy rows; the penalty moved row 0
    assert lg[:3] == pytest.approx(lc[:3], abs=1e-5)  # (row 3's seeded sample differs between the devices)
    assert [[t for t, _ in r] for r in kg] == [[t for t, _ in r] for r in kc]
    assert 0 <= tg[3] < 1000  # (a seeded sample: the generators of the two devices differ)


def test_prefix_cache_on_cuda_gives_the_cold_reply(trained):
    """The prefix cache in kernels mode with CUDA graphs: a conversation's next turn restored in place (after decode
    riders wrote over its free slot) and copied into another slot gives the reply of an engine without the cache.
    The kernels are not batch invariant (a chunk that starts at the cached prompt's end takes other tiles), so a near
    tie may flip: each reply's first 16 tokens at least equal the cold ones, the first one's logprob (the restored
    keys' own effect; later ones also carry the decode batches' other tiles: printed) within 0.01, and at a
    divergence the cold run's two tokens within 0.25 of a logit (a tie, not a wrong key). Measured on an H100
    (2026-12-07): 40 of 40 and 53 of 96 tokens equal, then a tie 0.062 apart; the first logprobs 1.6e-5 apart."""
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.runtime.engine import Engine
    from gptoss_fp8.runtime.runner import ModelRunner
    from gptoss_fp8.runtime.sampling import SamplingParams
    from gptoss_fp8.tokenizer import ByteTokenizer
    from gptoss_fp8.verify.backends import ops_for

    model = load_model(trained[0], device="cuda")
    ops, tok = ops_for("kernels"), ByteTokenizer()
    warm = Engine(ModelRunner(model, ops, 4, 1024, prefix_cache=True), chunk=64)
    cold = Engine(ModelRunner(model, ops, 4, 1024), chunk=64)
    assert warm.runner.graphs is not None

    p1 = tok.encode(SOURCE[:300])
    first = warm.add(p1, SamplingParams(max_tokens=24))
    other = warm.add(tok.encode(SOURCE[300:]), SamplingParams(max_tokens=60))
    while not first.finished:
        warm.step()
    for _ in range(8):
        warm.step()  # first's slot free, riding other's decode steps
    p2 = p1 + first.tokens + tok.encode("\n\ndef second(x):\n")
    busy = warm.add(p2, SamplingParams(max_tokens=40, logprobs=True))  # p1's slot, in place
    warm.step()
    ext = warm.add(p2 + tok.encode("    return"), SamplingParams(max_tokens=NEW, logprobs=True))  # copied from busy's
    warm.run_until_done()
    # (busy reuses first's prompt and reply but its last token, saved when first ended; ext busy's prompt)
    assert not other.error and busy.cached == len(p1) + len(first.tokens) - 1 and ext.cached == len(p2)
    assert ext.slot is None
    _versus_cold(model, ops, cold, [(busy, p2), (ext, p2 + tok.encode("    return"))])


def _versus_cold(model, ops, cold, runs) -> None:
    """Each (warm sequence, its prompt) of ``runs`` against the same prompt on ``cold``: at least 16 tokens equal,
    the first logprob within 0.01, and at a divergence a near tie (the previous test's docstring); printed."""
    from gptoss_fp8.runtime.sampling import SamplingParams

    lines = []
    for seq, prompt in runs:
        ref = cold.add(prompt, SamplingParams(max_tokens=len(seq.tokens), logprobs=True))
        cold.run_until_done()
        d = next((j for j, (x, y) in enumerate(zip(seq.tokens, ref.tokens, strict=True)) if x != y), len(ref.tokens))
        drift = max((abs(x - y) for x, y in zip(seq.logprobs[:d], ref.logprobs[:d], strict=True)), default=0.0)
        line = (f"{len(prompt)}-token prompt ({seq.cached} cached): {d} of {len(ref.tokens)} tokens equal, logprobs "
                f"within {drift:.2e}")
        if d < len(ref.tokens):  # the cold run's logits there, teacher-forced: a near tie, or not
            logits = model.forward(torch.tensor(prompt + ref.tokens[:d], device="cuda"), ops, last_only=True)[0].float()
            gap = float(logits[ref.tokens[d]] - logits[seq.tokens[d]])
            line += f"; then cold {ref.tokens[d]}, warm {seq.tokens[d]}: logit gap {gap:.3f}"
            assert gap < 0.25, line
        lines.append(line)
        assert d >= 16 and abs(seq.logprobs[0] - ref.logprobs[0]) < 0.01, line
    print("\n" + "\n".join(lines))


def test_prefix_cache_shared_part_on_cuda_gives_the_cold_reply(trained):
    """A prompt that shares only its first 400 tokens with a cached one (another ending): the full layers' rows come
    from the cache and the two sliding layers' rings are rebuilt by one chunk of the last 126 shared tokens (kernels
    mode, CUDA graphs), in place after riders wrote over the free slot, then copied from that slot while it runs.
    The replies agree with an engine without the cache as the previous test's do."""
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.runtime.engine import Engine
    from gptoss_fp8.runtime.runner import ModelRunner
    from gptoss_fp8.runtime.sampling import SamplingParams
    from gptoss_fp8.tokenizer import ByteTokenizer
    from gptoss_fp8.verify.backends import ops_for

    model = load_model(trained[0], device="cuda")
    ops, tok = ops_for("kernels"), ByteTokenizer()
    warm = Engine(ModelRunner(model, ops, 4, 1024, prefix_cache=True), chunk=256)
    cold = Engine(ModelRunner(model, ops, 4, 1024), chunk=256)
    assert warm.prefix.rebuild == 126 and warm.runner.graphs is not None
    doc = tok.encode(SOURCE[:400])
    first = warm.add(doc + tok.encode("one = 1\n"), SamplingParams(max_tokens=8))
    other = warm.add(tok.encode(SOURCE[400:]), SamplingParams(max_tokens=60))
    while not first.finished:
        warm.step()
    for _ in range(4):
        warm.step()  # first's slot free, riding other's decode steps
    a = warm.add(doc + tok.encode("two = 2\n"), SamplingParams(max_tokens=40, logprobs=True))  # in place
    warm.step()
    b = warm.add(doc + tok.encode("\n\ndef third(x):\n"), SamplingParams(max_tokens=NEW, logprobs=True))  # copied
    warm.run_until_done()
    assert not other.error and a.cached == b.cached == 400 - 126 and a.kept == b.kept == 400
    _versus_cold(model, ops, cold, [(a, doc + tok.encode("two = 2\n")), (b, doc + tok.encode("\n\ndef third(x):\n"))])

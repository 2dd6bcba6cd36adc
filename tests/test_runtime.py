"""The runtime without HTTP: the scheduler's chunks and token budget, slots lowest first and freed
at once on cancellation, decode riders' lengths put back, requests checked against the context,
and a long prompt never stalling the running decodes."""

import pytest
import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.runtime.engine import Engine
from gptoss_fp8.runtime.prefix import HOLD_MIN, MIN_SHARED, Placement, PrefixCache, reusable
from gptoss_fp8.runtime.runner import ModelRunner
from gptoss_fp8.runtime.sampling import SamplingParams, TokenCounts, draw, nucleus, penalize
from gptoss_fp8.runtime.scheduler import QueueFull, Scheduler
from gptoss_fp8.runtime.sequence import Sequence, State
from gptoss_fp8.runtime.slots import SlotManager


def _tiny(root, layers: int, seed: int):
    """A converted synthetic tiny model of ``layers`` layers (sliding window 8, then full, alternating), loaded."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic
    from gptoss_fp8.model.load import load_model

    write_synthetic(root / "src", "tiny", layers=layers, seed=seed, layout="hf", sliding_window=8)
    convert_checkpoint(root / "src", root / "fp8")
    return load_model(root / "fp8")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("runtime"), 2, 2)


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    """Four layers: two sliding under two full, so a ring rebuild must cover both (14 tokens)."""
    return _tiny(tmp_path_factory.mktemp("runtime4"), 4, 4)


def _engine(model, slots=3, ctx=64, **kw):
    return Engine(ModelRunner(model, get_ops("weights"), slots, ctx), **kw)


def test_scheduler_cuts_prompts_at_fixed_points_under_the_budget():
    sched = Scheduler(SlotManager(2), chunk=4, token_budget=6, max_waiting=1)
    a, b, c = (Sequence(list(range(n)), SamplingParams()) for n in (10, 3, 5))
    for s in (a, b, c):
        sched.add(s)
    with pytest.raises(QueueFull):
        sched.add(Sequence([1], SamplingParams()))  # a and b will take the 2 slots, c is the 1 waiting allowed
    step = sched.schedule()  # a and b take the slots; c waits
    assert [(s.slot, x, y) for s, x, y in step.prefills] == [(0, 0, 4)] and list(sched.waiting) == [c]
    a.prefilled = 4
    step = sched.schedule()  # 4 tokens of budget left after a's chunk: b's 3-token prompt does not fit in 2
    assert [(x, y) for _, x, y in step.prefills] == [(4, 8)]
    a.prefilled, a.state = 10, State.DECODE
    step = sched.schedule()
    assert step.decodes == [a] and [(s.slot, x, y) for s, x, y in step.prefills] == [(1, 0, 3)]
    sched.remove(a)
    assert a.slot is None and sched.slots.available == 1
    step = sched.schedule()
    assert c.slot == 0  # the lowest free slot


def test_a_long_prompt_does_not_stall_the_running_decodes(model):
    eng = _engine(model, slots=2, ctx=64, chunk=4, token_budget=5)
    short = eng.add([1, 2, 3], SamplingParams(max_tokens=20))
    eng.step()  # its prompt in, first token
    long = eng.add(list(range(40, 80)), SamplingParams(max_tokens=2))
    steps = 0
    while long.state is not State.DECODE:
        before = len(short.tokens)
        eng.step()
        steps += 1
        assert len(short.tokens) == before + 1  # one token every step while the long prompt goes in
    assert steps == 10 and long.prefilled == 40  # 40 tokens in chunks of 4


def test_cancel_frees_the_slot_at_the_next_step_and_riders_keep_their_lengths(model):
    eng = _engine(model, slots=3, ctx=64, chunk=64)
    seqs = [eng.add(list(range(5, 5 + n)), SamplingParams(max_tokens=12)) for n in (4, 6, 8)]
    eng.step()
    eng.step()
    assert [s.slot for s in seqs] == [0, 1, 2] and eng.runner.cache.host_lengths == [5, 7, 9]
    eng.cancel(seqs[1])
    eng.step()  # the cancel is taken at the step boundary: slot 1 free, a rider of this step at length 0
    assert seqs[1].finish == "cancelled" and eng.slots.available == 1
    assert eng.runner.cache.host_lengths == [6, 0, 10] and eng.runner.cache.lengths.tolist() == [6, 0, 10]
    again = eng.add([9, 9], SamplingParams(max_tokens=1))
    eng.step()
    assert again.slot is None and again.finish == "length" and len(again.tokens) == 1  # ran in slot 1, left
    assert eng.runner.cache.host_lengths == [7, 0, 11]
    eng.run_until_done()
    assert eng.slots.available == 3 and eng.runner.cache.lengths.tolist() == [0, 0, 0]
    assert [len(s.tokens) for s in (seqs[0], seqs[2])] == [12, 12]


def test_requests_are_checked_against_the_context(model):
    eng = _engine(model, slots=1, ctx=16)
    with pytest.raises(GptOssFp8Error, match=r"the context is 16 tokens \(--max-context\): give at most 15"):
        eng.add(list(range(16)), SamplingParams(max_tokens=1))
    with pytest.raises(GptOssFp8Error, match="ask for at most 6"):
        eng.add(list(range(10)), SamplingParams(max_tokens=7))
    with pytest.raises(GptOssFp8Error, match="outside the vocabulary"):
        eng.add([1, 10**6], SamplingParams())
    with pytest.raises(GptOssFp8Error, match="top_p 0"):
        eng.add([1], SamplingParams(top_p=0))
    seq = eng.add(list(range(10)), SamplingParams(max_tokens=6))
    eng.run_until_done()
    assert len(seq.tokens) == 6 and eng.runner.cache.host_lengths == [0]


def test_stop_tokens_and_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.equal(nucleus(probs, 0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.equal(nucleus(probs, 0.5), torch.tensor([1.0, 0, 0, 0]))
    assert torch.equal(nucleus(probs, 1.0), probs)


def _penalized_ref(row: list[float], out: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI's rule, one logit at a time: logit[j] - frequency * count[j] - presence * (count[j] > 0)."""
    return [v - frequency * out.count(j) - presence * (out.count(j) > 0) for j, v in enumerate(row)]


def test_penalties_follow_openais_rule_on_the_generated_ids():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=g) * 3
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.5), SamplingParams(),
              SamplingParams(presence_penalty=-1.25), SamplingParams(frequency_penalty=2.0)]
    outputs = [[5, 5, 9, 31, 5], [1, 2], [0, 39, 39], []]
    got = penalize(logits, params, outputs)
    for i, p in enumerate(params):
        want = _penalized_ref(logits[i].tolist(), outputs[i], p.presence_penalty, p.frequency_penalty)
        assert torch.allclose(got[i], torch.tensor(want), rtol=0, atol=1e-6), i
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])  # no penalty / nothing generated yet
    assert not torch.equal(got[0], logits[0]) and torch.equal(penalize(logits, [SamplingParams()] * 4, outputs), logits)
    toks, lps, tops = draw(logits, params, [None] * 4, outputs).get()  # greedy on the penalized rows
    assert toks == [int(torch.tensor(_penalized_ref(logits[i].tolist(), outputs[i], p.presence_penalty,
                                                    p.frequency_penalty)).argmax()) for i, p in enumerate(params)]
    assert lps is None and tops is None
    with pytest.raises(GptOssFp8Error, match="generated ids"):
        draw(logits, params, [None] * 4)
    bias = [SamplingParams(logit_bias=((int(logits[0].argmin()), 100.0), (7, -3.5))), SamplingParams(frequency_penalty=1.0,
            logit_bias=((39, 0.25),))]
    got = penalize(logits[:2], bias, [[], [39, 39]])
    want = logits[:2].clone()
    want[0, logits[0].argmin()] += 100
    want[0, 7] -= 3.5
    want[1, 39] += 0.25 - 2.0
    assert torch.allclose(got, want, rtol=0, atol=1e-5) and draw(logits[:1], bias[:1], [None]).get()[0] == [
        int(logits[0].argmin())]  # (no generated ids needed for a bias alone)


def test_token_counts_count_each_steps_new_ids_per_slot():
    """TokenCounts over steps (each request's new ids only), a slot taken by another request (its row starts over), and
    draw with those counts equals draw with the whole replies."""
    counts, g = TokenCounts(3), torch.Generator().manual_seed(5)
    replies = {1: [], 2: [], 3: []}
    for step in range(6):
        live = [(0, 1), (2, 2)] if step < 4 else [(0, 3), (2, 2)]  # request 3 takes request 1's slot at step 4
        for _, rid in live:
            replies[rid] += torch.randint(0, 9, (1 + step % 2,), generator=g).tolist()
        got = counts.rows([(slot, rid, replies[rid]) for slot, rid in live], 9, torch.device("cpu"))
        want = torch.stack([torch.bincount(torch.tensor(replies[rid], dtype=torch.long), minlength=9).float()
                            for _, rid in live])
        assert torch.equal(got, want), step
    logits = torch.randn(2, 9, generator=g)
    params = [SamplingParams(frequency_penalty=1.5, presence_penalty=0.5), SamplingParams(presence_penalty=-1.0)]
    outs = [replies[3], replies[2]]
    assert torch.equal(penalize(logits, params, None, counts.rows([(0, 3, outs[0]), (2, 2, outs[1])], 9, logits.device)),
                       penalize(logits, params, outs))


def _repeated_ref(row: list[float], seen: set[int], r: float) -> list[float]:
    """The repetition penalty, one logit at a time: a seen token's positive logit / r, its negative one * r."""
    return [(v / r if v > 0 else v * r) if j in seen else v for j, v in enumerate(row)]


def test_repetition_penalty_covers_the_prompt_and_the_reply():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 30, generator=g) * 3
    counts = TokenCounts(4)
    reqs = [(3, 7, [1, 2, 2, 29], [5, 9]), (1, 8, [0], [])]  # (slot, id, prompt, reply so far)
    seen = counts.seen_rows(reqs, 30, logits.device)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in seen] == [{1, 2, 29, 5, 9}, {0}]
    reqs[0][3].append(12)  # the next step: its new id only
    seen = counts.seen_rows(reqs, 30, logits.device)
    assert set(torch.nonzero(seen[0]).flatten().tolist()) == {1, 2, 29, 5, 9, 12}
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5), SamplingParams(),
              SamplingParams(repetition_penalty=0.8)]
    got = penalize(logits, params, [[5, 9, 12], [], []], seen=seen)
    want0 = torch.tensor(_repeated_ref(logits[0].tolist(), {1, 2, 29, 5, 9, 12}, 1.3))
    want0[[5, 9, 12]] -= 0.5  # (then the presence penalty over the reply)
    assert torch.allclose(got[0], want0, rtol=0, atol=1e-6) and torch.equal(got[1], logits[1])
    assert torch.allclose(got[2], torch.tensor(_repeated_ref(logits[2].tolist(), {0}, 0.8)), rtol=0, atol=1e-6)
    with pytest.raises(GptOssFp8Error, match="repetition_penalty; pass seen"):
        penalize(logits, params, [[], [], []])
    with pytest.raises(GptOssFp8Error, match="repetition_penalty 0.0"):
        SamplingParams(repetition_penalty=0.0).check()


def test_top_logprobs_are_the_models_own_distribution():
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 64, generator=g) * 4).bfloat16()
    params = [SamplingParams(logprobs=True, top_logprobs=5, temperature=0.7, seed=1, frequency_penalty=1.0),
              SamplingParams(logprobs=True), SamplingParams(logprobs=True, top_logprobs=2)]
    gens = [p.generator(torch.device("cpu")) for p in params]
    toks, lps, tops = draw(logits, params, gens, [[3, 3], [], []]).get()
    logp = torch.log_softmax(logits.float(), dim=-1)  # before temperature, penalties and top_p
    for i in range(3):
        assert lps[i] == pytest.approx(float(logp[i, toks[i]]), abs=1e-6)
        order = logp[i].argsort(descending=True)[:5]
        assert [t for t, _ in tops[i]] == order.tolist()  # every row gets the largest k asked: 5
        assert [v for _, v in tops[i]] == pytest.approx(logp[i, order].tolist(), abs=1e-6)
    assert toks[1] == tops[1][0][0] and toks[2] == tops[2][0][0]  # greedy rows: the most likely token
    for bad, msg in ((dict(top_logprobs=3), "needs logprobs"), (dict(logprobs=True, top_logprobs=21), "0 to 20"),
                     (dict(presence_penalty=2.5), "presence_penalty 2.5"),
                     (dict(frequency_penalty=float("nan")), "frequency_penalty nan"),
                     (dict(logit_bias=((5, 101.0),)), "logit_bias of token 5: 101.0"),
                     (dict(seed=2**64), "seed 18446744073709551616: give an integer that fits in 64 bits"),
                     (dict(seed=-2**63 - 1), "fits in 64 bits")):
        with pytest.raises(GptOssFp8Error, match=msg):
            SamplingParams(**bad).check()


def test_the_engine_keeps_each_requests_own_alternatives(model):
    eng = _engine(model, slots=2, ctx=32)  # (the penalties: a request's own reply, replayed)
    a = eng.add([3, 4, 5], SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3))
    b = eng.add([7, 8], SamplingParams(max_tokens=12, logprobs=True, frequency_penalty=2.0, presence_penalty=2.0))
    eng.run_until_done()
    c = eng.add([7, 8], SamplingParams(max_tokens=12))
    eng.run_until_done()
    assert b.tokens != c.tokens and len(set(c.tokens)) < 12  # (this model repeats itself unpenalized)
    assert len(a.top_logprobs) == 6 and all(len(t) == 3 for t in a.top_logprobs) and b.top_logprobs == []
    assert [t[0][0] for t in a.top_logprobs] == a.tokens  # greedy: the most likely token each step
    assert [t[0][1] for t in a.top_logprobs] == pytest.approx(a.logprobs, abs=1e-6)
    # b's choices, replayed from one forward over its prompt and reply: each the argmax of its penalized logits
    logits = model(torch.tensor([7, 8] + b.tokens), get_ops("weights")).float()[1:]
    for k, tok in enumerate(b.tokens):
        row = _penalized_ref(logits[k].tolist(), b.tokens[:k], 2.0, 2.0)
        assert row[tok] >= max(row) - 1e-3, k
        assert b.logprobs[k] == pytest.approx(float(torch.log_softmax(logits[k], -1)[tok]), abs=2e-2)


def test_the_engine_applies_a_repetition_penalty_over_prompt_and_reply(model):
    eng = _engine(model, slots=2, ctx=32)
    prompt = [7, 8, 9, 7]
    a = eng.add(prompt, SamplingParams(max_tokens=10, logprobs=True, repetition_penalty=1.8))
    b = eng.add(prompt, SamplingParams(max_tokens=10))
    eng.run_until_done()
    assert a.tokens != b.tokens
    logits = model(torch.tensor(prompt + a.tokens), get_ops("weights")).float()[len(prompt) - 1:]
    for k, tok in enumerate(a.tokens):  # each choice the argmax of its penalized logits
        row = _repeated_ref(logits[k].tolist(), set(prompt + a.tokens[:k]), 1.8)
        assert row[tok] >= max(row) - 1e-3, k


def test_stop_token_ends_the_reply(model):
    eng = _engine(model, slots=1, ctx=32)
    greedy = eng.add([3, 4, 5], SamplingParams(max_tokens=8))
    eng.run_until_done()
    stop_at = greedy.tokens[2]
    seq = eng.add([3, 4, 5], SamplingParams(max_tokens=8, stop_token_ids=(stop_at,)))
    eng.run_until_done()
    first = greedy.tokens.index(stop_at)
    assert seq.tokens == greedy.tokens[:first + 1] and seq.finish == "stop" and seq.stop == str(stop_at)


def test_a_steps_prompts_run_in_one_forward_and_a_failing_one_fails_alone(model, monkeypatch):
    """The step's prompt chunks go through ``ModelRunner.prefill_many`` together; when that
    forward raises, each runs alone and only the chunk that raises fails."""
    eng = _engine(model, slots=3, ctx=64, chunk=64, log_errors=False)
    calls = []
    real = eng.runner.prefill_many
    monkeypatch.setattr(eng.runner, "prefill_many", lambda chunks: calls.append(len(chunks)) or real(chunks))
    seqs = [eng.add(p, SamplingParams(max_tokens=3)) for p in ([1, 2, 3], list(range(10, 30)), [7])]
    eng.step()
    assert calls == [3] and all(len(s.tokens) == 1 for s in seqs)
    real_one = eng.runner.prefill

    def one(slot, tokens, start):
        if tokens == [99, 98]:
            raise RuntimeError("boom")
        return real_one(slot, tokens, start)

    monkeypatch.setattr(eng.runner, "prefill", one)
    monkeypatch.setattr(eng.runner, "prefill_many", lambda chunks: (_ for _ in ()).throw(RuntimeError("batch")))
    eng.run_until_done()
    bad, good = eng.add([99, 98], SamplingParams(max_tokens=2)), eng.add([5, 6], SamplingParams(max_tokens=2))
    eng.run_until_done()
    assert bad.finish == "error" and "boom" in bad.error
    assert good.finish == "length" and len(good.tokens) == 2
    assert eng.slots.available == 3


def test_deferred_events_arrive_one_step_late_and_complete(model):
    """``defer_events`` (the CUDA default; here forced on the CPU): a step's tokens are chosen and its
    stops applied at once, its ``on_event`` calls come in the next step (after that step's launch);
    every token arrives, in order, the finishing call sees the sequence finished, a cancel drops
    what was not yet delivered, and the tokens equal those of an engine that delivers at once."""
    def run(defer):
        eng = _engine(model, slots=3, ctx=64, chunk=8, defer_events=defer)
        got: dict[int, list] = {}

        def on_event(seq, new):
            assert not got.get(seq.id) or got[seq.id][-1] != "end"  # nothing after the last call
            got.setdefault(seq.id, []).extend(new)
            if seq.finished:
                got[seq.id].append("end")

        seqs = [eng.add(p, SamplingParams(max_tokens=m), on_event) for p, m in
                (([1, 2, 3], 6), (list(range(10, 30)), 4), ([7, 8], 9))]
        eng.step()  # the short prompts in: their first tokens chosen ...
        firsts = {s.id: len(s.tokens) for s in seqs}
        delivered_after_one = {k: list(v) for k, v in got.items()}
        eng.step()
        cancelled = seqs[2]
        eng.cancel(cancelled)
        eng.run_until_done()
        return seqs, got, firsts, delivered_after_one, cancelled

    seqs, got, firsts, early, cancelled = run(True)
    ref_seqs, ref_got, _, ref_early, _ = run(False)
    assert firsts[seqs[0].id] == 1 and early == {}  # ... and delivered only at the next step
    assert ref_early[ref_seqs[0].id] == ref_seqs[0].tokens[:1]  # at once without deferral
    for s, r in zip(seqs[:2], ref_seqs[:2], strict=True):
        assert s.tokens == r.tokens and s.finish == r.finish == "length"
        assert got[s.id] == s.tokens + ["end"]
    assert cancelled.finish == "cancelled" and got[cancelled.id][-1] == "end"
    assert got[cancelled.id][:-1] == cancelled.tokens[:len(got[cancelled.id]) - 1]  # a prefix, in order
    assert ref_got[ref_seqs[2].id][:-1] == ref_seqs[2].tokens  # delivered at once, a cancel loses nothing


def test_prefix_cache_reuses_whole_prompts_and_places_requests():
    assert reusable([1, 2, 3], [1, 2, 3, 4]) == 3  # a longer prompt: all of it
    assert reusable([1, 2, 3], [1, 2, 3]) == 2  # the same: all but the last (its logits are needed)
    assert reusable([1, 2, 3], [1, 2, 9, 4]) == 2
    assert reusable([1, 2, 3], [1, 9, 3, 4]) == reusable([1, 2, 3], [1, 2]) == 0  # a part, or a shorter one: none
    pc = PrefixCache()
    pc.record(2, [1, 2, 3])
    pc.record(0, [5, 6, 7, 8])
    assert pc.place([1, 2, 3, 4], [0, 1, 2]) == Placement(2, 3, 2)  # in place, from its end: the entry stays valid
    assert pc.place([1, 2, 9], [0, 1]) == Placement(1, 2, 2)  # (slot 2 now busy: copied from it, one token short)
    assert pc.place([9, 9], [0]) == Placement(0) and set(pc.entries) == {(2, 0)}  # no slot without one: 0's evicted
    pc.record(1, [4, 4, 4])
    pc.record(3, [6, 6, 6])
    assert pc.place([2, 2], [1, 3]) == Placement(1) and set(pc.entries) == {(2, 0), (3, 0)}  # least recently used
    # a head (kind 1) beside its prompt in one slot: another conversation with that head copies it into a free slot
    # without an entry, so the slot keeps its longer prompt (for that conversation's next turn)
    pc = PrefixCache()
    pc.record(4, [1, 2, 3, 4, 5, 6], kind=0)
    pc.record(4, [1, 2, 3], kind=1)
    assert pc.place([1, 2, 3, 7, 7], [4, 5]) == Placement(5, 3, 4, 1) and set(pc.entries) == {(4, 0), (4, 1)}
    pc.record(5, [1, 2, 3, 7, 7])
    assert pc.place([1, 2, 3, 4, 5, 6, 9], [4, 6]) == Placement(4, 6, 4, 0)  # (all of slot 4's entries kept there)
    pc.record(4, [1, 2, 3, 4, 5, 6, 9])
    assert pc.place([1, 2, 3, 8], [4, 5]) == Placement(4, 3, 4, 1)  # no free slot without an entry: in place
    assert set(pc.entries) == {(4, 1), (5, 0)}  # (slot 4's prompt went: its rows from 3 on will be written)
    assert pc.pending(list(range(100)), [list(range(HOLD_MIN + 1))])
    assert not pc.pending(list(range(100)), [list(range(HOLD_MIN - 1))])  # too little to wait for


def test_prefix_cache_places_a_shared_part_with_its_ring_rebuild():
    pc = PrefixCache(rebuild=10)
    doc = list(range(1000, 1200))
    pc.record(0, doc)
    pc.record(1, doc[:100])
    # the first 150 of slot 0's tokens, then others: its full layers' rows of 150, prefill from 140 (copied into a
    # free slot without an entry, so slot 0 keeps its whole entry; in place when there is none)
    assert pc.place(doc[:150] + [7] * 5, [0, 2]) == Placement(2, 140, 0, 0, 150)
    pc.record(2, [9])
    assert pc.place(doc[:150] + [7] * 5, [0, 2]) == Placement(0, 140, 0, 0, 150)
    assert set(pc.entries) == {(1, 0), (2, 0)}  # slot 0's longer entry goes (its rows from 150 on will be written)
    pc.record(0, doc)
    assert pc.place(doc[:100] + [7], [2]) == Placement(2, 100, 1, 0)  # a whole entry skips more: copied from slot 1
    assert pc.place(doc[:120], [3]) == Placement(3, 109, 0, 0, 120)  # the start of an entry: its last 11 prefilled
    short = 10 + MIN_SHARED - 1  # it would skip fewer than MIN_SHARED tokens: a cold prefill
    assert pc.place([5] + doc[1:short] + [7], [4]) == Placement(4)
    assert PrefixCache().place(doc[:150] + [7], [5]) == Placement(5)  # no rebuild offered: whole entries only


def test_a_ring_rebuild_is_one_chunk_to_the_shared_end_and_a_head_past_it_is_still_cut():
    sched = Scheduler(SlotManager(1), chunk=16, token_budget=40, max_waiting=1)
    seq = Sequence(list(range(60)), SamplingParams())
    seq.slot, seq.state, seq.prefilled, seq.kept = 0, State.PREFILL, 20, 37  # rebuild 20..36, its cut at 32 is not
    sched.running.append(seq)
    assert [(a, b) for _, a, b in sched.schedule().prefills] == [(20, 37)]
    seq.kept = 30  # the shared part ends before the cut: one chunk to the cut, or to a head between them
    assert [(a, b) for _, a, b in sched.schedule().prefills] == [(20, 32)]
    seq.keep = 31
    assert [(a, b) for _, a, b in sched.schedule().prefills] == [(20, 31)]


def _replies(eng, prompts, **kw):
    seqs = [eng.add(p, SamplingParams(max_tokens=6, logprobs=True, **kw)) for p in prompts]
    eng.run_until_done()
    return seqs


def test_a_prompt_that_starts_with_a_cached_one_prefills_the_rest_and_gets_the_cold_reply(model):
    """A conversation's next turn (in place, after decode riders wrote over the free slot's position 0 and its
    rings were overwritten by the reply), the same prompt again, a copy from a slot still running, and identical
    prompts held for one another: each reply equals a cold engine's bit for bit (the weights mode)."""
    warm = Engine(ModelRunner(model, get_ops("weights"), 3, 160, prefix_cache=True), chunk=16)
    cold = Engine(ModelRunner(model, get_ops("weights"), 3, 160), chunk=16)

    def same(seq, prompt):
        ref, = _replies(cold, [prompt])
        assert seq.tokens == ref.tokens and seq.logprobs == ref.logprobs, len(prompt)

    p1 = list(range(30, 70))  # 40 tokens: the sliding window's 8-row ring wraps
    a = warm.add(p1, SamplingParams(max_tokens=6, logprobs=True))
    other = warm.add(list(range(200, 210)), SamplingParams(max_tokens=30))
    while not a.finished:
        warm.step()
    for _ in range(4):
        warm.step()  # slot 0 free: it rides along other's decode steps at length 0
    assert not other.finished and warm.stats()["cached_prompts"] == 3  # a's prompt, a's prompt and reply, other's prompt
    p2 = p1 + a.tokens + [5, 6, 7]
    b = warm.add(p2, SamplingParams(max_tokens=6, logprobs=True))
    warm.step()
    assert b.slot == 0 and b.cached == 45 and b.prefilled == 48  # in place: a's prompt and reply but its last token
    warm.run_until_done()
    same(b, p2)
    again, = _replies(warm, [p2])
    assert again.cached == len(p2) - 1
    same(again, p2)
    long = warm.add(p2, SamplingParams(max_tokens=20))  # keeps slot 0 busy
    warm.step()
    ext = warm.add(p2 + [11, 12], SamplingParams(max_tokens=6, logprobs=True))
    warm.step()
    assert long.slot == 0 and ext.slot == 2 and ext.cached == len(p2)  # copied from the running slot 0 (1 keeps its entry)
    warm.run_until_done()
    same(ext, p2 + [11, 12])
    p3 = list(range(300, 380))  # 80 >= HOLD_MIN: the second waits for the first instead of prefilling beside it
    f, g = (warm.add(p3, SamplingParams(max_tokens=6, logprobs=True)) for _ in range(2))
    warm.step()
    assert f.state is State.PREFILL and g.state is State.WAITING and warm.slots.available == 2
    warm.run_until_done()
    assert (f.cached, g.cached) == (0, len(p3) - 1)
    same(f, p3)
    same(g, p3)
    assert long.cached == len(p2) - 1
    assert warm.metrics.cached_tokens == 45 + 2 * (len(p2) - 1) + len(p2) + len(p3) - 1


def test_a_prompt_that_goes_on_from_an_ended_reply_reuses_it(model):
    """A request that ends (here cancelled mid-reply) leaves its prompt's and reply's keys but the last token's, its
    rings saved then: a prompt that goes on from the reply prefills only what follows, in place after riders wrote over
    the free slot, and copied from that slot while it runs. Each reply equals a cold engine's bit for bit."""
    warm = Engine(ModelRunner(model, get_ops("weights"), 3, 200, prefix_cache=True), chunk=16)
    cold = Engine(ModelRunner(model, get_ops("weights"), 3, 200), chunk=16)
    p1 = list(range(30, 70))
    a = warm.add(p1, SamplingParams(max_tokens=30))
    other = warm.add(list(range(200, 210)), SamplingParams(max_tokens=60))
    for _ in range(8):
        warm.step()
    slot = a.slot
    warm.cancel(a)
    for _ in range(4):
        warm.step()  # a's slot free, riding other's decode steps
    assert a.finish == "cancelled" and 2 < len(a.tokens) < 30 and not other.finished
    n = len(p1) + len(a.tokens) - 1  # (the last token's keys were never written)
    b = warm.add(p1 + a.tokens + [5, 6], SamplingParams(max_tokens=6, logprobs=True))
    warm.step()
    c = warm.add(p1 + a.tokens + [7], SamplingParams(max_tokens=6, logprobs=True))
    warm.step()
    assert b.slot == slot and c.slot not in (None, slot) and b.cached == c.cached == n  # in place, then copied
    warm.run_until_done()
    for seq in (b, c):
        ref, = _replies(cold, [seq.prompt])
        assert (seq.tokens, seq.logprobs) == (ref.tokens, ref.logprobs)


def test_a_shared_head_is_kept_and_another_conversation_prefills_only_what_follows(model):
    """A request's ``keep`` (a chat's system and developer messages): its prefill cuts a chunk there and the rings are
    saved; a later prompt with the same head and another question reuses it, in place or copied from a running slot,
    and gets the cold engine's reply bit for bit (the weights mode)."""
    warm = Engine(ModelRunner(model, get_ops("weights"), 3, 160, prefix_cache=True), chunk=16)
    cold = Engine(ModelRunner(model, get_ops("weights"), 3, 160), chunk=16)
    head = list(range(400, 440))  # 40 tokens: past the 8-row ring; not a multiple of the chunk
    first = warm.add(head + [1, 2, 3], SamplingParams(max_tokens=4), keep=len(head))
    while first.prefilled < len(head):
        warm.step()
    assert first.prefilled == len(head) and (first.slot, 1) in warm.prefix.entries  # cut at the head, saved
    warm.run_until_done()
    runs = []
    for question, busy in (([4, 5], False), ([6, 7, 8, 9], True)):
        if busy:  # the head's slot taken by a long reply: copied from it
            long = warm.add(head + [1], SamplingParams(max_tokens=30), keep=len(head))
            warm.step()
        seq = warm.add(head + question, SamplingParams(max_tokens=6, logprobs=True), keep=len(head))
        warm.run_until_done()
        ref, = _replies(cold, [head + question])
        assert seq.cached == len(head) and (seq.tokens, seq.logprobs) == (ref.tokens, ref.logprobs), question
        runs.append(seq)
    assert long.cached == len(head)


def test_a_prompt_sharing_part_of_a_cached_one_rebuilds_its_rings_and_gets_the_cold_reply(model4):
    """A document asked about again with another question: the full layers' rows of the shared part come from the
    cache and the two sliding layers' rings are rebuilt by a chunk that prefills the last 14 shared tokens again
    (and goes on with the new ones to the chunks' next cut): in place (that chunk waiting behind another prompt's
    while decode steps ride over the slot), copied from a running slot (in one forward with another prompt's
    chunk), and a prompt that is the start of a cached one (its rebuild chunk ends with it). Each reply equals a
    cold engine's bit for bit (the weights mode)."""
    warm = Engine(ModelRunner(model4, get_ops("weights"), 4, 256, prefix_cache=True), chunk=16)
    cold = Engine(ModelRunner(model4, get_ops("weights"), 3, 256), chunk=16)
    assert warm.runner.rebuild == 14 and warm.prefix.rebuild == 14

    def same(seq, prompt):
        ref, = _replies(cold, [prompt])
        assert seq.tokens == ref.tokens and seq.logprobs == ref.logprobs, len(prompt)

    doc = list(range(100, 210))  # 110 shared tokens: the rebuild from 96 and the chunk's cut at 112
    a, *_ = _replies(warm, [doc + [1, 2, 3], [50, 51], [60, 61], [70, 71]])  # (every slot holds an entry)
    assert a.cached == 0 and len({s for s, _ in warm.prefix.entries}) == 4
    busy = warm.add(list(range(300, 310)), SamplingParams(max_tokens=40))  # decodes in slot 1
    while not busy.tokens:
        warm.step()
    other = warm.add(list(range(400, 440)), SamplingParams(max_tokens=2))  # slot 2: a 40-token prompt, older
    b = warm.add(doc + [4, 5, 6, 7], SamplingParams(max_tokens=6, logprobs=True))
    warm.step()
    assert b.slot == 0 and b.cached == 96 and b.kept == 110 and b.prefilled == 96  # in place; its chunk waits
    assert other.prefilled == 16  # (the older prompt's chunk took the budget)
    warm.step()
    assert b.prefilled == 96 and not busy.finished  # slot 0 rode this step's decode at its kept end
    while b.prefilled == 96:
        warm.step()
    assert b.prefilled == 112  # the rebuild and two new tokens, one chunk
    while not b.finished:
        warm.step()
    same(b, doc + [4, 5, 6, 7])
    while not busy.finished:
        warm.step()
    long = warm.add(doc + [4, 5, 6, 7] + b.tokens + [8], SamplingParams(max_tokens=30))  # keeps slot 0 busy
    warm.step()
    d = warm.add([7, 8, 9], SamplingParams(max_tokens=6, logprobs=True))
    c = warm.add(doc + [9, 9], SamplingParams(max_tokens=6, logprobs=True))
    warm.step()
    assert long.slot == 0 and c.slot != 0 and c.cached == 96  # copied from the running slot 0
    assert c.prefilled == 112 and d.prefilled == 3  # (the rebuild in one forward with another prompt's chunk)
    start = warm.add(doc[:90], SamplingParams(max_tokens=6, logprobs=True))  # the start of a cached prompt
    warm.run_until_done()
    assert start.cached == 75 and start.kept == 90  # (its last row reads one more position)
    same(c, doc + [9, 9])
    same(d, [7, 8, 9])
    same(start, doc[:90])


def test_requests_that_arrive_together_with_a_shared_part_wait_for_the_first(model4):
    """A burst with one document: the second request waits while the first prefills the shared part (it would give
    the second 100 - 14 tokens once it is in), then reuses it; both replies equal a cold engine's bit for bit."""
    warm = Engine(ModelRunner(model4, get_ops("weights"), 3, 256, prefix_cache=True), chunk=16)
    cold = Engine(ModelRunner(model4, get_ops("weights"), 3, 256), chunk=16)
    doc = list(range(250, 350))
    first = warm.add(doc + [1, 2], SamplingParams(max_tokens=6, logprobs=True))
    second = warm.add(doc + [3, 4, 5], SamplingParams(max_tokens=6, logprobs=True))
    other = warm.add([7, 8, 9], SamplingParams(max_tokens=6, logprobs=True))  # (no share: not held)
    warm.step()
    assert first.state is State.PREFILL and second.state is State.WAITING and other.slot is not None
    warm.run_until_done()
    assert (first.cached, second.cached, other.cached) == (0, 100 - 14, 0)
    for seq in (first, second, other):
        ref, = _replies(cold, [seq.prompt])
        assert (seq.tokens, seq.logprobs) == (ref.tokens, ref.logprobs)

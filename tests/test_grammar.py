"""Structured output: the sampler's allowed-token masks (runtime/sampling.py ``allowed_mask``, ``draw(allowed=)``) and
the Harmony reply grammar (serve/grammar.py) on the real o200k_harmony vocabulary, driven by fresh random logits: every
token drawn is one the grammar allows, and the reply ends as the request's format says (a final JSON message that
fits its schema, or a call whose arguments fit the function's)."""

import json

import pytest
import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.runtime.sampling import SamplingParams, allowed_mask, draw

pytest.importorskip("llguidance")
pytest.importorskip("openai_harmony")

from gptoss_fp8.serve import grammar, harmony  # noqa: E402

V = 201088
END, RETURN, CALL = 200007, harmony.RETURN, harmony.CALL
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["n", "ok", "color"], "additionalProperties": False}


class _Ids:
    """A Constraint allowing a fixed set of ids (its masks and checks counted)."""

    def __init__(self, ids):
        self.ids, self.masks, self.checks = ids, 0, 0

    def allow(self, row):
        self.masks += 1
        bits = torch.zeros(row.numel() * 32, dtype=torch.bool)
        bits[self.ids] = True
        row.copy_((bits.view(-1, 32).long() << torch.arange(32)).sum(1).to(torch.int64).to(torch.int32))

    def check(self, tok):
        self.checks += 1
        return tok in self.ids

    def consume(self, tok):
        return tok in self.ids

    error = ""


def test_allowed_mask_unpacks_each_bit():
    ids = [[0, 5, 31, 32, 63, 64, 200007, V - 1], [7]]
    m = allowed_mask([_Ids(i) for i in ids], V, torch.device("cpu"))
    assert m.shape == (2, V) and m.dtype == torch.bool
    assert [r.nonzero().flatten().tolist() for r in m] == ids


def test_draw_chooses_among_the_allowed_only_and_reports_the_models_logprobs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 1000, generator=g) * 4
    ok = [17, 400, 999]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, logprobs=True), SamplingParams()]
    gens = [None, torch.Generator().manual_seed(2), None]
    rows = [0, 1]
    for _ in range(20):
        d = draw(logits, params, gens, allowed=(rows, allowed_mask([_Ids(ok), _Ids(ok)], 1000, torch.device("cpu"))))
        toks, lps, _ = d.get()
        assert toks[0] == max(ok, key=lambda t: logits[0, t]) and toks[1] in ok
        assert toks[2] == int(logits[2].argmax())  # a row without a rule: free
        want = torch.log_softmax(logits.float(), -1)[1, toks[1]]  # the model's, not the masked distribution's
        assert lps[1] == pytest.approx(float(want), abs=1e-5)
    assert int(logits[0].argmax()) not in ok  # (so the mask did something on row 0)
    # a rule that allows nothing (a broken one) leaves its row free rather than failing the step's draw
    none = allowed_mask([_Ids([]), _Ids(ok)], 1000, torch.device("cpu"))
    assert bool(none[0].all()) and none[1].nonzero().flatten().tolist() == ok
    toks, _, _ = draw(logits, params, gens, allowed=([1, 0], none)).get()
    assert toks[1] in range(1000) and toks[0] in ok


def _run(fmt, seed, steps=400, end_bias=30.0, lazy=False):
    """Random logits drawn through the grammar (temperature 1, <|end|> favoured where allowed so reasoning and
    preambles end) -> the reply's ids; each draw's token must be one the matcher then accepts. ``lazy``: drawn
    freely, checked, drawn again through the mask when refused (``draw(lazy=)``; random logits are refused often)."""
    rule = grammar.constraint(fmt, V)()
    g = torch.Generator().manual_seed(seed)
    p = SamplingParams(temperature=1.0)
    out = []
    for _ in range(steps):
        logits = torch.randn(1, V, generator=g)
        logits[0, END] += end_bias
        how = {"lazy": ([0], [rule])} if lazy else {"allowed": ([0], allowed_mask([rule], V, torch.device("cpu")))}
        tok = draw(logits, [p], [g], **how).get()[0][0]
        assert rule.consume(tok), rule.error
        out.append(tok)
        if tok in (RETURN, CALL):
            return out
    raise AssertionError(f"no end in {steps} tokens: {harmony.encoding().decode(out)!r}")


def _messages(ids):
    from openai_harmony import Role

    return harmony.encoding().parse_messages_from_completion_tokens(ids, Role.ASSISTANT)


@pytest.mark.parametrize("seed, lazy", [(0, False), (1, True)])
def test_a_json_schema_holds_the_final_message(seed, lazy):
    ids = _run(grammar.Format(SCHEMA), seed, lazy=lazy)
    assert ids[-1] == RETURN
    last = _messages(ids)[-1]
    assert last.channel == "final"
    body = json.loads(last.content[0].text)
    assert set(body) == {"n", "ok", "color"} and 0 <= body["n"] <= 99 and isinstance(body["n"], int)
    assert isinstance(body["ok"], bool) and body["color"] in ("red", "green")
    assert " " not in last.content[0].text  # (compact: free whitespace is off unless the schema's x-guidance asks)


def test_required_and_strict_tools_hold_the_call():
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}}},
        {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    fmt = grammar.request_format(None, tools, {"type": "function", "function": {"name": "get_weather"}})
    assert not fmt.final and [n for n, _ in fmt.calls] == ["get_weather"]
    ids = _run(fmt, 3)
    assert ids[-1] == CALL
    last = _messages(ids)[-1]
    assert last.recipient == "functions.get_weather" and json.loads(last.content[0].text) in ({"unit": "C"},
                                                                                             {"unit": "F"})
    # required: some function, no final message; auto with a strict tool: a final message may end it, or a call
    assert grammar.request_format(None, tools, "required").final is False
    auto = grammar.request_format(None, tools, "auto")
    assert auto.final and auto.needed and auto.calls[1] == ("other", None)
    assert not grammar.request_format(None, tools[1:], "auto").needed  # nothing ruled out: no grammar
    assert grammar.constraint(grammar.request_format(None, tools[1:], None), V) is None


def test_the_grammar_accepts_a_real_harmony_reply_and_refuses_the_wrong_ending():
    enc = harmony.encoding()
    rule = grammar.constraint(grammar.Format(SCHEMA), V)
    good = ('<|channel|>analysis<|message|>Pick red.<|end|><|start|>assistant<|channel|>analysis<|message|>Sure.'
            '<|end|><|start|>assistant<|channel|>final<|message|>{"n":4,"ok":true,"color":"red"}<|return|>')
    ids = enc.encode(good, allowed_special="all")
    assert rule().matcher.validate_tokens(ids) == len(ids)
    for bad in ('<|channel|>final<|message|>{"n":4,"ok":true,"color":"blue"}<|return|>',
                '<|channel|>final<|message|>Sure! {"n":4}<|return|>',
                '<|channel|>commentary<|message|>One moment.<|end|>',  # (a preamble: only before a call)
                '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>'):
        ids = enc.encode(bad, allowed_special="all")
        assert rule().matcher.validate_tokens(ids) < len(ids), bad


def test_lazy_rows_choose_what_their_masks_choose():
    """draw(lazy=): greedy rows take the allowed argmax bit for bit, a mask made only for a refused row, the
    log-probabilities the model's; the rules that refused are reported."""
    n, v = 6, 1000
    logits = torch.randn(n, v) * 3
    oks = [torch.randperm(v)[:k].tolist() for k in (1, 5, 40, 400, 900, 999)]
    oks[2].append(int(logits[2].argmax()))  # (one row whose free choice is allowed: no mask for it)
    params = [SamplingParams(temperature=0, logprobs=True)] * n
    rules = [_Ids(ok) for ok in oks]
    told = []
    toks, lps, _ = draw(logits, params, [None] * n, lazy=(list(range(n)), rules), refused=told.extend).get()
    want, _, _ = draw(logits, params, [None] * n, allowed=(list(range(n)), allowed_mask([_Ids(o) for o in oks], v,
                                                                                        torch.device("cpu")))).get()
    assert toks == want and all(t in ok for t, ok in zip(toks, oks, strict=True))
    logp = torch.log_softmax(logits, -1)
    assert lps == pytest.approx([float(logp[i, t]) for i, t in enumerate(toks)], abs=1e-6)
    free = [int(r.argmax()) in ok for r, ok in zip(logits, oks, strict=True)]
    assert free[2] and not all(free)
    assert [r.masks for r in rules] == [0 if f else 1 for f in free] and all(r.checks == 1 for r in rules)
    assert told == [r for r, f in zip(rules, free, strict=True) if not f]
    with pytest.raises(GptOssFp8Error, match="row 0 has top_p 0.9; a lazy rule needs top_p 1"):
        draw(logits[:1], [SamplingParams(temperature=1.0, top_p=0.9)], [torch.Generator()], lazy=([0], rules[:1]))


def test_a_lazy_rows_samples_follow_the_masked_distribution():
    """Sampled: a free draw kept when allowed, else one from the masked distribution, gives each allowed token its
    probability over the allowed mass (p / A), as the mask does; 4000 draws each way, within 5 standard errors."""
    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0, 0.0, 1.0]])
    ok = [1, 3, 4, 5]
    p = torch.softmax(logits[0], -1)
    want = torch.zeros(6)
    want[ok] = p[ok] / p[ok].sum()
    params, g, draws = [SamplingParams(temperature=1.0)], torch.Generator().manual_seed(5), 4000
    for how in ("lazy", "allowed"):
        seen = torch.zeros(6)
        for _ in range(draws):
            rule = _Ids(ok)
            kw = {"lazy": ([0], [rule])} if how == "lazy" else {"allowed": ([0], allowed_mask([rule], 6,
                                                                                            torch.device("cpu")))}
            seen[draw(logits, params, [g], **kw).get()[0][0]] += 1
        freq = seen / draws
        assert freq.tolist() == pytest.approx(want.tolist(), abs=float(5 * (want * (1 - want) / draws).sqrt().max())), how
        assert freq[[0, 2]].sum() == 0


def test_the_default_sampler_masks_a_rule_for_a_while_after_it_refused():
    from gptoss_fp8.runtime.engine import DefaultSampler
    from gptoss_fp8.runtime.sequence import Sequence

    v = 50
    logits = torch.zeros(3, v)
    logits[:, 7] = 5.0  # every row's free choice: 7
    made = [_Ids([7, 9]), _Ids([9]), _Ids([9])]  # the second refuses 7; the third's row samples at top_p 0.5
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, top_p=0.5, seed=1)]
    seqs = []
    for i, (rule, p) in enumerate(zip(made, params, strict=True)):
        s = Sequence([1, 2], p, slot=i, constraint=rule, generator=p.generator(torch.device("cpu")))
        seqs.append(s)
    sampler = DefaultSampler(3, masked_after_refusal=3)
    history = []
    for _ in range(6):
        toks = sampler(logits, seqs).get()[0]
        assert toks[:2] == [7, 9] and toks[2] == 9
        history.append([(r.checks, r.masks) for r in made])
    # row 0: checked each step, never masked; row 1: refused at step 1 (checked, then masked), masked first for
    # steps 2-4, then lazy again (refused: masked again); row 2 (top_p < 1): masked first every step, never checked
    assert [h[0] for h in history] == [(k, 0) for k in range(1, 7)]
    assert [h[1] for h in history] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 5), (2, 6)]
    assert [h[2] for h in history] == [(0, k) for k in range(1, 7)]
    m = sampler.metrics
    assert (m.structured_checked, m.structured_refused, m.structured_masked) == (6 + 2, 2, 4 + 6)
    eager = DefaultSampler(3, lazy=False)
    made[0].masks = made[0].checks = 0
    eager(logits, seqs).get()
    assert (made[0].checks, made[0].masks) == (0, 1)


def test_a_lazy_rows_tokens_do_not_depend_on_its_batch():
    """Same seed, same tokens whatever else runs: a sampled lazy row alone and beside rows that are refused (their
    masks made and tokens drawn again) takes the same 20 tokens."""
    v, g = 300, torch.Generator().manual_seed(11)
    steps = [torch.randn(4, v, generator=g) * 2 for _ in range(20)]
    ok = torch.randperm(v, generator=g)[:120].tolist()

    def run(rows):
        gens = [torch.Generator().manual_seed(100 + i) for i in range(4)]
        params = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(4)]
        out = []
        for logits in steps:
            toks = draw(logits[rows], [params[i] for i in rows], [gens[i] for i in rows],
                        lazy=(list(range(len(rows))), [_Ids(ok if i == 0 else [7]) for i in rows])).get()[0]
            out.append(toks[0])
        return out

    alone, beside = run([0]), run([0, 1, 2, 3])
    assert alone == beside and all(t in ok for t in alone)


def test_a_grammars_check_agrees_with_its_mask():
    enc = harmony.encoding()
    rule = grammar.constraint(grammar.Format(SCHEMA), V)()
    g = torch.Generator().manual_seed(3)
    for text in ("", "<|channel|>analysis<|message|>Hm", "<|end|><|start|>assistant<|channel|>final<|message|>{",
                 '"n":4,"ok":'):
        assert all(rule.consume(t) for t in enc.encode(text, allowed_special="all"))
        mask = allowed_mask([rule], V, torch.device("cpu"))[0]
        some = torch.cat([mask.nonzero().flatten()[:50], torch.randint(0, V, (300,), generator=g)]).tolist()
        assert [rule.check(t) for t in some] == [bool(mask[t]) for t in some], text
        assert 0 < int(mask.sum()) < V


def test_bad_formats_are_one_line():
    with pytest.raises(GptOssFp8Error, match="json_schema format needs its schema"):
        grammar.schema_of({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format")
    with pytest.raises(GptOssFp8Error, match="give text, json_object or json_schema"):
        grammar.schema_of({"type": "yaml"}, "response_format")
    with pytest.raises(GptOssFp8Error, match="not among the tools"):
        grammar.request_format(None, [], {"type": "function", "name": "nope"})
    with pytest.raises(GptOssFp8Error, match="needs tools"):
        grammar.request_format(None, None, "required")
    with pytest.raises(GptOssFp8Error, match="needs the o200k_harmony vocabulary.*this model has 512"):
        grammar.constraint(grammar.Format(SCHEMA), 512)
    with pytest.raises(GptOssFp8Error, match="the byte-level vocabulary has no Harmony"):
        grammar.constraint(grammar.Format(SCHEMA), 259, "byte-level")
    with pytest.raises(GptOssFp8Error, match="a byte-level vocabulary has 259 ids; this model has 300"):
        grammar.constraint(grammar.Format(SCHEMA, raw=True), 300, "byte-level")
    with pytest.raises(GptOssFp8Error, match="cannot be enforced"):
        grammar.constraint(grammar.Format({"type": "integer", "minimum": 5, "maximum": 1, "x-guidance": {"lenient": 7}}),
                           V)


@pytest.mark.gpu
def test_allowed_mask_and_draw_on_the_gpu():
    dev = torch.device("cuda")
    ids = [[0, 5, 31, 32, 63, 64, 200007, V - 1], [7, 123456]]
    m = allowed_mask([_Ids(i) for i in ids], V, dev)
    assert m.device.type == "cuda" and [r.nonzero().flatten().tolist() for r in m] == ids
    logits = torch.randn(3, V, device=dev).bfloat16()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, logprobs=True), SamplingParams()]
    gens = [None, torch.Generator(device=dev).manual_seed(1), None]
    for _ in range(10):
        toks, lps, _ = draw(logits, params, gens, allowed=([0, 1], allowed_mask([_Ids(i) for i in ids], V, dev))).get()
        assert toks[0] == max(ids[0], key=lambda t: float(logits[0, t])) and toks[1] in ids[1]
        assert toks[2] == int(logits[2].float().argmax())
        assert lps[1] == pytest.approx(float(torch.log_softmax(logits.float(), -1)[1, toks[1]]), abs=1e-4)
        rules = [_Ids(i) for i in ids]  # lazy: the same choice, the refused rows' masks made after the read
        again, lps2, _ = draw(logits, params, gens, lazy=([0, 1], rules)).get()
        assert again[0] == toks[0] and again[1] in ids[1] and again[2] == toks[2]
        assert lps2[1] == pytest.approx(float(torch.log_softmax(logits.float(), -1)[1, again[1]]), abs=1e-4)


def test_several_grammars_masks_at_once_equal_one_at_a_time():
    enc = harmony.encoding()
    make = grammar.constraint(grammar.Format(SCHEMA), V)
    rules = [make() for _ in range(3)]
    steps = ["", "<|channel|>analysis<|message|>Hm", '<|channel|>final<|message|>{"n":4,"ok":']
    for r, text in zip(rules, steps, strict=True):
        assert all(r.consume(t) for t in enc.encode(text, allowed_special="all"))
    both = allowed_mask([_Ids([9]), *rules], V, torch.device("cpu"))  # (the grammars through allow_many)
    for i, r in enumerate(rules):
        alone = allowed_mask([r], V, torch.device("cpu"))[0]
        assert torch.equal(both[i + 1], alone) and 0 < int(alone.sum()) < V
    assert both[0].nonzero().flatten().tolist() == [9]
    assert not torch.equal(both[1], both[2]) and not torch.equal(both[2], both[3])


def test_the_engine_feeds_each_token_to_its_sequences_rule_and_fails_one_it_breaks():
    from gptoss_fp8.runtime.engine import Engine
    from gptoss_fp8.runtime.null import NullRunner, ScriptSampler

    class _Refuse:
        """Allows all; its sequence's tokens recorded; ``bad`` refused."""

        def __init__(self, bad, log):
            self.bad, self.log, self.error = bad, log, ""

        def allow(self, row):
            row.fill_(-1)

        def consume(self, tok):
            self.log.append(tok)
            self.error = "no 7 here" if tok == self.bad else ""
            return tok != self.bad

    logs = [[], []]
    made = iter(logs)
    eng = Engine(NullRunner(3, 64, vocab=1000), sampler=ScriptSampler([5, 6, 7, 8]), chunk=16)
    ruled = eng.add([1, 2, 3], SamplingParams(max_tokens=6, constraint=lambda: _Refuse(7, next(made))))
    fine = eng.add([1, 2, 3], SamplingParams(max_tokens=6, constraint=lambda: _Refuse(99, next(made))))
    free = eng.add([4, 5], SamplingParams(max_tokens=6))
    eng.run_until_done()
    assert ruled.finish == "error" and ruled.error == "the output format failed at token 7: no 7 here"
    from gptoss_fp8.errors import OutputFormatError

    assert isinstance(ruled.exception, OutputFormatError)  # (the server's 400: tests/test_serve_faults.py)
    assert ruled.tokens == [5, 6, 7] and logs[0] == [5, 6, 7]  # each token fed once, in order; none after the break
    assert fine.finish == "length" and logs[1] == fine.tokens == [5, 6, 7, 8, 5, 6]
    assert free.finish == "length" and free.constraint is None and len(free.tokens) == 6

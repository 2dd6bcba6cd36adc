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
    """A Constraint allowing a fixed set of ids."""

    def __init__(self, ids):
        self.ids = ids

    def allow(self, row):
        bits = torch.zeros(row.numel() * 32, dtype=torch.bool)
        bits[self.ids] = True
        row.copy_((bits.view(-1, 32).long() << torch.arange(32)).sum(1).to(torch.int64).to(torch.int32))


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


def _run(fmt, seed, steps=400, end_bias=30.0):
    """Random logits drawn through the grammar (temperature 1, <|end|> favoured where allowed so reasoning and
    preambles end) -> the reply's ids; each draw's token must be one the matcher then accepts."""
    rule = grammar.constraint(fmt, V)()
    g = torch.Generator().manual_seed(seed)
    p = SamplingParams(temperature=1.0)
    out = []
    for _ in range(steps):
        logits = torch.randn(1, V, generator=g)
        logits[0, END] += end_bias
        tok = draw(logits, [p], [g], allowed=([0], allowed_mask([rule], V, torch.device("cpu")))).get()[0][0]
        assert rule.consume(tok), rule.error
        out.append(tok)
        if tok in (RETURN, CALL):
            return out
    raise AssertionError(f"no end in {steps} tokens: {harmony.encoding().decode(out)!r}")


def _messages(ids):
    from openai_harmony import Role

    return harmony.encoding().parse_messages_from_completion_tokens(ids, Role.ASSISTANT)


@pytest.mark.parametrize("seed", [0])
def test_a_json_schema_holds_the_final_message(seed):
    ids = _run(grammar.Format(SCHEMA), seed)
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
    assert ruled.finish == "error" and "breaks the request's output format: no 7 here" in ruled.error
    assert ruled.tokens == [5, 6, 7] and logs[0] == [5, 6, 7]  # each token fed once, in order; none after the break
    assert fine.finish == "length" and logs[1] == fine.tokens == [5, 6, 7, 8, 5, 6]
    assert free.finish == "length" and free.constraint is None and len(free.tokens) == 6

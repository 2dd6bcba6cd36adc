"""gptoss-fp8 generate: greedy decode equals the full forward's argmax on the growing sequence,
seeded sampling is reproducible, Harmony stop tokens stop it, bad input is one line."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from gptoss_fp8.cli.main import app
from gptoss_fp8.config import special_token_ids
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.model.gptoss import GptOss
from gptoss_fp8.verify import generate as gen

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic
    from gptoss_fp8.model.load import load_model

    root = tmp_path_factory.mktemp("generate")
    cfg = write_synthetic(root / "src", "tiny", seed=7, layout="hf")
    convert_checkpoint(root / "src", root / "fp8")
    return root / "fp8", cfg, load_model(root / "fp8")


def _prompt(cfg, n=None):
    n = n or int(torch.randint(5, 20, (1,)))
    stops = set(gen.stop_tokens(cfg.vocab_size))
    ids = torch.randint(0, cfg.vocab_size - 8, (n,)).tolist()  # clear of the stand-in special ids
    assert not stops & set(ids)
    return ids


def test_greedy_equals_the_full_forward_argmax_on_the_growing_sequence(tiny):
    _, cfg, model = tiny
    prompt = _prompt(cfg)
    ops = get_ops("weights")
    g = gen.generate(model, prompt, ops, max_new_tokens=12)
    assert 1 <= len(g.tokens) <= 12 and (g.stop == "max-new-tokens") == (len(g.tokens) == 12)
    seq = list(prompt)
    for tok in g.tokens:  # the weights mode: decode is bit-identical to the forward on CPU
        want = int(model(torch.tensor(seq), ops)[-1].float().argmax())
        assert tok == want, (seq, g.tokens)
        seq.append(tok)
    assert g.prefill_seconds > 0 and g.decode_seconds > 0 and g.decode_tokens_per_s > 0


def test_same_seed_same_tokens_other_seed_other_tokens(tiny, monkeypatch):
    _, cfg, model = tiny
    prompt = _prompt(cfg)
    ops = get_ops("w8a8")
    # no stop tokens here: on some random prompts the tiny model's likeliest first token is a stand-in
    # stop id, and two seeds that both draw it first would give the same one-token reply
    monkeypatch.setattr(gen, "stop_tokens", lambda *a, **k: {})
    run = [gen.generate(model, prompt, ops, max_new_tokens=16, temperature=1.5, seed=s).tokens for s in (11, 11, 12)]
    assert len(run[0]) == 16
    assert run[0] == run[1]
    assert run[0] != run[2]
    monkeypatch.undo()
    greedy = gen.generate(model, prompt, ops, max_new_tokens=4, seed=11).tokens
    assert greedy == gen.generate(model, prompt, ops, max_new_tokens=4, seed=99).tokens  # T = 0: no sampling


@pytest.mark.parametrize("stop", ["eos", "call"])
def test_stops_at_a_harmony_stop_token(tiny, monkeypatch, stop):
    _, cfg, model = tiny
    stop_id = special_token_ids(cfg.vocab_size)[stop]
    stops = list(gen.stop_tokens(cfg.vocab_size))
    real, real_prefill, real_many = GptOss.decode, GptOss.prefill, GptOss.prefill_many
    calls = []

    def steer(logits, favour: bool):  # no stop id before the second decode step's, which is favoured
        logits = logits.clone()
        logits[..., stops] = logits.min() - 10
        if favour:
            logits[..., stop_id] = logits.max() + 10
        return logits

    def decode(self, cache, token, ops=None, **kw):
        calls.append(int(token))
        return steer(real(self, cache, token, ops, **kw), len(calls) == 2)

    def prefill(self, *a, **kw):  # (a random prompt's first token may be a stop id on this tiny model)
        cache, logits = real_prefill(self, *a, **kw)
        return cache, steer(logits, False)

    monkeypatch.setattr(GptOss, "decode", decode)
    monkeypatch.setattr(GptOss, "prefill", prefill)
    monkeypatch.setattr(GptOss, "prefill_many", lambda self, *a, **kw: steer(real_many(self, *a, **kw), False))
    g = gen.generate(model, _prompt(cfg), get_ops("weights"), max_new_tokens=20)
    assert len(g.tokens) == 3 and g.tokens[-1] == stop_id and stop_id not in g.tokens[:-1]
    assert g.stop == {"eos": "<|return|>", "call": "<|call|>"}[stop]
    assert len(calls) == 2  # nothing decoded after the stop


def test_end_stops_except_after_analysis():
    stops = gen.stop_tokens(gen.HARMONY_VOCAB)
    assert set(stops.values()) == {"<|return|>", "<|call|>", "<|end|>"} and stops[200002] == "<|return|>"
    analysis = [gen.CHANNEL, *gen.ANALYSIS, gen.MESSAGE, 1000, 2000, gen.END]
    assert gen.stops_here(analysis, stops) is None  # the final answer follows
    final = [*analysis, gen.START, 173781, gen.CHANNEL, 17196, gen.MESSAGE, 42, gen.END]
    assert gen.stops_here(final, stops) == "<|end|>"
    assert gen.stops_here([*final[:-1], gen.RETURN], stops) == "<|return|>"
    assert gen.stops_here([5, 6], stops) is None
    small = gen.stop_tokens(503)  # a synthetic vocabulary: the stand-ins, no <|end|>
    assert set(small) == {special_token_ids(503)["eos"], special_token_ids(503)["call"]}


def test_reply_text_stream_and_channels():
    pytest.importorskip("openai_harmony", reason="text needs openai-harmony")
    enc = gen._encoding()
    reply = "<|channel|>analysis<|message|>Add: 2 + 2 = 4 ✓.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>"
    ids = enc.encode(reply, allowed_special="all")
    stream = gen.TextStream()
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) + stream.flush() == reply
    assert all("\ufffd" not in p for p in pieces)
    msgs, why = gen.parse_reply(ids)
    assert why is None and msgs == [("analysis", "Add: 2 + 2 = 4 ✓."), ("final", "Four.")]
    msgs, why = gen.parse_reply(ids[:-2])  # cut short by --max-new-tokens: the open message still shows
    assert why is None and msgs == [("analysis", "Add: 2 + 2 = 4 ✓."), ("final", "Four")]
    msgs, why = gen.parse_reply([5, 6, gen.CHANNEL, 99])  # noise, as synthetic weights give
    assert msgs == [] and why.startswith("the reply is not well-formed Harmony")


def test_generate_cli_streams_ids_and_reports_speed(tiny, tmp_path):
    ckpt, cfg, _ = tiny
    tok = tmp_path / "t.json"
    tok.write_text(json.dumps(_prompt(cfg, 9)))
    r = runner.invoke(app, ["generate", str(ckpt), "--tokens", str(tok), "--max-new-tokens", "6", "--mode", "w8a8"])
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert "vocab_size 503 is not the o200k_harmony tokenizer's 201088" in out[0]
    assert out[1].startswith("[9 prompt tokens, mode w8a8, cpu, greedy]")
    ids = [int(x) for x in out[2].split()]
    assert 1 <= len(ids) <= 6 and all(0 <= i < cfg.vocab_size for i in ids)
    assert out[3].startswith("stopped: ")
    assert out[4].startswith("prefill: 9 tokens in ") and "tokens/s" in out[4] and "decode: " in out[4]


@pytest.fixture(scope="module")
def real_vocab(tmp_path_factory):
    """A small synthetic gpt-oss with the tokenizer's 201088-token vocabulary: text and channels."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    root = tmp_path_factory.mktemp("generate-vocab")
    write_synthetic(root / "src", "tiny", layers=1, seed=3, layout="hf", vocab_size=gen.HARMONY_VOCAB, hidden_size=64,
                    intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                    num_experts_per_tok=1)
    convert_checkpoint(root / "src", root / "fp8")
    return root / "fp8"


def test_generate_cli_text_channels_and_harmony_stops(real_vocab, monkeypatch):
    """--prompt end to end; the model's choices replaced by a scripted Harmony reply (synthetic
    weights give noise): analysis's <|end|> goes on, <|return|> stops, channels are parsed."""
    pytest.importorskip("openai_harmony", reason="--prompt needs openai-harmony")
    enc = gen._encoding()
    reply = ("<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant<|channel|>final"
             "<|message|>2 + 2 = 4.<|return|>")
    script = iter(enc.encode(reply, allowed_special="all") + [5, 6, 7])  # what would follow is never asked for
    real_pick = gen.pick
    monkeypatch.setattr(gen, "pick", lambda logits, t, g: real_pick(logits, t, g) * 0 + next(script))
    r = runner.invoke(app, ["generate", str(real_vocab), "--prompt", "What is 2+2?", "--max-new-tokens", "64"])
    assert r.exit_code == 0, r.output
    assert reply in r.output  # streamed as text
    assert "stopped: <|return|> after" in r.output
    assert "[analysis] User asks 2+2. Answer 4." in r.output and "[final] 2 + 2 = 4." in r.output
    assert next(script) == 5


def _one_line_error(args):
    p = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    return p.stderr


def _one_line_error_in_process(args):
    """_one_line_error through the same root handler (cli.main._Root.main) in this process: a real
    process per case cost ~4 s each on the 2-core box; the first case below keeps one."""
    r = runner.invoke(app, args)
    assert r.exit_code != 0 and "Traceback" not in r.stderr, (r.exit_code, r.output)
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def test_bad_input_is_one_line(tiny, tmp_path):
    ckpt, cfg, _ = tiny
    tok = tmp_path / "t.json"
    tok.write_text(json.dumps(_prompt(cfg, 4)))
    assert str(tmp_path / "nope") in _one_line_error(["generate", str(tmp_path / "nope"), "--tokens", str(tok)])
    err = _one_line_error_in_process
    assert "exactly one of --prompt" in err(["generate", str(ckpt), "--tokens", str(tok), "--prompt", "hi"])
    assert "exactly one of --prompt" in err(["generate", str(ckpt)])
    assert "exceed the model's context of 131072 tokens; ask for at most 131068" in err(
        ["generate", str(ckpt), "--tokens", str(tok), "--max-new-tokens", "200000"])
    assert "greater than or equal to 1" in err(["generate", str(ckpt), "--tokens", str(tok), "--max-new-tokens", "0"])
    assert "finite number >= 0" in err(["generate", str(ckpt), "--tokens", str(tok), "--temperature", "-1"])
    tok.write_text(json.dumps([1, cfg.vocab_size]))
    assert "outside the vocabulary" in err(["generate", str(ckpt), "--tokens", str(tok)])


def test_prompt_on_a_small_vocabulary_says_so(tiny):
    ckpt, _, _ = tiny
    err = _one_line_error_in_process(["generate", str(ckpt), "--prompt", "What is 2+2?"])
    assert "vocabulary has 503 tokens, not the Harmony tokenizer's 201088" in err and "--tokens FILE" in err


def test_library_rejects_bad_requests(tiny):
    _, cfg, model = tiny
    ops = get_ops("weights")
    with pytest.raises(GptOssFp8Error, match="the prompt is empty"):
        gen.generate(model, [], ops, max_new_tokens=2)
    with pytest.raises(GptOssFp8Error, match="--max-new-tokens 0: give at least 1"):
        gen.generate(model, [1, 2], ops, max_new_tokens=0)
    with pytest.raises(GptOssFp8Error, match="--temperature nan"):
        gen.generate(model, [1, 2], ops, max_new_tokens=2, temperature=float("nan"))


def test_help_is_fast_and_imports_no_torch():
    probe = ("import sys, time; t = time.perf_counter(); sys.argv = ['gptoss-fp8', 'generate', '--help']\n"
             "from gptoss_fp8.cli.main import app\ntry:\n    app()\nexcept SystemExit:\n    pass\n"
             "print('TORCH', 'torch' in sys.modules, 'SECONDS', time.perf_counter() - t)")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    last = p.stdout.strip().splitlines()[-1].split()
    assert "--max-new-tokens" in p.stdout and last[1] == "False", p.stdout + p.stderr
    assert float(last[3]) < 5.0, last


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["weights", "kernels"])
def test_generate_on_cuda(tiny, mode):
    """On the GPU: greedy tokens are the full forward's argmax on the growing sequence wherever that
    argmax is not a near-tie (one-row and T-row GEMMs round otherwise there); seeded sampling repeats."""
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.verify.backends import ops_for

    ckpt, cfg, _ = tiny
    model = load_model(ckpt, device="cuda")
    ops = ops_for(mode)
    prompt = _prompt(cfg)
    g = gen.generate(model, prompt, ops, max_new_tokens=16)
    seq = list(prompt)
    for tok in g.tokens:
        row = model(torch.tensor(seq, device="cuda"), ops)[-1].float()
        top2 = row.topk(2)
        if float(top2.values[0] - top2.values[1]) >= 0.25:
            assert tok == int(top2.indices[0]), (seq, g.tokens)
        seq.append(tok)
    a, b = (gen.generate(model, prompt, ops, max_new_tokens=16, temperature=1.0, seed=5).tokens for _ in range(2))
    assert a == b
    if mode == "kernels":  # the default there replays each step as a CUDA graph: the same tokens as eager
        assert gen.generate(model, prompt, ops, max_new_tokens=16, cuda_graph=False).tokens == g.tokens
    print(f"METRIC generate cuda {mode}: prefill {g.prefill_tokens_per_s:.0f} tokens/s, "
          f"decode {g.decode_tokens_per_s:.0f} tokens/s")

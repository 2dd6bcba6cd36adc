"""verify-logits: metrics, broken conversions caught and located, reference files, CLI."""

import hashlib
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from gptoss_fp8.cli.main import app
from gptoss_fp8.convert.convert import convert_checkpoint
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.verify.metrics import layer_errors, logit_metrics

pytest.importorskip("gpt_oss.torch.model", reason="OpenAI's reference: pip install --no-deps gpt-oss==0.0.9")

from gptoss_fp8.verify.reference import (
    Rounding,
    load_reference_file,
    reference_for,
    save_reference,
)
from gptoss_fp8.verify.run import verify_checkpoint

runner = CliRunner()


# ------------------------------------------------------------------------------------------------
# metrics


def test_logit_metrics_against_direct_formulas():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(9, 40, generator=g) * 3
    ours = ref + 0.3 * torch.randn(9, 40, generator=g)
    m = logit_metrics(ref, ours)
    p, q = torch.softmax(ref.double(), -1), torch.softmax(ours.double(), -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(torch.tensor(m["per_position"]["kl"], dtype=torch.float64), kl, rtol=1e-9, atol=1e-12)
    assert m["summary"]["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-9)
    assert m["summary"]["kl_max"] == pytest.approx(float(kl.max()), rel=1e-9)
    assert m["summary"]["top1_agreement"] == pytest.approx(float((ref.argmax(-1) == ours.argmax(-1)).double().mean()))
    assert m["summary"]["max_abs_delta"] == pytest.approx(float((ours - ref).abs().max()), rel=1e-6)
    for t in range(9):
        a, b = set(ref[t].topk(5).indices.tolist()), set(ours[t].topk(5).indices.tolist())
        assert m["per_position"]["top5_overlap"][t] == pytest.approx(len(a & b) / 5)
    same = logit_metrics(ref, ref.clone())["summary"]
    assert same["kl_max"] == 0 and same["top1_agreement"] == 1 and same["top5_overlap"] == 1 and same["max_abs_delta"] == 0


def test_near_ties_do_not_count_against_top1():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(10, 50, generator=g)
    ref[:, 7] = 20.0  # decisive top-1 everywhere ...
    ref[4, 9] = 19.9  # ... except position 4: a near-tie (margin 0.1 < 0.25)
    ours = ref.clone()
    ours[4, 9] = 20.05  # the near-tie flips
    s = logit_metrics(ref, ours)["summary"]
    assert s["top1_agreement"] == pytest.approx(0.9) and s["top1_agreement_decisive"] == 1.0 and s["ties"] == 1
    ours[2, 3] = 21.0  # a decisive flip counts
    s = logit_metrics(ref, ours)["summary"]
    assert s["top1_agreement_decisive"] == pytest.approx(8 / 9)


def test_layer_errors_and_added():
    g = torch.Generator().manual_seed(2)
    ref = {f"{i}.{p}": torch.randn(6, 32, generator=g) for i in range(2) for p in ("attn", "mlp")}
    ours = {k: v.clone() for k, v in ref.items()}
    ours["1.attn"] = ref["1.attn"] * 1.1
    ours["1.mlp"] = ref["1.mlp"] * 1.1
    errs = layer_errors(ref, ours, 2)
    assert [e["rel_err"] for e in errs[:2]] == [0.0, 0.0]
    assert errs[2]["rel_err"] == pytest.approx(0.1, rel=1e-5) and errs[2]["added"] == pytest.approx(0.1, rel=1e-5)
    assert errs[3]["added"] == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------------------------------
# broken conversions are caught and located


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    cfg = write_synthetic(root / "src", "tiny", seed=8, layout="hf")
    convert_checkpoint(root / "src", root / "exact", keep_attention_bf16=True)
    tokens = torch.randint(0, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(6))
    (root / "tokens.json").write_text(json.dumps(tokens.tolist()))
    ref = reference_for(root / "src", tokens)
    return root, tokens, ref


@pytest.fixture(scope="module")
def tiny_default(tiny):
    """The default conversion (FP8 attention, lossy) and the reference with its expected rounding."""
    from gptoss_fp8.verify.report import rounding_for

    root, tokens, _ = tiny
    convert_checkpoint(root / "src", root / "default")
    rounding, exact = rounding_for(root / "default")
    assert not exact and rounding == Rounding("pow2", True)
    return root / "default", reference_for(root / "src", tokens, rounding=rounding)


def _edit(ckpt, name, fn):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    f = ckpt / idx["weight_map"][name]
    with safe_open(str(f), "pt") as sf:
        meta = sf.metadata()
    t = load_file(str(f))
    t[name] = fn(t[name].clone())
    save_file(t, str(f), metadata=meta)
    # A buggy converter writes a manifest that matches its (wrong) files: keep layout.json in step,
    # so the forward pass, not the integrity check, has to find the damage.
    layout = json.loads((ckpt / "layout.json").read_text())
    rel = str(f.relative_to(ckpt))
    for rank in layout["ranks"]:
        if rel in rank["files"]:
            rank["files"][rel] = {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (ckpt / "layout.json").write_text(json.dumps(layout))


def _flip_scale(t):  # one block scale of every expert negated
    t[:, 0, 0] = -t[:, 0, 0]
    return t


def _swap_interleave(t):  # rows 2j <-> 2j+1: gate and up exchanged
    return t.view(t.shape[0], -1, 2, t.shape[-1]).flip(2).reshape(t.shape)


def _zero_sinks(t):
    return torch.zeros_like(t)


@pytest.mark.parametrize("tensor,fn,layer,part", [
    ("model.layers.1.mlp.experts.gate_up_proj_scale_inv", _flip_scale, 1, "mlp"),
    ("model.layers.0.mlp.experts.down_proj_scale_inv",
     lambda t: t.index_put_((torch.tensor([3]), torch.tensor([1]), torch.tensor([0])), t[3, 1, 0] * 16), 0, "mlp"),
    ("model.layers.0.mlp.experts.gate_up_proj", _swap_interleave, 0, "mlp"),
    ("model.layers.1.self_attn.sinks", _zero_sinks, 1, "attn"),
])
def test_broken_conversion_is_caught_and_located(tiny, tmp_path, tensor, fn, layer, part):
    root, _, ref = tiny
    d = tmp_path / "broken"
    shutil.copytree(root / "exact", d)
    _edit(d, tensor, fn)
    report, _ = verify_checkpoint(d, ref, modes=["weights"])
    sec = report["weights"]
    assert report["passed"] is False and sec["passed"] is False and sec["failures"]
    assert sec["profile"] == "exact"
    assert (sec["divergence"]["layer"], sec["divergence"]["part"]) == (layer, part), sec["divergence"]
    earlier = [p for p in sec["layers"] if (p["layer"], p["part"] == "mlp") < (layer, part == "mlp")]
    assert all(p["rel_err"] <= 1e-3 for p in earlier), earlier


def _flip_block(t):  # one 128x128 block scale of a 2-D weight negated
    t[0, 0] = -t[0, 0]
    return t


def _drop_one_sink(t):  # the head with the largest sink loses it: no extra softmax column
    t[t.float().argmax()] = -float("inf")
    return t


@pytest.mark.parametrize("tensor,fn,layer,part", [
    ("model.layers.0.self_attn.q_proj.weight_scale_inv", _flip_block, 0, "attn"),
    ("model.layers.1.self_attn.o_proj.weight_scale_inv", lambda t: t * 2, 1, "attn"),
    ("model.layers.1.mlp.experts.gate_up_proj_scale_inv", _flip_scale, 1, "mlp"),
    ("model.layers.0.mlp.experts.gate_up_proj", _swap_interleave, 0, "mlp"),
    ("model.layers.1.self_attn.sinks", _drop_one_sink, 1, "attn"),
])
def test_broken_default_conversion_is_caught_and_located(tiny_default, tmp_path, tensor, fn, layer, part):
    """A lossy (FP8 attention) conversion is checked exactly too: against OpenAI's model holding the
    weights the conversion should produce."""
    ckpt, ref = tiny_default
    d = tmp_path / "broken"
    shutil.copytree(ckpt, d)
    _edit(d, tensor, fn)
    report, _ = verify_checkpoint(d, ref, modes=["weights"])
    sec = report["weights"]
    assert sec["profile"] == "exact" and sec["compared_with"] == "expected"
    assert report["passed"] is False and sec["failures"]
    assert (sec["divergence"]["layer"], sec["divergence"]["part"]) == (layer, part), sec["divergence"]


def test_default_conversion_passes_and_reports_fp8_cost(tiny_default):
    ckpt, ref = tiny_default
    report, _ = verify_checkpoint(ckpt, ref, modes=["weights", "w8a8"])
    assert report["passed"] is True and report["expected_rounding"] == "pow2/attention-fp8"
    w = report["weights"]
    assert w["summary"]["kl_mean"] == 0.0  # bit-identical to the expected reference on CPU
    assert w["vs_source"]["summary"]["kl_mean"] > 1e-3  # FP8 attention does cost something
    assert report["w8a8"]["summary"]["kl_mean"] > 0


def test_exact_conversion_passes_both_modes(tiny):
    root, _, ref = tiny
    report, _ = verify_checkpoint(root / "exact", ref, modes=["weights", "w8a8"])
    assert report["passed"] is True
    assert report["weights"]["profile"] == "exact" and report["w8a8"]["profile"] == "w8a8"
    assert report["weights"]["summary"]["top1_agreement"] == 1.0
    assert report["weights"]["summary"]["kl_mean"] <= 2e-3
    assert report["w8a8"]["summary"]["kl_mean"] > 0  # FP8 activations do change the numbers


def test_reference_file_roundtrip(tiny, tmp_path):
    _, tokens, ref = tiny
    save_reference(ref, tmp_path / "ref.safetensors")
    back = load_reference_file(tmp_path / "ref.safetensors")
    assert torch.equal(back.tokens, tokens) and torch.equal(back.logits, ref.logits)
    assert back.hidden.keys() == ref.hidden.keys()
    assert all(torch.equal(back.hidden[k], ref.hidden[k]) for k in ref.hidden)


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_report_dump_and_plot(tiny, tmp_path):
    root = tiny[0]
    args = ["verify-logits", str(root / "exact"), "--reference", str(root / "src"), "--tokens", str(root / "tokens.json"),
            "--json", str(tmp_path / "r.json"), "--dump-logits", str(tmp_path / "l.safetensors"),
            "--save-reference", str(tmp_path / "ref.safetensors")]
    import importlib.util

    plot = importlib.util.find_spec("matplotlib") is not None  # optional: --plot needs it
    if plot:
        args += ["--plot", str(tmp_path / "p.png")]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "PASSED" in r.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] is True and rep["modes"] == ["weights", "w8a8"]  # the default on CPU
    assert rep["parallel"] == {"tp": 1, "ep": 1, "collective": None}  # one process, no collective
    # which ops backend computed each mode, in the report and on the console; no kernels ran
    assert rep["backends"] == {"weights": "reference", "w8a8": "w8a8-cpu"} and rep["kernels_vs_w8a8"] is None
    assert "weights PASS [reference ops on cpu]" in r.output and "w8a8    PASS [w8a8-cpu ops on cpu]" in r.output
    for mode in ("weights", "w8a8"):
        sec = rep[mode]
        assert sec["backend"] == rep["backends"][mode] and sec["backend_device"] == "cpu" and "spec_fallbacks" not in sec
        assert set(sec["summary"]) == {"kl_mean", "kl_p95", "kl_max", "top1_agreement", "top1_agreement_decisive",
                                       "ties", "top5_overlap", "max_abs_delta", "cosine_min", "cosine_mean"}
        assert len(sec["per_position"]["kl"]) == 48
        assert [(p["layer"], p["part"]) for p in sec["layers"]] == [(0, "attn"), (0, "mlp"), (1, "attn"), (1, "mlp")]
        assert set(sec["thresholds"]) == {"kl_mean", "kl_max", "top1_min", "layer_rel_err"}
    from safetensors.torch import load_file

    for mode in ("weights", "w8a8"):
        t = load_file(str(tmp_path / f"l.{mode}.safetensors"))
        assert t["logits"].dtype == torch.float32 and t["logits"].shape == (48, 503)
    if plot:
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the saved reference file replaces the source, tokens included
    r2 = runner.invoke(app, ["verify-logits", str(root / "exact"), "--reference", str(tmp_path / "ref.safetensors"),
                             "--mode", "weights", "--json", str(tmp_path / "r2.json")])
    assert r2.exit_code == 0, r2.output
    rep2 = json.loads((tmp_path / "r2.json").read_text())
    assert rep2["weights"]["summary"] == rep["weights"]["summary"]


def test_cli_fails_with_exit_1_on_broken_conversion(tiny, tmp_path):
    root = tiny[0]
    d = tmp_path / "broken"
    shutil.copytree(root / "exact", d)
    _edit(d, "model.layers.1.mlp.experts.gate_up_proj", _swap_interleave)
    r = runner.invoke(app, ["verify-logits", str(d), "--reference", str(root / "src"), "--tokens", str(root / "tokens.json"),
                            "--mode", "weights"])
    assert r.exit_code == 1
    assert "FAILED" in r.output and "diverges at layer 1 (mlp)" in r.output
    # thresholds can be overridden
    r = runner.invoke(app, ["verify-logits", str(d), "--reference", str(root / "src"), "--tokens", str(root / "tokens.json"),
                            "--mode", "weights", "--max-kl-mean", "100", "--max-kl", "100", "--min-top1", "0",
                            "--max-part-err", "100"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("extra,match", [
    (["--tokens", "NOFILE"], "no such tokens file"),
    (["--prompt", "hi", "--tokens", "x.json"], "not both"),
    (["--tokens", "BADTOK"], "vocab_size 503"),
    (["--tokens", "OK", "--tp", "2"], "converted for --tp 1 --ep 1"),
    (["--tokens", "OK", "--reference", "/nonexistent/ref"], "no such file or directory"),
])
def test_cli_user_errors_are_one_line(tiny, tmp_path, extra, match):
    root = tiny[0]
    (tmp_path / "bad.json").write_text(json.dumps([1, 2, 100000]))
    sub = {"NOFILE": str(tmp_path / "missing.json"), "BADTOK": str(tmp_path / "bad.json"), "OK": str(root / "tokens.json")}
    extra = [sub.get(a, a) for a in extra]
    args = ["verify-logits", str(root / "exact"), "--reference", str(root / "src")] + extra
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and match in err[0], r.output


def test_prompt_renders_harmony_offline():
    pytest.importorskip("openai_harmony", reason="--prompt needs openai-harmony")
    pytest.importorskip("bpe_openai", reason="--prompt needs bpe-openai")
    from gptoss_fp8.verify.prompt import render_prompt

    ids = render_prompt("What is 2 + 2?")
    # <|start|>user<|message|>...<|end|><|start|>assistant
    assert ids[0] == 200006 and ids[-1] == 173781 and 200008 in ids and 200007 in ids


# "forward" (replicated vocabulary, no --decode: ~12 s of torchrun on the 2-core box) under -m slow: the
# same command under torchrun, forward included, runs by default in "decode-vocab-parallel"; a sharded
# verify with the vocabulary replicated (tp 2 ep 2) in tests/test_verify_mutations.py::test_bug_in_the_spec_fails_sharded
@pytest.mark.parametrize("case", [pytest.param("forward", marks=pytest.mark.slow), "decode-vocab-parallel"])
def test_cli_under_torchrun_tp2(tiny, tmp_path, case):
    """`torchrun --nproc-per-node 2 gptoss-fp8 verify-logits` on a tp 2 conversion: rank 0 runs the
    reference, both ranks their shard, rank 0 reports; every rank exits with the verdict. The second
    case: a vocab-parallel conversion, and ``--decode 3`` (the last 3 tokens decoded one at a time on
    the ranks' KV caches, each step checked against the same mode's forward)."""
    import os
    import shutil as sh
    import subprocess
    import sys

    from gptoss_fp8.parallel import free_port as _free_port

    root = tiny[0]
    vocab = case == "decode-vocab-parallel"
    convert_checkpoint(root / "src", tmp_path / "tp2", tp=2, ep=1, keep_attention_bf16=True, vocab_parallel=vocab)
    torchrun = sh.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "gptoss_fp8.cli.main",
           "verify-logits", str(tmp_path / "tp2"), "--reference", str(root / "src"), "--tokens", str(root / "tokens.json"),
           "--json", str(tmp_path / "r.json")] + (["--decode", "3"] if vocab else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] is True and rep["parallel"] == {"tp": 2, "ep": 1, "collective": "gloo"}
    assert rep["weights"]["summary"]["top1_agreement"] == 1.0
    if vocab:
        assert json.loads((tmp_path / "tp2" / "layout.json").read_text())["vocab_parallel"] is True
        dec = rep["weights"]["decode"]
        assert dec["steps"] == 3 and dec["passed"] is True, dec


def test_cli_prompt_end_to_end(tmp_path):
    """--prompt renders Harmony offline; needs the real 201088-token vocabulary (tiny otherwise)."""
    pytest.importorskip("openai_harmony", reason="--prompt needs openai-harmony")
    pytest.importorskip("bpe_openai", reason="--prompt needs bpe-openai")
    write_synthetic(tmp_path / "src", "tiny", seed=2, layers=1, layout="hf", hidden_size=64, intermediate_size=64,
                    num_local_experts=4, vocab_size=201088)
    convert_checkpoint(tmp_path / "src", tmp_path / "fp8", keep_attention_bf16=True)
    r = runner.invoke(app, ["verify-logits", str(tmp_path / "fp8"), "--reference", str(tmp_path / "src"),
                            "--prompt", "Say hello.", "--mode", "weights", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["tokens"]["from"] == "--prompt (Harmony)" and rep["tokens"]["count"] >= 8
    assert rep["weights"]["profile"] == "exact" and rep["passed"] is True


def test_exact_profile_relaxes_only_across_device_types():
    """A CPU-made reference with our weights mode on a GPU gets the cross-device profile; the same
    device keeps ``exact``; the reference file records the device it was made on."""
    from gptoss_fp8.verify.reference import (
        Reference,
    )
    from gptoss_fp8.verify.report import profile_for

    ref = Reference(torch.arange(3), torch.randn(3, 7))
    assert profile_for("weights", ref, True, "cpu")[0] == "exact"
    assert profile_for("weights", ref, True, "cuda")[0] == "exact-cross-device"
    assert profile_for("w8a8", ref, True, "cuda")[0] == "w8a8"
    assert profile_for("weights", ref, False, "cuda")[0] == "lossy"
    ref.device = "cuda"
    assert profile_for("weights", ref, True, "cuda:0")[0] == "exact"
    assert profile_for("weights", ref, True, "cpu")[0] == "exact-cross-device"


def test_reference_file_records_its_device(tmp_path):
    from gptoss_fp8.verify.reference import (
        Reference,
        load_reference_file,
        save_reference,
    )

    ref = Reference(torch.arange(3), torch.randn(3, 7), device="cuda")
    save_reference(ref, tmp_path / "r.safetensors")
    assert load_reference_file(tmp_path / "r.safetensors").device == "cuda"

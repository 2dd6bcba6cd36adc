"""verify-logits on our GPU kernels: the ``kernels`` mode (the triton ops backend), its agreement with
the torch w8a8 spec, which backend the report names, and the errors when the kernels cannot run.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when no GPU
is visible), whose fp32 -> bf16 stores truncate instead of rounding: slightly farther from the spec
than the GPU. GPU tests (``-m gpu``) run ``verify-logits --device cuda`` on every golden checkpoint.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from gptoss_fp8.cli.main import app
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.verify import golden
from gptoss_fp8.verify.backends import resolve_modes
from gptoss_fp8.verify.thresholds import DEFAULTS

HAS_CUDA = torch.cuda.is_available()
runner = CliRunner()

try:  # Triton fixes interpreter-or-not for its own library at import: do it now, under conftest's flag,
    import triton  # noqa: F401  (not inside a test that turns the flag off)
except ImportError:
    pass

# Golden checkpoints' kernels-vs-spec agreement, much stricter than the default
# (thresholds.DEFAULTS["kernels_vs_w8a8"], a smoke check sized for random-router models up to the
# 20b preset). Worst golden run through the interpreter: odd, default conversion, KL mean 0.052,
# KL max 1.86, decisive top-1 0.977, logits rel. err 0.085 (one layer, 3 experts top-1: a token
# routed elsewhere changes its logits wholesale, and which tokens flip is chance); bounds about 3x.
# The GPU rounds where the interpreter truncates: it should do better.
GOLDEN_AGREEMENT = {"kl_mean": 0.15, "kl_max": 6.0, "top1_decisive": 0.9, "logits_rel_err": 0.25}


def _verify(ckpt, ref_file, tmp_path, *extra):
    args = ["verify-logits", str(ckpt), "--reference", str(ref_file), "--json", str(tmp_path / "r.json"), *extra]
    r = runner.invoke(app, args)
    rep = json.loads((tmp_path / "r.json").read_text()) if (tmp_path / "r.json").is_file() else None
    return r, rep


def _check_kernels_report(r, rep, device_words):
    assert r.exit_code == 0, r.output
    assert rep["passed"] is True, r.output
    assert rep["modes"] == ["weights", "w8a8", "kernels"]
    assert rep["backends"] == {"weights": "reference", "w8a8": "w8a8-cpu", "kernels": "triton"}
    k = rep["kernels"]
    assert k["backend"] == "triton" and k["backend_device"] == device_words
    assert k["profile"] == "kernels" and k["thresholds"] == DEFAULTS["kernels"].to_dict() and k["passed"] is True
    # every op the triton backend has a kernel for ran on it
    assert k["spec_fallbacks"] and set(k["spec_fallbacks"].values()) == {0}, k["spec_fallbacks"]
    assert "spec_fallbacks" not in rep["w8a8"]
    agree = rep["kernels_vs_w8a8"]
    assert agree["passed"] is True and agree["thresholds"] == DEFAULTS["kernels_vs_w8a8"].to_dict()
    s = agree["summary"]
    assert s["kl_mean"] > 0  # a different computation, not the spec again
    assert s["kl_mean"] <= GOLDEN_AGREEMENT["kl_mean"] and s["kl_max"] <= GOLDEN_AGREEMENT["kl_max"], s
    assert s["top1_agreement_decisive"] >= GOLDEN_AGREEMENT["top1_decisive"], s
    assert agree["logits_rel_err"] <= GOLDEN_AGREEMENT["logits_rel_err"], agree["logits_rel_err"]
    # the console says which backend computed each mode
    assert f"kernels PASS [triton ops on {device_words}]" in r.output, r.output
    assert "w8a8    PASS [w8a8-cpu ops on" in r.output and "kernels vs w8a8 PASS" in r.output, r.output


# ------------------------------------------------------------------------------------------------
# Mode selection and errors (no model runs)


def test_resolve_modes(monkeypatch):
    assert resolve_modes(None, "cpu") == ["weights", "w8a8"]
    assert resolve_modes(["both"], "cpu") == ["weights", "w8a8"]
    assert resolve_modes(["w8a8", "weights", "w8a8"], "cpu") == ["weights", "w8a8"]
    with pytest.raises(GptOssFp8Error, match="unknown mode 'fast'"):
        resolve_modes(["fast"], "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_modes(None, "cuda") == ["weights", "w8a8", "kernels"]  # auto: the kernels on a GPU
    assert resolve_modes(["kernels", "weights"], "cuda") == ["weights", "kernels"]
    assert resolve_modes(["both"], "cuda") == ["weights", "w8a8"]
    assert resolve_modes(["all"], "cuda") == ["weights", "w8a8", "kernels"]


@pytest.mark.parametrize("extra,match", [
    (["--mode", "kernels"], "--mode kernels runs our Triton kernels, which need --device cuda"),
    (["--mode", "all"], "--mode kernels runs our Triton kernels, which need --device cuda"),
    (["--device", "cuda"], "--device cuda: no CUDA GPU is visible"),
])
def test_kernels_without_cuda_or_interpreter_is_one_line(monkeypatch, tmp_path, extra, match):
    """Checked before anything runs: the reference path given does not even exist."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused_before_anything_runs(tmp_path, extra, match)


def _refused_before_anything_runs(tmp_path, extra, match):
    """verify-logits on an empty checkpoint and an absent reference: exit 1 with one error line holding match."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    r = runner.invoke(app, ["verify-logits", str(ckpt), "--reference", str(tmp_path / "nothing"), *extra])
    assert r.exit_code == 1, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and match in err[0], r.output
    assert "Traceback" not in r.output


def test_kernels_mode_refused_by_the_library_too(monkeypatch, golden_ckpts):
    from gptoss_fp8.verify.run import compute_outputs

    ckpt, _ = golden_ckpts("odd")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(GptOssFp8Error, match="need --device cuda"):
        compute_outputs(ckpt, torch.tensor([1, 2, 3]), ["kernels"])


# ------------------------------------------------------------------------------------------------
# Fallback accounting


def test_spec_fallbacks_are_counted_and_change_nothing():
    """An op the kernels cannot take (head_dim 8; K not a multiple of 16) runs the spec and is
    counted; bf16 GEMMs (torch by design) are not; results equal the uncounted backend's."""
    pytest.importorskip("triton")
    if not HAS_CUDA and not _interpreter():
        pytest.skip("needs CUDA or the Triton interpreter")
    from gptoss_fp8.model.backends import get_ops
    from gptoss_fp8.model.ops import W8A8CpuOps
    from gptoss_fp8.quant.fp8 import quantize_weight_blocks
    from gptoss_fp8.verify.backends import ops_for

    dev = "cuda" if HAS_CUDA else "cpu"
    ops, plain, spec = ops_for("kernels"), get_ops("triton"), W8A8CpuOps()
    assert set(ops.spec_fallbacks.values()) == {0} and {"linear", "attention", "expert_ffn"} <= set(ops.spec_fallbacks)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(9, 2, 2, 8, generator=g).bfloat16().to(dev)  # head_dim 8: below the kernel's 16
    k, v = (torch.randn(9, 2, 8, generator=g).bfloat16().to(dev) for _ in range(2))
    s = torch.randn(4, generator=g).bfloat16().to(dev)
    assert torch.equal(ops.attention(q, k, v, s, 0.3, 4), spec.attention(q, k, v, s, 0.3, 4))
    x = torch.randn(5, 40, generator=g).bfloat16().to(dev)  # K = 40: not a multiple of 16
    w, sc = (t.to(dev) for t in quantize_weight_blocks(torch.randn(24, 40, generator=g)))
    assert torch.equal(ops.linear(x, w, sc, None), spec.linear(x, w, sc, None))
    xb, wb = torch.randn(5, 48, generator=g).bfloat16().to(dev), torch.randn(24, 48, generator=g).bfloat16().to(dev)
    ops.linear(xb, wb, None, None)  # a bf16 weight: not a fallback
    x2 = torch.randn(7, 64, generator=g).bfloat16().to(dev)  # a shape the kernels take
    w2, s2 = (t.to(dev) for t in quantize_weight_blocks(torch.randn(32, 64, generator=g)))
    assert torch.equal(ops.linear(x2, w2, s2, None), plain.linear(x2, w2, s2, None))
    assert {op: n for op, n in ops.spec_fallbacks.items() if n} == {"attention": 1, "linear": 1}


def _interpreter() -> bool:
    from gptoss_fp8.model.triton_ops import interpreter_on

    return interpreter_on()


# ------------------------------------------------------------------------------------------------
# The kernels mode on the golden checkpoints, through the interpreter (CPU)

needs_interpreter = pytest.mark.skipif(HAS_CUDA, reason="the GPU tests run the kernels compiled")


@needs_interpreter
@pytest.mark.parametrize("case,conversion", [("odd", "default"), pytest.param("tiny", "exact", marks=pytest.mark.slow)])
def test_kernels_mode_through_the_interpreter(golden_ckpts, tmp_path, case, conversion):
    ckpt, ref_file = golden_ckpts(case, conversion)
    r, rep = _verify(ckpt, ref_file, tmp_path, "--mode", "all", "--dump-logits", str(tmp_path / "l.safetensors"))
    _check_kernels_report(r, rep, "cpu, Triton interpreter")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "l.kernels.safetensors"), "pt") as f:
        assert f.metadata()["backend"] == "triton"


@needs_interpreter
@pytest.mark.slow  # the kernels unsharded: the test above; sharding: the spec modes' sharded tests
def test_kernels_mode_sharded_through_the_interpreter(golden_ckpts):
    """tp 2 worker processes (gloo), the intermediate split over ranks: fallback counts come back
    from rank 0, and the kernels agree with the spec as unsharded."""
    from gptoss_fp8.verify.reference import load_reference_file
    from gptoss_fp8.verify.report import kernels_vs_spec
    from gptoss_fp8.verify.run import compute_outputs

    ckpt, ref_file = golden_ckpts("odd", "exact", tp=2, ep=1)
    tokens = load_reference_file(ref_file).tokens
    out = compute_outputs(ckpt, tokens, ["kernels", "w8a8"], tp=2, ep=1)
    assert list(out) == ["w8a8", "kernels"]
    assert {o.collective for o in out.values()} == {"gloo"}
    assert out["w8a8"].spec_fallbacks is None and set(out["kernels"].spec_fallbacks.values()) == {0}
    agree = kernels_vs_spec(out["w8a8"], out["kernels"], n_layers=1, experts_per_token=1)
    assert agree["passed"] and agree["logits_rel_err"] <= GOLDEN_AGREEMENT["logits_rel_err"], agree["summary"]


def test_kernels_vs_spec_fails_on_a_broken_kernel_output():
    """The agreement check is a check: logits that are not the spec's fail it."""
    from gptoss_fp8.verify.report import ModeOutput, kernels_vs_spec

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=g) * 4
    spec = ModeOutput(logits, {}, 0.0)
    same = kernels_vs_spec(spec, ModeOutput(logits + 0.01 * torch.randn(32, 50, generator=g), {}, 0.0, {}), 1)
    assert same["passed"] and same["failures"] == []
    broken = kernels_vs_spec(spec, ModeOutput(logits[torch.randperm(32, generator=g)], {}, 0.0, {}), 1)
    assert not broken["passed"] and broken["failures"]


# ------------------------------------------------------------------------------------------------
# GPU: verify-logits --device cuda on every golden checkpoint


GOLDEN_RUNS = [(c.name, conv) for c in golden.CASES for conv in golden.CONVERSIONS]


@pytest.mark.gpu
@pytest.mark.parametrize("case,conversion", GOLDEN_RUNS)
def test_verify_logits_cuda_on_golden(golden_ckpts, tmp_path, case, conversion):
    """The default on a GPU: weights, w8a8 and kernels, against OpenAI's stored reference logits."""
    ckpt, ref_file = golden_ckpts(case, conversion)
    r, rep = _verify(ckpt, ref_file, tmp_path, "--device", "cuda")
    assert rep is not None, r.output
    print(f"METRIC verify cuda {case}/{conversion}: kernels KL mean {rep['kernels']['summary']['kl_mean']:.3g} | "
          f"kernels vs w8a8 KL mean {rep['kernels_vs_w8a8']['summary']['kl_mean']:.3g} max "
          f"{rep['kernels_vs_w8a8']['summary']['kl_max']:.3g} top-1 {rep['kernels_vs_w8a8']['summary']['top1_agreement']:.3f} "
          f"rel {rep['kernels_vs_w8a8']['logits_rel_err']:.3g}")
    _check_kernels_report(r, rep, "cuda")
    assert rep["device"] == "cuda" and rep["weights"]["passed"] and rep["w8a8"]["passed"]


@pytest.mark.gpu
def test_verify_logits_cuda_with_openai_reference_on_the_gpu(golden_ckpts, tmp_path):
    """OpenAI's reference run on the GPU from the golden source (not the stored file)."""
    pytest.importorskip("gpt_oss.torch.model", reason="OpenAI's reference: pip install --no-deps gpt-oss==0.0.9")
    from gptoss_fp8.verify.reference import load_reference_file

    ckpt, ref_file = golden_ckpts("tiny", "default")
    (tmp_path / "tokens.json").write_text(json.dumps(load_reference_file(ref_file).tokens.tolist()))
    r, rep = _verify(ckpt, ckpt.parent / "src", tmp_path, "--device", "cuda", "--tokens", str(tmp_path / "tokens.json"))
    _check_kernels_report(r, rep, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2)])
def test_verify_logits_cuda_sharded_on_golden(golden_ckpts, tmp_path, tp, ep):
    ckpt, ref_file = golden_ckpts("tiny", "exact", tp=tp, ep=ep)
    r, rep = _verify(ckpt, ref_file, tmp_path, "--device", "cuda")
    _check_kernels_report(r, rep, "cuda")
    # NCCL when every rank has a GPU of its own (a 2-GPU machine), else gloo through host memory
    collective = "nccl" if torch.cuda.device_count() >= tp else "gloo"
    assert rep["parallel"] == {"tp": tp, "ep": ep, "collective": collective}


# ------------------------------------------------------------------------------------------------
# --kernel-option: a KernelConfig setting of the kernels mode (an opt-in's numerics through the verdict)


@pytest.mark.parametrize("extra,match", [
    (["--kernel-option", "lane_max=1"], "--kernel-option changes the kernels mode only"),
    (["--mode", "kernels", "--kernel-option", "lane_max=1"], "--kernel-option lane_max: no field 'lane_max'"),
    (["--mode", "kernels", "--kernel-option", "attention_fp8_lane_max=maybe"], "give true or false"),
])
def test_kernel_option_checked_before_anything_runs(tmp_path, extra, match):
    """One line before any model or reference runs (the checkpoint is empty, the reference absent)."""
    if not HAS_CUDA and not _interpreter():
        pytest.skip("--mode kernels needs CUDA or the Triton interpreter")
    _refused_before_anything_runs(tmp_path, extra, match)


def test_kernel_options_reach_the_kernels_ops():
    from gptoss_fp8.verify.backends import ops_for

    ops = ops_for("kernels", kernel_options=("attention_fp8_lane_max=true", "moe_gluon_wide_gate_up.stages=3"))
    assert ops.config.attention_fp8_lane_max is True and ops.config.moe_gluon_wide_gate_up.stages == 3
    assert ops_for("kernels").config.attention_fp8_lane_max is False
    assert not hasattr(ops_for("w8a8", kernel_options=("attention_fp8_lane_max=true",)), "config")


@needs_interpreter
@pytest.mark.slow  # a kernels-mode verdict through the interpreter (the test above it covers the unset run)
def test_kernel_options_recorded_in_the_report(golden_ckpts, tmp_path):
    ckpt, ref_file = golden_ckpts("odd")
    r, rep = _verify(ckpt, ref_file, tmp_path, "--mode", "all", "--kernel-option", "dense_skinny_max_rows=0")
    _check_kernels_report(r, rep, "cpu, Triton interpreter")
    assert rep["kernel_options"] == ["dense_skinny_max_rows=0"]
    assert "kernel options dense_skinny_max_rows=0 (--kernel-option)" in r.output


def test_kernel_options_refused_on_a_sharded_run():
    from gptoss_fp8.verify.run import check_one_process

    check_one_process(None, 4)
    check_one_process(["attention_fp8_lane_max=true"], 1)
    for tp, torchrun, word in ((2, False, "not 2"), (1, True, "not torchrun")):
        with pytest.raises(GptOssFp8Error, match=f"one-process run \\(tp 1, {word}\\)"):
            check_one_process(["attention_fp8_lane_max=true"], tp, torchrun)

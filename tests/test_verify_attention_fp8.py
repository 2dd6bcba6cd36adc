"""``--attention fp8`` in the verdict (verify/report.py ``attention-fp8`` profile, thresholds
``NOISE_RULES["attention-fp8"]``): on the trained fixture the weights mode with FP8 attention
passes against bf16 attention within its own measured noise, and an attention bug injected into it
fails at an attention part; the FP8 modes' noise grids redraw the FP8 attention's rounding."""

import pytest
from mutations import hook

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.ops import ReferenceOps
from gptoss_fp8.verify.run import verify_checkpoint

# by name, for verify.run.resolve_ops_hook
weights__double_sinks = hook("weights", "double_sinks")
weights__no_window = hook("weights", "no_window")
weights__no_sinks = hook("weights", "no_sinks")
weights__no_rope = hook("weights", "no_rope")


def test_weights_mode_with_fp8_attention_passes(trained):
    ckpt, _, _, ref = trained
    report, _ = verify_checkpoint(ckpt, ref, modes=["weights"], attention="fp8")
    sec = report["weights"]
    assert report["attention"] == "fp8" and sec["profile"] == "attention-fp8"
    assert report["passed"], sec["failures"]
    tf = sec["teacher_forced"]
    assert tf["limits_profile"].startswith("attention-fp8")
    attn = [r for r in tf["parts"] if r["part"] == "attn"]
    # FP8 attention is not free (bf16 attention is bit-exact here: 0.0) and its noise was measured
    assert all(r["rel_err"] > 1e-3 and r["noise"] > 1e-3 for r in attn), attn
    mlp = [r for r in tf["parts"] if r["part"] == "mlp"]
    assert all(r["rel_err"] < 1e-3 for r in mlp), mlp  # the MoE sees the reference's inputs: unchanged
    worst = max(r["rel_err"] / r["limit"] for r in attn)
    print(f"METRIC trained weights --attention fp8: worst attention error / limit {worst:.3g}, "
          f"KL mean {sec['summary']['kl_mean']:.3g}")


@pytest.mark.parametrize("bug", [
    "no_sinks", "no_window", "no_rope",
    # measured 2026-12-03: error / limit 0.35-0.69 per layer (L1 0.0715 / 0.103): a sink counted
    # twice moves this model's attention by less than FP8 attention's own rounding noise (the w8a8
    # verdict, with bf16 attention, catches it on this fixture)
    pytest.param("double_sinks", marks=pytest.mark.xfail(strict=True, reason="below FP8 attention's noise")),
])
def test_attention_bug_fails_with_fp8_attention(trained, bug):
    ckpt, _, _, ref = trained
    report, _ = verify_checkpoint(ckpt, ref, modes=["weights"], attention="fp8",
                                  ops_hook=f"test_verify_attention_fp8:weights__{bug}")
    tf = report["weights"]["teacher_forced"]
    assert not report["passed"] and not tf["passed"]
    assert tf["first_failing"]["part"] == "attn", tf["failures"]


def test_unknown_attention_kind_is_one_line():
    with pytest.raises(GptOssFp8Error, match="--attention 'fp4'"):
        ReferenceOps().with_attention("fp4")

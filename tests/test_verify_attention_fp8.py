"""``--attention fp8`` in the verdict (verify/report.py ``attention-fp8`` profile, thresholds
``NOISE_RULES["attention-fp8"]``): on the trained fixture the weights mode with FP8 attention
passes against bf16 attention within its own measured noise, and an attention bug injected into it
fails at an attention part; the FP8 modes' noise grids redraw the FP8 attention's rounding."""

import pytest
import torch
from mutations import hook

from gptoss_fp8.config import GptOssConfig
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.ops import ReferenceOps
from gptoss_fp8.verify.run import verify_checkpoint

# by name, for verify.run.resolve_ops_hook
weights__double_sinks = hook("weights", "double_sinks")
weights__no_window = hook("weights", "no_window")
weights__no_sinks = hook("weights", "no_sinks")
weights__no_rope = hook("weights", "no_rope")


@pytest.mark.parametrize("kind", ["fp8", "fp8-lin"])
def test_weights_mode_with_fp8_attention_passes(trained, kind):
    """Both FP8 kinds: "fp8-lin" (P's e4m3 codes from the scores without 2^x) under the same rule, its noise grids
    redrawing its own codes."""
    ckpt, _, _, ref = trained
    report, _ = verify_checkpoint(ckpt, ref, modes=["weights"], attention=kind)
    sec = report["weights"]
    assert report["attention"] == kind and sec["profile"] == "attention-fp8"
    assert report["passed"], sec["failures"]
    tf = sec["teacher_forced"]
    assert tf["limits_profile"].startswith("attention-fp8")
    attn = [r for r in tf["parts"] if r["part"] == "attn"]
    full = {i for i, kind in enumerate(GptOssConfig.from_file(ckpt / "config.json").layer_types)
            if kind == "full_attention"}
    assert 0 < len(full) < len(attn)
    # FP8 attention in the full-attention layers is not free (bf16 attention is bit-exact here: 0.0) and its
    # noise was measured; the sliding-window layers stay bf16 (ReferenceOps.fp8_attention): exact
    assert all(r["rel_err"] > 1e-3 and r["noise"] > 1e-3 for r in attn if r["layer"] in full), attn
    assert all(r["rel_err"] == 0.0 for r in attn if r["layer"] not in full), attn
    mlp = [r for r in tf["parts"] if r["part"] == "mlp"]
    assert all(r["rel_err"] < 1e-3 for r in mlp), mlp  # the MoE sees the reference's inputs: unchanged
    worst = max(r["rel_err"] / r["limit"] for r in attn)
    print(f"METRIC trained weights --attention {kind}: worst attention error / limit {worst:.3g}, "
          f"KL mean {sec['summary']['kl_mean']:.3g}, top-1 {sec['summary']['top1_agreement_decisive']:.3g}")


@pytest.mark.parametrize("bug", [
    "no_sinks",
    pytest.param("no_window", marks=pytest.mark.slow),  # ~20 s each on CPU: one verify run per bug
    pytest.param("no_rope", marks=pytest.mark.slow),
    # a sink counted twice moves this model's full-attention layers by less than FP8 attention's own
    # rounding noise (error / limit 0.35-0.69, 2026-12-03); the sliding-window layers stay bf16
    # (ReferenceOps.fp8_attention) and catch it there
    pytest.param("double_sinks", marks=pytest.mark.slow),
])
def test_attention_bug_fails_with_fp8_attention(trained, bug):
    _attention_bug_fails(trained, bug, "fp8")


def test_attention_bug_fails_with_fp8_lin_attention(trained):
    """An injected attention bug fails under ``--attention fp8-lin`` too (its looser P codes do not hide it)."""
    _attention_bug_fails(trained, "no_sinks", "fp8-lin")


def _attention_bug_fails(trained, bug, kind):
    ckpt, _, _, ref = trained
    report, _ = verify_checkpoint(ckpt, ref, modes=["weights"], attention=kind,
                                  ops_hook=f"test_verify_attention_fp8:weights__{bug}")
    tf = report["weights"]["teacher_forced"]
    assert not report["passed"] and not tf["passed"]
    assert tf["first_failing"]["part"] == "attn", tf["failures"]
    print(f"METRIC --attention {kind}, {bug}: first failing {tf['first_failing']}")


def test_unknown_attention_kind_is_one_line():
    with pytest.raises(GptOssFp8Error, match="--attention 'fp4'"):
        ReferenceOps().with_attention("fp4")


def test_cli_choices_are_the_ops_kinds():
    from gptoss_fp8.cli.common import Attention
    from gptoss_fp8.model.ops import ATTENTION_KINDS

    assert tuple(a.value for a in Attention) == ATTENTION_KINDS


def test_decode_is_refused_with_fp8_attention():
    from gptoss_fp8.verify.run import check_attention

    check_attention("fp8", 0)
    check_attention("bf16", 4)
    for kind in ("fp8", "fp8-lin"):
        with pytest.raises(GptOssFp8Error, match=f"--decode.*--attention {kind}"):
            check_attention(kind, 4)


def test_reference_ops_route_prefill_attention_to_the_fp8_spec():
    """The ops' full attention (and a prompt chunk's, with its query offset) is spec.attention_fp8 under
    with_attention("fp8"), on the backend's grid; sliding-window layers and decode attention stay bf16."""
    import torch

    from gptoss_fp8 import spec
    from gptoss_fp8.model.ops import W8A8CpuOps

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(40, h, 16, generator=g).bfloat16() for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g).bfloat16()
    ops = W8A8CpuOps(act_max=416.0).with_attention("fp8")
    got = ops.attention(q.view(40, 2, 2, 16), k, v, sinks, 0.25, 0)
    assert torch.equal(got, spec.attention_fp8(q, k, v, sinks, 0.25, fp8_max=416.0).reshape(40, -1))
    assert not torch.equal(got, spec.attention(q, k, v, sinks, 0.25).reshape(40, -1))
    chunk = ops.attention_chunk(q[30:].reshape(10, 2, 2, 16), k, v, sinks, 0.25, 0, 30)
    assert torch.equal(chunk, spec.attention_fp8(q[30:], k, v, sinks, 0.25, 0, 30, fp8_max=416.0).reshape(10, -1))
    # a sliding-window layer stays bf16 (ReferenceOps.fp8_attention), its chunks too
    assert torch.equal(ops.attention(q.view(40, 2, 2, 16), k, v, sinks, 0.25, 8),
                       spec.attention(q, k, v, sinks, 0.25, 8).reshape(40, -1))
    chunk = ops.attention_chunk(q[30:].reshape(10, 2, 2, 16), k, v, sinks, 0.25, 8, 30)
    assert torch.equal(chunk, spec.attention(q[30:], k, v, sinks, 0.25, 8, q_offset=30).reshape(10, -1))
    # fp8-lin: the same spec with P's codes read linearly (p_code "lin"), its scale on the grid's
    lin = W8A8CpuOps(act_max=416.0).with_attention("fp8-lin")
    got_lin = lin.attention(q.view(40, 2, 2, 16), k, v, sinks, 0.25, 0)
    assert torch.equal(got_lin, spec.attention_fp8(q, k, v, sinks, 0.25, fp8_max=416.0, p_code="lin").reshape(40, -1))
    assert not torch.equal(got_lin, got)


def test_fp8_lin_norm_bound_keeps_trained_scores_on_the_fast_path(trained):
    """fp8-lin's default kernel form (exp_lin 5) on the trained fixture's own scores (CPU, the spec's operands,
    benchmarks/lin_bound_probe.py's reading): ``lin_bounds`` covers every Q tile's largest |score| and keeps every tile
    of both full-attention layers within the 16-bit codes' limit (the kernel's fast path), where the amax bound of
    exp_lin 2 / 4 leaves some tiles of layer 0 past it (forty-sixth session: its steps then all took the exact path)."""
    import importlib.util
    from pathlib import Path

    from gptoss_fp8.model.load import load_model

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lin_bound_probe.py"
    spec_ = importlib.util.spec_from_file_location("lin_bound_probe", path)
    probe = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(probe)
    ckpt, _, tokens, _ = trained
    ops = probe.Capturing()
    with torch.inference_mode():
        load_model(str(ckpt)).forward(tokens, ops)
    assert len(ops.calls) == 2
    amax_fast = []
    for q, k, v, sink, sm_scale in ops.calls:
        tile, _, amax_b, bound = probe.bounds(q, k, v, sm_scale)
        assert (tile <= bound).all() and probe.fast_ok(bound, sink).all(), bound.amax()
        amax_fast.append(probe.fast_ok(amax_b, sink).all().item())
    assert not all(amax_fast)

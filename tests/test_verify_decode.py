"""verify-logits --decode N: the KV-cached decode, step by step and layer by layer, against the
same mode's full forward. Correct code passes on both golden checkpoints and on random shapes not
seen by the calibration (thresholds.DECODE_LIMITS); each injected decode-only bug makes the
verdict FAIL at the step and layer it first acts in, with one line naming them."""

import math
import random

import pytest
import torch

from gptoss_fp8.checkpoint.checkpoint import Checkpoint
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.cache import KVCache
from gptoss_fp8.model.gptoss import GptOss
from gptoss_fp8.model.ops import ReferenceOps
from gptoss_fp8.verify.decode import compare_decode
from gptoss_fp8.verify.reference import reference_for
from gptoss_fp8.verify.report import rounding_for, summary_lines
from gptoss_fp8.verify.run import verify_checkpoint
from gptoss_fp8.verify.thresholds import DECODE_LIMITS

HAS_CUDA = torch.cuda.is_available()
MODES = ["weights", "w8a8"]


def _verify(ckpt, ref_src, decode, modes=MODES, device="cpu", tokens=None):
    rounding, exact = rounding_for(ckpt)
    ref = reference_for(ref_src, tokens, device, None if exact else rounding)
    report, _ = verify_checkpoint(ckpt, ref, modes=modes, device=device, decode=decode)
    return report


def _check_passes(report, decode, modes=MODES):
    assert report["decode_steps"] == decode
    for m in modes:
        dec = report[m]["decode"]
        assert dec["passed"] and not dec["failures"], (m, dec["failures"])
        assert len(dec["per_step"]) == decode and dec["first_failing"] is None
        assert dec["prefill_tokens"] == report["tokens"]["count"] - decode
        assert dec["limits"] == DECODE_LIMITS[dec["limits_profile"]]
        assert 0 <= dec["logits_rel_err_max"] <= dec["limits"]["logits"]
        assert set(dec["vs_reference"]) >= {"kl_mean", "top1_agreement"}
    assert report["passed"], {m: report[m]["failures"] for m in modes}


@pytest.fixture(scope="module")
def golden(golden_ckpts):
    return {case: golden_ckpts(case, "default") for case in ("tiny", "odd")}


@pytest.mark.parametrize("case", ["tiny", "odd"])
def test_decode_passes_on_the_golden_checkpoints(golden, case):
    ckpt, ref_file = golden[case]
    report = _verify(ckpt, ref_file, 32)
    _check_passes(report, 32)
    assert report["weights"]["decode"]["logits_rel_err_max"] == 0.0  # bf16 path on CPU: bit-identical here
    lines = summary_lines(report)
    assert sum("decode 32 steps" in line and "PASS" in line for line in lines) == 2, lines


def _unseen_shape(i: int):
    """Random shapes, seeds outside the calibration's (thresholds.DECODE_MEASURED used 9000 + i)."""
    r = random.Random(7100 + i)
    kvh, grp = r.choice([(1, 3), (3, 1), (1, 7), (2, 2), (3, 3), (2, 4), (5, 1)])
    experts = r.choice([4, 6, 8, 12])
    ov = dict(hidden_size=r.choice([96, 160, 224, 288]), intermediate_size=r.choice([96, 160, 224]),
              head_dim=r.choice([16, 32]), num_attention_heads=kvh * grp, num_key_value_heads=kvh,
              num_local_experts=experts, num_experts_per_tok=min(r.choice([1, 2, 3, 4]), experts),
              sliding_window=r.choice([4, 8, 16]), vocab_size=r.choice([257, 311, 503]))
    return r.choice([1, 2, 3]), ov, r.choice([36, 48])


# 1 and 2 under -m slow (kept bf16 attention decodes by default in test_sharded_decode_passes_and_catches_a_bug)
@pytest.mark.parametrize("i", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_decode_passes_on_random_unseen_shapes(tmp_path, i):
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    layers, ov, n = _unseen_shape(i)
    write_synthetic(tmp_path / "src", "tiny", layers=layers, seed=300 + i, layout="hf", **ov)
    convert_checkpoint(tmp_path / "src", tmp_path / "fp8", keep_attention_bf16=bool(i % 2))
    tokens = torch.randint(0, ov["vocab_size"], (n,), generator=torch.Generator().manual_seed(40 + i))
    decode = n - 1 - i  # from a 1-token prefill (the ring fills and wraps during decode) to a longer one
    report = _verify(tmp_path / "fp8", tmp_path / "src", decode, tokens=tokens)
    _check_passes(report, decode)


# ------------------------------------------------------------------------------------------------
# Injected decode-only bugs (in the model and cache code, so they act in every backend)


def _ring_one_short(window):  # a ring of window - 1 rows: the oldest visible key is overwritten
    return window - 1


def _rope_at_zero(self, cache, pos):  # the new token rotated as position 0, not its absolute position
    return cache.cos[pos * 0], cache.sin[pos * 0]


_append = KVCache.append


def _stale_entry(self, i, step, k, v):  # the new K / V never reach the cache: the row keeps what it held
    s = step.slot(self.rows(i), not self.is_ring(i))
    _append(self, i, step, self.k[i][step.seq, s], self.v[i][step.seq, s])


_attention_cached = ReferenceOps.attention_cached


def _sink_in_two_splits(self, q, k_cache, v_cache, lengths, sinks, sm_scale, window):
    """The split-KV pitfall on the spec path: the sink's exp() counted by two splits, emulated as
    one sink of twice its weight (exp(s) + exp(s) = exp(s + ln 2))."""
    return _attention_cached(self, q, k_cache, v_cache, lengths, (sinks.float() + math.log(2)).to(sinks.dtype),
                             sm_scale, window)


BUGS = {
    "ring_off_by_one": (KVCache, "ring_size", staticmethod(_ring_one_short)),
    "rope_position": (GptOss, "_rope_at", _rope_at_zero),
    "stale_cache_entry": (KVCache, "append", _stale_entry),
    "sink_every_split": (ReferenceOps, "attention_cached", _sink_in_two_splits),
}


def _expected_first(ckpt, bug: str, prefill: int) -> tuple[int, int]:
    """(step, layer) a bug first acts at. A ring exists only on sliding layers, and one row short
    it first loses a visible key when the query sees a whole window (position window - 1); the
    other bugs act in every layer from the first decoded token on."""
    cfg = Checkpoint.open(ckpt).config
    if bug == "ring_off_by_one":
        return max(0, cfg.sliding_window - 1 - prefill), cfg.layer_types.index("sliding_attention")
    return 0, 0


# every bug on odd by default (~3 s each); on tiny (2 to 5 times that) under -m slow
@pytest.mark.parametrize("case", [pytest.param("tiny", marks=pytest.mark.slow), "odd"])
@pytest.mark.parametrize("bug", list(BUGS))
def test_injected_decode_bug_fails_at_its_step_and_layer(golden, monkeypatch, case, bug):
    ckpt, ref_file = golden[case]
    # --decode 32 (a prefill longer than the window); the sink from a 1-token prefill, where its
    # share of the softmax is largest (2 keys at step 0), and the ring for odd too (it fills, then
    # loses its first visible key at step window - 2)
    n_tokens = reference_for(ref_file, None).tokens.numel()
    decode = n_tokens - 1 if bug == "sink_every_split" or (case, bug) == ("odd", "ring_off_by_one") else 32
    monkeypatch.setattr(*BUGS[bug])
    report = _verify(ckpt, ref_file, decode)
    assert not report["passed"]
    for m in MODES:
        dec = report[m]["decode"]
        assert not dec["passed"] and not report[m]["passed"], (m, bug)
        step, layer = _expected_first(ckpt, bug, dec["prefill_tokens"])
        pos = dec["prefill_tokens"] + step
        assert dec["first_failing"] == {"step": step, "position": pos, "layer": layer, "part": "attn"}, (
            m, bug, dec["first_failing"], dec["failures"])
        line = dec["failures"][0]
        assert line.startswith(f"decode step {step} (position {pos}) layer {layer} attention: rel. err")
        assert line.endswith("against the full forward") and line in report[m]["failures"]
        assert all(r["passed"] for r in dec["per_step"][:step])
        first = dec["per_step"][step]
        print(f"METRIC decode bug {bug} {case} {m}: step {step} rel. err {first['hidden_rel_err_max']:.3g} "
              f"(added {first['added_max']:.3g}), logits {first['logits_rel_err']:.3g}; limits {dec['limits']}")
        # the forward is untouched by a decode-only bug: its teacher-forced verdict still passes
        assert report[m]["teacher_forced"]["passed"], report[m]["teacher_forced"]["failures"]


def sink_twice_hook(mode, ops):
    """An ops hook (verify.run.resolve_ops_hook, by name in the workers of a sharded run): the sink
    counted twice in every mode's decode attention."""
    real = ops.attention_cached

    def twice(q, k_cache, v_cache, lengths, sinks, sm_scale, window):
        return real(q, k_cache, v_cache, lengths, (sinks.float() + math.log(2)).to(sinks.dtype), sm_scale, window)

    ops.attention_cached = twice
    return ops


def test_sharded_decode_passes_and_catches_a_bug(golden_ckpts, monkeypatch):
    """tp 2 / ep 2 worker processes: each rank's cache holds its kv heads; rank 0 reports."""
    import os
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ckpt, ref_file = golden_ckpts("tiny", "exact", tp=2, ep=2)
    rounding, exact = rounding_for(ckpt)
    ref = reference_for(ref_file, None, rounding=None if exact else rounding)
    report, _ = verify_checkpoint(ckpt, ref, modes=MODES, tp=2, ep=2, decode=32)
    _check_passes(report, 32)
    n = ref.tokens.numel() - 1
    report, _ = verify_checkpoint(ckpt, ref, modes=MODES, tp=2, ep=2, decode=n,
                                  ops_hook="test_verify_decode:sink_twice_hook")
    assert not report["passed"]
    for m in MODES:
        assert report[m]["decode"]["first_failing"] == {"step": 0, "position": 1, "layer": 0, "part": "attn"}
        assert report[m]["teacher_forced"]["passed"]


# ------------------------------------------------------------------------------------------------
# The comparison itself, on made-up captures


def _fake(n_tokens=10, n=4, h=16, e=4, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    fwd_logits = torch.randn(n_tokens, 50, generator=g)
    hidden = {}
    for i in range(layers):
        hidden[f"{i}.attn"] = torch.randn(n_tokens, h, generator=g).bfloat16()
        hidden[f"{i}.mlp"] = torch.randn(n_tokens, h, generator=g).bfloat16()
        hidden[f"{i}.router"] = torch.randn(n_tokens, e, generator=g).bfloat16()
    dec = {"logits": fwd_logits[n_tokens - n - 1:].clone()}
    dec |= {k: v[n_tokens - n:].clone() for k, v in hidden.items()}
    return fwd_logits, hidden, dec


def test_compare_names_the_first_failing_step_and_layer():
    fwd, hidden, dec = _fake(seed=int(torch.randint(0, 1000, (1,))))
    lim = {"logits": 0.05, "hidden": 0.05, "added": 0.05, "router": 0.05}
    assert compare_decode(dec, fwd, hidden, 2, lim, 2)["passed"]
    dec["1.attn"][2] *= 2  # step 2, layer 1's attention (exact in bf16: rel. err 1); later points follow it
    dec["1.mlp"][2] *= 2
    dec["logits"][3] *= 2
    dec["0.mlp"][3] *= 4  # step 3 fails earlier in its step, but step 2 comes first
    sec = compare_decode(dec, fwd, hidden, 2, lim, 2)
    assert not sec["passed"]
    assert sec["first_failing"] == {"step": 2, "position": 8, "layer": 1, "part": "attn"}
    assert sec["failures"][0] == "decode step 2 (position 8) layer 1 attention: rel. err 1 > 0.05 against the full forward"
    assert sec["failures"][1] == "decode: 2 of 4 steps fail (first 2, last 3)"
    assert [s["passed"] for s in sec["per_step"]] == [True, True, False, False]


def test_compare_a_routing_near_tie_is_not_binding_but_a_router_error_fails():
    fwd, hidden, dec = _fake(seed=int(torch.randint(0, 1000, (1,))))
    lim = {"logits": 0.05, "hidden": 0.05, "added": 0.05, "router": 0.05}
    # step 1 (position 7): the forward's experts 1 and 2 nearly tie for the second of top-2
    hidden["0.router"][7] = torch.tensor([3.0, 2.0, 1.99, -1.0]).bfloat16()
    dec["0.router"][1] = torch.tensor([3.0, 1.99, 2.0, -1.0]).bfloat16()  # a bf16-level swap: expert 2 in
    dec["0.mlp"][1] *= 2.0  # its MoE output changes wholesale, and so does all that follows in the step
    dec["1.attn"][1] *= 2.0
    dec["logits"][2] *= 2.0
    sec = compare_decode(dec, fwd, hidden, 2, lim, 2)
    assert sec["passed"], sec["failures"]
    assert sec["per_step"][1]["routing_near_tie"] == 0 and sec["routing_near_ties"] == 1
    assert 0 < sec["per_step"][1]["router_rel_err_max"] < 0.05  # checked up to the router, not past it
    assert sec["per_step"][1]["worst_point"] == {"layer": 0, "part": "attn"}
    # the same swap from router logits that moved far more than noise: the router is named
    dec["0.router"][1] = torch.tensor([3.0, 1.0, 2.5, -1.0]).bfloat16()
    sec = compare_decode(dec, fwd, hidden, 2, lim, 2)
    assert sec["first_failing"] == {"step": 1, "position": 7, "layer": 0, "part": "router"}
    assert sec["failures"][0].startswith("decode step 1 (position 7) layer 0 router logits: rel. err 0.2")
    assert sec["routing_near_ties"] == 0


def test_too_many_decode_steps_is_one_clear_error(golden):
    ckpt, ref_file = golden["odd"]
    for n in (48, 100):
        with pytest.raises(GptOssFp8Error, match=r"--decode .*: give 1 to 47 steps for these 48 tokens"):
            _verify(ckpt, ref_file, n, modes=["weights"])


def test_cli_decode_flag(golden, tmp_path):
    import json

    from typer.testing import CliRunner

    from gptoss_fp8.cli.main import app

    ckpt, ref_file = golden["tiny"]
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["verify-logits", str(ckpt), "--reference", str(ref_file), "--mode", "weights",
                                 "--decode", "8", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "decode 8 steps after a 56-token prefill PASS" in r.output
    rep = json.loads(out.read_text())
    assert rep["decode_steps"] == 8 and rep["weights"]["decode"]["steps"] == 8
    tok = tmp_path / "t.json"
    tok.write_text(json.dumps([1, 2, 3]))
    r = CliRunner().invoke(app, ["verify-logits", str(ckpt), "--reference", str(ref_file), "--tokens", str(tok),
                                 "--decode", "3", "--json", str(tmp_path / "r2.json")])
    assert r.exit_code == 1 and "--decode 3: give 1 to 2 steps for these 3 tokens" in r.output
    assert not (tmp_path / "r2.json").exists()


@pytest.mark.slow
def test_decode_kernels_through_the_interpreter(golden):
    """The kernels mode (its split-KV decode kernel included) through Triton's interpreter on CPU
    (conftest sets TRITON_INTERPRET=1 without a GPU): correct code passes, no op handed to the spec."""
    if HAS_CUDA:
        pytest.skip("the GPU tests below run the kernels for real")
    ckpt, ref_file = golden["odd"]
    report = _verify(ckpt, ref_file, 32, modes=["w8a8", "kernels"])
    _check_passes(report, 32, ["w8a8", "kernels"])
    assert report["kernels"]["decode"]["limits_profile"] == "kernels-interpreter"
    assert not any(report["kernels"]["decode"]["spec_fallbacks"].values())


# ------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): OpenAI's model and ours on the H200, every mode


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["tiny", "odd"])
def test_decode_passes_on_cuda(golden, case):
    ckpt, ref_file = golden[case]
    src = ckpt.parent / "src"
    tokens = reference_for(ref_file, None).tokens
    modes = ["weights", "w8a8", "kernels"]
    report = _verify(ckpt, src, 32, modes=modes, device="cuda", tokens=tokens)
    for m in modes:
        d = report[m]["decode"]
        print(f"METRIC decode cuda {case} {m}: logits {d['logits_rel_err_max']:.3g} layers {d['hidden_rel_err_max']:.3g} "
              f"near-ties {d['routing_near_ties']} fallbacks {d.get('spec_fallbacks')}")
    _check_passes(report, 32, modes)


@pytest.mark.gpu
@pytest.mark.parametrize("bug", list(BUGS))
def test_injected_decode_bug_fails_on_cuda(golden, monkeypatch, bug):
    from gptoss_fp8.model.triton_ops import TritonOps

    ckpt, ref_file = golden["tiny"]
    monkeypatch.setattr(*BUGS[bug])
    if bug == "sink_every_split":  # the kernels' own decode attention too
        real = TritonOps.attention_cached

        def twice(self, q, k_cache, v_cache, lengths, sinks, sm_scale, window):
            return real(self, q, k_cache, v_cache, lengths, (sinks.float() + math.log(2)).to(sinks.dtype),
                        sm_scale, window)

        monkeypatch.setattr(TritonOps, "attention_cached", twice)
    if bug == "stale_cache_entry":  # the kernels' fused rotate-and-store too (it writes the cache itself)
        real_append = TritonOps.rope_append

        def stale(self, q, k, v, cos, sin, cache, i, step):
            s = step.slot(cache.rows(i), not cache.is_ring(i))
            old = cache.k[i][step.seq, s].clone(), cache.v[i][step.seq, s].clone()
            q = real_append(self, q, k, v, cos, sin, cache, i, step)
            cache.k[i][step.seq, s], cache.v[i][step.seq, s] = old
            return q

        monkeypatch.setattr(TritonOps, "rope_append", stale)
    tokens = reference_for(ref_file, None).tokens
    decode = tokens.numel() - 1 if bug == "sink_every_split" else 32  # as on the CPU (the sink weighs most there)
    modes = ["weights", "w8a8", "kernels"]
    report = _verify(ckpt, ckpt.parent / "src", decode, modes=modes, device="cuda", tokens=tokens)
    assert not report["passed"]
    for m in modes:
        dec = report[m]["decode"]
        step, layer = _expected_first(ckpt, bug, dec["prefill_tokens"])
        first = dec["per_step"][step]
        print(f"METRIC decode cuda bug {bug} {m}: step {step} rel. err {first['hidden_rel_err_max']} "
              f"added {first['added_max']}, limits {dec['limits']}")
        assert dec["first_failing"] == {"step": step, "position": dec["prefill_tokens"] + step, "layer": layer,
                                        "part": "attn"}, (m, dec["failures"])

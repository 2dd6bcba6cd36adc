"""The FP8 forward pass: ops against float64 / OpenAI's reference, loading, shapes."""

import hashlib
import json
import math

import pytest
import torch

from gptoss_fp8.convert.convert import convert_checkpoint
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.model.load import load_model
from gptoss_fp8.model.ops import ReferenceOps, W8A8CpuOps
from gptoss_fp8.quant.fp8 import dequantize_act, dequantize_weight_blocks, quantize_act, quantize_weight_blocks
from gptoss_fp8.spec import rope_cos_sin, swiglu

ref_model = pytest.importorskip("gpt_oss.torch.model", reason="OpenAI's reference: pip install --no-deps gpt-oss==0.0.9")

from gptoss_fp8.verify.metrics import logit_metrics  # noqa: E402
from gptoss_fp8.verify.reference import load_reference_model, run_reference_model  # noqa: E402

BF16_ULP = 2.0**-8  # relative spacing of bf16 values (8 significant bits)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# w8a8 CPU path against float64 of the same math


def _f64_block_gemm(x, w, s_w, bias):
    """float64: quantize x per token (1x128) exactly as the spec, dequantize both, matmul, + bias."""
    xq, xs = quantize_act(x)
    xd = dequantize_act(xq, xs).double()
    wd = dequantize_weight_blocks(w, s_w, torch.float64)
    y = xd @ wd.t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("t,k,n", [(7, 200, 150), (33, 384, 96), (1, 64, 300)])
def test_w8a8_linear_matches_float64(t, k, n):
    g = _gen(t * 1000 + k)
    x = (torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4).to(torch.bfloat16)
    w, s = quantize_weight_blocks(torch.randn(n, k, generator=g) / math.sqrt(k))
    b = (0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)
    got = W8A8CpuOps().linear(x, w, s, b)
    assert got.dtype == torch.bfloat16 and got.shape == (t, n)
    want = _f64_block_gemm(x, w, s, b)
    # fp32 accumulation vs float64, then one bf16 rounding: within one bf16 ulp of the value
    # plus fp32 accumulation noise relative to the sum of |terms|.
    scale = (dequantize_act(*quantize_act(x)).double().abs() @ dequantize_weight_blocks(w, s, torch.float64).abs().t())
    tol = BF16_ULP * want.abs() + 1e-5 * scale + 1e-30
    assert ((got.double() - want).abs() <= tol).all(), float(((got.double() - want).abs() - tol).max())


def test_w8a8_expert_ffn_matches_float64():
    g = _gen(5)
    tkn, h, i, e, k = 19, 160, 96, 4, 2
    x = torch.randn(tkn, h, generator=g).to(torch.bfloat16)
    gu, gus = quantize_weight_blocks(torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h))
    dn, dns = quantize_weight_blocks(torch.randn(e, h, i, generator=g) / math.sqrt(i))
    gub = (0.1 * torch.randn(e, 2 * i, generator=g)).to(torch.bfloat16)
    dnb = (0.1 * torch.randn(e, h, generator=g)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tkn)])
    ex = dict(gate_up_proj=gu, gate_up_proj_scale_inv=gus, gate_up_proj_bias=gub,
              down_proj=dn, down_proj_scale_inv=dns, down_proj_bias=dnb)
    got, none = W8A8CpuOps().expert_ffn(x, idx, ex, 0, 7.0)  # [T, k, H] f32 of bf16 values
    assert none is None
    for tt in range(tkn):
        for j in range(k):
            ee = int(idx[tt, j])
            # spec: gate_up accumulator + bias and SwiGLU in fp32 (as the fused MoE kernel), then FP8
            h1 = _f64_block_gemm(x[tt:tt + 1], gu[ee], gus[ee], gub[ee]).float()
            a = swiglu(h1, 7.0)
            want = _f64_block_gemm(a, dn[ee], dns[ee], dnb[ee])
            err = (got[tt, j].double() - want[0]).abs()
            # fp32 accumulation order may move an fp8 rounding of the activation; output is bf16
            assert err.max() <= 4 * BF16_ULP * want.abs().max() + 1e-6, (tt, j, float(err.max()))


def test_weights_mode_is_dequantized_bf16_linear():
    g = _gen(9)
    x = torch.randn(5, 300, generator=g).to(torch.bfloat16)
    w, s = quantize_weight_blocks(torch.randn(70, 300, generator=g))
    b = torch.randn(70, generator=g).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, dequantize_weight_blocks(w, s, torch.bfloat16), b)
    assert torch.equal(ReferenceOps().linear(x, w, s, b), want)


# ------------------------------------------------------------------------------------------------
# ops against OpenAI's functions on fresh random inputs (same op order: bit-identical)


@pytest.mark.parametrize("window", [0, 5])
def test_attention_matches_reference_sdpa(window):
    g = _gen(window + 1)
    n, kv, m, d = 23, 2, 3, 16
    q = torch.randn(n, kv, m, d, generator=g).to(torch.bfloat16)
    k = torch.randn(n, kv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(n, kv, d, generator=g).to(torch.bfloat16)
    s = torch.randn(kv * m, generator=g).to(torch.bfloat16)
    want = ref_model.sdpa(q, k, v, s, 0.25, window)
    assert torch.equal(ReferenceOps().attention(q, k, v, s, 0.25, window), want)


@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_rope_matches_reference(head_dim):
    from gptoss_fp8.config import GptOssConfig

    cfg = GptOssConfig(num_hidden_layers=1, num_local_experts=2, num_experts_per_tok=1, hidden_size=64,
                       intermediate_size=64, head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2, vocab_size=10)
    n = 37
    r = ref_model.RotaryEmbedding(head_dim, cfg.rope_theta, torch.float32, initial_context_length=4096,
                                  scaling_factor=32.0, ntk_alpha=1.0, ntk_beta=32.0)
    cos_r, sin_r = r._compute_cos_sin(n)
    cos, sin = rope_cos_sin(cfg, n)
    assert torch.equal(cos, cos_r) and torch.equal(sin, sin_r)
    g = _gen(head_dim)
    q = torch.randn(n, 4 * head_dim, generator=g).to(torch.bfloat16)
    kk = torch.randn(n, 2 * head_dim, generator=g).to(torch.bfloat16)
    qr, kr = r(q, kk)
    ops = ReferenceOps()
    assert torch.equal(ops.rope(q.view(n, 4, head_dim), cos, sin).reshape(n, -1), qr)
    assert torch.equal(ops.rope(kk.view(n, 2, head_dim), cos, sin).reshape(n, -1), kr)


def test_swiglu_matches_reference():
    x = (torch.randn(11, 64, generator=_gen(3)) * 6).to(torch.bfloat16)
    assert torch.equal(swiglu(x, 7.0), ref_model.swiglu(x, limit=7.0))


# ------------------------------------------------------------------------------------------------
# Whole model against OpenAI's reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    cfg = write_synthetic(root / "src", "tiny", seed=11, layout="both")
    convert_checkpoint(root / "src", root / "exact", keep_attention_bf16=True)
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=_gen(4))
    ref = run_reference_model(load_reference_model(root / "src"), tokens)
    return root, cfg, tokens, ref


def test_reference_hf_mapping_equals_original_layout(tiny):
    root, _, tokens, ref = tiny
    orig = run_reference_model(load_reference_model(root / "src" / "original"), tokens)
    assert torch.equal(orig.logits, ref.logits)
    assert ref.hidden.keys() == orig.hidden.keys() and len(ref.hidden) == 6  # attn, mlp, router x 2 layers
    assert all(torch.equal(ref.hidden[k], orig.hidden[k]) for k in ref.hidden)


def test_reference_token_chunking_is_exact(tiny, monkeypatch):
    import gptoss_fp8.verify.reference as R

    root, _, tokens, ref = tiny
    monkeypatch.setattr(R, "MLP_CHUNK_BYTES", 1)  # one token per MLP call
    chunked = run_reference_model(load_reference_model(root / "src"), tokens)
    assert torch.equal(chunked.logits, ref.logits)


def test_weights_mode_agrees_with_reference_on_exact_conversion(tiny):
    root, _, tokens, ref = tiny
    cap = {}
    logits = load_model(root / "exact")(tokens, get_ops("weights"), cap).float()
    s = logit_metrics(ref.logits, logits)["summary"]
    # bf16 noise at most (on CPU the op order is OpenAI's, so it is in fact bit-identical)
    assert s["top1_agreement"] == 1.0
    assert s["kl_mean"] <= 1e-4 and s["max_abs_delta"] <= 0.05, s
    assert {k for k in cap if not k.endswith((".ids", ".weights"))} == set(ref.hidden)  # + our routing
    for k in ref.hidden:
        assert (cap[k].float() - ref.hidden[k].float()).norm() <= 1e-2 * ref.hidden[k].float().norm(), k


def test_w8a8_mode_is_close_but_not_identical(tiny):
    root, _, tokens, ref = tiny
    logits = load_model(root / "exact")(tokens, get_ops("w8a8")).float()
    s = logit_metrics(ref.logits, logits)["summary"]
    assert 0 < s["kl_mean"] <= 0.05 and s["top1_agreement"] >= 0.85, s


@pytest.mark.parametrize("mode", ["weights", "w8a8"])
def test_moe_part_is_the_forwards_moe_and_runs_on_forced_routing(tiny, mode):
    """``moe_part`` on the forward's own stream after attention reproduces the forward's MoE block
    (norm, router, experts, combine, residual add) and returns our router logits and our own
    top-k choice and combine weights; forced (ids, weights) are what the experts and the combine
    use, while the router outputs stay ours."""
    from gptoss_fp8.verify.parts import target_routing

    root, cfg, tokens, _ = tiny
    model, ops = load_model(root / "exact"), get_ops(mode)
    cap = {}
    model(tokens, ops, cap)
    k = cfg.num_experts_per_tok
    for i in range(cfg.num_hidden_layers):
        x = cap[f"{i}.attn"]
        own = model.moe_part(i, x, ops)
        assert set(own) == {"out", "router", "ids", "weights"}
        assert own["out"].dtype == torch.bfloat16 and own["out"].shape == x.shape
        assert own["router"].shape == (tokens.numel(), cfg.num_local_experts) and own["ids"].shape == (tokens.numel(), k)
        assert torch.equal(own["out"], cap[f"{i}.mlp"]) and torch.equal(own["router"], cap[f"{i}.router"]), i
        # our choice and weights: the top-k of our router logits and a softmax over those k
        ids, w = target_routing(own["router"], k)
        assert torch.equal(own["ids"].sort(-1).values, ids.sort(-1).values)
        assert torch.allclose(own["weights"].float().sort(-1).values, w.float().sort(-1).values, rtol=2**-7, atol=0)
        # forcing our own routing changes nothing
        forced = model.moe_part(i, x, ops, routing=(own["ids"], own["weights"]))
        assert torch.equal(forced["out"], own["out"]), i
        # other experts: the output moves; our router, choice and weights are reported unchanged
        other = (own["ids"] + 1) % cfg.num_local_experts
        moved = model.moe_part(i, x, ops, routing=(other, own["weights"]))
        assert not torch.equal(moved["out"], own["out"])
        assert all(torch.equal(moved[key], own[key]) for key in ("router", "ids", "weights"))
        # weights halved: the block adds half as much (bf16 rounding of the sum aside)
        half = model.moe_part(i, x, ops, routing=(own["ids"], (own["weights"].float() / 2).bfloat16()))
        d_own, d_half = own["out"].double() - x.double(), half["out"].double() - x.double()
        assert (d_half - d_own / 2).norm() <= 0.02 * d_own.norm(), i


@pytest.mark.parametrize("layers,overrides", [
    (1, dict(hidden_size=96, intermediate_size=288, num_local_experts=3, num_experts_per_tok=1)),
    (3, dict(hidden_size=416, intermediate_size=64, num_local_experts=5, head_dim=8)),
])
def test_other_shapes(tmp_path, layers, overrides):
    cfg = write_synthetic(tmp_path / "src", "tiny", seed=3, layers=layers, layout="hf", **overrides)
    convert_checkpoint(tmp_path / "src", tmp_path / "exact", keep_attention_bf16=True)
    convert_checkpoint(tmp_path / "src", tmp_path / "fp8")
    tokens = torch.randint(0, cfg.vocab_size, (33,), generator=_gen(layers))
    ref = run_reference_model(load_reference_model(tmp_path / "src"), tokens)
    exact = logit_metrics(ref.logits, load_model(tmp_path / "exact")(tokens, get_ops("weights")))["summary"]
    assert exact["top1_agreement"] == 1.0 and exact["kl_mean"] <= 1e-4, exact
    for mode in ("weights", "w8a8"):
        s = logit_metrics(ref.logits, load_model(tmp_path / "fp8")(tokens, get_ops(mode)))["summary"]
        assert s["kl_mean"] <= 0.2 and s["top1_agreement"] >= 0.7, (mode, s)


# ------------------------------------------------------------------------------------------------
# Loading errors


def _drop(ckpt, name):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    f = ckpt / idx["weight_map"].pop(name)
    with safe_open(str(f), "pt") as sf:
        meta = sf.metadata()
    t = load_file(str(f))
    del t[name]
    save_file(t, str(f), metadata=meta)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))
    # As a buggy converter would: a manifest that agrees with the files, so the model's own check
    # (not the integrity check of layout.json) reports the missing tensor.
    layout = json.loads((ckpt / "layout.json").read_text())
    rel = str(f.relative_to(ckpt))
    for rank in layout["ranks"]:
        rank["tensors"].pop(name, None)
        if rel in rank["files"]:
            rank["files"][rel] = {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (ckpt / "layout.json").write_text(json.dumps(layout))


def test_missing_tensor_names_tensor_and_layer(tiny, tmp_path):
    import shutil

    root = tiny[0]
    d = tmp_path / "ck"
    shutil.copytree(root / "exact", d)
    _drop(d, "model.layers.1.self_attn.sinks")
    with pytest.raises(GptOssFp8Error, match=r"model\.layers\.1\.self_attn\.sinks is missing \(layer 1\)"):
        load_model(d)


def test_config_mismatch_is_a_user_error(tiny, tmp_path):
    import shutil

    root = tiny[0]
    d = tmp_path / "ck"
    shutil.copytree(root / "exact", d)
    c = json.loads((d / "config.json").read_text())
    c["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(GptOssFp8Error, match="gate_up_proj has shape"):
        load_model(d)

"""gptoss_fp8/spec.py, the one plain-torch specification of each op, against independent small
computations (explicit loops, float64 formulas, OpenAI's own functions) and invariants, on fresh
random inputs."""

import math

import pytest
import torch

from gptoss_fp8 import spec
from gptoss_fp8.config import GptOssConfig
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.fp8 import dequantize_act, dequantize_weight_blocks, quantize_act, quantize_weight_blocks

BF16_ULP = 2.0**-8


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _ref_model():
    try:
        import gpt_oss.torch.model as m
    except ImportError:
        return None
    return m


# ------------------------------------------------------------------------------------------------
# Norms


def test_rms_norm_against_float64():
    g = _gen(1)
    x = (torch.randn(9, 200, generator=g) * 3 + 0.5).bfloat16()
    w = torch.rand(200, generator=g) + 0.5
    want = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    got = spec.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert ((got.double() - want).abs() <= BF16_ULP * want.abs() + 1e-6).all()
    # the normed rows have unit RMS before the scale
    assert torch.allclose((got.double() / w.double()).pow(2).mean(-1), torch.ones(9, dtype=torch.float64), rtol=2e-2)


def test_add_rms_norm_rounds_the_sum_once_then_norms_it():
    g = _gen(2)
    x = torch.randn(7, 96, generator=g).bfloat16()
    delta = torch.randn(7, 96, generator=g) * 0.37  # float32: an all-reduced partial sum
    w = torch.rand(96, generator=g) + 0.5
    xo, y = spec.add_rms_norm(x, delta, w, 1e-6)
    assert xo.dtype == torch.bfloat16
    assert torch.equal(xo, (x.float() + delta.bfloat16().float()).bfloat16())
    assert torch.equal(y, spec.rms_norm(xo, w, 1e-6))


# ------------------------------------------------------------------------------------------------
# SwiGLU


def test_swiglu_against_the_formula_element_by_element():
    g = _gen(3)
    limit, alpha = 3.0, spec.SWIGLU_ALPHA
    h = torch.randn(5, 24, generator=g, dtype=torch.float64) * 5  # many values beyond the limit
    assert (h.abs() > limit).any()
    got = spec.swiglu(h, limit)
    assert got.shape == (5, 12)
    for t in range(5):
        for j in range(12):
            gate, lin = float(h[t, 2 * j]), float(h[t, 2 * j + 1])
            gate = min(gate, limit)
            lin = max(-limit, min(lin, limit))
            want = gate / (1 + math.exp(-alpha * gate)) * (lin + 1)
            assert abs(float(got[t, j]) - want) <= 1e-12 * max(1.0, abs(want)), (t, j)


def test_swiglu_matches_openai():
    m = _ref_model()
    if m is None:
        pytest.skip("OpenAI's reference not installed")
    x = (torch.randn(11, 64, generator=_gen(4)) * 6).bfloat16()
    assert torch.equal(spec.swiglu(x, 7.0), m.swiglu(x, limit=7.0))


# ------------------------------------------------------------------------------------------------
# Routing


def test_select_experts_invariants():
    g = _gen(5)
    logits = (torch.randn(50, 16, generator=g) * 2).bfloat16()
    ids, w = spec.select_experts(logits, 4)
    assert ids.dtype == torch.int64 and w.dtype == torch.bfloat16 and ids.shape == w.shape == (50, 4)
    picked = logits.gather(1, ids)
    assert (picked[:, :-1] >= picked[:, 1:]).all()  # sorted by logit, descending
    rest = logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True), -float("inf"))
    assert (rest.max(1).values <= picked[:, -1]).all()  # no unselected expert beats a selected one
    assert (ids.sort(1).values.diff(dim=1) > 0).all()  # k distinct experts
    assert ((w.float().sum(1) - 1).abs() <= 4 * BF16_ULP).all()
    p = picked.double().exp()
    assert ((w.double() - p / p.sum(1, keepdim=True)).abs() <= BF16_ULP).all()


def test_route_is_the_bf16_linear_then_selection():
    g = _gen(6)
    x, wr, br = (torch.randn(13, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16(),
                 torch.randn(8, generator=g).bfloat16())
    logits, ids, w = spec.route(x, wr, br, 3)
    want = x.double() @ wr.double().t() + br.double()
    assert logits.dtype == torch.bfloat16 and ((logits.double() - want).abs() <= 2 * BF16_ULP * want.abs() + 1e-2).all()
    i2, w2 = spec.select_experts(logits, 3)
    assert torch.equal(ids, i2) and torch.equal(w, w2)


# ------------------------------------------------------------------------------------------------
# YaRN rotary embedding


@pytest.mark.parametrize("head_dim,factor", [(64, 32.0), (16, 32.0), (64, 1.0)])
def test_yarn_tables_match_openai(head_dim, factor):
    m = _ref_model()
    if m is None:
        pytest.skip("OpenAI's reference not installed")
    r = m.RotaryEmbedding(head_dim, 150000, torch.float32, initial_context_length=4096,
                          scaling_factor=factor, ntk_alpha=1.0, ntk_beta=32.0)
    conc_r, inv_r = r._compute_concentration_and_inv_freq()
    conc, inv = spec.yarn_inv_freq(head_dim, scaling_factor=factor)
    assert conc == conc_r and torch.equal(inv, inv_r)
    cos_r, sin_r = r._compute_cos_sin(300)
    cos, sin = spec.rope_table(300, head_dim, scaling_factor=factor)
    assert torch.equal(cos, cos_r) and torch.equal(sin, sin_r)


def test_yarn_by_the_formula():
    """inv_freq: 1/base^(2j/D) above the ramp, divided by the factor below it; concentration folded in."""
    conc, inv = spec.yarn_inv_freq(64, base=150000.0, scaling_factor=32.0)
    assert conc == pytest.approx(0.1 * math.log(32) + 1)
    plain = 1.0 / 150000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(inv[:4].double(), plain[:4], rtol=1e-6)  # fast dims extrapolate
    assert torch.allclose(inv[-4:].double(), plain[-4:] / 32, rtol=1e-6)  # slow dims interpolate
    cos, sin = spec.rope_table(50, 64)
    t = torch.arange(50, dtype=torch.float64)[:, None]
    assert torch.allclose(cos.double(), conc * torch.cos(t * inv.double()), atol=1e-5)
    assert torch.allclose(cos.double() ** 2 + sin.double() ** 2, torch.full((50, 32), conc**2, dtype=torch.float64), rtol=1e-5)


def test_rope_cos_sin_of_a_config():
    cfg = GptOssConfig(num_hidden_layers=1, num_local_experts=2, num_experts_per_tok=1, hidden_size=64,
                       intermediate_size=64, head_dim=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=10,
                       rope_theta=10000.0, rope_scaling={"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0,
                                                         "original_max_position_embeddings": 2048})
    p = spec.yarn_params(cfg)
    assert p == dict(head_dim=32, base=10000.0, scaling_factor=8.0, initial_context_length=2048, ntk_alpha=2.0, ntk_beta=16.0)
    cos, sin = spec.rope_cos_sin(cfg, 20)
    c2, s2 = spec.rope_table(20, 32, base=10000.0, scaling_factor=8.0, initial_context_length=2048, ntk_alpha=2.0, ntk_beta=16.0)
    assert torch.equal(cos, c2) and torch.equal(sin, s2) and cos.shape == (20, 16)
    with pytest.raises(GptOssFp8Error, match="YaRN ramp bounds"):
        spec.yarn_inv_freq(4)  # head_dim too small for the ramp


def test_apply_rope_is_a_complex_rotation_per_half():
    g = _gen(7)
    cos, sin = spec.rope_table(64, 16)
    pos = torch.randint(0, 64, (10,), generator=g)
    x = torch.randn(10, 3, 16, generator=g)
    got = spec.apply_rope(x, cos, sin, pos, dtype=torch.float32)
    z = torch.complex(x[..., :8].double(), x[..., 8:].double()) * torch.complex(cos[pos].double(), sin[pos].double())[:, None, :]
    want = torch.cat([z.real, z.imag], dim=-1)
    assert torch.allclose(got.double(), want, atol=1e-5)
    # positions pick rows: the same as passing those rows
    assert torch.equal(got, spec.apply_rope(x, cos[pos], sin[pos], dtype=torch.float32))


def test_apply_rope_bf16_matches_openai():
    m = _ref_model()
    if m is None:
        pytest.skip("OpenAI's reference not installed")
    cos, sin = spec.rope_table(21, 32)
    x = torch.randn(21, 4, 32, generator=_gen(8)).bfloat16()
    assert torch.equal(spec.apply_rope(x, cos, sin), m._apply_rotary_emb(x, cos, sin))


# ------------------------------------------------------------------------------------------------
# Attention


def _attention_loop(q, k, v, sinks, sm_scale, window, q_offset):
    """One query, one head at a time, float64."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    for h in range(hq):
        kvh = h // (hq // hkv)
        for t in range(tq):
            i = t + q_offset
            keys = [j for j in range(tk) if j <= i and (window == 0 or j > i - window)]
            s = [float(q[t, h].double() @ k[j, kvh].double()) * sm_scale for j in keys]
            mx = max(s + [float(sinks[h])])
            e = [math.exp(x - mx) for x in s]
            z = sum(e) + math.exp(float(sinks[h]) - mx)
            for j, ej in zip(keys, e, strict=True):
                out[t, h] += ej / z * v[j, kvh].double()
    return out


@pytest.mark.parametrize("window,q_offset", [(0, 0), (4, 0), (0, 5), (3, 5)])
def test_attention_against_a_loop(window, q_offset):
    g = _gen(10 + window + q_offset)
    tk, hq, hkv, d = 12, 4, 2, 8
    q = torch.randn(tk - q_offset, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64)
    want = _attention_loop(q, k, v, sinks, 0.4, window, q_offset)
    got = spec.attention(q, k, v, sinks, 0.4, window, q_offset)
    assert got.shape == q.shape and torch.allclose(got, want, atol=1e-12)
    # bf16 inputs computed in fp32 (the kernels' reference), returned as bf16
    got32 = spec.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks.bfloat16(), 0.4, window, q_offset,
                           dtype=torch.float32)
    want_b = _attention_loop(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks.bfloat16(), 0.4, window, q_offset)
    assert got32.dtype == torch.bfloat16 and torch.allclose(got32.double(), want_b, atol=2e-2)


def test_attention_bf16_matches_openai_sdpa():
    m = _ref_model()
    if m is None:
        pytest.skip("OpenAI's reference not installed")
    g = _gen(11)
    n, kv, mult, d = 17, 2, 2, 16
    q = torch.randn(n, kv, mult, d, generator=g).bfloat16()
    k, v = (torch.randn(n, kv, d, generator=g).bfloat16() for _ in range(2))
    s = torch.randn(kv * mult, generator=g).bfloat16()
    for window in (0, 6):
        got = spec.attention(q.reshape(n, kv * mult, d), k, v, s, 0.25, window).reshape(n, -1)
        assert torch.equal(got, m.sdpa(q, k, v, s, 0.25, window))


def test_attention_varlen_keeps_sequences_apart():
    g = _gen(12)
    q, k, v = (torch.randn(10, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 3, 3, 10])
    got = spec.attention_varlen(q, k, v, sinks, cu, window=2)
    assert torch.allclose(got[:3], _attention_loop(q[:3], k[:3], v[:3], sinks, 1 / math.sqrt(8), 2, 0), atol=1e-12)
    assert torch.allclose(got[3:], _attention_loop(q[3:], k[3:], v[3:], sinks, 1 / math.sqrt(8), 2, 0), atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Experts


def _experts(e, h, i, seed):
    g = _gen(seed)
    w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h))
    w2, s2 = quantize_weight_blocks(torch.randn(e, h, i, generator=g) / math.sqrt(i))
    b13 = (0.3 * torch.randn(e, 2 * i, generator=g)).bfloat16()
    b2 = (0.1 * torch.randn(e, h, generator=g)).bfloat16()
    return w13, s13, b13, w2, s2, b2


def _slot_w8a8(x_row, e, w13, s13, b13, w2, s2, b2, limit):
    """One (token, slot) by the written conventions, float64 after each quantization."""
    xq = dequantize_act(*quantize_act(x_row[None])).double()
    h = (xq @ dequantize_weight_blocks(w13[e], s13[e], torch.float64).t() + b13[e].double()).float()
    a = dequantize_act(*quantize_act(spec.swiglu(h, limit))).double()
    return a @ dequantize_weight_blocks(w2[e], s2[e], torch.float64).t() + b2[e].double()


def test_moe_experts_w8a8_slot_by_slot_and_foreign_slots_zero():
    t, h, i, e, k = 11, 160, 136, 6, 2
    w13, s13, b13, w2, s2, b2 = _experts(e, h, i, 13)
    g = _gen(14)
    x = (torch.randn(t, h, generator=g) * 2).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    # this rank holds experts 2..4 only
    ex = tuple(a[2:5] for a in (w13, s13, b13, w2, s2, b2))
    y, b = spec.moe_experts_w8a8(x, ids, *ex, expert_start=2, limit=5.0)
    assert b is None and y.dtype == torch.float32 and y.shape == (t, k, h)
    assert torch.equal(y, y.bfloat16().float())  # bf16 values
    for tt in range(t):
        for j in range(k):
            ee = int(ids[tt, j])
            if not 2 <= ee < 5:
                assert (y[tt, j] == 0).all()
                continue
            want = _slot_w8a8(x[tt], ee, w13, s13, b13, w2, s2, b2, 5.0)[0]
            assert ((y[tt, j].double() - want).abs() <= 4 * BF16_ULP * want.abs().max() + 1e-6).all(), (tt, j)
    assert (y != 0).any()


def test_moe_experts_w8a8_split_intermediate_sums_to_whole():
    """Two ranks holding 128-column halves of every expert's intermediate: the fp32 partial
    products summed, plus the bias once, give the whole experts' output (to fp32 order + one bf16 rounding)."""
    t, h, i, e, k = 9, 128, 256, 3, 2
    w13, s13, b13, w2, s2, b2 = _experts(e, h, i, 15)
    g = _gen(16)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    whole, _ = spec.moe_experts_w8a8(x, ids, w13, s13, b13, w2, s2, b2)
    parts = []
    for r in range(2):
        rows = slice(2 * 128 * r, 2 * 128 * (r + 1))  # interleaved gate/up rows of this half
        parts.append(spec.moe_experts_w8a8(x, ids, w13[:, rows], s13[:, 2 * r:2 * r + 2], b13[:, rows],
                                           w2[:, :, 128 * r:128 * (r + 1)], s2[:, :, r:r + 1], b2 if r == 0 else None,
                                           partial=True))
    y = parts[0][0] + parts[1][0]
    bias = parts[0][1] + parts[1][1]
    assert (parts[1][1] == 0).all() and (parts[0][1] != 0).any()
    combined = (y + bias).bfloat16().float()
    assert ((combined - whole).abs() <= 2 * BF16_ULP * whole.abs() + 1e-5).all()


def test_moe_w8a8_is_the_weighted_sum_of_the_slots():
    t, h, i, e, k = 8, 128, 128, 4, 3
    ex = _experts(e, h, i, 17)
    g = _gen(18)
    x = torch.randn(t, h, generator=g).bfloat16()
    wr = torch.randn(e, h, generator=g).bfloat16()
    _, ids, w = spec.route(x, wr, None, k)
    y, _ = spec.moe_experts_w8a8(x, ids, *ex)
    got = spec.moe_w8a8(x, w, ids, *ex)
    want = (y.double() * w.double()[..., None]).sum(1)
    assert got.dtype == torch.bfloat16 and ((got.double() - want).abs() <= BF16_ULP * want.abs() + 1e-6).all()


def test_moe_experts_bf16_against_float64():
    t, h, i, e, k = 7, 96, 64, 3, 2
    w13, s13, b13, w2, s2, b2 = _experts(e, h, i, 19)
    g = _gen(20)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    y, b = spec.moe_experts_bf16(x, ids, w13, s13, b13, w2, s2, b2, limit=7.0)
    assert b is None
    for tt in range(t):
        for j in range(k):
            ee = int(ids[tt, j])
            w13d = dequantize_weight_blocks(w13[ee], s13[ee], torch.bfloat16).double()
            w2d = dequantize_weight_blocks(w2[ee], s2[ee], torch.bfloat16).double()
            hh = x[tt].double() @ w13d.t() + b13[ee].double()
            want = spec.swiglu(hh, 7.0) @ w2d.t() + b2[ee].double()
            # bf16 rounding of each GEMM, bias add and the SwiGLU: a few bf16 ulps of the output scale
            assert ((y[tt, j].double() - want).abs() <= 8 * BF16_ULP * want.abs().max()).all(), (tt, j)


# --- FP8 attention (spec.attention_fp8) -----------------------------------------------------------
# Measured on these random inputs (unit-normal q, k, v; sinks in [-10, 10]): the FP8 spec's output
# is 4.7-6.0% (relative, Frobenius) from fp32 attention, bf16 attention 0.4%. Per entry e4m3 keeps
# 3 mantissa bits (relative rounding error <= 2^-4, ~2% RMS), and Q, K, V and P are each rounded
# once; 8% is that bound with a margin. One that dropped a scale or the sink is off by O(1).


def _fp8_case(t, hq, hkv, seed, d=64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, d, generator=g).bfloat16() for h in (hq, hkv, hkv))
    sinks = (torch.rand(hq, generator=g) * 20 - 10).bfloat16()
    return q, k, v, sinks


@pytest.mark.parametrize("t,hq,hkv,window,q_offset", [(200, 8, 2, 0, 0), (300, 4, 1, 128, 0), (64, 2, 2, 0, 0),
                                                      (130, 8, 1, 32, 0), (40, 4, 2, 0, 90)])
def test_attention_fp8_near_attention(t, hq, hkv, window, q_offset):
    q, k, v, sinks = _fp8_case(t + q_offset, hq, hkv, t + window + q_offset)
    q = q[q_offset:]
    exact = spec.attention(q, k, v, sinks, None, window, q_offset, dtype=torch.float32).float()
    out = spec.attention_fp8(q, k, v, sinks, None, window, q_offset)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    rel = ((out.float() - exact).norm() / exact.norm()).item()
    assert 5e-3 < rel <= 8e-2, f"fp8 attention rel error {rel:.3e}"  # rounded (not bf16-exact), within the e4m3 bound


def test_attention_fp8_rounds_p():
    """P goes through e4m3: with Q, K, V exactly on the e4m3 grid (one block scale of 1), the only
    roundings left are P's and the fp32 sums; the result then differs from fp32 attention on the
    same values, by no more than P's 2^-4 relative step."""
    g = torch.Generator().manual_seed(3)
    t, h = 100, 2
    grid = lambda *s: (torch.randn(*s, generator=g) * 8).to(torch.float8_e4m3fn).float()  # noqa: E731
    q, k, v = grid(t, h, 64), grid(t, h, 64), grid(t, h, 64)
    for x in (q, k, v):  # pin each block's amax to 448 so every scale is exactly 1
        x[::64, :, 0] = 448.0
    sinks = torch.zeros(h)
    exact = spec.attention(q, k, v, sinks, 0.01, dtype=torch.float32)
    out = spec.attention_fp8(q, k, v, sinks, 0.01)
    rel = ((out - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 2 ** -4, rel


def test_attention_fp8_varlen_keeps_sequences_apart():
    """Each sequence attends within itself; a ragged batch of one sequence equals attention_fp8."""
    q, k, v, sinks = _fp8_case(150, 4, 2, 11)
    one = spec.attention_fp8_varlen(q, k, v, sinks, torch.tensor([0, 150], dtype=torch.int32))
    assert torch.equal(one, spec.attention_fp8(q, k, v, sinks))
    cu = torch.tensor([0, 50, 150], dtype=torch.int32)
    out = spec.attention_fp8_varlen(q, k, v, sinks, cu)
    exact = spec.attention_varlen(q, k, v, sinks, cu, dtype=torch.float32)
    assert ((out.float() - exact).norm() / exact.norm()).item() < 8e-2
    # the second sequence does not see the first: reordering the first's keys (which keeps the
    # amax, so the scale, of the 64-row block it shares with the second) leaves it bit-identical
    k2 = k.clone()
    k2[:50] = k[:50].flip(0)
    out2 = spec.attention_fp8_varlen(q, k2, v, sinks, cu)
    assert torch.equal(out2[50:], out[50:]) and not torch.equal(out2[:50], out[:50])

"""The optional DeepGEMM backend (kernels/deepgemm.py, kernels/swiglu_quant.py, TritonOps with
``KernelConfig(gemm="deep_gemm")``).

CPU: deep_gemm cannot be installed here, so a fake ``deep_gemm`` module is put in sys.modules. It
implements the two calls from DeepGEMM's documented contract in plain torch (not from our code):
FP8 operands dequantized with their 1x128 / 128x128 scales, fp32 products, bf16 out; K % 128 == 0;
activation scales in the TMA-aligned column-major layout (strict here: DeepGEMM would transpose
other layouts slowly on every call, which the backend must never need); m_indices one expert per
128-row block, -1 rows' output unspecified (written NaN here, so a consumer reading them fails).
Our kernels run in Triton's interpreter. Tolerances:
* the helper kernels (gather, SwiGLU-quant, scatter) against their references: exact bytes, or for
  SwiGLU-quant at most one e4m3 step on a rare value (sigmoid implementations);
* a dense linear against ``block_gemm_reference``: the DeepGEMM output is rounded to bf16 before
  the bias (two roundings instead of one): rel <= 6e-3;
* the expert FFN against ``W8A8CpuOps.expert_ffn``: the gate_up product rounded to bf16 before its
  bias and SwiGLU flips some FP8 intermediate values by one e4m3 step: rel <= 2.5e-2 (whole
  experts) and 3e-2 (partial products) where 1.4e-2 was measured in the interpreter (our own
  kernels there: <= 1.2e-2, test_triton_ops.py);
* the tiny model's logits against ``W8A8CpuOps``: the interpreter bound of test_triton_ops.py.
GPU (``gpu`` marker, skipped unless the real deep_gemm imports): DeepGEMM grouped and dense against
the reference, and TritonOps(gemm="deep_gemm") against TritonOps() on a tiny model.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels import deepgemm
from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.kernels.moe_align import moe_align
from gptoss_fp8.kernels.swiglu_quant import swiglu_quant, swiglu_quant_reference
from gptoss_fp8.model.ops import W8A8CpuOps
from gptoss_fp8.quant.fp8 import FP8_DTYPE, block_gemm_reference, quantize_act, quantize_weight_blocks

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------
# The fake deep_gemm: DeepGEMM's documented contract in plain torch


def _deq_lhs(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    assert k % 128 == 0, f"DeepGEMM needs K % 128 == 0, got {k}"
    assert s.shape == (m, k // 128) and s.dtype == torch.float32, f"lhs scales {tuple(s.shape)} for {tuple(x.shape)}"
    aligned = (m + 3) // 4 * 4
    assert s.stride(0) == 1 and (k == 128 or s.stride(1) == aligned), (
        f"lhs scales not column-major TMA-aligned: strides {s.stride()} for M={m}")
    return x.float() * s.repeat_interleave(128, dim=1)


def _deq_rhs(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    assert s.shape == ((n + 127) // 128, k // 128) and s.is_contiguous(), f"rhs scales {tuple(s.shape)} for {tuple(w.shape)}"
    return w.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)


class FakeDeepGemm(types.ModuleType):
    def __init__(self):
        super().__init__("deep_gemm")
        self.calls = {"dense": 0, "grouped": 0}

    def gemm_fp8_fp8_bf16_nt(self, lhs, rhs, out):
        (x, xs), (w, ws) = lhs, rhs
        assert x.dtype == FP8_DTYPE and w.dtype == FP8_DTYPE and out.dtype == torch.bfloat16
        assert x.stride(1) == 1 and w.stride(1) == 1 and out.stride(1) == 1
        assert x.shape[1] == w.shape[1] and out.shape == (x.shape[0], w.shape[0]), (x.shape, w.shape, out.shape)
        self.calls["dense"] += 1
        out.copy_((_deq_lhs(x, xs) @ _deq_rhs(w, ws).t()).to(torch.bfloat16))

    def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(self, lhs, rhs, out, m_indices):
        (x, xs), (w, ws) = lhs, rhs
        m, k = x.shape
        e, n, _ = w.shape
        assert x.is_contiguous() and w.is_contiguous() and out.is_contiguous() and m_indices.is_contiguous()
        assert m_indices.dtype == torch.int32 and m_indices.shape == (m,) and out.shape == (m, n)
        assert m % 128 == 0, f"grouped M={m} is not a multiple of 128"
        assert ws.shape == (e, (n + 127) // 128, k // 128) and ws.is_contiguous()
        for b in m_indices.view(-1, 128):  # one expert per 128-row block, named by its first row
            vals = b[b >= 0]
            assert vals.numel() == 0 or (b[0] >= 0 and (vals == b[0]).all()), f"mixed block {b.tolist()}"
            assert int(b.max()) < e
        self.calls["grouped"] += 1
        xd = _deq_lhs(x, xs)
        res = torch.full((m, n), float("nan"), dtype=torch.float32, device=x.device)  # -1 rows: unspecified
        for g in torch.unique(m_indices[m_indices >= 0]).tolist():
            rows = m_indices == g
            res[rows] = xd[rows] @ _deq_rhs(w[g], ws[g]).t()
        out.copy_(res.to(torch.bfloat16))


@pytest.fixture
def fake_dg(monkeypatch):
    fake = FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    deepgemm._load.cache_clear()
    deepgemm.clear_cache()
    yield fake
    deepgemm._load.cache_clear()
    deepgemm.clear_cache()


def _ops(gluon: bool = False):
    """TritonOps on DeepGEMM (Gluon off on CPU: the interpreter runs the Triton kernels)."""
    from gptoss_fp8.model.triton_ops import TritonOps

    return TritonOps(config=KernelConfig(gemm="deep_gemm", gluon=gluon))


# ------------------------------------------------------------------------------------------------
# Availability and bad input


def test_missing_deep_gemm_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError
    deepgemm._load.cache_clear()
    try:
        assert deepgemm.available() is False and deepgemm.available() is False  # cached, never raises
        with pytest.raises(GptOssFp8Error) as err:
            deepgemm.require()
        msg = str(err.value)
        assert "\n" not in msg and "deep_gemm" in msg and "deepgemm_setup.sh" in msg and "--gemm ours" in msg, msg
        g = torch.Generator().manual_seed(0)
        w, s = quantize_weight_blocks(torch.randn(128, 192, generator=g))
        with pytest.raises(GptOssFp8Error, match="not importable"):
            _ops().linear(torch.randn(4, 192, generator=g).bfloat16().to(DEV), w.to(DEV), s.to(DEV), None)
    finally:
        deepgemm._load.cache_clear()


def test_a_deep_gemm_without_the_calls_is_not_available(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    deepgemm._load.cache_clear()
    try:
        assert not deepgemm.available()
        with pytest.raises(GptOssFp8Error, match="has no gemm_fp8_fp8_bf16_nt"):
            deepgemm.require()
    finally:
        deepgemm._load.cache_clear()


def test_cli_gemm_deep_gemm_without_deep_gemm_is_one_line(monkeypatch):
    from typer.testing import CliRunner

    from gptoss_fp8.cli.main import app

    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    deepgemm._load.cache_clear()
    runner = CliRunner()
    dev = "cuda" if HAS_CUDA else "cpu"  # the kernels mode runs on CPU under the interpreter (conftest)
    try:
        # checked before the checkpoint or the reference is opened
        r = runner.invoke(app, ["verify-logits", "nowhere", "--reference", "nowhere", "--mode", "kernels",
                                "--device", dev, "--gemm", "deep_gemm"])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 1 and len(lines) == 1 and "deepgemm_setup.sh" in lines[0], r.output
        r = runner.invoke(app, ["verify-logits", "nowhere", "--reference", "nowhere", "--mode", "w8a8",
                                "--gemm", "deep_gemm"])
        assert r.exit_code == 1 and "kernels mode only" in r.output, r.output
        r = runner.invoke(app, ["verify-logits", "nowhere", "--reference", "nowhere", "--gemm", "cublas"])
        assert r.exit_code == 2 and "cublas" in r.output
        for cmd in (["bench", "kernels"], ["bench", "prefill"]):
            r = runner.invoke(app, [*cmd, "--help"])
            assert r.exit_code == 0 and "--gemm" in r.output
    finally:
        deepgemm._load.cache_clear()


def test_kernel_config_rejects_an_unknown_gemm_and_kernel_paths_names_deep_gemm():
    from gptoss_fp8.kernels.config import kernel_paths

    with pytest.raises(ValueError, match="gemm"):
        KernelConfig(gemm="cublas")
    assert "DeepGEMM" in kernel_paths(torch.device("cpu"), KernelConfig(gemm="deep_gemm"))
    assert "DeepGEMM" not in kernel_paths(torch.device("cpu"), KernelConfig())


# ------------------------------------------------------------------------------------------------
# Pieces: padded activation quantization, weight preparation, gather, SwiGLU-quant, scatter


@pytest.mark.parametrize("m,k", [(19, 192), (8, 256), (5, 96)])
def test_act_quant_padded_col_major(m, k):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).bfloat16().to(DEV)
    q, s = act_quant(x, pad_k=True, col_major_scale=True)
    rq, rs = quantize_act(x)
    kp = (k + 127) // 128 * 128
    assert q.shape == (m, kp) and q.is_contiguous() and s.shape == rs.shape
    assert s.stride() == (1, (m + 3) // 4 * 4)
    assert torch.equal(q[:, :k].view(torch.uint8), rq.view(torch.uint8))
    assert (q[:, k:].view(torch.uint8) == 0).all()
    assert torch.equal(s, rs)
    # the default output is unchanged
    q0, s0 = act_quant(x)
    assert q0.shape == (m, k) and torch.equal(q0.view(torch.uint8), rq.view(torch.uint8)) and s0.is_contiguous()


def test_prepared_weights_are_padded_once_and_follow_in_place_changes(fake_dg):
    g = torch.Generator().manual_seed(1)
    w, s = quantize_weight_blocks(torch.randn(3, 96, 200, generator=g))
    wp, sp = deepgemm.prepared_weight(w, s)
    assert wp.shape == (3, 96, 256) and sp.shape == s.shape == (3, 1, 2)
    assert torch.equal(wp[..., :200].view(torch.uint8), w.view(torch.uint8))
    assert (wp[..., 200:].view(torch.uint8) == 0).all()
    assert deepgemm.prepared_weight(w, s)[0] is wp  # cached
    w.view(torch.uint8)[0, 0, 0] ^= 1  # changed in place: rebuilt
    assert deepgemm.prepared_weight(w, s)[0] is not wp
    aligned, sa = quantize_weight_blocks(torch.randn(64, 256, generator=g))
    assert deepgemm.prepared_weight(aligned, sa)[0] is aligned  # K % 128 == 0: no copy


def _routing(t, k, e_total, g):
    return torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(t)]).int()


def test_gather_rows_builds_the_grouped_operand():
    g = torch.Generator().manual_seed(2)
    t, k, h, e = 23, 3, 200, 6
    x = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    ids = _routing(t, k, 8, g).to(DEV)  # experts 6, 7 on another rank
    xq, xs = quantize_act(x)
    slots, block_expert = moe_align(ids, 0, e, 128)
    a, a_s, midx = deepgemm.gather_rows(xq, xs, slots, block_expert, k, e)
    assert a.shape == (slots.shape[0], 256) and a_s.stride() == (1, (a.shape[0] + 3) // 4 * 4)
    valid = slots < t * k
    want_e = torch.where(valid, block_expert.repeat_interleave(128), -1)
    assert torch.equal(midx, want_e.int())
    tok = (slots[valid] // k).long()
    assert torch.equal(a[valid, :h].view(torch.uint8), xq[tok].view(torch.uint8))
    assert (a[valid, h:].view(torch.uint8) == 0).all()
    assert torch.equal(a_s[valid], xs[tok])
    # every local (token, slot) pair appears once, with its expert
    flat = ids.reshape(-1).long()
    assert sorted(slots[valid].tolist()) == [i for i in range(t * k) if flat[i] < e]
    assert torch.equal(flat[slots[valid].long()], midx[valid].long())


@pytest.mark.parametrize("i", [160, 256, 64])
def test_swiglu_quant_matches_its_reference(i):
    g = torch.Generator().manual_seed(i)
    m, e = 48, 3
    h = (torch.randn(m, 2 * i, generator=g) * 4).bfloat16().to(DEV)  # beyond the clamp limit too
    bias = (torch.randn(e, 2 * i, generator=g) * 0.3).bfloat16().to(DEV)
    midx = torch.randint(0, e, (m,), generator=g).int()
    midx[5:9] = -1
    midx[32:48] = -1  # a whole 16-row block of padding
    midx = midx.to(DEV)
    q, s = swiglu_quant(h, bias, midx, 7.0)
    rq, rs = swiglu_quant_reference(h, bias, midx, 7.0)
    ip = (i + 127) // 128 * 128
    assert q.shape == (m, ip) and s.shape == rs.shape and s.stride() == (1, m)
    v = midx >= 0
    assert torch.allclose(s[v], rs[v], rtol=1e-6, atol=0)
    qf, rf = q[v].float(), rq[v].float()
    diff = qf != rf
    assert diff.float().mean() <= 2e-3, diff.float().mean()
    # where they differ, by one e4m3 step at most (12.5% of the value)
    assert ((qf - rf).abs()[diff] <= rf.abs()[diff] * 0.125 + 1e-6).all()
    assert (q[v][:, i:].view(torch.uint8) == 0).all()


def test_scatter_bias_writes_slots_with_their_bias():
    g = torch.Generator().manual_seed(4)
    t, k, hd, e = 9, 2, 96, 3
    ids = _routing(t, k, 4, g).to(DEV)
    slots, block_expert = moe_align(ids, 0, e, 128)
    valid = slots < t * k
    midx = torch.where(valid, block_expert.repeat_interleave(128), -1).int()
    hb = torch.randn(slots.shape[0], hd, generator=g).bfloat16().to(DEV)
    hb[~valid] = float("nan")  # padding rows never reach y
    bias = torch.randn(e, hd, generator=g).bfloat16().to(DEV)
    for b, dt in ((bias, torch.bfloat16), (None, torch.float32)):
        y = torch.full((t * k, hd), -7.0, dtype=dt, device=DEV)
        deepgemm.scatter_bias(hb, b, slots, midx, y)
        s = slots[valid].long()
        want = hb[valid].float() + (0 if b is None else b[midx[valid].long()].float())
        if dt == torch.float32 or HAS_CUDA:
            assert torch.equal(y[s], want.to(dt))
        else:  # the interpreter's fp32 -> bf16 stores truncate: one bf16 ulp
            assert ((y[s].float() - want).abs() <= want.abs() * 2**-7).all()
        foreign = torch.ones(t * k, dtype=torch.bool, device=DEV)
        foreign[s] = False
        assert (y[foreign] == -7.0).all()  # left to zero_foreign_rows


# ------------------------------------------------------------------------------------------------
# Through TritonOps with the fake DeepGEMM


@pytest.mark.parametrize("k", [192, 256])
def test_linear_and_linears_on_deep_gemm(fake_dg, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(21, k, generator=g).bfloat16().to(DEV)
    projs = []
    for n in (256, 128, 128):
        w, s = quantize_weight_blocks(torch.randn(n, k, generator=g) / math.sqrt(k))
        projs.append((w.to(DEV), s.to(DEV), (0.1 * torch.randn(n, generator=g)).bfloat16().to(DEV)))
    ops, spec = _ops(), W8A8CpuOps()
    for w, s, b in projs:
        want = spec.linear(x, w, s, b)
        got = ops.linear(x, w, s, b)
        assert got.dtype == torch.bfloat16 and rel(want, got) <= 6e-3, rel(want, got)
        got32 = ops.linear(x, w, s, b, torch.float32)
        want32 = spec.linear(x, w, s, b, torch.float32)
        assert got32.dtype == torch.float32 and rel(want32, got32) <= 6e-3
    xq = quantize_act(x)  # the norm's quantization (unpadded, row-major scales) is re-laid out, same result
    assert torch.equal(ops.linear(x, *projs[0], xq=xq), ops.linear(x, *projs[0]))
    fused = ops.linears(x, projs, xq=xq)
    assert all(torch.equal(a, ops.linear(x, *p)) for a, p in zip(fused, projs, strict=True))
    unaligned = [(w[:96], s[:1], b[:96]) for w, s, b in projs[:2]]  # N = 96: one GEMM each
    got = ops.linears(x, [(w.contiguous(), s.contiguous(), b.contiguous()) for w, s, b in unaligned])
    assert all(rel(spec.linear(x, *p), y) <= 6e-3 for p, y in zip(unaligned, got, strict=True))
    assert fake_dg.calls["dense"] >= 9 and not any(ops.spec_fallbacks.values()), ops.spec_fallbacks


def _experts(e, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h))
    w2, s2 = quantize_weight_blocks(torch.randn(e, h, i, generator=g) / math.sqrt(i))
    return {
        "gate_up_proj": w13.to(DEV), "gate_up_proj_scale_inv": s13.to(DEV),
        "gate_up_proj_bias": (0.1 * torch.randn(e, 2 * i, generator=g)).bfloat16().to(DEV),
        "down_proj": w2.to(DEV), "down_proj_scale_inv": s2.to(DEV),
        "down_proj_bias": (0.1 * torch.randn(e, h, generator=g)).bfloat16().to(DEV),
    }


def test_expert_ffn_on_deep_gemm_keeps_the_contract(fake_dg):
    g = torch.Generator().manual_seed(11)
    t, h, i, e, k = 37, 192, 256, 8, 3
    x = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEV)
    ex = _experts(e, h, i, 0)
    ops, spec = _ops(), W8A8CpuOps()
    y, b = ops.expert_ffn(x, idx, ex, 0, 7.0)
    want, _ = spec.expert_ffn(x, idx, ex, 0, 7.0)
    assert b is None and y.shape == (t, k, h) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert rel(want, y) <= 2.5e-2, rel(want, y)
    assert fake_dg.calls["grouped"] == 2
    assert torch.equal(ops.expert_ffn(x, idx, ex, 0, 7.0, xq=quantize_act(x))[0], y)  # the norm's xq: same

    # expert-parallel ranks: each slot computed by exactly one rank, zeros elsewhere
    parts = []
    for first in (0, 4):
        yr, _ = ops.expert_ffn(x, idx, {n: v[first:first + 4] for n, v in ex.items()}, first, 7.0)
        here = ((idx >= first) & (idx < first + 4))[..., None]
        assert (yr.float().masked_fill(here, 0) == 0).all()
        parts.append(yr.float())
    assert torch.equal(parts[0] + parts[1], y.float())

    # intermediate split in two: bf16 products widened to float32 without bias; the bias as the spec's
    half = i // 2
    total = 0
    for p in range(2):
        sub = dict(ex)
        rows = slice(2 * half * p, 2 * half * (p + 1))
        sub["gate_up_proj"] = ex["gate_up_proj"][:, rows]  # views: the backend pads / copies itself
        sub["gate_up_proj_bias"] = ex["gate_up_proj_bias"][:, rows]
        sub["gate_up_proj_scale_inv"] = ex["gate_up_proj_scale_inv"][:, 2 * half * p // 128:2 * half * (p + 1) // 128]
        sub["down_proj"] = ex["down_proj"][:, :, half * p:half * (p + 1)]
        sub["down_proj_scale_inv"] = ex["down_proj_scale_inv"][:, :, half * p // 128:half * (p + 1) // 128]
        sub["down_proj_bias"] = ex["down_proj_bias"] if p == 0 else None
        yp, bp = ops.expert_ffn(x, idx, sub, 0, 7.0, partial=True)
        sp, sbp = spec.expert_ffn(x, idx, sub, 0, 7.0, partial=True)
        assert yp.dtype == torch.float32 and torch.equal(bp, sbp)
        assert rel(sp, yp) <= 3e-2, rel(sp, yp)
        total = total + yp + bp
    assert rel(y.float(), total) <= 3e-2


def test_bench_rows_of_the_deepgemm_peer_and_backend(fake_dg, monkeypatch):
    """bench kernels' DeepGEMM rows (the timing replaced by one call each): they run the raw calls
    and the backend on the same data, and name their peers."""
    from gptoss_fp8.bench import kernels_gemm as kg

    calls = []
    monkeypatch.setattr(kg, "_ms", lambda fn: (calls.append(fn()), 1.0)[1])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 192, generator=g).bfloat16().to(DEV)
    w, s = quantize_weight_blocks(torch.randn(128, 192, generator=g) / 14)
    b = (0.1 * torch.randn(128, generator=g)).bfloat16()
    rows = kg._dense_deepgemm_rows("dense", 1.0, 1.0, *quantize_act(x), w.to(DEV), s.to(DEV), b.to(DEV))
    assert [r["peer"] for r in rows] == ["DeepGEMM gemm_fp8_fp8_bf16_nt, no bias"] * 2
    assert rows[1]["case"].endswith("[deep_gemm backend]") and fake_dg.calls["dense"] == 2
    e, h, i = 4, 192, 128
    ex = _experts(e, h, i, 3)
    experts = tuple(ex[n] for n in ("gate_up_proj", "gate_up_proj_scale_inv", "gate_up_proj_bias", "down_proj",
                                    "down_proj_scale_inv", "down_proj_bias"))
    wr = (torch.randn(e, h, generator=g) / 14).bfloat16().to(DEV)
    rows = kg._moe_deepgemm_rows(e, 40, 1.0, x, wr, None, experts)
    assert len(rows) == 2 and all("deepgemm_gate_up_ms" in r for r in rows)
    assert fake_dg.calls["grouped"] == 4  # the two GEMMs alone, then the backend's two
    ours, backend = calls[2], calls[-1]  # moe_experts and the deep_gemm backend, combined [T, H]
    assert rel(ours.float(), backend.float()) <= 2.5e-2


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    root = tmp_path_factory.mktemp("dg_tiny")
    write_synthetic(root / "src", "tiny", seed=7, layers=2, layout="hf")
    convert_checkpoint(root / "src", root / "fp8")
    return root / "fp8"


def test_tiny_model_on_deep_gemm_matches_the_w8a8_spec(fake_dg, tiny_ckpt):
    from gptoss_fp8.model.load import load_model

    if HAS_CUDA:
        pytest.skip("the fake deep_gemm is for CPU; the GPU test runs the real one")
    model = load_model(tiny_ckpt, device="cpu")
    tokens = torch.randint(0, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    ops = _ops()
    want = model(tokens, W8A8CpuOps()).float()
    got = model(tokens, ops).float()
    assert torch.isfinite(got).all()
    r, top1 = rel(want, got), float((want.argmax(-1) == got.argmax(-1)).float().mean())
    # test_triton_ops.py's interpreter bound (truncating bf16 stores, plus here the bf16 GEMM outputs)
    assert r <= 0.12 and top1 >= 0.85, (r, top1)
    assert fake_dg.calls["dense"] > 0 and fake_dg.calls["grouped"] == 4  # 2 layers x (gate_up, down)
    assert ops.spec_fallbacks["linear"] == 0 and ops.spec_fallbacks["expert_ffn"] == 0, ops.spec_fallbacks


def test_adopt_padded_leaves_one_copy_and_the_same_outputs(fake_dg, tiny_ckpt):
    """adopt_padded: each FP8 weight with K % 128 != 0 becomes the [..., :K] view of its padded copy
    (same values), DeepGEMM is handed that copy (no second one is made), and the logits of the spec
    and of the deep_gemm backend are bit for bit those before it; a second call changes nothing."""
    from gptoss_fp8.model.load import load_model

    if HAS_CUDA:
        pytest.skip("the fake deep_gemm is for CPU")
    model = load_model(tiny_ckpt, device="cpu")
    tokens = torch.randint(0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    experts = model.model.layers[0].mlp.experts
    before_w = experts.gate_up_proj.clone()
    want_spec, want_dg = model(tokens, W8A8CpuOps()), model(tokens, _ops())
    deepgemm.clear_cache()
    added = deepgemm.adopt_padded(model)
    w = experts.gate_up_proj
    k = w.shape[-1]
    assert k % 128 and added > 0 and not w.is_contiguous() and w._base.shape[-1] == deepgemm.cdiv(k, 128) * 128
    assert torch.equal(w.view(torch.uint8), before_w.view(torch.uint8))
    assert (w._base.view(torch.uint8)[..., k:] == 0).all()
    assert deepgemm.prepared_weight(w, experts.gate_up_proj_scale_inv)[0] is w._base  # no copy
    assert deepgemm.adopt_padded(model) == 0
    assert torch.equal(model(tokens, W8A8CpuOps()), want_spec)
    assert torch.equal(model(tokens, _ops()), want_dg)


def test_adopt_padded_pads_a_shared_tensor_once():
    """A tensor several modules hold (bench's ``--distinct-layers`` repeats a layer's) gets one padded copy: every
    holder gets the same view and the padding is counted once, so the repeated model still fits."""
    from gptoss_fp8.bench.prefill import random_model
    from gptoss_fp8.config import preset_config

    cfg = preset_config("tiny", 4)
    rep, whole = random_model(cfg, "cpu", 2, distinct_layers=2), random_model(cfg, "cpu", 2)
    deepgemm.clear_cache()
    added_rep, added_whole = deepgemm.adopt_padded(rep), deepgemm.adopt_padded(whole)
    assert 0 < added_rep and added_rep * 2 == added_whole  # (every FP8 tensor is a layer's: 2 of 4 distinct)
    a, b = (rep.model.layers[i].mlp.experts.gate_up_proj for i in (0, 2))
    assert a is b and a._base is not None and a.shape[-1] % 128
    assert rep.model.layers[1].mlp.experts.gate_up_proj._base is not a._base
    assert deepgemm.adopt_padded(rep) == 0


# ------------------------------------------------------------------------------------------------
# The real DeepGEMM (GPU machine, deep_gemm importable: BENCHMARKS.md "How to run the peers")


def _real():
    deepgemm._load.cache_clear()
    if not (HAS_CUDA and deepgemm.available()):
        pytest.skip("needs a CUDA GPU and an importable deep_gemm")


@pytest.mark.gpu
def test_real_deep_gemm_dense_and_grouped_gpu():
    _real()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 2880, device="cuda", generator=g).bfloat16()
    w, s = quantize_weight_blocks(torch.randn(5120, 2880, device="cuda", generator=g) / 54)
    b = (0.1 * torch.randn(5120, device="cuda", generator=g)).bfloat16()
    y = deepgemm.linear(x, w, s, b)
    want = block_gemm_reference(*quantize_act(x), w, s, b)
    print(f"METRIC deep_gemm dense rel {rel(want, y):.3e}")
    assert rel(want, y) <= 5e-3, rel(want, y)  # two bf16 roundings (GEMM out, + bias) and GPU division
    t, k, e, h, i = 200, 4, 8, 2880, 2880
    idx = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(j))[:k] for j in range(t)])
    g13, s13 = quantize_weight_blocks(torch.randn(e, 2 * i, h, device="cuda", generator=g) / 54)
    g2, s2 = quantize_weight_blocks(torch.randn(e, h, i, device="cuda", generator=g) / 54)
    b13 = (0.1 * torch.randn(e, 2 * i, device="cuda", generator=g)).bfloat16()
    b2 = (0.1 * torch.randn(e, h, device="cuda", generator=g)).bfloat16()
    ex = {"gate_up_proj": g13, "gate_up_proj_scale_inv": s13, "gate_up_proj_bias": b13,
          "down_proj": g2, "down_proj_scale_inv": s2, "down_proj_bias": b2}
    xs = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    got, _ = _ops().expert_ffn(xs, idx.cuda(), ex, 0, 7.0)
    want, _ = W8A8CpuOps().expert_ffn(xs, idx.cuda(), ex, 0, 7.0)
    print(f"METRIC deep_gemm expert_ffn rel {rel(want, got):.3e}")
    # the gate_up product rounded to bf16 before bias + SwiGLU: the bound test_triton_ops.py set when
    # the spec itself rounded the intermediate to bf16
    assert rel(want, got) <= 4e-2, rel(want, got)


@pytest.mark.gpu
def test_real_deep_gemm_tiny_model_against_our_gemms_gpu(tiny_ckpt):
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.model.triton_ops import TritonOps

    _real()
    model = load_model(tiny_ckpt, device="cuda")
    tokens = torch.randint(0, model.cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).cuda()
    want = model(tokens, TritonOps()).float()
    ops = _ops(gluon=True)
    got = model(tokens, ops).float()
    r, top1 = rel(want, got), float((want.argmax(-1) == got.argmax(-1)).float().mean())
    print(f"METRIC deep_gemm vs ours tiny: rel {r:.3e} top1 {top1:.3f}")
    # test_triton_ops.py's GPU bound of our kernels against the spec; the two GEMM libraries differ by less
    assert r <= 0.08 and top1 >= 0.85, (r, top1)
    assert ops.spec_fallbacks["linear"] == 0 and ops.spec_fallbacks["expert_ffn"] == 0, ops.spec_fallbacks

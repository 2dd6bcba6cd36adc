"""RMSNorm / residual-add + RMSNorm kernel (kernels/norm.py) against the plain-torch reference.

Tolerance: one bf16 ulp (relative 2^-7 of each value, plus 1e-6 absolute for values near zero):
the kernel's sum of squares runs in another order and its rsqrt is approximate. In the interpreter
(CPU) every fp32 -> bf16 cast truncates instead of rounding; where two casts meet (an fp32 delta
cast to bf16, then the sum) that is two ulps, so the CPU bound is 2^-6. Bit-identical outputs: at
least 90% on the GPU; in the interpreter, whose stores truncate, about half (measured 55%), so at
least 40% there.
The fused quantization (``rms_norm_quant``) is checked bit for bit against ``act_quant`` of the
kernel's own normed output (same arithmetic on the same bf16 values), on CPU and GPU alike.
"""

import pytest
import torch

from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.norm import add_rms_norm, rms_norm, rms_norm_quant
from gptoss_fp8.spec import add_rms_norm as add_rms_norm_reference
from gptoss_fp8.spec import rms_norm as rms_norm_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """|got - want| within one bf16 ulp (two on CPU) of max(|want|, |scale|)."""
    g, w = got.float().cpu(), want.float().cpu()
    mag = w.abs() if scale is None else torch.maximum(w.abs(), scale.float().abs().cpu())
    ulps = 1 if DEV == "cuda" else 2
    assert torch.all((g - w).abs() <= mag * ulps * 2**-7 + 1e-6), f"max diff {(g - w).abs().max()}"
    assert (g == w).float().mean() >= (0.9 if DEV == "cuda" else 0.4)


@pytest.mark.parametrize("t,h", [(1, 192), (37, 96), (64, 2880), (5, 4096)])
def test_rms_norm_matches_reference(t, h):
    gen = torch.Generator().manual_seed(t * 1000 + h)
    x = (torch.randn(t, h, generator=gen) * 3 + 0.5).to(DEV, torch.bfloat16)
    w = (1 + 0.3 * torch.randn(h, generator=gen)).to(DEV)
    _check(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))


@pytest.mark.parametrize("delta_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_matches_reference(delta_dtype):
    gen = torch.Generator().manual_seed(7)
    t, h = 29, 2880
    x = torch.randn(t, h, generator=gen).to(DEV, torch.bfloat16)
    d = (2 * torch.randn(t, h, generator=gen)).to(DEV, delta_dtype)
    w = torch.rand(h, generator=gen).to(DEV) + 0.5
    xo, y = add_rms_norm(x, d, w, 1e-5)
    xr, _ = add_rms_norm_reference(x, d, w, 1e-5)
    _check(xo, xr, scale=d)  # a rounding of delta counts at delta's magnitude (cancellation)
    _check(y, rms_norm_reference(xo, w, 1e-5))  # the norm of the sum the kernel stored
    assert xo.dtype == y.dtype == torch.bfloat16 and xo.data_ptr() != x.data_ptr()


def test_norm_of_a_strided_view_and_empty():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(16, 2 * 192, generator=gen).to(DEV, torch.bfloat16)
    x = base[:, :192]  # row stride 384
    w = torch.rand(192, generator=gen).to(DEV)
    _check(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 192)


@pytest.mark.parametrize("t,h,with_delta", [(33, 2880, True), (5, 2880, False), (17, 96, True), (3, 4096, True)])
def test_rms_norm_quant_equals_act_quant_of_the_norm(t, h, with_delta):
    """H = 2880 ends in a half group; H = 96 is one partial group; the norm part equals add_rms_norm."""
    gen = torch.Generator().manual_seed(t + h)
    x = (torch.randn(t, h, generator=gen) * 2).to(DEV, torch.bfloat16)
    d = torch.randn(t, h, generator=gen).to(DEV, torch.bfloat16) if with_delta else None
    w = (torch.rand(h, generator=gen) + 0.5).to(DEV)
    xo, y, (q, s) = rms_norm_quant(x, d, w, 1e-5)
    if with_delta:
        xr, yr = add_rms_norm(x, d, w, 1e-5)
        assert torch.equal(xo, xr)
    else:
        xr, yr = x, rms_norm(x, w, 1e-5)
        assert xo is x
    assert torch.equal(y, yr)
    qr, sr = act_quant(y)
    assert q.shape == qr.shape and s.shape == sr.shape == (t, (h + 127) // 128)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert q.float().abs().max() > 100  # the largest value of a group lands near 448


@pytest.mark.parametrize("t,k,h,dtype", [(23, 4, 2880, torch.bfloat16), (9, 3, 96, torch.float32), (2, 4, 4096, torch.bfloat16)])
def test_norm_with_the_moe_combine_fused_equals_combine_then_norm(t, k, h, dtype):
    """``combine=weights``: the delta is the weighted combine of per-slot rows [T, k, H], the same bits
    as moe.moe_combine followed by the norm (bf16 slots as the model's, fp32 as a split expert's)."""
    from gptoss_fp8.kernels.moe import moe_combine

    gen = torch.Generator().manual_seed(t * k + h)
    x = (torch.randn(t, h, generator=gen) * 2).to(DEV, torch.bfloat16)
    y = torch.randn(t, k, h, generator=gen).to(DEV, dtype)
    wts = torch.softmax(torch.randn(t, k, generator=gen), -1).to(DEV, torch.bfloat16)
    nw = (torch.rand(h, generator=gen) + 0.5).to(DEV)
    xo, yn, (q, s) = rms_norm_quant(x, y, nw, 1e-5, combine=wts)
    delta = moe_combine(y, wts)
    xr, yr, (qr, sr) = rms_norm_quant(x, delta, nw, 1e-5)
    assert torch.equal(xo, xr) and torch.equal(yn, yr) and torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert not torch.equal(xo, x)  # the delta was added
    xo2, _, _ = rms_norm_quant(x, y.reshape(t * k, h), nw, 1e-5, combine=wts)  # flat slot rows
    assert torch.equal(xo2, xr)
    xo3, y3, (q3, s3) = rms_norm_quant(x, y, nw, 1e-5, combine=wts, rows=False)  # the bf16 rows left out
    assert y3 is None and torch.equal(xo3, xr) and torch.equal(s3, sr) and torch.equal(q3.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("t", [1, 7, 64])
def test_norm_without_delta_two_rows_a_program_same_bits(t):
    """``norm_tile``'s two rows a program for a norm of the stream alone (no delta; rows of 4096 columns or more once
    padded): the same bits as one row a program, each row reduced in the same order (normed rows, their FP8
    quantization and scales, the rsqrt factors), an odd count of rows included; a norm with a delta keeps one."""
    from gptoss_fp8.kernels.norm import norm_tile

    assert norm_tile(2880, True, delta=False) == (4096, 2, 8) and norm_tile(2880, True) == (4096, 1, 8)
    assert norm_tile(2880, True, delta=False, stream_rows=1) == (4096, 1, 8)  # KernelConfig.norm_stream_rows=1
    gen = torch.Generator().manual_seed(t)
    x = (torch.randn(t, 2880, generator=gen) * 2).to(DEV, torch.bfloat16)
    w = (1 + 0.3 * torch.randn(2880, generator=gen)).to(DEV)
    r2, r1 = (torch.empty(t, device=DEV) for _ in range(2))
    two = rms_norm_quant(x, None, w, 1e-5, rstd=r2)
    one = rms_norm_quant(x, None, w, 1e-5, rstd=r1, tile=norm_tile(2880, True, delta=False, stream_rows=1))
    assert torch.equal(two[1], one[1]) and torch.equal(r2, r1)
    assert torch.equal(two[2][0].view(torch.uint8), one[2][0].view(torch.uint8)) and torch.equal(two[2][1], one[2][1])

"""RMSNorm, optionally fused with the residual add before it (Triton).

gpt-oss (``gpt_oss/torch/model.py``) normalises in fp32: t = x.float(); t = t * rsqrt(mean(t^2)
+ eps); out = (t * weight).to(x.dtype), with the norm scale held in fp32. Every norm but the first
follows a residual add in the bf16 stream, x = x + delta.to(bf16). ``add_rms_norm`` does both in
one pass over the row (one read of x and delta, one write of the new x and of the normed row),
where torch takes ~8 passes over [T, H] in fp32.

Numerics: the residual sum is rounded to bf16 exactly as torch's bf16 add (fp32 sum, one
rounding); the sum of squares is an fp32 tree reduction (torch's mean: another order) and
``rsqrt`` is the GPU's approximate one: the normed output is within one bf16 ulp of
``rms_norm_reference``. In Triton's interpreter (CPU), fp32 -> bf16 stores truncate instead of
rounding, which is also within one bf16 ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr,
    M, H, stride_x, stride_d, stride_xo, stride_y, eps,
    HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0)
        # torch: x + delta.to(x.dtype), an fp32 sum rounded once to x's dtype
        x = (x.to(tl.float32) + d.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(xo_ptr + rows[:, None] * stride_xo + cols[None, :], x, mask=mask)
    t = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(t * t, axis=1) / H + eps)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = (t * r[:, None]) * w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)}"
    m, h = x.shape
    assert weight.shape == (h,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} does not fit H={h}"
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if delta is not None else x
    if delta is not None:
        assert delta.shape == x.shape and delta.stride(-1) == 1, f"delta {tuple(delta.shape)} does not fit x {tuple(x.shape)}"
    if m == 0:
        return xo, y
    block_h = triton.next_power_of_2(h)
    block_m = max(1, min(16, 2048 // block_h))  # ~2048 elements per program for small H
    d = delta if delta is not None else x
    _rms_norm_kernel[(triton.cdiv(m, block_m),)](
        x, d, weight, xo, y, m, h, x.stride(0), d.stride(0), xo.stride(0), y.stride(0), float(eps),
        HAS_DELTA=delta is not None, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=8 if block_h >= 4096 else 4,
    )
    return xo, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (bf16), weight float32 [H] -> normed [T, H] in x's dtype."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: (x + delta.to(x.dtype), rms_norm of that), both [T, H] in x's dtype.
    delta may be bf16 or float32 (an all-reduced partial sum, rounded here once)."""
    return _launch(x, delta, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gpt-oss's RMSNorm in plain torch (fp32, cast back to x's dtype)."""
    t = x.float()
    t = t * torch.rsqrt(torch.mean(t**2, dim=-1, keepdim=True) + eps)
    return (t * weight).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add of the bf16 stream, then ``rms_norm_reference`` (the ops spec uses both)."""
    xo = x + delta.to(x.dtype)
    return xo, rms_norm_reference(xo, weight, eps)

"""Bias + clamped SwiGLU + FP8 quantization of a bf16 gate_up GEMM output (Triton): the epilogue
that DeepGEMM's grouped GEMM lacks, run as the kernel after it (kernels/deepgemm.py).

Contract: h bf16 [M, 2I] (the gate_up product without bias, rows in padded sorted order, gate/up
columns interleaved: 2j = gate j, 2j+1 = up j); bias [E, 2I] bf16/fp32; m_indices int32 [M], each
row's expert (-1: a padding row). Per valid row, in fp32: g = h[2j] + b[e, 2j], u = h[2j+1] +
b[e, 2j+1], glu = min(g, limit), lin = clamp(u, -limit, limit), a = glu * sigmoid(1.702 glu) *
(lin + 1) (spec.swiglu), then a quantized per row in 1x128 groups (quant/fp8.quantize_act's
numerics). Output: q fp8 [M, round_up(I, 128)] (zeros in the padding columns: it is the down
GEMM's K-padded A operand) and scale float32 [M, ceil(I/128)] in DeepGEMM's TMA-aligned
column-major layout (act_quant.scale_layout). Rows with m_indices -1 are left unwritten: the
GEMMs are row-independent, so their bytes only ever reach rows nobody reads; a 16-row block of
padding rows only reads its indices. Not done here: the GEMMs, the down bias (deepgemm.py).
Reference: ``swiglu_quant_reference`` (spec.swiglu + quantize_act).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_fp8 import spec
from gptoss_fp8.kernels.act_quant import quantize_group_rows, scale_layout
from gptoss_fp8.quant.fp8 import ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX, cdiv, quantize_act
from gptoss_fp8.spec import SWIGLU_ALPHA


@triton.jit
def _swiglu_quant_kernel(
    h_ptr, bias_ptr, idx_ptr, q_ptr, s_ptr,
    M, N, I_OUT, stride_hm, stride_be, stride_qm, stride_sm, stride_sg, limit,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, ALPHA: tl.constexpr, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr,
):
    """One block of rows x one 128-wide group of SwiGLU outputs (= 256 interleaved h columns)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    e = tl.load(idx_ptr + offs_m, mask=m_ok, other=-1)
    valid = e >= 0
    if tl.max(valid.to(tl.int32), 0) > 0:
        rows = offs_m.to(tl.int64)
        offs_n = tl.program_id(1) * 2 * GROUP + tl.arange(0, 2 * GROUP)
        mask = valid[:, None] & (offs_n < N)[None, :]
        h = tl.load(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + tl.where(valid, e, 0).to(tl.int64)[:, None] * stride_be + offs_n[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        h = tl.where(mask, h + b, 0.0)  # masked columns stay exactly 0: SwiGLU(0, 0) = 0, out of the amax
        gate, up = tl.split(tl.reshape(h, (BLOCK_M, GROUP, 2)))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        a = gate * tl.sigmoid(ALPHA * gate) * (up + 1.0)
        q, scale = quantize_group_rows(a, FP8_MAX_C, EPS)
        offs_j = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        tl.store(q_ptr + rows[:, None] * stride_qm + offs_j[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=valid[:, None] & (offs_j < I_OUT)[None, :])
        tl.store(s_ptr + rows * stride_sm + tl.program_id(1) * stride_sg, scale, mask=valid)


def swiglu_quant(h: torch.Tensor, bias: torch.Tensor, m_indices: torch.Tensor,
                 limit: float = 7.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(q fp8 [M, round_up(I, 128)], scale float32 [M, ceil(I/128)] column-major TMA-aligned) of
    FP8(SwiGLU(h + bias[m_indices])) for h bf16 [M, 2I] (module docstring); rows with
    m_indices -1 unwritten."""
    m, n = h.shape
    assert n % 2 == 0 and h.stride(-1) == 1, f"h {tuple(h.shape)} needs an even, contiguous last dim"
    assert bias.dim() == 2 and bias.shape[1] == n and bias.stride(-1) == 1, f"bias {tuple(bias.shape)} does not fit h {n}"
    assert m_indices.shape == (m,) and m_indices.dtype == torch.int32, f"m_indices {tuple(m_indices.shape)} {m_indices.dtype}"
    i = n // 2
    g = cdiv(i, BLOCK)
    q = torch.empty((m, g * BLOCK), dtype=FP8_DTYPE, device=h.device)
    s = scale_layout(m, g, h.device)
    if m:
        block_m = 16
        _swiglu_quant_kernel[(cdiv(m, block_m), g)](
            h, bias, m_indices.contiguous(), q, s, m, n, g * BLOCK, h.stride(0), bias.stride(0), q.stride(0),
            s.stride(0), s.stride(1), float(limit),
            BLOCK_M=block_m, GROUP=BLOCK, ALPHA=SWIGLU_ALPHA, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, num_warps=4,
        )
    return q, s


def swiglu_quant_reference(h: torch.Tensor, bias: torch.Tensor, m_indices: torch.Tensor,
                           limit: float = 7.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: quantize_act(spec.swiglu(h.float() + bias[e].float(), limit)) per row, K-padded
    with zeros to a multiple of 128; scales row-major [M, ceil(I/128)]. Rows with m_indices -1 are
    zeros here (the kernel leaves them unwritten: compare valid rows only)."""
    valid = (m_indices >= 0)[:, None]
    hb = h.float() + bias[m_indices.long().clamp(min=0)].float()
    a = torch.where(valid, spec.swiglu(hb, limit), 0.0)
    q, s = quantize_act(a)
    pad = cdiv(q.shape[1], BLOCK) * BLOCK - q.shape[1]
    q = torch.nn.functional.pad(q.view(torch.uint8), (0, pad)).view(FP8_DTYPE)
    return q, s

"""FP8 attention operands: Q, K, V in e4m3 with fp32 scales (the ``--attention fp8`` option).

Layouts (T packed token rows, H heads, D head_dim; rows of a ragged batch are packed too, so a
block may straddle two sequences: the scale is a quantization choice, not a semantic one)
-------------------------------------------------------------------------------------------
* Q and K: ``quantize_qk(x [T, H, D])`` -> (x8 float8_e4m3fn [T, H, D], scale float32
  [H, ceil(T/64)]). Block (h, b) covers rows ``64*b : 64*(b+1)`` of head h, all D columns;
  scale = max(amax, ACT_EPS) / 448 and x8 = rne(x / scale) saturated (quant/fp8.py's activation
  rule on a 64 x D block). Dequantized value: ``x8.float() * scale[h, t // 64]``. One scale per
  row of the score tile (Q) and per column (K), so it factors out of Q K^T for any tile shape.
* V: ``quantize_v(v [T, H, D])`` -> (v8t float8_e4m3fn [H, D, T] (V transposed: keys contiguous,
  the K-major layout Hopper's FP8 MMA wants for the P V product), scale float32 [H, D]). One scale
  per (head, channel) over all T rows, which factors out of P V along its output columns for any
  tile shape; V's outliers are per channel. Dequantized value: ``v8t[h, d, t].float() * scale[h, d]``.
* P (the softmax numerators, in [0, 1]): ``e4m3(P * P_SCALE)`` with the fixed P_SCALE = 256, a
  power of two (exact), below 448, that keeps P >= 2^-14 out of e4m3's subnormals.
"""

from __future__ import annotations

import torch

from gptoss_fp8.quant.fp8 import ACT_EPS, FP8_MAX, cdiv, to_fp8_saturating

QK_BLOCK = 64  # rows per Q / K scale block
P_SCALE = 256.0  # P in [0, 1] is stored as e4m3(P * 256)


def quantize_qk(x: torch.Tensor, fp8_max: float = FP8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] float -> (x8 e4m3 [T, H, D], scale fp32 [H, ceil(T/64)]), per 64-row block per head.
    ``fp8_max``: the value a block's amax maps to (448; another e4m3 value for the verdict's noise grids)."""
    assert x.dim() == 3, f"x {tuple(x.shape)}: want [T, H, D]"
    t, h, d = x.shape
    nb = cdiv(t, QK_BLOCK)
    if nb * QK_BLOCK != t:  # (a copy only for a partial last block)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, nb * QK_BLOCK - t))
    xb = x.view(nb, QK_BLOCK, h, d)
    # amax in x's own dtype (exact), the scale and the division in fp32
    scale = xb.abs().amax(dim=(1, 3)).float().clamp(min=ACT_EPS) / fp8_max  # [nb, H]
    x8 = to_fp8_saturating(xb.float() / scale[:, None, :, None]).view(nb * QK_BLOCK, h, d)[:t]
    return x8.contiguous(), scale.t().contiguous()


def quantize_v(v: torch.Tensor, fp8_max: float = FP8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """v [T, H, D] float -> (v8t e4m3 [H, D, T], scale fp32 [H, D]), per (head, channel)."""
    assert v.dim() == 3, f"v {tuple(v.shape)}: want [T, H, D]"
    scale = v.abs().amax(dim=0).float().clamp(min=ACT_EPS) / fp8_max  # [H, D]
    v8t = to_fp8_saturating(v.float() / scale).permute(1, 2, 0).contiguous()
    return v8t, scale


def lin_e4m3(d: torch.Tensor, log2_scale: float = 8.0) -> torch.Tensor:
    """d = log2(P) <= 3/4 (fp32; -inf for a hidden key) -> P * 2^log2_scale (256) as e4m3 with its mantissa read
    linearly (the FP8 attention's ``exp_lin`` / ``p_code="lin"``): the byte round(8 (d + log2_scale) + 56) clamped at
    0 (RNE; a code is 8 E + M: 2^(E - 7) (1 + M / 8) for E >= 1, M 2^-9 below), i.e. 2^floor(d') (1 + frac(d')) for
    d' = d + log2_scale rounded to e4m3's step, not 2^d' rounded: at most 6.1% above 2^d' before the rounding (at
    frac 0.44), exact at the powers of two; zero below d' = -7 (e4m3 rounds 2^d' to zero below -9.5). log2_scale
    other than 8: the verdict's noise grids (P's scale 256 * fp8_max / 448, spec.attention_fp8)."""
    code = torch.round(d.float() * 8.0 + (8.0 * log2_scale + 56.0)).clamp(min=0.0)
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def row_scales(scale: torch.Tensor, t: int) -> torch.Tensor:
    """A Q / K block scale [H, nb] expanded to one value per row: [T, H]."""
    return scale.repeat_interleave(QK_BLOCK, dim=1)[:, :t].t()

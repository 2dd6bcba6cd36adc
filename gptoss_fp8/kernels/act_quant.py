"""Per-token activation quantization to FP8 e4m3, groups of 128 along K (Triton).

Contract (gptoss_fp8.quant.fp8): x [..., K] bf16/fp16/fp32 -> x_fp8 float8_e4m3fn [..., K] and
scale float32 [..., ceil(K/128)], scale = max(amax, 1e-10) / 448 over each group of 128 (the last
group may be partial, e.g. K = 2880 = 22*128 + 64), x_fp8 = rne(x / scale) saturated at +-448.

The rounding to e4m3 (``e4m3``): on the GPU the cast Triton emits, ``cvt.rn.satfinite.e4m3x2.f32``
(round to nearest even, saturating; the Gluon MoE epilogues' cast), one instruction a pair of values.
In Triton's interpreter, whose fp32 -> fp8 cast drops the carry when rounding crosses a binade (e.g.
124.8 -> 64 instead of 128), ``round_to_e4m3`` first (integer arithmetic on the fp32 bits), so the cast
only sees representable values there. The two give the same values; a negative value rounding to
zero is -0 (0x80) from the hardware, as torch's cast, and +0 from ``round_to_e4m3``. Until the
thirty-third session the GPU took ``round_to_e4m3`` too (~10 instructions a value more). ``e4m3`` is
shared with the norm's quantization (norm.py), the MoE's (moe.py, moe_gemm.py, moe_gemv.py,
swiglu_quant.py) and the attention operands' (attn_quant.py).

Division on the GPU: Triton's fp32 ``/`` is not IEEE-rounded (measured on the H200: 29% of
quotients 1 ulp off, max relative 1.7e-7), and neither is torch's CUDA division by a scalar (a
multiplication by the reciprocal). The scales therefore match ``quantize_act`` on CUDA exactly, and
about 6e-5 of the FP8 values land one e4m3 step from torch's (quotients within an ulp of a rounding
tie). ``tl.math.div_rn`` is exact, but a version using it failed the MoE tests on the H200 for a
reason not found within the session (see the notes), so it is not used.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_wait
from gptoss_fp8.quant.fp8 import ACT_EPS, ACT_GROUP, FP8_DTYPE, FP8_MAX, cdiv, quantize_act

# Whether kernels run in Triton's interpreter: read when this module is imported, as triton.jit reads
# TRITON_INTERPRET when it decorates them (tests/conftest.py sets it first on a machine without a GPU).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
# GPTOSS_FP8_E4M3=soft (measurement only, benchmarks/quant_ab.py): the GPU rounds as the interpreter does, with
# round_to_e4m3 before the cast (the kernels before the thirty-third session); the same values.
SOFT_E4M3 = tl.constexpr(INTERPRETED.value or os.environ.get("GPTOSS_FP8_E4M3", "") == "soft")


@triton.jit
def e4m3(q):
    """fp32 values already clamped to [-fp8_max, fp8_max] -> their e4m3 values, round to nearest even, for a
    store: on the GPU the hardware cast (float8e4nv), in the interpreter ``round_to_e4m3``'s fp32 (the store's
    cast is then exact)."""
    if SOFT_E4M3:
        return round_to_e4m3(q)
    else:
        return q.to(tl.float8e4nv)


@triton.jit
def e4m3_saturated(q, FP8_MAX_C: tl.constexpr):
    """fp32 values -> their e4m3 values (``e4m3``), saturated at +-FP8_MAX_C. Where FP8_MAX_C is e4m3's own largest
    value (448) the GPU's cast saturates by itself (cvt.rn.satfinite: the same bytes as clamping first for every
    non-NaN value; a NaN stays NaN, as torch's cast of the reference's quotient, where the clamp made it -448), so
    only the interpreter's ``round_to_e4m3`` and a smaller bound get the clamp: two FMNMX a value fewer on the GPU
    (forty-second session)."""
    if SOFT_E4M3:
        q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    elif FP8_MAX_C != 448.0:
        q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    return e4m3(q)


# two fp32 values ($2, $3) -> the same rounded to bf16, in fp32 ($0, $1): one packed cvt, two bit moves
BF16_ROUND_ASM = tl.constexpr("{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }")


@triton.jit
def bf16_round(x):
    """fp32 values rounded to bf16 (RNE) and kept in fp32, as ``x.to(bfloat16).to(float32)``: on the GPU one packed
    cvt.rn.bf16x2.f32 and two bit moves for two values, where the compiler makes that pair of casts one unpacked F2F a
    value on the XU pipe (the quarter-rate one an attention's exponentials need; forty-second session)."""
    if INTERPRETED:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return tl.inline_asm_elementwise(BF16_ROUND_ASM, "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def round_to_e4m3(q):
    """Round fp32 values already clamped to [-448, 448] to the nearest e4m3 value (ties to even).

    Returns fp32 holding exactly representable e4m3 values, so a following cast is exact.
    """
    # Normal e4m3 range (|q| >= 2^-6): keep 3 mantissa bits of the fp32 pattern, round to nearest
    # even on the 20 dropped bits; a mantissa carry moves into the exponent as it should.
    bits = q.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    bits = (bits + 0x7FFFF + lsb) & -1048576  # -1048576 == 0xFFF00000 as int32
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range (|q| < 2^-6): fixed spacing 2^-9. Adding 1.5 * 2^14 (whose fp32 ulp is
    # 2^-9) rounds to that grid with the FPU's round-to-nearest-even.
    magic = 24576.0
    sub = (q + magic) - magic
    return tl.where(tl.abs(q) < 0.015625, sub, normal)


@triton.jit
def group_scale(amax, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr):
    """Per-row scale max(amax, eps) / 448."""
    return tl.maximum(amax, EPS) / FP8_MAX_C


@triton.jit
def quantize_with_scale(x, scale, FP8_MAX_C: tl.constexpr):
    """x [BLOCK_M, G] fp32, scale [BLOCK_M] -> e4m3 values rne(x / scale) saturated (``e4m3_saturated``: for a
    store)."""
    return e4m3_saturated(x / scale[:, None], FP8_MAX_C)


@triton.jit
def quantize_group_rows(x, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr):
    """x [BLOCK_M, G] fp32 (one group per row, masked entries 0) -> (q e4m3 values, scale [BLOCK_M])."""
    scale = group_scale(tl.max(tl.abs(x), axis=1), FP8_MAX_C, EPS)
    return quantize_with_scale(x, scale, FP8_MAX_C), scale


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K, K_OUT, stride_xm, stride_qm, stride_sm, stride_sg,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, PDL: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_g * GROUP + tl.arange(0, GROUP)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    rows = offs_m.to(tl.int64)
    pdl_wait(PDL)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_group_rows(x, FP8_MAX_C, EPS)
    # columns K..K_OUT (a K-padded output) get the zeros loaded there
    out_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K_OUT)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q.to(q_ptr.dtype.element_ty), mask=out_mask)
    tl.store(s_ptr + rows * stride_sm + pid_g * stride_sg, scale, mask=offs_m < M)


def act_quant(x: torch.Tensor, group: int = ACT_GROUP, *, pad_k: bool = False,
              col_major_scale: bool = False, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token in groups of 128 along the last dimension.

    x: [..., K] bf16 / fp16 / fp32, last dimension contiguous. Returns (x_fp8 float8_e4m3fn
    [..., K] contiguous, scale float32 [..., ceil(K/128)]), bit-identical to
    ``gptoss_fp8.quant.fp8.quantize_act`` in the interpreter; on the GPU up to the division
    rounding described above.

    For DeepGEMM (kernels/deepgemm.py), x 2-D [M, K]: ``pad_k`` writes x_fp8 [M, round_up(K, 128)]
    with zeros in columns K.. (same bits before them, same scales: the padding is in the last
    group, whose amax it does not change); ``col_major_scale`` writes the scales [M, ceil(K/128)]
    column-major with the column stride M rounded up to 4 (16-byte TMA alignment), the layout
    DeepGEMM reads without a transposing copy (``scale_layout``). ``pdl``: launch with programmatic
    dependent launch (kernels/pdl.py).
    """
    assert group == ACT_GROUP, f"only groups of {ACT_GROUP} are supported, got {group}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x dtype {x.dtype}"
    assert x.shape[-1] > 0, f"empty last dimension in {tuple(x.shape)}"
    assert not (pad_k or col_major_scale) or x.dim() == 2, f"pad_k / col_major_scale take 2-D x, got {tuple(x.shape)}"
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    g = cdiv(k, group)
    k_out = g * group if pad_k else k
    q = torch.empty((m, k_out), dtype=FP8_DTYPE, device=x.device)
    s = scale_layout(m, g, x.device) if col_major_scale else torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m > 0:
        block_m = 16
        grid = (cdiv(m, block_m), g)
        _act_quant_kernel[grid](
            x2, q, s, m, k, k_out, x2.stride(0), q.stride(0), s.stride(0), s.stride(1),
            BLOCK_M=block_m, GROUP=group, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, PDL=pdl, num_warps=4,
            **launch_kwargs(pdl),
        )
    if pad_k or col_major_scale:
        return q, s
    return q.reshape(*lead, k), s.reshape(*lead, g)


def scale_layout(m: int, g: int, device: torch.device | str) -> torch.Tensor:
    """An empty float32 [m, g] scale tensor in DeepGEMM's activation-scale layout: column-major,
    columns m rounded up to 4 apart (strides (1, round_up(m, 4)): TMA needs 16-byte aligned columns)."""
    m_al = cdiv(max(m, 1), 4) * 4
    return torch.empty((g, m_al), dtype=torch.float32, device=device).t()[:m]


def act_quant_reference(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch specification (quant/fp8.py owns it)."""
    return quantize_act(x, group)

"""The fused MoE's grouped FP8 expert GEMMs on Triton: gate_up + bias + clamped SwiGLU + FP8 quantization,
and down + bias scattered back to (token, slot) rows.

Contract (shapes checked by ``moe.moe_expert_slots``, the entry point): rows come in padded
sorted order from ``moe_align`` (segments of ALIGN_M rows, one expert per row tile; BLOCK_M
divides ALIGN_M). gate_up: A rows gathered from x_fp8 [T, H] by token (slot // TOP_K) with pointer
loads; W13 fp8 [E, 2I, H] with gate/up rows interleaved (2j = gate j, 2j+1 = up j), scale_inv
[E, ceil(2I/128), ceil(H/128)], bias [E, 2I]; BLOCK_N = 256 interleaved columns = one 128-wide
group of the SwiGLU output, so the epilogue (bias, glu = g.clamp(max=limit), lin =
u.clamp(-limit, limit), glu * sigmoid(1.702 glu) * (lin + 1), all fp32) quantizes it per row to
FP8 e4m3 with one float32 scale per 128 outputs: act [max_rows, I], act_scale [max_rows,
ceil(I/128)] in sorted order. down: A = act (sorted rows, TMA), W2 fp8 [E, H, I], scale_inv
[E, ceil(H/128), ceil(I/128)], bias [E, H]; BLOCK_N <= 128 (256-wide down tiles were slower,
notes/kernels_gemm.md, third session); the fp32 accumulator + bias rounded once to y's dtype,
row written to y[slot]. Both share ``fp8_block_mainloop`` (fp8_gemm.py): per 128-wide K block,
the fp8 product scaled by s_a[row] * s_w[col block] into fp32 (promotion every 128).
With ``tma`` the weights come through a descriptor over W viewed as [E * N, K]: a tile past an
expert's N rows reads the next expert's rows, which only feed masked columns.
Not done here: routing, alignment, combine (moe.py, moe_align.py); the Gluon gate_up is moe_ws.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gptoss_fp8.kernels.act_quant import group_scale, quantize_with_scale
from gptoss_fp8.kernels.config import TritonTile
from gptoss_fp8.kernels.fp8_gemm import fp8_block_mainloop, store_rows
from gptoss_fp8.quant.fp8 import ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX, cdiv
from gptoss_fp8.spec import SWIGLU_ALPHA


def check_expert_weights(name, w, s, b, n, k, e):
    """One expert tensor triple's shapes, dtypes and layout: w fp8 [e, n, k], scale_inv float32
    [e, ceil(n/128), ceil(k/128)], bias [e, n] bf16 / fp32, all contiguous (one assert each)."""
    assert w.dtype == FP8_DTYPE and w.shape == (e, n, k), f"{name} {tuple(w.shape)} {w.dtype}, expected fp8 [{e}, {n}, {k}]"
    assert s.dtype == torch.float32 and s.shape == (e, cdiv(n, BLOCK), cdiv(k, BLOCK)), (
        f"{name} scale_inv {tuple(s.shape)} {s.dtype} does not fit {tuple(w.shape)}"
    )
    assert b.shape == (e, n) and b.dtype in (torch.bfloat16, torch.float32), f"{name} bias {tuple(b.shape)} {b.dtype}"
    assert w.is_contiguous() and s.is_contiguous() and b.is_contiguous(), f"{name} tensors must be contiguous"


def check_experts(w13, s13, b13, w2, s2, b2, h: int) -> tuple[int, int]:
    """The MoE launchers' expert tensors for hidden size h: gate_up [E, 2I, H] (rows interleaved,
    so 2I even) and down [E, H, I] (``check_expert_weights`` each), H and I multiples of 16.
    Returns (E, I)."""
    e, two_i = w13.shape[0], w13.shape[1]
    assert two_i % 2 == 0, f"gate_up rows {two_i} must be even (interleaved gate/up)"
    i = two_i // 2
    check_expert_weights("gate_up", w13, s13, b13, two_i, h, e)
    check_expert_weights("down", w2, s2, b2, h, i, e)
    assert h % 16 == 0 and i % 16 == 0, f"H={h} and I={i} must be multiples of 16"
    return e, i



@triton.jit
def _moe_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, out_s_ptr,
    slots_ptr, block_expert_ptr,
    N, K, num_slots, num_experts, num_m_blocks,
    stride_am, stride_asm,
    stride_be, stride_bn, stride_bse, stride_bsn, stride_biase,
    stride_om, stride_osm,
    limit,
    FUSE_SWIGLU: tl.constexpr, TOP_K: tl.constexpr, TMA: tl.constexpr, ALIGN_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, ALPHA: tl.constexpr, SPLIT_N: tl.constexpr = True,
):
    """One row tile (one expert) x one column tile of a grouped FP8 block GEMM.

    FUSE_SWIGLU (gate_up): A rows gathered from x by token (slot // TOP_K) with pointer loads; the
    epilogue adds the bias, applies the clamped SwiGLU to interleaved gate/up columns and writes
    FP8 + 1x128 scales in padded sorted row order; SPLIT_N: the 256 columns as two 128-column
    products. Otherwise (down): A rows are the padded sorted rows (through TMA with TMA), the
    epilogue adds the bias and scatters rows to their (token, slot) index.
    TMA: the weights come through a tensor descriptor over W viewed as [E * N, K].
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    # Experts' segments are padded to ALIGN_M rows, a multiple of BLOCK_M: one expert per tile.
    expert32 = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ALIGN_M)
    if expert32 >= num_experts:
        return
    expert = expert32.to(tl.int64)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + offs_r)
    valid = slots < num_slots
    if FUSE_SWIGLU:
        a_rows = (tl.where(valid, slots, 0) // TOP_K).to(tl.int64)
    else:
        a_rows = offs_r.to(tl.int64)
    if TMA:
        b_src = b_ptr
    else:
        b_src = b_ptr + expert * stride_be
    acc_lo, acc_hi = fp8_block_mainloop(
        a_ptr, pid_m * BLOCK_M, a_rows, stride_am, as_ptr, stride_asm,
        b_src, expert32 * N + pid_n * BLOCK_N, pid_n * BLOCK_N, N, stride_bn, bs_ptr + expert * stride_bse, stride_bsn,
        K, BLOCK_M, BLOCK_N, BLOCK_K, TMA and not FUSE_SWIGLU, TMA, SPLIT_N,
    )
    bias_e = bias_ptr + expert * stride_biase
    if FUSE_SWIGLU:
        # BLOCK_N = 256 interleaved gate/up columns = two halves of 64 (gate, up) pairs: one
        # 128-wide group of the SwiGLU output, quantized with one scale per row.
        rows = offs_r.to(tl.int64)
        c0 = pid_n * BLOCK_K
        if SPLIT_N:
            h_lo = _bias_swiglu(acc_lo, bias_e, pid_n * BLOCK_N, N, limit, ALPHA, BLOCK_K)
            h_hi = _bias_swiglu(acc_hi, bias_e, pid_n * BLOCK_N + BLOCK_K, N, limit, ALPHA, BLOCK_K)
            amax = tl.maximum(tl.max(tl.abs(h_lo), axis=1), tl.max(tl.abs(h_hi), axis=1))
            scale = group_scale(amax, FP8_MAX_C, EPS)
            store_rows(out_ptr, rows, valid, quantize_with_scale(h_lo, scale, FP8_MAX_C), c0, N // 2, stride_om, out_ptr,
                       False, BLOCK_K // 2)
            store_rows(out_ptr, rows, valid, quantize_with_scale(h_hi, scale, FP8_MAX_C), c0 + BLOCK_K // 2, N // 2,
                       stride_om, out_ptr, False, BLOCK_K // 2)
        else:  # one 256-wide accumulator: its SwiGLU is the whole 128-wide group
            h = _bias_swiglu(acc_lo, bias_e, pid_n * BLOCK_N, N, limit, ALPHA, BLOCK_N)
            scale = group_scale(tl.max(tl.abs(h), axis=1), FP8_MAX_C, EPS)
            store_rows(out_ptr, rows, valid, quantize_with_scale(h, scale, FP8_MAX_C), c0, N // 2, stride_om, out_ptr,
                       False, BLOCK_K)
        tl.store(out_s_ptr + rows * stride_osm + pid_n, scale, mask=valid)
    else:
        rows = tl.where(valid, slots, 0).to(tl.int64)
        store_rows(out_ptr, rows, valid, acc_lo, pid_n * BLOCK_N, N, stride_om, bias_e, True, BLOCK_N)


@triton.jit
def _bias_swiglu(acc, bias_ptr, col0, N, limit, ALPHA: tl.constexpr, WIDTH: tl.constexpr):
    """acc [BM, WIDTH] interleaved gate/up columns col0.. (+ bias) -> clamped SwiGLU [BM, WIDTH // 2].

    Columns past N read as zero, so their SwiGLU output is exactly zero and stays out of the amax.
    """
    offs_n = col0 + tl.arange(0, WIDTH)
    n_mask = offs_n < N
    acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc = tl.where(n_mask[None, :], acc, 0.0)
    gate, up = tl.split(tl.reshape(acc, (acc.shape[0], WIDTH // 2, 2)))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(ALPHA * gate) * (up + 1.0)


def gate_up_triton(x_fp8: torch.Tensor, x_scale: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor,
                   b13: torch.Tensor, act: torch.Tensor, act_scale: torch.Tensor, sorted_slots: torch.Tensor,
                   block_expert: torch.Tensor, top_k: int, swiglu_limit: float, align_m: int, tma: bool,
                   tile: TritonTile) -> None:
    """act, act_scale (sorted rows) <- FP8(SwiGLU(x_fp8[token] @ W13[e]^T + b13[e])) (module doc)."""
    e, two_i, h = w13.shape
    max_rows = sorted_slots.shape[0]
    assert tile.block_n == 2 * BLOCK, "the SwiGLU-quant epilogue needs 256 gate/up columns per tile"
    assert align_m % tile.block_m == 0, f"BLOCK_M {tile.block_m} must divide ALIGN_M {align_m}"
    w13_box = [BLOCK if tile.split_n else 2 * BLOCK, BLOCK]
    w13_src = TensorDescriptor.from_tensor(w13.view(e * two_i, h), w13_box) if tma else w13
    grid = (max_rows // tile.block_m * cdiv(two_i, 2 * BLOCK),)
    _moe_gemm_kernel[grid](
        x_fp8, x_scale, w13_src, w13_scale_inv, b13, act, act_scale,
        sorted_slots, block_expert,
        two_i, h, top_k * x_fp8.shape[0], e, max_rows // tile.block_m,
        x_fp8.stride(0), x_scale.stride(0),
        w13.stride(0), w13.stride(1), w13_scale_inv.stride(0), w13_scale_inv.stride(1), b13.stride(0),
        act.stride(0), act_scale.stride(0),
        float(swiglu_limit),
        FUSE_SWIGLU=True, TOP_K=top_k, TMA=tma, ALIGN_M=align_m, BLOCK_M=tile.block_m, BLOCK_N=2 * BLOCK,
        BLOCK_K=BLOCK, GROUP_M=tile.group_m, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, ALPHA=SWIGLU_ALPHA,
        SPLIT_N=tile.split_n, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def down_triton(act: torch.Tensor, act_scale: torch.Tensor, w2: torch.Tensor, w2_scale_inv: torch.Tensor,
                b2: torch.Tensor, y: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor,
                top_k: int, align_m: int, tma: bool, tile: TritonTile) -> None:
    """y[slot] <- act[sorted row] @ W2[e]^T + b2[e], rounded once to y's dtype (module doc)."""
    e, h, i = w2.shape
    max_rows = sorted_slots.shape[0]
    bm, bn = tile.block_m, tile.block_n
    assert bn in (16, 32, 64, 128), f"down BLOCK_N={bn}: tiles must lie inside one 128-column weight block"
    assert align_m % bm == 0, f"BLOCK_M {bm} must divide ALIGN_M {align_m}"
    if tma:
        act_src = TensorDescriptor.from_tensor(act, [bm, BLOCK])
        w2_src = TensorDescriptor.from_tensor(w2.view(e * h, i), [bn, BLOCK])
    else:
        act_src, w2_src = act, w2
    grid = (max_rows // bm * cdiv(h, bn),)
    _moe_gemm_kernel[grid](
        act_src, act_scale, w2_src, w2_scale_inv, b2, y, y,
        sorted_slots, block_expert,
        h, i, y.shape[0], e, max_rows // bm,
        act.stride(0), act_scale.stride(0),
        w2.stride(0), w2.stride(1), w2_scale_inv.stride(0), w2_scale_inv.stride(1), b2.stride(0),
        y.stride(0), 0,
        0.0,
        FUSE_SWIGLU=False, TOP_K=top_k, TMA=tma, ALIGN_M=align_m, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK,
        GROUP_M=tile.group_m, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, ALPHA=SWIGLU_ALPHA,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )

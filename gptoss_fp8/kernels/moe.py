"""Fused FP8 mixture-of-experts FFN for gpt-oss: routing, dispatch and combine, with expert-parallel ranks.

Pipeline for x [T, H] bf16, top-k routing, a rank holding experts [e0, e0 + E_local):
1. routing (``fused_moe``: ``spec.route``, OpenAI's bf16 router; kernels/router.py has the
   one-kernel form): top-k expert ids and their softmax weights.
2. ``moe_align`` (moe_align.py): the T*k (token, slot) pairs routed to local experts grouped by
   expert, each segment padded to ALIGN_M rows; pairs routed to other ranks are dropped.
3. x's 1x128 FP8 quantization: the caller's (``x_quant``, e.g. from the norm's pass) or ``act_quant``.
4. gate_up + bias + clamped SwiGLU + FP8 quantization of the intermediate, then down + bias
   (moe_gemm.py on Triton; on sm_90 the gate_up runs as the Gluon kernel of moe_ws.py, which reads
   A pre-gathered in sorted row order: ``gather_act_quant``, rows copied from ``x_quant``, walking the tokens
   with ``moe_align_rows``' slot -> row map where ``KernelConfig.moe_gather_by_token``).
5. ``moe_combine``: out[t] = sum over the token's local slots of weight * y (fp32 sum, bf16 out).
   On an expert-parallel rank the result is that rank's partial sum; one all-reduce across ranks
   gives the full FFN (each expert's bias is counted once, on the rank that holds it).

Layouts: W13 fp8 [E, 2I, H] (gate/up rows interleaved) with scale_inv [E, ceil(2I/128),
ceil(H/128)] and bias [E, 2I]; W2 fp8 [E, H, I] with scale_inv [E, ceil(H/128), ceil(I/128)] and
bias [E, H]; H and I multiples of 16. Tiles: ``KernelConfig.moe_plan`` (kernels/config.py); up to
``KernelConfig.moe_skinny_max_slots`` (token, slot) pairs (decode) steps 2-4 are moe_gemv.py's two
launches instead.
Not done here: the expert-parallel all-reduce, token dropping / capacity limits.
Reference: ``spec.moe_w8a8`` (``spec.moe_experts_w8a8`` for the per-slot outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_fp8 import spec
from gptoss_fp8.kernels import moe_ws
from gptoss_fp8.kernels.act_quant import act_quant, group_scale, quantize_group_rows
from gptoss_fp8.kernels.config import DEFAULT, GluonTile, KernelConfig, MoePlan
from gptoss_fp8.kernels.moe_align import moe_align, moe_align_reference, moe_align_rows  # noqa: F401 - re-exported
from gptoss_fp8.kernels.moe_gemm import SWIGLU_ALPHA, check_experts, down_triton, gate_up_triton
from gptoss_fp8.kernels.pdl import pdl_launch
from gptoss_fp8.quant.fp8 import ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX, cdiv, next_pow2


@triton.jit
def _moe_combine_kernel(
    y_ptr, w_ptr, ids_ptr, out_ptr,
    H, expert_start, num_experts, stride_ym, stride_om,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_IDS: tl.constexpr,
):
    """out[t] = sum over slots j (routed to this rank, with HAS_IDS) of w[t, j] * y[t*TOP_K + j]
    (fp32 products and sum, one rounding)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        here = h_mask
        if HAS_IDS:
            e = tl.load(ids_ptr + t * TOP_K + j) - expert_start
            here = here & (e >= 0) & (e < num_experts)
        wj = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        y = tl.load(y_ptr + (t * TOP_K + j) * stride_ym + offs_h, mask=here, other=0.0).to(tl.float32)
        acc += wj * y
    tl.store(out_ptr + t * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def moe_combine(
    y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor | None = None, expert_start: int = 0,
    num_experts: int = 0, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of per-slot expert outputs: y [T*k, H] or [T, k, H] (bf16/fp32, last dim
    contiguous), weights [T, k] -> bf16 [T, H]. With ``ids`` (int32 [T, k] global expert ids), only
    slots routed to experts [expert_start, expert_start + num_experts) count (the others' rows of y
    are never read). ``out``: bf16 [T, H] with a contiguous last dim (e.g. rows of a larger buffer)
    to write into and return, instead of a new tensor."""
    t, k = weights.shape
    h = y.shape[-1]
    y2 = y.reshape(t * k, h)
    assert y2.stride(-1) == 1, "y needs a contiguous last dimension"
    if out is None:
        out = torch.empty((t, h), dtype=torch.bfloat16, device=y.device)
    assert out.shape == (t, h) and out.dtype == torch.bfloat16 and out.stride(-1) == 1, (
        f"out {tuple(out.shape)} {out.dtype} strides {out.stride()}: want bf16 [{t}, {h}], last dim contiguous")
    if t == 0:
        return out
    block_h = min(1024, next_pow2(h))
    ids_arg = ids.contiguous() if ids is not None else weights
    _moe_combine_kernel[(t, cdiv(h, block_h))](
        y2, weights.contiguous(), ids_arg, out, h, expert_start, num_experts, y2.stride(0), out.stride(0),
        TOP_K=k, BLOCK_H=block_h, HAS_IDS=ids is not None, num_warps=4,
    )
    return out


@triton.jit
def _zero_foreign_kernel(ids_ptr, y_ptr, n_slots, H, expert_start, num_experts, stride_ym,
                         BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    """y[slot] = 0 for every slot routed outside [expert_start, expert_start + num_experts).
    A block of slots with none routed elsewhere (every block, on a single rank) only reads its ids."""
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    e = tl.load(ids_ptr + offs_s, mask=offs_s < n_slots, other=expert_start) - expert_start
    foreign = (offs_s < n_slots) & ((e < 0) | (e >= num_experts))
    if tl.max(foreign.to(tl.int32), 0) > 0:
        rows = y_ptr + offs_s.to(tl.int64)[:, None] * stride_ym
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            tl.store(rows + offs_h[None, :], tl.zeros((BLOCK_S, BLOCK_H), dtype=y_ptr.dtype.element_ty),
                     mask=foreign[:, None] & (offs_h < H)[None, :])


def zero_foreign_rows(topk_ids: torch.Tensor, y: torch.Tensor, expert_start: int, num_experts: int) -> None:
    """y[slot] = 0 (in place) for the slots of topk_ids [T, k] (int32, contiguous) routed outside
    [expert_start, expert_start + num_experts); y [T*k, H] with a contiguous last dim."""
    n_slots, h = y.shape
    assert topk_ids.numel() == n_slots and topk_ids.is_contiguous() and y.stride(-1) == 1
    if n_slots:
        _zero_foreign_kernel[(cdiv(n_slots, 16),)](
            topk_ids, y, n_slots, h, expert_start, num_experts, y.stride(0), BLOCK_S=16,
            BLOCK_H=min(512, next_pow2(h)), num_warps=4,
        )


@triton.jit
def _gather_act_quant_kernel(
    x_ptr, xs_ptr, slots_ptr, q_ptr, s_ptr,
    M, K, num_slots, stride_xm, stride_xsm, stride_qm, stride_sm, stride_sg,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr,
    FROM_QUANT: tl.constexpr = False, GROUPS: tl.constexpr = 1,
):
    """Row r of the output = act_quant(x[slots[r] // TOP_K]) (zeros for padding rows, with the
    scale act_quant gives a zero row), GROUPS groups of GROUP columns a program. FROM_QUANT: x is
    that quantization already (x_ptr its FP8 bytes as uint8, xs_ptr its scales): the row's bytes and
    scale are copied, not recomputed."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    slots = tl.load(slots_ptr + offs_m, mask=m_ok, other=num_slots)
    valid = slots < num_slots
    src = (tl.where(valid, slots, 0) // TOP_K).to(tl.int64)
    rows = offs_m.to(tl.int64)
    for j in tl.static_range(GROUPS):
        g = tl.program_id(1) * GROUPS + j
        offs_k = g * GROUP + tl.arange(0, GROUP)
        k_ok = offs_k < K
        x_ptrs = x_ptr + src[:, None] * stride_xm + offs_k[None, :]
        if FROM_QUANT:
            q = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0)  # e4m3 bytes; 0 = +0.0 (padding)
            scale = tl.load(xs_ptr + src * stride_xsm + g, mask=valid & (g * GROUP < K), other=0.0)
            scale = tl.where(valid, scale, group_scale(tl.zeros([BLOCK_M], dtype=tl.float32), FP8_MAX_C, EPS))
        else:
            x = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            q, scale = quantize_group_rows(x.to(tl.float32), FP8_MAX_C, EPS)
        tl.store(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & k_ok[None, :])
        tl.store(s_ptr + rows * stride_sm + g * stride_sg, scale, mask=m_ok & (g * GROUP < K))


@triton.jit
def _gather_by_token_kernel(
    xq_ptr, xs_ptr, rows_ptr, slots_ptr, q_ptr, s_ptr,
    T, M, K, num_slots, stride_xm, stride_xsm, stride_qm, stride_sm, stride_sg,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, COLS: tl.constexpr, PAD_M: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX_C: tl.constexpr, EPS: tl.constexpr,
):
    """``gather_act_quant``'s rows from x's quantization, the bytes walked in token order: the first
    cdiv(T, BLOCK_T) programs read BLOCK_T tokens' FP8 rows once, COLS columns at a time, and store them into each
    of their TOP_K slots' rows (rows_ptr: slot -> row, -1 for a slot with none); the programs after them each take
    PAD_M sorted rows: their scales copied in sorted order (the tokens' scales, T * ceil(K / GROUP) * 4 bytes, stay
    in L2; written so, a group's scales land in whole sectors, where the token walk would scatter 4-byte stores), and
    the padding rows among them (slot >= num_slots) zero bytes with act_quant's scale of a zero row."""
    pid = tl.program_id(0)
    n_tok = tl.cdiv(T, BLOCK_T)
    if pid < n_tok:
        tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = tok < T
        src = tok.to(tl.int64)
        for c0 in range(0, K, COLS):
            cols = c0 + tl.arange(0, COLS)
            c_ok = cols < K
            v = tl.load(xq_ptr + src[:, None] * stride_xm + cols[None, :], mask=t_ok[:, None] & c_ok[None, :])
            for j in tl.static_range(TOP_K):  # (the rows' indices again each step: L1 hits, no registers held)
                row = tl.load(rows_ptr + tok * TOP_K + j, mask=t_ok, other=-1)
                d = tl.where(row >= 0, row, 0).to(tl.int64)
                tl.store(q_ptr + d[:, None] * stride_qm + cols[None, :], v, mask=(row >= 0)[:, None] & c_ok[None, :])
    else:
        offs = (pid - n_tok) * PAD_M + tl.arange(0, PAD_M)
        m_ok = offs < M
        slot = tl.load(slots_ptr + offs, mask=m_ok, other=num_slots)
        valid = slot < num_slots
        pad = m_ok & ~valid
        rows = offs.to(tl.int64)
        tok_p = (tl.where(valid, slot, 0) // TOP_K).to(tl.int64)
        zero_scale = group_scale(tl.zeros([PAD_M], dtype=tl.float32), FP8_MAX_C, EPS)
        for g in range(0, tl.cdiv(K, GROUP)):
            sc = tl.load(xs_ptr + tok_p * stride_xsm + g, mask=valid, other=0.0)
            tl.store(s_ptr + rows * stride_sm + g * stride_sg, tl.where(valid, sc, zero_scale), mask=m_ok)
        if tl.max(pad.to(tl.int32), axis=0) > 0:
            for c0 in range(0, K, COLS):
                pcols = c0 + tl.arange(0, COLS)
                tl.store(q_ptr + rows[:, None] * stride_qm + pcols[None, :], tl.zeros([PAD_M, COLS], tl.uint8),
                         mask=pad[:, None] & (pcols < K)[None, :])


def gather_by_token_tile(tokens: int) -> tuple[int, int]:
    """gather_act_quant(slot_rows=)'s program, (tokens, columns a step): 8 tokens, 256 columns a step (H100, the 20b's
    32768 tokens, scales MN-major, benchmarks/moe_parts.py, forty-fourth session: 208.5-209.2 us against 303.0-303.6
    for the sorted walk; 16 x 128 230.6, 8 x 128 213.0, 8 x 512 211.1, 32 x 64 254.9)."""
    return (8, 256)


def gather_tile(rows: int, groups: int) -> tuple[int, int]:
    """gather_act_quant's program, (rows, groups of 128 columns), by the rows it writes (H200, the 20b's rows copied
    from x_quant, benchmarks/moe_parts.py, twenty-sixth session): whole rows of 8 from 65536 rows on (135168 rows,
    32768 tokens: 252 us, 3.2 TB/s, against 359 us for the 16 x 1 tile before), 16 x 4 below (36864 rows: 57 us
    against 59)."""
    return (8, groups) if rows >= 65536 else (16, 4)


def gather_act_quant(x: torch.Tensor, sorted_slots: torch.Tensor, top_k: int,
                     x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
                     tile: tuple[int, int] | None = None,
                     scale_mn_major: bool = False,
                     slot_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate_up GEMM's A operand in padded sorted row order: row r is the 1x128 FP8 quantization
    of x[sorted_slots[r] // top_k] (``act_quant``'s numerics; a token routed to k experts is
    quantized k times, identically); padding rows (slot >= T*k) are zeros. Lets gate_up read A
    through TMA like the down GEMM, instead of gathering rows with pointer loads.
    x_quant: ``act_quant(x)`` (x_fp8 [T, H], scale [T, ceil(H/128)], last dims contiguous) when the
    caller has it; its rows are then copied (half the bytes of x read, no quantization), same bits.
    tile: (rows, groups of 128 columns) a program (None: ``gather_tile``'s). scale_mn_major: the
    scales [M, g] laid out MN-major (stride (1, M): a group's rows contiguous, what the wide gate_up
    with ``GluonTile.stage_scales`` copies into its stages), same values.
    slot_rows (with x_quant: ``moe_align_rows``' inverse map, each slot's row or -1): the same output written
    walking the tokens in order (``_gather_by_token_kernel``): each token's FP8 row read once and stored into
    its k rows, where the sorted walk reads it k times from wherever it lies (x_quant larger than L2: k reads
    from DRAM); tile then (tokens, columns a step) a program (None: ``gather_by_token_tile``'s)."""
    t, h = x.shape
    m = sorted_slots.shape[0]
    g = cdiv(h, BLOCK)
    q = torch.empty((m, h), dtype=FP8_DTYPE, device=x.device)
    if scale_mn_major:
        s = torch.empty((g, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if x_quant is not None:
        xq, xs = x_quant
        assert xq.shape == x.shape and xq.dtype == FP8_DTYPE and xq.stride(-1) == 1, (
            f"x_quant {tuple(xq.shape)} {xq.dtype} does not fit x {tuple(x.shape)}")
        assert xs.shape == (t, g) and xs.dtype == torch.float32 and xs.stride(-1) == 1, f"x_quant scale {tuple(xs.shape)}"
        src, src_s, out = xq.view(torch.uint8), xs, q.view(torch.uint8)
    else:
        src, src_s, out = x, x, q  # src_s unused
    if m and slot_rows is not None:
        assert x_quant is not None, "gather_act_quant(slot_rows=) copies rows from x_quant: pass it"
        assert slot_rows.shape == (t * top_k,) and slot_rows.dtype == torch.int32, f"slot_rows {tuple(slot_rows.shape)}"
        block_t, cols = tile or gather_by_token_tile(t)
        pad_m = 128
        _gather_by_token_kernel[(cdiv(t, block_t) + cdiv(m, pad_m),)](
            src, src_s, slot_rows, sorted_slots, out, s, t, m, h, t * top_k, src.stride(0), src_s.stride(0),
            q.stride(0), s.stride(0), s.stride(1),
            TOP_K=top_k, BLOCK_T=block_t, COLS=cols, PAD_M=pad_m, GROUP=BLOCK, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS,
            num_warps=4,
        )
    elif m:
        block_m, groups = tile or gather_tile(m, g)
        _gather_act_quant_kernel[(cdiv(m, block_m), cdiv(g, groups))](
            src, src_s, sorted_slots, out, s, m, h, t * top_k, src.stride(0), src_s.stride(0), q.stride(0), s.stride(0),
            s.stride(1),
            TOP_K=top_k, BLOCK_M=block_m, GROUP=BLOCK, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, FROM_QUANT=x_quant is not None,
            GROUPS=groups, num_warps=4,
        )
    return q, s


def moe_expert_slots(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor,
    expert_start: int = 0,
    swiglu_limit: float = 7.0,
    config: KernelConfig | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    zero_foreign: bool = True,
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """Per-(token, slot) expert outputs [T*k, H] in ``out_dtype``, before the weighted combine.

    Same argument layout as ``moe_experts``. Row t*k + j is expert(x[t]) + bias for slot j of token
    t, the fp32 accumulator rounded once to out_dtype. Slots routed to experts outside
    [expert_start, expert_start + E) are zero (``zero_foreign``) or left unwritten. ``x_quant``:
    x's ``act_quant`` (x_fp8 [T, H], scale [T, ceil(H/128)]) when the caller already has it.
    ``config``: the tuning (None: kernels/config.DEFAULT); ``plan``: these launches instead of
    ``config.moe_plan``'s choice (a ``GluonTile`` gate_up forces the Gluon kernel). x None: ``x_quant`` alone
    (a norm that left its bf16 rows out: every launch below reads the quantization when given).
    """
    if x is None:
        assert x_quant is not None, "moe_expert_slots needs x or its quantization x_quant"
        x = x_quant[0]  # (its shape and device; the rows' values are read from x_quant alone)
    else:
        assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x {tuple(x.shape)} {x.dtype}"
    assert x.dim() == 2, f"x {tuple(x.shape)}"
    t, h = x.shape
    e, i = check_experts(w13, w13_scale_inv, b13, w2, w2_scale_inv, b2, h)
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t, f"topk ids {tuple(topk_ids.shape)} do not fit x {tuple(x.shape)}"
    assert topk_ids.dtype == torch.int32, f"topk_ids must be int32, got {topk_ids.dtype}"
    if x_quant is not None:
        xq, xs = x_quant
        assert xq.shape == x.shape and xq.dtype == FP8_DTYPE and xq.stride(-1) == 1, (
            f"x_quant {tuple(xq.shape)} {xq.dtype} does not fit x {tuple(x.shape)}"
        )
        assert xs.shape == (t, cdiv(h, BLOCK)) and xs.stride(-1) == 1, f"x_quant scale {tuple(xs.shape)}"
    k = topk_ids.shape[1]
    n_slots = t * k
    y = torch.empty((n_slots, h), dtype=out_dtype, device=x.device)
    if t == 0:
        return y
    topk_ids = topk_ids.contiguous()
    cfg = config or DEFAULT
    if plan is None and cfg.moe_skinny_max_slots is not None and n_slots <= cfg.moe_skinny_max_slots:
        # decode-sized: kernels/moe_gemv.py, two launches, no alignment (foreign rows zeroed there)
        from gptoss_fp8.kernels.moe_gemv import WGMMA_TILE, moe_slots_skinny

        x_fp8, x_scale = x_quant if x_quant is not None else act_quant(x.contiguous())
        return moe_slots_skinny(x_fp8, x_scale, topk_ids, w13, w13_scale_inv, b13, w2, w2_scale_inv, b2, expert_start,
                                swiglu_limit, y, zero_foreign, WGMMA_TILE if cfg.moe_skinny_wgmma else None,
                                pdl=pdl_launch(cfg, t, x.device))
    if zero_foreign:  # only rows of slots routed to other ranks' experts are written (none with one rank)
        zero_foreign_rows(topk_ids, y, expert_start, e)
    gluon_ok = cfg.gluon_on(x.device)
    plan = plan or cfg.moe_plan(t, k, e, gluon_ok)
    align = plan.align_m
    gluon_gu = isinstance(plan.gate_up, GluonTile)
    if gluon_gu:
        gu_rows = plan.gate_up.block_m or moe_ws.TILE_M
        assert gluon_ok and align == gu_rows and plan.tma, (
            f"a GluonTile gate_up needs config.gluon, an sm_90 GPU, triton with Gluon, TMA and "
            f"ALIGN_M={gu_rows} (got {align})")
        moe_ws.check_promote(plan.gate_up.promote, gu_rows == moe_ws.WIDE_M,
                             f"the {gu_rows} x {moe_ws.TILE_N} Gluon MoE gate_up")
        moe_ws.check_turns(plan.gate_up.turns, gu_rows == moe_ws.WIDE_M, f"the {gu_rows} x {moe_ws.TILE_N} gate_up")
        moe_ws.check_stage_scales(plan.gate_up.stage_scales, gu_rows == moe_ws.WIDE_M,
                                  f"the {gu_rows} x {moe_ws.TILE_N} gate_up")
        moe_ws.check_gather(plan.gate_up.gather, gu_rows == moe_ws.WIDE_M,
                            f"the {gu_rows} x {moe_ws.TILE_N} gate_up")
        moe_ws.check_narrow(plan.gate_up.narrow, False, f"the {gu_rows} x {moe_ws.TILE_N} gate_up")
        moe_ws.check_thread_release(plan.gate_up.thread_release, gu_rows == moe_ws.WIDE_M,
                                    f"the {gu_rows} x {moe_ws.TILE_N} gate_up")
    if isinstance(plan.down, GluonTile):  # refused before any launch: the Gluon down has only the serial loop
        moe_ws.check_promote(plan.down.promote, True, "the Gluon MoE down")

    by_token = cfg.moe_gather_by_token and gluon_gu and not plan.gate_up.gather and x_quant is not None
    if by_token:  # gather_act_quant walks the tokens in order (each FP8 row read once): it needs each slot's row
        sorted_slots, block_expert, slot_rows = moe_align_rows(topk_ids, expert_start, e, align)
    else:
        (sorted_slots, block_expert), slot_rows = moe_align(topk_ids, expert_start, e, align), None
    max_rows = sorted_slots.shape[0]
    act = torch.empty((max_rows, i), dtype=FP8_DTYPE, device=x.device)
    # GluonTile.stage_scales: the down's A scales MN-major where the wide gate_up writes them (else its launcher
    # transposes them)
    if isinstance(plan.down, GluonTile) and plan.down.stage_scales and gluon_gu and gu_rows == moe_ws.WIDE_M:
        act_scale = torch.empty((cdiv(i, BLOCK), max_rows), dtype=torch.float32, device=x.device).t()
    else:
        act_scale = torch.empty((max_rows, cdiv(i, BLOCK)), dtype=torch.float32, device=x.device)
    if gluon_gu:
        gather = 0
        if plan.gate_up.gather:  # the tokens' own FP8 rows, copied into sorted order by the GEMM's producer
            a_fp8, a_scale = x_quant if x_quant is not None else act_quant(x.contiguous())
            gather = k if h % 16 == 0 and a_fp8.data_ptr() % 16 == 0 and a_fp8.stride(0) % 16 == 0 else 0
        if not gather:  # A quantized straight into sorted row order (rows copied from x_quant when given: same bits)
            a_fp8, a_scale = gather_act_quant(x.contiguous(), sorted_slots, k, x_quant,
                                              scale_mn_major=plan.gate_up.stage_scales, slot_rows=slot_rows)
        moe_ws.ws_moe_gemm(a_fp8, a_scale, w13, w13_scale_inv, b13, act, act_scale, sorted_slots, block_expert,
                           n_slots, swiglu_limit, SWIGLU_ALPHA, FP8_MAX, ACT_EPS,
                           stages=plan.gate_up.stages, group_m=plan.gate_up.group_m, block_m=gu_rows,
                           balance=plan.gate_up.balance, promote=plan.gate_up.promote, turns=plan.gate_up.turns,
                           stage_scales=plan.gate_up.stage_scales, gather_top_k=gather,
                           thread_release=plan.gate_up.thread_release)
    else:
        x_fp8, x_scale = x_quant if x_quant is not None else act_quant(x.contiguous())
        gate_up_triton(x_fp8, x_scale, w13, w13_scale_inv, b13, act, act_scale, sorted_slots, block_expert, k,
                       swiglu_limit, align, plan.tma, plan.gate_up)
    if isinstance(plan.down, GluonTile):  # the Gluon down (128 x 256 tiles over 128-row segments)
        assert gluon_ok and align == moe_ws.WIDE_M and plan.tma, (
            f"a GluonTile down needs config.gluon, an sm_90 GPU, triton with Gluon, TMA and ALIGN_M={moe_ws.WIDE_M} "
            f"(got {align})")
        moe_ws.ws_moe_down(act, act_scale, w2, w2_scale_inv, b2, y, sorted_slots, block_expert, n_slots,
                           stages=plan.down.stages, group_m=plan.down.group_m, balance=plan.down.balance,
                           promote=plan.down.promote, turns=plan.down.turns, stage_scales=plan.down.stage_scales,
                           narrow=plan.down.narrow, thread_release=plan.down.thread_release)
    else:
        down_triton(act, act_scale, w2, w2_scale_inv, b2, y, sorted_slots, block_expert, k, align, plan.tma,
                    plan.down)
    return y


def moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor,
    expert_start: int = 0,
    swiglu_limit: float = 7.0,
    config: KernelConfig | None = None,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """Expert FFN of already-routed tokens on a rank holding experts [expert_start, expert_start + E).

    x [T, H] bf16; topk_weights [T, k] (bf16/fp32) and topk_ids [T, k] int32 global ids;
    w13 fp8 [E, 2I, H] (gate/up rows interleaved) with scale_inv [E, ceil(2I/128), ceil(H/128)] and
    bias b13 [E, 2I]; w2 fp8 [E, H, I] with scale_inv [E, ceil(H/128), ceil(I/128)] and bias
    b2 [E, H]. Returns bf16 [T, H]: sum over each token's slots routed here of weight * expert(x);
    slots routed to other ranks contribute nothing.
    """
    assert topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], (
        f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} do not fit x {tuple(x.shape)}"
    )
    # The combine skips slots routed elsewhere, so they need not be zeroed.
    y = moe_expert_slots(x, topk_ids, w13, w13_scale_inv, b13, w2, w2_scale_inv, b2, expert_start,
                         swiglu_limit, config, torch.bfloat16, zero_foreign=False, plan=plan)
    return moe_combine(y, topk_weights, topk_ids, expert_start, w13.shape[0])


def fused_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor,
    top_k: int = 4,
    expert_start: int = 0,
    swiglu_limit: float = 7.0,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Route (``spec.route`` over all E_total experts of router_weight [E_total, H]) then ``moe_experts``
    on this rank's experts."""
    _, ids, weights = spec.route(x, router_weight, router_bias, top_k)
    ids = ids.to(torch.int32)
    return moe_experts(x, weights, ids, w13, w13_scale_inv, b13, w2, w2_scale_inv, b2, expert_start, swiglu_limit, config)

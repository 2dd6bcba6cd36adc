"""Fused FP8 mixture-of-experts FFN for gpt-oss (Triton), with expert-parallel ranks.

Pipeline for x [T, H] bf16, top-k routing, a rank holding experts [e0, e0 + E_local):
1. ``route``: logits = x @ Wr^T + br (bf16), top-k (sorted), softmax over the k selected logits in
   bf16, exactly as OpenAI's reference.
2. ``moe_align``: the T*k (token, slot) pairs routed to local experts are grouped by expert and
   each expert's segment is padded to a multiple of ALIGN_M rows, so every row tile of the grouped
   GEMMs belongs to one expert (``block_expert``); pairs routed to other ranks are dropped. Three
   small Triton kernels, no host synchronisation (sizes are upper bounds).
3. ``act_quant`` of x once per token (1x128 groups, FP8 e4m3).
4. Grouped GEMM gate_up: rows gathered from x_fp8 by token, W13 [E, 2I, H] with rows interleaved
   (2j = gate j, 2j+1 = up j), per-expert bias, then in the epilogue the clamped SwiGLU
   (glu = g.clamp(max=limit), lin = u.clamp(-limit, limit), glu * sigmoid(1.702 glu) * (lin + 1))
   and the 1x128 FP8 quantization of its output: a 256-column tile of interleaved gate/up rows
   is exactly one 128-wide activation group, so the intermediate goes to memory once, as FP8.
5. Grouped GEMM down: W2 [E, H, I] + per-expert bias, bf16 rows scattered back to (token, slot).
6. ``combine``: out[t] = sum over the token's local slots of weight * y (fp32 sum, bf16 out).
   On an expert-parallel rank the result is that rank's partial sum; one all-reduce across ranks
   gives the full FFN (each expert's bias is counted once, on the rank that holds it).

The grouped GEMMs share ``fp8_block_mainloop`` with the dense GEMM (fp8_gemm.py). On sm_90 the
gate_up GEMM runs as the warp-specialized Gluon kernel of moe_ws.py (same contract; A is then
quantized straight into sorted row order, ``gather_act_quant``), see ``moe_config``. Scales:
W13 scale_inv [E, ceil(2I/128), ceil(H/128)], W2 scale_inv [E, ceil(H/128), ceil(I/128)].
``moe_reference`` is the plain-torch specification built from quant/fp8.py's references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gptoss_fp8.kernels.act_quant import (
    act_quant,
    group_scale,
    quantize_group_rows,
    quantize_with_scale,
)
from gptoss_fp8.kernels import moe_ws
from gptoss_fp8.kernels.fp8_gemm import fp8_block_mainloop, store_rows
from gptoss_fp8.kernels.router import router_reference
from gptoss_fp8.quant.fp8 import (
    ACT_EPS,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    block_gemm_reference,
    cdiv,
    next_pow2,
    quantize_act,
)

SWIGLU_ALPHA = 1.702
# The Gluon warp-specialized expert GEMMs (kernels/moe_ws.py) where they can run (moe_config):
# WS_MOE for gate_up (False keeps the Triton kernels everywhere: benchmarks/ab_prefill.py's
# "triton-moe" variant); WS_MOE_DOWN also for down, off by default: on the H200 the Gluon down GEMM
# (bf16 rows scattered by pointer stores) ran 5-10% slower than the Triton one, while the Gluon
# gate_up ran 3-11% faster (benchmarks/notes/kernels_gemm.md, seventh session).
WS_MOE = True
WS_MOE_DOWN = False
# With PREGATHER, build gate_up's sorted A by copying the rows of the caller's x_quant (the
# norm's FP8 output) instead of quantizing x again: the same bits, half the bytes read and no
# quantization math. Whole-model A/B on the H200 (ninth session, benchmarks/ab_prefill.py
# "gather-quant", same process, identical logits): 20b 0.0973 vs 0.0983 s at 8192 tokens and
# 0.5520 vs 0.5536 s at 32768; 120b at 8192 0.1637 vs 0.1630 s (min 0.1588 vs 0.1607): at most 1%.
GATHER_FROM_QUANT = True
# The Gluon gate_up's ring depth and tile order (moe_config; benchmarks/ab_prefill.py varies them).
WS_GATE_UP_STAGES = 4
WS_GATE_UP_GROUP_M = 8


# ---------------------------------------------------------------------------------------------
# Routing (torch: kernels/router.py's reference) and alignment
# ---------------------------------------------------------------------------------------------


def route(
    x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] bf16, router_weight [E, H], router_bias [E] -> (weights [T, k] bf16, ids [T, k] int32).

    logits = x @ Wr^T + br in x's dtype, ``topk(sorted=True)``, softmax over the k selected logits
    in that dtype (gpt-oss reference numerics).
    """
    _, ids, weights = router_reference(x, router_weight, router_bias, top_k)
    return weights, ids.to(torch.int32)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, rank_ptr, n_slots, expert_start, num_experts, BLOCK: tl.constexpr):
    """Count the slots of each local expert; each slot's rank within its expert (atomic order)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_slots
    e = tl.load(ids_ptr + offs, mask=m, other=0) - expert_start
    here = m & (e >= 0) & (e < num_experts)
    rank = tl.atomic_add(counts_ptr + tl.where(here, e, 0), tl.full((BLOCK,), 1, tl.int32), mask=here)
    tl.store(rank_ptr + offs, rank, mask=m)


@triton.jit
def _align_offsets_kernel(counts_ptr, pad_start_ptr, block_expert_ptr, num_experts, num_tiles,
                          ALIGN_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program: padded segment starts (exclusive cumsum of counts rounded up to ALIGN_M) and
    the expert of every ALIGN_M-row tile (num_experts past the last segment)."""
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    counts = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)
    padded = (counts + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    pad_end = tl.cumsum(padded, axis=0)
    tl.store(pad_start_ptr + offs_e, pad_end - padded, mask=e_mask)
    tile_end = tl.where(e_mask, pad_end // ALIGN_M, 2147483647)  # [BLOCK_E] tile index ends
    for t0 in range(0, num_tiles, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        # expert of tile t = number of experts whose segment ends at or before t
        expert = tl.sum((tile_end[None, :] <= offs_t[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + offs_t, expert, mask=offs_t < num_tiles)


@triton.jit
def _align_scatter_kernel(ids_ptr, rank_ptr, pad_start_ptr, sorted_ptr, n_slots, expert_start, num_experts,
                          BLOCK: tl.constexpr):
    """sorted_slots[pad_start[e] + rank] = slot for every slot routed to a local expert."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_slots
    e = tl.load(ids_ptr + offs, mask=m, other=0) - expert_start
    here = m & (e >= 0) & (e < num_experts)
    rank = tl.load(rank_ptr + offs, mask=here, other=0)
    start = tl.load(pad_start_ptr + tl.where(here, e, 0), mask=here, other=0)
    tl.store(sorted_ptr + start + rank, offs, mask=here)


def moe_align(
    topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by local expert, padding each expert's segment to block_m rows.

    topk_ids [T, k] int32 global expert ids. Returns
    - ``sorted_slots`` int32 [max_rows]: flat slot index t*k + j per padded row, T*k for padding;
    - ``block_expert`` int32 [max_rows / block_m]: the local expert of each row tile, num_local for
      tiles past the last expert's segment (the kernels skip those).
    max_rows = round_up(T*k + num_local*(block_m - 1), block_m) is an upper bound, so no host sync.
    Three small Triton kernels (count with atomics, offsets, scatter); the order of the slots
    inside one expert's segment follows the atomics and may change between runs, which changes
    nothing in the results (rows are independent and written back by slot index).
    """
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous(), f"topk_ids {topk_ids.dtype}"
    dev = topk_ids.device
    n_slots = topk_ids.numel()
    max_rows = cdiv(n_slots + num_local * (block_m - 1), block_m) * block_m
    num_tiles = max_rows // block_m
    counts = torch.zeros(num_local, dtype=torch.int32, device=dev)
    rank = torch.empty(n_slots, dtype=torch.int32, device=dev)
    pad_start = torch.empty(num_local, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    sorted_slots = torch.full((max_rows,), n_slots, dtype=torch.int32, device=dev)
    block = 1024
    grid = (cdiv(n_slots, block),)
    _align_count_kernel[grid](topk_ids, counts, rank, n_slots, expert_start, num_local, BLOCK=block)
    _align_offsets_kernel[(1,)](
        counts, pad_start, block_expert, num_local, num_tiles,
        ALIGN_M=block_m, BLOCK_E=max(16, next_pow2(num_local)), BLOCK_T=64,
    )
    _align_scatter_kernel[grid](topk_ids, rank, pad_start, sorted_slots, n_slots, expert_start, num_local, BLOCK=block)
    return sorted_slots, block_expert


def moe_align_reference(
    topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``moe_align`` (stable order inside each expert's segment)."""
    n_slots = topk_ids.numel()
    max_rows = cdiv(n_slots + num_local * (block_m - 1), block_m) * block_m
    key = topk_ids.reshape(-1).long() - expert_start
    key = torch.where((key >= 0) & (key < num_local), key, num_local)
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    sorted_slots = torch.full((max_rows,), n_slots, dtype=torch.int32, device=topk_ids.device)
    for e in range(num_local):
        slots = (key == e).nonzero().reshape(-1)
        start = int(pad_end[e] - padded[e])
        sorted_slots[start:start + slots.numel()] = slots.int()
    tiles = torch.arange(0, max_rows, block_m, device=topk_ids.device)
    return sorted_slots, torch.searchsorted(pad_end, tiles, right=True).int()


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


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
    FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, ALPHA: tl.constexpr, A_SORTED: tl.constexpr = True,
    SPLIT_N: tl.constexpr = True,
):
    """One row tile (one expert) x one column tile of a grouped FP8 block GEMM.

    A_SORTED: A rows are already in padded sorted row order (the down GEMM, or gate_up on
    ``gather_act_quant``'s output), read through TMA when TMA is set; otherwise (gate_up only) they
    are gathered from x by token (slot // TOP_K) with pointer loads.
    FUSE_SWIGLU: the epilogue adds the bias,
    applies the clamped SwiGLU to interleaved gate/up columns and writes FP8 + 1x128 scales in
    padded sorted row order. Otherwise A rows are the padded sorted rows and the epilogue adds the
    bias and scatters bf16 rows to their (token, slot) index.
    TMA: the weights come through a tensor descriptor over W viewed as [E * N, K] (and, without
    FUSE_SWIGLU, A through one over [rows, K]); a tile past an expert's N rows reads the next
    expert's rows, which only feed masked columns.
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
    if A_SORTED:
        a_rows = offs_r.to(tl.int64)
    else:
        a_rows = (tl.where(valid, slots, 0) // TOP_K).to(tl.int64)
    if TMA:
        b_src = b_ptr
    else:
        b_src = b_ptr + expert * stride_be
    acc_lo, acc_hi = fp8_block_mainloop(
        a_ptr, pid_m * BLOCK_M, a_rows, stride_am, as_ptr, stride_asm,
        b_src, expert32 * N + pid_n * BLOCK_N, pid_n * BLOCK_N, N, stride_bn, bs_ptr + expert * stride_bse, stride_bsn,
        K, BLOCK_M, BLOCK_N, BLOCK_K, TMA and A_SORTED, TMA, SPLIT_N,
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
            store_rows(out_ptr, rows, valid, quantize_with_scale(h_lo, scale, FP8_MAX_C), c0, N // 2, stride_om, out_ptr, False, BLOCK_K // 2)
            store_rows(out_ptr, rows, valid, quantize_with_scale(h_hi, scale, FP8_MAX_C), c0 + BLOCK_K // 2, N // 2, stride_om, out_ptr, False, BLOCK_K // 2)
        else:  # one 256-wide accumulator: its SwiGLU is the whole 128-wide group
            h = _bias_swiglu(acc_lo, bias_e, pid_n * BLOCK_N, N, limit, ALPHA, BLOCK_N)
            scale = group_scale(tl.max(tl.abs(h), axis=1), FP8_MAX_C, EPS)
            store_rows(out_ptr, rows, valid, quantize_with_scale(h, scale, FP8_MAX_C), c0, N // 2, stride_om, out_ptr, False, BLOCK_K)
        tl.store(out_s_ptr + rows * stride_osm + pid_n, scale, mask=valid)
    else:
        rows = tl.where(valid, slots, 0).to(tl.int64)
        if BLOCK_N > BLOCK_K and SPLIT_N:
            store_rows(out_ptr, rows, valid, acc_lo, pid_n * BLOCK_N, N, stride_om, bias_e, True, BLOCK_K)
            store_rows(out_ptr, rows, valid, acc_hi, pid_n * BLOCK_N + BLOCK_K, N, stride_om, bias_e, True, BLOCK_K)
        else:
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
    num_experts: int = 0,
) -> torch.Tensor:
    """Weighted sum of per-slot expert outputs: y [T*k, H] or [T, k, H] (bf16/fp32, last dim
    contiguous), weights [T, k] -> bf16 [T, H]. With ``ids`` (int32 [T, k] global expert ids), only
    slots routed to experts [expert_start, expert_start + num_experts) count (the others' rows of y
    are never read)."""
    t, k = weights.shape
    h = y.shape[-1]
    y2 = y.reshape(t * k, h)
    assert y2.stride(-1) == 1, "y needs a contiguous last dimension"
    out = torch.empty((t, h), dtype=torch.bfloat16, device=y.device)
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
    M, K, num_slots, stride_xm, stride_xsm, stride_qm, stride_sm,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr,
    FROM_QUANT: tl.constexpr = False,
):
    """Row r of the output = act_quant(x[slots[r] // TOP_K]) (zeros for padding rows, with the
    scale act_quant gives a zero row). FROM_QUANT: x is that quantization already (x_ptr its FP8
    bytes as uint8, xs_ptr its scales): the row's bytes and scale are copied, not recomputed."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    slots = tl.load(slots_ptr + offs_m, mask=m_ok, other=num_slots)
    valid = slots < num_slots
    src = (tl.where(valid, slots, 0) // TOP_K).to(tl.int64)
    offs_k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    k_ok = offs_k < K
    x_ptrs = x_ptr + src[:, None] * stride_xm + offs_k[None, :]
    if FROM_QUANT:
        q = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0)  # e4m3 bytes; 0 = +0.0 (padding)
        scale = tl.load(xs_ptr + src * stride_xsm + tl.program_id(1), mask=valid, other=0.0)
        scale = tl.where(valid, scale, group_scale(tl.zeros([BLOCK_M], dtype=tl.float32), FP8_MAX_C, EPS))
    else:
        x = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        q, scale = quantize_group_rows(x.to(tl.float32), FP8_MAX_C, EPS)
    rows = offs_m.to(tl.int64)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q.to(q_ptr.dtype.element_ty), mask=m_ok[:, None] & k_ok[None, :])
    tl.store(s_ptr + rows * stride_sm + tl.program_id(1), scale, mask=m_ok)


def gather_act_quant(x: torch.Tensor, sorted_slots: torch.Tensor, top_k: int,
                     x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate_up GEMM's A operand in padded sorted row order: row r is the 1x128 FP8 quantization
    of x[sorted_slots[r] // top_k] (``act_quant``'s numerics; a token routed to k experts is
    quantized k times, identically); padding rows (slot >= T*k) are zeros. Lets gate_up read A
    through TMA like the down GEMM, instead of gathering rows with pointer loads.
    x_quant: ``act_quant(x)`` (x_fp8 [T, H], scale [T, ceil(H/128)], last dims contiguous) when the
    caller has it; its rows are then copied (half the bytes of x read, no quantization), same bits."""
    t, h = x.shape
    m = sorted_slots.shape[0]
    g = cdiv(h, BLOCK)
    q = torch.empty((m, h), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if x_quant is not None:
        xq, xs = x_quant
        assert xq.shape == x.shape and xq.dtype == FP8_DTYPE and xq.stride(-1) == 1, (
            f"x_quant {tuple(xq.shape)} {xq.dtype} does not fit x {tuple(x.shape)}")
        assert xs.shape == (t, g) and xs.dtype == torch.float32 and xs.stride(-1) == 1, f"x_quant scale {tuple(xs.shape)}"
        src, src_s, out = xq.view(torch.uint8), xs, q.view(torch.uint8)
    else:
        src, src_s, out = x, x, q  # src_s unused
    if m:
        block_m = 16
        _gather_act_quant_kernel[(cdiv(m, block_m), g)](
            src, src_s, sorted_slots, out, s, m, h, t * top_k, src.stride(0), src_s.stride(0), q.stride(0), s.stride(0),
            TOP_K=top_k, BLOCK_M=block_m, GROUP=BLOCK, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, FROM_QUANT=x_quant is not None,
            num_warps=4,
        )
    return q, s


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def moe_config(num_tokens: int, top_k: int, num_experts: int, ws: bool = False) -> dict:
    """Tile shapes by load (picked from the H200 sweeps in benchmarks/notes/kernels_gemm.md).

    ALIGN_M pads each expert's rows (padding waste vs tile efficiency); each GEMM's BLOCK_M
    divides it. gate_up's BLOCK_N is fixed at 256: one 128-wide SwiGLU output group per tile.
    ``PREGATHER`` (gate_up's A quantized straight into sorted row order and read through TMA) is
    an option, not the default: whole-model prefill of the 120b at 8192 tokens (128 experts, 256
    rows each) took 0.1826 s with it (128x256 gate_up tiles, ALIGN 128) against 0.1737 s without,
    although the isolated sweep had ranked that configuration first.
    ``SPLIT_N=False`` (gate_up as one 64x256 product per K step, per-column weight scales): each
    warpgroup's wgmma is 64x128 instead of 64x64; the whole FFN 2-5% faster at 8192 and 32768
    tokens, 32 and 128 experts (H200, ``python -m gptoss_fp8.bench.kernels_gemm --moe-variants``).
    ``ws``: the warp-specialized Gluon GEMMs (kernels/moe_ws.py) can run here (an sm_90 GPU);
    ``WS=True`` in a GEMM's dict picks them (64-row segments only; gate_up then reads A pre-gathered).
    """
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    align = 64 if rows_per_expert >= 48 else 16
    down_triton = dict(BLOCK_M=align, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)
    if ws and align == 64 and WS_MOE:
        down_ws = dict(WS=True, BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_stages=4)
        return dict(ALIGN_M=64, TMA=True, PREGATHER=True,
                    gate_up=dict(WS=True, BLOCK_M=64, BLOCK_N=256, GROUP_M=WS_GATE_UP_GROUP_M,
                                 num_stages=WS_GATE_UP_STAGES),
                    down=down_ws if WS_MOE_DOWN else down_triton)
    return dict(
        ALIGN_M=align,
        TMA=True,
        gate_up=dict(BLOCK_M=align, BLOCK_N=256, GROUP_M=8, num_warps=8 if align == 64 else 4, num_stages=4,
                     SPLIT_N=align != 64),
        down=down_triton,
    )


def _check_expert_weights(name, w, s, b, n, k, e):
    assert w.dtype == FP8_DTYPE and w.shape == (e, n, k), f"{name} {tuple(w.shape)} {w.dtype}, expected fp8 [{e}, {n}, {k}]"
    assert s.dtype == torch.float32 and s.shape == (e, cdiv(n, BLOCK), cdiv(k, BLOCK)), (
        f"{name} scale_inv {tuple(s.shape)} {s.dtype} does not fit {tuple(w.shape)}"
    )
    assert b.shape == (e, n) and b.dtype in (torch.bfloat16, torch.float32), f"{name} bias {tuple(b.shape)} {b.dtype}"
    assert w.is_contiguous() and s.is_contiguous() and b.is_contiguous(), f"{name} tensors must be contiguous"


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
    config: dict | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    zero_foreign: bool = True,
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-(token, slot) expert outputs [T*k, H] in ``out_dtype``, before the weighted combine.

    Same argument layout as ``moe_experts``. Row t*k + j is expert(x[t]) + bias for slot j of token
    t, the fp32 accumulator rounded once to out_dtype. Slots routed to experts outside
    [expert_start, expert_start + E) are zero (``zero_foreign``) or left unwritten. ``x_quant``:
    x's ``act_quant`` (x_fp8 [T, H], scale [T, ceil(H/128)]) when the caller already has it.
    """
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x {tuple(x.shape)} {x.dtype}"
    t, h = x.shape
    e, two_i = w13.shape[0], w13.shape[1]
    assert two_i % 2 == 0, f"gate_up rows {two_i} must be even (interleaved gate/up)"
    i = two_i // 2
    _check_expert_weights("gate_up", w13, w13_scale_inv, b13, two_i, h, e)
    _check_expert_weights("down", w2, w2_scale_inv, b2, h, i, e)
    assert h % 16 == 0 and i % 16 == 0, f"H={h} and I={i} must be multiples of 16"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t, f"topk ids {tuple(topk_ids.shape)} do not fit x {tuple(x.shape)}"
    assert topk_ids.dtype == torch.int32, f"topk_ids must be int32, got {topk_ids.dtype}"
    k = topk_ids.shape[1]
    n_slots = t * k
    y = torch.empty((n_slots, h), dtype=out_dtype, device=x.device)
    if t == 0:
        return y
    topk_ids = topk_ids.contiguous()
    if zero_foreign:  # only rows of slots routed to other ranks' experts are written (none with one rank)
        zero_foreign_rows(topk_ids, y, expert_start, e)
    cfg = config or moe_config(t, k, e, moe_ws.supported(x.device))
    align = cfg["ALIGN_M"]
    gu, dn = dict(cfg["gate_up"]), dict(cfg["down"])
    ws_gu, ws_dn = bool(gu.pop("WS", False)), bool(dn.pop("WS", False))
    if ws_gu or ws_dn:
        assert moe_ws.supported(x.device) and align == moe_ws.TILE_M and cfg.get("TMA"), (
            f"config WS=True needs an sm_90 GPU, triton with Gluon, TMA and ALIGN_M={moe_ws.TILE_M} (got {align})")
        assert not ws_gu or cfg.get("PREGATHER"), "WS gate_up reads A pre-gathered: set PREGATHER=True"
    assert gu.pop("BLOCK_N") == 2 * BLOCK, "the SwiGLU-quant epilogue needs 256 gate/up columns per tile"
    bm_gu, bm_dn = gu.pop("BLOCK_M"), dn.pop("BLOCK_M")
    assert align % bm_gu == 0 and align % bm_dn == 0, f"BLOCK_M {bm_gu}, {bm_dn} must divide ALIGN_M {align}"

    sorted_slots, block_expert = moe_align(topk_ids, expert_start, e, align)
    max_rows = sorted_slots.shape[0]

    tma = bool(cfg.get("TMA", False))
    # PREGATHER: quantize x straight into sorted row order so gate_up reads A through TMA.
    pregather = tma and bool(cfg.get("PREGATHER", False))
    if pregather:
        # GATHER_FROM_QUANT: copy the rows of the caller's act_quant(x) (same bits, fewer bytes)
        x_fp8, x_scale = gather_act_quant(x.contiguous(), sorted_slots, k, x_quant if GATHER_FROM_QUANT else None)
        x_src = None if ws_gu else TensorDescriptor.from_tensor(x_fp8, [bm_gu, BLOCK])
    elif x_quant is not None:
        x_fp8, x_scale = x_quant
        assert x_fp8.shape == x.shape and x_fp8.dtype == FP8_DTYPE and x_fp8.stride(-1) == 1, (
            f"x_quant {tuple(x_fp8.shape)} {x_fp8.dtype} does not fit x {tuple(x.shape)}"
        )
        assert x_scale.shape == (t, cdiv(h, BLOCK)) and x_scale.stride(-1) == 1, f"x_quant scale {tuple(x_scale.shape)}"
        x_src = x_fp8
    else:
        x_fp8, x_scale = act_quant(x.contiguous())
        x_src = x_fp8
    act = torch.empty((max_rows, i), dtype=FP8_DTYPE, device=x.device)
    act_scale = torch.empty((max_rows, cdiv(i, BLOCK)), dtype=torch.float32, device=x.device)
    if ws_gu:
        moe_ws.ws_moe_gemm(x_fp8, x_scale, w13, w13_scale_inv, b13, act, act_scale, sorted_slots, block_expert,
                           n_slots, swiglu_limit, True, SWIGLU_ALPHA, FP8_MAX, ACT_EPS,
                           stages=gu.get("num_stages", 4), group_m=gu.get("GROUP_M", 8))
    else:
        _gate_up_triton(x_src, x_scale, x_fp8, w13, w13_scale_inv, b13, act, act_scale, sorted_slots, block_expert,
                        n_slots, swiglu_limit, k, tma, align, bm_gu, pregather, gu)
    if ws_dn:
        moe_ws.ws_moe_gemm(act, act_scale, w2, w2_scale_inv, b2, y, None, sorted_slots, block_expert, n_slots,
                           swiglu_limit, False, SWIGLU_ALPHA, FP8_MAX, ACT_EPS,
                           stages=dn.get("num_stages", 4), group_m=dn.get("GROUP_M", 8))
        return y
    _down_triton(act, act_scale, w2, w2_scale_inv, b2, y, sorted_slots, block_expert, n_slots, swiglu_limit, k, tma,
                 align, bm_dn, dn)
    return y


def _gate_up_triton(x_src, x_scale, x_fp8, w13, w13_scale_inv, b13, act, act_scale, sorted_slots, block_expert,
                    n_slots, swiglu_limit, k, tma, align, bm_gu, pregather, gu):
    e, two_i, h = w13.shape
    max_rows = sorted_slots.shape[0]
    split_gu = bool(gu.pop("SPLIT_N", True))  # False: one 256-wide product per K step (per-column scales)
    w13_box = [BLOCK if split_gu else 2 * BLOCK, BLOCK]
    w13_src = TensorDescriptor.from_tensor(w13.view(e * two_i, h), w13_box) if tma else w13
    grid = (max_rows // bm_gu * cdiv(two_i, 2 * BLOCK),)
    _moe_gemm_kernel[grid](
        x_src, x_scale, w13_src, w13_scale_inv, b13, act, act_scale,
        sorted_slots, block_expert,
        two_i, h, n_slots, e, max_rows // bm_gu,
        x_fp8.stride(0), x_scale.stride(0),
        w13.stride(0), w13.stride(1), w13_scale_inv.stride(0), w13_scale_inv.stride(1), b13.stride(0),
        act.stride(0), act_scale.stride(0),
        float(swiglu_limit),
        FUSE_SWIGLU=True, TOP_K=k, TMA=tma, ALIGN_M=align, BLOCK_M=bm_gu, BLOCK_N=2 * BLOCK, BLOCK_K=BLOCK,
        FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, ALPHA=SWIGLU_ALPHA, A_SORTED=pregather, SPLIT_N=split_gu, **gu,
    )


def _down_triton(act, act_scale, w2, w2_scale_inv, b2, y, sorted_slots, block_expert, n_slots, swiglu_limit, k, tma,
                 align, bm_dn, dn):
    e, h, i = w2.shape
    max_rows = sorted_slots.shape[0]
    bn = dn.pop("BLOCK_N")
    split_dn = bool(dn.pop("SPLIT_N", True))
    if tma:
        act_src = TensorDescriptor.from_tensor(act, [bm_dn, BLOCK])
        w2_src = TensorDescriptor.from_tensor(w2.view(e * h, i), [min(bn, BLOCK) if split_dn else bn, BLOCK])
    else:
        act_src, w2_src = act, w2
    grid = (max_rows // bm_dn * cdiv(h, bn),)
    _moe_gemm_kernel[grid](
        act_src, act_scale, w2_src, w2_scale_inv, b2, y, y,
        sorted_slots, block_expert,
        h, i, n_slots, e, max_rows // bm_dn,
        act.stride(0), act_scale.stride(0),
        w2.stride(0), w2.stride(1), w2_scale_inv.stride(0), w2_scale_inv.stride(1), b2.stride(0),
        y.stride(0), 0,
        float(swiglu_limit),
        FUSE_SWIGLU=False, TOP_K=k, TMA=tma, ALIGN_M=align, BLOCK_M=bm_dn, BLOCK_N=bn, BLOCK_K=BLOCK,
        FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, ALPHA=SWIGLU_ALPHA, SPLIT_N=split_dn, **dn,
    )


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
    config: dict | None = None,
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
                         swiglu_limit, config, torch.bfloat16, zero_foreign=False)
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
    config: dict | None = None,
) -> torch.Tensor:
    """Route (over all E_total experts of router_weight [E_total, H]) then ``moe_experts`` on this rank's experts."""
    weights, ids = route(x, router_weight, router_bias, top_k)
    return moe_experts(x, weights, ids, w13, w13_scale_inv, b13, w2, w2_scale_inv, b2, expert_start, swiglu_limit, config)


# ---------------------------------------------------------------------------------------------
# References (plain torch)
# ---------------------------------------------------------------------------------------------


def swiglu_reference(hg: torch.Tensor, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss clamped SwiGLU on interleaved gate/up columns [..., 2I] -> [..., I] (input dtype)."""
    glu = hg[..., ::2].clamp(max=limit)
    lin = hg[..., 1::2].clamp(min=-limit, max=limit)
    return glu * torch.sigmoid(SWIGLU_ALPHA * glu) * (lin + 1)


def moe_experts_reference(
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
) -> torch.Tensor:
    """The w8a8 specification of ``moe_experts``: per-token 1x128 FP8 x, block GEMM + bias in fp32,
    SwiGLU in fp32, 1x128 FP8 intermediate, block GEMM + bias rounded to bf16, fp32 weighted sum."""
    t, h = x.shape
    x_fp8, x_scale = quantize_act(x)
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e + expert_start, as_tuple=True)
        if tok.numel() == 0:
            continue
        hg = block_gemm_reference(x_fp8[tok], x_scale[tok], w13[e], w13_scale_inv[e], b13[e], torch.float32)
        act_fp8, act_scale = quantize_act(swiglu_reference(hg, swiglu_limit))
        y = block_gemm_reference(act_fp8, act_scale, w2[e], w2_scale_inv[e], b2[e], torch.bfloat16)
        out.index_add_(0, tok, topk_weights[tok, slot].float()[:, None] * y.float())
    return out.to(torch.bfloat16)


def fused_moe_reference(
    x, router_weight, router_bias, w13, w13_scale_inv, b13, w2, w2_scale_inv, b2,
    top_k: int = 4, expert_start: int = 0, swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """``route`` (already plain torch) followed by ``moe_experts_reference``."""
    weights, ids = route(x, router_weight, router_bias, top_k)
    return moe_experts_reference(x, weights, ids, w13, w13_scale_inv, b13, w2, w2_scale_inv, b2, expert_start, swiglu_limit)

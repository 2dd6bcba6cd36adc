"""Small-batch FP8 MoE expert path (Triton): the per-slot expert outputs of ``moe.moe_expert_slots``
for a decode step's few tokens, in two launches that stream each routed expert's weights once, with
no ``moe_align`` and no zero-fill launch.

Contract (``moe_slots_skinny``): x_fp8 fp8 [T, H] (last dim contiguous) with x_scale float32
[T, ceil(H/128)] (the caller's ``act_quant``); topk_ids int32 [T, k] global expert ids; a rank
holding experts [expert_start, expert_start + E); W13 fp8 [E, 2I, H] with gate/up rows interleaved
(2j = gate j, 2j+1 = up j), scale_inv [E, ceil(2I/128), ceil(H/128)], bias [E, 2I]; W2 fp8
[E, H, I], scale_inv [E, ceil(H/128), ceil(I/128)], bias [E, H] (always given: zeros for a partial
sum); biases bf16 or fp32; weights, scales and biases contiguous; H and I multiples of 16, not
necessarily of 128 (2880 = 22.5 x 128). out: preallocated contiguous [T*k, H], bf16 or float32.
Row t*k + j = expert(x[t]) + bias for slot j of token t; rows of slots routed to other ranks'
experts are zeros (``zero_foreign``) or left unwritten.

Numerics (moe_gemm.py's, so the two agree up to fp32 summation order inside a K block): per
128-wide K block the fp8 product in fp32 (exact products) times s_act[row, kb] * s_w[e, nb, kb],
added to an fp32 accumulator; gate_up + bias in fp32, clamped SwiGLU in fp32 (moe_gemm's
``_bias_swiglu``: glu = gate.clamp(max=limit), lin = up.clamp(-limit, limit),
glu * sigmoid(1.702 glu) * (lin + 1)); the intermediate quantized per row to e4m3 with one float32
scale per 128 consecutive columns (``group_scale``: max(amax, 1e-10) / 448, ``quantize_with_scale``:
rne, saturated: the fused epilogue's helpers, so equal fp32 inputs give equal bits); down the same
way, + bias in fp32, one rounding to out's dtype. On the GPU the products run on fp8 wgmma where
a tile has 64+ weight rows (its accumulation inside one K block is the tensor core's, as in the
Gluon paths) and on mma.sync (fp8 widened to f16 first, as the grouped path's 16-row tiles) below.

Launches, grids (T*k slots, column blocks) with the slot fastest, so every slot's program for one
column block is issued together and tokens sharing an expert meet its weight tile in L2:
1. gate_up: program (slot, BLOCK_N1 rows of W13): acc^T [BLOCK_N1, M] = W13 tile @ x^T ("swap
   AB": the weights are the MMA's M side, the tokens its N = max(16, next_pow2(T)), so one token
   costs a 16-wide MMA, not a 64-row one), bias + SwiGLU, the BLOCK_N1 / 2 outputs stored in fp32
   to a workspace inter [T*k, I]. Then the split-K semaphore (``kernels.arrival_counters``): a CTA
   barrier and one acq_rel gpu-scope atomic per (owner slot, 128-column group); the last of the
   group's 256 / BLOCK_N1 programs to arrive resets the counter, reads the group back from L2
   (.cg), quantizes it and writes act fp8 [T*k, I] + act_scale [T*k, ceil(I/128)]. The group
   spans 256 gate_up rows; splitting its quantization from the GEMM lets BLOCK_N1 be small (at
   batch 1 of the 20b, BLOCK_N1 = 64 gives 4 x 90 programs for 132 SMs).
2. down: program (slot, BLOCK_N2 rows of W2): acc^T = W2 tile @ act^T, + b2, stored to every slot
   of the token routed to the expert. A foreign slot's programs write its zero row.
Rows: a program computes every token routed to its slot's expert, and only the expert's first slot
in (token, slot) order (its "owner") runs; the others return at once. Each expert's weights are
then streamed once per call however many tokens share it (T = 8 at 32 experts routes 32 slots to
~21 experts). Loads: ``tl.range(num_stages=...)``, a cp.async ring of weight and activation tiles.
CUDA-graph capturable: no host syncs, grids and workspaces from T and k only, the counters left at
zero by every call (calls on one device share one stream, as for every user of the counters).

Deviations from the design brief, from ptxas's sm_90a code (loop bodies counted per K block and
warp; tests/kernels/test_moe_gemv.py compiles both kernels without a GPU). (a) Tensor cores, not
CUDA-core FMAs, even for one token: Triton gave the FMA form of a [1, 128] row times a [BN, 128]
tile a layout that reduces across all four warps every K block, and it widens each fp8 weight to
f16 and then f32; swap-AB fp8 wgmma reads both tiles from shared memory as they are: 142
instructions per 8 KB K block at BLOCK_N = 64, 171 per 16 KB at 128, i.e. 0.07 / 0.04 warp
instructions per weight byte against the ~0.25 an H200 can issue per byte at 4.26 TB/s. (b) The
intermediate is quantized once, by kernel 1's last program per group, not in every down program:
there Triton rematerialized the block's amax in the MMA accumulator's layout (each thread reducing
all 128 values of its rows), 138 of the down loop's 355 instructions per 4 KB block (BLOCK_N2 = 32).

MOE_SKINNY_MAX_SLOTS (the dispatch threshold, the caller's): use this path while T*k is at most the
largest load where ``benchmarks/moe_gemv_sweep.py`` shows it faster than the grouped path; expected
somewhere in 16..64 slots (T = 4..16 at k = 4): past it the grouped path's 64-row tiles reuse each
weight tile for more rows per program.

Not done here: routing, x's quantization, the combine (moe.py), experts split along I (pass zero
biases for the partial sums), token counts past 64 (the launcher refuses: the tokens are the MMA's
N side, whose accumulator grows with them).
Reference: ``spec.moe_experts_w8a8``; the grouped ``moe.moe_expert_slots`` (same numerics).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gptoss_fp8.kernels import arrival_counters, sm_count
from gptoss_fp8.kernels.act_quant import group_scale, quantize_with_scale
from gptoss_fp8.kernels.moe_gemm import _bias_swiglu, check_experts  # the fused epilogue's SwiGLU: one definition
from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_wait
from gptoss_fp8.quant.fp8 import ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX, cdiv, next_pow2
from gptoss_fp8.spec import SWIGLU_ALPHA

MAX_TOKENS = 64  # the MMA's N side (tokens per program) at most
# The down launch with PDL too (benchmarks/ab_decode.py's "pdl-down" switches it on to measure it):
# launched early, its programs take the SM slots gate_up's first-finished programs free, so they
# may crowd onto part of the GPU instead of spreading over all of it.
PDL_DOWN = False


@dataclass(frozen=True)
class MoeSkinnyTile:
    """The two launches of ``moe_slots_skinny``."""

    block_n1: int  # W13 rows per gate_up program: 16, 32, 64 or 128 (one weight-scale block)
    block_n2: int  # W2 rows per down program: 16, 32, 64 or 128
    num_warps: int = 4
    num_stages: int = 4  # K steps in flight per program (the cp.async ring)
    k_step: int = 1  # 128-wide K blocks per step: k_step * 128 contiguous bytes of every weight row a step


# 64-row tiles (fp8 wgmma), 6 stages: the fastest measured, not the default (KernelConfig.moe_skinny_wgmma)
WGMMA_TILE = MoeSkinnyTile(64, 64, num_warps=4, num_stages=6)


def moe_skinny_tile(num_slots: int, two_i: int, h: int, sms: int) -> MoeSkinnyTile:
    """The tiles for num_slots = T*k slots of experts with 2I gate_up rows and H hidden: 32 weight
    rows per program in both kernels, i.e. mma.sync on fp8 widened to f16 with fp32 accumulation,
    which is exact to fp32 summation order, instead of fp8 wgmma (64+ rows), whose reduced-precision
    accumulation inside a K block flips e4m3 roundings of the intermediate. H200, 20b shapes, on
    the same inputs: against the w8a8 spec ||.|| / ||ref|| 3.3e-3 to 5.2e-3 for 64-row tiles
    (the prefill kernels' MoE FFN class, 4.2e-3) and 1e-5 to 7e-5 for the grouped 16-row path
    (tests/kernels/test_moe_gemv.py METRIC lines). The price (benchmarks/moe_gemv_sweep.py --quick,
    L2-cold experts, thirteenth session): 39.5 / 105.0 / 164.3 us at 4 / 16 / 32 slots against
    35.8 / 102.4 / 158.9 for 64 rows with 6 stages (the fastest), and 54.0 / 119.6 / 165.6 for the
    grouped path; 120b the same within 1%. At one token (up to 4 slots) 2 warps a program: 38.5 /
    38.8 us (20b / 120b) against 39.8 for 4 warps (120b; the 20b's 4-warp row was not kept, 39.5 in
    the thirteenth session), at 4 tokens 111.1 / 121.1 against 105.7 / 119.3 (the same sweep with
    --tokens 1,4, fourteenth session; 16-row tiles 1.5x slower). (two_i, h, sms) are kept for a
    shape-dependent choice.)"""
    return MoeSkinnyTile(32, 32, num_warps=2 if num_slots <= 4 else 4, num_stages=4)


@triton.jit
def _routed_rows(ids_ptr, expert, T, TOP_K: tl.constexpr, K_PAD: tl.constexpr, ROWS: tl.constexpr):
    """For tokens 0..ROWS-1: (first slot t*TOP_K + j routed to ``expert``, a global id; whether one
    is) and the expert's first slot overall (its owner, whose programs run)."""
    offs_t = tl.arange(0, ROWS)
    offs_j = tl.arange(0, K_PAD)
    slots = offs_t[:, None] * TOP_K + offs_j[None, :]
    ok = (offs_t[:, None] < T) & (offs_j[None, :] < TOP_K)
    ids = tl.load(ids_ptr + slots, mask=ok, other=-1)
    first = tl.min(tl.where(ok & (ids == expert), slots, ROWS * TOP_K), axis=1)
    return first, first < ROWS * TOP_K, tl.min(first, axis=0)


@triton.jit
def _skinny_mainloop(
    a_ptr, a_rows, rows_ok, stride_am, as_ptr, stride_asm, w_ptrs, ws_ptrs, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, K_STEP: tl.constexpr = 1,
):  # fmt: skip
    """acc^T [BLOCK_N, M] = sum over 128-wide K blocks kb of (W[n, kb] . A[row, kb]) * s_a[row, kb]
    * s_w[kb] in fp32. A fp8 rows ``a_rows`` [M] (int64; rows_ok False: read as zeros) with scales
    at as_ptr + row * stride_asm + kb; w_ptrs [BLOCK_N, BLOCK_K]: the fp8 W tile (rows clamped to
    valid ones); ws_ptrs: its weight-scale row (+ kb). K_STEP blocks per pipelined step (their
    loads issued together: K_STEP * 128 contiguous bytes of each weight row), added in kb order
    as with one: the same sums."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + a_rows * stride_asm
    n_kb = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, a_rows.shape[0]), dtype=tl.float32)
    for step in tl.range(0, tl.cdiv(n_kb, K_STEP), num_stages=NUM_STAGES):
        for j in tl.static_range(K_STEP):
            kb = step * K_STEP + j
            k0 = kb * BLOCK_K
            k_ok = offs_k < K - k0  # all False past the last block: zeros, and zero scales below
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            a = tl.load(a_ptrs + k0, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)  # [M, BLOCK_K]
            s_a = tl.load(as_ptrs + kb, mask=rows_ok & (kb < n_kb), other=0.0)
            acc += tl.dot(w, tl.trans(a)) * (s_a * tl.load(ws_ptrs + kb, mask=kb < n_kb, other=0.0))[None, :]
    return acc


@triton.jit
def _skinny_gate_up_kernel(
    x_ptr, xs_ptr, ids_ptr, w_ptr, ws_ptr, b_ptr, inter_ptr, act_ptr, acts_ptr, counter_ptr,
    T, N, K, expert_start, num_experts,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_im, stride_am,
    stride_asm, limit,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, ROWS: tl.constexpr, MMA_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, ALPHA: tl.constexpr, FP8_MAX_C: tl.constexpr,
    EPS: tl.constexpr, PDL: tl.constexpr = False, K_STEP: tl.constexpr = 1,
):  # fmt: skip
    """Owner program (slot, n block) of expert e: inter[first slot of t, n0/2 : (n0 + BLOCK_N)/2] =
    SwiGLU(x[t] @ W13[e, n0 : n0 + BLOCK_N]^T + b13[e]) in fp32 for every token t routed to e; the
    last program of each 128-column group quantizes the group (act, act_scale)."""
    pdl_wait(PDL)  # the routed ids are the predecessor's: no weight address is known before the wait
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot)
    e = expert - expert_start
    if (e < 0) | (e >= num_experts):
        return
    first, routed, owner = _routed_rows(ids_ptr, expert, T, TOP_K, K_PAD, MMA_M)
    if owner != slot:
        return
    e64 = e.to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    w_rows = tl.minimum(n0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = _skinny_mainloop(
        x_ptr, tl.arange(0, MMA_M).to(tl.int64), routed, stride_xm, xs_ptr, stride_xsm,
        w_ptr + e64 * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :],
        ws_ptr + e64 * stride_wse + (n0 // BLOCK_K) * stride_wsn, K, BLOCK_N, BLOCK_K, NUM_STAGES, K_STEP,
    )  # fmt: skip
    h = _bias_swiglu(tl.trans(acc), b_ptr + e64 * stride_be, n0, N, limit, ALPHA, BLOCK_N)  # [MMA_M, BLOCK_N // 2]
    rows = tl.where(routed, first, 0).to(tl.int64)
    offs_i = n0 // 2 + tl.arange(0, BLOCK_N // 2)
    tl.store(inter_ptr + rows[:, None] * stride_im + offs_i[None, :], h, mask=routed[:, None] & (offs_i < N // 2)[None, :])

    # The group's last program to finish quantizes it (the split-K semaphore of attention_decode.py:
    # every thread's stores happen before the count, and the last program's .cg loads see them all).
    group = n0 // (2 * BLOCK_K)
    arrivals = tl.cdiv(tl.minimum(2 * BLOCK_K, N - group * 2 * BLOCK_K), BLOCK_N)
    counter = counter_ptr + slot * tl.cdiv(N // 2, BLOCK_K) + group
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
        tl.store(counter, 0)  # ready for the next call
        first_r, routed_r, _ = _routed_rows(ids_ptr, expert, T, TOP_K, K_PAD, ROWS)  # the real rows only
        rows_r = tl.where(routed_r, first_r, 0).to(tl.int64)
        offs_g = group * BLOCK_K + offs_k
        g_mask = routed_r[:, None] & (offs_g < N // 2)[None, :]
        hg = tl.load(inter_ptr + rows_r[:, None] * stride_im + offs_g[None, :], mask=g_mask, other=0.0, cache_modifier=".cg")
        scale = group_scale(tl.max(tl.abs(hg), axis=1), FP8_MAX_C, EPS)
        q = quantize_with_scale(hg, scale, FP8_MAX_C)
        tl.store(act_ptr + rows_r[:, None] * stride_am + offs_g[None, :], q.to(act_ptr.dtype.element_ty), mask=g_mask)
        tl.store(acts_ptr + rows_r * stride_asm + group, scale, mask=routed_r)


@triton.jit
def _skinny_down_kernel(
    act_ptr, acts_ptr, ids_ptr, w_ptr, ws_ptr, b_ptr, out_ptr,
    T, N, K, expert_start, num_experts,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, MMA_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, ZERO_FOREIGN: tl.constexpr, PDL: tl.constexpr = False,
    K_STEP: tl.constexpr = 1,
):  # fmt: skip
    """Owner program (slot, n block) of expert e: out[every slot of token t routed to e, n0 : n0 +
    BLOCK_N] = act[first slot of t] @ W2[e, n0 : n0 + BLOCK_N]^T + b2[e]; a foreign slot's program
    writes its zeros (ZERO_FOREIGN)."""
    pdl_wait(PDL)
    slot = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    expert = tl.load(ids_ptr + slot)
    e = expert - expert_start
    if (e < 0) | (e >= num_experts):
        if ZERO_FOREIGN:
            tl.store(out_ptr + slot.to(tl.int64) * stride_om + offs_n,
                     tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty), mask=n_ok)  # fmt: skip
        return
    first, routed, owner = _routed_rows(ids_ptr, expert, T, TOP_K, K_PAD, MMA_M)
    if owner != slot:
        return
    e64 = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    acc = _skinny_mainloop(
        act_ptr, tl.where(routed, first, 0).to(tl.int64), routed, stride_am, acts_ptr, stride_asm,
        w_ptr + e64 * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :],
        ws_ptr + e64 * stride_wse + (n0 // BLOCK_K) * stride_wsn, K, BLOCK_N, BLOCK_K, NUM_STAGES, K_STEP,
    )  # fmt: skip
    y = tl.trans(acc) + tl.load(b_ptr + e64 * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y.to(out_ptr.dtype.element_ty)  # [MMA_M, BLOCK_N], row t: token t
    offs_t = tl.arange(0, MMA_M)
    for j in tl.static_range(TOP_K):  # every slot of the token routed here (one, for top-k ids)
        here = tl.load(ids_ptr + offs_t * TOP_K + j, mask=offs_t < T, other=-1) == expert
        dst = out_ptr + (offs_t * TOP_K + j).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, y, mask=here[:, None] & n_ok[None, :])


@contextlib.contextmanager
def _tile_fits(tile: MoeSkinnyTile):
    """Triton's OutOfResources at launch (a tile whose cp.async ring needs more shared memory than this GPU has) as
    one line naming the tile and what to change."""
    try:
        yield
    except triton.runtime.errors.OutOfResources as err:
        raise ValueError(
            f"{tile} needs {err.required} B of {err.name} where this GPU has {err.limit}: "
            "use fewer num_stages, a smaller k_step or a smaller block_n"
        ) from None


def moe_slots_skinny(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor,
    expert_start: int,
    swiglu_limit: float,
    out: torch.Tensor,
    zero_foreign: bool,
    tile: MoeSkinnyTile | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Per-(token, slot) expert outputs into ``out`` [T*k, H] (bf16 / float32, contiguous), returned.

    x_fp8 fp8 [T, H] with x_scale float32 [T, ceil(H/128)] (``act_quant(x)``), T <= 64; topk_ids
    int32 [T, k] global ids; the experts' tensors as in ``moe.moe_expert_slots``. Row t*k + j =
    expert(x[t]) + bias for slot j of token t; slots routed outside [expert_start, expert_start + E)
    are zero rows (``zero_foreign``) or left unwritten. ``tile``: the launches (None:
    ``moe_skinny_tile``). ``pdl``: gate_up launches with programmatic dependent launch
    (kernels/pdl.py); down only with ``PDL_DOWN``. A tile whose ring needs more shared memory than the GPU has:
    ValueError, one line.
    """
    assert x_fp8.dim() == 2 and x_fp8.dtype == FP8_DTYPE and x_fp8.stride(-1) == 1, (
        f"x_fp8 {tuple(x_fp8.shape)} {x_fp8.dtype}: fp8 [T, H] with a contiguous last dim expected"
    )
    t, h = x_fp8.shape
    assert t <= MAX_TOKENS, f"{t} tokens: the skinny path takes at most {MAX_TOKENS} (moe_expert_slots' grouped path)"
    assert x_scale.dtype == torch.float32 and x_scale.shape == (t, cdiv(h, BLOCK)) and x_scale.stride(-1) == 1, (
        f"x_scale {tuple(x_scale.shape)} {x_scale.dtype} does not fit x_fp8 {tuple(x_fp8.shape)}"
    )
    e, i = check_experts(w13, w13_scale_inv, b13, w2, w2_scale_inv, b2, h)
    two_i = 2 * i
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t and topk_ids.dtype == torch.int32, (
        f"topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}: int32 [{t}, k] expected"
    )
    k = topk_ids.shape[1]
    n_slots = t * k
    assert out.shape == (n_slots, h) and out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous(), (
        f"out {tuple(out.shape)} {out.dtype}: contiguous bf16 / float32 [{n_slots}, {h}] expected"
    )
    if n_slots == 0:
        return out
    tile = tile or moe_skinny_tile(n_slots, two_i, h, sm_count(x_fp8.device))
    for bn in (tile.block_n1, tile.block_n2):
        assert bn in (16, 32, 64, 128), f"block_n {bn}: 16, 32, 64 or 128 (inside one 128-row weight-scale block)"
    assert tile.k_step in (1, 2, 4), f"k_step {tile.k_step}: 1, 2 or 4 K blocks a step"
    dev = x_fp8.device
    groups = cdiv(i, BLOCK)
    ids = topk_ids.contiguous()
    inter = torch.empty((n_slots, i), dtype=torch.float32, device=dev)  # SwiGLU outputs, rows of owner slots
    act = torch.empty((n_slots, i), dtype=FP8_DTYPE, device=dev)  # their 1x128 quantization
    act_scale = torch.empty((n_slots, groups), dtype=torch.float32, device=dev)
    rows = next_pow2(t)
    meta = dict(TOP_K=k, K_PAD=next_pow2(k), MMA_M=max(rows, 16), BLOCK_K=BLOCK, NUM_STAGES=tile.num_stages,
                K_STEP=tile.k_step)
    with _tile_fits(tile):  # Triton's OutOfResources as one line
        _skinny_gate_up_kernel[(n_slots, cdiv(two_i, tile.block_n1))](
            x_fp8, x_scale, ids, w13, w13_scale_inv, b13, inter, act, act_scale, arrival_counters(dev, n_slots * groups),
            t, two_i, h, expert_start, e,
            x_fp8.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1), w13_scale_inv.stride(0),
            w13_scale_inv.stride(1), b13.stride(0), inter.stride(0), act.stride(0), act_scale.stride(0),
            float(swiglu_limit),
            ROWS=rows, BLOCK_N=tile.block_n1, ALPHA=SWIGLU_ALPHA, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, PDL=pdl,
            num_warps=tile.num_warps, **meta, **launch_kwargs(pdl),
        )  # fmt: skip
        pdl_down = pdl and PDL_DOWN
        _skinny_down_kernel[(n_slots, cdiv(h, tile.block_n2))](
            act, act_scale, ids, w2, w2_scale_inv, b2, out,
            t, h, i, expert_start, e,
            act.stride(0), act_scale.stride(0), w2.stride(0), w2.stride(1), w2_scale_inv.stride(0),
            w2_scale_inv.stride(1), b2.stride(0), out.stride(0),
            BLOCK_N=tile.block_n2, ZERO_FOREIGN=zero_foreign, PDL=pdl_down, num_warps=tile.num_warps, **meta,
            **launch_kwargs(pdl_down),
        )  # fmt: skip
    return out

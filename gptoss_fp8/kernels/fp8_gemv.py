"""Skinny FP8 block GEMM for decode (M <= 64 rows), split-K (Triton): y = (x_fp8 * s_x) @ (W_fp8 * s_W)^T + b.

Contract (fp8_gemm.py's): x_fp8 float8_e4m3fn [M, K] (last dim contiguous, row stride free) with
x_scale float32 [M, ceil(K/128)] (1x128 groups per row, last dim contiguous); W float8_e4m3fn
[N, K] contiguous with scale_inv float32 [ceil(N/128), ceil(K/128)] contiguous (128x128 blocks,
partial at the edges); bias [N] bf16 / fp32 or None; out a preallocated contiguous [M, N] bf16 or
float32 tensor. Any M >= 1 (tuned for 1..64; more rows take more row tiles), N >= 1, K % 16 == 0.
Agrees with ``quant.fp8.block_gemm_reference`` up to fp32 summation order.

Why a second dense kernel: at decode (M = 1..64) fp8_gemm's 16x64 tiles give 45-80 programs for
the gpt-oss projections, about half a wave on a 132-SM H200, and read the weights at 1.0-1.2 TB/s
(12 us for qkv 5120 x 2880 against a 3.5 us HBM floor). Here the weight is the MMA's M side (swap
AB: ``acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T``, BLOCK_M = max(16, next_pow2(M)) <= 64, so a
single row costs a 16-wide MMA instead of a 64-row one) and K is split across programs: grid
(SPLIT_K, cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)), split s covering K blocks
[s * KB // SPLIT_K, (s + 1) * KB // SPLIT_K) of KB = ceil(K/128) (sizes differ by at most one;
SPLIT_K is clamped to KB, so no split is empty). The split index is the fastest grid axis: the
splits of one tile are launched together and finish together, so its reduction overlaps the other
tiles' streaming when there is more than one wave.

Numerics: promotion every 128 as in fp8_gemm: each K block's fp8 product is its own ``tl.dot``,
scaled by s_W[n block, k block] (a scalar: BLOCK_N divides 128, so a tile lies in one weight-scale
block row) times s_x[row, k block] and added to an fp32 accumulator; fp8 MMAs never accumulate
across K blocks inside the tensor core. K tails load as zeros (masked), weight rows past N are
clamped to row N - 1 on load (or zero-filled by TMA), x rows past M masked to zero; stores are
masked. The bias is added in fp32 after the whole K sum, then one cast to out's dtype.

Split-K reduction (SPLIT_K > 1): every split stores its fp32 partial tile into a workspace
[SPLIT_K, M, N] (torch.empty per call: 4 * SPLIT_K * M * N bytes, 82 KB for qkv at M = 1, split 4),
then the split-K semaphore of attention_decode.py: a CTA barrier, one acq_rel gpu-scope
``atomic_add`` on the tile's arrival counter (``kernels.arrival_counters``); the split that
arrives last resets the counter to 0, reads all partials through L2 (.cg) and adds them in split
order 0 .. SPLIT_K - 1 (so the result does not depend on which split finished last: two calls are
bit-identical), adds the bias and stores out. With SPLIT_K = 1 the program stores out directly
(no workspace, no counter). No host sync and no data-dependent host decision: CUDA-graph capturable
(the workspace comes from the graph's pool; calls on one device must share one stream, as for
every user of the counters).

Tiles: ``skinny_tile`` (below) aims at ~3 programs per SM with every split >= 3 K blocks and the
partials' traffic (8 * SPLIT_K * M bytes per output column, L2) at most half the weight's (K bytes
per column); e.g. qkv 5120 x 2880: 80 tiles of 64 x split 4 (320 programs), o_proj 2880 x 4096:
45 x split 8. Weight loads are pointer loads (cp.async, ``num_stages`` deep) or, with
``SkinnyTile.tma``, a tensor descriptor (TMA); the scales are loaded one K block ahead. Compiled
for sm_90 offline (ptxas): BLOCK_N 64 / 128 tiles run wgmma (m64n16k32 at BLOCK_M 16), 16 / 32 run
mma.sync; 40-54 registers a thread at BLOCK_M 16, ~180 at BLOCK_M 64 (4 warps: 2 programs per SM).
Measured (H200, benchmarks/skinny_sweep.py --quick, thirteenth session): the heuristic's pick
within 4% of the best of 16 variants at 1 and 16 rows for qkv / o_proj / 5760 (qkv 7.3 us at one
row, 2.0 TB/s of weights; 32-row tiles 15-40% slower); in a 20b decode step the 48 calls take
6.9 us each against 12.3 for fp8_gemm's 16 x 64 Triton tile (BENCHMARKS.md "Decode"). The bytes
take 3-3.5 us: launch, ramp-up and the reduction are the rest. TP shard shapes and 32-64 rows not
swept.

Fused residual add + RMSNorm + FP8 quantization (an experiment, not wired into the model;
benchmarks/gemv_norm_ab.py measures it): ``fp8_gemm_skinny_add_rms_norm`` computes delta = the GEMM
(bf16 [M, N]) and then, in the same launch, what ``norm.rms_norm_quant(resid, delta, norm_weight,
eps)`` computes: xo = bf16(resid + delta), y = rmsnorm(xo) bf16 and its 1x128 FP8 groups (q, s),
for N = H (the hidden size: whole rows; BLOCK_H = next_pow2(N)). Protocol: once a tile's delta is
stored (by its last split, or by the tile itself with one split), a CTA barrier and one acq_rel
gpu-scope ``atomic_add`` on its row block's arrival counter (the shared buffer, after the split-K
tiles' counters); the last of the row block's cdiv(N, BLOCK_N) tiles resets it to 0 and runs
norm.py's row arithmetic (``add_rms_norm_rows``, the same helper ``_rms_norm_kernel`` calls) on
the block's rows, norm.py's rows per step, the delta read back through L2 (.cg); with PDL, split 0
of every tile first hints its columns of the norm weight and residual into L2. With norm.py's
warp count (``norm_tile``; the launcher's default: 8 warps at H = 2880) the sums of squares reduce
in the same layout, so all five outputs equal the unfused pair's bit for bit; with other warps
they do in the interpreter, and on the GPU delta and xo do, y within the norm's one bf16 ulp. The
default kernel (``_fp8_gemv_kernel``, no norm) compiles to the same sm_90 PTX as before the norm
went in (the body is ``_fp8_gemv_program`` with NORM off). ptxas sm_90 (o_proj, BLOCK_N 64, split 8):
58 registers at 8 warps (the GEMM alone: 48), 96 at 4 warps (44) at M = 1 (a launch specializes
it), 80 / 148 for M > 1 (3 programs per SM by registers), no spills; the norm's rows are done one
step after another by that one program (loading a step ahead: 95 registers at 8 warps, 2 per SM).

Not done here: fp8 output, per-tensor scales, transposed operands, [..., K] activations (the
caller reshapes), a persistent grid, stream-K (whole K blocks per split only), tiles wider than
one 128-row weight-scale block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gptoss_fp8.kernels import arrival_counters, sm_count
from gptoss_fp8.kernels.norm import add_rms_norm_rows, norm_tile
from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_wait, prefetch_l2
from gptoss_fp8.quant.fp8 import ACT_EPS, ACT_GROUP, BLOCK, FP8_DTYPE, FP8_MAX, cdiv, next_pow2, scale_grid

MAX_BLOCK_M = 64  # rows per tile (x^T is the MMA's N side: 16 .. 64)
# the fused norm's quantization: act_quant's groups, range and scale floor (norm.py passes the same)
_GROUP, _FP8_MAX, _ACT_EPS = tl.constexpr(ACT_GROUP), tl.constexpr(FP8_MAX), tl.constexpr(ACT_EPS)


@dataclass(frozen=True)
class SkinnyTile:
    """One launch of the skinny GEMM: BLOCK_N weight rows per tile (16 / 32 / 64 / 128: divides the
    128-row scale block), K split over ``split_k`` programs (clamped to the K block count), and the
    pipeline: warps, stages, tensor-descriptor weight loads."""

    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False


def block_m_for(m: int) -> int:
    """Rows per tile: the MMA's N side, at least 16 (tl.dot's minimum), at most 64."""
    return min(MAX_BLOCK_M, max(16, next_pow2(m)))


def skinny_tile(m: int, n: int, k: int, sms: int) -> SkinnyTile:
    """The launch for an [m, k] x [n, k]^T problem on ``sms`` SMs (measured at 1 and 16 rows on
    the gpt-oss shapes: the module docstring). Splits: as many as keep the grid at <= 3 programs per SM, each split >= 3 K
    blocks, and the fp32 partials' traffic (8 * split * m bytes per output column) <= half the
    weight's (k bytes per column). Narrow outputs (TP shards) take 32-row tiles when 64-row ones
    cannot fill 2 programs per SM even at the most splits."""
    kb = cdiv(k, BLOCK)
    m_tiles = cdiv(m, MAX_BLOCK_M)
    max_split = max(1, min(kb // 3, k // (16 * m)))
    block_n = 64
    if cdiv(n, block_n) * m_tiles * max_split < 2 * sms:
        block_n = 32
    tiles = cdiv(n, block_n) * m_tiles
    split = max(1, min(max_split, 3 * sms // tiles))
    return SkinnyTile(block_n=block_n, split_k=split, num_warps=4, num_stages=4)


def red_chunk(split: int, num_warps: int) -> int:
    """Elements per step of the split-K reduction: 32 / split per thread (a power of two, >= 2), so
    the unrolled loads of one step hold ~32 registers a thread."""
    per_thread = max(2, 1 << max(0, (32 // split).bit_length() - 1))
    return per_thread * 32 * num_warps


@triton.jit
def _reduce_splits(
    part_ptr,
    bias_ptr,
    out_ptr,
    m0,
    n0,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RED_CHUNK: tl.constexpr,
):
    """out[m0 : m0 + BLOCK_M, n0 : n0 + BLOCK_N] = sum over s = 0 .. SPLIT_K - 1 of the partials
    [SPLIT_K, M, N] (+ bias), added in split order. The tile's valid rows are walked flat in chunks
    of RED_CHUNK elements (BLOCK_N-long row segments, contiguous in the partials and in out), with
    the SPLIT_K loads of a chunk unrolled so they are in flight together (one L2 round trip per
    chunk, not per split) in ~32 registers a thread whatever the tile and split count (a
    [BLOCK_N, BLOCK_M] tile per split spilled 400 bytes at 128 x 64 x 16 splits, ptxas sm_90)."""
    count = tl.minimum(M - m0, BLOCK_M) * BLOCK_N
    offs_e = tl.arange(0, RED_CHUNK)
    for e0 in range(0, count, RED_CHUNK):
        e = e0 + offs_e
        row = (m0 + e // BLOCK_N).to(tl.int64)
        col = n0 + e % BLOCK_N
        ok = (e < count) & (col < N)
        total = tl.zeros((RED_CHUNK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: independent of which split arrived last
            total += tl.load(part_ptr + ((s * M + row) * N + col), mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (row * N + col), total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rows_when_done(
    counter_ptr,
    out_ptr,
    resid_ptr,
    nw_ptr,
    xo_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    pid_m,
    M,
    N,
    stride_r,
    eps,
    BLOCK_M: tl.constexpr,
    NORM_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Called by a tile once its out tile is stored: counts it on the row block's arrival counter
    (after the split-K tiles' counters); the last of the row block's N tiles resets that counter
    and runs norm.py's row arithmetic (``add_rms_norm_rows``, HAS_DELTA and QUANT) over the block's
    rows, NORM_ROWS at a time, the delta (out, every tile's) read back through L2."""
    ctr = counter_ptr + tl.num_programs(1) * tl.num_programs(2) + pid_m
    tl.debug_barrier()  # every thread's out stores before the one acq_rel count
    arrived = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        tl.store(ctr, 0)  # zero again for the next launch
        cols = tl.arange(0, BLOCK_H)
        w = tl.load(nw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        m0 = pid_m * BLOCK_M
        for r0 in range(m0, tl.minimum(M, m0 + BLOCK_M), NORM_ROWS):  # NORM_ROWS divides BLOCK_M
            rows = (r0 + tl.arange(0, NORM_ROWS)).to(tl.int64)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            x = tl.load(resid_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
            d = tl.load(out_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            add_rms_norm_rows(x, d, w, rows, cols, mask, M, N, eps, xo_ptr, y_ptr, q_ptr, s_ptr, N, N, N,
                              tl.cdiv(N, _GROUP), True, True, NORM_ROWS, BLOCK_H, _GROUP, _FP8_MAX, _ACT_EPS)


@triton.jit
def _fp8_gemv_program(
    x_ptr,
    xs_ptr,
    w_src,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RED_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    PF_STEPS: tl.constexpr,
    NORM: tl.constexpr,
    NORM_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    resid_ptr,
    stride_r,
    nw_ptr,
    xo_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    eps,
):
    """One program of the skinny GEMM (the kernels below): split pid_s of output tile (pid_n, pid_m);
    with NORM, the fused residual add + RMSNorm + FP8 quantization of whole rows (N = H) once the
    row block's every tile is stored (``_norm_rows_when_done``)."""
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_kb = tl.cdiv(K, BLOCK_K)
    kb_lo = pid_s * num_kb // SPLIT_K  # whole K blocks; split sizes differ by at most one
    kb_hi = (pid_s + 1) * num_kb // SPLIT_K

    n0 = pid_n * BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = offs_m.to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    xs_ptrs = xs_ptr + rows * stride_xsm
    if not TMA:
        w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: rows past N are never stored
        w_ptrs = w_src + w_rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    ws_row = ws_ptr + (n0 // BLOCK_K) * stride_wsn  # the tile's weight-scale block row

    # The scales are loaded one K block ahead (the pipeliner stages only the MMA operands; a scale
    # load in its own iteration delayed that iteration's next cp.async issue by an L2 round trip).
    # (carried as loaded: a product taken in the loading iteration waited there)
    s_w = tl.load(ws_row + kb_lo)
    if PF_STEPS > 0:  # PDL: this split's weight bytes stream into L2 while the predecessor drains
        offs_p = kb_lo * BLOCK_K + tl.arange(0, PF_STEPS) * 64
        p_ok = offs_p < tl.minimum(kb_hi * BLOCK_K, K)
        prefetch_l2(w_src + w_rows[:, None] * stride_wn + offs_p[None, :], p_ok[None, :] & (offs_n < N)[:, None])
    if NORM and PDL:  # split 0 hints its columns of the norm weight and residual rows into L2 for the norm's tail
        c_ok = (offs_n < N) & (pid_s == 0)
        prefetch_l2(nw_ptr + offs_n, c_ok)
        prefetch_l2(resid_ptr + rows[:, None] * stride_r + offs_n[None, :], m_ok[:, None] & c_ok[None, :])
    pdl_wait(PDL)
    s_x = tl.load(xs_ptrs + kb_lo, mask=m_ok, other=0.0)  # [BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k0 = kb * BLOCK_K
        k_ok = offs_k < K - k0
        if TMA:
            w = w_src.load([n0, k0])  # rows past N and K read as zeros
        else:
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        kn = tl.minimum(kb + 1, kb_hi - 1)  # the last iteration reloads its own block (unused)
        s_x_next = tl.load(xs_ptrs + kn, mask=m_ok, other=0.0)
        s_w_next = tl.load(ws_row + kn)
        # one K block per MMA chain, promoted to fp32 with both scales (promotion every 128)
        acc += tl.dot(w, tl.trans(x)) * (s_x * s_w)[None, :]
        s_x, s_w = s_x_next, s_w_next

    n_ok = offs_n < N
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + (rows[None, :] * N + offs_n[:, None])  # [BLOCK_N, BLOCK_M] into [M, N]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        if NORM:
            _norm_rows_when_done(counter_ptr, out_ptr, resid_ptr, nw_ptr, xo_ptr, y_ptr, q_ptr, s_ptr, pid_m, M, N,
                                 stride_r, eps, BLOCK_M, NORM_ROWS, BLOCK_H)
    else:
        # partials [SPLIT_K, M, N]: split s's tile at (s * M + rows) * N + offs_n (int64: rows)
        tl.store(part_ptr + ((pid_s * M + rows[None, :]) * N + offs_n[:, None]), acc, mask=mask)
        # The split-K semaphore: the barrier orders every thread's partial stores before the one
        # acq_rel count; the last split's .cg loads (L2) then see all partials.
        tile = pid_m * tl.num_programs(1) + pid_n
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.store(counter_ptr + tile, 0)  # zero again for the next launch
            _reduce_splits(part_ptr, bias_ptr, out_ptr, pid_m * BLOCK_M, n0, M, N, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K, RED_CHUNK)
            if NORM:
                _norm_rows_when_done(counter_ptr, out_ptr, resid_ptr, nw_ptr, xo_ptr, y_ptr, q_ptr, s_ptr, pid_m, M, N,
                                     stride_r, eps, BLOCK_M, NORM_ROWS, BLOCK_H)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    xs_ptr,
    w_src,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RED_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
    PF_STEPS: tl.constexpr = 0,  # with PDL: 64-byte steps of each weight row's split prefetched before the wait
):
    _fp8_gemv_program(
        x_ptr, xs_ptr, w_src, ws_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, stride_xm, stride_xsm, stride_wn,
        stride_wsn, HAS_BIAS, TMA, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, RED_CHUNK, PDL, PF_STEPS,
        False, 1, 1, None, None, None, None, None, None, None, None,  # no norm
    )


@triton.jit
def _fp8_gemv_norm_kernel(
    x_ptr,
    xs_ptr,
    w_src,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RED_CHUNK: tl.constexpr,
    resid_ptr,  # the residual [M, N] bf16 (row stride stride_r) and its norm weight fp32 [N]
    stride_r,
    nw_ptr,
    xo_ptr,  # outputs, contiguous: x + delta and the normed rows bf16 [M, N], q fp8 [M, N], s fp32 [M, ceil(N/128)]
    y_ptr,
    q_ptr,
    s_ptr,
    eps,
    NORM_ROWS: tl.constexpr,  # norm.py's tile (norm_tile): rows per step (divides BLOCK_M), the row's width
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
    PF_STEPS: tl.constexpr = 0,
):
    _fp8_gemv_program(
        x_ptr, xs_ptr, w_src, ws_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, stride_xm, stride_xsm, stride_wn,
        stride_wsn, HAS_BIAS, TMA, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, RED_CHUNK, PDL, PF_STEPS,
        True, NORM_ROWS, BLOCK_H, resid_ptr, stride_r, nw_ptr, xo_ptr, y_ptr, q_ptr, s_ptr, eps,
    )


def fp8_gemm_skinny(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tile: SkinnyTile | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """FP8 block GEMM with fused bias for few rows, written into ``out``; returns ``out``.

    x_fp8 float8_e4m3fn [M, K] (last dim contiguous) with x_scale float32 [M, ceil(K/128)] (last dim
    contiguous); w_fp8 float8_e4m3fn [N, K] contiguous with w_scale_inv float32
    [ceil(N/128), ceil(K/128)] contiguous; bias [N] bf16/fp32 or None; out contiguous [M, N] bf16 or
    float32. ``tile``: this launch instead of ``skinny_tile``'s choice (split_k is clamped to
    ceil(K/128)). Agrees with ``block_gemm_reference`` up to fp32 summation order. ``pdl``: launch
    with programmatic dependent launch (kernels/pdl.py), the weights prefetched into L2 before the wait.
    """
    return _launch(x_fp8, x_scale, w_fp8, w_scale_inv, bias, out, tile, pdl)


def fp8_gemm_skinny_add_rms_norm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    resid: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    tile: SkinnyTile | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_gemm_skinny`` then ``norm.rms_norm_quant(resid, delta, norm_weight, eps)`` in one launch:
    returns (delta bf16 [M, N], xo = resid + delta bf16 [M, N], y = the normed xo bf16 [M, N],
    q fp8 [M, N], s float32 [M, ceil(N/128)]), all new and contiguous. An experiment, not wired in.

    The GEMM operands as for ``fp8_gemm_skinny``; resid bf16 [M, N] (last dim contiguous) is the
    residual stream, N its width H (whole rows: the last of a row block's N tiles to store its
    delta normalises the block's rows, norm.py's ``add_rms_norm_rows``), norm_weight float32 [N].
    ``tile``: the GEMM's launch; by default ``skinny_tile``'s with norm.py's warp count for this H
    (``norm_tile``), so the sum of squares runs in the unfused norm's order and the outputs equal
    the unfused pair's bit for bit (the same ``tile`` for the GEMM alone). With other warps: bit for
    bit in the interpreter; on the GPU delta and xo bit for bit, y within the norm's one bf16 ulp.
    """
    m, n = resid.shape if resid.dim() == 2 else (-1, -1)
    assert resid.dim() == 2 and resid.dtype == torch.bfloat16 and resid.stride(-1) == 1, (
        f"resid {tuple(resid.shape)} {resid.dtype}: want a bf16 [M, N] with a contiguous last dim"
    )
    assert x_fp8.dim() == 2 and x_fp8.shape[0] == m and w_fp8.dim() == 2 and w_fp8.shape[0] == n, (
        f"resid {tuple(resid.shape)} is not the output [M, N] of x {tuple(x_fp8.shape)} and weight {tuple(w_fp8.shape)}"
    )
    assert norm_weight.shape == (n,) and norm_weight.dtype == torch.float32 and norm_weight.is_contiguous(), (
        f"norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype}: want a contiguous float32 [{n}]"
    )
    dev = resid.device
    assert norm_weight.device == dev, "all tensors must be on one device"
    delta = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    xo, y = torch.empty_like(delta), torch.empty_like(delta)
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=dev)
    s = torch.empty((m, cdiv(n, ACT_GROUP)), dtype=torch.float32, device=dev)
    if m == 0:
        return delta, xo, y, q, s
    block_h, norm_rows, norm_warps = norm_tile(n, quant=True)
    if tile is None:
        tile = replace(skinny_tile(m, n, x_fp8.shape[1], sm_count(dev)), num_warps=norm_warps)
    norm = (resid, norm_weight, float(eps), xo, y, q, s, norm_rows, block_h)
    _launch(x_fp8, x_scale, w_fp8, w_scale_inv, bias, delta, tile, pdl, norm)
    return delta, xo, y, q, s


def _launch(x_fp8, x_scale, w_fp8, w_scale_inv, bias, out, tile, pdl, norm=None) -> torch.Tensor:
    """Checks the GEMM's operands and launches it (``_fp8_gemv_kernel``; with ``norm``, the tuple
    of ``fp8_gemm_skinny_add_rms_norm``, ``_fp8_gemv_norm_kernel``)."""
    assert x_fp8.dtype == FP8_DTYPE and w_fp8.dtype == FP8_DTYPE, f"fp8 operands expected, got {x_fp8.dtype}, {w_fp8.dtype}"
    assert x_fp8.dim() == 2 and w_fp8.dim() == 2, (
        f"x must be [M, K] and weight [N, K], got {tuple(x_fp8.shape)}, {tuple(w_fp8.shape)}"
    )
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    assert w_fp8.shape[1] == k, f"x {tuple(x_fp8.shape)} does not match weight {tuple(w_fp8.shape)}"
    assert k % 16 == 0, f"K={k} must be a multiple of 16 (16-byte rows)"
    assert x_scale.dtype == torch.float32 and w_scale_inv.dtype == torch.float32, "scales must be float32"
    assert x_scale.shape == (m, cdiv(k, BLOCK)), f"x_scale {tuple(x_scale.shape)} does not fit x {tuple(x_fp8.shape)}"
    assert w_scale_inv.shape == scale_grid(n, k), (
        f"w_scale_inv {tuple(w_scale_inv.shape)} does not fit weight {tuple(w_fp8.shape)}"
    )
    assert x_fp8.stride(-1) == 1 and x_scale.stride(-1) == 1, "x and x_scale need a contiguous last dimension"
    assert w_fp8.is_contiguous() and w_scale_inv.is_contiguous(), "weight and its scales must be contiguous"
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype in (torch.bfloat16, torch.float32) and bias.is_contiguous(), (
            f"bias {tuple(bias.shape)} {bias.dtype}: want a contiguous [{n}] bf16 or float32"
        )
    assert out.shape == (m, n) and out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous(), (
        f"out {tuple(out.shape)} {out.dtype} is not a contiguous ({m}, {n}) bf16 or float32"
    )
    dev = x_fp8.device
    assert all(t.device == dev for t in (x_scale, w_fp8, w_scale_inv, out) + ((bias,) if bias is not None else ())), (
        "all tensors must be on one device"
    )
    tile = tile or skinny_tile(m, n, k, sm_count(dev))
    bn = tile.block_n
    assert bn in (16, 32, 64, 128), f"block_n={bn}: tiles must lie inside one 128-row weight-scale block"
    assert tile.split_k >= 1, f"split_k={tile.split_k}"
    if m == 0:
        return out
    bm = block_m_for(m)
    split = min(tile.split_k, cdiv(k, BLOCK))
    num_n, num_m = cdiv(n, bn), cdiv(m, bm)
    if split > 1 or norm is not None:
        # split-K tiles' counters, then (norm) one per row block
        counter = arrival_counters(dev, num_n * num_m + (num_m if norm is not None else 0))
    else:
        counter = out  # unused
    part = torch.empty((split, m, n), dtype=torch.float32, device=dev) if split > 1 else out  # (else unused)
    # TMA needs a 16-byte aligned base (the row stride K is a multiple of 16)
    tma = tile.tma and w_fp8.data_ptr() % 16 == 0
    w_src = TensorDescriptor.from_tensor(w_fp8, [bn, BLOCK]) if tma else w_fp8
    kernel, extra = _fp8_gemv_kernel, {}
    if norm is not None:
        resid, nw, eps, xo, y, q, s, norm_rows, block_h = norm
        assert bm % norm_rows == 0 and block_h >= n, (bm, norm_rows, block_h, n)
        kernel = _fp8_gemv_norm_kernel
        extra = dict(resid_ptr=resid, stride_r=resid.stride(0), nw_ptr=nw, xo_ptr=xo, y_ptr=y, q_ptr=q, s_ptr=s, eps=eps,
                     NORM_ROWS=norm_rows, BLOCK_H=block_h)
    kernel[(split, num_n, num_m)](
        x_fp8,
        x_scale,
        w_src,
        w_scale_inv,
        bias if bias is not None else out,
        out,
        part,
        counter,
        m,
        n,
        k,
        x_fp8.stride(0),
        x_scale.stride(0),
        w_fp8.stride(0),
        w_scale_inv.stride(0),
        HAS_BIAS=bias is not None,
        TMA=tma,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=BLOCK,
        SPLIT_K=split,
        RED_CHUNK=red_chunk(split, tile.num_warps),
        PDL=pdl,
        PF_STEPS=next_pow2(2 * cdiv(cdiv(k, BLOCK), split)) if pdl and not tma else 0,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **extra,
        **launch_kwargs(pdl),
    )
    return out

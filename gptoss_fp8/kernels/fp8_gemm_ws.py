"""Warp-specialized FP8 block GEMM + bias for Hopper (sm_90), written in Gluon (triton's explicit
layout / barrier / partition dialect, ``triton.experimental.gluon``).

Same contract and numerics as kernels/fp8_gemm.py, whose plain-torch reference
(``fp8_gemm_reference``) is this kernel's reference too: y = (x_fp8 * s_x) @ (W_fp8 * s_W)^T + b,
each 128-wide K block's fp8 tensor-core product scaled by s_x[row, kb] * s_W[col block, kb] into an
fp32 accumulator, the bias added in fp32, one cast to bf16. ``fp8_gemm`` calls it (for large M on
sm_90, see ``KernelConfig.dense_tile``); call it through there.

Structure: one persistent program per SM walking 128 x 128 output tiles in grouped order.
- A 1-warp producer partition streams the (A, B) K blocks of this program's tiles through a ring of
  STAGES shared-memory stages with TMA, each stage's arrival signalled on its ``ready`` mbarrier.
- Two consumer warpgroups, each a partition of its own, own 64 rows of every tile: each issues
  the wgmma of K block i + 1 before it waits for block i's, then scales block i's product into its
  accumulator (the tensor cores stay busy through the promotion), and releases the stage on its
  ``empty`` mbarrier (count 2: free once both consumers are done with it). Being separate
  partitions, the two drift: one's promotion and epilogue run beside the other's wgmma.
- Epilogue: bias added, the bf16 tile written to shared memory and stored by TMA asynchronously;
  the store is waited for only before that buffer is written again, one tile later.
Wide forms (``GluonTile(block_m=256, promote="serial")`` / ``GluonTile(block_n=256,
promote="serial")``; the 128 x 256 one is the default from 8192 rows, ``KernelConfig``): 256 x 128
or 128 x 256 tiles, each consumer warpgroup holding two 64 x 128 fp32 accumulators and one
promotion temporary, each K block's wgmmas waited for within their iteration so ptxas does not
serialize them (``_gluon.block_scaled_mainloop_serial``, the only loop of the wide forms: they
refuse promote="pipelined"); 1.5x the FLOPs per loaded byte of the 128 x 128 tile.
``GluonTile(promote="serial")`` on the 128 x 128 tile: the same loop with one product.
``GluonTile(balance=True)``: the fewest programs that keep the number of waves.
Triton's tile language cannot express this on Hopper (its automatic warp specialization hangs on
the H200 with triton 3.6: benchmarks/repro_triton_autows_hang.py).

Measured (H200, benchmarks/notes/kernels_gemm.md, seventh session): 8192 x 5120 x 2880 295 us
(819 TFLOP/s) against 310 us (778) for the Triton kernel in the same run; 8192 x 2880 x 4096
237 us (816) against 248 us (778).

Requirements (``supported`` / ``fp8_gemm`` check them and fall back to the Triton kernel
otherwise): an sm_90 device, triton with Gluon's Hopper API (3.6), bf16 output with N % 8 == 0
(16-byte rows for the TMA store), A rows 16-byte aligned. K tails and M / N tails are handled by
TMA's zero fill on load and its clipping on store.
"""

from __future__ import annotations

import torch

from gptoss_fp8.kernels import sm_count
from gptoss_fp8.kernels._gluon import (  # noqa: F401 - re-exported
    HAS_GLUON,
    check_narrow,
    check_promote,
    check_stage_scales,
    check_thread_release,
    check_turns,
    num_programs,
    stage_scale_args,
    stage_scale_box,
    supported,
)
from gptoss_fp8.quant.fp8 import ACT_EPS, FP8_MAX, cdiv

if HAS_GLUON:
    from gptoss_fp8.kernels._gluon import (
        block_scaled_mainloop,
        block_scaled_mainloop_serial,
        descriptor,
        fence_async_shared,
        gl,
        gluon,
        halves,
        load_stage,
        load_stage_scaled,
        mbarrier,
        stage_scale_buffers,
        tile_coords,
        tma,
        turn_barriers,
        unhalves,
    )

BM, BN, BK = 128, 128, 128  # output tile and K block (= the scale group)
WARPGROUP_ROWS = BM // 2  # rows of a tile per consumer warpgroup (and of one TMA store)
WIDE = 256  # the wide forms' long tile side: 256 x 128 (block_m) or 128 x 256 (block_n) tiles
SMEM_BYTES = 227 * 1024  # one sm_90 block's shared memory
Q_HEAD = 64  # ``q_fp8``: the columns of one head (and rows of one Q scale block: attn_quant's QK_BLOCK)




if HAS_GLUON:

    @gluon.jit
    def _produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, GROUP_M: gl.constexpr,
                 scales=None, SC: gl.constexpr = False):
        """TMA producer: every K block of every tile of this program, in the consumers' order. SC
        (``GluonTile.stage_scales``, 128 x 256 tiles; ``scales`` = (sa_desc, sb_desc, sa_bufs, sb_bufs,
        stride_bsn)): each K block's row and weight scales too (``_gluon.load_stage_scaled``)."""
        TM: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        TK: gl.constexpr = a_desc.block_type.shape[1]
        num_m = gl.cdiv(M, TM)
        num_n = gl.cdiv(N, TN)
        n_k = gl.cdiv(K, TK)
        c = 0  # K blocks issued over all tiles: stage c % S, its use number c // S
        for tile in range(gl.program_id(0), num_m * num_n, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            for kk in range(n_k):
                if SC:
                    sa_desc, sb_desc, sa_bufs, sb_bufs, stride_bsn = scales
                    c = load_stage_scaled(a_desc, b_desc, sa_desc, sb_desc, empty, ready, a_bufs, b_bufs, sa_bufs,
                                          sb_bufs, c, [pid_m * TM, kk * TK], [pid_n * TN, kk * TK],
                                          kk * (gl.cdiv(M, 4) * 4) + pid_m * TM,
                                          (pid_n * (TN // TK)) * stride_bsn + kk)
                else:
                    c = load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, [pid_m * TM, kk * TK],
                                   [pid_n * TN, kk * TK])

    @gluon.jit
    def _consume(ROW0: gl.constexpr, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_smem,
                 M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr,
                 SERIAL: gl.constexpr = False):
        """One consumer warpgroup: rows ROW0 .. ROW0 + 64 of every tile of this program."""
        TM: gl.constexpr = a_bufs.type.shape[1]
        TN: gl.constexpr = b_bufs.type.shape[1]
        TK: gl.constexpr = a_bufs.type.shape[2]
        ROWS: gl.constexpr = c_smem.type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TN, 32])
        num_m = gl.cdiv(M, TM)
        num_n = gl.cdiv(N, TN)
        n_k = gl.cdiv(K, TK)
        c = 0
        for tile in range(gl.program_id(0), num_m * num_n, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            rows = pid_m * TM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            rmask = rows < M
            a_s_ptr = as_ptr + rows * stride_asm
            b_s_ptr = bs_ptr + pid_n * stride_bsn  # TN = 128: one weight-scale block row per tile
            if SERIAL:  # promotion, each block's wgmma waited for in its iteration (no C7514 serialization)
                acc, _unused, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, ROW0, ROW0, ROWS, 0, 0, TN,
                                                               as_ptr, rows * stride_asm, 0, rmask, rmask,
                                                               b_s_ptr, 0, c, n_k, layout, True, False)
            else:
                acc, c = block_scaled_mainloop(ready, empty, a_bufs, b_bufs, ROW0, ROWS, 0, TN, a_s_ptr, rmask, b_s_ptr,
                                               c, n_k, layout, True)
            # epilogue (the producer is already loading this program's next tile)
            if HAS_BIAS:
                cols = pid_n * TN + gl.arange(0, TN, layout=gl.SliceLayout(0, layout))
                acc = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
            tma.store_wait(0)  # the previous tile's store has left c_smem
            c_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [pid_m * TM + ROW0, pid_n * TN], c_smem)
        tma.store_wait(0)

    # The two worker partitions take the same arguments (a warp_specialize requirement).
    @gluon.jit
    def _second_consumer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                         M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr,
                         SERIAL: gl.constexpr = False):
        _consume(c_bufs.type.shape[1], empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs.index(1),
                 M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS, SERIAL)

    @gluon.jit
    def _producer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                  M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr,
                  SERIAL: gl.constexpr = False):
        _produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, GROUP_M)

    @gluon.jit
    def _ws_fp8_gemm_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_desc, M, N, K, stride_asm, stride_bsn,
                            num_progs, STAGES: gl.constexpr, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr,
                            SERIAL: gl.constexpr = False):
        TM: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        TK: gl.constexpr = a_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TM, TK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TN, TK], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, TM // 2, TN], c_desc.layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=2)  # released by both consumer warpgroups
            mbarrier.init(ready.index(i), count=1)
        gl.warp_specialize([
            (_consume, (0, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs.index(0),
                        M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS, SERIAL)),
            (_second_consumer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                                M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS, SERIAL)),
            (_producer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                         M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS, SERIAL)),
        ], [4, 1], [232, 40])


if HAS_GLUON:
    _Q_MAX = gl.constexpr(FP8_MAX)  # (``q_fp8``: what a Q block's amax maps to, and the scale's floor: attn_quant's)
    _Q_EPS = gl.constexpr(ACT_EPS)

    @gluon.jit
    def _consume_wide(W: gl.constexpr, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                      M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr,
                      turn, TURN: gl.constexpr, sa_bufs=None, sb_bufs=None, SC: gl.constexpr = False, r_desc=None,
                      rbar=None, RES: gl.constexpr = False, NARROW: gl.constexpr = False, q8_desc=None, qf=None,
                      QN: gl.constexpr = 0):
        """Wide forms, consumer warpgroup W, two 64 x 128 accumulators (``block_scaled_mainloop_serial``):
        256 x 128 tiles: rows W*128 .. W*128 + 128 as two 64-row products sharing each B stage;
        128 x 256 tiles: rows W*64 .. W*64 + 64, columns 0..128 and 128..256 as two products sharing
        each A stage (the second skipped where it lies wholly past N). Each 64 x 128 piece leaves
        through its own TMA store. c_bufs [2 * NB, 64, 128]: NB store buffers per warpgroup (with
        one, the second piece waits until the first piece's store has read the buffer). TURN
        (``GluonTile(turns=True)``): the two warpgroups issue their wgmmas in turns on the ``turn``
        barriers (``_gluon.block_scaled_mainloop_serial``). SC (``GluonTile(stage_scales=True)``, 128 x 256
        only): the scales from the stages (sa_bufs, sb_bufs). RES (two store buffers a warpgroup): the epilogue
        adds the residual r_desc's tile to the bf16-rounded product + bias and rounds again (``spec.add_rms_norm``'s
        x + delta); each tile's residual lands by TMA in the store buffers (barrier rbar[W]) while the tile before's
        products run: issued once that tile's stores have read the buffers. QN > 0 (128 x 256, ``q_fp8``): the output's
        columns [0, QN) are Q's heads, rotated and quantized here (``_store_q8``: into q8_desc; qf = (qs_ptr,
        cos_ptr, sin_ptr, nbq)) instead of stored; the columns from QN on stored to c_desc at column - QN."""
        TM: gl.constexpr = a_bufs.type.shape[1]
        TN: gl.constexpr = b_bufs.type.shape[1]
        TK: gl.constexpr = a_bufs.type.shape[2]
        R: gl.constexpr = c_bufs.type.shape[1]
        HN: gl.constexpr = c_bufs.type.shape[2]  # columns of one product
        NB: gl.constexpr = c_bufs.type.shape[0] // 2
        WN: gl.constexpr = TN > HN  # 128 x 256 (else 256 x 128)
        A0: gl.constexpr = W * R if WN else W * 2 * R
        A1: gl.constexpr = A0 if WN else A0 + R
        B1: gl.constexpr = HN if WN else 0
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
        num_m = gl.cdiv(M, TM)
        num_n = gl.cdiv(N, TN)
        n_k = gl.cdiv(K, TK)
        c = 0
        rphase = 0
        if RES:
            gl.static_assert(NB == 2, "the residual lands in both store buffers of a warpgroup")
            if gl.program_id(0) < num_m * num_n:
                _load_residual(r_desc, rbar.index(W), c_bufs, W, gl.program_id(0), num_m, num_n, GROUP_M, TM, TN, A0,
                               R, HN, WN)
        for tile in range(gl.program_id(0), num_m * num_n, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            row0 = pid_m * TM + A0
            col0 = pid_n * TN
            rows0 = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
            a_offs = rows0 * stride_asm
            b_s_ptr = bs_ptr + (col0 // TK) * stride_bsn  # one weight-scale block row per 128 columns
            if WN and NARROW and col0 + HN // 2 >= N:
                # the last column tile's valid columns fit one m64n64 product: only that one (N = 2880: 2.2% of the
                # products were columns past N); its half-width piece leaves through the first buffer's left half
                # (the box's right half lies past N: clipped)
                layout_n: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                   instr_shape=[16, HN // 2, 32])
                rows_n = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, layout_n))
                accn, _unused, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, A0, A1, R, 0, B1, HN // 2,
                                                                 as_ptr, rows_n * stride_asm, 0, rows_n < M, rows_n < M,
                                                                 b_s_ptr, stride_bsn, c, n_k, layout_n, True, False,
                                                                 turn, W, TURN, sa_bufs, sb_bufs, SC)
                buf = c_bufs.index(W * NB)
                if HAS_BIAS:
                    colsn = col0 + gl.arange(0, HN // 2, layout=gl.SliceLayout(0, layout_n))
                    accn = accn + gl.expand_dims(gl.load(bias_ptr + colsn, mask=colsn < N, other=0.0).to(gl.float32), 0)
                if RES:
                    mbarrier.wait(rbar.index(W), rphase)
                    rphase ^= 1
                    accn = _plus_residual(accn, buf.slice(0, HN // 2, dim=1), layout_n)
                else:
                    tma.store_wait(0)  # the previous tile's stores have left c_bufs
                buf.slice(0, HN // 2, dim=1).store(accn.to(gl.bfloat16))
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [row0, col0 - QN], buf)  # (QN: Q's columns are not out's)
            else:
                if WN:
                    row1 = row0
                    col1 = col0 + HN
                    if col1 < N:
                        acc0, acc1, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, A0, A1, R, 0, B1,
                                                                      HN, as_ptr, a_offs, 0, rows0 < M, rows0 < M,
                                                                      b_s_ptr, stride_bsn, c, n_k, layout, True, True,
                                                                      turn, W, TURN, sa_bufs, sb_bufs, SC)
                    else:
                        acc0, acc1, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, A0, A1, R, 0, B1,
                                                                      HN, as_ptr, a_offs, 0, rows0 < M, rows0 < M,
                                                                      b_s_ptr, stride_bsn, c, n_k, layout, True, False,
                                                                      turn, W, TURN, sa_bufs, sb_bufs, SC)
                else:
                    row1 = row0 + R
                    col1 = col0
                    acc0, acc1, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, A0, A1, R, 0, B1, HN,
                                                                 as_ptr, a_offs, R * stride_asm, rows0 < M,
                                                                 rows0 + R < M, b_s_ptr, 0, c, n_k, layout, True, True,
                                                                 turn, W, TURN)
                if HAS_BIAS:
                    cols0 = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, layout))
                    acc0 = acc0 + gl.expand_dims(gl.load(bias_ptr + cols0, mask=cols0 < N, other=0.0).to(gl.float32), 0)
                    cols1 = col1 + gl.arange(0, HN, layout=gl.SliceLayout(0, layout))
                    acc1 = acc1 + gl.expand_dims(gl.load(bias_ptr + cols1, mask=cols1 < N, other=0.0).to(gl.float32), 0)
                if RES:  # (the buffers hold this tile's residual: the stores before it were waited for when issued)
                    mbarrier.wait(rbar.index(W), rphase)
                    rphase ^= 1
                    acc0 = _plus_residual(acc0, c_bufs.index(W * NB), layout)
                    acc1 = _plus_residual(acc1, c_bufs.index(W * NB + 1), layout)
                else:
                    tma.store_wait(0)  # the previous tile's stores have left c_bufs
                if QN > 0:
                    if col0 < QN:  # (QN a multiple of 256: a tile is all Q or none)
                        _store_q8(acc0, acc1, c_bufs, W, row0, col0, M, q8_desc, qf)
                    else:
                        _store_pieces(acc0, acc1, c_desc, c_bufs, W, row0, col0 - QN, row1, col1 - QN)
                else:
                    _store_pieces(acc0, acc1, c_desc, c_bufs, W, row0, col0, row1, col1)
            if RES:
                if tile + num_progs < num_m * num_n:  # the next tile's residual, once these stores have read the buffers
                    tma.store_wait(0)
                    _load_residual(r_desc, rbar.index(W), c_bufs, W, tile + num_progs, num_m, num_n, GROUP_M, TM, TN,
                                   A0, R, HN, WN)
        tma.store_wait(0)

    @gluon.jit
    def _store_pieces(acc0, acc1, c_desc, c_bufs, W: gl.constexpr, row0, col0, row1, col1):
        """A warpgroup's two pieces rounded to bf16 into its store buffers, then to c_desc at (row0, col0) and (row1,
        col1) by TMA (clipped past M, N); with one buffer a warpgroup the second waits for the first's store."""
        NB: gl.constexpr = c_bufs.type.shape[0] // 2
        c_bufs.index(W * NB).store(acc0.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row0, col0], c_bufs.index(W * NB))
        if NB == 1:
            tma.store_wait(0)
        c_bufs.index(W * NB + NB - 1).store(acc1.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row1, col1], c_bufs.index(W * NB + NB - 1))

    @gluon.jit
    def _q8_head(h, c, s, ok, s_ptr, s_ok):
        """One head's 64 x 64 block (bf16 values in fp32, the wgmma layout) rotated by its rows' c / s and quantized
        as attn_quant's ``_quantize_qk_kernel`` (ROPE) does q's bf16 rows: ``rotate``'s two FMAs rounded to bf16
        (rows past M, ~ok, zero), one scale max(amax, eps) / 448 stored at s_ptr (where s_ok), IEEE quotients
        saturated at +-448, the e4m3 cast -> the e4m3 block."""
        x1, x2 = halves(h.to(gl.float32))
        y1 = gl.where(ok, gl.fma(x1, c, -(x2 * s)).to(gl.bfloat16).to(gl.float32), 0.0)
        y2 = gl.where(ok, gl.fma(x2, c, x1 * s).to(gl.bfloat16).to(gl.float32), 0.0)
        amax = gl.maximum(gl.max(gl.max(gl.abs(y1), axis=1), axis=0), gl.max(gl.max(gl.abs(y2), axis=1), axis=0))
        scale = gl.maximum(amax, _Q_EPS) / _Q_MAX
        gl.store(s_ptr, scale, mask=s_ok)
        q1 = gl.minimum(gl.maximum(gl.div_rn(y1, scale), -_Q_MAX), _Q_MAX).to(gl.float8e4nv)
        q2 = gl.minimum(gl.maximum(gl.div_rn(y2, scale), -_Q_MAX), _Q_MAX).to(gl.float8e4nv)
        return unhalves(q1, q2)

    @gluon.jit
    def _q8_piece(y, c, s, ok, s_ptr, s_ok, nbq):
        """A 64 x 128 piece of Q (two heads: the product + bias rounded to bf16, as the GEMM would store it), each
        head rotated and quantized (``_q8_head``; its scale at s_ptr, the second head's nbq further)."""
        h0, h1 = halves(y)
        return unhalves(_q8_head(h0, c, s, ok, s_ptr, s_ok), _q8_head(h1, c, s, ok, s_ptr + nbq, s_ok))

    @gluon.jit
    def _store_q8(acc0, acc1, c_bufs, W: gl.constexpr, row0, col0, M, q8_desc, qf):
        """``q_fp8``: a warpgroup's 64 rows of a tile of Q's columns (acc0 columns col0.., acc1 col0 + 128..: four
        heads) rotated at positions row0.. and quantized (``_q8_piece``), attn_quant.quantize_qk(rope=)'s bytes and
        scales: the e4m3 pieces through the store buffers (reinterpreted) to q8_desc by TMA, each head's scale to
        qs_ptr[head, row0 // 64]."""
        qs_ptr, cos_ptr, sin_ptr, nbq = qf
        y0 = acc0.to(gl.bfloat16)  # (both pieces held as bf16 from here: half the registers)
        y1 = acc1.to(gl.bfloat16)
        R: gl.constexpr = acc0.type.shape[0]
        HN: gl.constexpr = acc0.type.shape[1]
        HALF: gl.constexpr = HN // 4  # (half a head)
        NB: gl.constexpr = c_bufs.type.shape[0] // 2
        probe, _unused = halves(halves(y0)[0])  # (a half head's layout: the rope rows' loads take it)
        lay: gl.constexpr = probe.type.layout
        rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, lay))
        j = gl.arange(0, HALF, layout=gl.SliceLayout(0, lay))
        ok = gl.expand_dims(rows < M, 1)
        cs = gl.expand_dims(rows.to(gl.int64) * HALF, 1) + gl.expand_dims(j, 0)
        c = gl.load(cos_ptr + cs, mask=ok, other=0.0)
        s = gl.load(sin_ptr + cs, mask=ok, other=0.0)
        s_ptr = qs_ptr + (col0 // (2 * HALF)) * nbq + row0 // R
        s_ok = row0 < M
        buf = c_bufs.index(W * NB)._reinterpret(gl.float8e4nv, [R, HN], q8_desc.layout)
        buf.store(_q8_piece(y0, c, s, ok, s_ptr, s_ok, nbq))
        fence_async_shared()
        tma.async_copy_shared_to_global(q8_desc, [row0, col0], buf)
        if NB == 1:
            tma.store_wait(0)
        buf = c_bufs.index(W * NB + NB - 1)._reinterpret(gl.float8e4nv, [R, HN], q8_desc.layout)
        buf.store(_q8_piece(y1, c, s, ok, s_ptr + 2 * nbq, s_ok, nbq))
        fence_async_shared()
        tma.async_copy_shared_to_global(q8_desc, [row0, col0 + HN], buf)

    @gluon.jit
    def _load_residual(r_desc, bar, c_bufs, W: gl.constexpr, tile, num_m, num_n, GROUP_M: gl.constexpr,
                       TM: gl.constexpr, TN: gl.constexpr, A0: gl.constexpr, R: gl.constexpr, HN: gl.constexpr,
                       WN: gl.constexpr):
        """The residual of consumer warpgroup W's two pieces of ``tile`` into its two store buffers (TMA, on bar;
        rows / columns past M / N arrive as zeros and are clipped from the store)."""
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        row0 = pid_m * TM + A0
        col0 = pid_n * TN
        mbarrier.expect(bar, 2 * r_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(r_desc, [row0, col0], bar, c_bufs.index(W * 2))
        if WN:
            tma.async_copy_global_to_shared(r_desc, [row0, col0 + HN], bar, c_bufs.index(W * 2 + 1))
        else:
            tma.async_copy_global_to_shared(r_desc, [row0 + R, col0], bar, c_bufs.index(W * 2 + 1))

    @gluon.jit
    def _plus_residual(acc, buf, layout: gl.constexpr):
        """The product (+ bias) rounded to bf16, then the bf16 residual added in fp32 (the caller rounds once more):
        torch's bf16 ``x + delta``."""
        return acc.to(gl.bfloat16).to(gl.float32) + buf.load(layout).to(gl.float32)

    @gluon.jit
    def _wide_second_consumer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                              M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr,
                              HAS_BIAS: gl.constexpr, turn, TURN: gl.constexpr, sa_bufs, sb_bufs, SC: gl.constexpr,
                              r_desc, rbar, RES: gl.constexpr, NARROW: gl.constexpr, q8_desc, qf,
                              QN: gl.constexpr):
        _consume_wide(1, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs, M, N, K, stride_asm,
                      stride_bsn, num_progs, GROUP_M, HAS_BIAS, turn, TURN, sa_bufs, sb_bufs, SC, r_desc, rbar, RES,
                      NARROW, q8_desc, qf, QN)

    @gluon.jit
    def _wide_producer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, GROUP_M: gl.constexpr, scales,
                       SC: gl.constexpr):
        _produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, GROUP_M, scales, SC)

    @gluon.jit
    def _ws_fp8_gemm_wide_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_desc, M, N, K, stride_asm, stride_bsn,
                                 num_progs, STAGES: gl.constexpr, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr,
                                 C_BUFS: gl.constexpr, TURN: gl.constexpr = False, sa_desc=None, sb_desc=None,
                                 SC: gl.constexpr = False, r_desc=None, RES: gl.constexpr = False,
                                 NARROW: gl.constexpr = False, q8_desc=None, qs_ptr=None, cos_ptr=None, sin_ptr=None,
                                 nbq=None, QN: gl.constexpr = 0):
        """The wide forms (``GluonTile(block_m=256, promote="serial")``: 256 x 128 tiles, DeepGEMM's
        choice for these shapes; ``GluonTile(block_n=256, promote="serial")``: 128 x 256), always on
        the serial promotion loop: per K block 48 KB of loads for 256 x 128 x 128
        MACs (the 128 x 128 tile: 32 KB for half of that), i.e. 1.5x the FLOPs per byte through L2
        and shared memory. The producer is the base kernel's; C_BUFS: TMA-store buffers per consumer
        warpgroup (1 or 2). SC (``GluonTile.stage_scales``, 128 x 256): the scales through the stages,
        sa_desc over the row scales MN-major and sb_desc over the weight scales, both flat. RES: out = r_desc's
        tensor (bf16, out's shape) + the product + bias, each rounded to bf16 (``_consume_wide``). QN > 0 (128 x 256):
        the columns [0, QN) rotated and quantized into q8_desc / qs_ptr (``_store_q8``: cos_ptr / sin_ptr the rope
        tables, nbq the scales' row length), c_desc holding the columns from QN on."""
        TM: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        TK: gl.constexpr = a_desc.block_type.shape[1]
        R: gl.constexpr = c_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TM, TK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TN, TK], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * C_BUFS, R, c_desc.block_type.shape[1]], c_desc.layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=2)  # released by both consumer warpgroups
            mbarrier.init(ready.index(i), count=1)
        turn = turn_barriers(empty, TURN)  # the consumer warpgroups' turns at the tensor core (GluonTile.turns)
        sa_bufs, sb_bufs = stage_scale_buffers(sa_desc, sb_desc, empty, STAGES, TM, SC)
        rbar = turn_barriers(empty, RES)  # (two barriers of one arrival: each consumer warpgroup's residual tiles)
        # (a tuple of the workers' Q pointers: it holds no constexprs or descriptors, which a tuple in a variable loses)
        qf = (qs_ptr, cos_ptr, sin_ptr, nbq)
        gl.warp_specialize([
            (_consume_wide, (0, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                             M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS, turn, TURN, sa_bufs,
                             sb_bufs, SC, r_desc, rbar, RES, NARROW, q8_desc, qf, QN)),
            (_wide_second_consumer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc,
                                     c_bufs, M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS, turn,
                                     TURN, sa_bufs, sb_bufs, SC, r_desc, rbar, RES, NARROW, q8_desc, qf, QN)),
            (_wide_producer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, GROUP_M,
                              (sa_desc, sb_desc, sa_bufs, sb_bufs, stride_bsn), SC)),
        ], [4, 1], [232, 40])


def wide_c_bufs(stages: int, scale_bytes: int = 0) -> int:
    """Store buffers per consumer warpgroup of the wide kernel that fit beside ``stages`` stages (with
    ``scale_bytes`` of scales a stage: ``GluonTile.stage_scales``)."""
    stage = (WIDE + BN) * BK + scale_bytes  # fp8 A and B blocks
    c_buf = WARPGROUP_ROWS * BN * 2  # one bf16 64 x 128 store buffer
    for bufs in (2, 1):
        if stages * stage + 2 * bufs * c_buf + 1024 <= SMEM_BYTES:
            return bufs
    raise AssertionError(f"{stages} stages of {stage} bytes do not fit the wide kernel's shared memory")


def ws_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                bias: torch.Tensor | None, out: torch.Tensor, stages: int = 4, group_m: int = 8,
                block_m: int = BM, block_n: int = BN, balance: bool = False,
                promote: str = "pipelined", turns: bool = False, stage_scales: bool = False,
                residual: torch.Tensor | None = None, narrow: bool = False,
                q_fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[M, N] (bf16, contiguous) = the block GEMM + bias of 2-D a [M, K] (rows 16-byte aligned,
    last dim contiguous) with a_scale [M, ceil(K/128)], w [N, K] contiguous, w_scale_inv
    [ceil(N/128), ceil(K/128)]. Shapes are checked by ``fp8_gemm``, which is the entry point.
    block_m x block_n: 128 x 128 (the base kernel), 256 x 128 or 128 x 256 (the wide forms);
    balance: ``_gluon.num_programs``; promote: the 128 x 128 kernel's main loop, "pipelined"
    (``_gluon.block_scaled_mainloop``, the shipped one) or "serial" (every K block's wgmma waited
    for within its iteration, ``_gluon.block_scaled_mainloop_serial``, no C7514); the wide forms
    have only "serial" (ValueError otherwise). turns: the wide forms' two consumer warpgroups issue
    their wgmmas in turns (``GluonTile.turns``; ValueError for the 128 x 128 tile). stage_scales: the
    128 x 256 form's scales through the stages (``GluonTile.stage_scales``; ValueError for the other
    tiles; a_scale best MN-major, else transposed here, ``_gluon.stage_scale_args``). residual (bf16, out's shape,
    contiguous; ``residual_fused`` says where): out = residual + the product + bias rounded to bf16, then rounded
    again (the residual add of ``spec.add_rms_norm``), added in the wide forms' epilogue; out may be residual
    itself (each tile reads its residual before it writes). narrow (``GluonTile.narrow``, 128 x 256 only; ValueError
    for the other tiles): the last column tile as one m64n64 product a warpgroup where its valid columns fit 64.
    q_fp8 = (q8, qs, cos, sin) (128 x 256 only; ``fp8_gemm.fp8_gemm_q8``): the first QN = q8.shape[1] columns are Q's heads of 64
    (QN a multiple of 256): rotated at positions 0.. by cos / sin (fp32 [>= M, 32], contiguous) and quantized in the
    epilogue into q8 (e4m3 [M, QN], contiguous) and qs (fp32 [QN / 64, ceil(M / 64)], contiguous), the bytes and
    scales of ``attn_quant.quantize_qk`` of the rotated bf16 columns (``rope=``); out [M, N - QN] holds the rest."""
    wide = (block_m, block_n) != (BM, BN)
    check_promote(promote, wide, f"the {block_m} x {block_n} Gluon dense GEMM")
    check_turns(turns, wide, f"{block_m} x {block_n} (the base dense tile)")
    check_stage_scales(stage_scales, (block_m, block_n) == (BM, WIDE), f"the {block_m} x {block_n} Gluon dense GEMM")
    check_narrow(narrow, (block_m, block_n) == (BM, WIDE), f"the {block_m} x {block_n} Gluon dense GEMM")
    m, k = a.shape
    n = w.shape[0]
    qf = {}  # (``q_fp8``: the kernel's Q arguments)
    if q_fp8 is not None:
        qf = _q_fp8_args(q_fp8, m, n, out, (block_m, block_n), residual)
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and n % 8 == 0, "bf16 out with 16-byte rows"
    assert (block_m, block_n) in ((BM, BN), (WIDE, BN), (BM, WIDE)), (
        f"tile {block_m} x {block_n}: the Gluon dense GEMM has 128 x 128, 256 x 128 and 128 x 256 tiles")
    a_desc, b_desc = descriptor(a, [block_m, BK]), descriptor(w, [block_n, BK])
    c_desc = descriptor(out, [WARPGROUP_ROWS, BN])
    num_progs = num_programs(cdiv(m, block_m) * cdiv(n, block_n), sm_count(a.device), balance)
    sc, scale_bytes = {}, 0
    if stage_scales:
        sc, w_scale_inv = stage_scale_args(a_scale, w_scale_inv, block_m)
        scale_bytes = 4 * (block_m + sc["sb_desc"].block_shape[0])  # a stage's row and weight scales
    c_bufs = wide_c_bufs(stages, scale_bytes) if wide else 0
    res = {}
    if residual is not None:
        if not residual_fused(block_m, block_n, stages, stage_scales, k):
            raise ValueError(f"residual: the wide tiles with two store buffers a warpgroup add it, not {block_m} x "
                             f"{block_n} with {stages} stages (residual_fused)")
        assert residual.shape == out.shape and residual.dtype == torch.bfloat16 and residual.is_contiguous(), (
            f"residual {tuple(residual.shape)} {residual.dtype}: a contiguous bf16 {tuple(out.shape)}")
        res = dict(r_desc=descriptor(residual, [WARPGROUP_ROWS, BN]), RES=True)
    args = (a_desc, b_desc, a_scale, w_scale_inv, bias if bias is not None else out, c_desc, m, n, k,
            a_scale.stride(0), w_scale_inv.stride(0), num_progs)
    if not wide:
        serial = dict(SERIAL=True) if promote == "serial" else {}  # the shipped launch keeps its exact signature
        _ws_fp8_gemm_kernel[(num_progs,)](*args, STAGES=stages, GROUP_M=group_m, HAS_BIAS=bias is not None,
                                          num_warps=4, **serial)
    else:
        _ws_fp8_gemm_wide_kernel[(num_progs,)](*args, STAGES=stages, GROUP_M=group_m, HAS_BIAS=bias is not None,
                                               C_BUFS=c_bufs, num_warps=4, **({"TURN": True} if turns else {}),
                                               **sc, **res, **({"NARROW": True} if narrow else {}), **qf)
    return out


def _q_fp8_args(q_fp8, m: int, n: int, out: torch.Tensor, tile: tuple[int, int], residual) -> dict:
    """``ws_fp8_gemm(q_fp8=)``'s checks and kernel arguments."""
    q8, qs, cos, sin = q_fp8
    qn = q8.shape[-1]
    if tile != (BM, WIDE) or residual is not None:
        raise ValueError(f"q_fp8: the 128 x 256 tile without a residual quantizes Q, not {tile[0]} x {tile[1]}"
                         f"{' with a residual' if residual is not None else ''}")
    assert 0 < qn < n and qn % WIDE == 0, f"q_fp8: Q's {qn} columns, a multiple of {WIDE} below N = {n}"
    assert q8.shape == (m, qn) and q8.dtype == torch.float8_e4m3fn and q8.is_contiguous(), (
        f"q8 {tuple(q8.shape)} {q8.dtype}: a contiguous e4m3 {(m, qn)}")
    assert qs.shape == (qn // Q_HEAD, cdiv(m, Q_HEAD)) and qs.dtype == torch.float32 and qs.is_contiguous(), (
        f"qs {tuple(qs.shape)} {qs.dtype}: a contiguous fp32 {(qn // Q_HEAD, cdiv(m, Q_HEAD))}")
    for t in (cos, sin):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.shape[0] >= m and t.shape[1:] == (Q_HEAD // 2,), (
            f"rope table {tuple(t.shape)} {t.dtype}: contiguous fp32 [>= {m}, {Q_HEAD // 2}]")
    assert out.shape == (m, n - qn), f"out {tuple(out.shape)}: the {n - qn} columns after Q's"
    return dict(q8_desc=descriptor(q8, [WARPGROUP_ROWS, BN]), qs_ptr=qs, cos_ptr=cos, sin_ptr=sin, nbq=qs.shape[1],
                QN=qn)


def residual_fused(block_m: int, block_n: int, stages: int, stage_scales: bool, k: int) -> bool:
    """Whether ``ws_fp8_gemm`` adds a residual in this tile's epilogue (K = k): the wide forms with two store
    buffers a consumer warpgroup (``wide_c_bufs``), where each tile's residual lands."""
    if (block_m, block_n) not in ((WIDE, BN), (BM, WIDE)):
        return False
    scale_bytes = 4 * (block_m + stage_scale_box(cdiv(k, BK))) if stage_scales else 0  # (as ``ws_fp8_gemm``'s)
    try:
        return wide_c_bufs(stages, scale_bytes) == 2
    except AssertionError:
        return False

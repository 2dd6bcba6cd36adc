"""The MoE gate_up GEMM, warp-specialized for Hopper (sm_90), in Gluon.

Same contract and numerics as the Triton gate_up of kernels/moe_gemm.py (its reference,
``spec.moe_w8a8``, is this kernel's too), except that A comes pre-gathered: the tokens'
FP8 activations already in padded sorted row order (``moe.gather_act_quant``), rows in segments of
64 (TILE_M, the experts' alignment). W13 [E, 2I, H] fp8 with gate/up rows interleaved; epilogue:
bias, the clamped SwiGLU, the 1x128 FP8 quantization of the result (one scale per row and 128
outputs), written in sorted row order through TMA. Each K block's fp8 product is scaled by
s_a[row, kb] * s_w[expert, col block, kb] into an fp32 accumulator (promotion every 128).
Opt-in forms: the wide gate_up (``GluonTile(block_m=128, promote="serial")``, 128 x 256 tiles over
128-row segments, each warpgroup 64 rows x all 256 columns as two promoted products: no row-max
exchange, 1.67x the FLOPs per byte) and the down GEMM on the same tiles (``ws_moe_down``,
``GluonTile(block_m=128, promote="serial")``, output rows scattered to the slots with 16-byte
stores through shared memory; the earlier 64 x 256 Gluon down with 4-byte stores from the wgmma
layout ran 5-10% behind the Triton down, BENCHMARKS.md seventh session). Both run only
``_gluon.block_scaled_mainloop_serial`` (the promotion numerics with no wgmma in flight across a
loop back edge, no C7514) and refuse promote="pipelined"; the 64 x 256 gate_up takes either loop
(``GluonTile(promote="serial")`` is the default, ``KernelConfig.moe_gluon_gate_up``).
The base gate_up keeps ``slots_ptr``, ``out_ptr``, ``num_slots`` and
``stride_om`` in its argument lists, unused.

Structure (the dense fp8_gemm_ws.py's, on 64 x 256 tiles; experts' row segments are padded to 64):
one persistent program per SM walks (row tile, column tile) pairs in grouped order, skipping row
tiles past the last expert's segment. A 1-warp producer streams A [64, 128] and W [256, 128]
K blocks through a ring of shared-memory stages with TMA. Two consumer warpgroups, each its own
partition, share the A rows and own 128 of the 256 columns (one weight-scale block each), issue
the wgmma of K block i + 1 before promoting block i, and release a stage when both are done. For
gate_up, a tile's 256 interleaved gate/up columns are one 128-wide quantization group of the
SwiGLU output: the two warpgroups exchange their row maxima through shared memory (an mbarrier per
tile parity) and each stores its 64 FP8 columns with a TMA store. A warpgroup whose 128 columns lie
wholly past N (the last column tile of H = 2880 or 2I = 5760) skips its MMAs.
"""

from __future__ import annotations

import torch

from gptoss_fp8.kernels import sm_count
from gptoss_fp8.kernels._gluon import (  # noqa: F401 - re-exported
    HAS_GLUON,
    check_gather,
    check_narrow,
    check_promote,
    check_stage_scales,
    check_thread_release,
    check_turns,
    num_programs,
    stage_scale_args,
    supported,
    weight_scale_args,
)
from gptoss_fp8.quant.fp8 import cdiv

if HAS_GLUON:
    from gptoss_fp8.kernels._gluon import (
        async_copy,
        block_scaled_mainloop,
        block_scaled_mainloop_halves,
        block_scaled_mainloop_serial,
        descriptor,
        fence_async_shared,
        gl,
        gluon,
        load_stage,
        load_stage_scaled,
        mbarrier,
        release,
        skip_turns,
        stage_scale_buffers,
        tile_coords,
        tma,
        turn_barriers,
    )

TILE_M, TILE_N, BK = 64, 256, 128  # rows (= the experts' segment alignment), columns, K block
HALF_N = TILE_N // 2  # columns per consumer warpgroup
WIDE_M = 128  # the wide form's rows (segments padded to 128): 64 per consumer warpgroup, all 256 columns


if HAS_GLUON:
    GATHER_WARPS = gl.constexpr(4)  # the gathering gate_up's producer warps (GluonTile.gather: _moe_gather_producer)

    @gluon.jit
    def swiglu_columns(acc, nmask, limit, ALPHA: gl.constexpr):
        """acc [rows, 2w] interleaved gate/up columns (bias added) -> the clamped SwiGLU [rows, w] in
        kernels/moe_gemm.py's arithmetic; columns past N (nmask False) give exactly 0."""
        acc = gl.where(gl.expand_dims(nmask, 0), acc, 0.0)
        gate, up = gl.split(gl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
        gate = gl.minimum(gate, limit)
        up = gl.minimum(gl.maximum(up, -limit), limit)
        return gate * (1 / (1 + gl.exp(-(ALPHA * gate)))) * (up + 1.0)

    @gluon.jit
    def _moe_produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K, num_experts,
                     num_progs, GROUP_M: gl.constexpr, scales=None, SC: gl.constexpr = False):
        """The 1-warp producer: each tile's K blocks of A rows and W rows into the stage ring. SC
        (``GluonTile.stage_scales``; ``scales`` = (sa_desc, sb_desc, sa_bufs, sb_bufs, stride_bse,
        stride_bsn)): each K block's row scales (A's scales MN-major) and the two column halves'
        weight scales too (``_gluon.load_stage_scaled``)."""
        TM: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        TK: gl.constexpr = a_desc.block_type.shape[1]
        num_n = gl.cdiv(N, TN)
        n_k = gl.cdiv(K, TK)
        c = 0
        for tile in range(gl.program_id(0), num_m * num_n, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            expert = gl.load(block_expert_ptr + pid_m)
            if expert < num_experts:
                if SC:
                    sa_desc, sb_desc, sa_bufs, sb_bufs, stride_bse, stride_bsn = scales
                    sb0 = expert * stride_bse + (pid_n * (TN // TK)) * stride_bsn
                    for kk in range(n_k):
                        c = load_stage_scaled(a_desc, b_desc, sa_desc, sb_desc, empty, ready, a_bufs, b_bufs, sa_bufs,
                                              sb_bufs, c, [pid_m * TM, kk * TK], [expert * N + pid_n * TN, kk * TK],
                                              kk * (num_m * TM) + pid_m * TM, sb0 + kk)
                else:
                    for kk in range(n_k):
                        c = load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, [pid_m * TM, kk * TK],
                                       [expert * N + pid_n * TN, kk * TK])

    @gluon.jit
    def _moe_consume(W: gl.constexpr, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_smem, as_ptr, bs_ptr, bias_ptr,
                     out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots, num_experts,
                     stride_asm, stride_bse, stride_bsn, stride_biase, stride_om, stride_osm, limit, num_progs,
                     GROUP_M: gl.constexpr, ALPHA: gl.constexpr,
                     FP8_MAX_C: gl.constexpr, EPS: gl.constexpr, SERIAL: gl.constexpr = False):
        """Consumer warpgroup W (0 or 1): columns W*128 .. W*128 + 128 of every tile (SERIAL:
        ``block_scaled_mainloop_serial`` with one product instead of the pipelined promotion loop,
        whose wgmmas ptxas serializes)."""
        S: gl.constexpr = a_bufs.type.shape[0]
        TM: gl.constexpr = a_bufs.type.shape[1]
        TK: gl.constexpr = a_bufs.type.shape[2]
        TN: gl.constexpr = b_bufs.type.shape[1]
        HN: gl.constexpr = TN // 2
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
        num_n = gl.cdiv(N, TN)
        n_k = gl.cdiv(K, TK)
        c = 0
        t_local = 0
        for tile in range(gl.program_id(0), num_m * num_n, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            expert32 = gl.load(block_expert_ptr + pid_m)
            if expert32 < num_experts:
                expert = expert32.to(gl.int64)
                col0 = pid_n * TN + W * HN
                rows = pid_m * TM + gl.arange(0, TM, layout=gl.SliceLayout(1, layout))
                cols = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, layout))
                a_s_ptr = as_ptr + rows * stride_asm
                b_s_ptr = bs_ptr + expert * stride_bse + (col0 // TK) * stride_bsn
                if col0 < N:
                    if SERIAL:
                        acc, _unused, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, 0, 0, TM, W * HN,
                                                                       W * HN, HN, as_ptr, rows * stride_asm, 0, rows,
                                                                       rows, b_s_ptr, 0, c, n_k, layout, False, False)
                    else:
                        acc, c = block_scaled_mainloop(ready, empty, a_bufs, b_bufs, 0, TM, W * HN, HN, a_s_ptr, rows,
                                                       b_s_ptr, c, n_k, layout, False)
                else:  # all columns past N: only keep the stage ring in step
                    acc = gl.zeros((TM, HN), gl.float32, layout)
                    for _kk in range(n_k):
                        mbarrier.wait(ready.index(c % S), (c // S) & 1)
                        mbarrier.arrive(empty.index(c % S), count=1)
                        c += 1
                nmask = cols < N
                acc = acc + gl.expand_dims(
                    gl.load(bias_ptr + expert * stride_biase + cols, mask=nmask, other=0.0).to(gl.float32), 0)
                h = swiglu_columns(acc, nmask, limit, ALPHA)
                amax = gl.max(gl.abs(h), axis=1)
                # the other warpgroup's half of the 128-wide group: exchange row maxima
                p = t_local % 2
                x_smem.index(2 * p + W).store(amax)
                mbarrier.arrive(xbar.index(p), count=1)
                mbarrier.wait(xbar.index(p), (t_local // 2) & 1)
                amax = gl.maximum(amax, x_smem.index(2 * p + 1 - W).load(amax.type.layout))
                scale_o = gl.maximum(amax, EPS) / FP8_MAX_C
                q = h / gl.expand_dims(scale_o, 1)
                if FP8_MAX_C != 448.0:  # (at 448 the satfinite cast saturates itself: act_quant.e4m3_saturated)
                    q = gl.minimum(gl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
                tma.store_wait(0)
                o_smem.store(q.to(gl.float8e4nv))
                fence_async_shared()
                tma.async_copy_shared_to_global(out_desc, [pid_m * TM, pid_n * HN + W * (HN // 2)], o_smem)
                if W == 0:
                    srows = pid_m * TM + gl.arange(0, TM, layout=amax.type.layout)
                    gl.store(out_s_ptr + srows * stride_osm + pid_n, scale_o)
                t_local += 1
        tma.store_wait(0)

    # The two worker partitions take the same arguments (a warp_specialize requirement).
    @gluon.jit
    def _moe_second_consumer(a_desc, b_desc, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs, as_ptr, bs_ptr,
                             bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K,
                             num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_om,
                             stride_osm, limit, num_progs, GROUP_M: gl.constexpr,
                             ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr,
                             SERIAL: gl.constexpr = False):
        _moe_consume(1, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs.index(1), as_ptr, bs_ptr, bias_ptr, out_ptr,
                     out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm,
                     stride_bse, stride_bsn, stride_biase, stride_om, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C,
                     EPS, SERIAL)

    @gluon.jit
    def _moe_producer(a_desc, b_desc, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs, as_ptr, bs_ptr,
                      bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K,
                      num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_om,
                      stride_osm, limit, num_progs, GROUP_M: gl.constexpr,
                      ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr,
                      SERIAL: gl.constexpr = False):
        _moe_produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K, num_experts,
                     num_progs, GROUP_M)

    @gluon.jit
    def _ws_moe_gemm_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr,
                            block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse,
                            stride_bsn, stride_biase, stride_om, stride_osm, limit, num_progs,
                            STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                            ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr,
                            SERIAL: gl.constexpr = False):
        TM: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        TK: gl.constexpr = a_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TM, TK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TN, TK], b_desc.layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        xbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        x_smem = gl.allocate_shared_memory(gl.float32, [4, TM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        o_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, TM, TN // 4], out_desc.layout)
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=2)  # released by both consumer warpgroups
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(xbar.index(i), count=2)
        gl.warp_specialize([
            (_moe_consume, (0, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs.index(0), as_ptr, bs_ptr, bias_ptr,
                            out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots,
                            num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_om, stride_osm, limit,
                            num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS, SERIAL)),
            (_moe_second_consumer, (a_desc, b_desc, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs, as_ptr, bs_ptr,
                                    bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K,
                                    num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                                    stride_om, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C,
                                    EPS, SERIAL)),
            (_moe_producer, (a_desc, b_desc, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs, as_ptr, bs_ptr,
                             bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K,
                             num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_om,
                             stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS, SERIAL)),
        ], [4, 1], [232, 40])


if HAS_GLUON:

    @gluon.jit
    def _wide_consume(W: gl.constexpr, empty, ready, a_bufs, b_bufs, out_bufs, as_ptr, bs_ptr, bias_ptr, slots_ptr,
                      block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse, stride_bsn,
                      stride_biase, num_progs, GROUP_M: gl.constexpr, DOWN: gl.constexpr, out, turn,
                      TURN: gl.constexpr, sa_bufs, sb_bufs, SC: gl.constexpr, top_k=1, GATHER: gl.constexpr = False,
                      NARROW: gl.constexpr = False, TR: gl.constexpr = False):
        """Consumer warpgroup W of the two 128 x 256 kernels, the wide gate_up and (DOWN) the down:
        rows W*64 .. W*64 + 64 of every tile, all 256 columns as two 128-column products sharing each
        A stage (``block_scaled_mainloop_halves``; the right half is skipped where it lies wholly past
        N). A warpgroup whose first row is padding (a segment's padding rows come last, so all its
        rows are) skips its products and only keeps the stage ring in step. Then + bias and

        - gate_up (``out`` = (out_desc, out_s_ptr, stride_osm, stride_osn, limit, ALPHA, FP8_MAX_C, EPS)): the
          clamped SwiGLU; the tile's 128 SwiGLU outputs (one FP8 group) sit in one warpgroup, so no
          row-max exchange; FP8 out through out_bufs[2W], out_bufs[2W + 1] and TMA stores, the row
          scales at out_s_ptr. Padding rows are written too (their outputs: the bias's SwiGLU).
        - down (``out`` = (y_ptr, stride_ym)): each 64 x 128 piece goes through this warpgroup's
          shared-memory buffer out_bufs[W] into 16-byte row stores at its tokens' slots (padding
          rows not written).

        TURN (``GluonTile(turns=True)``): the two warpgroups issue their wgmmas in turns on the
        ``turn`` barriers (``_gluon.block_scaled_mainloop_serial``); a warpgroup of padding rows takes
        its turns with no wgmma (``skip_turns``).

        SC (``GluonTile(stage_scales=True)``): the K blocks' scales from the stages (sa_bufs, sb_bufs;
        ``_gluon.load_stage_scaled``), not from as_ptr / bs_ptr.

        GATHER (the gate_up, ``GluonTile(gather=True)``): the A rows are the tokens' own
        (``_moe_gather_producer`` copies them by cp.async), so the row scales are the tokens' too: as_ptr holds
        the [T, ceil(K/128)] scales of the unsorted rows, read at row slot // top_k (padding rows: row 0's, times
        their zero A rows), or with SC copied into the stages by the producer; a proxy fence after each ready wait
        (the mainloop's FENCE).

        NARROW (the down, ``GluonTile(narrow=True)``): the last column tile, where its valid columns fit 64
        (H = 2880), as one m64n64 product a warpgroup, stored through the left half of its buffer.

        Both epilogues are written inline, not as functions the walk calls: an inlined function's
        scope puts debug-info labels ($L__tmpN) into the PTX, which ptxas takes as block boundaries;
        with the down's epilogue a function of its own the PTX instructions were the same but the
        down's SASS was not."""
        S: gl.constexpr = a_bufs.type.shape[0]
        TM: gl.constexpr = a_bufs.type.shape[1]
        TK: gl.constexpr = a_bufs.type.shape[2]
        TN: gl.constexpr = b_bufs.type.shape[1]
        R: gl.constexpr = TM // 2
        HN: gl.constexpr = TN // 2
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
        if DOWN:
            y_ptr, stride_ym = out
            # 8 bf16 (16 bytes) per thread, a warp on 2 rows x 128 columns: coalesced row stores
            store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
            c_smem = out_bufs.index(W)
        else:
            out_desc, out_s_ptr, stride_osm, stride_osn, limit, ALPHA, FP8_MAX_C, EPS = out
        num_n = gl.cdiv(N, TN)
        n_k = gl.cdiv(K, TK)
        c = 0
        for tile in range(gl.program_id(0), num_m * num_n, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            expert32 = gl.load(block_expert_ptr + pid_m)
            if expert32 < num_experts:
                expert = expert32.to(gl.int64)
                row0 = pid_m * TM + W * R
                col0 = pid_n * TN
                rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
                if GATHER:
                    slot_r = gl.load(slots_ptr + rows)
                    a_offs = gl.where(slot_r < num_slots, slot_r // top_k, 0) * stride_asm
                else:
                    a_offs = rows * stride_asm
                b_s_ptr = bs_ptr + expert * stride_bse + (col0 // TK) * stride_bsn
                live = gl.load(slots_ptr + row0) < num_slots
                if DOWN and NARROW and live and col0 + HN // 2 >= N:
                    # (GluonTile.narrow) the last column tile's valid columns fit one m64n64 product: only that
                    layout_n: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                       instr_shape=[16, HN // 2, 32])
                    store_n: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                    rows_n = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, layout_n))
                    accn, _unused, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, W * R, W * R, R, 0,
                                                                     HN, HN // 2, as_ptr, rows_n * stride_asm, 0,
                                                                     rows_n < num_slots, rows_n < num_slots, b_s_ptr,
                                                                     stride_bsn, c, n_k, layout_n, False, False, turn, W,
                                                                     TURN, sa_bufs, sb_bufs, SC, False, TR)
                    srows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, store_n))
                    slot = gl.load(slots_ptr + srows)
                    colsn = col0 + gl.arange(0, HN // 2, layout=gl.SliceLayout(0, layout_n))
                    accn = accn + gl.expand_dims(
                        gl.load(bias_ptr + expert * stride_biase + colsn, mask=colsn < N, other=0.0).to(gl.float32), 0)
                    c_half = c_smem.slice(0, HN // 2, dim=1)
                    c_half.store(accn.to(gl.bfloat16))
                    vals = c_half.load(store_n)
                    scols = col0 + gl.arange(0, HN // 2, layout=gl.SliceLayout(0, store_n))
                    gl.store(y_ptr + gl.expand_dims(slot.to(gl.int64) * stride_ym, 1) + gl.expand_dims(scols, 0), vals,
                             mask=gl.expand_dims(slot < num_slots, 1) & gl.expand_dims(scols < N, 0))
                elif live:
                    acc0, acc1, c = block_scaled_mainloop_halves(ready, empty, a_bufs, b_bufs, W * R, W * R, R, 0, HN,
                                                                 HN, as_ptr, a_offs, 0, rows < num_slots,
                                                                 rows < num_slots, b_s_ptr, stride_bsn, c, n_k,
                                                                 layout, False, col0 + HN < N, turn, W, TURN,
                                                                 sa_bufs, sb_bufs, SC, GATHER, TR)
                    if DOWN:
                        srows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, store_layout))
                        slot = gl.load(slots_ptr + srows)
                        smask = gl.expand_dims(slot < num_slots, 1)
                        y_rows = y_ptr + gl.expand_dims(slot.to(gl.int64) * stride_ym, 1)
                        bias_row = bias_ptr + expert * stride_biase
                        cols0 = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, layout))
                        acc0 = acc0 + gl.expand_dims(
                            gl.load(bias_row + cols0, mask=cols0 < N, other=0.0).to(gl.float32), 0)
                        c_smem.store(acc0.to(gl.bfloat16))
                        vals = c_smem.load(store_layout)
                        scols = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, store_layout))
                        gl.store(y_rows + gl.expand_dims(scols, 0), vals, mask=smask & gl.expand_dims(scols < N, 0))
                        if col0 + HN < N:
                            cols1 = cols0 + HN
                            acc1 = acc1 + gl.expand_dims(
                                gl.load(bias_row + cols1, mask=cols1 < N, other=0.0).to(gl.float32), 0)
                            c_smem.store(acc1.to(gl.bfloat16))
                            vals = c_smem.load(store_layout)
                            scols = scols + HN
                            gl.store(y_rows + gl.expand_dims(scols, 0), vals,
                                     mask=smask & gl.expand_dims(scols < N, 0))
                else:  # padding rows only: keep the stage ring in step
                    if not DOWN:  # (the gate_up writes them: the bias's SwiGLU)
                        acc0 = gl.zeros((R, HN), gl.float32, layout)
                        acc1 = gl.zeros((R, HN), gl.float32, layout)
                    for _kk in range(n_k):
                        mbarrier.wait(ready.index(c % S), (c // S) & 1)
                        release(empty, c % S, TR)
                        skip_turns(turn, W, c, TURN)
                        c += 1
                if not DOWN:
                    # the column indices after the main loop: 32 registers each in the wgmma layout,
                    # not held through it
                    cols0 = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, layout))
                    cols1 = cols0 + HN
                    nmask0 = cols0 < N
                    nmask1 = cols1 < N
                    bias_row = bias_ptr + expert * stride_biase
                    acc0 = acc0 + gl.expand_dims(gl.load(bias_row + cols0, mask=nmask0, other=0.0).to(gl.float32), 0)
                    acc1 = acc1 + gl.expand_dims(gl.load(bias_row + cols1, mask=nmask1, other=0.0).to(gl.float32), 0)
                    h0 = swiglu_columns(acc0, nmask0, limit, ALPHA)
                    h1 = swiglu_columns(acc1, nmask1, limit, ALPHA)
                    amax = gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1))
                    scale_o = gl.maximum(amax, EPS) / FP8_MAX_C
                    inv = gl.expand_dims(scale_o, 1)
                    q0 = h0 / inv
                    q1 = h1 / inv
                    if FP8_MAX_C != 448.0:  # (at 448 the satfinite cast saturates itself: act_quant.e4m3_saturated)
                        q0 = gl.minimum(gl.maximum(q0, -FP8_MAX_C), FP8_MAX_C)
                        q1 = gl.minimum(gl.maximum(q1, -FP8_MAX_C), FP8_MAX_C)
                    tma.store_wait(0)  # the previous tile's stores have left out_bufs
                    out_bufs.index(2 * W).store(q0.to(gl.float8e4nv))
                    out_bufs.index(2 * W + 1).store(q1.to(gl.float8e4nv))
                    fence_async_shared()
                    tma.async_copy_shared_to_global(out_desc, [row0, pid_n * HN], out_bufs.index(2 * W))
                    tma.async_copy_shared_to_global(out_desc, [row0, pid_n * HN + HN // 2], out_bufs.index(2 * W + 1))
                    srows = row0 + gl.arange(0, R, layout=amax.type.layout)
                    gl.store(out_s_ptr + srows * stride_osm + pid_n * stride_osn, scale_o)
        if not DOWN:
            tma.store_wait(0)

    @gluon.jit
    def _moe_wide_second(a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc,
                         out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm,
                         stride_bse, stride_bsn, stride_biase, stride_osm, stride_osn, limit, num_progs,
                         GROUP_M: gl.constexpr, ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr, turn,
                         TURN: gl.constexpr, sa_bufs, sb_bufs, SC: gl.constexpr, top_k, GATHER: gl.constexpr,
                         TR: gl.constexpr):
        _wide_consume(1, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, slots_ptr, block_expert_ptr,
                      num_m, N, K, num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, num_progs,
                      GROUP_M, False, (out_desc, out_s_ptr, stride_osm, stride_osn, limit, ALPHA, FP8_MAX_C, EPS), turn,
                      TURN, sa_bufs, sb_bufs, SC, top_k, GATHER, False, TR)

    @gluon.jit
    def _moe_wide_producer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K, num_experts,
                           num_progs, GROUP_M: gl.constexpr, scales, SC: gl.constexpr):
        _moe_produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K, num_experts,
                     num_progs, GROUP_M, scales, SC)

    @gluon.jit
    def _moe_gather_producer(x_ptr, stride_xm, b_desc, empty, ready, a_bufs, b_bufs, slots_ptr, block_expert_ptr,
                             num_m, N, K, num_slots, num_experts, top_k, num_progs, GROUP_M: gl.constexpr, row_smem,
                             PW: gl.constexpr, scales, SC: gl.constexpr):
        """The wide gate_up's PW-warp producer with A gathered (``GluonTile(gather=True)``): each K block's A
        rows copied by cp.async straight from the tokens' FP8 rows x[slot // top_k] into the stage (16 bytes a
        copy, each thread 4 rows a step of 16 * PW rows), padding rows and columns past K zero-filled (as the
        pre-gathered rows and TMA give), W rows by TMA. Hopper's TMA loads boxes, not lists of rows. Every thread
        arrives on the stage's ready barrier once its copies land (``async_copy.mbarrier_arrive`` without
        incrementing the count: the barrier counts 32 * PW of those and the TMA's expect-arrive of the W bytes,
        so no thread's arrive can fall into the next phase). The tile's token rows (slot // top_k; -1 for padding
        rows) are computed once a tile into row_smem ([TM] int32) and read from there by each K block.

        SC (``GluonTile.stage_scales``; ``scales`` = (as_ptr, stride_asm, sb_desc, sa_bufs, sb_bufs, stride_bse,
        stride_bsn)): each K block's row scales copied too, one 4-byte cp.async a row from the tokens' [T,
        ceil(K/128)] scales (padding rows: token 0's, times their zero rows) into sa_bufs[stage], and the two
        column halves' weight scales by TMA into sb_bufs[stage] (``_gluon.load_stage_scaled``'s box): the
        consumers read both from shared memory.

        One warp (the thirty-fourth to thirty-seventh sessions' form, 32 copies a thread a K block and, in the
        first form, the row offsets recomputed every K block: 926 instructions a K block, then 399) set the pace
        of the tensor core; the partition is padded to a warpgroup anyway (``warp_specialize``), so PW = 4 costs
        no warps: 8 copies a thread a K block."""
        S: gl.constexpr = a_bufs.type.shape[0]
        TM: gl.constexpr = a_bufs.type.shape[1]
        TK: gl.constexpr = a_bufs.type.shape[2]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        CH: gl.constexpr = 16 * PW
        copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [PW, 1], [1, 0])
        tile_rows: gl.constexpr = gl.BlockedLayout([TM // (32 * PW)], [32], [PW], [0])
        num_n = gl.cdiv(N, TN)
        n_k = gl.cdiv(K, TK)
        cols = gl.arange(0, TK, layout=gl.SliceLayout(0, copy_layout))
        c = 0
        for tile in range(gl.program_id(0), num_m * num_n, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            expert = gl.load(block_expert_ptr + pid_m)
            if expert < num_experts:
                gl.thread_barrier()  # (the last tile's reads of row_smem done)
                slot = gl.load(slots_ptr + pid_m * TM + gl.arange(0, TM, layout=tile_rows))
                row_smem.store(gl.where(slot < num_slots, slot // top_k, -1))
                gl.thread_barrier()
                if SC:
                    as_ptr, stride_asm, sb_desc, sa_bufs, sb_bufs, stride_bse, stride_bsn = scales
                    sb0 = expert * stride_bse + (pid_n * (TN // TK)) * stride_bsn
                    tok_s = row_smem.load(tile_rows)
                    s_ptrs = as_ptr + gl.maximum(tok_s, 0) * stride_asm
                for kk in range(n_k):
                    s = c % S
                    mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)
                    kcols = kk * TK + cols
                    kmask = gl.expand_dims(kcols < K, 0)
                    for h in gl.static_range(TM // CH):
                        tok = row_smem.slice(h * CH, CH).load(gl.SliceLayout(1, copy_layout))
                        # (byte offsets of 16-byte aligned rows: the row stride a multiple of 16)
                        off = gl.multiple_of(tok * stride_xm, 16)
                        ptrs = x_ptr + gl.expand_dims(off, 1) + gl.expand_dims(kcols, 0)
                        async_copy.async_copy_global_to_shared(a_bufs.index(s).slice(h * CH, CH), ptrs,
                                                               mask=gl.expand_dims(tok >= 0, 1) & kmask)
                    if SC:
                        async_copy.async_copy_global_to_shared(sa_bufs.index(s), s_ptrs + kk)
                    async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                    if SC:
                        sb_off = sb0 + kk
                        mbarrier.expect(ready.index(s), b_desc.block_type.nbytes + sb_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(b_desc, [expert * N + pid_n * TN, kk * TK], ready.index(s),
                                                        b_bufs.index(s))
                        tma.async_copy_global_to_shared(sb_desc, [sb_off - sb_off % 4], ready.index(s),
                                                        sb_bufs.index(s))
                    else:
                        mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(b_desc, [expert * N + pid_n * TN, kk * TK], ready.index(s),
                                                        b_bufs.index(s))
                    c += 1

    @gluon.jit
    def _ws_moe_gemm_wide_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr, slots_ptr,
                                 block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse,
                                 stride_bsn, stride_biase, stride_osm, stride_osn, limit, num_progs,
                                 STAGES: gl.constexpr, GROUP_M: gl.constexpr, ALPHA: gl.constexpr,
                                 FP8_MAX_C: gl.constexpr, EPS: gl.constexpr, TURN: gl.constexpr = False,
                                 sa_desc=None, sb_desc=None, SC: gl.constexpr = False, x_ptr=None, stride_xm=0,
                                 top_k=1, GATHER: gl.constexpr = False, TR: gl.constexpr = False):
        """The wide gate_up (``GluonTile(block_m=128, promote="serial")``, the serial promotion loop):
        128 x 256 tiles over 128-row segments, 48 KB of loads per K block for twice the 64 x 256
        tile's work (40 KB): 1.67x the FLOPs per byte. out_s_ptr's rows and columns strided (stride_osn
        1: row-major, the default; the rows: MN-major, what the down reads with stage scales). SC
        (``GluonTile.stage_scales``): the scales through the stages, sa_desc over the row scales
        MN-major and sb_desc over the weight scales, both flat (``ws_moe_gemm``). GATHER (``GluonTile.gather``):
        A from the tokens' own rows x_ptr [T, K] (row stride stride_xm) by ``_moe_gather_producer``, as_ptr their
        scales [T, ceil(K/128)] (a_desc: over x, only its block shape and layout used); with SC the producer copies
        the row scales into sa_bufs (allocated here; sb_desc alone given, ``_gluon.weight_scale_args``)."""
        TM: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        TK: gl.constexpr = a_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TM, TK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TN, TK], b_desc.layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        o_bufs = gl.allocate_shared_memory(gl.float8e4nv, [4, TM // 2, TN // 4], out_desc.layout)
        for i in gl.static_range(STAGES):
            # released by both consumer warpgroups (TR: by each of their threads, _gluon.release)
            mbarrier.init(empty.index(i), count=256 if TR else 2)
            # (GATHER: each producer thread's cp.async arrive, and the W tile's expect-arrive)
            mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS if GATHER else 1)
        turn = turn_barriers(empty, TURN)  # the consumer warpgroups' turns at the tensor core (GluonTile.turns)
        if GATHER and SC:  # the row scales by cp.async (_moe_gather_producer), the weight scales by TMA
            sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, TM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, sb_desc.block_type.shape[0]], sb_desc.layout)
        else:
            sa_bufs, sb_bufs = stage_scale_buffers(sa_desc, sb_desc, empty, STAGES, TM, SC)
        # (the partitions' argument tuples written out in each branch: a tuple held in a variable loses its
        # elements' constexpr-ness)
        if GATHER:
            # the gather producer's token rows of its tile (_moe_gather_producer)
            row_smem = gl.allocate_shared_memory(gl.int32, [TM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            gl.warp_specialize([
                (_wide_consume, (0, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, slots_ptr,
                                 block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse,
                                 stride_bsn, stride_biase, num_progs, GROUP_M, False,
                                 (out_desc, out_s_ptr, stride_osm, stride_osn, limit, ALPHA, FP8_MAX_C, EPS), turn,
                                 TURN, sa_bufs, sb_bufs, SC, top_k, GATHER, False, TR)),
                (_moe_wide_second, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr,
                                    out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots,
                                    num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_osm,
                                    stride_osn, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS, turn, TURN, sa_bufs,
                                    sb_bufs, SC, top_k, GATHER, TR)),
                (_moe_gather_producer, (x_ptr, stride_xm, b_desc, empty, ready, a_bufs, b_bufs, slots_ptr,
                                        block_expert_ptr, num_m, N, K, num_slots, num_experts, top_k, num_progs,
                                        GROUP_M, row_smem, GATHER_WARPS,
                                        (as_ptr, stride_asm, sb_desc, sa_bufs, sb_bufs, stride_bse, stride_bsn), SC)),
            ], [4, GATHER_WARPS], [232, 40])
        else:
            gl.warp_specialize([
                (_wide_consume, (0, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, slots_ptr,
                                 block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse,
                                 stride_bsn, stride_biase, num_progs, GROUP_M, False,
                                 (out_desc, out_s_ptr, stride_osm, stride_osn, limit, ALPHA, FP8_MAX_C, EPS), turn,
                                 TURN, sa_bufs, sb_bufs, SC, 1, False, False, TR)),
                (_moe_wide_second, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr,
                                    out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots,
                                    num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_osm,
                                    stride_osn, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS, turn, TURN, sa_bufs,
                                    sb_bufs, SC, top_k, GATHER, TR)),
                (_moe_wide_producer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K,
                                      num_experts, num_progs, GROUP_M,
                                      (sa_desc, sb_desc, sa_bufs, sb_bufs, stride_bse, stride_bsn), SC)),
            ], [4, 1], [232, 40])


if HAS_GLUON:

    # the down's consumer partitions: _wide_consume(..., DOWN=True) (above)
    @gluon.jit
    def _down_second(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c_bufs, as_ptr, bs_ptr, bias_ptr, y_ptr,
                     slots_ptr, block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse,
                     stride_bsn, stride_biase, stride_ym, num_progs, GROUP_M: gl.constexpr, turn,
                     TURN: gl.constexpr, sa_bufs, sb_bufs, SC: gl.constexpr, NARROW: gl.constexpr, TR: gl.constexpr):
        _wide_consume(1, empty, ready, a_bufs, b_bufs, c_bufs, as_ptr, bs_ptr, bias_ptr, slots_ptr, block_expert_ptr,
                      num_m, N, K, num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, num_progs,
                      GROUP_M, True, (y_ptr, stride_ym), turn, TURN, sa_bufs, sb_bufs, SC, 1, False, NARROW, TR)

    @gluon.jit
    def _ws_moe_down_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, y_ptr, slots_ptr, block_expert_ptr, num_m, N,
                            K, num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_ym,
                            num_progs, STAGES: gl.constexpr, GROUP_M: gl.constexpr, TURN: gl.constexpr = False,
                            sa_desc=None, sb_desc=None, SC: gl.constexpr = False, NARROW: gl.constexpr = False,
                            TR: gl.constexpr = False):
        """The down GEMM on 128 x 256 tiles (``MoePlan(128, ..., down=GluonTile(block_m=128,
        promote="serial"))``): the wide gate_up's main loop (the serial promotion), 1.67x the 64 x 256
        tile's FLOPs per byte; output scattered to the slots' rows (the earlier 64 x 256 Gluon down,
        4-byte stores from the wgmma layout, ran 5-10% behind the Triton down). SC: as the wide
        gate_up's."""
        TM: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[0]
        TK: gl.constexpr = a_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TM, TK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TN, TK], b_desc.layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, TM // 2, TN // 2], c_layout)
        for i in gl.static_range(STAGES):
            # released by both consumer warpgroups (TR: by each of their threads, _gluon.release)
            mbarrier.init(empty.index(i), count=256 if TR else 2)
            mbarrier.init(ready.index(i), count=1)
        turn = turn_barriers(empty, TURN)  # the consumer warpgroups' turns at the tensor core (GluonTile.turns)
        sa_bufs, sb_bufs = stage_scale_buffers(sa_desc, sb_desc, empty, STAGES, TM, SC)
        gl.warp_specialize([
            (_wide_consume, (0, empty, ready, a_bufs, b_bufs, c_bufs, as_ptr, bs_ptr, bias_ptr, slots_ptr,
                             block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse, stride_bsn,
                             stride_biase, num_progs, GROUP_M, True, (y_ptr, stride_ym), turn, TURN, sa_bufs, sb_bufs,
                             SC, 1, False, NARROW, TR)),
            (_down_second, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, c_bufs, as_ptr, bs_ptr, bias_ptr, y_ptr,
                            slots_ptr, block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse,
                            stride_bsn, stride_biase, stride_ym, num_progs, GROUP_M, turn, TURN, sa_bufs, sb_bufs, SC,
                            NARROW, TR)),
            (_moe_wide_producer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K,
                                  num_experts, num_progs, GROUP_M,
                                  (sa_desc, sb_desc, sa_bufs, sb_bufs, stride_bse, stride_bsn), SC)),
        ], [4, 1], [232, 40])


def ws_moe_down(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                bias: torch.Tensor, y: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor,
                num_slots: int, stages: int = 4, group_m: int = 8, balance: bool = False,
                promote: str = "serial", turns: bool = False, stage_scales: bool = False, narrow: bool = False,
                thread_release: bool = False) -> None:
    """The down GEMM on 128 x 256 tiles: y[slot] = act[row] @ W2[expert]^T + b2[expert] (bf16), for
    the sorted rows of 128-row segments (``moe_expert_slots`` checks the shapes and is the entry
    point). a = act [max_rows, I] fp8 with a_scale [max_rows, ceil(I/128)]; w [E, H, I] fp8 with
    w_scale_inv [E, ceil(H/128), ceil(I/128)]; bias [E, H]; y [num_slots, H] bf16 (rows of padding
    slots are not written). Its one main loop is ``_gluon.block_scaled_mainloop_serial`` (the
    promotion numerics, no C7514): promote must be "serial" (ValueError otherwise). turns: the
    consumer warpgroups issue their wgmmas in turns (``GluonTile.turns``). stage_scales: the scales
    through the stages (``GluonTile.stage_scales``; a_scale best MN-major, ``_gluon.stage_scale_args``). narrow: the
    last column tile as one m64n64 product a warpgroup where its valid columns fit 64 (``GluonTile.narrow``).
    thread_release: each consumer thread releases the stages itself (``GluonTile.thread_release``)."""
    check_promote(promote, True, "the Gluon MoE down")
    max_rows, k = a.shape
    e, n, _ = w.shape
    assert max_rows % WIDE_M == 0 and y.stride(1) == 1 and y.dtype == torch.bfloat16, (max_rows, y.dtype)
    a_desc, b_desc = descriptor(a, [WIDE_M, BK]), descriptor(w.view(e * n, k), [TILE_N, BK])
    num_m = max_rows // WIDE_M
    num_progs = num_programs(num_m * cdiv(n, TILE_N), sm_count(a.device), balance)
    sc, w_scale_inv = stage_scale_args(a_scale, w_scale_inv, WIDE_M) if stage_scales else ({}, w_scale_inv)
    _ws_moe_down_kernel[(num_progs,)](
        a_desc, b_desc, a_scale, w_scale_inv, bias, y, sorted_slots, block_expert, num_m, n, k, num_slots, e,
        a_scale.stride(0), w_scale_inv.stride(0), w_scale_inv.stride(1), bias.stride(0), y.stride(0), num_progs,
        STAGES=stages, GROUP_M=group_m, num_warps=4, **({"TURN": True} if turns else {}), **sc,
        **({"NARROW": True} if narrow else {}), **({"TR": True} if thread_release else {}),
    )


def ws_moe_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                bias: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor, sorted_slots: torch.Tensor,
                block_expert: torch.Tensor, num_slots: int, limit: float, alpha: float,
                fp8_max: float, eps: float, stages: int = 4, group_m: int = 8, block_m: int = TILE_M,
                balance: bool = False, promote: str = "pipelined", turns: bool = False,
                stage_scales: bool = False, gather_top_k: int = 0, thread_release: bool = False) -> None:
    """The gate_up GEMM (``moe_expert_slots`` checks the shapes and is the entry point).

    a [max_rows, K] fp8 in padded sorted row order (segments of block_m rows: 64, or 128 for the
    wide form), a_scale [max_rows, ceil(K/128)]; w [E, N, K] fp8 with w_scale_inv [E, ceil(N/128),
    ceil(K/128)], bias [E, N]; out = act [max_rows, N/2] fp8 and out_scale [max_rows, ceil(N/256)]
    (sorted rows; the wide form also writes an MN-major out_scale, the 64 x 256 only row-major).
    balance: ``_gluon.num_programs``; promote: the 64 x 256 kernel's main loop,
    "pipelined" (``_gluon.block_scaled_mainloop``) or "serial" (``_gluon.block_scaled_mainloop_serial``,
    no C7514); the wide form has only "serial" (ValueError otherwise). turns: the wide form's consumer
    warpgroups issue their wgmmas in turns (``GluonTile.turns``; ValueError for the 64 x 256 tile).
    stage_scales: the wide form's scales through the stages (``GluonTile.stage_scales``, ValueError for
    the 64 x 256 tile; a_scale best MN-major, ``_gluon.stage_scale_args``). gather_top_k > 0 (``GluonTile.gather``,
    the wide form): a / a_scale are the tokens' own rows [T, K] and scales [T, ceil(K/128)] row-major
    (``act_quant``'s), K a multiple of 16 and a 16-byte aligned; the kernel's producer copies row
    sorted_slots[r] // gather_top_k into sorted row r itself (no ``gather_act_quant``), and with stage_scales
    that row's scales into the stages. thread_release: the wide form's consumer threads release the stages each
    (``GluonTile.thread_release``; ValueError for the 64 x 256 tile)."""
    assert block_m in (TILE_M, WIDE_M), f"block_m {block_m}: the Gluon gate_up has 64 x 256 and 128 x 256 tiles"
    check_turns(turns, block_m == WIDE_M, f"the {block_m} x {TILE_N} gate_up")
    check_stage_scales(stage_scales, block_m == WIDE_M, f"the {block_m} x {TILE_N} gate_up")
    check_promote(promote, block_m == WIDE_M, f"the {block_m} x {TILE_N} Gluon MoE gate_up")
    check_gather(gather_top_k > 0, block_m == WIDE_M, f"the {block_m} x {TILE_N} gate_up")
    check_thread_release(thread_release, block_m == WIDE_M, f"the {block_m} x {TILE_N} gate_up")
    k = a.shape[1]
    max_rows = sorted_slots.shape[0] if gather_top_k else a.shape[0]
    e, n, _ = w.shape
    assert max_rows % block_m == 0, f"block_m {block_m}, {max_rows} rows"
    if gather_top_k:
        assert k % 16 == 0 and a.data_ptr() % 16 == 0 and a.stride(1) == 1 and a.stride(0) % 16 == 0, (
            f"gathered A rows need 16-byte copies: K {k}, stride {a.stride()}")
        assert a.shape[0] * a.stride(0) < 2 ** 31, f"gathered A rows: int32 row offsets, {tuple(a.shape)} too large"
        assert a_scale.stride(1) == 1, f"gathered A rows: their scales row-major, strides {a_scale.stride()}"
    a_desc, b_desc = descriptor(a, [block_m, BK]), descriptor(w.view(e * n, k), [TILE_N, BK])
    out_desc = descriptor(out, [TILE_M, TILE_N // 4])
    num_m = max_rows // block_m
    num_progs = num_programs(num_m * cdiv(n, TILE_N), sm_count(a.device), balance)
    if block_m == WIDE_M:
        if gather_top_k:  # (a launch without it keeps its exact signature)
            sc, w_scale_inv = weight_scale_args(w_scale_inv) if stage_scales else ({}, w_scale_inv)
            sc |= dict(x_ptr=a, stride_xm=a.stride(0), top_k=gather_top_k, GATHER=True)
        else:
            sc, w_scale_inv = stage_scale_args(a_scale, w_scale_inv, WIDE_M) if stage_scales else ({}, w_scale_inv)
        _ws_moe_gemm_wide_kernel[(num_progs,)](
            a_desc, b_desc, a_scale, w_scale_inv, bias, out_desc, out_scale, sorted_slots, block_expert,
            num_m, n, k, num_slots, e, a_scale.stride(0), w_scale_inv.stride(0), w_scale_inv.stride(1),
            bias.stride(0), out_scale.stride(0), out_scale.stride(1), float(limit), num_progs,
            STAGES=stages, GROUP_M=group_m, ALPHA=alpha, FP8_MAX_C=fp8_max, EPS=eps, num_warps=4,
            **({"TURN": True} if turns else {}), **sc, **({"TR": True} if thread_release else {}),
        )
        return
    assert out_scale.stride(1) == 1, "the 64 x 256 gate_up writes a row-major out_scale"
    serial = dict(SERIAL=True) if promote == "serial" else {}  # the pipelined launch keeps its exact signature
    _ws_moe_gemm_kernel[(num_progs,)](
        a_desc, b_desc, a_scale, w_scale_inv, bias, out, out_desc, out_scale, sorted_slots, block_expert,
        num_m, n, k, num_slots, e, a_scale.stride(0), w_scale_inv.stride(0), w_scale_inv.stride(1), bias.stride(0),
        out.stride(0), out_scale.stride(0), float(limit), num_progs,
        STAGES=stages, GROUP_M=group_m, ALPHA=alpha, FP8_MAX_C=fp8_max, EPS=eps, num_warps=4, **serial,
    )

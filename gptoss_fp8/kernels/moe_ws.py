"""The MoE gate_up GEMM, warp-specialized for Hopper (sm_90), in Gluon.

Same contract and numerics as the Triton gate_up of kernels/moe_gemm.py (its reference,
``spec.moe_w8a8``, is this kernel's too), except that A comes pre-gathered: the tokens'
FP8 activations already in padded sorted row order (``moe.gather_act_quant``), rows in segments of
64 (TILE_M, the experts' alignment). W13 [E, 2I, H] fp8 with gate/up rows interleaved; epilogue:
bias, the clamped SwiGLU, the 1x128 FP8 quantization of the result (one scale per row and 128
outputs), written in sorted row order through TMA. Each K block's fp8 product is scaled by
s_a[row, kb] * s_w[expert, col block, kb] into an fp32 accumulator (promotion every 128).
Not done here: the down GEMM (a Gluon down ran 5-10% slower than the Triton one on the H200,
BENCHMARKS.md seventh session, and was removed; ``slots_ptr``, ``out_ptr``, ``num_slots`` and
``stride_om`` stay in the argument lists, unused); any other tile than 64 x 256.

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
from gptoss_fp8.kernels._gluon import HAS_GLUON, supported  # noqa: F401 - supported is re-exported
from gptoss_fp8.quant.fp8 import cdiv

if HAS_GLUON:
    from gptoss_fp8.kernels._gluon import (
        block_scaled_mainloop,
        descriptor,
        fence_async_shared,
        gl,
        gluon,
        load_stage,
        mbarrier,
        tile_coords,
        tma,
    )

TILE_M, TILE_N, BK = 64, 256, 128  # rows (= the experts' segment alignment), columns, K block
HALF_N = TILE_N // 2  # columns per consumer warpgroup


if HAS_GLUON:

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
                     num_progs, GROUP_M: gl.constexpr):
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
                for kk in range(n_k):
                    c = load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, [pid_m * TM, kk * TK],
                                   [expert * N + pid_n * TN, kk * TK])

    @gluon.jit
    def _moe_consume(W: gl.constexpr, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_smem, as_ptr, bs_ptr, bias_ptr,
                     out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots, num_experts,
                     stride_asm, stride_bse, stride_bsn, stride_biase, stride_om, stride_osm, limit, num_progs,
                     GROUP_M: gl.constexpr, ALPHA: gl.constexpr,
                     FP8_MAX_C: gl.constexpr, EPS: gl.constexpr):
        """Consumer warpgroup W (0 or 1): columns W*128 .. W*128 + 128 of every tile."""
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
                             ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr):
        _moe_consume(1, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs.index(1), as_ptr, bs_ptr, bias_ptr, out_ptr,
                     out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm,
                     stride_bse, stride_bsn, stride_biase, stride_om, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C,
                     EPS)

    @gluon.jit
    def _moe_producer(a_desc, b_desc, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs, as_ptr, bs_ptr,
                      bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K,
                      num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_om,
                      stride_osm, limit, num_progs, GROUP_M: gl.constexpr,
                      ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr):
        _moe_produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K, num_experts,
                     num_progs, GROUP_M)

    @gluon.jit
    def _ws_moe_gemm_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr,
                            block_expert_ptr, num_m, N, K, num_slots, num_experts, stride_asm, stride_bse,
                            stride_bsn, stride_biase, stride_om, stride_osm, limit, num_progs,
                            STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                            ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr):
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
                            num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
            (_moe_second_consumer, (a_desc, b_desc, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs, as_ptr, bs_ptr,
                                    bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K,
                                    num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                                    stride_om, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C,
                                    EPS)),
            (_moe_producer, (a_desc, b_desc, empty, ready, xbar, a_bufs, b_bufs, x_smem, o_bufs, as_ptr, bs_ptr,
                             bias_ptr, out_ptr, out_desc, out_s_ptr, slots_ptr, block_expert_ptr, num_m, N, K,
                             num_slots, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_om,
                             stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
        ], [4, 1], [232, 40])


def ws_moe_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                bias: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor, sorted_slots: torch.Tensor,
                block_expert: torch.Tensor, num_slots: int, limit: float, alpha: float,
                fp8_max: float, eps: float, stages: int = 4, group_m: int = 8) -> None:
    """The gate_up GEMM (``moe_expert_slots`` checks the shapes and is the entry point).

    a [max_rows, K] fp8 in padded sorted row order (segments of 64 rows), a_scale [max_rows,
    ceil(K/128)]; w [E, N, K] fp8 with w_scale_inv [E, ceil(N/128), ceil(K/128)], bias [E, N];
    out = act [max_rows, N/2] fp8 and out_scale [max_rows, ceil(N/256)] (sorted rows)."""
    max_rows, k = a.shape
    e, n, _ = w.shape
    a_desc, b_desc = descriptor(a, [TILE_M, BK]), descriptor(w.view(e * n, k), [TILE_N, BK])
    out_desc = descriptor(out, [TILE_M, TILE_N // 4])
    num_m = max_rows // TILE_M
    num_progs = min(num_m * cdiv(n, TILE_N), sm_count(a.device))
    _ws_moe_gemm_kernel[(num_progs,)](
        a_desc, b_desc, a_scale, w_scale_inv, bias, out, out_desc, out_scale, sorted_slots, block_expert,
        num_m, n, k, num_slots, e, a_scale.stride(0), w_scale_inv.stride(0), w_scale_inv.stride(1), bias.stride(0),
        out.stride(0), out_scale.stride(0), float(limit), num_progs,
        STAGES=stages, GROUP_M=group_m, ALPHA=alpha, FP8_MAX_C=fp8_max, EPS=eps, num_warps=4,
    )

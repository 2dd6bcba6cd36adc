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
from gptoss_fp8.kernels._gluon import HAS_GLUON, supported  # noqa: F401 - re-exported
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

BM, BN, BK = 128, 128, 128  # output tile and K block (= the scale group)
WARPGROUP_ROWS = BM // 2  # rows of a tile per consumer warpgroup




if HAS_GLUON:

    @gluon.jit
    def _produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, GROUP_M: gl.constexpr):
        """TMA producer: every K block of every tile of this program, in the consumers' order."""
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
                c = load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, [pid_m * TM, kk * TK],
                               [pid_n * TN, kk * TK])

    @gluon.jit
    def _consume(ROW0: gl.constexpr, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_smem,
                 M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr):
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
            acc, c = block_scaled_mainloop(ready, empty, a_bufs, b_bufs, ROW0, ROWS, 0, TN, a_s_ptr, rmask, b_s_ptr, c,
                                           n_k, layout, True)
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
                         M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr):
        _consume(c_bufs.type.shape[1], empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs.index(1),
                 M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS)

    @gluon.jit
    def _producer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                  M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr):
        _produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, GROUP_M)

    @gluon.jit
    def _ws_fp8_gemm_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_desc, M, N, K, stride_asm, stride_bsn,
                            num_progs, STAGES: gl.constexpr, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr):
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
                        M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS)),
            (_second_consumer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                                M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS)),
            (_producer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_desc, c_bufs,
                         M, N, K, stride_asm, stride_bsn, num_progs, GROUP_M, HAS_BIAS)),
        ], [4, 1], [232, 40])


def ws_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                bias: torch.Tensor | None, out: torch.Tensor, stages: int = 4, group_m: int = 8) -> torch.Tensor:
    """out[M, N] (bf16, contiguous) = the block GEMM + bias of 2-D a [M, K] (rows 16-byte aligned,
    last dim contiguous) with a_scale [M, ceil(K/128)], w [N, K] contiguous, w_scale_inv
    [ceil(N/128), ceil(K/128)]. Shapes are checked by ``fp8_gemm``, which is the entry point."""
    m, k = a.shape
    n = w.shape[0]
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and n % 8 == 0, "bf16 out with 16-byte rows"
    a_desc, b_desc, c_desc = descriptor(a, [BM, BK]), descriptor(w, [BN, BK]), descriptor(out, [WARPGROUP_ROWS, BN])
    num_progs = min(cdiv(m, BM) * cdiv(n, BN), sm_count(a.device))
    _ws_fp8_gemm_kernel[(num_progs,)](
        a_desc, b_desc, a_scale, w_scale_inv, bias if bias is not None else out, c_desc, m, n, k,
        a_scale.stride(0), w_scale_inv.stride(0), num_progs,
        STAGES=stages, GROUP_M=group_m, HAS_BIAS=bias is not None, num_warps=4,
    )
    return out

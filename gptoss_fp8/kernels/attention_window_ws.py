"""Sliding-window prefill attention with sinks for Hopper (sm_90), warp-specialized, in Gluon (issue 34).

Same contract as kernels/attention.py's ``attention_prefill`` for the case gpt-oss's window layers run (one sequence
from position 0, a window of W keys, head_dim 64, bf16, query heads in pairs of one KV head), whose plain-torch
reference (``spec.attention`` / ``attention_prefill_ref``) is this kernel's too; with ``rope`` q is rotated in the
kernel (kernels/rope.py ``rotate``'s FMAs, rounded to bf16, as the Triton kernel's ROPE_Q), and with ``quant_out``
it writes o_proj's FP8 input (act_quant's 1 x 128 groups: a pair's two heads of a row) instead of the bf16 rows.

Why: the Triton window kernel ran at 2.4-3x its bytes floor (each program's 5 key blocks of 32 too short a loop to
hide a load's latency). Here a program owns a pair of query heads for RUN steps of 64 positions (on the H100 with
``pair``, the two heads interleaved: level with the Triton kernel at 32768 tokens, 0.446 against 0.442 ms, and 6-7%
under it at 128000; latency-bound too; BENCHMARKS.md "The window kernels' epilogues lighter"; opt-in
``KernelConfig.attention_gluon_window``):
- a 1-warp producer streams, by TMA, each step's two Q tiles (and the rope's cos / sin rows) through a ring of QS
  stages, and the K / V blocks of 64 keys through a ring of S stages, each block once: a step needs the blocks from
  its first query's oldest key to its diagonal (NB = ceil((W - 1) / 64) + 1), the next step all but the oldest
  again, so the ring holds them and loads one new block a step;
- NC consumer warpgroups take the steps in turn (step s: warpgroup s % NC; QS >= NC, as a consumer waits for its Q
  stage by the phase's parity), both heads of the pair one after the other (or interleaved: ``pair``): Q rotated
  into shared memory, then the softmax in base 2 from the sink (as attention.py): for a 128-key window one exact pass
  over the row's 128 keys (``_win_attend_merged``: the outer blocks' visible triangles merged into one tile), else
  the masked online softmax over the blocks, QK^T(k) and PV(k - 1) in flight under block k's softmax; blocks before
  key 0 come from block 0 (finite) and are masked. A warpgroup releases a key block once no later step of its own
  reads it; the producer reloads a stage once every consumer has released it;
- epilogue: O / l, rounded to bf16; with ``quant_out`` the pair's 128-column group quantized in registers
  (act_quant's arithmetic: each row's max over both heads, max(amax, eps) / 448, the quotient, the e4m3 cast) and
  stored with its scale; else the bf16 rows. The tiles leave by TMA from the warpgroup's own two output buffers,
  waited for one step later (rows past T are not written).
"""

from __future__ import annotations

import torch

from gptoss_fp8.kernels._gluon import HAS_GLUON, supported  # noqa: F401 - supported is re-exported
from gptoss_fp8.kernels.attention_ws import _rows2d
from gptoss_fp8.quant.fp8 import ACT_EPS, ACT_GROUP, FP8_DTYPE, FP8_MAX, cdiv

if HAS_GLUON:
    from gptoss_fp8.kernels._gluon import (
        bf16_round,
        descriptor,
        fence_async_shared,
        gl,
        gluon,
        load_stage,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

LOG2E = 1.4426950408889634
ROWS = 64  # positions a step (one wgmma's M)
BLOCK_N = 64  # keys a block
HEAD_DIM = 64
# registers per consumer thread by consumer warpgroups (the producer warp keeps 40)
REGS = {2: 232, 3: 160}


if HAS_GLUON:

    @gluon.jit
    def _win_rotate(q_tile, qrot, c, sn, ROPE: gl.constexpr):
        """A head's Q tile of a step (64 positions, in shared memory as the producer's TMA left it) rotated (ROPE:
        c / sn the positions' cos / sin, fp32 [64, 32]; kernels/rope.py ``rotate``'s FMAs) and rounded to bf16 into
        qrot, QK^T's A operand. The caller orders the stores (fence, barrier) before the products read them."""
        HALF: gl.constexpr = qrot.type.shape[1] // 2
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        x1 = q_tile.slice(0, HALF, dim=1).load(blk).to(gl.float32)
        x2 = q_tile.slice(HALF, HALF, dim=1).load(blk).to(gl.float32)
        if ROPE:
            x1, x2 = gl.fma(x1, c, -(x2 * sn)), gl.fma(x2, c, x1 * sn)
        qrot.slice(0, HALF, dim=1).store(x1.to(gl.bfloat16))
        qrot.slice(HALF, HALF, dim=1).store(x2.to(gl.bfloat16))

    @gluon.jit
    def _win_scores(sc, m_i, l_i, rows, c_ar, kb, window, qk_scale):
        """Key block kb.. of a step's masked online softmax in base 2: (P in bf16, alpha, m, l)."""
        # (query - kb) through an opaque move: a step's rows and key blocks are 64-aligned, so every mask here is the
        # same at each step, and the compiler would hoist all NB x 32 predicates a thread (and the blocks' column
        # vectors) out of the step loop, into spills
        rk = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [rows - kb], dtype=gl.int32, is_pure=False, pack=1)
        rel = gl.expand_dims(rk, 1) - gl.expand_dims(c_ar, 0)
        visible = (rel >= 0) & (rel < window) & gl.expand_dims(c_ar >= -kb, 0)  # (keys before 0: masked)
        sc = sc * qk_scale + gl.where(visible, 0.0, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        alpha = gl.exp2(m_i - m_new)
        pt = gl.exp2(sc - gl.expand_dims(m_new, 1))
        return pt.to(gl.bfloat16), alpha, m_new, l_i * alpha + gl.sum(pt, 1)

    @gluon.jit
    def _win_attend(qrot, k_bufs, v_bufs, s, p, sink, window, qk_scale, NB: gl.constexpr):
        """One head of a step: queries p .. p + 63 (Q rotated in qrot) against the step's NB key blocks (ring
        positions s .. s + NB - 1), the masked online softmax in base 2 from the sink; QK^T(k) and PV(k - 1) issued
        together and block k's softmax under PV(k - 1) (attention_ws.py's loop). Returns O / l in fp32 (the o
        layout; the caller rounds it to bf16)."""
        S: gl.constexpr = k_bufs.type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        R: gl.constexpr = qrot.type.shape[0]
        D: gl.constexpr = qrot.type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        kb0 = (p // BN - (NB - 1)) * BN  # block 0's first key
        rows = p + gl.arange(0, R, layout=row_layout)
        c_ar = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([R], 0.0, gl.float32, row_layout) + sink
        l_i = gl.full([R], 1.0, gl.float32, row_layout)
        acc = gl.zeros([R, D], gl.float32, o_layout)
        zero_s = gl.zeros([R, BN], gl.float32, s_layout)
        sc = warpgroup_mma(qrot, k_bufs.index(s % S).permute((1, 0)), zero_s, use_acc=False)
        p_op, alpha, m_i, l_i = _win_scores(sc, m_i, l_i, rows, c_ar, kb0, window, qk_scale)
        p_op = gl.convert_layout(p_op, p_layout)
        for k in gl.static_range(1, NB):
            tok = warpgroup_mma(qrot, k_bufs.index((s + k) % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_bufs.index((s + k - 1) % S), acc, is_async=True)  # PV of block k - 1
            sc = warpgroup_mma_wait(num_outstanding=1, deps=(tok,))
            p_op, alpha, m_i, l_i = _win_scores(sc, m_i, l_i, rows, c_ar, kb0 + k * BN, window, qk_scale)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
            p_op = gl.convert_layout(p_op, p_layout)
        acc = warpgroup_mma(p_op, v_bufs.index((s + NB - 1) % S), acc)
        return acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)

    @gluon.jit
    def _win_merged_masks(p, R: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr):
        """The merged tile's triangle (key c of the oldest block visible to row r iff c > r) and the two outer
        blocks' biases (-inf for a block wholly before key 0; steps are 64-aligned)."""
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        # the rows through an opaque move: the triangle is the same at every step, and the compiler would hoist its
        # 32 predicates a thread out of the step loop (into spills)
        r = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [gl.arange(0, R, layout=row_layout) + p * 0],
                                      dtype=gl.int32, is_pure=False, pack=1)
        upper = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout)), 0) > gl.expand_dims(r, 1)
        bias0 = gl.where(p >= 2 * BN, 0.0, float("-inf"))  # block 0 wholly before key 0
        bias1 = gl.where(p >= BN, 0.0, float("-inf"))
        return upper, bias0, bias1

    @gluon.jit
    def _win_merged_probs(sm, m1, s1, upper, sink, p_layout: gl.constexpr):
        """The one-pass softmax of ``_win_attend_merged`` from the scaled scores (s1: block 1's; sm: the merged
        outer blocks'; m1 block 1's row max): P for the three PV products in bf16 (block 1's, the oldest block's
        triangle, the diagonal block's), and the row sum l from the sink."""
        m = gl.maximum(gl.maximum(m1, gl.max(sm, 1)), sink)
        p1 = gl.exp2(s1 - gl.expand_dims(m, 1))
        pm = gl.exp2(sm - gl.expand_dims(m, 1))
        l_i = gl.exp2(sink - m) + gl.sum(p1, 1) + gl.sum(pm, 1)
        x1 = gl.convert_layout(p1.to(gl.bfloat16), p_layout)
        xu = gl.convert_layout(gl.where(upper, pm, 0.0).to(gl.bfloat16), p_layout)
        xl = gl.convert_layout(gl.where(upper, 0.0, pm).to(gl.bfloat16), p_layout)
        return x1, xu, xl, l_i

    @gluon.jit
    def _win_block1(s1, bias1, qk_scale):
        """Block 1's scores of a step in base 2 (masked whole before key 0) and their row max."""
        s1 = s1 * qk_scale + bias1
        return s1, gl.max(s1, 1)

    @gluon.jit
    def _win_merged_tile(s0, s2, upper, bias0, qk_scale):
        """The outer blocks' scores merged into one tile in base 2: the oldest block's above the diagonal (masked
        whole before key 0), the diagonal block's on and below it."""
        return gl.where(upper, s0 * qk_scale + bias0, s2 * qk_scale)

    @gluon.jit
    def _win_merged_pv(x1, xu, xl, v_bufs, s, zero_o):
        """The step's three PV products of one head, issued async (block 1's P, the oldest block's triangle, the
        diagonal block's); the caller waits for the returned accumulator."""
        S: gl.constexpr = v_bufs.type.shape[0]
        acc = warpgroup_mma(x1, v_bufs.index((s + 1) % S), zero_o, use_acc=False, is_async=True)
        acc = warpgroup_mma(xu, v_bufs.index(s % S), acc, is_async=True)
        return warpgroup_mma(xl, v_bufs.index((s + 2) % S), acc, is_async=True)

    @gluon.jit
    def _win_attend_merged(qrot, k_bufs, v_bufs, s, p, sink, qk_scale):
        """``_win_attend`` for a window of two key blocks (W = 128: NB = 3), in one pass. Query p + r sees key
        p - 128 + c of block 0 iff c > r and key p + c of block 2 iff c <= r: the two blocks' visible scores fill one
        64-column tile without overlap, so a row's softmax runs over block 1's 64 scores and that merged tile's 64
        (128 exponentials, as many as the row's keys), not 192; P splits back by the same triangle for the two PV
        products. A block before key 0 (p < 128 / p < 64: steps are 64-aligned) is masked whole. The same exact
        softmax (max over the row's keys and the sink, one pass, no rescaling)."""
        S: gl.constexpr = k_bufs.type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        R: gl.constexpr = qrot.type.shape[0]
        D: gl.constexpr = qrot.type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        zero_s = gl.zeros([R, BN], gl.float32, s_layout)
        t1 = warpgroup_mma(qrot, k_bufs.index((s + 1) % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        t0 = warpgroup_mma(qrot, k_bufs.index(s % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        t2 = warpgroup_mma(qrot, k_bufs.index((s + 2) % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        upper, bias0, bias1 = _win_merged_masks(p, R, BN, s_layout)
        s1, m1 = _win_block1(warpgroup_mma_wait(num_outstanding=2, deps=(t1,)), bias1, qk_scale)
        s0, s2 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t2))
        sm = _win_merged_tile(s0, s2, upper, bias0, qk_scale)
        x1, xu, xl, l_i = _win_merged_probs(sm, m1, s1, upper, sink, p_layout)
        acc = _win_merged_pv(x1, xu, xl, v_bufs, s, gl.zeros([R, D], gl.float32, o_layout))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        return acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)

    @gluon.jit
    def _win_attend_merged_pair(q0, q1, q1_src, c, sn, q_free, k_bufs, v_bufs, s, p, sink0, sink1, qk_scale,
                                ROPE: gl.constexpr):
        """``_win_attend_merged`` for both heads of the step, their chains interleaved: head 1's Q is rotated
        (q1_src into q1) under head 0's QK^T, then the step's Q stage released (q_free); head 1's QK^T is issued
        before head 0's PV (wgmma groups complete in order), so head 1's softmax runs under head 0's PV and head 0's
        epilogue under head 1's PV. Same arithmetic per head as ``_win_attend_merged`` (same bytes). The caller has
        rotated head 0's Q into q0."""
        S: gl.constexpr = k_bufs.type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        R: gl.constexpr = q0.type.shape[0]
        D: gl.constexpr = q0.type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        zero_s = gl.zeros([R, BN], gl.float32, s_layout)
        zero_o = gl.zeros([R, D], gl.float32, o_layout)
        k0 = k_bufs.index(s % S).permute((1, 0))
        k1 = k_bufs.index((s + 1) % S).permute((1, 0))
        k2 = k_bufs.index((s + 2) % S).permute((1, 0))
        t1 = warpgroup_mma(q0, k1, zero_s, use_acc=False, is_async=True)
        t0 = warpgroup_mma(q0, k0, zero_s, use_acc=False, is_async=True)
        t2 = warpgroup_mma(q0, k2, zero_s, use_acc=False, is_async=True)
        _win_rotate(q1_src, q1, c, sn, ROPE)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(q_free, count=1)  # (every thread's reads of the stage are behind the barrier)
        upper, bias0, bias1 = _win_merged_masks(p, R, BN, s_layout)
        s1, m1 = _win_block1(warpgroup_mma_wait(num_outstanding=2, deps=(t1,)), bias1, qk_scale)
        s0, s2 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t2))
        x1, xu, xl, l0 = _win_merged_probs(_win_merged_tile(s0, s2, upper, bias0, qk_scale), m1, s1, upper, sink0,
                                           p_layout)
        # head 1's scores first, then head 0's PV: waiting for the former leaves the latter in flight. Its first
        # product accumulates onto zeros made from head 0's row sums (0 * l0), so ptxas cannot hoist it (and its 32
        # accumulator registers a thread) into head 0's softmax, where it spilled the exponentials
        u1 = warpgroup_mma(q1, k1, zero_s + gl.expand_dims(l0 * 0.0, 1), is_async=True)
        u0 = warpgroup_mma(q1, k0, zero_s, use_acc=False, is_async=True)
        u2 = warpgroup_mma(q1, k2, zero_s, use_acc=False, is_async=True)
        acc0 = _win_merged_pv(x1, xu, xl, v_bufs, s, zero_o)
        s1, m1 = _win_block1(warpgroup_mma_wait(num_outstanding=5, deps=(u1,)), bias1, qk_scale)
        s0, s2 = warpgroup_mma_wait(num_outstanding=3, deps=(u0, u2))
        x1, xu, xl, l1 = _win_merged_probs(_win_merged_tile(s0, s2, upper, bias0, qk_scale), m1, s1, upper, sink1,
                                           p_layout)
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
        acc1 = _win_merged_pv(x1, xu, xl, v_bufs, s, zero_o)
        y0 = acc0 / gl.expand_dims(gl.convert_layout(l0, orow_layout), 1)
        acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
        return y0, acc1 / gl.expand_dims(gl.convert_layout(l1, orow_layout), 1)

    @gluon.jit
    def _win_release(kready, kempty, lo, hi):
        """Release ring positions lo .. hi - 1 (each waited for first: a consumer releases only what was loaded)."""
        S: gl.constexpr = kready.type.shape[0]
        for j in range(lo, hi):
            mbarrier.wait(kready.index(j % S), (j // S) & 1)
            mbarrier.arrive(kempty.index(j % S), count=1)

    @gluon.jit
    def _win_consume(W: gl.constexpr, q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs,
                     v_bufs, qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T, window,
                     qk_scale, GROUP: gl.constexpr, RUN: gl.constexpr, NB: gl.constexpr, NC: gl.constexpr,
                     ROPE: gl.constexpr, QUANT: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr,
                      MERGE: gl.constexpr, PAIR: gl.constexpr):
        """Consumer warpgroup W: steps W, W + NC, .. of the program's run, both heads of its pair each."""
        QS: gl.constexpr = qready.type.shape[0]
        S: gl.constexpr = k_bufs.type.shape[0]
        R: gl.constexpr = qrot.type.shape[1]
        D: gl.constexpr = qrot.type.shape[2]
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        hp = gl.program_id(0)
        p0 = gl.program_id(1) * (RUN * R)
        n_steps = gl.minimum(RUN, gl.cdiv(T - p0, R))
        n_loaded = n_steps + NB - 1
        sink0 = gl.load(sinks_ptr + 2 * hp).to(gl.float32) * 1.4426950408889634
        sink1 = gl.load(sinks_ptr + 2 * hp + 1).to(gl.float32) * 1.4426950408889634
        _win_release(kready, kempty, 0, gl.minimum(W, n_loaded))  # blocks before this warpgroup's first step
        for s in range(W, n_steps, NC):
            qs = s % QS
            p = p0 + s * R
            mbarrier.wait(qready.index(qs), (s // QS) & 1)
            for k in gl.static_range(NB):
                mbarrier.wait(kready.index((s + k) % S), ((s + k) // S) & 1)
            q0 = qrot.index(2 * W)
            q1 = qrot.index(2 * W + 1)
            if ROPE:
                c = cs_bufs.index(2 * qs).load(blk)
                sn = cs_bufs.index(2 * qs + 1).load(blk)
            else:
                c = 0.0
                sn = 0.0
            _win_rotate(q_bufs.index(2 * qs), q0, c, sn, ROPE)
            if PAIR:  # (head 1's Q rotated under head 0's QK^T)
                fence_async_shared()
                gl.thread_barrier()
                y0, y1 = _win_attend_merged_pair(q0, q1, q_bufs.index(2 * qs + 1), c, sn, qempty.index(qs), k_bufs,
                                                 v_bufs, s, p, sink0, sink1, qk_scale, ROPE)
            else:
                _win_rotate(q_bufs.index(2 * qs + 1), q1, c, sn, ROPE)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(qempty.index(qs), count=1)  # (every thread's reads of the stage are behind the barrier)
                if MERGE:
                    y0 = _win_attend_merged(q0, k_bufs, v_bufs, s, p, sink0, qk_scale)
                    y1 = _win_attend_merged(q1, k_bufs, v_bufs, s, p, sink1, qk_scale)
                else:
                    y0 = _win_attend(q0, k_bufs, v_bufs, s, p, sink0, window, qk_scale, NB)
                    y1 = _win_attend(q1, k_bufs, v_bufs, s, p, sink1, window, qk_scale, NB)
            _win_release(kready, kempty, s, gl.minimum(s + NC, n_loaded))  # no later step of W reads them

            # the output tiles leave by TMA (rows past T are not written) from this warpgroup's two buffers, once
            # its previous step's stores have left them
            o0 = out_bufs.index(2 * W)
            o1 = out_bufs.index(2 * W + 1)
            tma.store_wait(0)
            gl.thread_barrier()
            if QUANT:  # act_quant of the pair's bf16 rows (one 128-column group): the row's max over both heads
                a = bf16_round(y0)  # (the bf16 rows act_quant would read)
                b = bf16_round(y1)
                amax = gl.maximum(gl.max(gl.abs(a), 1), gl.max(gl.abs(b), 1))
                scale = gl.maximum(amax, EPS) / FP8_MAX_C
                sc2 = gl.expand_dims(scale, 1)
                # (no clamp to +-448 before the cast: the cast is cvt.rn.satfinite, which saturates there itself, so
                # the bytes are act_quant's for every non-NaN row; 128 FMNMX a thread a step fewer)
                o0.store((a / sc2).to(gl.float8e4nv))
                o1.store((b / sc2).to(gl.float8e4nv))
                orows = p + gl.arange(0, R, layout=gl.SliceLayout(1, o_layout))
                gl.store(os_ptr + orows.to(gl.int64) * stride_os + hp, scale, mask=orows < T)
            else:
                o0.store(y0.to(gl.bfloat16))
                o1.store(y1.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(o_desc, [p, 2 * hp * D], o0)
            tma.async_copy_shared_to_global(o_desc, [p, (2 * hp + 1) * D], o1)
        tma.store_wait(0)

    # The worker partitions take the same arguments (a warp_specialize requirement).
    @gluon.jit
    def _win_consume1(q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs, qready,
                      qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T, window, qk_scale,
                      GROUP: gl.constexpr, RUN: gl.constexpr, NB: gl.constexpr, NC: gl.constexpr, ROPE: gl.constexpr,
                      QUANT: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr,
                      MERGE: gl.constexpr, PAIR: gl.constexpr):
        _win_consume(1, q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs, qready,
                     qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T, window, qk_scale, GROUP,
                     RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)

    @gluon.jit
    def _win_consume2(q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs, qready,
                      qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T, window, qk_scale,
                      GROUP: gl.constexpr, RUN: gl.constexpr, NB: gl.constexpr, NC: gl.constexpr, ROPE: gl.constexpr,
                      QUANT: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr,
                      MERGE: gl.constexpr, PAIR: gl.constexpr):
        _win_consume(2, q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs, qready,
                     qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T, window, qk_scale, GROUP,
                     RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)

    @gluon.jit
    def _win_produce(q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs, qready,
                     qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T, window, qk_scale,
                     GROUP: gl.constexpr, RUN: gl.constexpr, NB: gl.constexpr, NC: gl.constexpr, ROPE: gl.constexpr,
                     QUANT: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr,
                      MERGE: gl.constexpr, PAIR: gl.constexpr):
        """The producer warp: K / V blocks 0 .. NB - 2 (those before step 0's diagonal), then per step its two Q
        tiles (+ cos / sin) and the key block of its diagonal. Block i holds keys (p0 / 64 - NB + 1 + i) * 64 ..;
        before key 0, block 0's (finite; the consumers mask them)."""
        QS: gl.constexpr = qready.type.shape[0]
        R: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        hp = gl.program_id(0)
        p0 = gl.program_id(1) * (RUN * R)
        n_steps = gl.minimum(RUN, gl.cdiv(T - p0, R))
        kv_col = (2 * hp // GROUP) * D
        b0 = p0 // BN - (NB - 1)
        c = 0
        for i in range(NB - 1):
            row = gl.maximum(b0 + i, 0) * BN
            c = load_stage(k_desc, v_desc, kempty, kready, k_bufs, v_bufs, c, [row, kv_col], [row, kv_col])
        if ROPE:
            nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes + 2 * cos_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes
        for s in range(n_steps):
            qs = s % QS
            mbarrier.wait(qempty.index(qs), ((s // QS) & 1) ^ 1)
            mbarrier.expect(qready.index(qs), nbytes)
            pos = p0 + s * R
            tma.async_copy_global_to_shared(q_desc, [pos, 2 * hp * D], qready.index(qs), q_bufs.index(2 * qs))
            tma.async_copy_global_to_shared(q_desc, [pos, (2 * hp + 1) * D], qready.index(qs), q_bufs.index(2 * qs + 1))
            if ROPE:
                tma.async_copy_global_to_shared(cos_desc, [pos, 0], qready.index(qs), cs_bufs.index(2 * qs))
                tma.async_copy_global_to_shared(sin_desc, [pos, 0], qready.index(qs), cs_bufs.index(2 * qs + 1))
            row = gl.maximum(b0 + NB - 1 + s, 0) * BN
            c = load_stage(k_desc, v_desc, kempty, kready, k_bufs, v_bufs, c, [row, kv_col], [row, kv_col])

    @gluon.jit(do_not_specialize=["T", "window"])
    def _window_kernel(q_desc, k_desc, v_desc, cos_desc, sin_desc, sinks_ptr, o_desc, os_ptr, stride_os, T,
                       window, qk_scale, GROUP: gl.constexpr, RUN: gl.constexpr, NB: gl.constexpr, QS: gl.constexpr,
                       STAGES: gl.constexpr, NC: gl.constexpr, ROPE: gl.constexpr, QUANT: gl.constexpr,
                       REGS: gl.constexpr, FP8_MAX_C: gl.constexpr, EPS: gl.constexpr, MERGE: gl.constexpr = False,
                       PAIR: gl.constexpr = False):
        R: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * QS, R, D], q_desc.layout)
        if ROPE:
            cs_bufs = gl.allocate_shared_memory(cos_desc.dtype, [2 * QS, R, D // 2], cos_desc.layout)
        else:
            cs_bufs = gl.allocate_shared_memory(cos_desc.dtype, [2, R, D // 2], cos_desc.layout)
        qrot = gl.allocate_shared_memory(q_desc.dtype, [2 * NC, R, D], q_desc.layout)  # a consumer's two heads
        out_bufs = gl.allocate_shared_memory(o_desc.dtype, [2 * NC, R, D], o_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
        qready = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
        qempty = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
        kready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kempty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QS):
            mbarrier.init(qready.index(i), count=1)
            mbarrier.init(qempty.index(i), count=1)  # released by the step's one consumer
        for i in gl.static_range(STAGES):
            mbarrier.init(kready.index(i), count=1)
            mbarrier.init(kempty.index(i), count=NC)  # released by every consumer warpgroup
        # (argument tuples written out in place: a tuple holding a function cannot be a variable here)
        if NC == 3:
            gl.warp_specialize([
                (_win_consume, (0, q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs,
                                qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T,
                                window, qk_scale, GROUP, RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)),
                (_win_consume1, (q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs,
                                 qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T,
                                 window, qk_scale, GROUP, RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)),
                (_win_consume2, (q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs,
                                 qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T,
                                 window, qk_scale, GROUP, RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)),
                (_win_produce, (q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs,
                                qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T,
                                window, qk_scale, GROUP, RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)),
            ], [4, 4, 1], [REGS, REGS, 40])
        else:
            gl.warp_specialize([
                (_win_consume, (0, q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs,
                                qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T,
                                window, qk_scale, GROUP, RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)),
                (_win_consume1, (q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs,
                                 qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T,
                                 window, qk_scale, GROUP, RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)),
                (_win_produce, (q_desc, k_desc, v_desc, cos_desc, sin_desc, q_bufs, cs_bufs, qrot, out_bufs, k_bufs, v_bufs,
                                qready, qempty, kready, kempty, sinks_ptr, o_desc, os_ptr, stride_os, T,
                                window, qk_scale, GROUP, RUN, NB, NC, ROPE, QUANT, FP8_MAX_C, EPS, MERGE, PAIR)),
            ], [4, 1], [REGS, 40])


SMEM_MAX = 227 * 1024  # an sm_90 block's shared memory


def window_smem(stages: int, q_stages: int, consumers: int, rope: bool, quant_out: bool) -> int:
    """The kernel's shared memory in bytes: the K / V ring, the Q ring (two heads' tiles, the rope's cos / sin rows),
    each consumer's two rotated Q tiles and two output tiles (e4m3 with quant_out, else bf16), and 1 KB for the
    barriers and the allocations' alignment (at or above the compiler's figure)."""
    tile = ROWS * HEAD_DIM * 2
    cs = 2 * q_stages * ROWS * (HEAD_DIM // 2) * 4 if rope else 0  # (unused without: the compiler drops it)
    out = 2 * consumers * ROWS * HEAD_DIM * (1 if quant_out else 2)
    return 2 * stages * tile + 2 * q_stages * tile + cs + 2 * consumers * tile + out + 1024


def window_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> bool:
    """Whether ``window_attention_prefill`` takes these operands: bf16, head_dim 64, query heads in pairs of one KV
    head, [H, D] contiguous per row with 16-byte aligned rows, 2 <= window, an sm_90 GPU."""
    if q.dtype != torch.bfloat16 or q.shape[-1] != HEAD_DIM or window < 2:
        return False
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv or (hq // hkv) % 2 or not supported(q.device):
        return False
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.stride(0) * 2) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (q, k, v))


def window_attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                             sm_scale: float, window: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                             quant_out: bool = False, run: int = 8, q_stages: int = 2, stages: int = 4,
                             consumers: int = 2, merge: bool | None = None, pair: bool = False):
    """Sliding-window attention with sinks, one sequence from position 0: q [T, Hq, 64], k / v [T, Hkv, 64] bf16
    (views of one projection's rows allowed: ``window_ok``), keys i - window < j <= i visible to query i.
    rope = (cos, sin) fp32 [>= T, 32]: q not yet rotated (k is). Returns out [T, Hq, 64] bf16, or with quant_out
    o_proj's FP8 input (e4m3 [T, Hq * 64], fp32 scales [T, Hq * 64 / 128]: act_quant's of those rows).
    run: steps of 64 positions a program; q_stages / stages: the Q and K / V rings; consumers: warpgroups (2, 3);
    merge (window 128 only; None: there): ``_win_attend_merged``'s one-pass softmax over the row's 128 keys;
    pair (with merge): a step's two heads interleaved (``_win_attend_merged_pair``: head 1's softmax under head 0's PV)."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    assert window_ok(q, k, v, window), "window_attention_prefill: operands outside window_ok"
    assert k.shape[0] == v.shape[0] == T and sinks.numel() == hq, (tuple(k.shape), tuple(v.shape), sinks.shape)
    assert consumers in REGS and run >= 1, (consumers, run)
    # a consumer waits for its step's Q stage by the phase's parity: the stage's previous step must have been loaded
    # by then, which holds where each consumer's previous step is at least that recent (q_stages >= consumers); with
    # fewer stages a consumer can pass a stage two loads behind and read another step's Q (measured: wrong rows)
    assert q_stages >= consumers, f"q_stages {q_stages} < consumers {consumers}"
    nb = cdiv(window - 1, BLOCK_N) + 1
    merge = window == 2 * BLOCK_N if merge is None else merge
    assert not merge or window == 2 * BLOCK_N, f"merge: a window of {2 * BLOCK_N} keys (got {window})"
    assert merge or not pair, "pair: the merged one-pass softmax (a window of 128 keys) only"
    # the ring holds a step's NB blocks, the next ones' new block, and the blocks the other consumers still read
    assert stages >= nb + consumers - 1, f"stages {stages} < {nb + consumers - 1} for window {window}"
    smem = window_smem(stages, q_stages, consumers, rope is not None, quant_out)
    assert smem <= SMEM_MAX, (f"window_attention_prefill: {smem} bytes of shared memory (stages {stages}, q_stages "
                              f"{q_stages}, consumers {consumers}) > the SM's {SMEM_MAX}")
    if rope is not None:
        cos, sin = rope
        assert cos.shape == sin.shape and cos.shape[0] >= T and cos.shape[1] == d // 2, (cos.shape, sin.shape)
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        cs_desc = (descriptor(cos, [ROWS, d // 2]), descriptor(sin, [ROWS, d // 2]))
    else:
        dummy = torch.zeros((ROWS, d // 2), dtype=torch.float32, device=q.device)
        cs_desc = (descriptor(dummy, [ROWS, d // 2]),) * 2
    if quant_out:
        out = torch.empty((T, hq * d), dtype=FP8_DTYPE, device=q.device)
        scales = torch.empty((T, hq * d // ACT_GROUP), dtype=torch.float32, device=q.device)
        stride_os = scales.stride(0)
    else:
        out = torch.empty((T, hq, d), dtype=torch.bfloat16, device=q.device)
        scales, stride_os = out, 0
    grid = (hq // 2, cdiv(T, run * ROWS))
    _window_kernel[grid](
        descriptor(_rows2d(q), [ROWS, d]), descriptor(_rows2d(k), [BLOCK_N, d]), descriptor(_rows2d(v), [BLOCK_N, d]),
        *cs_desc, sinks, descriptor(out if quant_out else _rows2d(out), [ROWS, d]), scales, stride_os, T, window,
        sm_scale * LOG2E,
        GROUP=hq // hkv, RUN=run, NB=nb, QS=q_stages, STAGES=stages, NC=consumers, ROPE=rope is not None,
        QUANT=quant_out, REGS=REGS[consumers], FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, MERGE=merge, PAIR=pair,
        num_warps=4,
    )
    return (out, scales) if quant_out else out

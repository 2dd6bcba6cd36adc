"""Warp-specialized causal prefill attention with sinks for Hopper (sm_90), in Gluon.

Same contract and numerics as kernels/attention.py's ``attention_prefill`` (whose plain-torch
reference, ``attention_prefill_ref``, is this kernel's too) for the case the prefill spends most of
its time in: one sequence, full causal (no window), head_dim 64, bf16, any GQA ratio, q/k/v rows of
any 16-byte-aligned stride (views of the fused q/k/v projection). ``attention_prefill`` calls it
there on sm_90; call it through there.

Structure (FlashAttention-3's, on 64 queries per consumer warpgroup x one head per program):
- a 1-warp producer loads the program's 64-row Q tiles once, then streams K and V blocks of
  BLOCK_N keys through a ring of shared-memory stages with TMA (the GQA heads that share a KV head
  run side by side, so their K/V tiles come from L2);
- consumer warpgroups (three by default), each a partition of its own with 64 of the queries, run
  the online softmax in base 2 with the running max starting at the sink (as attention.py). Inside
  a warpgroup the work is software-pipelined: the QK^T product of block j + 1 and the PV product of
  block j - 1 are in flight on the tensor cores while block j's softmax runs, and the warpgroups
  overlap each other besides. Blocks past a warpgroup's diagonal are skipped (only
  released); the diagonal blocks get the causal mask.
- epilogue: O / l in bf16 through shared memory (the Q tile's buffer) and a TMA store.

Several sequences' chunks after their cached keys in one launch (``segments``: a serving step's prompts,
``attention_prefill``'s k_starts / q_offsets, opt-in ``KernelConfig.attention_gluon_segments``): the grid's third
axis is the sequence, each partition reads its row bases and query offset (``_segment``) and returns where the
sequence has no rows for its program; the producer loads from those rows, and the consumers store their rows through
a mask (a TMA store of a tile crossing a sequence's end would write the next one's rows). A sequence's last key
block may hold rows past its keys (the next sequence's, a cache's stale rows): masked scores, so they must be finite.

Options toward the exp bound (issue 34; ``ws_attention_prefill``'s keywords, ``GluonAttentionTile``'s
fields), measured side by side on the H200 (benchmarks/attn_variants.py; BENCHMARKS.md "Attention
prefill"): Q as the register operand of QK^T (the default: +3%), blocks in pairs with QK^T one block
ahead, part of 2^x by an FMA-pipe polynomial or packed bf16x2 ex2, conditional rescaling of the running
max, the consumer warpgroups issuing in turn (FlashAttention-3's ping-pong), tree row reductions, four
consumer warpgroups: none but the first gains, because the kernel runs at the H200's power cap (its MMAs
alone and its softmax alone, the ``PROBES``, spend together what the kernel spends). FP8 operands
(kernels/attention_ws_fp8.py) lower the energy per pair.
"""

from __future__ import annotations

import torch

from gptoss_fp8.kernels._gluon import HAS_GLUON, supported  # noqa: F401 - supported is re-exported
from gptoss_fp8.kernels.config import GLUON_EXP_MODES
from gptoss_fp8.quant.fp8 import cdiv

if HAS_GLUON:
    from gptoss_fp8.kernels._gluon import (
        descriptor,
        fence_async_shared,
        gl,
        gluon,
        halves,
        load_stage,
        mbarrier,
        pass_turn,
        take_turn,
        tma,
        unhalves,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

LOG2E = 1.4426950408889634
WG_ROWS = 64  # queries per consumer warpgroup
HEAD_DIM = 64


if HAS_GLUON:

    @gluon.jit
    def _attn_produce(q_desc, k_desc, v_desc, q_bar, ready, empty, q_smem, k_bufs, v_bufs, T, num_pid_m,
                      GROUP: gl.constexpr, VT: gl.constexpr = False, PAIRS: gl.constexpr = False,
                      PAIR_RELEASE: gl.constexpr = 0, P=None, QR=0, KR=0, M_AXIS: gl.constexpr = 1,
                      LOAD_Q: gl.constexpr = True, HEAD=None, C0=0, Q0=0, NQ: gl.constexpr = 0):
        """The producer warp: the program's Q tiles once, then K / V block j into ring position j.
        VT: V arrives transposed ([Hkv * D, T], keys contiguous: kernels/attention_ws_fp8.py). PAIRS: an even
        number of blocks (the consumers take them two at a time; a block past T arrives as zeros).
        PAIR_RELEASE (with PAIRS, an even ring): the consumers release a pair's two stages by one arrive, on the
        odd stage's barrier; both stages' next loads wait for it. PAIR_RELEASE 2: the pair's four loads also
        signal one ready barrier, the odd stage's. P: a later chunk's query offset (``_wg_blocks``): the P
        cached keys come first, every program reads them. QR / KR: the sequence's first row of q and of k / v (a
        ragged batch's segment, ``_segment``). M_AXIS: the grid axis of the program's row block (2 for segments).
        LOAD_Q False: no Q tiles (the consumers make their own: the FP8 kernel's ``q_fused``). HEAD: the query head
        (None: program_id(0)); C0: the ring position of block 0 (a program's second pass over the keys: the FP8
        kernel's ``quant_out``, two heads a program); NQ > 0: the Q tiles are q_smem[Q0 .. Q0 + NQ] (else all of
        q_smem). Returns the ring positions used (the blocks, even with PAIRS)."""
        BN: gl.constexpr = k_bufs.type.shape[1]
        if NQ == 0:
            NWG: gl.constexpr = q_smem.type.shape[0]
        else:
            NWG: gl.constexpr = NQ
        R: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        if HEAD is None:
            head = gl.program_id(0)
        else:
            head = HEAD
        m0 = (num_pid_m - 1 - gl.program_id(M_AXIS)) * (NWG * R)
        kv_col = (head // GROUP) * D
        if LOAD_Q:
            mbarrier.expect(q_bar, NWG * q_desc.block_type.nbytes)
            for w in gl.static_range(NWG):
                tma.async_copy_global_to_shared(q_desc, [QR + m0 + w * R, head * D], q_bar, q_smem.index(Q0 + w))
        if P is None:
            n_blocks = gl.cdiv(gl.minimum(m0 + NWG * R, T), BN)
        else:
            n_blocks = gl.cdiv(P + gl.minimum(m0 + NWG * R, T), BN)
        if PAIRS:
            n_blocks = 2 * gl.cdiv(n_blocks, 2)
        S: gl.constexpr = k_bufs.type.shape[0]
        nbytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
        if PAIR_RELEASE:  # a pair's two stages free once its odd stage's release arrives
            for jj in range(n_blocks // 2):
                j = 2 * jj
                c = C0 + j  # (C0 even: a pair's stages stay an even and an odd one)
                mbarrier.wait(empty.index((c + 1) % S), (((c + 1) // S) & 1) ^ 1)
                if PAIR_RELEASE == 2:  # (one ready barrier a pair: the odd stage's carries both blocks' bytes)
                    mbarrier.expect(ready.index((c + 1) % S), 2 * nbytes)
                for h in gl.static_range(2):
                    bar = ready.index((c + 1) % S) if PAIR_RELEASE == 2 else ready.index((c + h) % S)
                    if PAIR_RELEASE == 1:
                        mbarrier.expect(bar, nbytes)
                    tma.async_copy_global_to_shared(k_desc, [KR + (j + h) * BN, kv_col], bar, k_bufs.index((c + h) % S))
                    tma.async_copy_global_to_shared(v_desc, [kv_col, KR + (j + h) * BN], bar, v_bufs.index((c + h) % S))
        else:
            for j in range(n_blocks):
                if VT:
                    load_stage(k_desc, v_desc, empty, ready, k_bufs, v_bufs, C0 + j, [KR + j * BN, kv_col],
                               [kv_col, KR + j * BN])
                else:
                    load_stage(k_desc, v_desc, empty, ready, k_bufs, v_bufs, C0 + j, [KR + j * BN, kv_col],
                               [KR + j * BN, kv_col])
        return n_blocks

    @gluon.jit
    def _exp2_fma(x):
        """2^x on the FMA / integer pipes instead of the MUFU unit (FlashAttention-4's trick): Cody-Waite
        split x = j + f with j = round(x) (adding 1.5 * 2^23 leaves j in the low mantissa bits), 2^f on
        [-0.5, 0.5] by a degree-3 fit (relative error 7.5e-5, far below bf16's 3.9e-3), j added to the
        exponent field as an integer. x below -125 (also -inf) gives ~2^-125 instead of 0: negligible
        beside the row sum (>= 1)."""
        x = gl.maximum(x, -125.0)
        t = x + 12582912.0
        f = x - (t - 12582912.0)
        p = gl.fma(gl.fma(gl.fma(f, 0.05517098, 0.2426097), f, 0.69326097), f, 0.99992816)
        return (p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)).to(gl.float32, bitcast=True)

    @gluon.jit
    def _fold(x, SUM: gl.constexpr):
        lo, hi = halves(x)
        if SUM:
            return lo + hi
        else:
            return gl.maximum(lo, hi)

    @gluon.jit
    def _tree(x, SUM: gl.constexpr):
        """Row max (SUM False) or row sum of a [R, N] score tile, its register-held columns folded as a
        tree (halves by halves: log2(N / 8) levels, no data moved) before the reduction across the
        quad's lanes; ``gl.max`` / ``gl.sum`` alone fold a thread's 16-32 values in one dependent chain."""
        N: gl.constexpr = x.type.shape[1]
        x = _fold(x, SUM)
        if N >= 32:
            x = _fold(x, SUM)
        if N >= 64:
            x = _fold(x, SUM)
        if N >= 128:
            x = _fold(x, SUM)
        if SUM:
            return gl.sum(x, 1)
        else:
            return gl.max(x, 1)

    @gluon.jit
    def _row_reduce(x, SUM: gl.constexpr, TREE: gl.constexpr):
        if TREE:
            return gl.convert_layout(_tree(x, SUM), gl.SliceLayout(1, x.type.layout))
        elif SUM:
            return gl.sum(x, 1)
        else:
            return gl.max(x, 1)

    @gluon.jit
    def _exp2_tile(x, EXP: gl.constexpr):
        """2^x of a score tile: EXP 0 all on the MUFU; 1 the last quarter of the columns by _exp2_fma;
        2 the last half by _exp2_fma; 3 packed ``ex2.approx.ftz.bf16x2`` on bf16 arguments (result
        bf16, the PV operand's type)."""
        if EXP == 0 or EXP >= 8:  # 8, 9: the timing probes (PROBES) keep the MUFU
            return gl.exp2(x)
        elif EXP == 3:
            return gl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x.to(gl.bfloat16)],
                                             dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            lo, hi = halves(x)
            if EXP == 1:
                a, b = halves(hi)
                y = unhalves(gl.exp2(lo), unhalves(gl.exp2(a), _exp2_fma(b)))
            else:
                y = unhalves(gl.exp2(lo), _exp2_fma(hi))
            return gl.convert_layout(y, x.type.layout, assert_trivial=True)

    @gluon.jit
    def _softmax_step(sc, m_i, l_i, rows, j, qk_scale, MASKED: gl.constexpr, EXP: gl.constexpr,
                      THRESH: gl.constexpr, TREE: gl.constexpr):
        """Block j's scores -> (p, alpha, m_new, l_new, rescale) in base 2 (attention.py's arithmetic).
        THRESH > 0: the running max moves only when some row of the warpgroup grew by more than THRESH
        (log2 units; FlashAttention-4's conditional rescaling), so p <= 2^THRESH and, when it does not
        move, alpha is 1 and ``rescale`` False (the caller skips acc * alpha); O / l is exact either way."""
        BN: gl.constexpr = sc.type.shape[1]
        if MASKED:
            cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, sc.type.layout))
            visible = gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0)
            sc = sc * qk_scale + gl.where(visible, 0.0, float("-inf"))
            m_blk = _row_reduce(sc, False, TREE)
        else:
            m_blk = _row_reduce(sc, False, TREE) * qk_scale
            sc = sc * qk_scale
        if THRESH > 0:
            rescale = gl.max(m_blk - m_i, 0) > THRESH
            if rescale:
                m_new = gl.maximum(m_i, m_blk)
            else:
                m_new = m_i
        else:
            rescale = True
            m_new = gl.maximum(m_i, m_blk)
        sc = sc - gl.expand_dims(m_new, 1)
        alpha = gl.exp2(m_i - m_new)
        p = _exp2_tile(sc, EXP)
        l_new = l_i * alpha + _row_reduce(p.to(gl.float32), True, TREE)
        return p, alpha, m_new, l_new, rescale

    @gluon.jit
    def _softmax_any(sc, m_i, l_i, rows, j, n_full, qk_scale, EXP: gl.constexpr, THRESH: gl.constexpr,
                     TREE: gl.constexpr):
        if j < n_full:
            p, alpha, m_i, l_i, rescale = _softmax_step(sc, m_i, l_i, rows, j, qk_scale, False, EXP, THRESH, TREE)
            p = p.to(gl.bfloat16)
        else:  # the diagonal blocks (causal mask) keep 2^x on the MUFU
            p, alpha, m_i, l_i, rescale = _softmax_step(sc, m_i, l_i, rows, j, qk_scale, True, 0, THRESH, TREE)
            p = p.to(gl.bfloat16)
        return p, alpha, m_i, l_i, rescale

    @gluon.jit
    def _rescale(acc, alpha, rescale, orow_layout: gl.constexpr, THRESH: gl.constexpr):
        if THRESH > 0:
            if rescale:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        else:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        return acc

    @gluon.jit
    def _segment(seg_ptr, NWG: gl.constexpr, R: gl.constexpr, num_pid_m):
        """A ragged batch's segment for this program (``program_id(2)``; seg_ptr int32 [B, 4]: its first q row, its
        query rows, its first k / v row, its query offset) and whether the program has rows of it (the grid covers
        the longest segment's row blocks: the others' programs past their rows return). The grid is (heads, sequences,
        row blocks): the row blocks vary slowest, so every sequence's last (longest) blocks go first."""
        b = gl.program_id(1)
        qr = gl.load(seg_ptr + 4 * b)
        t = gl.load(seg_ptr + 4 * b + 1)
        kr = gl.load(seg_ptr + 4 * b + 2)
        p = gl.load(seg_ptr + 4 * b + 3)
        m0 = (num_pid_m - 1 - gl.program_id(2)) * (NWG * R)
        return qr, t, kr, p, m0 < t

    @gluon.jit
    def _wg_blocks(W: gl.constexpr, NWG: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, T, num_pid_m,
                   row_layout: gl.constexpr, P=None, M_AXIS: gl.constexpr = 1):
        """Consumer warpgroup W's share of the program (the longest row blocks first): (head, its first
        query row r0, its rows, the program's key blocks, the blocks all its queries see in full, the
        blocks it reads: the rest lie wholly in its future). P (a later prompt chunk: q's rows at key
        positions P.., the keys before them cached; None: 0, R == BN): rows are the queries' key
        positions (r0 stays q's row), so the diagonal may cross two key blocks."""
        head = gl.program_id(0)
        m0 = (num_pid_m - 1 - gl.program_id(M_AXIS)) * (NWG * R)
        r0 = m0 + W * R
        if P is None:
            rows = r0 + gl.arange(0, R, layout=row_layout)
            n_blocks = gl.cdiv(gl.minimum(m0 + NWG * R, T), BN)
            return head, r0, rows, n_blocks, (r0 + 1) // BN, gl.minimum(r0 // BN + 1, n_blocks)
        else:
            rows = P + r0 + gl.arange(0, R, layout=row_layout)
            n_blocks = gl.cdiv(P + gl.minimum(m0 + NWG * R, T), BN)
            return head, r0, rows, n_blocks, (P + r0 + 1) // BN, gl.minimum((P + r0 + R - 1) // BN + 1, n_blocks)

    @gluon.jit
    def _attn_consume(W: gl.constexpr, q_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr,
                      T, num_pid_m, qk_scale, q_offset, GROUP: gl.constexpr, QREG: gl.constexpr, DEEP: gl.constexpr,
                      EXP: gl.constexpr, THRESH: gl.constexpr, ORDER: gl.constexpr, TREE: gl.constexpr,
                      SYNC: gl.constexpr, OFFSET: gl.constexpr = False, SEG: gl.constexpr = False, seg_ptr=None,
                      out_ptr=None, stride_o=0):
        """Consumer warpgroup W: queries m0 + 64 W .. m0 + 64 W + 63 of the program's head.
        QREG: Q is the register operand of QK^T (read from shared memory once, not per block).
        DEEP: blocks in pairs, QK^T of the pair's second block issued before the first one's softmax (two
        score tiles in registers), so PV(j - 1) and QK^T(j + 1) are both on the tensor cores while it runs.
        ORDER: the warpgroups take turns to issue (``take_turn``): n_blocks + 1 turns each, the ones past a
        warpgroup's own blocks only passed on. TREE: row max / sum folded as a tree (``_tree``). SEG: a ragged batch
        (``_segment``: the program's sequence, its rows and query offset), its rows stored through out_ptr
        (row stride stride_o) under a mask: a TMA store of the tile would write the next sequence's rows."""
        S: gl.constexpr = k_bufs.type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        NWG: gl.constexpr = q_smem.type.shape[0]
        R: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        if SEG:
            qr, T, kr, q_offset, has_rows = _segment(seg_ptr, NWG, R, num_pid_m)
            if not has_rows:
                return
        if SEG:  # (the row block on the grid's third axis)
            head, r0, rows, n_blocks, n_full, my_blocks = _wg_blocks(W, NWG, R, BN, T, num_pid_m, row_layout, q_offset,
                                                                     M_AXIS=2)
        elif OFFSET:  # a later chunk: q's rows at key positions q_offset.. (rows: those positions; r0: q's row)
            head, r0, rows, n_blocks, n_full, my_blocks = _wg_blocks(W, NWG, R, BN, T, num_pid_m, row_layout, q_offset)
        else:
            head, r0, rows, n_blocks, n_full, my_blocks = _wg_blocks(W, NWG, R, BN, T, num_pid_m, row_layout)
        last = my_blocks - 1
        sink = gl.load(sinks_ptr + head).to(gl.float32) * 1.4426950408889634
        m_i = gl.full([R], 0.0, gl.float32, row_layout) + sink
        l_i = gl.full([R], 1.0, gl.float32, row_layout)
        acc = gl.zeros([R, D], gl.float32, o_layout)
        zero_s = gl.zeros([R, BN], gl.float32, s_layout)
        q = q_smem.index(W)
        mbarrier.wait(q_bar, 0)
        if QREG:
            qa = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            qa = q

        if DEEP:
            # blocks in pairs (a, b) after block 0: QK^T(a), QK^T(b) and PV(a - 1) issued together, a's
            # softmax under QK^T(b) and PV(a - 1), b's under PV(a). Nothing is in flight at the loop's
            # back edge (ptxas serializes every wgmma otherwise: C7514).
            mbarrier.wait(ready.index(0), 0)
            sc = warpgroup_mma(qa, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False)
            p_op, alpha, m_i, l_i, rescale = _softmax_any(sc, m_i, l_i, rows, 0, n_full, qk_scale, EXP, THRESH, TREE)
            p_op = gl.convert_layout(p_op, p_layout)
            for i in range((my_blocks - 1) // 2):
                a = 2 * i + 1
                b = a + 1
                mbarrier.wait(ready.index(a % S), (a // S) & 1)
                s_a = warpgroup_mma(qa, k_bufs.index(a % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                mbarrier.wait(ready.index(b % S), (b // S) & 1)
                s_b = warpgroup_mma(qa, k_bufs.index(b % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_bufs.index((a - 1) % S), acc, is_async=True)  # PV of block a - 1
                sc = warpgroup_mma_wait(num_outstanding=2, deps=(s_a,))
                p_op, alpha, m_i, l_i, rescale = _softmax_any(sc, m_i, l_i, rows, a, n_full, qk_scale, EXP, THRESH, TREE)
                acc, sc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_b))
                mbarrier.arrive(empty.index((a - 1) % S), count=1)
                acc = _rescale(acc, alpha, rescale, orow_layout, THRESH)
                p_op = gl.convert_layout(p_op, p_layout)
                acc = warpgroup_mma(p_op, v_bufs.index(a % S), acc, is_async=True)  # PV of block a
                p_op, alpha, m_i, l_i, rescale = _softmax_any(sc, m_i, l_i, rows, b, n_full, qk_scale, EXP, THRESH, TREE)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(a % S), count=1)
                acc = _rescale(acc, alpha, rescale, orow_layout, THRESH)
                p_op = gl.convert_layout(p_op, p_layout)
            if (my_blocks - 1) % 2 == 1:  # the odd block left: one step as below
                j = my_blocks - 1
                mbarrier.wait(ready.index(j % S), (j // S) & 1)
                s_tok = warpgroup_mma(qa, k_bufs.index(j % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_bufs.index((j - 1) % S), acc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                p_op, alpha, m_i, l_i, rescale = _softmax_any(sc, m_i, l_i, rows, j, n_full, qk_scale, EXP, THRESH, TREE)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((j - 1) % S), count=1)
                acc = _rescale(acc, alpha, rescale, orow_layout, THRESH)
                p_op = gl.convert_layout(p_op, p_layout)
            acc = warpgroup_mma(p_op, v_bufs.index(last % S), acc)
        elif SYNC:
            # each block's MMAs waited for within its step (no P carried across the loop: 128-key blocks fit
            # the consumers' 160 registers); the other warpgroups' work fills the waits
            for j in range(my_blocks):
                mbarrier.wait(ready.index(j % S), (j // S) & 1)
                s_tok = warpgroup_mma(qa, k_bufs.index(j % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
                p_op, alpha, m_i, l_i, rescale = _softmax_any(sc, m_i, l_i, rows, j, n_full, qk_scale, EXP, THRESH,
                                                              TREE)
                acc = _rescale(acc, alpha, rescale, orow_layout, THRESH)
                acc = warpgroup_mma(gl.convert_layout(p_op, p_layout), v_bufs.index(j % S), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if j < last:  # (the last block's stage is released below, as on the other paths)
                    mbarrier.arrive(empty.index(j % S), count=1)
        else:
            mbarrier.wait(ready.index(0), 0)
            take_turn(turn, W, 0, ORDER)
            s_tok = warpgroup_mma(qa, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            pass_turn(turn, W, ORDER)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            p_op, alpha, m_i, l_i, rescale = _softmax_any(sc, m_i, l_i, rows, 0, n_full, qk_scale, EXP, THRESH, TREE)
            p_op = gl.convert_layout(p_op, p_layout)
            sc0 = sc
            for j in range(1, my_blocks):
                s = j % S
                sp = (j - 1) % S
                mbarrier.wait(ready.index(s), (j // S) & 1)
                if EXP == 9:  # probe: the softmax alone, on block 0's scores (a scale that varies with j)
                    p_op, alpha, m_i, l_i, rescale = _softmax_any(sc0, m_i, l_i, rows, j, n_full,
                                                                  qk_scale * (1.0 + j * 1e-6), 0, THRESH, TREE)
                    mbarrier.arrive(empty.index(sp), count=1)
                    acc = _rescale(acc, alpha, rescale, orow_layout, THRESH)
                else:
                    take_turn(turn, W, j, ORDER)
                    s_tok = warpgroup_mma(qa, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    acc = warpgroup_mma(p_op, v_bufs.index(sp), acc, is_async=True)  # PV of block j - 1
                    pass_turn(turn, W, ORDER)
                    sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                    if EXP == 8:  # probe: the MMAs alone (P = the scores)
                        p_op = sc.to(gl.bfloat16)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                        mbarrier.arrive(empty.index(sp), count=1)
                    else:
                        # block j's softmax runs while PV(j - 1) is on the tensor cores
                        p_op, alpha, m_i, l_i, rescale = _softmax_any(sc, m_i, l_i, rows, j, n_full, qk_scale, EXP,
                                                                      THRESH, TREE)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                        mbarrier.arrive(empty.index(sp), count=1)  # K and V of block j - 1 are consumed
                        acc = _rescale(acc, alpha, rescale, orow_layout, THRESH)
                p_op = gl.convert_layout(p_op, p_layout)
            take_turn(turn, W, my_blocks, ORDER)
            acc = warpgroup_mma(p_op, v_bufs.index(last % S), acc, is_async=True)
            pass_turn(turn, W, ORDER)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(last % S), count=1)
        for j in range(my_blocks, n_blocks):  # past the diagonal: only keep the stage ring in step
            mbarrier.wait(ready.index(j % S), (j // S) & 1)
            mbarrier.arrive(empty.index(j % S), count=1)
        if ORDER:  # the turns of the blocks past this warpgroup's diagonal, passed on (after the stage
            # releases above: the others' later blocks need those stages loaded again)
            for k in range(my_blocks + 1, n_blocks + 1):
                take_turn(turn, W, k, ORDER)
                pass_turn(turn, W, ORDER)

        out = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
        if SEG:  # the sequence's rows only, under a mask (int64 offsets: T * Hq * D may pass 2^31)
            orows = r0 + gl.arange(0, R, layout=orow_layout)
            cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            offs = gl.expand_dims((qr + orows).to(gl.int64) * stride_o, 1) + gl.expand_dims(head * D + cols, 0)
            gl.store(out_ptr + offs, out.to(gl.bfloat16), mask=gl.expand_dims(orows < T, 1))
        else:
            q.store(out.to(gl.bfloat16))  # the Q tile's buffer is free now
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [r0, head * D], q)
            tma.store_wait(0)

    # The worker partitions take the same arguments (a warp_specialize requirement).
    @gluon.jit
    def _attn_second_consumer(q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                              sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP: gl.constexpr, QREG: gl.constexpr,
                              DEEP: gl.constexpr, EXP: gl.constexpr, THRESH: gl.constexpr, ORDER: gl.constexpr,
                              TREE: gl.constexpr,
                      SYNC: gl.constexpr, OFFSET: gl.constexpr = False, SEG: gl.constexpr = False, seg_ptr=None,
                      out_ptr=None, stride_o=0):
        _attn_consume(1, q_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr, T, num_pid_m,
                      qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE, SYNC, OFFSET, SEG, seg_ptr,
                      out_ptr, stride_o)

    @gluon.jit
    def _attn_third_consumer(q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                             sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP: gl.constexpr, QREG: gl.constexpr,
                             DEEP: gl.constexpr, EXP: gl.constexpr, THRESH: gl.constexpr, ORDER: gl.constexpr,
                             TREE: gl.constexpr,
                      SYNC: gl.constexpr, OFFSET: gl.constexpr = False, SEG: gl.constexpr = False, seg_ptr=None,
                      out_ptr=None, stride_o=0):
        _attn_consume(2, q_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr, T, num_pid_m,
                      qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE, SYNC, OFFSET, SEG, seg_ptr,
                      out_ptr, stride_o)

    @gluon.jit
    def _attn_fourth_consumer(q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                              sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP: gl.constexpr, QREG: gl.constexpr,
                              DEEP: gl.constexpr, EXP: gl.constexpr, THRESH: gl.constexpr, ORDER: gl.constexpr,
                              TREE: gl.constexpr,
                      SYNC: gl.constexpr, OFFSET: gl.constexpr = False, SEG: gl.constexpr = False, seg_ptr=None,
                      out_ptr=None, stride_o=0):
        _attn_consume(3, q_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr, T, num_pid_m,
                      qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE, SYNC, OFFSET, SEG, seg_ptr,
                      out_ptr, stride_o)

    @gluon.jit
    def _attn_producer(q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr,
                       T, num_pid_m, qk_scale, q_offset, GROUP: gl.constexpr, QREG: gl.constexpr, DEEP: gl.constexpr,
                       EXP: gl.constexpr, THRESH: gl.constexpr, ORDER: gl.constexpr, TREE: gl.constexpr,
                      SYNC: gl.constexpr, OFFSET: gl.constexpr = False, SEG: gl.constexpr = False, seg_ptr=None,
                      out_ptr=None, stride_o=0):
        if SEG:  # a ragged batch's segment: its rows of q and of k / v, its query offset
            NWG: gl.constexpr = q_smem.type.shape[0]
            R: gl.constexpr = q_smem.type.shape[1]
            qr, t, kr, p, has_rows = _segment(seg_ptr, NWG, R, num_pid_m)
            if has_rows:
                _attn_produce(q_desc, k_desc, v_desc, q_bar, ready, empty, q_smem, k_bufs, v_bufs, t, num_pid_m, GROUP,
                              P=p, QR=qr, KR=kr, M_AXIS=2)
        elif OFFSET:
            _attn_produce(q_desc, k_desc, v_desc, q_bar, ready, empty, q_smem, k_bufs, v_bufs, T, num_pid_m, GROUP,
                          P=q_offset)
        else:
            _attn_produce(q_desc, k_desc, v_desc, q_bar, ready, empty, q_smem, k_bufs, v_bufs, T, num_pid_m, GROUP)

    @gluon.jit(do_not_specialize=["q_offset"])
    def _ws_attention_kernel(q_desc, k_desc, v_desc, o_desc, sinks_ptr, T, num_pid_m, qk_scale, q_offset,
                             GROUP: gl.constexpr, STAGES: gl.constexpr, NWG: gl.constexpr, REGS: gl.constexpr,
                             QREG: gl.constexpr = True, DEEP: gl.constexpr = False, EXP: gl.constexpr = 0,
                             THRESH: gl.constexpr = 0.0, ORDER: gl.constexpr = False, TREE: gl.constexpr = False,
                             SYNC: gl.constexpr = False, OFFSET: gl.constexpr = False, SEG: gl.constexpr = False,
                             seg_ptr=None, out_ptr=None, stride_o=0):
        R: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [NWG, R, D], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [NWG, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NWG):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NWG)  # released by every consumer warpgroup
        # (argument tuples written out in place: a tuple holding a function cannot be a variable here)
        if NWG == 4:
            gl.warp_specialize([
                (_attn_consume, (0, q_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr, T,
                                 num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE, SYNC, OFFSET, SEG,
                                 seg_ptr, out_ptr, stride_o)),
                (_attn_second_consumer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                         sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER,
                                         TREE, SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
                (_attn_third_consumer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                        sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER,
                                        TREE, SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
                (_attn_fourth_consumer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                         sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER,
                                         TREE, SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
                (_attn_producer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                  sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE,
                                  SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
            ], [4, 4, 4, 1], [REGS, REGS, REGS, 24])
        elif NWG == 3:
            gl.warp_specialize([
                (_attn_consume, (0, q_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr, T,
                                 num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE, SYNC, OFFSET, SEG,
                                 seg_ptr, out_ptr, stride_o)),
                (_attn_second_consumer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                         sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER,
                                         TREE, SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
                (_attn_third_consumer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                        sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER,
                                        TREE, SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
                (_attn_producer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                  sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE,
                                  SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
            ], [4, 4, 1], [REGS, REGS, 40])
        else:
            gl.warp_specialize([
                (_attn_consume, (0, q_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs, sinks_ptr, T,
                                 num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE, SYNC, OFFSET, SEG,
                                 seg_ptr, out_ptr, stride_o)),
                (_attn_second_consumer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                         sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER,
                                         TREE, SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
                (_attn_producer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, q_smem, k_bufs, v_bufs,
                                  sinks_ptr, T, num_pid_m, qk_scale, q_offset, GROUP, QREG, DEEP, EXP, THRESH, ORDER, TREE,
                                  SYNC, OFFSET, SEG, seg_ptr, out_ptr, stride_o)),
            ], [4, 1], [REGS, 40])


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with a contiguous [H, D] per row -> the [T, H * D] view (any row stride)."""
    n, h, d = t.shape
    return t.as_strided((n, h * d), (t.stride(0), 1))


EXP_MODES = dict(zip(GLUON_EXP_MODES, range(4), strict=True))  # _exp2_tile's EXP: mufu 0, fma25 1, fma50 2, bf16x2 3
# Timing probes for the roofline (wrong values; benchmarks/attn_variants.py): the same loop with the
# softmax left out (P = the scores, no rescale) or with the MMAs left out (block 0's scores reused)
PROBES = {"probe-mma-only": 8, "probe-softmax-only": 9}
# registers per consumer thread by consumer warpgroups (the producer warp keeps 40, 24 beside four): four
# fit only with Q read from shared memory (with Q in registers ptxas spills and serializes the wgmmas)
REGS = {2: 232, 3: 160, 4: 112}


def ws_attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, out: torch.Tensor,
                         sm_scale: float, block_n: int = 64, stages: int = 3, warpgroups: int = 2,
                         q_in_registers: bool = True, deep: bool = False, exp: str = "mufu",
                         rescale_threshold: float = 0.0, ordered: bool = False, tree: bool = False,
                         sync: bool = False, q_offset: int = 0,
                         segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """Causal attention with sinks, one sequence: q [T, Hq, 64], k/v [q_offset + T, Hkv, 64] bf16 whose [H, D]
    part is contiguous per row, out [T, Hq, 64] (``attention_prefill`` checks the arguments). q_offset > 0:
    a later prompt chunk, q's rows at key positions q_offset.. after the cached keys (``spec.attention(q_offset=)``).
    ``segments`` = (cu_seqlens, k_starts, q_offsets, max_seqlen): several sequences' chunks after their cached keys
    (``attention_prefill``'s k_starts / q_offsets: k / v any rows, e.g. a KV cache's flat view), one launch.
    Options (``GluonAttentionTile``): q_in_registers (Q the register operand of QK^T), deep (blocks in
    pairs, QK^T one block ahead), exp (``EXP_MODES``: how the unmasked blocks' 2^x is computed),
    rescale_threshold (> 0: conditional rescaling of the running max, log2 units), ordered (the consumer
    warpgroups issue their MMAs in turn), tree (row max / sum folded as a tree), sync (each block's MMAs
    waited for within its step: no P carried across the loop, so 128-key blocks fit three warpgroups)."""
    T, hq, d = q.shape
    hkv = k.shape[1]

    def desc(t, rows):
        return descriptor(_rows2d(t), [rows, d])

    assert warpgroups in REGS and block_n in (64, 128), f"warpgroups {warpgroups}, block_n {block_n}"
    assert exp in EXP_MODES or exp in PROBES, f"exp {exp!r}, expected one of {sorted(EXP_MODES)}"
    assert exp not in PROBES or not deep, "the probes are built for the one-block loop"
    assert not (ordered and deep), "ordered turns are built for the one-block loop, not deep"
    assert not (sync and (deep or ordered or exp in PROBES)), "sync is its own loop (not deep, ordered or a probe)"
    assert not sync or block_n == 128, "sync needs block_n=128 (64-key blocks computed wrong rows on the H200)"
    # ordered: warpgroup 0 releases its blocks past the diagonal before passing its last turns, which the
    # others' later blocks wait for; the ring must hold those blocks or the turns deadlock
    assert not ordered or stages >= cdiv((warpgroups - 1) * WG_ROWS, block_n), (
        f"ordered turns need stages >= {cdiv((warpgroups - 1) * WG_ROWS, block_n)} with {warpgroups} warpgroups "
        f"of {block_n}-key blocks (got {stages})")
    assert segments is not None or (q_offset >= 0 and k.shape[0] == v.shape[0] == q_offset + T), (
        f"q_offset {q_offset}: k {tuple(k.shape)} / v {tuple(v.shape)} need q_offset + T = {q_offset + T} rows")
    assert not ((q_offset or segments is not None) and ordered), (
        "ordered turns: one sequence from position 0 (their ring depth is sized for it)")
    n_row_blocks = cdiv(T, warpgroups * WG_ROWS)
    grid, extra = (hq, n_row_blocks), ({"OFFSET": True} if q_offset else {})
    if segments is not None:  # [B, 4]: each sequence's first q row, its rows, its first k / v row, its query offset
        cu, k_starts, q_offsets, max_seqlen = segments
        n_row_blocks = cdiv(max_seqlen, warpgroups * WG_ROWS)
        seg = torch.stack([cu[:-1], cu[1:] - cu[:-1], k_starts, q_offsets], 1).to(torch.int32).contiguous()
        grid = (hq, seg.shape[0], n_row_blocks)  # (row blocks slowest: ``_segment``)
        extra = dict(SEG=True, seg_ptr=seg, out_ptr=out, stride_o=out.stride(0))
    _ws_attention_kernel[grid](
        desc(q, WG_ROWS), desc(k, block_n), desc(v, block_n), desc(out, WG_ROWS), sinks, T, n_row_blocks,
        sm_scale * LOG2E, q_offset, GROUP=hq // hkv, STAGES=stages, NWG=warpgroups, REGS=REGS[warpgroups],
        QREG=q_in_registers, DEEP=deep, EXP={**EXP_MODES, **PROBES}[exp], THRESH=float(rescale_threshold),
        ORDER=ordered, TREE=tree, SYNC=sync, num_warps=4, **extra,
    )
    return out

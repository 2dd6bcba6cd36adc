"""Warp-specialized causal prefill attention with sinks on FP8 operands (``--attention fp8``), Gluon, sm_90.

The pipeline of kernels/attention_ws.py (a 1-warp TMA producer streaming K and V blocks of 64 keys
through a ring of shared-memory stages; three consumer warpgroups of 64 queries each) with e4m3 wgmma
for both products. By default each consumer takes its key blocks two at a time (``pairs``: 128 keys
a step, FlashAttention-3's 192 x 128 tile at head dim 64): QK^T of both blocks, one softmax step (the
running max's ceil and 2^step off the MUFU, tree row reductions), then PV over the 128 keys in one
accumulation, every MMA of a step waited for within it (the other warpgroups fill the waits); and
the row sum comes from the tensor core (``ones``: P8 times a tile of ones, m64n8k32, carried like
the output), not from 64 FADDs a row. The warpgroups take turns at the MUFU (``turns``: an mbarrier
ring, passed on after the first block's 2^x; alone, their exponential phases coincide and the unit
idles while all three wait on MMAs: 56% busy in Nsight Compute), and a step's two ring stages are
released by one arrive and loaded onto one ready barrier (``pair_release``, ``pair_ready``). Why FP8: the
bf16 kernel runs at the H200's 700 W cap, and e4m3 products take half the tensor-core cycles. This one
now runs at the cap too (690 W, 1.94-1.97 GHz): its MMAs alone draw the cap (137 ms at 128000 tokens,
1.73 GHz), its softmax alone runs at 443 W and 2.86e12 pairs/s (183 ms, latency-bound), and the whole
takes the energy of both (~150 J at 128000) at 690 W. H200, 128000 tokens, 64 q / 8 kv heads:
214.3-216 ms with the quantization (2.43-2.45e12 pairs/s) against 219-221 without the turns, 229 with the
row sum on the FMA pipes, 254 for one 64-key block a step (``pairs=False``: QK^T of block j under block
j - 1's PV, P carried in fp32) and bf16's 286 (BENCHMARKS.md, issue 34). A step of a warpgroup takes
~2560 cycles (benchmarks/attn_trace.py): its exponentials ~1270 (the MUFU shared with the other two),
the row max ~420, QK^T ~280, the turn, PV and the rest ~600.

Numerics: ``spec.attention_fp8`` (quant/attn_fp8.py's operands, quantized by the launcher): scores
= (Q8 K8^T) * (sq * sm_scale * log2 e) * sk in log2 units (the two scales folded into one factor per
64-key block, then one FMA with the running max: an fp32 rounding or two from the spec's order); the
running max kept an integer (ceil), so alpha is an exact power of two and P * 256 rounds to e4m3 in
the spec's final frame; 2^x taken at (x + 8) for P * 256 directly; each step's P8 V8 summed fresh in
fp32 by the tensor core (Hopper's FP8 MMA accumulates imprecisely over long K) and added to the
running output after its alpha; the row sum of the same P8 (``row_sum="p8"``; the options without
``ones`` sum the fp32 P: ``row_sum="p"``); at the end times V's channel scale / 256, divided by the
row sum (the sink's term included). V arrives transposed (keys contiguous, [Hkv * D, T]): the
K-major B operand e4m3 wgmma needs. T, the grid's row count and the scale widths are launch values,
never compiled in: compiled for one program row per head (an argument equal to 1 is specialized),
the 128-key step returned wrong rows at T <= 192 (benchmarks/attn_poison_probe.py found it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels import attn_quant
from gptoss_fp8.kernels._gluon import HAS_GLUON
from gptoss_fp8.quant.attn_fp8 import FP8_MAX, P_SCALE, QK_BLOCK, quantize_qk, quantize_v
from gptoss_fp8.quant.fp8 import ACT_EPS, ACT_GROUP, cdiv
from gptoss_fp8.quant.fp8 import FP8_MAX as ACT_FP8_MAX

if HAS_GLUON:
    from gptoss_fp8.kernels._gluon import (
        bf16_round,
        descriptor,
        fence_async_shared,
        gl,
        gluon,
        halves,
        mbarrier,
        pass_turn,
        take_turn,
        tma,
        unhalves,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from gptoss_fp8.kernels.attention_ws import (
        _attn_produce,
        _exp2_fma,
        _fold,
        _row_reduce,
        _wg_blocks,
    )

LOG2E = 1.4426950408889634
WG_ROWS = 64  # queries per consumer warpgroup (= QK_BLOCK: one Q scale per warpgroup)
BLOCK_N = 64  # keys per block (= QK_BLOCK: one K scale per block)
HEAD_DIM = 64
NWG = 3  # consumer warpgroups
# S16 (QK^T accumulated in f16): Q's e4m3 block maximum, so that 64 products of |q| <= 1.75 and |k| <= 448 sum
# to at most 50176 < 65504 (f16's largest); 1.75 = 448 / 256, an e4m3 value
S16_Q_MAX = 1.75


if HAS_GLUON:
    _Q_MAX = gl.constexpr(FP8_MAX)  # (``q_fused``: what a Q block's amax maps to, and the scale's floor: attn_quant's)
    _Q_EPS = gl.constexpr(ACT_EPS)
    _A_MAX = gl.constexpr(ACT_FP8_MAX)  # (``quant_out``: act_quant's, o_proj's input)
    _A_EPS = gl.constexpr(ACT_EPS)
    _LIN_MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2^23: a float whose unit in the last place is 1
    _LIN_BOUND = gl.constexpr(64.0 * 448.0 * 448.0)  # |a QK^T sum of e4m3 products| at head dim 64

    @gluon.jit
    def _ceil(x):
        """ceil(x) by one add rounding up at 1.5 * 2^23 (an FMA-pipe FADD; exact for |x| < 2^22, and scores in
        log2 units are far smaller; -inf stays -inf) instead of FRND, which shares the MUFU's pipe with 2^x."""
        return gl.inline_asm_elementwise("{ .reg .f32 t; add.rp.f32 t, $1, 0f4B400000; sub.f32 $0, t, 0f4B400000; }",
                                         "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _pow2(d):
        """2^d for integer-valued d <= 0 (the running max's step) built in the exponent bits (max, add, integer
        subtract, shift; 0 for d <= -127, as ex2.approx.ftz flushes) instead of a MUFU ex2."""
        return gl.inline_asm_elementwise(
            "{ .reg .f32 t; .reg .b32 b; max.f32 t, $1, 0fC2FE0000; add.f32 t, t, 0f4B400000; mov.b32 b, t; "
            "sub.s32 b, b, 0x4B3FFF81; shl.b32 b, b, 23; mov.b32 $0, b; }",
            "=f,f", [d], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _fp8_softmax(sc, c, m_i, l_i, rows, j, MASKED: gl.constexpr):
        """Block j's raw e4m3 dot products sc and its score factor c -> (P * 256, alpha, m, l)."""
        BN: gl.constexpr = sc.type.shape[1]
        if MASKED:
            cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, sc.type.layout))
            visible = gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0)
            sc = gl.where(visible, sc * c, float("-inf"))
            m_new = gl.maximum(m_i, gl.ceil(gl.max(sc, 1)))
            p = gl.exp2(sc - gl.expand_dims(m_new - 8.0, 1))
        else:
            m_new = gl.maximum(m_i, gl.ceil(gl.max(sc, 1) * c))
            p = gl.exp2(sc * c - gl.expand_dims(m_new - 8.0, 1))  # P * 256
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, 1) * 0.00390625
        return p, alpha, m_new, l_new

    @gluon.jit
    def _exp2_split(x, FMA: gl.constexpr):
        """2^x of a score tile: FMA 0 on the MUFU; 1 its second half of columns by the FMA pipes' polynomial
        (attention_ws._exp2_fma, FlashAttention-4's trick: relative error 7.5e-5, far below e4m3's step);
        2 all of it by the polynomial."""
        if FMA == 0:
            return gl.exp2(x)
        elif FMA == 1:
            lo, hi = halves(x)
            return gl.convert_layout(unhalves(gl.exp2(lo), _exp2_fma(hi)), x.type.layout, assert_trivial=True)
        else:
            return _exp2_fma(x)

    @gluon.jit
    def _turn_taken(m8, turn, zrow, W: gl.constexpr, k, TURN: gl.constexpr):
        """TURN: wait for warpgroup W's k-th turn, then m8 plus zeros read from shared memory after the wait
        (without that data dependency ptxas schedules the exponentials between the wait's first try and its
        test: the turn would not order them)."""
        if TURN > 0:
            take_turn(turn, W, k, True)
            m8 = m8 + zrow.load(m8.type.layout)
        return m8

    @gluon.jit
    def _ex2(x, S16: gl.constexpr):
        if S16:
            return _h2exp2(x)
        else:
            return gl.exp2(x)

    @gluon.jit
    def _exp2_passing(x, turn, W: gl.constexpr, TURN: gl.constexpr, S16: gl.constexpr = False):
        """2^x of the step's first block, the turn passed on after it (TURN 2) or after its first half of
        columns (3). S16: x f16, by packed pairs."""
        if TURN == 3:
            lo, hi = halves(x)
            lo = _ex2(lo, S16)
            pass_turn(turn, W, True)
            return gl.convert_layout(unhalves(lo, _ex2(hi, S16)), x.type.layout, assert_trivial=True)
        else:
            y = _ex2(x, S16)
            pass_turn(turn, W, TURN == 2)
            return y

    @gluon.jit
    def _lane_max(x):
        """A score tile's row maxima folded within each thread only: [R, N] (the wgmma accumulator layout) ->
        [R, 4], a row's maximum over the columns each lane of its quad holds (``attention_ws._tree``'s folds, then
        the pair of adjacent columns in a thread's registers; no data moved, no shuffle)."""
        R: gl.constexpr = x.type.shape[0]
        x = _fold(_fold(_fold(x, False), False), False)  # 64 -> 8 columns: 2 a lane of the quad
        gl.static_assert(x.type.shape[1] == 8, "_lane_max: 64-key blocks")
        a, b = gl.split(gl.reshape(x, [R, 4, 2]))
        return gl.maximum(a, b)

    @gluon.jit
    def _quad_max(x, rows):
        """[R, 4] lane maxima (``_lane_max``) -> the rows' maxima [R] across the quad's lanes (two shuffles), in
        the layout of ``rows`` (the score tile's rows)."""
        return gl.convert_layout(gl.max(x, 1), rows.type.layout)

    @gluon.jit
    def _step32(sa, sb, ca, cb, m_i, rows, FMA: gl.constexpr, turn, zrow, W: gl.constexpr, k, TURN: gl.constexpr,
                trace_ptr, TRACE: gl.constexpr, LMAX: gl.constexpr):
        """``_fp8_softmax2``'s unmasked step in fp32 -> (P * 256 of each block, m)."""
        if LMAX:  # (each block's maxima scaled per lane: max and a positive scale commute, the same m)
            m_blk = _quad_max(gl.maximum(_lane_max(sa) * ca, _lane_max(sb) * cb), rows)
        else:
            m_blk = gl.maximum(_row_reduce(sa, False, True) * ca, _row_reduce(sb, False, True) * cb)
        if FMA >= 3:  # (exp_lin: m = ceil(max - 3/4), the codes up to 126, e4m3's 448, with half a code of room for
            # the FFMA's exact products against m from the rounded ones: 127 would be NaN)
            m_blk = m_blk - 0.75
        m_new = gl.maximum(m_i, _ceil(m_blk))
        _stamp(trace_ptr, m_new, rows, 3, k, W, TRACE)
        m8 = _turn_taken(m_new - 8.0, turn, zrow, W, k, TURN)
        _stamp(trace_ptr, m8, rows, 4, k, W, TRACE)
        if FMA >= 3:  # (exp_lin: the e4m3 codes of P * 256 in the low bits, no 2^x; ``_lin_e4m3`` packs them)
            b = gl.expand_dims(_lin_bias(m_new), 1)
            pa = sa * (ca * 8.0) + b
            _stamp(trace_ptr, m8, rows, 5, k, W, TRACE)
            pb = sb * (cb * 8.0) + b
        else:
            pa = _exp2_passing(sa * ca - gl.expand_dims(m8, 1), turn, W, TURN)  # P * 256
            _stamp(trace_ptr, m8, rows, 5, k, W, TRACE)
            pb = _exp2_split(sb * cb - gl.expand_dims(m8, 1), FMA)
        return pa, pb, m_new

    @gluon.jit
    def _step16(sa, sb, ca, cb, m_i, rows, turn, zrow, W: gl.constexpr, k, TURN: gl.constexpr, trace_ptr,
                TRACE: gl.constexpr, S16: gl.constexpr):
        """``_fp8_softmax2``'s unmasked step on f16 scores (S16): the row max exact in f16, scaled in fp32; the
        scale and shift one ``fma.rn.f16x2`` and 2^x one ``ex2.approx.f16x2`` for two scores -> (P * 256 f16, m)."""
        m_blk = gl.maximum(_row_reduce(sa, False, True).to(gl.float32) * ca,
                           _row_reduce(sb, False, True).to(gl.float32) * cb)
        m_new = gl.maximum(m_i, _ceil(m_blk))
        _stamp(trace_ptr, m_new, rows, 3, k, W, TRACE)
        m8 = _turn_taken(m_new - 8.0, turn, zrow, W, k, TURN)
        _stamp(trace_ptr, m8, rows, 4, k, W, TRACE)
        shift = gl.expand_dims((0.0 - m8).to(gl.float16), 1)
        pa = _exp2_passing(_h2fma(sa, ca.to(gl.float16), shift), turn, W, TURN, S16)
        _stamp(trace_ptr, m8, rows, 5, k, W, TRACE)
        pb = _ex2(_h2fma(sb, cb.to(gl.float16), shift), S16)
        return pa, pb, m_new

    @gluon.jit
    def _step_masked(sa, sb, ca, cb, m_i, rows, a, turn, zrow, W: gl.constexpr, k, TURN: gl.constexpr, trace_ptr,
                     TRACE: gl.constexpr, LMAX: gl.constexpr, S16: gl.constexpr = False, FMA: gl.constexpr = 0):
        """``_fp8_softmax2``'s masked step (blocks a, a + 1 from the diagonal on), in fp32 -> (P * 256 of each
        block in the scores' dtype, m)."""
        BN: gl.constexpr = sa.type.shape[1]
        cols = a * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, sa.type.layout))
        xa = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), sa.to(gl.float32) * ca, float("-inf"))
        xb = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols + BN, 0), sb.to(gl.float32) * cb, float("-inf"))
        if LMAX:
            m_blk = _quad_max(gl.maximum(_lane_max(xa), _lane_max(xb)), rows)
        else:
            m_blk = gl.maximum(_row_reduce(xa, False, True), _row_reduce(xb, False, True))
        if FMA >= 3:  # (exp_lin: m = ceil(max - 3/4), the codes up to 126, e4m3's 448, with half a code of room for
            # the FFMA's exact products against m from the rounded ones: 127 would be NaN)
            m_blk = m_blk - 0.75
        m_new = gl.maximum(m_i, _ceil(m_blk))
        _stamp(trace_ptr, m_new, rows, 3, k, W, TRACE)
        m8 = _turn_taken(m_new - 8.0, turn, zrow, W, k, TURN)
        _stamp(trace_ptr, m8, rows, 4, k, W, TRACE)
        if FMA >= 3:  # (exp_lin; -inf stays -inf: its low bits are zeros, and as an integer it is negative)
            b = gl.expand_dims(_lin_bias(m_new), 1)
            pa = xa * 8.0 + b
            pb = xb * 8.0 + b
        else:
            pa = _exp2_passing(xa - gl.expand_dims(m8, 1), turn, W, TURN)
            pb = gl.exp2(xb - gl.expand_dims(m8, 1))
        if S16:
            pa = pa.to(gl.float16)
            pb = pb.to(gl.float16)
        return pa, pb, m_new

    @gluon.jit
    def _fp8_softmax2(sa, sb, ca, cb, m_i, l_i, rows, a, n_full, ONES: gl.constexpr, FMA: gl.constexpr = 0,
                      turn=None, zrow=None, W: gl.constexpr = 0, k=0, TURN: gl.constexpr = 0, trace_ptr=None,
                      TRACE: gl.constexpr = 0, LMAX: gl.constexpr = False, S16: gl.constexpr = False):
        """Blocks a and a + 1 (raw e4m3 dot products sa, sb; score factors ca, cb) -> (P * 256 of each, alpha,
        m, l): one running-max step for their 128 keys, masked from the first block crossing the diagonal
        (n_full) on; row max and sum folded as trees (attention_ws._row_reduce). ONES: l is left to the
        tensor core (the caller's P8 x ones product), returned unchanged. FMA: in the unmasked steps, a
        quarter (1) or half (2) of the step's 2^x on the FMA pipes (block b's by ``_exp2_split``). TURN: the
        warpgroups take turns at the MUFU (step k's turn, ``take_turn``): the 2^x of both blocks (1), of
        block a (2) or of its first half (3) between taking the turn and passing it on, so that their
        exponential phases follow each other instead of sharing the unit at once. S16: sa, sb are f16 (QK^T
        accumulated in f16, Q quantized to 1.75 so that no sum can overflow): the unmasked step's scale, shift and
        2^x on f16 pairs (one instruction for two scores), P returned in f16; the masked steps in fp32 as without
        it, P rounded to f16 at the end."""
        if S16:
            if a + 1 < n_full:
                pa, pb, m_new = _step16(sa, sb, ca, cb, m_i, rows, turn, zrow, W, k, TURN, trace_ptr, TRACE, S16)
            else:
                pa, pb, m_new = _step_masked(sa, sb, ca, cb, m_i, rows, a, turn, zrow, W, k, TURN, trace_ptr, TRACE,
                                             LMAX, S16)
        elif a + 1 < n_full:
            pa, pb, m_new = _step32(sa, sb, ca, cb, m_i, rows, FMA, turn, zrow, W, k, TURN, trace_ptr, TRACE, LMAX)
        else:
            pa, pb, m_new = _step_masked(sa, sb, ca, cb, m_i, rows, a, turn, zrow, W, k, TURN, trace_ptr, TRACE, LMAX,
                                         False, FMA)
        pass_turn(turn, W, TURN == 1)
        alpha = _pow2(m_i - m_new)
        if ONES:
            l_new = l_i
        else:
            l_new = l_i * alpha + (_row_reduce(pa, True, True) + _row_reduce(pb, True, True)) * 0.00390625
        return pa, pb, alpha, m_new, l_new

    @gluon.jit
    def _relabel(p, p_layout: gl.constexpr):
        """P * 256 [R, 64] fp32 in the accumulator layout -> the A operand's layout, no data moved: its
        key columns relabelled by key_order (bits c5 c4 c3 c2 c1 c0 read as c5 c4 c2 c1 c3 c0: each
        thread's own values in the operand's order; the launcher put V's keys in that order too)."""
        R: gl.constexpr = p.type.shape[0]
        x = gl.permute(gl.reshape(p, [R, 2, 2, 2, 2, 2, 2]), (0, 1, 2, 4, 5, 3, 6))
        return gl.convert_layout(gl.reshape(x, [R, 64]), p_layout, assert_trivial=True)

    @gluon.jit
    def _e4m3(x):
        """fp32 -> e4m3, four values to one register (two cvt e4m3x2: RNE, saturating, as the spec's cast
        below 448). Called right before the wgmma that reads it: an e4m3 tensor carried across the loop's
        back edge is kept a byte per register and repacked (~100 instructions a block)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)

    @gluon.jit
    def _lin_bias(m):
        """``exp_lin``'s per-row addend: 1.5 * 2^23 + 120 - 8 m, so that 8 x + it (x the scores in log2 units, m their
        integer running max) rounds to an integer in the low mantissa bits: round(8 (x - m + 8) + 56), the e4m3 code
        of 2^(x - m + 8) = P * 256 with the mantissa bits read linearly (quant/attn_fp8.py ``lin_e4m3``)."""
        return (_LIN_MAGIC + 120.0) - 8.0 * m

    @gluon.jit
    def _lin_floor(y, U: gl.constexpr = False):
        """``exp_lin``'s codes clamped at 0 as floats (max with 1.5 * 2^23; -inf too); U: ``_lin_pack16``'s codes, u
        clamped at 32768 (code 0; max with 1.5 * 2^23 + 32768). Not pure, so that the compiler keeps the branch it
        sits in (a pure max it computes on both sides of the branch and selects)."""
        FLOOR: gl.constexpr = "0f4B408000" if U else "0f4B400000"
        return gl.inline_asm_elementwise("max.f32 $0, $1, " + FLOOR + ";", "=f,f", [y], dtype=gl.float32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _lin_e4m3(y, FMA: gl.constexpr):
        """``exp_lin``'s codes (``_lin_bias``) -> e4m3, four values to one register: each code clamped at 0 (the codes
        below 0, and -inf, are 0) and its low byte taken. FMA 3: clamped as 32-bit integers (any float); 4: as
        16-bit halves (one packed max for two; a code below -32768, 4096 log2 units under the row's max, would wrap:
        ``_fp8_pairs`` clamps the codes as floats first, ``_lin_floor``, in any step where one could be); 5 as 4."""
        if FMA == 3:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 a, b, c, d, lo, hi; max.s32 a, $1, 0x4B400000; max.s32 b, $2, 0x4B400000; "
                "max.s32 c, $3, 0x4B400000; max.s32 d, $4, 0x4B400000; prmt.b32 lo, a, b, 0x0040; "
                "prmt.b32 hi, c, d, 0x0040; prmt.b32 $0, lo, hi, 0x5410; }",
                "=r,r,r,r,r", [y], dtype=gl.float8e4nv, is_pure=True, pack=4)
        else:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 lo, hi; prmt.b32 lo, $1, $2, 0x5410; prmt.b32 hi, $3, $4, 0x5410; "
                "max.relu.s16x2 lo, lo, lo; max.relu.s16x2 hi, hi, hi; prmt.b32 $0, lo, hi, 0x6420; }",
                "=r,r,r,r,r", [y], dtype=gl.float8e4nv, is_pure=True, pack=4)

    @gluon.jit
    def _lin_pack16(y, p_layout: gl.constexpr):
        """``exp_lin`` 4 / 5's codes [R, 64] fp32 (the scores' layout; ``_lin_bias`` + 32768: each code plus 32768 in the
        float's low 16 bits, an unsigned u) -> [R, 32] int32 in the A operand's order (``_relabel``): two u a register
        (one PRMT), an even key's low. Exact while every code is within [-32768, 32767]: the callers clamp as floats
        first wherever the bound does not rule that out."""
        R: gl.constexpr = y.type.shape[0]
        e, o = gl.split(gl.reshape(_relabel(y, p_layout), [R, 32, 2]))
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [e, o], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _umax16(a, b):
        """The larger of each unsigned 16-bit half: one ``max.u16x2``."""
        return gl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _halves_umax(x):
        """The larger unsigned 16-bit half of each register, as an int32."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, $1, 0x1032; max.u16x2 t, $1, t; shr.u32 $0, t, 16; }", "=r,r",
            [x], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _lin_bytes(h, p_layout: gl.constexpr):
        """[R, 32] int32 of u = code + 32768 pairs (``_lin_pack16``) -> P8 [R, 64] e4m3 in the A operand's layout: each
        u raised to 32768 (code clamped at 0; ``max.u16x2``) and its low byte (the code's: 32768's is 0), four a
        register (one PRMT for two registers)."""
        R: gl.constexpr = h.type.shape[0]
        lo, hi = gl.split(gl.reshape(h, [R, 16, 2]))
        w = gl.inline_asm_elementwise(
            "{ .reg .b32 z, a, b; mov.b32 z, 0x80008000; max.u16x2 a, $1, z; max.u16x2 b, $2, z; "
            "prmt.b32 $0, a, b, 0x6420; }", "=r,r,r", [lo, hi], dtype=gl.int32, is_pure=True, pack=1)
        w2 = gl.join(w, w)  # (the register four times over, in the operand's [R, 64] shape: no data moved)
        w4 = gl.convert_layout(gl.reshape(gl.join(w2, w2), [R, 64]), p_layout, assert_trivial=True)
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w4], dtype=gl.float8e4nv, is_pure=True,
                                         pack=4)

    @gluon.jit
    def _lin_raise(c, ha, hb, m_i, acc, lacc, orow_layout: gl.constexpr, lrow_layout: gl.constexpr):
        """``_lin_cmax``'s fast-step rescale: each row whose largest code c passed 126 gets m raised by d = ceil((c -
        126) / 8), its codes shifted by 8 d and its accumulators scaled by 2^-d (d = 0 elsewhere: the same bits)."""
        d = gl.maximum(c - 119, 0) >> 3
        # (u - 8 d in each half by one 32-bit subtract: the bound keeps each code - 8 d above -32768, so no half
        # borrows)
        d8 = gl.expand_dims(d * (8 * 65537), 1)
        df = d.to(gl.float32)
        alpha = _pow2(0.0 - df)
        return (ha - d8, hb - d8, acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1),
                lacc * gl.expand_dims(gl.convert_layout(alpha, lrow_layout), 1), m_i + gl.convert_layout(df, m_i.type.layout))

    @gluon.jit
    def _lin_cmax(sa, sb, ca, cb, m_i, rows, a, fast, acc, lacc, p_layout: gl.constexpr, orow_layout: gl.constexpr,
                  lrow_layout: gl.constexpr, NOBRANCH: gl.constexpr = False):
        """``exp_lin`` 4 / 5's softmax step (FMA 6 / 7) for blocks a, a + 1 -> (their codes as ``_lin_pack16``'s,
        acc and lacc rescaled, m). fast (no mask, the 16-bit bound holds: a uniform scalar): the codes against the
        running max m first, their row maxima c on the packed halves (a tree of ``max.u16x2``); only where one
        exceeds 126 (P * 256 past e4m3's 448: a score about 13/16 above m) is m raised, by d = ceil((c - 126) / 8),
        the codes shifted by 8 d (exact integers; one subtract a register) and the accumulators scaled by 2^-d: no
        fp32 row max and mostly no rescale at all. m then stays one below the spec's max(ceil(sink), ceil(row max -
        3/4)) where the row max lies 3/4 to 13/16 above it: the same P up to a factor 2 that the row sum cancels,
        but for the codes that reach the clamp at 0 (below 2^-7 of the row's largest P). Otherwise (masked, or
        clamped as floats) the fp32 row max and the spec's rule, as ``exp_lin`` 2. NOBRANCH (``exp_lin`` 8): the fast
        step's rescale made every step, by d = 0 in the rows that need none (codes shifted by 0, alpha 1: the same
        bits), so no warpgroup-wide maximum of the rows' codes and no branch on it."""
        if fast:
            bias = gl.expand_dims(_lin_bias(m_i) + 32768.0, 1)
            ha = _lin_pack16(sa * (ca * 8.0) + bias, p_layout)
            hb = _lin_pack16(sb * (cb * 8.0) + bias, p_layout)
            c = _halves_umax(gl.reduce(_umax16(ha, hb), 1, _umax16)) - 32768
            if NOBRANCH:
                cm = a * 0 + 127
                ha, hb, acc, lacc, m_i = _lin_raise(c, ha, hb, m_i, acc, lacc, orow_layout, lrow_layout)
            else:
                cm = gl.max(c, 0)
                if cm > 126:  # (a warpgroup-uniform scalar: one row past 448 takes the warpgroup here)
                    ha, hb, acc, lacc, m_i = _lin_raise(c, ha, hb, m_i, acc, lacc, orow_layout, lrow_layout)
        else:
            cm = a * 0 + 127  # (a code may be live: the PV product taken)
            BN: gl.constexpr = sa.type.shape[1]
            cols = a * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, sa.type.layout))
            xa = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), sa * ca, float("-inf"))
            xb = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols + BN, 0), sb * cb, float("-inf"))
            m_blk = gl.maximum(_row_reduce(xa, False, True), _row_reduce(xb, False, True))
            m_new = gl.maximum(m_i, _ceil(m_blk - 0.75))
            bias = gl.expand_dims(_lin_bias(m_new) + 32768.0, 1)
            ha = _lin_pack16(_lin_floor(xa * 8.0 + bias, True), p_layout)
            hb = _lin_pack16(_lin_floor(xb * 8.0 + bias, True), p_layout)
            alpha = _pow2(m_i - m_new)
            m_i = m_new
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
            lacc = lacc * gl.expand_dims(gl.convert_layout(alpha, lrow_layout), 1)
        return ha, hb, acc, lacc, m_i, cm

    @gluon.jit
    def _lin_products(ha, hb, va, vb, ones, zero_o, zero_l, p_layout: gl.constexpr, pl_layout: gl.constexpr):
        """``exp_lin`` 4-6's PV products: the two blocks' codes (``_lin_cmax``) as e4m3 P8, P8 V over their 128 keys
        and P8 times the tile of ones (the row sum), each into a fresh fp32 accumulator (the FP8 wgmma's accumulation
        keeps too few bits to run over thousands of keys in place, 1.6% off the spec at 4096 tokens on the H100)."""
        p8a = _lin_bytes(ha, p_layout)
        p8b = _lin_bytes(hb, p_layout)
        pv = warpgroup_mma(p8a, va, zero_o, use_acc=False, is_async=True)
        pv = warpgroup_mma(p8b, vb, pv, is_async=True)
        lp = warpgroup_mma(gl.convert_layout(p8a, pl_layout, assert_trivial=True), ones, zero_l, use_acc=False,
                           is_async=True)
        lp = warpgroup_mma(gl.convert_layout(p8b, pl_layout, assert_trivial=True), ones, lp, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(pv, lp))

    @gluon.jit
    def _lin_pv(ha, hb, va, vb, ones, acc, lacc, zero_o, zero_l, p_layout: gl.constexpr, pl_layout: gl.constexpr):
        """``exp_lin`` 4-5's PV step: ``_lin_products`` added to acc / lacc."""
        pv, lp = _lin_products(ha, hb, va, vb, ones, zero_o, zero_l, p_layout, pl_layout)
        return acc + pv, lacc + lp

    @gluon.jit
    def _release_step(empty, r, S: gl.constexpr, PAIR_RELEASE: gl.constexpr):
        """A 128-key step's two ring stages released (one arrive with ``pair_release``)."""
        if not PAIR_RELEASE:
            mbarrier.arrive(empty.index(r % S), count=1)
        mbarrier.arrive(empty.index((r + 1) % S), count=1)

    @gluon.jit
    def _e4m3h(x):
        """f16 -> e4m3, four values to one register (two cvt e4m3x2.f16x2: RNE, saturating): ``_e4m3`` of the
        S16 step's f16 P."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f16x2 lo, $1; cvt.rn.satfinite.e4m3x2.f16x2 hi, $2; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)

    @gluon.jit
    def _h2fma(x, a, b):
        """x * a + b on f16 pairs (one ``fma.rn.f16x2`` for two scores; a, b broadcast to x's shape)."""
        a = gl.broadcast(a, x)[0]
        b = gl.broadcast(b, x)[0]
        return gl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [x, a, b], dtype=gl.float16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _h2exp2(x):
        """2^x of f16 pairs (``ex2.approx.f16x2``; 0 for -inf)."""
        return gl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=gl.float16, is_pure=True,
                                         pack=2)

    @gluon.jit
    def _stamp(trace_ptr, dep, rows, slot, i, W: gl.constexpr, TRACE: gl.constexpr):
        """TRACE (a timing probe, benchmarks/attn_trace.py): the SM clock when dep (a row vector) is ready, stored for
        step i of warpgroup W of head 0's programs at slot 0..7 of its record (the thread of the tile's first row)."""
        if TRACE > 0:
            clk = gl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.f32 p, $1, 0f7F7FFFFF; mov.u32 $0, 0; @p mov.u32 $0, %clock; }",
                "=r,f", [dep], dtype=gl.int32, is_pure=False, pack=1)
            NWGS: gl.constexpr = 3
            rec = (gl.program_id(1) * NWGS + W) * TRACE + i
            first = (rows % 64) == 0
            gl.store(trace_ptr + rec * 8 + slot + rows * 0, clk,
                     mask=first & (gl.program_id(0) == 0) & (i < TRACE))

    @gluon.jit
    def _fp8_blocks(q, k_bufs, v_bufs, ready, empty, sk_ptr, cq, kv, nbk, m_i, l_i, acc, rows, n_full, my_blocks,
                    n_blocks, zero_s, zero_o, p_layout: gl.constexpr, orow_layout: gl.constexpr):
        """One 64-key block a step: QK^T of block j and PV of block j - 1 on the tensor cores while block j's
        softmax runs (P carried across the loop in fp32). -> (acc, l)."""
        S: gl.constexpr = k_bufs.type.shape[0]
        last = my_blocks - 1
        mbarrier.wait(ready.index(0), 0)
        s_tok = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        c = cq * gl.load(sk_ptr + kv * nbk)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        if n_full > 0:
            p256, alpha, m_i, l_i = _fp8_softmax(sc, c, m_i, l_i, rows, 0, False)
        else:
            p256, alpha, m_i, l_i = _fp8_softmax(sc, c, m_i, l_i, rows, 0, True)
        p_op = _relabel(p256, p_layout)
        alpha_prev = alpha
        for j in range(1, my_blocks):
            s = j % S
            sp = (j - 1) % S
            c = cq * gl.load(sk_ptr + kv * nbk + j)
            mbarrier.wait(ready.index(s), (j // S) & 1)
            s_tok = warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            pv = warpgroup_mma(_e4m3(p_op), v_bufs.index(sp).permute((1, 0)), zero_o, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            if j < n_full:
                p256, alpha, m_i, l_i = _fp8_softmax(sc, c, m_i, l_i, rows, j, False)
            else:
                p256, alpha, m_i, l_i = _fp8_softmax(sc, c, m_i, l_i, rows, j, True)
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
            mbarrier.arrive(empty.index(sp), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha_prev, orow_layout), 1) + pv
            alpha_prev = alpha
            p_op = _relabel(p256, p_layout)
        pv = warpgroup_mma(_e4m3(p_op), v_bufs.index(last % S).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        mbarrier.arrive(empty.index(last % S), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha_prev, orow_layout), 1) + pv
        for j in range(my_blocks, n_blocks):  # past the diagonal: only keep the stage ring in step
            mbarrier.wait(ready.index(j % S), (j // S) & 1)
            mbarrier.arrive(empty.index(j % S), count=1)
        return acc, l_i

    @gluon.jit
    def _fp8_pairs(q, k_bufs, v_bufs, ones, ready, empty, sk_ptr, cq, kv, nbk, m_i, l_i, acc, rows, n_full, my_blocks,
                   n_blocks, zero_s, zero_o, p_layout: gl.constexpr, orow_layout: gl.constexpr, ONES: gl.constexpr,
                   FMA: gl.constexpr, turn, zrow, W: gl.constexpr, n_turns, TURN: gl.constexpr,
                   PAIR_RELEASE: gl.constexpr, trace_ptr=None, bound_ptr=None, TRACE: gl.constexpr = 0,
                   PROBE: gl.constexpr = 0,
                   LMAX: gl.constexpr = False, S16: gl.constexpr = False, c0=0, k0=0, sink=0.0, qn=0.0):
        """Two 64-key blocks a step (128 keys: FlashAttention-3's tile at head dim 64), each step's MMAs waited
        for within it: QK^T of both, one softmax step, PV over the 128 keys in one accumulation; the other
        warpgroups' work fills the waits (P carried across the loop in fp32 would take 64 registers more:
        ptxas spills at 160). A last odd block's partner (keys past T: zeros; or past every row here) is
        masked. ONES: the row sum of P * 256 by the tensor core, as P8 times a tile of ones (m64n8k32: the
        sum of the e4m3 P the PV product weighs V by) carried like the output (times alpha). TURN: the
        warpgroups' exponentials take turns (``_fp8_softmax2``); every warpgroup takes n_turns turns, the ones
        past its own steps only passed on (before the ring's blocks past the diagonal: a later warpgroup's
        steps wait for them). c0 / k0: the ring position of block 0 and the first turn's number (a program's second
        head: ``quant_out``; c0 even). FMA 3 / 4 (``exp_lin``): P's e4m3 codes from the scores, clamped as 32-bit
        integers (3), or (4) as 16-bit halves while the step's bound allows it: every score of a block lies within
        D 448^2 c of zero (c its score factor; Q and K e4m3), and the running max within the largest such bound so
        far (or the sink, its log2 units here), so a code stays above -32768 while that bound mb obeys mb + max(sink,
        mb + 1) <= 4000; past it (a uniform branch) the codes are clamped as floats first. FMA 5 (``exp_lin`` 3): FMA 4
        with a tighter bound, |q8 . k8| <= |q8| |k8|: qn the Q tile's largest row norm, each key block's from
        bound_ptr (the K norms, [Hkv, nbk], e4m3 units: the launcher's). FMA 6 / 7 (``exp_lin`` 4 /
        5): ``_lin_cmax``'s step, with FMA 4's bound (6) or one bound for the whole pass in qn (7: the launcher's, a
        Q tile's scores' in log2 units); FMA 8 (``exp_lin`` 6): 7, a fast step whose codes are all <= 0 skipping its
        PV and row-sum MMAs (``_lin_products``); FMA 10 (``exp_lin`` 8): 7 with the fast step's rescale unbranched
        (``_lin_cmax``'s NOBRANCH). -> (acc, l)."""
        S: gl.constexpr = k_bufs.type.shape[0]
        R: gl.constexpr = acc.type.shape[0]
        if ONES:
            l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, 8, 32])
            pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
            lrow_layout: gl.constexpr = gl.SliceLayout(1, l_layout)
            zero_l = gl.zeros([R, 8], gl.float32, l_layout)
            lacc = zero_l + gl.expand_dims(gl.convert_layout(l_i * 256.0, lrow_layout), 1)
        if PROBE == 2:  # (the probe's scores: block 0's, computed once)
            if PAIR_RELEASE != 2:
                mbarrier.wait(ready.index(0), 0)
            mbarrier.wait(ready.index(1 % S), (1 // S) & 1)
            s_a = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_b = warpgroup_mma(q, k_bufs.index(1 % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            sa0, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s_a, s_b))
            acc = gl.convert_layout(sa0, acc.type.layout, assert_trivial=True)
        mb = sink * 0.0  # (FMA 4: the largest score bound so far, a scalar)
        if FMA >= 7:  # (exp_lin 5 / 6: one bound for the pass, the launcher's, in qn)
            mb = qn
            lin_lo = mb + gl.maximum(sink, mb + 1.0) <= 4000.0
        for i in range(gl.cdiv(my_blocks, 2)):
            a = 2 * i
            r = c0 + a  # (its ring position)
            _stamp(trace_ptr, m_i, rows, 0, i, W, TRACE)
            if PAIR_RELEASE != 2:
                mbarrier.wait(ready.index(r % S), (r // S) & 1)
            mbarrier.wait(ready.index((r + 1) % S), ((r + 1) // S) & 1)
            _stamp(trace_ptr, m_i, rows, 1, i, W, TRACE)
            ca = cq * gl.load(sk_ptr + kv * nbk + a)
            cb = cq * gl.load(sk_ptr + kv * nbk + gl.minimum(a + 1, nbk - 1))
            if FMA >= 4 and FMA < 7:  # (exp_lin 2-4: the scores' bound so far, here so that its loads overlap the
                # QK^T MMAs)
                if FMA == 5:  # (the norms', a little wider for the fp32 sums' roundings)
                    nka = gl.load(bound_ptr + kv * nbk + a)
                    nkb = gl.load(bound_ptr + kv * nbk + gl.minimum(a + 1, nbk - 1))
                    mb = gl.maximum(mb, gl.maximum(ca * nka, cb * nkb) * qn * 1.001 + 1.0)
                else:
                    mb = gl.maximum(mb, gl.maximum(ca, cb) * _LIN_BOUND)
                lin_lo = mb + gl.maximum(sink, mb + 1.0) <= 4000.0  # (no code below -32768)
            if PROBE == 2:  # timing probe, the softmax alone: no MMA; scores from the output tile (block 0's)
                sa = gl.convert_layout(acc, zero_s.type.layout, assert_trivial=True)
                sb = -sa  # (not sa itself: its row max would be shared)
            else:
                s_a = warpgroup_mma(q, k_bufs.index(r % S).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                s_b = warpgroup_mma(q, k_bufs.index((r + 1) % S).permute((1, 0)), zero_s, use_acc=False,
                                    is_async=True)
                sa, sb = warpgroup_mma_wait(num_outstanding=0, deps=(s_a, s_b))
            _stamp(trace_ptr, m_i, rows, 2, i, W, TRACE)
            if FMA >= 6:  # (exp_lin 4 / 5: the codes against the running max first, ``_lin_cmax``; the accumulators
                # rescaled only in the steps that raise m)
                # (16 bits hold every code: from below as for exp_lin 2, from above as m >= ceil(sink))
                fast = (a + 1 < n_full) & lin_lo & (mb - sink <= 4000.0)
                ha, hb, acc, lacc, m_i, cm = _lin_cmax(sa, sb, ca, cb, m_i, rows, a, fast, acc, lacc, p_layout,
                                                       orow_layout, lrow_layout, FMA == 10)
                for slot in gl.static_range(3, 7):  # (TRACE: no exponential, no turn: slots 3 to 6 all here)
                    _stamp(trace_ptr, m_i, rows, slot, i, W, TRACE)
                va = v_bufs.index(r % S).permute((1, 0))
                vb = v_bufs.index((r + 1) % S).permute((1, 0))
                if FMA == 8:  # (exp_lin 6: a fast step whose codes are all <= 0 for the warpgroup has P8 = 0: its PV
                    # and row-sum products are zeros, and adding them changes no bit, so they are skipped; the stages
                    # released in each branch, before the adds, as 5's arrive goes among them)
                    if cm > 0:
                        pv, lp = _lin_products(ha, hb, va, vb, ones.permute((1, 0)), zero_o, zero_l, p_layout,
                                               pl_layout)
                        _release_step(empty, r, S, PAIR_RELEASE)
                        acc = acc + pv
                        lacc = lacc + lp
                    else:
                        _release_step(empty, r, S, PAIR_RELEASE)
                else:
                    acc, lacc = _lin_pv(ha, hb, va, vb, ones.permute((1, 0)), acc, lacc, zero_o, zero_l, p_layout,
                                        pl_layout)
                    _release_step(empty, r, S, PAIR_RELEASE)
                if TRACE > 0:  # (the step's products waited for and added)
                    _stamp(trace_ptr, gl.convert_layout(gl.max(lacc, 1), m_i.type.layout), rows, 7, i, W, TRACE)
            else:
                if PROBE == 1:  # timing probe, the MMAs alone: P = the scaled scores, no max, no 2^x
                    pa = sa * ca
                    pb = sb * cb
                    alpha = gl.full(m_i.type.shape, 1.0, gl.float32, m_i.type.layout)
                else:
                    pa, pb, alpha, m_i, l_i = _fp8_softmax2(sa, sb, ca, cb, m_i, l_i, rows, a, n_full, ONES, FMA, turn,
                                                            zrow, W, k0 + i, TURN, trace_ptr, TRACE, LMAX, S16)
                if FMA >= 4:  # (exp_lin's 16-bit clamp: the codes clamped as floats first wherever the bound may not hold;
                    # a branch over fp32 values only: no wgmma or e4m3 tensor inside it)
                    if mb + gl.maximum(sink, mb + 1.0) > 4000.0:
                        pa = _lin_floor(pa)
                        pb = _lin_floor(pb)
                if S16:
                    p8a = _e4m3h(_relabel(pa, p_layout))
                    p8b = _e4m3h(_relabel(pb, p_layout))
                elif FMA >= 3:
                    p8a = _lin_e4m3(_relabel(pa, p_layout), FMA)
                    p8b = _lin_e4m3(_relabel(pb, p_layout), FMA)
                else:
                    p8a = _e4m3(_relabel(pa, p_layout))
                    p8b = _e4m3(_relabel(pb, p_layout))
                if PROBE == 2:
                    pv = zero_o
                else:
                    pv = warpgroup_mma(p8a, v_bufs.index(r % S).permute((1, 0)), zero_o, use_acc=False, is_async=True)
                    pv = warpgroup_mma(p8b, v_bufs.index((r + 1) % S).permute((1, 0)), pv, is_async=True)
                _stamp(trace_ptr, m_i, rows, 6, i, W, TRACE)
                if ONES and PROBE == 3:  # timing probe: the row-sum MMAs skipped (l stays the sink's term)
                    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                elif ONES:
                    lp = warpgroup_mma(gl.convert_layout(p8a, pl_layout, assert_trivial=True), ones.permute((1, 0)),
                                       zero_l, use_acc=False, is_async=True)
                    lp = warpgroup_mma(gl.convert_layout(p8b, pl_layout, assert_trivial=True), ones.permute((1, 0)), lp,
                                       is_async=True)
                    pv, lp = warpgroup_mma_wait(num_outstanding=0, deps=(pv, lp))
                    _stamp(trace_ptr, m_i, rows, 7, i, W, TRACE)
                    lacc = lacc * gl.expand_dims(gl.convert_layout(alpha, lrow_layout), 1) + lp
                else:
                    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                _release_step(empty, r, S, PAIR_RELEASE)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1) + pv
        if TURN > 0:
            for i in range(gl.cdiv(my_blocks, 2), n_turns):
                take_turn(turn, W, k0 + i, True)
                pass_turn(turn, W, True)
        for jb in range(2 * gl.cdiv(my_blocks, 2), 2 * gl.cdiv(n_blocks, 2)):  # past the diagonal: the ring in step
            j = c0 + jb
            if PAIR_RELEASE == 2:  # (the pair's bytes arrive on its odd stage's barrier)
                mbarrier.wait(ready.index(j % S), (j // S) & 1, pred=j % 2 == 1)
            else:
                mbarrier.wait(ready.index(j % S), (j // S) & 1)
            if PAIR_RELEASE:
                mbarrier.arrive(empty.index(j % S), count=1, pred=j % 2 == 1)
            else:
                mbarrier.arrive(empty.index(j % S), count=1)
        if ONES:  # (every column of lacc is the row sum)
            l_i = gl.convert_layout(gl.max(lacc, 1), l_i.type.layout) * 0.00390625
        return acc, l_i

    @gluon.jit
    def _fp8_setup(W: gl.constexpr, ones_smem, zrow, R: gl.constexpr, ONES: gl.constexpr, TURN: gl.constexpr):
        """A consumer warpgroup's shared tiles, filled once a program (``_fp8_head``'s FIRST): its tile of ones
        (ONES: the row sum's B operand) and, with TURN, its row of zeros."""
        BN: gl.constexpr = ones_smem.type.shape[2]
        if ONES:  # (any layout holds ones)
            fill: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
            ones_smem.index(W).store(gl.full([8, BN], 1.0, gl.float32, fill).to(gl.float8e4nv))
            fence_async_shared()
            gl.thread_barrier()  # (all four warps' stores before the warpgroup's first wgmma reads the tile)
        if TURN > 0:  # (zeros read after each turn is taken: the exponentials depend on the wait's acquire)
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BN, 32])
            zrow.slice(W * R, R).store(gl.zeros([R], gl.float32, gl.SliceLayout(1, s_layout)))
            gl.thread_barrier()

    @gluon.jit
    def _fp8_head(W: gl.constexpr, head, r0, rows, n_blocks, n_full, my_blocks, n_turns, q_bar, turn, zrow, q, ready,
                  empty, k_bufs, v_bufs, ones_smem, sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                  T, nbq, nbk, q_offset,
                  GROUP: gl.constexpr, PAIRS: gl.constexpr, ONES: gl.constexpr, FMA: gl.constexpr, TURN: gl.constexpr,
                  REL: gl.constexpr, TRACE: gl.constexpr, PROBE: gl.constexpr, QREG: gl.constexpr,
                  LMAX: gl.constexpr, S16: gl.constexpr, qsrc, QB16: gl.constexpr, ROPE: gl.constexpr,
                  FIRST: gl.constexpr = True, c0=0, k0=0):
        """Consumer warpgroup W's pass over the keys for one query head (``_fp8_consume``): its normalized output
        rows [64, D] fp32 (times V's scales). FIRST: the program's first pass, which also fills the warpgroup's tile
        of ones and its zero row; c0 / k0: the ring position and the turn this pass starts at (``_fp8_pairs``)."""
        BN: gl.constexpr = k_bufs.type.shape[1]
        R: gl.constexpr = q.type.shape[0]
        D: gl.constexpr = q.type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        kv = head // GROUP
        sink = gl.load(sinks_ptr + head).to(gl.float32) * 1.4426950408889634
        m_i = gl.full([R], 0.0, gl.float32, row_layout) + gl.ceil(sink)
        l_i = gl.exp2(gl.full([R], 0.0, gl.float32, row_layout) + (sink - gl.ceil(sink)))
        acc = gl.zeros([R, D], gl.float32, o_layout)
        zero_s = gl.zeros([R, BN], gl.float16 if S16 else gl.float32, s_layout)
        zero_o = gl.zeros([R, D], gl.float32, o_layout)
        if QB16:  # (before the tile of ones below: its fence and barrier order this tile's stores too)
            cq = _quantize_q_tile(qsrc, head, r0, q_offset, T, q, ROPE)
            if not ONES:
                fence_async_shared()
                gl.thread_barrier()
        else:
            # this warpgroup's Q scale (times sm_scale * log2 e, the launcher's); rows past T: any
            cq = gl.load(sq_ptr + head * nbq + gl.minimum(r0 // R, nbq - 1))
        if ONES:  # this warpgroup's tile of ones (any layout holds ones)
            ones = ones_smem.index(W)
        else:
            ones = ones_smem.index(0)
        if FIRST:
            _fp8_setup(W, ones_smem, zrow, R, ONES, TURN)
        if not QB16:
            mbarrier.wait(q_bar, 0)
        qn = sink * 0.0
        if FMA == 5:  # (exp_lin 3: the Q tile's largest row norm, e4m3 units, for the scores' bound)
            qt = q.load(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])).to(gl.float32)
            qn = gl.sqrt(gl.max(gl.sum(qt * qt, 1), 0))
        elif FMA >= 7:  # (exp_lin 5 / 6: the launcher's bound on every score of this Q tile, log2 units)
            qn = gl.load(bound_ptr + head * nbq + gl.minimum(r0 // R, nbq - 1))
        if QREG:
            q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4))
        if PAIRS:
            acc, l_i = _fp8_pairs(q, k_bufs, v_bufs, ones, ready, empty, sk_ptr, cq, kv, nbk, m_i, l_i, acc, rows,
                                  n_full, my_blocks, n_blocks, zero_s, zero_o, p_layout, orow_layout, ONES, FMA, turn,
                                  zrow.slice(W * R, R), W, n_turns, TURN, REL, trace_ptr, bound_ptr, TRACE, PROBE, LMAX, S16,
                                  c0, k0, sink, qn)
        else:
            acc, l_i = _fp8_blocks(q, k_bufs, v_bufs, ready, empty, sk_ptr, cq, kv, nbk, m_i, l_i, acc, rows, n_full,
                                   my_blocks, n_blocks, zero_s, zero_o, p_layout, orow_layout)

        sv = gl.load(sv_ptr + kv * D + gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)))  # V scale / 256
        return acc * gl.expand_dims(sv, 0) / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)

    @gluon.jit
    def _fp8_consume(W: gl.constexpr, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs, ones_smem,
                     sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                     T, num_pid_m, nbq, nbk, q_offset, GROUP: gl.constexpr,
                     PAIRS: gl.constexpr, ONES: gl.constexpr, FMA: gl.constexpr, TURN: gl.constexpr,
                     REL: gl.constexpr, TRACE: gl.constexpr, PROBE: gl.constexpr, QREG: gl.constexpr = False,
                     OFFSET: gl.constexpr = False, LMAX: gl.constexpr = False, S16: gl.constexpr = False,
                     qsrc=None, QB16: gl.constexpr = False, ROPE: gl.constexpr = False, qout=None,
                     QOUT: gl.constexpr = 0):
        """Consumer warpgroup W: queries m0 + 64 W .. + 63 of the program's head (one Q scale block), one key
        block a step (``_fp8_blocks``) or two (PAIRS: ``_fp8_pairs``, ONES its row sum by the tensor core).
        QREG: Q loaded into registers once (the QK^T wgmmas' A operand from registers, 8 a thread: the bf16
        kernel's q_in_registers, 3% there), not read from shared memory by every QK^T. QB16 (``q_fused``): the
        warpgroup quantizes its own Q tile from q's bf16 rows (``_quantize_q_tile``; ROPE: rotated first), no
        Q tile from the producer and no Q scale from sq_ptr.

        QOUT (``quant_out``, with PAIRS; qout = (q_bars, xq_desc, xq_a, xq_b, xs_ptr, stride_xs, amax_smem)): the program
        holds the heads 2p, 2p + 1 (one 128-column group of o_proj's input) and makes two passes over the keys, one
        a head (Q tiles q_smem[W], q_smem[3 + W] on q_bars[0], [1]); the first head's bf16 rows wait in o_smem[W],
        and after the second the pair's rows are quantized as ``act_quant`` does (each row's maximum over both
        heads, scale max(amax, eps) / 448, the quotients' saturating e4m3 cast) into xq [T, Hq * D] e4m3 (TMA,
        rows past T not written) and the scales into xs [T, Hq * D / 128]: no bf16 output."""
        R: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        BN: gl.constexpr = k_bufs.type.shape[1]
        NW: gl.constexpr = o_smem.type.shape[0]  # (the consumer warpgroups; q_smem holds two heads' tiles with QOUT)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        if OFFSET:  # a later chunk: q's rows at key positions q_offset.. (rows: those positions; r0: q's row)
            head, r0, rows, n_blocks, n_full, my_blocks = _wg_blocks(W, NW, R, BN, T, num_pid_m, row_layout, q_offset)
        else:
            head, r0, rows, n_blocks, n_full, my_blocks = _wg_blocks(W, NW, R, BN, T, num_pid_m, row_layout)
        n_turns = 0
        if PAIRS:
            # (the last warpgroup reads the most blocks: every warpgroup takes as many turns as it has steps)
            if OFFSET:
                n_turns = gl.cdiv(_wg_blocks(NW - 1, NW, R, BN, T, num_pid_m, row_layout, q_offset)[5], 2)
            else:
                n_turns = gl.cdiv(_wg_blocks(NW - 1, NW, R, BN, T, num_pid_m, row_layout)[5], 2)
        if QOUT:
            q_bars, xq_desc, xq_a, xq_b, xs_ptr, stride_xs, amax_smem = qout
            pair = head  # (the grid's first axis counts head pairs)
            _fp8_setup(W, ones_smem, zrow, R, ONES, TURN)
            # (a run-time loop, not two inlined passes: one copy of the key loop's code, 2.6% of the warp samples
            # were instruction fetch with two)
            for hh in range(2):
                y = _fp8_head(W, 2 * pair + hh, r0, rows, n_blocks, n_full, my_blocks, n_turns, q_bars.index(hh), turn,
                              zrow, q_smem.index(NW * hh + W), ready, empty, k_bufs, v_bufs, ones_smem, sinks_ptr,
                              sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr, T, nbq, nbk, q_offset, GROUP, PAIRS, ONES, FMA, TURN,
                              REL, TRACE, PROBE, QREG, LMAX, S16, qsrc, QB16, ROPE, False, hh * 2 * gl.cdiv(n_blocks, 2),
                              hh * n_turns)
                yb = bf16_round(y)  # (the bf16 rows act_quant would read)
                if QOUT == 2:  # (measurement: each head's bf16 rows stored as without QOUT, no quantization)
                    o = o_smem.index(W)
                    tma.store_wait(0)
                    gl.thread_barrier()
                    o.store(yb.to(gl.bfloat16))
                    fence_async_shared()
                    gl.thread_barrier()
                    tma.async_copy_shared_to_global(o_desc, [r0, (2 * pair + hh) * D], o)
                elif hh == 0:  # the first head's rows wait in o_smem, their maxima in amax_smem (a register carried
                    # through the second pass spilled inside its key loop: 8 bytes a step, ~1% at 128000 tokens)
                    amax_smem.slice(W * R, R).store(gl.max(gl.abs(yb), 1))
                    o_smem.index(W).store(yb.to(gl.bfloat16))
                else:
                    amax0 = amax_smem.slice(W * R, R).load(gl.SliceLayout(1, o_layout))
                    scale = gl.maximum(gl.maximum(amax0, gl.max(gl.abs(yb), 1)), _A_EPS) / _A_MAX
                    sc2 = gl.expand_dims(scale, 1)
                    ya = o_smem.index(W).load(o_layout).to(gl.float32)
                    # (no clamp before the cast: cvt.rn.satfinite saturates at 448 itself, act_quant.e4m3_saturated)
                    xq_a.index(W).store((ya / sc2).to(gl.float8e4nv))
                    xq_b.index(W).store((yb / sc2).to(gl.float8e4nv))
                    fence_async_shared()
                    gl.thread_barrier()
                    tma.async_copy_shared_to_global(xq_desc, [r0, 2 * pair * D], xq_a.index(W))
                    tma.async_copy_shared_to_global(xq_desc, [r0, (2 * pair + 1) * D], xq_b.index(W))
                    qrows = r0 + gl.arange(0, R, layout=gl.SliceLayout(1, o_layout))
                    gl.store(xs_ptr + qrows.to(gl.int64) * stride_xs + pair, scale, mask=qrows < T)
            tma.store_wait(0)
        else:
            out = _fp8_head(W, head, r0, rows, n_blocks, n_full, my_blocks, n_turns, q_bar, turn, zrow,
                            q_smem.index(W), ready, empty, k_bufs, v_bufs, ones_smem, sinks_ptr, sq_ptr, sk_ptr, sv_ptr,
                            trace_ptr, bound_ptr, T, nbq, nbk, q_offset, GROUP, PAIRS, ONES, FMA, TURN, REL, TRACE, PROBE,
                            QREG, LMAX, S16, qsrc, QB16, ROPE)
            o = o_smem.index(W)
            o.store(out.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [r0, head * D], o)
            tma.store_wait(0)

    # The worker partitions take the same arguments (a warp_specialize requirement).
    @gluon.jit
    def _fp8_consumer1(q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs, ones_smem,
                       sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                       T, num_pid_m, nbq, nbk, q_offset, GROUP: gl.constexpr,
                       PAIRS: gl.constexpr, ONES: gl.constexpr, FMA: gl.constexpr, TURN: gl.constexpr,
                       REL: gl.constexpr, TRACE: gl.constexpr, PROBE: gl.constexpr, QREG: gl.constexpr = False,
                     OFFSET: gl.constexpr = False, LMAX: gl.constexpr = False, S16: gl.constexpr = False,
                     qsrc=None, QB16: gl.constexpr = False, ROPE: gl.constexpr = False, qout=None,
                     QOUT: gl.constexpr = 0):
        _fp8_consume(1, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs, ones_smem, sinks_ptr, sq_ptr,
                     sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                     T, num_pid_m, nbq, nbk, q_offset, GROUP, PAIRS, ONES, FMA, TURN, REL, TRACE, PROBE,
                     QREG, OFFSET, LMAX, S16, qsrc, QB16, ROPE, qout, QOUT)

    @gluon.jit
    def _fp8_consumer2(q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs, ones_smem,
                       sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                       T, num_pid_m, nbq, nbk, q_offset, GROUP: gl.constexpr,
                       PAIRS: gl.constexpr, ONES: gl.constexpr, FMA: gl.constexpr, TURN: gl.constexpr,
                       REL: gl.constexpr, TRACE: gl.constexpr, PROBE: gl.constexpr, QREG: gl.constexpr = False,
                     OFFSET: gl.constexpr = False, LMAX: gl.constexpr = False, S16: gl.constexpr = False,
                     qsrc=None, QB16: gl.constexpr = False, ROPE: gl.constexpr = False, qout=None,
                     QOUT: gl.constexpr = 0):
        _fp8_consume(2, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs, ones_smem, sinks_ptr, sq_ptr,
                     sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                     T, num_pid_m, nbq, nbk, q_offset, GROUP, PAIRS, ONES, FMA, TURN, REL, TRACE, PROBE,
                     QREG, OFFSET, LMAX, S16, qsrc, QB16, ROPE, qout, QOUT)

    @gluon.jit
    def _fp8_producer(q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs, ones_smem,
                      sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                      T, num_pid_m, nbq, nbk, q_offset, GROUP: gl.constexpr,
                      PAIRS: gl.constexpr, ONES: gl.constexpr, FMA: gl.constexpr, TURN: gl.constexpr,
                      REL: gl.constexpr, TRACE: gl.constexpr, PROBE: gl.constexpr, QREG: gl.constexpr = False,
                     OFFSET: gl.constexpr = False, LMAX: gl.constexpr = False, S16: gl.constexpr = False,
                     qsrc=None, QB16: gl.constexpr = False, ROPE: gl.constexpr = False, qout=None,
                     QOUT: gl.constexpr = 0):
        if QOUT:  # two heads a program (``_fp8_consume``'s QOUT): each head's Q tiles and a pass over the keys
            q_bars = qout[0]
            NW: gl.constexpr = o_smem.type.shape[0]
            pair = gl.program_id(0)
            if OFFSET:
                n_ring = _attn_produce(q_desc, k_desc, v_desc, q_bars.index(0), ready, empty, q_smem, k_bufs, v_bufs,
                                       T, num_pid_m, GROUP, True, PAIRS, REL, q_offset, HEAD=2 * pair, NQ=NW)
                _attn_produce(q_desc, k_desc, v_desc, q_bars.index(1), ready, empty, q_smem, k_bufs, v_bufs, T,
                              num_pid_m, GROUP, True, PAIRS, REL, q_offset, HEAD=2 * pair + 1, C0=n_ring, Q0=NW, NQ=NW)
            else:
                n_ring = _attn_produce(q_desc, k_desc, v_desc, q_bars.index(0), ready, empty, q_smem, k_bufs, v_bufs,
                                       T, num_pid_m, GROUP, True, PAIRS, REL, HEAD=2 * pair, NQ=NW)
                _attn_produce(q_desc, k_desc, v_desc, q_bars.index(1), ready, empty, q_smem, k_bufs, v_bufs, T,
                              num_pid_m, GROUP, True, PAIRS, REL, HEAD=2 * pair + 1, C0=n_ring, Q0=NW, NQ=NW)
        elif OFFSET:
            _attn_produce(q_desc, k_desc, v_desc, q_bar, ready, empty, q_smem, k_bufs, v_bufs, T, num_pid_m, GROUP,
                          True, PAIRS, REL, q_offset, LOAD_Q=not QB16)
        else:
            _attn_produce(q_desc, k_desc, v_desc, q_bar, ready, empty, q_smem, k_bufs, v_bufs, T, num_pid_m, GROUP,
                          True, PAIRS, REL, LOAD_Q=not QB16)

    @gluon.jit
    def _quantize_q_tile(qsrc, head, r0, pos0, T, q_tile, ROPE: gl.constexpr):
        """A consumer warpgroup's Q tile made in place of the producer's (``q_fused``): q's bf16 rows r0 .. r0 + 63
        of ``head`` (qsrc = (q_ptr, cos_ptr, sin_ptr, stride_qt, qk_scale)), rotated at positions pos0 + r0 ..
        (ROPE: kernels/rope.py ``rotate``'s fp32 FMAs, rounded to bf16), quantized as kernels/attn_quant.py's
        ``_quantize_qk_kernel`` does (one scale max(amax, eps) / 448 over the 64 x 64 block, IEEE quotients, the
        hardware e4m3 cast): the same bytes into q_tile (e4m3 [64, 64] in shared memory, as its two 32-column
        halves). Returns the scale times qk_scale (sm_scale * log2 e: ``fp8_operands``'s sq product)."""
        q_ptr, cos_ptr, sin_ptr, stride_qt, qk_scale = qsrc
        R: gl.constexpr = q_tile.type.shape[0]
        HALF: gl.constexpr = q_tile.type.shape[1] // 2
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        rows = r0 + gl.arange(0, R, layout=gl.SliceLayout(1, lay))
        j = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, lay)), 0)
        ok = gl.expand_dims(rows < T, 1)
        src = q_ptr + gl.expand_dims(rows.to(gl.int64) * stride_qt, 1) + head * (2 * HALF) + j
        x1 = gl.load(src, mask=ok, other=0.0).to(gl.float32)
        x2 = gl.load(src + HALF, mask=ok, other=0.0).to(gl.float32)
        if ROPE:
            cs = gl.expand_dims((rows + pos0).to(gl.int64) * HALF, 1) + j
            c = gl.load(cos_ptr + cs, mask=ok, other=0.0)
            sn = gl.load(sin_ptr + cs, mask=ok, other=0.0)
            x1, x2 = gl.fma(x1, c, -(x2 * sn)), gl.fma(x2, c, x1 * sn)
            x1 = x1.to(gl.bfloat16).to(gl.float32)
            x2 = x2.to(gl.bfloat16).to(gl.float32)
        amax = gl.maximum(gl.max(gl.max(gl.abs(x1), axis=1), axis=0), gl.max(gl.max(gl.abs(x2), axis=1), axis=0))
        scale = gl.maximum(amax, _Q_EPS) / _Q_MAX
        q_tile.slice(0, HALF, dim=1).store(
            gl.minimum(gl.maximum(gl.div_rn(x1, scale), -_Q_MAX), _Q_MAX).to(gl.float8e4nv))
        q_tile.slice(HALF, HALF, dim=1).store(
            gl.minimum(gl.maximum(gl.div_rn(x2, scale), -_Q_MAX), _Q_MAX).to(gl.float8e4nv))
        return scale * qk_scale

    # (num_pid_m, T and the scale widths are never specialized as constants: compiled for num_pid_m == 1, as
    # Triton specializes an integer argument equal to 1, the 128-key step returned wrong rows for every
    # T <= 192 on the H200 while the same program's work inside a larger grid was right: 2026-12-04)
    @gluon.jit(do_not_specialize=["T", "num_pid_m", "nbq", "nbk", "q_offset"])
    def _ws_attention_fp8_kernel(q_desc, k_desc, v_desc, o_desc, sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr, T,
                                 num_pid_m, nbq, nbk, q_offset, GROUP: gl.constexpr, STAGES: gl.constexpr,
                                 PAIRS: gl.constexpr = False,
                                 ONES: gl.constexpr = False, FMA: gl.constexpr = 0, TURN: gl.constexpr = 0,
                                 REL: gl.constexpr = 0, TRACE: gl.constexpr = 0, PROBE: gl.constexpr = 0,
                                 QREG: gl.constexpr = False, OFFSET: gl.constexpr = False,
                                 LMAX: gl.constexpr = False, S16: gl.constexpr = False, q_ptr=None, cos_ptr=None,
                                 sin_ptr=None, stride_qt=0, qk_scale=1.0, QB16: gl.constexpr = False,
                                 ROPE: gl.constexpr = False, xq_desc=None, xs_ptr=None, stride_xs=0,
                                 QOUT: gl.constexpr = 0):
        R: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        # (3: NWG; QOUT: both heads' tiles, the second's at 3..5, in a power-of-two allocation)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [8 if QOUT else 3, R, D], q_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [3, R, D], o_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, D, BN], v_desc.layout)
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BN], gl.float8e4nv)
        ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [3 if ONES else 1, 8, BN], ones_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        zrow = gl.allocate_shared_memory(gl.float32, [4 * R], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        mbarrier.init(q_bar, count=1)
        if QOUT:  # (quant_out: a Q barrier and Q tiles a head; the pair's e4m3 output tiles, each head's half)
            q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bars.index(0), count=1)
            mbarrier.init(q_bars.index(1), count=1)
            xq_a = gl.allocate_shared_memory(gl.float8e4nv, [3, R, D], xq_desc.layout)
            xq_b = gl.allocate_shared_memory(gl.float8e4nv, [3, R, D], xq_desc.layout)
            amax_smem = gl.allocate_shared_memory(gl.float32, [4 * R], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            qout = (q_bars, xq_desc, xq_a, xq_b, xs_ptr, stride_xs, amax_smem)
        else:
            qout = q_bar  # (unread: warp_specialize's arguments must be values)
        if TURN > 0:
            for i in gl.static_range(3):
                mbarrier.init(turn.index(i), count=1)  # passed on by the warpgroup before
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=3)  # released by every consumer warpgroup
        # (the workers take the same arguments, spelled out: a tuple held in a variable loses its constexprs; qsrc
        # holds none)
        qsrc = (q_ptr, cos_ptr, sin_ptr, stride_qt, qk_scale)
        gl.warp_specialize([
            (_fp8_consume, (0, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs, ones_smem, sinks_ptr,
                            sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                            T, num_pid_m, nbq, nbk, q_offset, GROUP, PAIRS, ONES, FMA, TURN, REL,
                            TRACE, PROBE, QREG, OFFSET, LMAX, S16, qsrc, QB16, ROPE, qout, QOUT)),
            (_fp8_consumer1, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs,
                              ones_smem, sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                              T, num_pid_m, nbq, nbk, q_offset, GROUP, PAIRS,
                              ONES, FMA, TURN, REL, TRACE, PROBE, QREG, OFFSET, LMAX, S16, qsrc, QB16, ROPE, qout, QOUT)),
            (_fp8_consumer2, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs,
                              ones_smem, sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                              T, num_pid_m, nbq, nbk, q_offset, GROUP, PAIRS,
                              ONES, FMA, TURN, REL, TRACE, PROBE, QREG, OFFSET, LMAX, S16, qsrc, QB16, ROPE, qout, QOUT)),
            (_fp8_producer, (q_desc, k_desc, v_desc, o_desc, q_bar, ready, empty, turn, zrow, q_smem, o_smem, k_bufs, v_bufs,
                             ones_smem, sinks_ptr, sq_ptr, sk_ptr, sv_ptr, trace_ptr, bound_ptr,
                             T, num_pid_m, nbq, nbk, q_offset, GROUP, PAIRS,
                             ONES, FMA, TURN, REL, TRACE, PROBE, QREG, OFFSET, LMAX, S16, qsrc, QB16, ROPE, qout, QOUT)),
        ], [4, 4, 1], [160, 160, 40])


def compile_types() -> dict[str, str]:
    """The kernel's argument types as ``_gluon.compile_for_sm90`` takes them (the launcher's descriptors: 64 x 64 e4m3
    tiles of Q / K / V^T, 64 x 64 bf16 of O): for compile-only checks without a GPU (tests, benchmarks/sass_counts.py)."""
    def lay(bits, sw):
        return (f"NVMMASharedLayout(swizzle_byte_width={sw}, element_bitwidth={bits}, rank=2, transposed=False, "
                "fp4_padded=False, cga_layout=[])")
    types = {n: f"tensordesc<fp8e4nv[64, 64],{lay(8, 64)}>" for n in ("q_desc", "k_desc", "v_desc")}
    return types | dict(o_desc=f"tensordesc<bf16[64, 64],{lay(16, 128)}>", sinks_ptr="*fp32", sq_ptr="*fp32",
                        sk_ptr="*fp32", sv_ptr="*fp32", trace_ptr="*i32", bound_ptr="*fp32")


def key_order(device=None) -> torch.Tensor:
    """KEY_ORDER: position k of a 64-key block holds key sigma(k), sigma the bit map k5 k4 k3 k2 k1 k0 ->
    key bits k5 k4 k1 k3 k2 k0 (what _relabel reads P's columns as)."""
    k = torch.arange(BLOCK_N, device=device)
    b = [(k >> i) & 1 for i in range(6)]
    # key bit c0 = k0, c1 = k2, c2 = k3, c3 = k1, c4 = k4, c5 = k5
    return b[0] | (b[2] << 1) | (b[3] << 2) | (b[1] << 3) | (b[4] << 4) | (b[5] << 5)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    n, h, d = t.shape
    return t.as_strided((n, h * d), (t.stride(0), 1))


class Fp8Operands(NamedTuple):
    """``fp8_operands``' result (shapes there): the e4m3 Q / K with their scales, V transposed with its channel
    scale / 256, and (when asked) each 64-row block's largest row norm of K's / Q's e4m3 values (``key_norms``)."""
    q8: torch.Tensor | None
    sq: torch.Tensor | None
    k8: torch.Tensor
    sk: torch.Tensor
    vt: torch.Tensor
    sv: torch.Tensor
    k_norms: torch.Tensor | None = None
    q_norms: torch.Tensor | None = None


def fp8_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None, pos0: int = 0, q_max: float = FP8_MAX,
                 with_q: bool = True, k_norms: bool = False, q_norms: bool = False) -> Fp8Operands:
    """The kernel's operands (quant/attn_fp8.py's roundings: on CUDA the fused Triton kernels of
    kernels/attn_quant.py, on CPU torch ops), an ``Fp8Operands``: (q8 [T, Hq, D], sq [Hq, nb] times sm_scale * log2 e, k8
    [Tk, Hkv, D], sk [Hkv, nbk], vt [Hkv * D, Tpad] e4m3: V transposed, its Tk keys padded with zero keys
    to a multiple of 64, each 64-key block's keys in key_order (P's operand order), and V's channel scale /
    256 [Hkv, D]). rope = (cos, sin) fp32 [>= pos0 + T, D/2]: q not yet rotated (positions pos0..pos0 + T
    - 1: a later chunk's q_offset), rotated in its quantization's pass (``attn_quant.quantize_qk(rope=)``;
    on CPU ``spec.apply_rope`` in fp32 first). q_max: what a Q block's amax maps to (``S16_Q_MAX`` for s16).
    with_q False: q8 and sq None (the kernel's ``q_fused`` makes them itself). k_norms / q_norms: also
    ``key_norms(k8)`` / ``key_norms(q8)`` (``exp_lin`` 3 / 5's bound; on CUDA from the quantization passes;
    else None)."""
    hkv, d = k.shape[1], k.shape[2]
    qn = []
    if q.is_cuda:
        q8, sq, *qn = (attn_quant.quantize_qk(q, q_max, rope=rope, pos0=pos0, norms=q_norms) if with_q
                       else (None, None))
        k8, sk, *kn = attn_quant.quantize_qk(k, norms=k_norms)
        v8t, sv = attn_quant.quantize_v(v, key_order=key_order(), pad_to=BLOCK_N)  # [Hkv, D, Tpad]
        vt = v8t.view(hkv * d, v8t.shape[-1])
    else:
        if rope is not None and with_q:
            rows = slice(pos0, pos0 + q.shape[0])
            q = spec.apply_rope(q, rope[0][rows], rope[1][rows], dtype=torch.float32)
        q8, sq = quantize_qk(q, q_max) if with_q else (None, None)
        k8, sk = quantize_qk(k)
        v8t, sv = quantize_v(v)  # [Hkv, D, T]
        T = v8t.shape[-1]
        tpad = cdiv(T, BLOCK_N) * BLOCK_N
        if tpad != T:
            vp = torch.zeros(hkv, d, tpad, dtype=v8t.dtype, device=v8t.device)
            vp[..., :T] = v8t
            v8t = vp
        vt = v8t.view(hkv * d, tpad // BLOCK_N, BLOCK_N)[:, :, key_order(v8t.device)].reshape(hkv * d, tpad)
        kn = [key_norms(k8)] if k_norms else []
        qn = [key_norms(q8)] if q_norms and q8 is not None else []
    sq = None if sq is None else (sq * (sm_scale * LOG2E)).contiguous()
    return Fp8Operands(q8, sq, k8, sk, vt, (sv / P_SCALE).contiguous(), kn[0] if kn else None, qn[0] if qn else None)


def key_norms(k8: torch.Tensor) -> torch.Tensor:
    """k8 e4m3 [T, Hkv, D] -> each 64-key block's largest key norm, sqrt(sum of squares) of its e4m3 values (fp32
    [Hkv, ceil(T / 64)]): ``exp_lin`` 3's bound on the scores (torch ops: a measurement option's)."""
    t, h, _ = k8.shape
    n = k8.float().square().sum(-1).sqrt()  # [T, Hkv]
    nb = cdiv(t, BLOCK_N)
    n = torch.nn.functional.pad(n, (0, 0, 0, nb * BLOCK_N - t))
    return n.view(nb, BLOCK_N, h).amax(1).t().contiguous()


def lin_bounds(sq: torch.Tensor, q_norms: torch.Tensor, sk: torch.Tensor, k_norms: torch.Tensor) -> torch.Tensor:
    """``exp_lin`` 5's bound on every score of each Q tile, log2 units: sq [Hq, nbq] (the Q scales times sm_scale
    log2 e), q_norms [Hq, nbq] / k_norms [Hkv, nbk] (``key_norms``: each 64-row block's largest row norm of its e4m3
    values), sk [Hkv, nbk] -> fp32 [Hq, nbq]: sq |q8|max max_b(sk_b |k8|b) (|q8 . k8| <= |q8| |k8|; over all of the
    head's key blocks), a little wider for the fp32 sums' roundings (times 1.001, plus 1)."""
    g = (sk * k_norms).amax(1).repeat_interleave(sq.shape[0] // sk.shape[0])  # [Hq]
    return (sq * q_norms * g[:, None] * 1.001 + 1.0).contiguous()


def spec_row_sum(pairs: bool = True, ones: bool = True) -> str:
    """The ``row_sum`` of spec.attention_fp8 that ``ws_attention_prefill_fp8(pairs=, ones=)`` computes: "p8"
    (the e4m3 P, by the tensor core) for the 128-key step with ``ones``, else "p" (the fp32 P)."""
    return "p8" if pairs and ones else "p"


def ws_attention_prefill_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                             out: torch.Tensor | None, sm_scale: float, stages: int = 4, pairs: bool = True,
                             ones: bool = True, exp_fma: int = 0, turns: int | None = None,
                             pair_release: bool | None = None, pair_ready: bool | None = None,
                             probe: str | None = None,
                             trace: torch.Tensor | None = None,
                             rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                             q_in_registers: bool = False, q_offset: int = 0, lane_max: bool = False,
                             s16: bool = False, q_fused: bool = False,
                             q_scale: torch.Tensor | None = None,
                             quant_out: bool = False,
                             two_heads: bool = False, exp_lin: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal FP8 attention with sinks, one sequence (``spec.attention_fp8``'s numerics): q [T, Hq, 64],
    k / v [q_offset + T, Hkv, 64] bf16 (q_offset > 0: a later prompt chunk, q's rows at key positions
    q_offset.. after the cached keys; ``spec.attention_fp8(q_offset=)``), out [T, Hq, 64] bf16 whose [H, D]
    part is contiguous per row (checked by ``attention_prefill``, which calls this). Q, K, V quantized
    here (``fp8_operands``: on the GPU the fused kernels of kernels/attn_quant.py, 0.66 ms at 128000
    tokens on the H200 against 9.4 ms for the torch ops they replace and ~220 ms of attention). Options:
    pairs (128 keys a step), ones (its row sum by the tensor core; the spec's row_sum="p8"; without it, or
    without pairs, row_sum="p"), stages,
    exp_fma (1 / 2: a quarter / half of the unmasked steps' 2^x on the FMA pipes: 8% / 20% slower on the H200),
    turns (0 / 1 / 2 / 3: the warpgroups take turns at the exponentials: never, of both blocks, of the first
    block (the default with pairs: 1.5-3% faster than none on the H200), of its first half), pair_release (one
    release of a step's two ring stages: the default with pairs and an even ring). Measurement only (never taken by
    a model run): probe ("mma": P = the scaled scores, no max or 2^x, no turns; "softmax": no MMA, the scores
    taken from the output tile; "nosum": the row-sum MMAs skipped: wrong values, for time and power), trace (int32
    [programs, 3, steps + 1, 8]: the SM clock at eight points of each step of head 0's programs, ``_stamp``;
    benchmarks/attn_trace.py; any form, exp_lin's too, whose bounds have a pointer of their own). rope = (cos,
    sin): q not yet rotated, rotated in its quantization's pass
    (``fp8_operands``: the rotated bf16 q is never written). q_in_registers (opt-in, built without a GPU in the
    twenty-eighth session, unmeasured): each warpgroup's Q tile loaded into registers once, QK^T's A operand
    from there (the bf16 kernel's 3% win), not re-read from shared memory by every QK^T wgmma. lane_max (opt-in,
    thirty-third session, unmeasured): a 128-key step's row max reduced across the quad's lanes once, not once a
    block (``_lane_max``: each block's maxima folded and scaled within the threads; max and a positive factor's
    rounding commute, so m is the same bit for bit): 4 shuffles and 4 FMNMX fewer a thread and step. s16 (measurement
    only, thirty-sixth session): QK^T accumulated in f16 (the wgmma's .f16 form, Q quantized to ``S16_Q_MAX`` so no
    sum overflows) and the unmasked steps' scale, shift and 2^x on f16 pairs (``_fp8_softmax2``): a step's SASS 423
    -> 401 instructions a warp (FFMA 100 -> 36, FMNMX 74 -> 14; 32 HFMA2, 30 packed max, 36 PRMT joining the
    MUFU's f16 halves), yet 7-9% slower on the H100 (14.0 -> 15.2 ms at 32768, 212 -> 227 ms at 128000,
    benchmarks/attn_variants.py fp8-s16); within ``spec.attention_fp8(q_max=S16_Q_MAX)``'s tolerance. q_fused (opt-in,
    thirty-ninth session, built without a GPU): no Q quantization launch; each consumer warpgroup quantizes its own
    64-row Q tile from q's bf16 rows (rotated first with a rope) into the shared memory the producer's TMA would have
    filled (``_quantize_q_tile``: attn_quant's bytes and scale): q's bf16 rows read once, by the kernel, instead of
    read, written as e4m3 and read again (~0.27 GB a full layer at 32768 tokens); q bf16 with its heads' D
    contiguous; not with s16. q_scale (fp32 [Hq, ceil(T / 64)]): q is e4m3 already, rotated and quantized by
    ``attn_quant.quantize_qk``'s rules (the q / k / v GEMM's epilogue, ``fp8_gemm.fp8_gemm_q8``), these its scales; no
    rope, q_fused or s16. quant_out (opt-in, forty-third session; with pairs, an even number of query heads a KV head,
    head_dim 64; no probe, trace, q_fused or s16): returns o_proj's input quantization instead of out, ``act_quant``
    of out's rows viewed [T, Hq * 64] (e4m3 [T, Hq * 64], scales fp32 [T, Hq * 64 / 128], the same bytes): each
    program holds two heads (one 128-column group) and makes a pass over the keys for each (``_fp8_consume``'s
    QOUT), so the bf16 rows are neither written nor read again (out unused). two_heads (measurement only, with
    quant_out's conditions, not quant_out): the same two heads a program, each head's bf16 rows into out as without
    it, nothing quantized: what the program structure alone costs. exp_lin (opt-in, forty-fifth session; 1 to 6 or 8, with
    pairs and ones; ``spec.attention_fp8(p_code="lin")``'s numerics, not the default's): no 2^x; each P * 256 is the
    e4m3 byte whose bits are round(8 (x - m + 8) + 56) clamped at 0 (x the score, m the running max, log2 units):
    2^x's exponent exact, its 3 mantissa bits read linearly from x's fraction (Schraudolph's trick in e4m3; at most
    6.1% above 2^x before the rounding, mostly cancelled by the row sum of the same codes); one FFMA puts the code in
    the low bits of a float (``_lin_bias``), and ``_lin_e4m3`` clamps and packs them: 1 as 32-bit integers, 2 as
    16-bit halves (one packed max for two), clamped as floats first in the steps whose scores' bound could let a
    code reach -32768 (``_fp8_pairs``; the same bytes either way). No turns by default (no MUFU; 1 at most: 2 and 3
    pass the turn on after a 2^x). 3 (measurement, forty-fifth session, not yet run on a GPU): 2 with the bound from
    row norms, |q8 . k8| <= |q8| |k8| (each Q tile's largest, by its consumers; each key block's, ``key_norms`` here):
    on the trained fixture the amax bound of 2 was ~20x the scores' real spread, so every step took the float clamp.
    4 (forty-sixth session): the codes against the running max first, no fp32 row max: their row maxima on the packed
    16-bit codes (as code + 32768, unsigned), m raised from them and the accumulators rescaled only in the steps where
    a code passes 126 (``_lin_cmax``; one uniform branch a step, a warpgroup's flag reduced across its warps); 5: 4
    with 3's bound from row norms (K's from its quantization pass, ``attn_quant.quantize_qk(norms=True)``); 6 (fifty-first
    session): 5 with a fast step whose codes are all <= 0 for the warpgroup (P8 = 0, its products zeros) skipping its
    PV and row-sum MMAs (``_lin_products``), the same bytes as 5: one compare and branch a step more (H100, 128000
    tokens: 5% slower than 5 where no step is dead, 13% faster on Q / K at a trained model's amax); 8 (fifty-fourth
    session): 5 with the fast step's rescale made every step by d = 0 where none is needed (``_lin_cmax``'s NOBRANCH:
    no warpgroup-wide maximum and branch a step; 362 SASS instructions an unmasked step against ~334 on 5's usual path,
    the scale fused into the PV adds), the same bytes as 5, 2-3% faster whole models (H100): the default. All of them
    compute ``spec.attention_fp8(p_code="lin")`` (m = ceil(max - 3/4); 4 / 5 keep m one lower where a row's max lies 3/4
    to 13/16 above it: the same P up to the factor the row sum cancels)."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    assert d == HEAD_DIM and hq % hkv == 0, f"q {tuple(q.shape)}, k {tuple(k.shape)}"
    assert q_offset >= 0 and k.shape[0] == v.shape[0] == q_offset + T, (
        f"q_offset {q_offset}: k {tuple(k.shape)} / v {tuple(v.shape)} need q_offset + T = {q_offset + T} rows")
    assert not q_offset or trace is None, "trace: one sequence from position 0 (its stamps pick rows by position)"
    ones = ones and pairs  # (the row sum by the tensor core is built for the 128-key step)
    assert exp_fma in (0, 1, 2) and (exp_fma == 0 or pairs), f"exp_fma {exp_fma}: 0, 1 or 2 (with pairs)"
    assert stages >= 2 or not pairs, f"stages {stages}: a 128-key step holds two key blocks"
    assert probe in (None, "mma", "softmax", "nosum") and (probe is None or pairs), (
        f"probe {probe!r}: None, 'mma', 'softmax' or 'nosum'")
    assert exp_lin in (0, 1, 2, 3, 4, 5, 6, 8) and (not exp_lin or (ones and exp_fma == 0 and not s16 and probe is None)), (
        f"exp_lin {exp_lin}: 0 to 6 or 8; with pairs and ones, no exp_fma, s16 or probe")
    turns = (2 if pairs and probe != "mma" and not exp_lin else 0) if turns is None else turns
    assert not exp_lin or turns in (0, 1), f"exp_lin: turns 0 or 1 (no 2^x to pass a turn after), not {turns}"
    pair_release = (pairs and stages % 2 == 0) if pair_release is None else pair_release
    assert turns in (0, 1, 2, 3) and (turns == 0 or pairs), f"turns {turns}: 0, 1, 2 or 3 (with pairs)"
    assert probe != "mma" or turns == 0, "probe='mma' takes no turns (its steps skip the exponentials they ring)"
    assert not pair_release or (pairs and stages % 2 == 0), "pair_release: with pairs and an even ring"
    pair_ready = pair_release if pair_ready is None else pair_ready
    assert not pair_ready or pair_release, "pair_ready: with pair_release"
    assert not q_in_registers or pairs, "q_in_registers: with pairs (one block a step spills with it)"
    assert not lane_max or pairs, "lane_max: with pairs (one block a step reduces each block's maxima once anyway)"
    assert not s16 or (ones and exp_fma == 0 and probe is None and not lane_max), (
        "s16: with pairs and ones, no exp_fma, probe or lane_max")
    assert not q_fused or (not s16 and q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == d), (
        f"q_fused: bf16 q with contiguous heads, not with s16 (q {q.dtype}, strides {q.stride()})")
    assert q_scale is None or (rope is None and not q_fused and not s16 and q.dtype == torch.float8_e4m3fn), (
        f"q_scale: an e4m3 q ({q.dtype}), no rope, q_fused or s16")
    assert exp_lin < 5 or not q_fused, f"exp_lin {exp_lin}: not with q_fused (its bound wants the Q tiles' norms first)"
    q8, sq, k8, sk, vt, svs, kn, qn = fp8_operands(
        q, k, v, sm_scale, rope, q_offset, S16_Q_MAX if s16 else FP8_MAX, with_q=not q_fused and q_scale is None,
        k_norms=exp_lin in (3, 5, 6, 8), q_norms=exp_lin >= 5 and q_scale is None)
    if q_scale is not None:  # (fp8_operands' sq: the scales times sm_scale * log2 e)
        q8, sq = q, (q_scale * (sm_scale * LOG2E)).contiguous()
        if exp_lin >= 5:
            qn = key_norms(q8)
    # (exp_lin 3: the K norms K's quantization pass wrote; 5 / 6: the Q tiles' bounds; bound_ptr)
    norms = lin_bounds(sq, qn, sk, kn) if exp_lin >= 5 else kn
    fused = {}
    if q_fused:  # (a 64-row e4m3 stand-in gives the Q tiles' type; sk stands in for the unread Q scales)
        q8, sq = torch.empty((WG_ROWS, hq, d), dtype=k8.dtype, device=q.device), sk
        cos, sin = rope if rope is not None else (sinks, sinks)
        fused = dict(q_ptr=q, cos_ptr=cos, sin_ptr=sin, stride_qt=q.stride(0), qk_scale=sm_scale * LOG2E, QB16=True,
                     **({"ROPE": True} if rope is not None else {}))
    num_pid_m = cdiv(T, NWG * WG_ROWS)
    qout, xq, xs = {}, None, None
    assert quant_out or out is not None, "out: the bf16 rows' tensor (None only with quant_out)"
    if quant_out or two_heads:
        assert pairs and hq % 2 == 0 and (hq // hkv) % 2 == 0 and 2 * d == ACT_GROUP, (
            f"quant_out: pairs, two query heads of one KV head a 128-column group (Hq {hq}, Hkv {hkv}, D {d})")
        assert probe is None and trace is None and not q_fused and not s16, "quant_out: no probe, trace, q_fused or s16"
        xq = torch.empty((T, hq * d), dtype=k8.dtype, device=q.device)
        xs = torch.empty((T, hq * d // ACT_GROUP), dtype=torch.float32, device=q.device)
        qout = dict(xq_desc=descriptor(xq, [WG_ROWS, d]), xs_ptr=xs, stride_xs=xs.stride(0), QOUT=2 if two_heads else 1)
        if two_heads:
            assert not quant_out and out is not None, "two_heads: the bf16 rows into out (not with quant_out)"
    _ws_attention_fp8_kernel[(hq // 2 if qout else hq, num_pid_m)](
        descriptor(_rows2d(q8), [WG_ROWS, d]), descriptor(_rows2d(k8), [BLOCK_N, d]), descriptor(vt, [d, BLOCK_N]),
        descriptor(_rows2d(out if out is not None else q.new_empty((WG_ROWS, hq, d), dtype=torch.bfloat16)),
                   [WG_ROWS, d]), sinks, sq, sk, svs, sinks if trace is None else trace,
        norms if norms is not None else sinks, T, num_pid_m,
        sq.shape[1], sk.shape[1], q_offset,
        GROUP=hq // hkv, STAGES=stages, PAIRS=pairs, ONES=ones, FMA=2 + exp_lin if exp_lin else exp_fma, TURN=turns,
        REL=int(pair_release) + int(pair_ready),
        TRACE=0 if trace is None else trace.shape[-2],
        PROBE={None: 0, "mma": 1, "softmax": 2, "nosum": 3}[probe],
        num_warps=4, **({"QREG": True} if q_in_registers else {}), **({"OFFSET": True} if q_offset else {}),
        **({"LMAX": True} if lane_max else {}), **({"S16": True} if s16 else {}), **fused, **qout,
    )
    return (xq, xs) if quant_out else out


assert WG_ROWS == BLOCK_N == QK_BLOCK, "one Q scale per warpgroup and one K scale per key block"

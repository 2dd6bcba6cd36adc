"""Prefill attention with learned sinks, causal or sliding-window, GQA, ragged batches (Triton).

Semantics (OpenAI's ``gpt_oss.torch.model.sdpa``): per query head h a learned logit ``sinks[h]`` is
appended to every softmax row as an extra column that carries no value; ``sm_scale = 1/sqrt(d)``;
key j is visible to query i iff ``j <= i`` and, on sliding layers, ``i - window < j``.

Layout (packed tokens, as a ragged batch through ``cu_seqlens``):
    q    [T, Hq, D]  bf16    (rows of sequence b are cu_seqlens[b] .. cu_seqlens[b+1]-1)
    k, v [T, Hkv, D] bf16    (Hq % Hkv == 0; query head h reads kv head h // (Hq // Hkv))
    sinks [Hq]       any float dtype (read as fp32)
    out  [T, Hq, D]  bf16
Positions restart at 0 for each sequence (self-attention over the whole sequence). One sequence
may also be a later prompt chunk (``q_offset`` > 0, cu_seqlens None): q's T rows sit at positions
q_offset.. and k / v hold q_offset + T rows (the cached keys, then the chunk's); the masks and key
ranges then use query position q_offset + row (``spec.attention``'s q_offset). Decode-shaped
calls (a few new queries against a KV cache) live in ``attention_decode.py``.

The kernel: one program per (query head, block of BLOCK_M queries, sequence). The online softmax
runs in base 2 with fp32 state; its running max starts at the sink (m = sink, l = 1), so the sink is
counted exactly once and a row whose keys are all masked stays finite. KV blocks are visited in up to
three phases: window-edge blocks (masked), blocks every query of the tile sees in full (no mask),
and the diagonal blocks (causal mask); blocks that no query of the tile can see are never loaded.
Query blocks are issued longest-first (causal load balance) and heads vary fastest in the grid, so
the Hq / Hkv programs that share a KV head run side by side and share its tiles through L2.

With ``PrefillTile.pack = p`` a program takes p query heads of one KV head for BLOCK_M / p
positions, stacked in the tile's rows (tile row r: position m0 + r % (BLOCK_M / p), head
p * pid + r // (BLOCK_M / p)); the K/V tiles it loads then serve p heads. The window default packs 2.

Several sequences' chunks after their cached keys run in one launch (``k_starts`` / ``q_offsets`` with
cu_seqlens: sequence b's keys are rows k_starts[b].. of k / v, e.g. a KV cache's [batch * rows] view,
and its queries sit at key positions q_offsets[b]..; the serving engine's prompts of one step,
model/gptoss.py ``prefill_many``).

On sm_90, one-sequence causal calls with head_dim 64 and no q_offset go to the warp-specialized
Gluon kernel of attention_ws.py (same semantics and arithmetic; ``KernelConfig.attention_gluon``
and its tile); a later chunk (q_offset > 0) runs the Triton kernel unless its Gluon option is on
(``attention_gluon_offset``), and so do chunks after cached keys (``attention_gluon_segments``); ragged batches
always run the Triton kernel.
Tiles: ``KernelConfig.prefill_tile`` (kernels/config.py) unless a ``tile`` is given.

FP8 (``fp8=True``, ``--attention fp8``; reference ``spec.attention_fp8_varlen``): the launcher
quantizes with quant/attn_fp8.py's roundings (Q, K e4m3 per 64 packed rows per head, V e4m3 per
(head, channel), written transposed [Hkv, D, T] so the P V product's B operand is K-major; on CUDA
in one pass by kernels/attn_quant.py, on CPU by quant/attn_fp8.py's torch ops); both
dots take e4m3 operands with fp32 accumulation (the block scales multiply the scores; V's channel
scale the output), P is rounded as e4m3(P * 256) against an integral running max (exact
power-of-two rescaling: the spec's roundings), the row sum is of that e4m3 P, and each block's P V
is summed in a fresh fp32 accumulator before it joins acc (Hopper's FP8 MMA accumulates with fewer
bits). One causal sequence on sm_90 runs the Gluon e4m3 kernel (attention_ws_fp8.py); windows,
ragged batches and later chunks this Triton kernel, and so do several sequences' chunks after their cached keys
(``k_starts`` / ``q_offsets`` with ``fp8_plan``, attn_quant.SegmentPlan: each chunk quantized in 64-row / 64-key
blocks from its own first row / key, V's scales over its own keys, as ``spec.attention_fp8`` of the chunk alone).
With ``rope``, q is rotated in its quantization's pass (one sequence on the GPU: kernels/attn_quant.py; else
kernels/rope.py first, the same bits). The interpreter casts fp32 -> e4m3 wrongly where the rounding carries into
the exponent (31.94 -> 16): there P's rounding is done arithmetically.

Options: ``rope=(cos, sin)`` rotates q inside the kernel (YaRN, see ``rope.py``; k comes rotated).
In the Triton interpreter (CPU) bf16 arithmetic is wrong, so the kernel upcasts tiles to fp32 after
loading there (``UPCAST``); on the GPU the dots take bf16. Reference: ``spec.attention_varlen``
(fp32). Not done here: a KV cache (attention_decode.py), head_dim outside 16..256, dropout, bias.
(K/V through Hopper tensor descriptors lost to cp.async pointer loads at every tile tried,
notes/kernels_attention.md, and was removed.)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels import attn_quant
from gptoss_fp8.kernels.act_quant import act_quant, bf16_round, e4m3_saturated, group_scale
from gptoss_fp8.kernels.config import DEFAULT, KernelConfig, PrefillTile
from gptoss_fp8.kernels.rope import rotate
from gptoss_fp8.quant import attn_fp8
from gptoss_fp8.quant.attn_fp8 import P_SCALE, QK_BLOCK
from gptoss_fp8.quant.fp8 import ACT_EPS, ACT_GROUP, FP8_DTYPE, FP8_MAX, cdiv

LOG2E = 1.4426950408889634


@triton.jit
def _attn_inner(
    acc, l_i, m_i, q,
    K, V,  # pointers at (sequence start, kv head)
    stride_kt, stride_vt,
    offs_m, offs_n, offs_d,  # offs_m: the tile rows' query positions (q_offset + row)
    seqlen, window, qk_scale,  # seqlen: the keys of the sequence (q_offset + its query rows)
    lo, hi,
    MASK: tl.constexpr,  # False: every key of every block visible; True: causal + window + bounds
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    sq=None, SK=None, kbase=0, stride_vd=1,  # FP8: q's row scales (times qk_scale), K's block scales of
    FP8: tl.constexpr = False,                # the kv head, the sequence's first packed row, V^T's D stride
):                                            # (FP8 2: P's codes read linearly, p_code "lin")
    if FP8:
        acc, l_i, m_i = _attn_inner_fp8(acc, l_i, m_i, q, sq, K, SK, kbase, V, stride_kt, stride_vd, offs_m, offs_n,
                                        offs_d, seqlen, window, lo, hi, MASK, BLOCK_N, UPCAST, FP8 == 2)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            cols = start_n + offs_n  # [BLOCK_N] key positions in the sequence
            if MASK:
                kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None], mask=cols[None, :] < seqlen, other=0.0)
            else:
                kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None])
            if UPCAST:
                kt = kt.to(tl.float32)
            qk = tl.dot(q, kt)  # [BLOCK_M, BLOCK_N] raw scores
            # Scores go to log2 units (times sm_scale * log2 e). m_i >= sink > -inf, so exp2 never
            # sees -inf - -inf, also for rows whose keys in this block are all masked.
            if MASK:
                rel = offs_m[:, None] - cols[None, :]  # query pos - key pos
                visible = (rel >= 0) & (rel < window)
                qk = qk * qk_scale + tl.where(visible, 0.0, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                qk = qk - m_new[:, None]
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                qk = qk * qk_scale - m_new[:, None]  # one FMA per score
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if MASK:
                v = tl.load(V + cols[:, None] * stride_vt + offs_d[None, :], mask=cols[:, None] < seqlen, other=0.0)
            else:
                v = tl.load(V + cols[:, None] * stride_vt + offs_d[None, :])
            if UPCAST:
                acc = tl.dot(p, v.to(tl.float32), acc)
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _e4m3_round_nonneg(x):
    """fp32 x in [0, 448] rounded to the nearest e4m3 value (ties to even), as fp32: the ulp is
    2^(e - 3) for x in [2^e, 2^(e+1)), e >= -6 (2^-9 below 2^-6, the subnormals); x / ulp < 16
    is rounded by the 1.5 * 2^23 trick (exact in fp32). The row sum's values; the interpreter's P too."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    return ((x / ulp + magic) - magic) * ulp


@triton.jit
def _attn_inner_fp8(
    acc, l_i, m_i, q, sq,
    K, SK, kbase, VT,  # K / VT at (sequence start, kv head); SK: K's block scales of the kv head, by packed row // 64
    stride_kt, stride_vd,
    offs_m, offs_n, offs_d,
    seqlen, window,
    lo, hi,
    MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    LIN: tl.constexpr = False,
):
    """``_attn_inner`` on e4m3 operands, spec.attention_fp8's roundings: scores = (Q8 K8^T) * sq * sk
    in log2 units; the running max is kept an integer (ceil), so rescaling by alpha is an exact
    power of two and e4m3(P * 256) rounds as in the spec's final frame; the row sum of that e4m3 P;
    PV as e4m3 x e4m3 with a fresh fp32 accumulator per block (Hopper's FP8 MMA accumulates
    imprecisely), added to acc. LIN (``p_code="lin"``, quant/attn_fp8.py ``lin_e4m3``): no 2^x, P's e4m3
    byte round(8 (x - m) + 120) clamped at 0, made in the low bits of a float (1.5 * 2^23 added), against m =
    ceil(max - 3/4) (codes up to 126, e4m3's 448)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASK:
            kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None], mask=cols[None, :] < seqlen, other=0.0)
            sk = tl.load(SK + (kbase + cols) // 64, mask=cols < seqlen, other=0.0)
        else:
            kt = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None])
            sk = tl.load(SK + (kbase + cols) // 64)
        if UPCAST:
            qk = tl.dot(q.to(tl.float32), kt.to(tl.float32))
        elif q.shape[1] < 32:  # e4m3 MMAs take K >= 32: a short head dim in fp16 (e4m3 values are fp16 values)
            qk = tl.dot(q.to(tl.float16), kt.to(tl.float16))
        else:
            qk = tl.dot(q, kt)
        qk = qk * sq[:, None] * sk[None, :]
        if MASK:
            rel = offs_m[:, None] - cols[None, :]
            visible = (rel >= 0) & (rel < window)
            qk = qk + tl.where(visible, 0.0, float("-inf"))
        if LIN:  # (m = ceil(max - 3/4): the codes up to 126, e4m3's 448)
            m_new = tl.maximum(m_i, tl.math.ceil(tl.max(qk, 1) - 0.75))
        else:
            m_new = tl.maximum(m_i, tl.math.ceil(tl.max(qk, 1)))
        alpha = tl.math.exp2(m_i - m_new)
        if LIN:  # (-inf: the clamp's 1.5 * 2^23, code 0)
            y = tl.maximum(qk * 8.0 + (12582912.0 + 120.0 - 8.0 * m_new)[:, None], 12582912.0)
            p8 = (y.to(tl.int32, bitcast=True) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            p8f = p8.to(tl.float32)
            if UPCAST:
                p8 = p8f
        else:
            p = tl.math.exp2(qk - m_new[:, None])
            # the row sum of the e4m3 P (the spec's), its values rounded in fp32 (not the cast's bytes
            # converted back, which the compiler may fold into the fp32 P)
            p8f = _e4m3_round_nonneg(p * 256.0)
            if UPCAST:  # the interpreter's fp32 -> e4m3 cast is wrong where rounding carries into the exponent
                p8 = p8f
            else:
                p8 = (p * 256.0).to(tl.float8e4nv)
        l_i = l_i * alpha + tl.sum(p8f, 1) * 0.00390625
        if MASK:
            v = tl.load(VT + cols[:, None] + offs_d[None, :] * stride_vd, mask=cols[:, None] < seqlen, other=0.0)
        else:
            v = tl.load(VT + cols[:, None] + offs_d[None, :] * stride_vd)
        if UPCAST:
            pv = tl.dot(p8, v.to(tl.float32))
        else:
            pv = tl.dot(p8, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_prefill_kernel(
    Q, K, V, Sinks, Out, CuSeqlens, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,  # sm_scale * log2(e)
    window,  # keys i - window < j <= i are visible; a huge value means plain causal
    num_pid_m,
    total_tokens,  # T: the one sequence's query rows when not RAGGED
    q_offset,  # not RAGGED: query row r sits at key position q_offset + r (K / V hold q_offset + T rows); else 0
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: bf16 arithmetic is wrong there, compute in fp32
    ROPE_Q: tl.constexpr,  # rotate q in-kernel with the Cos/Sin tables [max_pos, HEAD_DIM/2]
    RAGGED: tl.constexpr,  # sequences from CuSeqlens; False: one sequence of total_tokens rows
    PACK: tl.constexpr = 1,  # query heads per program (same KV head): BLOCK_M // PACK positions each
    # FP8 (quant/attn_fp8.py): Q, K e4m3 with block scales Sq [Hq, nb] (times qk_scale), Sk [Hkv, nb];
    # V is V^T e4m3 [Hkv, D, T] (stride_vt = 1, stride_vd its D stride) with channel scales Sv [Hkv, D] / 256.
    Sq=None, Sk=None, Sv=None, stride_sqh=0, stride_skh=0, stride_vd=1,
    FP8: tl.constexpr = False,
    # SEGMENTS (RAGGED): sequence b's keys are rows KStarts[b].. of K / V (not its query rows) and its
    # query rows sit at key positions QOffsets[b].. (prompt chunks after cached keys, one launch)
    KStarts=None, QOffsets=None,
    SEGMENTS: tl.constexpr = False,
    # FP8 + SEGMENTS (attn_quant.SegmentPlan): each chunk's Q scales from column QScaleBase[b] of Sq, its keys packed
    # from KStarts[b] (a multiple of 64: its K scales from column KStarts[b] / 64), its V scales Sv[b] [Hkv, D]
    QScaleBase=None, SV_STRIDE_B: tl.constexpr = 0,
    # QUANT_OUT: the output's FP8 quantization (act_quant's 1x128 groups of the bf16 rows, its arithmetic) into
    # OutQ [T, Hq * D] e4m3 / OutS [T, Hq * D / 128] fp32 instead of the bf16 rows: 128 / HEAD_DIM heads a group,
    # which PACK must hold whole (o_proj's input, written once)
    OutQ=None, OutS=None, stride_oq=0, stride_os=0,
    QUANT_OUT: tl.constexpr = False, FP8_MAX_C: tl.constexpr = 448.0, EPS: tl.constexpr = 1e-10,
    ONE_LOOP: tl.constexpr = False,  # PrefillTile.one_loop
):
    QB: tl.constexpr = BLOCK_M // PACK  # query positions per program
    pid_h = tl.program_id(0)  # heads pid_h * PACK .. pid_h * PACK + PACK - 1
    if SEGMENTS:  # the query blocks slowest: every sequence's last (longest) blocks first, whatever its order
        pid_m = num_pid_m - 1 - tl.program_id(2)
        pid_b = tl.program_id(1)
    else:
        pid_m = num_pid_m - 1 - tl.program_id(1)  # longest query blocks first
        pid_b = tl.program_id(2)
    if RAGGED:
        seq_start = tl.load(CuSeqlens + pid_b)
        seqlen = tl.load(CuSeqlens + pid_b + 1) - seq_start
        if SEGMENTS:
            k_start = tl.load(KStarts + pid_b)
            q_offset = tl.load(QOffsets + pid_b)
        else:
            k_start = seq_start
    else:  # one sequence of all T rows: no cu_seqlens tensor (building one per call would sync)
        seq_start = 0
        k_start = 0
        seqlen = total_tokens
    seqlen_k = seqlen + q_offset  # keys: the q_offset before the query rows, then theirs
    # Row offsets of the sequence in int64 (T * H * D, a cache's rows * H * D, can pass 2^31); offsets
    # inside it stay int32.
    row0 = tl.full([], seq_start, tl.int64)
    krow0 = tl.full([], k_start, tl.int64)
    m0 = pid_m * QB
    if m0 >= seqlen:
        return
    kv_h = (pid_h * PACK) // GROUP

    # Tile row r: query row m0 + r % QB of head pid_h * PACK + r // QB (heads stacked), at key
    # position q_offset + that row (pos_m: what the masks and the key ranges use).
    rows = tl.arange(0, BLOCK_M)
    if PACK == 1:
        offs_m = m0 + rows
        head = pid_h
    else:
        offs_m = m0 + rows % QB
        head = pid_h * PACK + rows // QB
    pos_m = offs_m + q_offset
    p0 = m0 + q_offset  # the tile's first query position
    head_off = head * stride_qh
    if PACK > 1:
        head_off = head_off[:, None]
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen

    if ROPE_Q:
        # YaRN rotary on q in registers (positions q_offset.. of each sequence), rounded to q's dtype once,
        # as the separate kernel's store would: saves that kernel's pass over q (8x k's bytes).
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_j = tl.arange(0, HALF)
        q_row = Q + row0 * stride_qt + offs_m[:, None] * stride_qt + head_off + offs_j[None, :]
        x1 = tl.load(q_row, mask=row_ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(q_row + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
        cs = pos_m[:, None] * HALF + offs_j[None, :]
        c = tl.load(Cos + cs, mask=row_ok[:, None], other=0.0)
        s = tl.load(Sin + cs, mask=row_ok[:, None], other=0.0)
        o1, o2 = rotate(x1, x2, c, s)
        q = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_M, HEAD_DIM))
        q = q.to(Q.dtype.element_ty)  # on every device: the rotated q of the unfused rope + this kernel
        if UPCAST:
            q = q.to(tl.float32)
    else:
        q_ptrs = Q + row0 * stride_qt + offs_m[:, None] * stride_qt + head_off + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        if UPCAST and not FP8:
            q = q.to(tl.float32)
    k_src = K + krow0 * stride_kt + kv_h * stride_kh
    v_src = V + krow0 * stride_vt + kv_h * stride_vh
    if FP8:
        if SEGMENTS:  # the chunk's own 64-row blocks from its first row
            sq = tl.load(Sq + head * stride_sqh + tl.load(QScaleBase + pid_b) + offs_m // 64, mask=row_ok, other=0.0)
        else:
            sq = tl.load(Sq + head * stride_sqh + (row0 + offs_m) // 64, mask=row_ok, other=0.0)
        sk_src = Sk + kv_h * stride_skh
    else:
        sq = row0  # unused
        sk_src = Sk  # unused

    sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # scalar, or [BLOCK_M] when packed
    if FP8:  # an integral running max from the start: l counts the sink as exp2(sink - ceil(sink))
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.math.ceil(sink)
        l_i = tl.math.exp2(sink - m_i)
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Key ranges, by position (q_offset 0: QB is a multiple of BLOCK_N, so diag_lo = p0 = m0):
    #   [lo, full_lo):      seen by some queries of the tile only (window edge)   -> masked
    #   [full_lo, diag_lo): seen by every query of the tile                       -> unmasked
    #   [diag_lo, hi):      the diagonal (from p0's block)                        -> masked
    hi = tl.minimum(p0 + QB, seqlen_k)
    diag_lo = (p0 // BLOCK_N) * BLOCK_N  # keys below it are <= p0 - 1: causally seen by every row
    first_key = tl.maximum(p0 - window + 1, 0)  # oldest key the tile's first query sees
    lo = (first_key // BLOCK_N) * BLOCK_N
    full_first = tl.maximum(p0 + QB - window, 0)  # oldest key the tile's last query sees
    full_lo = tl.minimum(tl.cdiv(full_first, BLOCK_N) * BLOCK_N, diag_lo)
    if ONE_LOOP:  # every block masked, one loop: the pipeliner's stages span the whole (short) key range
        acc, l_i, m_i = _attn_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pos_m, offs_n, offs_d,
            seqlen_k, window, qk_scale, lo, hi, True, BLOCK_N, UPCAST, sq, sk_src, krow0, stride_vd, FP8,
        )
    else:
        acc, l_i, m_i = _attn_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pos_m, offs_n, offs_d,
            seqlen_k, window, qk_scale, lo, full_lo, True, BLOCK_N, UPCAST, sq, sk_src, krow0, stride_vd, FP8,
        )
        acc, l_i, m_i = _attn_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pos_m, offs_n, offs_d,
            seqlen_k, window, qk_scale, full_lo, diag_lo, False, BLOCK_N, UPCAST, sq, sk_src, krow0, stride_vd, FP8,
        )
        acc, l_i, m_i = _attn_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pos_m, offs_n, offs_d,
            seqlen_k, window, qk_scale, diag_lo, hi, True, BLOCK_N, UPCAST, sq, sk_src, krow0, stride_vd, FP8,
        )

    if FP8:  # V's channel scale / 256 (P's fixed scale), then the row sum (spec.attention_fp8's order)
        if SEGMENTS:
            acc = acc * tl.load(Sv + pid_b * SV_STRIDE_B + kv_h * HEAD_DIM + offs_d)[None, :]
        else:
            acc = acc * tl.load(Sv + kv_h * HEAD_DIM + offs_d)[None, :]
    out = acc / l_i[:, None]
    if QUANT_OUT:
        # act_quant of the bf16 rows the store below would write: each 128-column group of an output row is
        # GH heads of one position, rows h * QB + i of the tile (h in the group's heads): each row's maximum, then
        # the group's over its GH rows (only [BLOCK_M] vectors reshaped, not the tile)
        GH: tl.constexpr = 128 // HEAD_DIM
        NG: tl.constexpr = PACK // GH
        if Out.dtype.element_ty == tl.bfloat16:
            y = bf16_round(out)  # (the same values, no F2F a value on the XU pipe)
        else:
            y = out.to(Out.dtype.element_ty).to(tl.float32)
        scale = group_scale(tl.max(tl.reshape(tl.max(tl.abs(y), axis=1), (NG, GH, QB)), axis=1), FP8_MAX_C, EPS)
        row_scale = tl.reshape(tl.broadcast_to(tl.expand_dims(scale, 1), (NG, GH, QB)), (BLOCK_M,))
        q8 = e4m3_saturated(y / row_scale[:, None], FP8_MAX_C)
        q_head = head * HEAD_DIM
        if PACK > 1:
            q_head = q_head[:, None]
        q_ptrs = OutQ + row0 * stride_oq + offs_m[:, None] * stride_oq + q_head + offs_d[None, :]
        tl.store(q_ptrs, q8.to(OutQ.dtype.element_ty), mask=row_ok[:, None])
        pos = m0 + tl.arange(0, QB)
        grp = (pid_h * PACK) // GH + tl.arange(0, NG)
        tl.store(OutS + row0 * stride_os + pos[None, :] * stride_os + grp[:, None], scale,
                 mask=(pos < seqlen)[None, :])
    else:
        o_head = head * stride_oh
        if PACK > 1:
            o_head = o_head[:, None]
        o_ptrs = Out + row0 * stride_ot + offs_m[:, None] * stride_ot + o_head + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


_NO_WINDOW = 1 << 30


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    sliding_window: int = 0,
    sm_scale: float | None = None,
    config: KernelConfig | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    tile: PrefillTile | None = None,
    fp8: bool = False,
    p_code: str = "e4m3",
    q_offset: int = 0,
    k_starts: torch.Tensor | None = None,
    q_offsets: torch.Tensor | None = None,
    fp8_plan: attn_quant.SegmentPlan | None = None,
    quant_out: bool = False,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal (or sliding-window) attention with sinks over a ragged batch of packed sequences.

    q [T, Hq, D] bf16, k/v [T, Hkv, D] bf16 (last dim contiguous), sinks [Hq];
    cu_seqlens int32 [B+1] (None: one sequence of T tokens); max_seqlen: the longest sequence
    (None: read from cu_seqlens, which syncs). sliding_window 0 = full causal.
    ``config``: the tuning (None: kernels/config.DEFAULT); ``tile``: this Triton launch instead of
    the config's choice (and never the Gluon kernel). ``fp8``: Q, K, V quantized to e4m3 here
    (quant/attn_fp8.py, torch ops) and both products on e4m3 operands, P as e4m3(P * 256): the
    numerics of ``spec.attention_fp8_varlen`` (a rope rotates q in its quantization; one causal sequence on sm_90 runs the Gluon
    e4m3 kernel, kernels/attention_ws_fp8.py, unless ``config.attention_gluon_fp8`` is off). ``p_code`` (with
    ``fp8``): "e4m3" (P as above) or "lin" (``spec.attention_fp8(p_code="lin")``: P's e4m3 codes made from the
    scores without 2^x, the Gluon kernel's ``exp_lin``; every path here).
    ``q_offset`` > 0 (one sequence, cu_seqlens None): a prompt chunk after cached keys, q's row t at
    key position q_offset + t of k / v [q_offset + T, Hkv, D] (the keys before the chunk, then its
    own): ``spec.attention(..., q_offset=)`` (``spec.attention_fp8`` with ``fp8``); masks on absolute
    positions, fused rope at positions q_offset.., the Triton kernel (opt-in, a causal chunk on sm_90: the
    Gluon kernels, ``config.attention_gluon_offset`` / with ``fp8`` ``config.attention_gluon_fp8_offset``).
    ``k_starts`` / ``q_offsets`` (int32 [B] on q's device, with cu_seqlens and max_seqlen; bf16): several
    sequences' chunks after their cached keys in one launch (``spec.attention_varlen``'s contract):
    sequence b's query rows at key positions q_offsets[b].., its keys rows k_starts[b] ..
    k_starts[b] + q_offsets[b] + n_b - 1 of k / v, which may hold any number of rows (a KV cache's
    [batch * rows, Hkv, D] view); the caller keeps those rows inside k / v (not read back here: no sync).
    A rope rotates q at positions q_offsets[b] + t. The Triton kernel (opt-in, full causal bf16 on sm_90: the Gluon
    kernel, ``config.attention_gluon_segments``). With ``fp8`` (q rotated, no rope) ``fp8_plan``
    (``attn_quant.SegmentPlan`` of the same chunks) quantizes each chunk's Q, keys and V as ``spec.attention_fp8`` of
    that chunk alone: each sequence's rows those of its own ``q_offset`` call.
    Returns out [T, Hq, D] bf16; with ``quant_out`` its FP8 quantization instead, ``act_quant(out.view(T, Hq *
    D))``'s (x_fp8 [T, Hq * D], scale [T, Hq * D / 128]; o_proj's input): written by the Triton kernel in place of
    the bf16 rows where its tile holds whole 128-column groups (``quant_out_fused``: head_dim 32 / 64 / 128 and
    128 / head_dim dividing the tile's heads, the window layers' pack 4), else act_quant after the kernel.
    ``q_scale`` (with ``fp8``, one sequence, no rope): q is already e4m3, rotated and quantized as this function
    would (``attn_quant.quantize_qk``'s bytes, e.g. by the q / k / v GEMM's epilogue, ``fp8_gemm.fp8_gemm_q8``), and
    q_scale its scales (fp32 [Hq, ceil(T / 64)]): the same result as the bf16 q it was made from.
    """
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q {q.shape} k {k.shape} v {v.shape}: want [T, H, D]"
    assert p_code in ("e4m3", "lin") and (fp8 or p_code == "e4m3"), f"p_code {p_code!r}: 'e4m3' or 'lin' (with fp8)"
    T, Hq, D = q.shape
    if not isinstance(q_offset, int) or q_offset < 0:
        raise GptOssFp8Error(f"attention_prefill: q_offset {q_offset!r} must be an int >= 0")
    if q_offset and cu_seqlens is not None:
        raise GptOssFp8Error(f"attention_prefill: q_offset {q_offset} takes one sequence (cu_seqlens None), "
                             f"not a ragged batch")
    segments = k_starts is not None or q_offsets is not None
    if segments:
        _check_segments(q, k, v, cu_seqlens, max_seqlen, k_starts, q_offsets, fp8, fp8_plan, rope)
    elif k.shape[0] != q_offset + T or v.shape[0] != q_offset + T:
        raise GptOssFp8Error(f"attention_prefill: k {tuple(k.shape)} / v {tuple(v.shape)} need q_offset + T = "
                             f"{q_offset} + {T} = {q_offset + T} rows (the keys before q's rows, then theirs)")
    assert k.shape == v.shape and k.shape[2] == D, f"q {q.shape} k {k.shape} v {v.shape}"
    Hkv = k.shape[1]
    assert Hq % Hkv == 0, f"{Hq} query heads not a multiple of {Hkv} kv heads"
    assert D in (16, 32, 64, 128, 256), f"head_dim {D} must be a power of two in 16..256"
    if q_scale is not None:
        assert fp8 and not segments and cu_seqlens is None and rope is None and q.dtype == FP8_DTYPE, (
            f"q_scale: an e4m3 q ({q.dtype}) with fp8, one sequence, no rope")
        assert q_scale.shape == (Hq, cdiv(T, QK_BLOCK)) and q_scale.dtype == torch.float32, (
            f"q_scale {tuple(q_scale.shape)} {q_scale.dtype}: fp32 {(Hq, cdiv(T, QK_BLOCK))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.dtype == torch.bfloat16 or (name == "q" and q_scale is not None), f"{name} dtype {t.dtype}, want bfloat16"
        assert t.stride(-1) == 1, f"{name} last dim not contiguous (strides {t.stride()})"
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    assert sinks.shape == (Hq,), f"sinks {sinks.shape}, want ({Hq},)"
    assert sinks.is_floating_point() and sinks.device == q.device
    ragged = cu_seqlens is not None
    if ragged:
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.is_contiguous(), (
            f"cu_seqlens {cu_seqlens.dtype} {cu_seqlens.shape}: want contiguous int32 [B+1]"
        )
        assert cu_seqlens.device == q.device, f"cu_seqlens on {cu_seqlens.device}, q on {q.device}"
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0
        B = cu_seqlens.numel() - 1
    else:
        B, max_seqlen = 1, T
    if B == 0 or T == 0 or max_seqlen == 0:
        return _quantized(_out(q), quant_out)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    window = sliding_window if 0 < sliding_window and (segments or sliding_window < max_seqlen + q_offset) else _NO_WINDOW
    on_gpu = q.device.type == "cuda"
    cfg = config or DEFAULT
    if (tile is None and fp8 and not segments and cfg.attention_gluon_fp8 and (not q_offset or cfg.attention_gluon_fp8_offset)
            and _ws_ok(q, k, v, ragged, window, None, cfg)):
        from gptoss_fp8.kernels.attention_ws_fp8 import ws_attention_prefill_fp8

        exp_lin = cfg.attention_exp_lin if p_code == "lin" else 0
        # (exp_lin 5 / 6 / 8's bound wants each Q tile's norm before the launch: Q quantized first there, not by the kernel)
        q_fused = (cfg.attention_fp8_q_fused and q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == D
                   and exp_lin < 5)
        # (quant_out in the kernel: two query heads of one KV head a 128-column group of o_proj's input)
        fused_out = (quant_out and cfg.attention_fp8_quant_out and not q_fused and (Hq // Hkv) % 2 == 0
                     and 2 * D == ACT_GROUP)
        # (a rope: q rotated in its quantization's pass, at positions q_offset..)
        o = ws_attention_prefill_fp8(q, k, v, sinks, None if fused_out else _out(q), sm_scale, rope=rope,
                                     q_in_registers=cfg.attention_fp8_q_registers, q_offset=q_offset,
                                     lane_max=cfg.attention_fp8_lane_max, q_fused=q_fused, q_scale=q_scale,
                                     quant_out=fused_out, exp_lin=exp_lin)
        return o if fused_out else _quantized(o, quant_out)
    if (tile is None and not fp8 and not segments and not ragged and not q_offset and window != _NO_WINDOW
            and cfg.gluon and cfg.attention_gluon_window and on_gpu):
        from gptoss_fp8.kernels import attention_window_ws as aw

        if (aw.window_ok(q, k, v, window) and (not quant_out or D * 2 == ACT_GROUP)
                and (rope is None or all(t.data_ptr() % 16 == 0 for t in rope))):  # (the tables by TMA too)
            return aw.window_attention_prefill(q, k, v, sinks, sm_scale, window, rope=rope, quant_out=quant_out,
                                               pair=cfg.attention_gluon_window_pair and window == 2 * aw.BLOCK_N)
    g = cfg.attention_gluon_tile
    if (tile is None and not fp8 and segments and cfg.attention_gluon_segments and not g.ordered
            and _ws_ok(q, k, v, False, window, rope, cfg)):
        from gptoss_fp8.kernels.attention_ws import ws_attention_prefill

        o = ws_attention_prefill(q, k, v, sinks, _out(q), sm_scale, block_n=g.block_n, stages=g.stages,
                                 warpgroups=g.warpgroups, q_in_registers=g.q_in_registers, deep=g.deep,
                                 exp=g.exp, rescale_threshold=g.rescale_threshold, tree=g.tree, sync=g.sync,
                                 segments=(cu_seqlens, k_starts, q_offsets, max_seqlen))
        return _quantized(o, quant_out)
    if (tile is None and not fp8 and not segments and (not q_offset or (cfg.attention_gluon_offset and not g.ordered))
            and _ws_ok(q, k, v, ragged, window, rope, cfg)):
        from gptoss_fp8.kernels.attention_ws import ws_attention_prefill

        o = ws_attention_prefill(q, k, v, sinks, _out(q), sm_scale, block_n=g.block_n, stages=g.stages,
                                 warpgroups=g.warpgroups, q_in_registers=g.q_in_registers, deep=g.deep,
                                 exp=g.exp, rescale_threshold=g.rescale_threshold, ordered=g.ordered,
                                 tree=g.tree, sync=g.sync, q_offset=q_offset)
        return _quantized(o, quant_out)
    tile = tile or cfg.prefill_tile(on_gpu, window != _NO_WINDOW, Hq // Hkv)
    BLOCK_M, BLOCK_N, pack = tile.block_m, tile.block_n, tile.pack
    assert (Hq // Hkv) % pack == 0, f"pack {pack} must divide the {Hq // Hkv} query heads per kv head"
    assert BLOCK_M % (pack * BLOCK_N) == 0, f"BLOCK_M {BLOCK_M} must be a multiple of pack {pack} x BLOCK_N {BLOCK_N}"
    if rope is not None:
        cos, sin = rope
        assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == D // 2, f"rope cos {cos.shape} sin {sin.shape}"
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert cos.shape[0] >= max_seqlen + q_offset, (
            f"rope tables cover {cos.shape[0]} positions < max_seqlen {max_seqlen} + q_offset {q_offset}")
        assert cos.device == q.device and sin.device == q.device
    else:
        cos = sin = sinks  # unused
    num_pid_m = cdiv(max_seqlen, BLOCK_M // pack)
    grid = (Hq // pack, B, num_pid_m) if segments else (Hq // pack, num_pid_m, B)
    fp8_args = {}
    if fp8 and segments:  # each chunk quantized as its own launch would (no rope: _check_segments)
        q8, sq, k8, sk, v8t, sv = fp8_plan.operands(q, k, v)
        k_starts = fp8_plan.k_starts8  # (its packed keys, 64-aligned)
        fp8_args = dict(QScaleBase=fp8_plan.q_scale_base, SV_STRIDE_B=sv[0].numel())
    elif fp8:
        # on CUDA the fused Triton kernels (kernels/attn_quant.py), the same roundings in one pass; a rope
        # rotates q there (one sequence on the GPU) or first (kernels/rope.py: ragged positions, the CPU)
        quant = attn_quant if on_gpu else attn_fp8
        if q_scale is not None:  # (made already: q_scale's rules)
            q8, sq = q, q_scale
        elif rope is not None and on_gpu and not ragged:
            q8, sq = attn_quant.quantize_qk(q, rope=rope, pos0=q_offset)
        else:
            if rope is not None:
                q = _rotated(q, cos, sin, cu_seqlens, q_offset)
            q8, sq = quant.quantize_qk(q)
        rope = None  # (q8 is rotated)
        k8, sk = quant.quantize_qk(k)
        v8t, sv = quant.quantize_v(v)  # [Hkv, D, T], keys contiguous
    if fp8:
        q, k, v = q8, k8, v8t.permute(2, 0, 1)  # v as a [T, Hkv, D] view: stride(0) == 1
        sq = sq * (sm_scale * LOG2E)
        fp8_args.update(Sq=sq, Sk=sk, Sv=(sv / P_SCALE).contiguous(), stride_sqh=sq.stride(0), stride_skh=sk.stride(0),
                        stride_vd=v8t.stride(1), FP8=2 if p_code == "lin" else 1)
    fused = quant_out and quant_out_fused(D, pack)
    # (fused: the kernel takes only the bf16 rows' dtype from ``out``; q may be e4m3 here)
    out = torch.empty((0 if fused else T, Hq, D), dtype=torch.bfloat16, device=q.device)
    if fused:  # o_proj's input written in place of the bf16 rows
        oq = torch.empty((T, Hq * D), dtype=FP8_DTYPE, device=q.device)
        os_ = torch.empty((T, Hq * D // ACT_GROUP), dtype=torch.float32, device=q.device)
        fp8_args.update(OutQ=oq, OutS=os_, stride_oq=oq.stride(0), stride_os=os_.stride(0), QUANT_OUT=True,
                        FP8_MAX_C=FP8_MAX, EPS=ACT_EPS)
    _attn_prefill_kernel[grid](
        q, k, v, sinks, out, cu_seqlens if ragged else sinks, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        sm_scale * LOG2E, window, num_pid_m, T, q_offset,
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=not on_gpu,
        ROPE_Q=rope is not None, RAGGED=ragged, PACK=pack, ONE_LOOP=tile.one_loop, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **({"maxnreg": tile.maxnreg} if tile.maxnreg and on_gpu else {}), **fp8_args,
        **(dict(KStarts=k_starts, QOffsets=q_offsets, SEGMENTS=True) if segments else {}),
    )
    return (oq, os_) if fused else _quantized(out, quant_out)


def quant_out_fused(head_dim: int, pack: int) -> bool:
    """Whether the Triton prefill kernel's tile of ``pack`` heads a program writes ``quant_out`` itself: each
    128-column group of an output row is 128 / head_dim whole heads of the tile."""
    return head_dim <= ACT_GROUP and ACT_GROUP % head_dim == 0 and pack % (ACT_GROUP // head_dim) == 0


def _out(q: torch.Tensor) -> torch.Tensor:
    """An empty bf16 output of q's shape [T, Hq, D] (q bf16, or e4m3 with ``q_scale``)."""
    return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)


def _quantized(out: torch.Tensor, quant_out: bool):
    """out [T, Hq, D], or with quant_out its act_quant as [T, Hq * D] rows (the kernels that write bf16 rows)."""
    if not quant_out:
        return out
    return act_quant(out.view(out.shape[0], -1))


def _check_segments(q, k, v, cu_seqlens, max_seqlen, k_starts, q_offsets, fp8, fp8_plan, rope) -> None:
    """``attention_prefill``'s chunks after cached keys (k_starts / q_offsets): what they take."""
    if k_starts is None or q_offsets is None:
        raise GptOssFp8Error("attention_prefill: k_starts and q_offsets come together (sequence b's keys at rows "
                             "k_starts[b].. of k / v, its queries at key positions q_offsets[b]..)")
    if cu_seqlens is None or max_seqlen is None:
        raise GptOssFp8Error("attention_prefill: k_starts / q_offsets need cu_seqlens (the query rows) and max_seqlen "
                             "(the longest chunk: reading it back would sync)")
    b = cu_seqlens.numel() - 1
    if fp8 and (fp8_plan is None or fp8_plan.segments != b or fp8_plan.q_rows != q.shape[0] or rope is not None):
        raise GptOssFp8Error(
            f"attention_prefill: fp8 chunks after cached keys (k_starts / q_offsets) take q rotated (rope None, got "
            f"{'a rope' if rope is not None else 'none'}) and fp8_plan, attn_quant.SegmentPlan of the same {b} chunks "
            f"of {q.shape[0]} rows (got {None if fp8_plan is None else (fp8_plan.segments, fp8_plan.q_rows)})")
    if not fp8 and fp8_plan is not None:
        raise GptOssFp8Error("attention_prefill: fp8_plan is for fp8=True")
    for name, t in (("k_starts", k_starts), ("q_offsets", q_offsets)):
        if t.dtype != torch.int32 or t.shape != (b,) or not t.is_contiguous() or t.device != q.device:
            raise GptOssFp8Error(f"attention_prefill: {name} {t.dtype} {tuple(t.shape)} on {t.device}: want contiguous "
                                 f"int32 [{b}] (one per sequence of cu_seqlens) on {q.device}")
    if k.shape != v.shape:
        raise GptOssFp8Error(f"attention_prefill: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if q.device.type == "cpu":  # host tensors: the rows each sequence reads, checked (on a GPU that would sync)
        n = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        end = k_starts.long() + q_offsets.long() + n
        if b and (int(k_starts.min()) < 0 or int(q_offsets.min()) < 0 or int(end.max()) > k.shape[0]
                  or int(n.max()) > max_seqlen):
            raise GptOssFp8Error(f"attention_prefill: the segments read key rows up to {int(end.max())} of k's "
                                 f"{k.shape[0]} (k_starts {k_starts.tolist()[:8]}, q_offsets {q_offsets.tolist()[:8]}, "
                                 f"max_seqlen {max_seqlen}): each needs k_starts + q_offsets + its rows <= k's rows")


def _rotated(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor | None,
             q_offset: int) -> torch.Tensor:
    """q [T, H, D] rotated by kernels/rope.py at its rows' positions: q_offset + t for one sequence,
    t - its sequence's start in a ragged batch (cu_seqlens)."""
    from gptoss_fp8.kernels.rope import rope_qk

    T = q.shape[0]
    pos = torch.arange(T, dtype=torch.int32, device=q.device)
    if cu_seqlens is not None:
        starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff(), output_size=T)
        pos = pos - starts
    return rope_qk(None, q, pos + q_offset, cos, sin)[1]


def _ws_ok(q, k, v, ragged, window, rope, cfg: KernelConfig) -> bool:
    """Whether the Gluon warp-specialized kernel takes this call: allowed by ``cfg``, one causal
    sequence, head_dim 64, no fused rope, [H, D] contiguous per row with 16-byte aligned rows, an
    sm_90 GPU."""
    if not (cfg.gluon and cfg.attention_gluon) or ragged or window != _NO_WINDOW or rope is not None or q.shape[-1] != 64:
        return False
    from gptoss_fp8.kernels import attention_ws

    if not attention_ws.supported(q.device):
        return False
    return all(t.stride(1) == t.shape[2] and (t.stride(0) * 2) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (q, k, v))
